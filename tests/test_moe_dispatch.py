"""Dispatch (contig / masked placement, static capacities, auto layout) and the permute /
un-permute round trip, against numpy models written here."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from custom_calls import ActivationSpec
import moe_jax as mj


def np_counts(ids, e_loc, offset):
    loc = ids - offset
    ok = (ids >= 0) & (loc >= 0) & (loc < e_loc)
    return np.bincount(loc[ok], minlength=e_loc)


def random_ids(key, m, k, e):
    """(m, k) distinct ids per row in [0, e)."""
    u = jax.random.uniform(key, (m, e))
    return np.array(jnp.argsort(u, axis=1)[:, :k], np.int32)  # writable copy


def test_contig_capacity_is_the_exact_worst_case():
    for a, e_loc, r in itertools.product((1, 2, 4), (1, 2, 3), (1, 2, 3, 5)):
        worst = 0
        for counts in itertools.product(range(r + 1), repeat=e_loc):  # every split of <= r routes
            if sum(counts) <= r:
                worst = max(worst, sum(-(-c // a) * a for c in counts))
        assert mj.contig_capacity(r, 1, e_loc, a) == worst, (a, e_loc, r)
    assert mj.contig_capacity(29, 4, 16, 128) == 128 * (16 + (116 - 16) // 128)


@pytest.mark.parametrize("m,k,e_loc,offset,align", [(13, 4, 16, 0, 8), (29, 3, 5, 4, 128),
                                                    (7, 2, 3, 6, 4)])
def test_dispatch_contig_invariants(m, k, e_loc, offset, align):
    ids = random_ids(jax.random.key(m), m, k, 12)
    ids[1, 0] = -1
    d = jax.jit(mj.dispatch_contig, static_argnames=("num_local_experts", "alignment"))(
        jnp.asarray(ids), num_local_experts=e_loc, alignment=align, expert_offset=jnp.int32(offset))
    s2d, mi = np.asarray(d.src2dst), np.asarray(d.m_indices)
    cap = mj.contig_capacity(m, k, e_loc, align)
    assert mi.shape == (cap,) and d.num_rows_cap == cap and cap % align == 0
    counts = np_counts(ids, e_loc, offset)
    np.testing.assert_array_equal(np.asarray(d.counts), counts)
    padded = -(-counts // align) * align
    assert int(d.num_rows) == padded.sum()
    starts = np.concatenate([[0], np.cumsum(padded)[:-1]])
    expect_mi = np.full(cap, -1)
    for e in range(e_loc):
        expect_mi[starts[e]:starts[e] + counts[e]] = e
    np.testing.assert_array_equal(mi, expect_mi)
    # each local route at its expert's segment, in (token, k) order; others -1
    nxt = starts.copy()
    for t, j in itertools.product(range(m), range(k)):
        loc = ids[t, j] - offset
        if ids[t, j] >= 0 and 0 <= loc < e_loc:
            assert s2d[t, j] == nxt[loc]
            nxt[loc] += 1
        else:
            assert s2d[t, j] == -1


def test_dispatch_masked_and_overflow_reported():
    ids = random_ids(jax.random.key(3), 37, 4, 8)
    d = mj.dispatch_masked(jnp.asarray(ids), num_local_experts=8, m_pad=128, num_experts_global=8)
    np.testing.assert_array_equal(np.asarray(d.masked_m), np_counts(ids, 8, 0))
    assert d.expected_m == -(-37 * 4 // 8) and int(d.num_dropped) == 0
    s2d = np.asarray(d.src2dst)
    for e in range(8):
        rows = np.sort(s2d[ids == e])
        np.testing.assert_array_equal(rows, e * 128 + np.arange(len(rows)))
    # a caller's ids with a repeated expert can exceed m_pad: dropped and counted, never silent
    dup = np.zeros((130, 2), np.int32)
    d = mj.dispatch_masked(jnp.asarray(dup), num_local_experts=2, m_pad=256, num_experts_global=2)
    assert int(d.num_dropped) == 260 - 256 and int(d.masked_m[0]) == 256
    assert int((np.asarray(d.src2dst) >= 0).sum()) == 256
    with pytest.raises(ValueError, match="m_pad=128 is too small"):
        mj.dispatch_masked(jnp.asarray(dup), num_local_experts=2, m_pad=128, num_experts_global=2)
    with pytest.raises(ValueError, match="m_pad: expected a positive multiple of 128"):
        mj.dispatch_masked(jnp.asarray(ids), num_local_experts=8, m_pad=100, num_experts_global=8)


def test_choose_layout_rules():
    kw = dict(num_tokens=100, num_local_experts=16, hidden_size=512, intermediate_size=256,
              recipe="fp8_block", arch=90)
    plain, clamp = ActivationSpec(), ActivationSpec(swiglu_limit=7.0)
    assert mj.choose_layout(**kw, act=plain) == "contig"  # no budget given
    assert mj.choose_layout(**kw, act=plain, memory_budget_bytes=1 << 30) == "masked"
    peak = mj.masked_peak_bytes(num_local_experts=16, m_pad=256, hidden_size=512,
                                intermediate_size=256, quantized=True)
    assert mj.choose_layout(**kw, act=plain, memory_budget_bytes=4 * peak) == "masked"
    assert mj.choose_layout(**kw, act=plain, memory_budget_bytes=4 * peak - 4) == "contig"
    # the clamped masked activation kernel (the accelerated one "auto" would use) needs
    # I//8 >= E_local and (I / group) % 4 == 0: I = 256 has 2 groups of 128
    static = dict(num_groups=16, m_pad=256, two_i=512, act=clamp, recipe="fp8_block", arch=90,
                  dtype=jnp.dtype(jnp.bfloat16))
    ok, reason = cc.static_supports("activation_quant_masked", "auto", **static)
    assert not ok and "G % 4 == 0 violated" in reason
    assert mj.choose_layout(**kw, act=clamp, memory_budget_bytes=1 << 40) == "contig"
    # the reference activation has no such constraint
    assert mj.choose_layout(**kw, act=clamp, backend="reference", memory_budget_bytes=1 << 40) == "masked"
    assert mj.choose_layout(**dict(kw, intermediate_size=512), act=clamp, memory_budget_bytes=1 << 40) == "masked"
    # D // 8 >= E_local: 64 experts need I >= 512
    assert mj.choose_layout(**dict(kw, intermediate_size=512, num_local_experts=65), act=clamp,
                            memory_budget_bytes=1 << 40) == "contig"


@pytest.mark.parametrize("layout", ["contig", "masked"])
def test_permute_unpermute_round_trip_identity_experts(layout):
    m, k, e, h = 23, 3, 6, 40
    x = jax.random.normal(jax.random.key(0), (m, h), jnp.float32)
    ids = random_ids(jax.random.key(1), m, k, e)
    ids[4] = -1
    ids[9, 2] = -1
    w = np.asarray(jax.random.uniform(jax.random.key(2), (m, k), jnp.float32, 0.1, 1.0))
    if layout == "contig":
        d = mj.dispatch_contig(jnp.asarray(ids), num_local_experts=e, alignment=8)
        rows, scale = cc.permute_contig(x, d.src2dst, num_rows=d.num_rows_cap, recipe="bf16", arch=90)
        used = np.asarray(d.m_indices) >= 0
    else:
        d = mj.dispatch_masked(jnp.asarray(ids), num_local_experts=e, m_pad=128, num_experts_global=e)
        rows, scale = cc.permute_masked(x, d.src2dst, num_groups=e, m_pad=128, recipe="bf16", arch=90)
        rows = rows.reshape(e * 128, h)
        used = (np.arange(128)[None] < np.asarray(d.masked_m)[:, None]).reshape(-1)
    assert scale is None and rows.dtype == jnp.bfloat16
    r = np.asarray(rows.astype(jnp.float32))
    if layout == "contig":  # contig padding rows are zero; masked rows past masked_m are unspecified
        assert np.all(r[~used] == 0)
    assert used.sum() == (ids >= 0).sum()
    y = cc.unpermute(rows, d.src2dst, jnp.asarray(w), routed_scaling_factor=2.5, out_dtype=jnp.float32)
    xb = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    expect = xb * (np.where(ids >= 0, w, 0).sum(1) * 2.5)[:, None]
    np.testing.assert_allclose(np.asarray(y), expect, rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(y)[4] == 0)


@pytest.mark.parametrize("recipe,arch", [("fp8_block", 90), ("fp8_block", 100), ("mxfp8", 100)])
def test_permute_quantizes_into_the_gemm_image(recipe, arch):
    m, k, e, h = 9, 2, 4, 256
    x = jax.random.normal(jax.random.key(5), (m, h), jnp.float32) * 3
    ids = random_ids(jax.random.key(6), m, k, e)
    d = mj.dispatch_contig(jnp.asarray(ids), num_local_experts=e, alignment=128)
    q, sf = cc.permute_contig(x, d.src2dst, num_rows=d.num_rows_cap, recipe=recipe, arch=arch)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (d.num_rows_cap, h)
    gk = 32 if recipe == "mxfp8" else 128
    if arch == 90:
        assert sf.shape == (h // gk, d.num_rows_cap) and sf.dtype == jnp.float32
    else:
        assert sf.shape == (-(-(h // gk) // 4), d.num_rows_cap) and sf.dtype == jnp.int32
    deq = np.asarray(cc.dequantize_lhs(q, sf, recipe, arch))
    s2d = np.asarray(d.src2dst)
    for t, j in itertools.product(range(m), range(k)):
        # e4m3: 2^-4 relative for normals; the subnormal step 2^-9 of a (<= 2x amax/448) scale
        xt = np.asarray(x[t])
        np.testing.assert_allclose(deq[s2d[t, j]], xt, rtol=2**-4, atol=np.abs(xt).max() / 448 * 2**-8)
    assert np.all(deq[np.asarray(d.m_indices) < 0] == 0)


@pytest.mark.slow
def test_masked_overflow_poisons_the_tokens_that_lost_a_route():
    cfg = mj.MoEConfig(num_experts=2, top_k=2, hidden_size=16, intermediate_size=8,
                       masked_m_pad=128)
    p = mj.init_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (100, 16), jnp.float32).astype(jnp.bfloat16)
    ids = jnp.zeros((100, 2), jnp.int32)  # every token repeats expert 0: 200 routes, 128 rows
    w = jnp.full((100, 2), 0.5, jnp.float32)
    y = np.asarray(mj.routed_experts(x, ids, w, p, cfg, layout="masked").astype(jnp.float32))
    lost = np.isnan(y).any(1)
    assert lost.sum() == 100 - 64 and not np.isnan(y[:64]).any()  # routes of tokens >= 64 dropped
    # checked mode poisons the same tokens (after the un-permute instead of through a row mark)
    import custom_calls as cc

    err, yd = cc.checked(lambda x: mj.routed_experts(x, ids, w, p, cfg, layout="masked", debug_checks=True),
                         throw=False)(x)
    assert err.get() is None
    np.testing.assert_array_equal(np.isnan(np.asarray(yd.astype(jnp.float32))).any(1), lost)
    yc = np.asarray(mj.routed_experts(x, ids, w, p, cfg, layout="contig").astype(jnp.float32))
    assert np.isfinite(yc).all()  # contig capacity covers any ids
    np.testing.assert_allclose(y[:64], yc[:64], rtol=1e-2, atol=1e-3)


def test_unpermute_reads_only_routed_rows():
    """Rows no route points to (masked tails, padding) may hold anything, NaN included; -1 routes
    contribute nothing. Checked against a float64 loop."""
    m, k, r, h = 11, 3, 40, 24
    d = np.array(jax.random.normal(jax.random.key(11), (r, h), jnp.float32))
    s2d = np.array(jax.random.permutation(jax.random.key(12), r)[: m * k]).reshape(m, k)
    s2d = s2d.astype(np.int32)
    s2d[2] = -1
    s2d[5, 1] = -1
    unread = np.setdiff1d(np.arange(r), s2d[s2d >= 0])
    d[unread] = np.nan
    d[unread[:1]] = np.inf
    w = np.asarray(jax.random.uniform(jax.random.key(13), (m, k), jnp.float32, 0.1, 1.0))
    s2d0 = s2d.copy()
    y = np.asarray(cc.unpermute(jnp.asarray(d), jnp.asarray(s2d), jnp.asarray(w),
                                routed_scaling_factor=1.5, out_dtype=jnp.float32))
    expect = np.zeros((m, h))
    for t, j in itertools.product(range(m), range(k)):
        if s2d[t, j] >= 0:
            expect[t] += float(w[t, j]) * d[s2d[t, j]].astype(np.float64)
    np.testing.assert_allclose(y, expect * 1.5, rtol=1e-6, atol=1e-6)
    assert np.all(y[2] == 0)
    # a row index past d or below -1 (a broken src2dst) drops that route only, never reads a clamped row
    y0 = np.asarray(cc.unpermute(jnp.asarray(d), jnp.asarray(s2d), jnp.asarray(w), out_dtype=jnp.float32))
    s2d[7, 0], s2d[8, 1] = r, -5
    y = np.asarray(cc.unpermute(jnp.asarray(d), jnp.asarray(s2d), jnp.asarray(w), out_dtype=jnp.float32))
    for t, j in ((7, 0), (8, 1)):
        np.testing.assert_allclose(y[t], y0[t] - float(w[t, j]) * d[s2d0[t, j]], rtol=1e-5, atol=1e-5)
    others = np.setdiff1d(np.arange(m), [7, 8])
    np.testing.assert_array_equal(y[others], y0[others])


def test_unpermute_addend_is_added_in_fp32_and_cast_once():
    """out = cast(scale * sum + addend): against a float64 model, and the fp32 result plus the
    addend cast afterwards (the layer's former two-pass form) up to one bf16 step where a fused
    multiply-add rounds once instead of twice."""
    m, k, r, h = 9, 4, 48, 40
    d = jax.random.normal(jax.random.key(21), (r, h), jnp.bfloat16)
    s2d = jax.random.permutation(jax.random.key(22), r)[: m * k].reshape(m, k).astype(jnp.int32)
    s2d = s2d.at[3, 2].set(-1)
    w = jax.random.uniform(jax.random.key(23), (m, k), jnp.float32, 0.1, 1.0)
    add = jax.random.normal(jax.random.key(24), (m, h), jnp.bfloat16) * 4
    y = cc.unpermute(d, s2d, w, routed_scaling_factor=2.5, out_dtype=jnp.bfloat16, addend=add)
    f32 = cc.unpermute(d, s2d, w, routed_scaling_factor=2.5, out_dtype=jnp.float32)
    two_pass = (f32 + add.astype(jnp.float32)).astype(jnp.bfloat16)
    yf, tf = np.asarray(y, np.float32), np.asarray(two_pass, np.float32)
    step = 2**-7 * np.maximum(np.abs(tf), np.abs(np.asarray(f32)) + np.abs(np.asarray(add, np.float32)))
    assert np.all(np.abs(yf - tf) <= step)
    d64, s, w64 = np.asarray(d, np.float64), np.asarray(s2d), np.asarray(w, np.float64)
    want = np.asarray(add, np.float64).copy()
    for t, j in itertools.product(range(m), range(k)):
        if s[t, j] >= 0:
            want[t] += 2.5 * w64[t, j] * d64[s[t, j]]
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2**-8, atol=1e-6)
    with pytest.raises(ValueError, match=r"addend: expected shape \(9, 40\) \(tokens of src2dst, H of d\), "
                                         r"got \(9, 41\)"):
        cc.unpermute(d, s2d, w, addend=jnp.zeros((9, 41), jnp.bfloat16))
    with pytest.raises(TypeError, match="addend: expected dtype"):
        cc.unpermute(d, s2d, w, addend=jnp.zeros((9, 40), jnp.int32))


def test_bad_permute_and_unpermute_inputs():
    x = jnp.ones((5, 16), jnp.bfloat16)
    s2d = jnp.zeros((5, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"src2dst: expected 5 rows \(tokens of x\), got shape \(4, 2\)"):
        cc.permute_contig(x, s2d[:4], num_rows=128, recipe="bf16", arch=90)
    with pytest.raises(TypeError, match="src2dst: expected dtype int32, got int16"):
        cc.permute_contig(x, s2d.astype(jnp.int16), num_rows=128, recipe="bf16", arch=90)
    with pytest.raises(TypeError, match="x: expected dtype .*got int32"):
        cc.permute_contig(x.astype(jnp.int32), s2d, num_rows=128, recipe="bf16", arch=90)
    with pytest.raises(ValueError, match="m_pad: expected a multiple of 128, got 100"):
        cc.permute_masked(x, s2d, num_groups=2, m_pad=100, recipe="bf16", arch=90)
    d = jnp.ones((128, 16), jnp.bfloat16)
    w = jnp.ones((5, 2), jnp.float32)
    with pytest.raises(ValueError, match=r"topk_weights: expected shape \(5, 2\) \(as src2dst\)"):
        cc.unpermute(d, s2d, w[:, :1])
    with pytest.raises(TypeError, match="topk_weights: expected dtype .*got int32"):
        cc.unpermute(d, s2d, w.astype(jnp.int32))
    with pytest.raises(TypeError, match="d: expected dtype .*got int8"):
        cc.unpermute(d.astype(jnp.int8), s2d, w)
    with pytest.raises(ValueError, match="d: expected rank 2"):
        cc.unpermute(d[None], s2d, w)


@pytest.mark.parametrize("r,e", [(0, 3), (1, 1), (517, 7), (4096, 32)])
def test_rank_within_expert_reference_against_numpy(r, e):
    from custom_calls import rank_within_expert

    ids = np.asarray(jax.random.randint(jax.random.key(r + e), (r,), 0, e + 1, jnp.int32))
    counts, rank = jax.jit(lambda i: rank_within_expert(i, num_experts=e))(jnp.asarray(ids))
    seen = np.zeros(e + 1, np.int64)
    want = np.empty(r, np.int64)
    for i, v in enumerate(ids):  # routes of the same value before this one
        want[i] = seen[v]
        seen[v] += 1
    np.testing.assert_array_equal(np.asarray(rank), want)
    np.testing.assert_array_equal(np.asarray(counts), seen[:e])


def test_bad_rank_within_expert_inputs():
    from custom_calls import rank_within_expert

    with pytest.raises(ValueError, match=r"e_flat: expected rank 1"):
        rank_within_expert(jnp.zeros((2, 2), jnp.int32), num_experts=2)
    with pytest.raises(TypeError, match=r"e_flat: expected dtype int32, got float32"):
        rank_within_expert(jnp.zeros((4,), jnp.float32), num_experts=2)
    with pytest.raises(ValueError, match="num_experts: expected a positive int, got 0"):
        rank_within_expert(jnp.zeros((4,), jnp.int32), num_experts=0)


def test_bad_dispatch_inputs():
    ids = jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"topk_ids: expected rank 2 \(M, top_k\), got shape \(8,\)"):
        mj.dispatch_contig(ids.reshape(-1), num_local_experts=2, alignment=8)
    with pytest.raises(TypeError, match="topk_ids: expected an integer dtype, got float32"):
        mj.dispatch_masked(ids.astype(jnp.float32), num_local_experts=2, m_pad=128, num_experts_global=2)
    with pytest.raises(ValueError, match="num_local_experts: expected a positive int, got 0"):
        mj.dispatch_contig(ids, num_local_experts=0, alignment=8)
    with pytest.raises(ValueError, match="alignment: expected a positive int, got 0"):
        mj.dispatch_contig(ids, num_local_experts=2, alignment=0)


def _np_dispatch_maps(ids, offset, e, alignment, m_pad):
    """numpy model of both dispatch maps, one route at a time in (token, k) order."""
    flat = ids.reshape(-1).astype(np.int64)
    loc = flat - offset
    held = (flat >= 0) & (loc >= 0) & (loc < e)
    counts = np.zeros(e, np.int64)
    rank = np.full(flat.size, -1, np.int64)
    for i in np.flatnonzero(held):
        rank[i] = counts[loc[i]]
        counts[loc[i]] += 1
    padded = -(-counts // alignment) * alignment
    start = np.cumsum(padded) - padded
    contig_dst = np.where(held, start[np.clip(loc, 0, e - 1)] + rank, -1)
    cap = mj.contig_capacity(*ids.shape, e, alignment)
    m_indices = np.full(cap, -1, np.int64)
    for x in range(e):
        m_indices[start[x]:start[x] + counts[x]] = x
    masked_dst = np.where(held & (rank < m_pad), loc * m_pad + rank, -1)
    return ((contig_dst.reshape(ids.shape), m_indices, padded.sum(), counts),
            (masked_dst.reshape(ids.shape), np.minimum(counts, m_pad), np.maximum(counts - m_pad, 0).sum()))


@pytest.mark.parametrize("m,k,e,offset,alignment,m_pad", [(1, 1, 1, 0, 1, 128), (37, 6, 5, 3, 16, 128),
                                                          (300, 8, 20, 7, 128, 128), (0, 8, 4, 0, 128, 128)])
def test_dispatch_map_reference_against_numpy(m, k, e, offset, alignment, m_pad):
    """The ops' reference backend, expert_offset traced; ids below, inside and above the local
    window, -1, and (first rows) repeated experts so masked slabs overflow."""
    rng = np.random.default_rng(m + e)
    ids = rng.integers(-1, e + 2 * offset + 3, (m, k)).astype(np.int32)
    ids[: m // 3] = offset + rng.integers(0, 2, (m // 3, k))
    want_c, want_m = _np_dispatch_maps(ids, offset, e, alignment, m_pad)
    got_c = jax.jit(lambda i, o: cc.dispatch_map_contig(i, o, num_local_experts=e, alignment=alignment,
                                                        backend="reference"))(jnp.asarray(ids), jnp.int32(offset))
    got_m = jax.jit(lambda i, o: cc.dispatch_map_masked(i, o, num_local_experts=e, m_pad=m_pad,
                                                        backend="reference"))(jnp.asarray(ids), jnp.int32(offset))
    got_mark = jax.jit(lambda i, o: cc.dispatch_map_masked(i, o, num_local_experts=e, m_pad=m_pad, mark_dropped=True,
                                                           backend="reference"))(jnp.asarray(ids), jnp.int32(offset))
    # mark_dropped: a held route past m_pad names the row one past the last slab instead of -1
    flat = ids.reshape(-1).astype(np.int64) - offset
    held = ((ids.reshape(-1) >= 0) & (flat >= 0) & (flat < e)).reshape(ids.shape)
    want_mark = (np.where(held & (want_m[0] < 0), e * m_pad, want_m[0]), *want_m[1:])
    for got, want in ((got_c, want_c), (got_m, want_m), (got_mark, want_mark)):
        for g, w in zip(got, want):
            assert g.dtype == jnp.int32 and np.array_equal(np.asarray(g), w)
    if m == 300:
        assert int(got_m[2]) > 0  # the overflow case is exercised
        assert int((np.asarray(got_mark[0]) == e * m_pad).sum()) == int(got_m[2])
    # the dispatcher returns the same maps
    dc = mj.dispatch_contig(jnp.asarray(ids), num_local_experts=e, alignment=alignment, expert_offset=offset)
    for g, w in zip((dc.src2dst, dc.m_indices, dc.num_rows, dc.counts), want_c):
        assert np.array_equal(np.asarray(g), w)


def test_bad_dispatch_map_inputs():
    ids = jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"topk_ids: expected rank 2"):
        cc.dispatch_map_contig(ids.reshape(-1), 0, num_local_experts=2, alignment=8)
    with pytest.raises(TypeError, match="topk_ids: expected an integer dtype, got float32"):
        cc.dispatch_map_masked(ids.astype(jnp.float32), 0, num_local_experts=2, m_pad=128)
    with pytest.raises(ValueError, match=r"expert_offset: expected an integer scalar, got shape \(2,\)"):
        cc.dispatch_map_masked(ids, jnp.zeros((2,), jnp.int32), num_local_experts=2, m_pad=128)
    with pytest.raises(ValueError, match="num_local_experts: expected a positive int, got True"):
        cc.dispatch_map_contig(ids, 0, num_local_experts=True, alignment=8)
    with pytest.raises(TypeError, match="mark_dropped: expected a bool, got 1"):
        cc.dispatch_map_masked(ids, 0, num_local_experts=2, m_pad=128, mark_dropped=1)
    with pytest.raises(ValueError, match="alignment: expected a positive int, got 0"):
        cc.dispatch_map_contig(ids, 0, num_local_experts=2, alignment=0)
    with pytest.raises(ValueError, match="m_pad: expected a positive int, got 0"):
        cc.dispatch_map_masked(ids, 0, num_local_experts=2, m_pad=0)
