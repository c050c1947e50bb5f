"""The ops' index contracts (custom_calls/contracts.py): canonicalization against independent numpy
models, the checked mode's messages (argument, index, value) through the public ops and the layer,
no check traced when it is off, the Triton backend under Triton's interpreter (in a subprocess:
TRITON_INTERPRET must be set before triton is imported), and DeepGEMM on a GPU (`gpu` marker).

Reference vs accelerated agreement on violating inputs for every registered backend is in
tests/test_conformance.py ("violations" cases)."""

from __future__ import annotations

import os
import re
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import custom_calls as cc
from custom_calls.backends import split_arrays
import layouts
import moe_jax as mj
from custom_calls import ActivationSpec
from layouts import gemm_format
from moe_jax.random_init import _quantize_checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_conformance import np_canonical_m_indices, np_canonical_src2dst  # noqa: E402
from interpreter_script import run_under_interpreter  # noqa: E402


_CHECKED: dict = {}  # fn -> its checked wrapper: calls with the same shapes reuse one compiled program


def _error(fn, *args, **kwargs) -> str | None:
    """The message of the first failed check of fn under `cc.checked` (None when all pass)."""
    if fn not in _CHECKED:
        _CHECKED[fn] = cc.checked(fn, throw=False)
    err, _ = _CHECKED[fn](*args, **kwargs)
    msg = err.get()
    return None if msg is None else msg.removesuffix(" (`check` failed)")


def _primitives(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


# ------------------------------------------------------------------ canonicalization


def _random_m_indices(rng, nb: int, align: int, g: int) -> np.ndarray:
    """Well-formed blocks mixed with every kind of broken one."""
    mi = np.full(nb * align, -1, np.int32)
    for b in range(nb):
        blk = mi[b * align:(b + 1) * align]
        kind = rng.integers(0, 7)
        c = int(rng.integers(1, align + 1))
        e = int(rng.integers(0, g))
        blk[:c] = e
        if kind == 1:
            blk[rng.integers(0, align)] = (e + 1) % g  # another expert
        elif kind == 2:
            blk[0] = -1  # padding before rows (or a lone -1 at the head)
        elif kind == 3:
            blk[rng.integers(0, align)] = g + int(rng.integers(0, 5))  # no such expert
        elif kind == 4:
            blk[rng.integers(0, align)] = -2 - int(rng.integers(0, 5))  # below -1
        elif kind == 5:
            blk[:] = -1
    return mi


@pytest.mark.parametrize("align,g", [(128, 5), (8, 2), (4, 7)])
def test_canonical_m_indices_matches_the_model(align, g):
    rng = np.random.default_rng(align + g)
    mi = _random_m_indices(rng, 40, align, g)
    got = np.asarray(jax.jit(cc.canonical_m_indices, static_argnums=(1, 2))(jnp.asarray(mi), g, align))
    want = np_canonical_m_indices(mi, g, align)
    np.testing.assert_array_equal(got, want)
    assert (want == -1).sum() > (mi == -1).sum()  # the case holds broken blocks
    assert np.any(want >= 0)  # and well-formed ones, which stay as they are


def test_canonical_m_indices_keeps_dispatch_output():
    from moe_jax.dispatch import dispatch_contig

    rng = np.random.default_rng(3)
    ids = np.argsort(rng.random((77, 9)), axis=1)[:, :3].astype(np.int32)
    ids[rng.random(ids.shape) < 0.1] = -1
    d = dispatch_contig(jnp.asarray(ids), num_local_experts=9, alignment=128)
    np.testing.assert_array_equal(np.asarray(cc.canonical_m_indices(d.m_indices, 9, 128)), np.asarray(d.m_indices))


def test_canonical_masked_m_and_src2dst():
    np.testing.assert_array_equal(np.asarray(cc.canonical_masked_m(jnp.asarray([-4, 0, 77, 128, 129, 1 << 30],
                                                                               jnp.int32), 128)),
                                  [0, 0, 77, 128, 128, 128])
    rng = np.random.default_rng(5)
    s = rng.integers(-6, 60, (31, 4)).astype(np.int32)  # out-of-range entries and repeats
    for distinct in (True, False):
        got = np.asarray(cc.canonical_src2dst(jnp.asarray(s), 50, distinct=distinct))
        np.testing.assert_array_equal(got, np_canonical_src2dst(s, 50, distinct))
    assert len(np.unique(s[(s >= 0) & (s < 50)])) < np.sum((s >= 0) & (s < 50))  # repeats present


def _route_ops(assume_canonical: bool, s):
    """The permute (masked, 2 slabs of 128 rows) and un-permute ops on a (13, 3) src2dst `s`."""
    x = jax.random.normal(jax.random.key(4), (13, 256), jnp.bfloat16)
    d = jax.random.normal(jax.random.key(5), (256, 256), jnp.bfloat16)
    w = jax.random.uniform(jax.random.key(6), (13, 3), jnp.float32)
    lhs, scale = cc.permute_masked(x, s, num_groups=2, m_pad=128, recipe="fp8_block", arch=90,
                                   assume_canonical=assume_canonical)
    out = cc.unpermute(d, s, w, routed_scaling_factor=2.0, assume_canonical=assume_canonical)
    return lhs, scale, out


def test_assume_canonical_skips_the_pass_and_keeps_the_result():
    """On a src2dst that keeps the contract (the dispatcher's), assume_canonical gives the same bits
    without the canonicalization pass: the permute's scatter of first claims is gone from the program."""
    from moe_jax.dispatch import dispatch_masked

    rng = np.random.default_rng(9)
    ids = np.argsort(rng.random((13, 2)), axis=1).astype(np.int32)
    ids = np.concatenate([ids, np.full((13, 1), -1, np.int32)], axis=1)  # a route to nowhere per token
    s = dispatch_masked(jnp.asarray(ids), num_local_experts=2, m_pad=128, num_experts_global=2).src2dst
    for a, b in zip(_route_ops(False, s), _route_ops(True, s)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))

    def scatters(assume):
        jaxpr = jax.make_jaxpr(lambda t: _route_ops(assume, t))(s).jaxpr
        return sum(str(e).count("scatter") for e in jaxpr.eqns)

    assert scatters(True) < scatters(False)


@pytest.mark.parametrize("layout", ["contig", "masked"])
def test_layer_runs_no_index_canonicalization(layout, monkeypatch):
    """The dispatcher's m_indices / masked_m / src2dst keep the contracts by construction, so the
    layer's grouped GEMMs, activation and (un)permute run no canonicalization pass; the ops called
    directly still canonicalize (same bits as the layer for canonical indices)."""
    config = mj.MoEConfig.deepseek_v3().scaled(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128)
    params = mj.prepare_params(mj.init_params(jax.random.key(0), config), config)
    x = jax.random.normal(jax.random.key(1), (19, 256), jnp.bfloat16)
    want = mj.moe_forward(x, params, config, layout=layout)

    def refuse(*args, **kwargs):
        raise AssertionError("a canonicalization pass on the layer's path")

    for name in ("canonical_m_indices", "canonical_masked_m", "canonical_src2dst"):
        monkeypatch.setattr(cc.contracts, name, refuse)
    got = jax.jit(mj.moe_forward, static_argnames=("config", "layout"))(x, params, config=config, layout=layout)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(AssertionError, match="canonicalization pass"):  # the op alone still canonicalizes
        cc.m_grouped_gemm_masked(jax.random.normal(jax.random.key(2), (2, 128, 256), jnp.bfloat16),
                                 jax.random.normal(jax.random.key(3), (2, 64, 256), jnp.bfloat16),
                                 jnp.ones((2,), jnp.int32), expected_m=1, recipe="bf16", arch=90)


def test_assume_canonical_on_a_violating_src2dst_stays_in_bounds():
    """A broken promise gives unspecified values, never an access outside a buffer: repeats and
    rows outside [-1, num_rows) still run, and every token whose routes are all in range and
    distinct gets the canonical result."""
    s = np.tile(np.array([[0, 1, 2]], np.int32), (13, 1)) + 3 * np.arange(13, dtype=np.int32)[:, None]
    s[4] = [300, -9, 5]  # outside the rows, below -1, and row 5 again (token 1 named it first)
    lhs, _, out = _route_ops(True, jnp.asarray(s))
    _, _, want = _route_ops(False, jnp.asarray(s))
    assert lhs.shape == (2, 128, 256)
    clean = np.ones(13, bool)
    clean[[1, 4]] = False
    np.testing.assert_array_equal(np.asarray(out)[clean], np.asarray(want)[clean])


# ------------------------------------------------------------------ checked mode: messages


def _gemm_operands(rng, recipe="fp8_block", arch=90, g=3, m_cap=512, n=128, k=256):
    fmt = gemm_format(recipe, arch)
    x = jnp.asarray(rng.standard_normal((m_cap, k)), jnp.bfloat16)
    lhs, lhs_scale = fmt.quantize_lhs(x)
    w = jnp.asarray(rng.standard_normal((g, n, k)) * 0.05, jnp.float32)
    values, scale = _quantize_checkpoint(w, recipe)
    rhs, rhs_scale = layouts.prepare_expert_weights(values, scale, recipe=recipe, arch=arch)
    return lhs, lhs_scale, rhs, rhs_scale


def _gemm_contig(lhs, rhs, mi, lhs_scale, rhs_scale, recipe="fp8_block", arch=90, **kw):
    return cc.m_grouped_gemm_contig(lhs, rhs, mi, lhs_scale=lhs_scale, rhs_scale=rhs_scale, recipe=recipe,
                                    arch=arch, debug_checks=True, **kw)


def _well_formed(m_cap=512):
    mi = np.full(m_cap, -1, np.int32)
    mi[0:128], mi[128:150], mi[256:400] = 0, 2, 1
    return mi


@pytest.mark.parametrize("row,value,message", [
    (130, 1, r"m_indices\[130\] = 1 differs from m_indices\[128\] = 2 inside alignment block 1 \(rows 128\.\.255\)"),
    (300, 7, r"m_indices\[300\] = 7 is outside \[-1, 3\) \(alignment block 2, rows 256\.\.383\)"),
    (5, -3, r"m_indices\[5\] = -3 is outside \[-1, 3\) \(alignment block 0, rows 0\.\.127\)"),
    (160, 2, r"m_indices\[160\] = 2 follows padding \(-1\) inside alignment block 1 \(rows 128\.\.255\)"),
])
def test_m_indices_violations_are_named(row, value, message):
    rng = np.random.default_rng(row)
    lhs, ls, rhs, rs = _gemm_operands(rng)
    mi = _well_formed()
    assert _error(_gemm_contig, lhs, rhs, jnp.asarray(mi), ls, rs) is None
    mi[row] = value
    msg = _error(_gemm_contig, lhs, rhs, jnp.asarray(mi), ls, rs)
    assert msg is not None and re.search(message, msg), msg
    with pytest.raises(checkify.JaxRuntimeError, match=message):
        cc.checked(_gemm_contig)(lhs, rhs, jnp.asarray(mi), ls, rs)


def test_checked_results_equal_unchecked():
    rng = np.random.default_rng(1)
    lhs, ls, rhs, rs = _gemm_operands(rng)
    mi = jnp.asarray(_well_formed())
    kw = dict(lhs_scale=ls, rhs_scale=rs, recipe="fp8_block", arch=90)
    want = cc.m_grouped_gemm_contig(lhs, rhs, mi, **kw)
    got = cc.checked(lambda *a: cc.m_grouped_gemm_contig(*a, **kw, debug_checks=True))(lhs, rhs, mi)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # under jit too, with the error as a value
    err, out = jax.jit(cc.checked(lambda *a: cc.m_grouped_gemm_contig(*a, **kw, debug_checks=True),
                                  throw=False))(lhs, rhs, mi)
    assert err.get() is None
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def test_checked_traces_once_per_static_signature():
    traces = []

    def scaled_positive(x, factor, *, label):
        traces.append((factor, label))
        checkify.check(jnp.all(x > 0), f"{label}: x must be positive")
        return x * factor

    f = cc.checked(scaled_positive)
    rng = np.random.default_rng(7)
    for _ in range(3):  # fresh arrays of one shape: one trace
        x = jnp.asarray(rng.uniform(0.5, 2.0, (5, 3)), jnp.float32)
        np.testing.assert_array_equal(np.asarray(f(x, 3, label="a")), np.asarray(x) * 3)
    assert traces == [(3, "a")]
    with pytest.raises(checkify.JaxRuntimeError, match="a: x must be positive"):  # the same program
        f(x.at[2, 1].set(-1.0), 3, label="a")
    assert len(traces) == 1
    # another static value, or an equal one of another type (3.0 == 3 but promotes int x to float)
    f(x, 3, label="b")
    xi = x.astype(jnp.int32) + 1
    assert f(xi, 3.0, label="a").dtype == jnp.float32 and type(traces[-1][0]) is float
    assert f(xi, 3, label="a").dtype == jnp.int32 and type(traces[-1][0]) is int
    assert [t[1] for t in traces] == ["a", "b", "a", "a"]

    class Unhashable:
        __hash__ = None

        def __rmul__(self, other):
            return other * 2

    f(x, Unhashable(), label="u")
    np.testing.assert_array_equal(np.asarray(f(x, Unhashable(), label="u")), np.asarray(x) * 2)
    assert len(traces) == 6  # nothing to look the program up by: traced on each call, still right


def test_split_arrays_keeps_no_array_of_the_call():
    x = jnp.arange(4.0)
    split = split_arrays(lambda a, n, *, b: a * n + b, (x, 2), {"b": x},
                         lambda v: isinstance(v, jax.Array))
    assert split.where == (0, 2) and split.arrays[0] is x and split.arrays[1] is x
    held = [c.cell_contents for c in split.run.__closure__]
    held += [leaf for c in held if isinstance(c, (tuple, list)) for leaf in c]
    assert not any(isinstance(v, jax.Array) for v in held)
    np.testing.assert_array_equal(np.asarray(split.run(x + 1, x)), np.asarray((x + 1) * 2 + x))
    hash(split.static_key)


def test_non_finite_weight_scales_are_named_by_expert():
    rng = np.random.default_rng(2)
    lhs, ls, rhs, rs = _gemm_operands(rng)
    rs = rs.at[1, 0, 0].set(jnp.inf)
    msg = _error(_gemm_contig, lhs, rhs, jnp.asarray(_well_formed()), ls, rs)
    assert msg is not None and msg.startswith("rhs_scale has non-finite values in experts [1]"), msg
    # arch 100: packed UE8M0 words, 0xFF is NaN
    lhs, ls, rhs, rs = _gemm_operands(rng, "mxfp8", 100)
    rs = rs.at[2].set(jnp.int32(0x7F7F7FFF))
    msg = _error(_gemm_contig, lhs, rhs, jnp.asarray(_well_formed()), ls, rs, recipe="mxfp8", arch=100)
    assert msg is not None and msg.startswith("rhs_scale has non-finite (0xFF UE8M0) values in experts [2]"), msg
    # bf16 weights themselves
    lhs, ls, rhs, rs = _gemm_operands(rng, "bf16", 90)
    rhs = rhs.at[0, 5, 5].set(jnp.nan).at[2, 0, 1].set(-jnp.inf)
    msg = _error(_gemm_contig, lhs, rhs, jnp.asarray(_well_formed()), ls, rs, recipe="bf16", arch=90)
    assert msg is not None and msg.startswith("rhs has non-finite values in experts [0, 2]"), msg


def test_masked_m_violations_are_named():
    rng = np.random.default_rng(4)
    fmt = gemm_format("bf16", 90)
    lhs, _ = fmt.quantize_lhs(jnp.asarray(rng.standard_normal((3, 128, 128)), jnp.bfloat16))
    rhs = jnp.asarray(rng.standard_normal((3, 64, 128)), jnp.bfloat16)

    def gemm(mm):
        return cc.m_grouped_gemm_masked(lhs, rhs, mm, expected_m=8, recipe="bf16", arch=90, debug_checks=True)

    assert _error(gemm, jnp.asarray([0, 128, 5], jnp.int32)) is None
    assert _error(gemm, jnp.asarray([0, 129, 5], jnp.int32)) == "masked_m[1] = 129 is outside [0, m_pad=128]"
    assert _error(gemm, jnp.asarray([0, 1, -2], jnp.int32)) == "masked_m[2] = -2 is outside [0, m_pad=128]"

    def act(mm):
        return cc.activation_quant_masked(jnp.ones((3, 128, 256), jnp.bfloat16), mm, act=ActivationSpec(),
                                          recipe="fp8_block", arch=90, debug_checks=True)

    assert _error(act, jnp.asarray([200, 1, 2], jnp.int32)) == "masked_m[0] = 200 is outside [0, m_pad=128]"


def test_src2dst_violations_and_non_finite_tokens_are_named():
    x = jnp.asarray(np.random.default_rng(6).standard_normal((6, 128)), jnp.bfloat16)
    s = np.arange(12, dtype=np.int32).reshape(6, 2)

    def permute(x, s):
        return cc.permute_contig(x, s, num_rows=128, recipe="fp8_block", arch=90, debug_checks=True)

    assert _error(permute, x, jnp.asarray(s)) is None
    bad = s.copy()
    bad[4, 1] = 128
    assert _error(permute, x, jnp.asarray(bad)) == "src2dst[4, 1] = 128 is outside [-1, num_rows=128)"
    bad = s.copy()
    bad[5, 0] = 3
    assert _error(permute, x, jnp.asarray(bad)) == ("src2dst[5, 0] = 3 names the same row as src2dst[1, 1] "
                                                    "(rows must be distinct)")
    assert (_error(permute, x.at[jnp.asarray([1, 4])].set(jnp.inf), jnp.asarray(s))
            == "x has non-finite values in tokens [1, 4]")
    many = jnp.full((40, 128), jnp.nan, jnp.bfloat16)
    assert (_error(permute, many, jnp.zeros((40, 2), jnp.int32) - 1)
            == "x has non-finite values in tokens [0, 1, 2, 3, 4, 5, 6, 7] (first 8 of 40)")

    def permute_masked(x, s):
        return cc.permute_masked(x, s, num_groups=2, m_pad=128, recipe="bf16", arch=90, debug_checks=True)

    bad = s.copy()
    bad[2, 0] = -2
    assert _error(permute_masked, x, jnp.asarray(bad)) == "src2dst[2, 0] = -2 is outside [-1, num_rows=256)"

    d = jnp.ones((10, 64), jnp.bfloat16)
    w = jnp.ones((6, 2), jnp.float32)

    def unpermute(s, w):
        return cc.unpermute(d, s, w, debug_checks=True)

    ok = np.where(s < 10, s, -1)
    assert _error(unpermute, jnp.asarray(ok), w) is None
    assert _error(unpermute, jnp.asarray(s), w) == "src2dst[5, 0] = 10 is outside [-1, num_rows=10)"
    assert (_error(unpermute, jnp.asarray(ok), w.at[3, 1].set(jnp.nan))
            == "topk_weights has non-finite values in tokens [3]")


# ------------------------------------------------------------------ checks off: nothing traced


def _op_calls():
    rng = np.random.default_rng(7)
    lhs, ls, rhs, rs = _gemm_operands(rng)
    mi = jnp.asarray(_well_formed())
    x = jnp.ones((6, 128), jnp.bfloat16)
    s = jnp.asarray(np.arange(12, dtype=np.int32).reshape(6, 2))
    mm = jnp.asarray([1, 2, 3], jnp.int32)
    q = jnp.ones((3, 128, 256), jnp.float8_e4m3fn)
    qs = jnp.ones((3, 2, 128), jnp.float32)
    return {
        "m_grouped_gemm_contig": lambda dc: cc.m_grouped_gemm_contig(
            lhs, rhs, mi, lhs_scale=ls, rhs_scale=rs, recipe="fp8_block", arch=90, debug_checks=dc),
        "m_grouped_gemm_masked": lambda dc: cc.m_grouped_gemm_masked(
            q, rhs, mm, expected_m=2, lhs_scale=qs, rhs_scale=rs, recipe="fp8_block", arch=90, debug_checks=dc),
        "permute_contig": lambda dc: cc.permute_contig(x, s, num_rows=128, recipe="fp8_block", arch=90,
                                                       debug_checks=dc),
        "permute_masked": lambda dc: cc.permute_masked(x, s, num_groups=1, m_pad=128, recipe="fp8_block", arch=90,
                                                       debug_checks=dc),
        "activation_quant_masked": lambda dc: cc.activation_quant_masked(
            jnp.ones((3, 128, 256), jnp.bfloat16), mm, act=ActivationSpec(), recipe="fp8_block", arch=90,
            debug_checks=dc),
        "unpermute": lambda dc: cc.unpermute(jnp.ones((12, 64), jnp.bfloat16), s, jnp.ones((6, 2)),
                                             debug_checks=dc),
    }


@pytest.mark.parametrize("op", sorted(_op_calls()))
def test_checks_off_trace_no_check(op):
    call = _op_calls()[op]
    off = jax.make_jaxpr(lambda: call(False))()
    assert "check" not in _primitives(off.jaxpr)
    # on: the checks are there (functionalized by checkify), and staging them unfunctionalized is
    # refused rather than silently dropped
    on = jax.make_jaxpr(checkify.checkify(lambda: call(True)))()
    assert len(on.jaxpr.eqns) > len(off.jaxpr.eqns)
    with pytest.raises(Exception, match="checkify"):
        jax.jit(lambda: call(True))()


def test_checks_off_adds_only_index_work():
    """Off, the canonicalization reads the small index arrays only: no op of the traced program
    touches an (M_cap, K) or (M_cap, N) array beyond what the implementation itself does."""
    rng = np.random.default_rng(8)
    lhs, ls, rhs, rs = _gemm_operands(rng)
    mi = jnp.asarray(_well_formed())
    kw = dict(lhs_scale=ls, rhs_scale=rs, recipe="fp8_block", arch=90)
    full = jax.make_jaxpr(lambda m: cc.m_grouped_gemm_contig(lhs, rhs, m, **kw))(mi).jaxpr
    (impl,) = [e for e in full.eqns if set(e.outvars) & set(full.outvars)]  # the implementation's call
    added = [e for e in full.eqns if e is not impl]
    assert 0 < len(added) < 40
    for eqn in added:
        for v in list(eqn.invars) + list(eqn.outvars):
            aval = getattr(v, "aval", None)
            assert aval is None or np.prod(aval.shape, dtype=int) <= mi.shape[0], (eqn.primitive.name, aval)


# ------------------------------------------------------------------ the layer


def _layer(layout):
    cfg = mj.MoEConfig(num_experts=6, top_k=2, hidden_size=128, intermediate_size=128, recipe="fp8_block",
                       layout=layout)
    params = mj.prepare_params(mj.init_params(jax.random.key(0), cfg), cfg)
    x = jax.random.normal(jax.random.key(1), (3, 7, 128), jnp.bfloat16)
    return cfg, params, x


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["contig", "masked"])
def test_layer_checked_mode(layout):
    cfg, params, x = _layer(layout)
    fwd = jax.jit(mj.moe_forward, static_argnames=("config", "debug_checks"))
    want = fwd(x, params, config=cfg)
    layer = cc.checked(lambda x, p: mj.moe_forward(x, p, cfg, debug_checks=True), throw=False)
    err, got = layer(x, params)
    assert err.get() is None
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    bad = x.at[1, 3].set(jnp.nan).at[2, 0, 5].set(jnp.inf)  # flattened tokens 10 and 14
    err, _ = layer(bad, params)  # the program compiled for x
    with pytest.raises(checkify.JaxRuntimeError, match=r"x has non-finite values in tokens \[10, 14\]"):
        err.throw()
    off = jax.make_jaxpr(lambda x, p: mj.moe_forward(x, p, cfg))(x, params)
    assert "check" not in _primitives(off.jaxpr)
    ids = jnp.zeros((3, 7, 2), jnp.int32)
    with pytest.raises(checkify.JaxRuntimeError, match=r"x has non-finite values in tokens \[10, 14\]"):
        cc.checked(lambda x: mj.routed_experts(x, ids, jnp.ones((3, 7, 2)), params, cfg, debug_checks=True))(bad)


def _fused_operands(rng, m=5, h=256, i=128, e=4, k=3):
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    w13, s13 = layouts.quantize_fp8_per_block(jnp.asarray(rng.standard_normal((e, 2 * i, h)) * 0.05, jnp.float32), 128)
    w2, s2 = layouts.quantize_fp8_per_block(jnp.asarray(rng.standard_normal((e, h, i)) * 0.05, jnp.float32), 128)
    return x, jnp.asarray(rng.uniform(0.1, 1.0, (m, k)), jnp.float32), w13, s13, w2, s2


def np_canonical_topk_ids(ids: np.ndarray, e: int) -> np.ndarray:
    out = np.where((ids >= 0) & (ids < e), ids, -1)
    for t in range(out.shape[0]):
        seen = set()
        for j in range(out.shape[1]):
            if out[t, j] in seen:
                out[t, j] = -1
            elif out[t, j] >= 0:
                seen.add(out[t, j])
    return out


def test_canonical_topk_ids_matches_the_model():
    rng = np.random.default_rng(12)
    ids = rng.integers(-3, 7, (200, 5)).astype(np.int32)  # out of range and repeats, -1 too
    np.testing.assert_array_equal(np.asarray(cc.canonical_topk_ids(jnp.asarray(ids), 5)),
                                  np_canonical_topk_ids(ids, 5))


@pytest.mark.parametrize("ids,message", [
    ([[0, 1, 2], [3, -1, 2], [1, 3, 1], [2, 0, 2], [-1, -1, -1]],
     "topk_ids[2, 2] = 1 repeats topk_ids[2, 0] (a token names each expert at most once)"),
    ([[0, 1, 2], [3, 3, 3], [1, 2, 0], [0, 1, 2], [0, 1, 2]],
     "topk_ids[1, 1] = 3 repeats topk_ids[1, 0] (a token names each expert at most once)"),
    ([[0, 1, 2], [3, -1, 2], [1, 2, 4], [0, 0, 2], [0, 1, 2]], r"topk_ids[2, 2] = 4 is outside [-1, num_experts=4)"),
    ([[0, -2, 2], [3, -1, 2], [1, 2, 0], [0, 1, 2], [0, 1, 2]], r"topk_ids[0, 1] = -2 is outside [-1, num_experts=4)"),
])
def test_fused_moe_topk_ids_violations_are_named(ids, message):
    x, w, w13, s13, w2, s2 = _fused_operands(np.random.default_rng(13))

    def f(ids, debug_checks=True):
        return cc.fused_moe(x, ids, w, w13, s13, w2, s2, backend="reference", debug_checks=debug_checks)

    assert _error(f, jnp.asarray(ids, jnp.int32)) == message
    good = jnp.asarray([[0, 1, 2], [3, -1, 2], [1, 2, 0], [2, 0, 3], [-1, -1, -1]], jnp.int32)
    err, got = cc.checked(f, throw=False)(good)
    assert err.get() is None
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(f(good, False), np.float32))
    # unchecked, the violating routes are dropped: the same as passing the canonical ids
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(ids, jnp.int32), False), np.float32),
                                  np.asarray(f(jnp.asarray(np_canonical_topk_ids(np.asarray(ids), 4)), False),
                                             np.float32))


def test_layer_checked_mode_fused_layout_names_a_repeated_expert():
    cfg = mj.MoEConfig.deepseek_v3(num_experts=8, n_shared_experts=0, n_group=4, topk_group=2, top_k=3,
                                   hidden_size=256, intermediate_size=128, recipe="fp8_block", arch=90,
                                   layout="fused")
    params = mj.prepare_params(mj.init_params(jax.random.PRNGKey(3), cfg), cfg)
    x = jax.random.normal(jax.random.key(4), (6, 256), jnp.bfloat16)
    ids = np.tile(np.asarray([[0, 5, 7]], np.int32), (6, 1))
    w = jnp.full((6, 3), 0.3, jnp.float32)

    def f(ids):
        return mj.routed_experts(x, ids, w, params, cfg, debug_checks=True)

    err, got = cc.checked(f, throw=False)(jnp.asarray(ids))
    assert err.get() is None and np.isfinite(np.asarray(got, np.float32)).all()
    ids[4, 2] = 5
    assert _error(f, jnp.asarray(ids)) == ("topk_ids[4, 2] = 5 repeats topk_ids[4, 1] (a token names each expert "
                                           "at most once)")
    # routing itself never repeats an expert: the whole layer passes
    err, _ = cc.checked(lambda x, p: mj.moe_forward(x, p, cfg, debug_checks=True), throw=False)(x, params)
    assert err.get() is None


# ------------------------------------------------------------------ Triton under the interpreter

TRITON_SCRIPT = r"""
import json, numpy as np, jax, jax.numpy as jnp
import custom_calls as cc
from custom_calls import ActivationSpec
out = {}
def msg(err):
    m = err.get()
    return None if m is None else m.removesuffix(" (`check` failed)")
x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 256)), jnp.bfloat16)
s = np.arange(12, dtype=np.int32).reshape(6, 2)
bad = s.copy(); bad[5, 0] = 3
def permute(x, s):
    return cc.permute_contig(x, s, num_rows=128, recipe="bf16", arch=90, backend="triton", debug_checks=True)
err, res = cc.checked(permute, throw=False)(x, jnp.asarray(bad))
ref = cc.permute_contig(x, jnp.asarray(bad), num_rows=128, recipe="bf16", arch=90, backend="reference")
out["permute_msg"] = msg(err)
out["permute_same"] = bool(np.array_equal(np.asarray(res[0], np.float32), np.asarray(ref[0], np.float32)))
err, _ = cc.checked(permute, throw=False)(x.at[2].set(jnp.nan), jnp.asarray(s))
out["nan_msg"] = msg(err)
def act(mm):
    return cc.activation_quant_masked(jnp.ones((2, 128, 256), jnp.bfloat16), mm, act=ActivationSpec(),
                                      recipe="fp8_block", arch=90, backend="triton", debug_checks=True)
err, _ = cc.checked(act, throw=False)(jnp.asarray([3, -1], jnp.int32))
out["act_msg"] = msg(err)
d = jnp.asarray(np.random.default_rng(1).standard_normal((10, 64)), jnp.bfloat16)
def unp(s):
    return cc.unpermute(d, s, jnp.ones((6, 2)), backend="triton", out_dtype=jnp.float32, debug_checks=True)
err, res = cc.checked(unp, throw=False)(jnp.asarray(s))
ref = cc.unpermute(d, jnp.asarray(s), jnp.ones((6, 2)), backend="reference", out_dtype=jnp.float32)
out["unpermute_msg"] = msg(err)
out["unpermute_same"] = bool(np.allclose(np.asarray(res), np.asarray(ref), rtol=1e-6, atol=1e-6))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_triton_backend_checked_under_interpreter():
    got = run_under_interpreter(TRITON_SCRIPT)
    assert got["permute_msg"] == "src2dst[5, 0] = 3 names the same row as src2dst[1, 1] (rows must be distinct)"
    assert got["permute_same"]
    assert got["nan_msg"] == "x has non-finite values in tokens [2]"
    assert got["act_msg"] == "masked_m[1] = -1 is outside [0, m_pad=128]"
    assert got["unpermute_msg"] == "src2dst[5, 0] = 10 is outside [-1, num_rows=10)"
    assert got["unpermute_same"]


# ------------------------------------------------------------------ GPU (run on an H200)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["deep_gemm", "triton", "auto"])
def test_checked_mode_on_gpu(backend):
    """The checks run on the device with the accelerated ops in the program (custom calls inside
    checkify), and report as on the CPU."""
    cfg, params, x = _layer("contig")
    bad = x.at[0, 4].set(jnp.nan)
    with pytest.raises(checkify.JaxRuntimeError, match=r"x has non-finite values in tokens \[4\]"):
        cc.checked(lambda x, p: mj.moe_forward(x, p, cfg, backend=backend, debug_checks=True))(bad, params)
    err, got = jax.jit(cc.checked(lambda x, p: mj.moe_forward(x, p, cfg, backend=backend, debug_checks=True),
                                  throw=False))(x, params)
    assert err.get() is None
    want = jax.jit(mj.moe_forward, static_argnames=("config", "backend"))(x, params, config=cfg, backend=backend)
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)  # XLA may fuse the rest differently
    assert np.isfinite(g).all() and np.linalg.norm(g - w) <= 1e-2 * np.linalg.norm(w)


@pytest.mark.gpu
def test_deep_gemm_fp8_broken_blocks_are_zero_with_real_lhs_rows():
    """The FP8 kernel skips a 64-row slice whose first id is -1: a broken block (now all -1) is 0
    even where lhs holds real rows, as on the reference."""
    rng = np.random.default_rng(10)
    lhs, ls, rhs, rs = _gemm_operands(rng, g=3, m_cap=512, n=256, k=384)
    mi = _well_formed()
    mi[300] = 2  # breaks block 2 (rows 256..383), whose lhs rows are random
    kw = dict(lhs_scale=ls, rhs_scale=rs, recipe="fp8_block", arch=90)
    got = np.asarray(cc.m_grouped_gemm_contig(lhs, rhs, jnp.asarray(mi), backend="deep_gemm", **kw), np.float32)
    ref = np.asarray(cc.m_grouped_gemm_contig(lhs, rhs, jnp.asarray(mi), backend="reference", **kw), np.float32)
    assert np.all(got[256:384] == 0) and np.all(ref[256:384] == 0)
    rows = np_canonical_m_indices(mi, 3, 128) >= 0
    err = np.linalg.norm(got[rows] - ref[rows]) / np.linalg.norm(ref[rows])
    assert err < 5e-3


@pytest.mark.gpu
def test_deep_gemm_non_finite_weight_scale_padding_rows():
    """The one documented difference: the block's padding rows come out NaN on the FP8 kernel when
    the expert's weight scale is non-finite (0 x inf), 0 on the reference; real rows agree (NaN
    where they read that scale)."""
    rng = np.random.default_rng(11)
    lhs, ls, rhs, rs = _gemm_operands(rng, g=3, m_cap=512, n=256, k=384)
    mi = _well_formed()  # block 1: 22 rows of expert 2, then padding
    x = jnp.where(jnp.asarray(mi >= 0)[:, None], lhs.astype(jnp.float32), 0).astype(lhs.dtype)
    rs = rs.at[2, 0, 0].set(jnp.inf)
    kw = dict(lhs_scale=ls, rhs_scale=rs, recipe="fp8_block", arch=90)
    got = np.asarray(cc.m_grouped_gemm_contig(x, rhs, jnp.asarray(mi), backend="deep_gemm", **kw), np.float32)
    ref = np.asarray(cc.m_grouped_gemm_contig(x, rhs, jnp.asarray(mi), backend="reference", **kw), np.float32)
    assert np.all(ref[150:256] == 0)
    # padding rows the kernel computes (its block or 64-row slice starts with expert 2's rows): 0 x inf
    assert np.isnan(got[150:160, :128]).all()
    assert np.all(got[192:256] == 0)  # a slice that starts with -1 is skipped: stored as 0
