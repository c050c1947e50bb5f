"""EP dispatch/combine in its three modes, on 8 CPU devices, against a float64 numpy model.

The experts here are elementwise stand-ins, f_e(x) = tanh(x * s_e) with a random vector s_e per
expert, so a row sent to the wrong rank, expert or token, or a lost or doubled route, changes the
result. The real layer's experts are exercised in test_parallel_patterns.py.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from moe_jax.parallel._compat import shard_map
from moe_jax.parallel.a2a import ragged_all_to_all, resolve_impl
from moe_jax.parallel.ep_common import EPGroup, SendQuant, check_routes
from moe_jax.parallel.ep_low_latency import ep_moe_low_latency, ll_dispatch
from moe_jax.parallel.ep_normal import ep_moe_normal, normal_dispatch
from moe_jax.parallel.ep_ring import ep_moe_ring
from moe_jax.parallel.packing import pack_rows, row_format, unpack_rows

E, H, K, M = 16, 256, 4, 7  # 7 tokens per rank: odd on purpose
AXES = ("a", "b")
N = 8


@functools.lru_cache(maxsize=None)
def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:N]).reshape(2, 4), AXES)


def _routes(seed: int, m_total: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m_total, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(m_total)]).astype(np.int32)
    ids[rng.random(m_total) < 0.2] = -1  # padding rows: no route at all
    ids[rng.random((m_total, K)) < 0.1] = -1  # single excluded routes
    w = rng.random((m_total, K)).astype(np.float32)
    s = (0.5 + rng.random((E, H))).astype(np.float32)
    return x, ids, w, s


def _np_quant(x: np.ndarray, g: int) -> np.ndarray:
    """Independent FP8 e4m3 per-token-group quantize -> dequantize (float64 result)."""
    xg = x.astype(np.float64).reshape(x.shape[0], -1, g)
    sf = np.maximum(np.abs(xg).max(-1, keepdims=True), 1e-4) / 448.0
    q = np.clip(xg / sf, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (q * sf).reshape(x.shape)


def _model(x, ids, w, s, quant: bool, keep=None) -> np.ndarray:
    xd = _np_quant(x, 128) if quant else x.astype(np.float64)
    out = np.zeros(x.shape, np.float64)
    for m in range(x.shape[0]):
        for j in range(K):
            e = ids[m, j]
            if e >= 0 and (keep is None or keep[m, j]):
                out[m] += w[m, j] * np.tanh(xd[m] * s[e])
    return out


def _expert_fn(s):
    def fn(xr, ids, w):
        se = jnp.asarray(s)[jnp.maximum(ids, 0)]  # (R, k, H)
        y = jnp.tanh(xr[:, None, :].astype(jnp.float32) * se)
        return jnp.einsum("rk,rkh->rh", jnp.where(ids >= 0, w, 0.0), y,
                          precision=jax.lax.Precision.HIGHEST)
    return fn


@functools.lru_cache(maxsize=None)
def _ep_fn(mode: str, quant: bool, capacity: int, seed: int):
    """Jitted EP step over all 8 devices for one (mode, quant, capacity); returns (y, dropped)."""
    group = EPGroup(AXES, N, E)
    q = SendQuant(128, False) if quant else None
    s = _routes(seed, N * M)[3]

    def body(x, ids, w):
        if mode in ("dense", "ragged_emulated"):
            y, d = ep_moe_normal(x, ids, w, group, _expert_fn(s), impl=mode, quant=q,
                                 combine_dtype=jnp.float32)
        elif mode == "low_latency":
            y, d = ep_moe_low_latency(x, ids, w, group, _expert_fn(s), capacity=capacity,
                                      quant=q, combine_dtype=jnp.float32)
        else:
            y, d = ep_moe_ring(x, ids, w, group, _expert_fn(s), quant=q, reduce_dtype=jnp.float32)
        return y, d[None]

    return jax.jit(shard_map(body, _mesh(), (P(AXES), P(AXES), P(AXES)), (P(AXES), P(AXES))))


# ragged_emulated with an FP8 wire is compared bitwise with dense below; low_latency with a bf16
# wire in the overflow test.
@pytest.mark.parametrize("mode,quant", [("dense", False), ("dense", True), ("ragged_emulated", False),
                                        ("low_latency", True), ("ring", False), ("ring", True)])
def test_ep_modes_match_float64_model(mode, quant):
    x, ids, w, s = _routes(0, N * M)
    y, dropped = _ep_fn(mode, quant, 128, 0)(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w))
    y = np.asarray(y)
    ref = _model(x, ids, w, s, quant)
    assert np.isfinite(y).all()
    assert not np.asarray(dropped).any()
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    assert not np.abs(y[(ids < 0).all(1)]).any()  # padding rows: nothing comes back


def test_ep_tokens_conserved_with_identity_experts():
    """f_e = identity, weights of each token summing to 1: every token must come back whole."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((N * M, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N * M)]).astype(np.int32)
    w = rng.random((N * M, K)).astype(np.float32)
    w /= w.sum(1, keepdims=True)
    group = EPGroup(AXES, N, E)

    def ident(xr, i, ww):
        return xr.astype(jnp.float32) * jnp.sum(jnp.where(i >= 0, ww, 0.0), axis=1, keepdims=True)

    for mode in ("dense", "low_latency"):
        def body(xx, ii, ww, mode=mode):
            if mode == "dense":
                return ep_moe_normal(xx, ii, ww, group, ident, impl="dense", quant=None,
                                     combine_dtype=jnp.float32)[0]
            return ep_moe_low_latency(xx, ii, ww, group, ident, capacity=M, quant=None,
                                      combine_dtype=jnp.float32)[0]
        f = jax.jit(shard_map(body, _mesh(), (P(AXES),) * 3, P(AXES)))
        y = np.asarray(f(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w)))
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6, err_msg=mode)


def _dest_pairs(ids: np.ndarray, e_loc: int) -> np.ndarray:
    """(M_total, n) bool: token has at least one route to rank d."""
    out = np.zeros((ids.shape[0], N), bool)
    for m, row in enumerate(ids):
        for e in row[row >= 0]:
            out[m, e // e_loc] = True
    return out


def test_normal_dispatch_receives_each_token_once_per_rank_and_never_padding():
    x, ids, w, _ = _routes(1, N * M)
    group = EPGroup(AXES, N, E)

    def body(xx, ii, ww):
        recv, _ = normal_dispatch(xx, ii, ww, group, impl="dense", quant=None)
        got = jnp.any(recv.topk_ids >= 0, axis=1)
        return (jnp.sum(got)[None], recv.num_recv_tokens_per_expert,
                jnp.sum(jnp.where(got[:, None], recv.x, 0.0), axis=0)[None])

    f = jax.jit(shard_map(body, _mesh(), (P(AXES),) * 3, (P(AXES), P(AXES), P(AXES))))
    rows, per_expert, xsum = (np.asarray(a) for a in f(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w)))
    pairs = _dest_pairs(ids, E // N)
    np.testing.assert_array_equal(rows, pairs.sum(0))  # one row per (token, rank) pair
    np.testing.assert_array_equal(per_expert, np.bincount(ids[ids >= 0], minlength=E))
    for d in range(N):  # the rows that arrived are exactly the tokens routed there
        np.testing.assert_allclose(xsum[d], x[pairs[:, d]].sum(0), rtol=1e-5, atol=1e-4)


def _ll_model_keep(ids: np.ndarray, c: int):
    """Routes delivered with c slots per peer: a rank sends its tokens to each peer in token order,
    the first c only. Returns (keep (M_total, K) bool, dropped routes per rank, rows per (src, dst))."""
    e_loc = E // N
    keep = np.zeros(ids.shape, bool)
    dropped = np.zeros(N, int)
    rows = np.zeros((N, N), int)
    for r in range(N):
        for m in range(r * M, (r + 1) * M):
            dests = {int(e) // e_loc for e in ids[m] if e >= 0}
            for d in dests:
                fits = rows[r, d] < c
                rows[r, d] += fits
                for j in range(K):
                    if ids[m, j] >= 0 and ids[m, j] // e_loc == d:
                        keep[m, j] = fits
                        dropped[r] += not fits
    return keep, dropped, rows


def test_low_latency_buffers_are_fixed_and_overflow_is_counted():
    x, ids, w, _ = _routes(2, N * M)
    group = EPGroup(AXES, N, E)
    c = 3

    def body(xx, ii, ww):
        recv, handle = ll_dispatch(xx, ii, ww, group, capacity=c, quant=None)
        got = jnp.any(recv.topk_ids >= 0, axis=1).reshape(N, c)  # block i: rows from rank i
        return jnp.sum(got, axis=1)[None], handle.dropped[None], recv.x.shape[0] * jnp.ones((1,), jnp.int32)

    f = jax.jit(shard_map(body, _mesh(), (P(AXES),) * 3, (P(AXES),) * 3))
    per_src, dropped, n_rows = (np.asarray(a) for a in f(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w)))
    _, want_drop, rows = _ll_model_keep(ids, c)
    assert (n_rows == N * c).all()  # n * capacity arrival rows, whatever M
    assert want_drop.sum() > 0  # the case must overflow
    np.testing.assert_array_equal(dropped, want_drop)
    np.testing.assert_array_equal(per_src, rows.T)  # [receiver d, source i]


def test_low_latency_overflow_drops_only_the_counted_routes():
    x, ids, w, s = _routes(4, N * M)
    c = 2
    y, dropped = _ep_fn("low_latency", False, c, 4)(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w))
    keep, want_drop, _ = _ll_model_keep(ids, c)
    assert want_drop.sum() > 0
    np.testing.assert_array_equal(np.asarray(dropped), want_drop)
    np.testing.assert_allclose(np.asarray(y), _model(x, ids, w, s, False, keep), rtol=1e-5, atol=1e-5)


def test_ragged_emulated_equals_dense_bitwise():
    x, ids, w, _ = _routes(5, N * M)
    group = EPGroup(AXES, N, E)
    outs = {}
    for impl in ("dense", "ragged_emulated"):
        def body(xx, ii, ww, impl=impl):
            recv, _ = normal_dispatch(xx, ii, ww, group, impl=impl, quant=SendQuant(128, True))
            return recv.x, recv.topk_ids, recv.topk_weights
        f = jax.jit(shard_map(body, _mesh(), (P(AXES),) * 3, (P(AXES),) * 3))
        outs[impl] = [np.asarray(a) for a in f(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w))]
    for a, b in zip(outs["dense"], outs["ragged_emulated"]):
        np.testing.assert_array_equal(a.view(np.uint8) if a.dtype.itemsize == 1 else a, b)


def test_ragged_emulation_follows_ragged_all_to_all_semantics():
    """Random offsets (with internal padding) and sizes against a numpy model of the documented
    semantics: slice d of rank i lands at output_offsets[d] of rank d."""
    rng = np.random.default_rng(6)
    s_rows, r_rows, chunk = 40, 48, 5
    sizes = rng.integers(0, chunk + 1, (N, N)).astype(np.int32)  # sizes[i, d]: rank i -> rank d
    in_off = np.zeros((N, N), np.int32)
    for i in range(N):
        at = 0
        for d in range(N):
            at += rng.integers(0, 2)  # internal padding
            in_off[i, d] = at
            at += sizes[i, d]
    out_off = np.zeros((N, N), np.int32)  # out_off[i, d]: where rank i's slice sits on rank d
    for d in range(N):
        at = 0
        for i in range(N):
            out_off[i, d] = at
            at += sizes[i, d]
    operand = rng.standard_normal((N, s_rows, 3)).astype(np.float32)
    init = rng.standard_normal((N, r_rows, 3)).astype(np.float32)
    want = init.copy()
    for i in range(N):
        for d in range(N):
            n_ = sizes[i, d]
            want[d, out_off[i, d]:out_off[i, d] + n_] = operand[i, in_off[i, d]:in_off[i, d] + n_]

    def body(op, out, io, ss, oo, rs):
        return ragged_all_to_all(op[0], out[0], io[0], ss[0], oo[0], rs[0], AXES,
                                 impl="ragged_emulated", chunk=chunk)[None]

    f = jax.jit(shard_map(body, _mesh(), (P(AXES),) * 6, P(AXES)))
    got = f(operand, init, in_off, sizes, out_off, np.ascontiguousarray(sizes.T))
    np.testing.assert_array_equal(np.asarray(got), want)


def _collectives(text: str) -> dict[str, int]:
    names = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")
    c = {n: len(re.findall(rf"stablehlo\.{n}\b", text)) for n in names}
    c["ragged_all_to_all"] = len(re.findall(r"@ragged_all_to_all\b", text))
    return c


def test_ragged_path_lowers_to_two_ragged_all_to_alls_and_one_count_exchange():
    """The GPU path cannot run on XLA:CPU, but its lowering can be inspected here."""
    x, ids, w, s = _routes(0, N * M)
    group = EPGroup(AXES, N, E)

    def body(xx, ii, ww):
        return ep_moe_normal(xx, ii, ww, group, _expert_fn(s), impl="ragged", quant=None,
                             combine_dtype=jnp.bfloat16)[0]

    text = jax.jit(shard_map(body, _mesh(), (P(AXES),) * 3, P(AXES))).lower(x, ids, w).as_text()
    assert _collectives(text) == dict(all_reduce=0, all_gather=0, reduce_scatter=0, all_to_all=1,
                                      collective_permute=0, ragged_all_to_all=2)


@pytest.mark.gpu
def test_ragged_all_to_all_on_gpu_matches_dense():
    devs = [d for d in jax.devices() if d.platform == "gpu"]
    n = len(devs)
    mesh = Mesh(np.array(devs), ("ep",))
    e = 4 * n
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n * M, H)).astype(np.float32)
    ids = np.stack([rng.choice(e, min(K, e), replace=False) for _ in range(n * M)]).astype(np.int32)
    ids[::3] = -1
    w = rng.random(ids.shape).astype(np.float32)
    s = (0.5 + rng.random((e, H))).astype(np.float32)
    group = EPGroup(("ep",), n, e)
    out = {}
    for impl in ("dense", "ragged"):
        def body(xx, ii, ww, impl=impl):
            return ep_moe_normal(xx, ii, ww, group, _expert_fn(s), impl=impl, quant=SendQuant(128, False),
                                 combine_dtype=jnp.float32)[0]
        f = jax.jit(shard_map(body, mesh, (P("ep"),) * 3, P("ep")))
        out[impl] = np.asarray(f(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w)))
    np.testing.assert_array_equal(out["ragged"], out["dense"])


def test_packing_roundtrip_is_bitwise():
    rng = np.random.default_rng(8)
    a = jnp.asarray(rng.standard_normal((5, 7)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((5, 3)), jnp.float8_e4m3fn)
    c = jnp.asarray(rng.integers(-9, 9, (5, 2)), jnp.int32)
    d = jnp.asarray(rng.standard_normal((5,)), jnp.float32)
    fmt = row_format(a=a, b=b, c=c, d=d)
    buf = pack_rows(fmt, a=a, b=b, c=c, d=d)
    assert buf.shape == (5, 7 * 2 + 3 + 2 * 4 + 4) == (5, fmt.nbytes) and buf.dtype == jnp.uint8
    got = unpack_rows(buf, fmt)
    for name, want in (("a", a), ("b", b), ("c", c), ("d", d[:, None])):
        np.testing.assert_array_equal(np.asarray(got[name]).view(np.uint8), np.asarray(want).view(np.uint8))


def test_bad_inputs():
    with pytest.raises(ValueError, match="num_experts=12 must be divisible by the EP size 8"):
        EPGroup(AXES, 8, 12)
    with pytest.raises(ValueError, match="topk_weights: expected shape"):
        check_routes(jnp.zeros((3, H)), jnp.zeros((3, K), jnp.int32), jnp.zeros((3, K + 1)))
    with pytest.raises(ValueError, match=r"topk_ids: expected \(3, top_k\)"):
        check_routes(jnp.zeros((3, H)), jnp.zeros((4, K), jnp.int32), jnp.zeros((4, K)))
    with pytest.raises(TypeError, match="topk_ids: expected int32"):
        check_routes(jnp.zeros((3, H)), jnp.zeros((3, K), jnp.float32), jnp.zeros((3, K)))
    with pytest.raises(ValueError, match="'ragged' needs a GPU or TPU mesh"):
        resolve_impl("ragged", "cpu")
    with pytest.raises(ValueError, match="a2a_impl: expected one of"):
        resolve_impl("nccl", "gpu")
    assert resolve_impl("auto", "gpu") == "ragged" and resolve_impl("auto", "cpu") == "dense"
    with pytest.raises(ValueError, match="pack_rows: expected fields"):
        pack_rows(row_format(a=jnp.zeros((2, 3))), b=jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"buf: expected \(\.\.\., 12\) uint8"):
        unpack_rows(jnp.zeros((2, 11), jnp.uint8), row_format(a=jnp.zeros((2, 3))))
    group = EPGroup(AXES, N, E)
    xs, ks = jax.ShapeDtypeStruct((M, H), jnp.float32), jax.ShapeDtypeStruct((M, K), jnp.int32)
    ws = jax.ShapeDtypeStruct((M, K), jnp.float32)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank: expected a positive int, got 0"):
        jax.eval_shape(lambda x, i, w: ll_dispatch(x, i, w, group, capacity=0, quant=None), xs, ks, ws)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank: expected a positive int, "
                                         "got True"):
        jax.eval_shape(lambda x, i, w: ll_dispatch(x, i, w, group, capacity=True, quant=None), xs, ks, ws)
    with pytest.raises(ValueError, match=r"slots: the ragged exchange is exact \(slots = M = 7\), got 3"):
        jax.eval_shape(lambda x, i, w: normal_dispatch(x, i, w, group, impl="ragged", quant=None, slots=3),
                       xs, ks, ws)
