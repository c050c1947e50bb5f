"""The "triton" backend on a CUDA GPU through jax_triton, under jax.jit: every op against the
reference op on the same inputs, and against numpy / float64 models written here (shared with
the interpreter suite). Odd shapes: partial scale groups, partial tiles, rows % 4 != 0."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from custom_calls.activation import ActivationSpec, activation_quant_contig, activation_quant_masked
from custom_calls.act_quant import quantize_activation
from custom_calls.permute import permute_contig, permute_masked
from custom_calls.unpermute import unpermute
from test_triton_interpret import model_activation, model_group_scales, model_quant_values, read_image

pytestmark = pytest.mark.gpu
backends = importlib.import_module("custom_calls.backends")

# ("mxfp4", 90): its W4A8 form, the lhs in the W4A8 column order (`_plain` undoes it before the models)
RECIPE_ARCHS = [("fp8_block", 90), ("fp8_block", 100), ("mxfp8", 100), ("mxfp4", 100), ("mxfp4", 90), ("bf16", 90)]
GROUP = {"fp8_block": 128, "mxfp8": 32, "mxfp4": 128}


def _plain(q, recipe, arch):
    """An lhs of `gemm_format(recipe, arch)` in column order."""
    from layouts import gemm_format
    from layouts.w4a8 import from_w4a8_lhs_order

    return from_w4a8_lhs_order(jnp.asarray(q)) if recipe != "bf16" and gemm_format(recipe, arch).w4a8 else q


def _routes(key, m, k, e, drop=0.1):
    k1, k2 = jax.random.split(key)
    ids = jnp.argsort(jax.random.uniform(k1, (m, e)), axis=1)[:, :k].astype(jnp.int32)
    return jnp.where(jax.random.uniform(k2, (m, k)) < drop, -1, ids)


def _x(key, shape):
    k1, k2 = jax.random.split(key)
    return (jax.random.normal(k1, shape) * jax.random.uniform(k2, shape[:-1] + (1,), minval=0.05, maxval=30)
            ).astype(jnp.bfloat16)


def _np(a):
    return np.asarray(jax.device_get(a))


def _check_quantized_rows(lhs, img, rows_f32, group, arch, label):
    """lhs (..., mn, K) e4m3 and its image against the numpy model of the rows it should hold."""
    ue8m0 = arch == 100
    mn, k = rows_f32.shape[-2:]
    sf = read_image(_np(img), mn, -(-k // group), ue8m0)
    want_sf = model_group_scales(rows_f32, group, ue8m0)
    if ue8m0:
        assert np.array_equal(sf, want_sf), label
    else:
        np.testing.assert_allclose(sf, want_sf, rtol=2.4e-7, err_msg=label)
    want_q = model_quant_values(rows_f32, sf, group)  # q consistent with the scale written
    got = _np(lhs).astype(np.float32)
    assert np.array_equal(got, want_q.astype(np.float32)), f"{label}: {np.argwhere(got != want_q.astype(np.float32))[:5]}"


def _agrees_with_reference(q, ref_q, min_equal: float) -> None:
    """e4m3 tensors: equal except a small fraction, and those off by at most one e4m3 step.
    XLA's f32 -> e4m3 conversion on the GPU is not a single round-to-nearest-even (it differs from
    ml_dtypes' exact cast on ~0.1% of non-power-of-two-scaled values; the kernels match the exact
    cast, see `_check_quantized_rows`), so the reference op is a near, not exact, match."""
    a, b = _np(q).astype(np.float32), _np(ref_q).astype(np.float32)
    equal = a == b
    assert equal.mean() >= min_equal, equal.mean()
    assert (np.abs(a - b) <= 0.125 * np.maximum(np.abs(a), np.abs(b)) + 2.0**-9)[~equal].all()


@pytest.mark.parametrize("recipe,arch", RECIPE_ARCHS)
def test_permute_contig(recipe, arch):
    from moe_jax.dispatch import dispatch_contig

    m, h, k, e = 301, 2176, 6, 9  # H: 17 groups of 128 (a partial packed word), 68 of 32
    key = jax.random.PRNGKey(1)
    x = _x(key, (m, h))
    disp = dispatch_contig(_routes(jax.random.fold_in(key, 1), m, k, e), num_local_experts=e, alignment=128)
    rows = disp.num_rows_cap
    run = jax.jit(lambda x, s, b: permute_contig(x, s, num_rows=rows, recipe=recipe, arch=arch, backend=b),
                  static_argnums=2)
    lhs, img = run(x, disp.src2dst, "triton")
    ref_lhs, ref_img = run(x, disp.src2dst, "reference")
    s2d = _np(disp.src2dst)
    placed = np.zeros((rows, h), np.float32)
    xs = _np(x).astype(np.float32)
    for (t, j), r in np.ndenumerate(s2d):
        if r >= 0:
            placed[r] = xs[t]
    if recipe == "bf16":
        assert img is None and np.array_equal(_np(lhs).astype(np.float32), placed)
        return
    _check_quantized_rows(_plain(lhs, recipe, arch), img, placed, GROUP[recipe], arch, "permute_contig")
    # agrees with the reference op (fp32 scales may differ by one ulp: XLA divides as x * (1/448))
    _agrees_with_reference(lhs, ref_lhs, 0.995 if arch == 90 else 1.0)
    if arch == 90:
        np.testing.assert_allclose(_np(img), _np(ref_img), rtol=2.4e-7)
    else:
        assert np.array_equal(_np(img), _np(ref_img))


def test_row_sources_zero_filled_and_placed():
    """The permute's row -> token map: the launcher zero-fills it on every call (the same buffer
    size is produced several times in one program, after a poisoned array of that size)."""
    from custom_calls.triton.permute_kernel import row_sources

    m, k, rows = 1000, 5, 7000
    sets = []
    for i in range(3):
        s2d = np.full((m, k), -1, np.int32)
        pick = np.random.default_rng(i).permutation(rows + 50)[: m * k // 2]  # some past the buffer
        s2d.reshape(-1)[np.random.default_rng(10 + i).permutation(m * k)[: pick.size]] = pick
        sets.append(s2d)

    def run(poison, *s2ds):
        return [poison + 1] + [row_sources(s, rows) for s in s2ds]

    outs = jax.jit(run)(jnp.full((rows,), 0x7B7B7B7B - 1, jnp.int32), *[jnp.asarray(s) for s in sets])
    for s2d, got in zip(sets, outs[1:]):
        want = np.zeros(rows, np.int32)
        for (t, j), r in np.ndenumerate(s2d):
            if 0 <= r < rows:
                want[r] = t + 1
        assert np.array_equal(_np(got), want)


@pytest.mark.parametrize("recipe,arch", RECIPE_ARCHS)
def test_permute_masked(recipe, arch):
    from moe_jax.dispatch import dispatch_masked

    m, h, k, e, m_pad = 200, 1152, 4, 7, 256
    key = jax.random.PRNGKey(2)
    x = _x(key, (m, h))
    disp = dispatch_masked(_routes(jax.random.fold_in(key, 1), m, k, e), num_local_experts=e, m_pad=m_pad,
                           num_experts_global=e)
    run = jax.jit(lambda x, s, b: permute_masked(x, s, num_groups=e, m_pad=m_pad, recipe=recipe, arch=arch,
                                                  backend=b), static_argnums=2)
    lhs, img = run(x, disp.src2dst, "triton")
    placed = np.zeros((e * m_pad, h), np.float32)
    routed = np.zeros(e * m_pad, bool)
    xs = _np(x).astype(np.float32)
    for (t, j), r in np.ndenumerate(_np(disp.src2dst)):
        if r >= 0:
            placed[r] = xs[t]
            routed[r] = True
    placed, routed = placed.reshape(e, m_pad, h), routed.reshape(e, m_pad)
    assert lhs.shape == (e, m_pad, h)
    # rows no route lands on are unspecified: compare the routed ones (zeros stand in for the rest)
    got = np.where(routed[..., None], _np(lhs).astype(np.float32), 0.0)
    if recipe == "bf16":
        assert np.array_equal(got, placed)
        return
    _check_quantized_rows(_plain(got.astype(_np(lhs).dtype), recipe, arch), img, placed, GROUP[recipe], arch,
                          "permute_masked")
    ref_lhs, _ = run(x, disp.src2dst, "reference")
    _agrees_with_reference(_np(lhs)[routed], _np(ref_lhs)[routed], 0.995 if arch == 90 else 1.0)


ACTS = {
    "silu": ActivationSpec(kind="silu"),
    "silu_limit": ActivationSpec(kind="silu", swiglu_limit=7.0),
    "oai": ActivationSpec(kind="swiglu_oai", swiglu_limit=7.0, gemm1_alpha=1.702),
    "situ": ActivationSpec(kind="situ", situ_beta=3.0, situ_linear_beta=5.0),
    "keep_fp32": ActivationSpec(kind="silu", keep_fp32=True),
}
_MODEL = {"silu": {}, "silu_limit": dict(limit=7.0), "oai": dict(limit=7.0, alpha=1.702),
          "situ": dict(bs=3.0, bl=5.0), "keep_fp32": {}}


def _y64(gateup, variant):
    kind = ACTS[variant].kind
    p = _MODEL[variant]
    return model_activation(_np(gateup), kind, p.get("limit"), p.get("alpha"), p.get("bs", 1.0), p.get("bl", 1.0))


def _check_act(a, img, y64, group, arch, sel):
    """Dequantized a within e4m3 + bf16 rounding of the float64 model, on the selected rows."""
    ue8m0 = arch == 100
    mn, i = y64.shape[-2:]
    sf = read_image(_np(img), mn, -(-i // group), ue8m0).astype(np.float64)
    sfe = np.repeat(sf, group, axis=-1)[..., :i]
    deq = _np(a).astype(np.float64) * sfe
    ok = np.abs(deq - y64) <= 0.0705 * np.abs(y64) + sfe * 2**-9
    assert np.where(sel[..., None], ok, True).all()


@pytest.mark.parametrize("variant,recipe,arch",
                         [(v, r, a) for r, a in [("fp8_block", 90), ("fp8_block", 100), ("mxfp8", 100)] for v in ACTS]
                         + [(v, "mxfp4", 90) for v in ACTS if not ACTS[v].keep_fp32])  # keep_fp32: FP8 weights only
def test_activation_contig(variant, recipe, arch):
    rows, inter = 389, 1536  # rows % 4 == 1: image padding columns
    gateup = (jax.random.normal(jax.random.PRNGKey(3), (rows, 2 * inter)) * 3).astype(jnp.bfloat16)
    act = ACTS[variant]
    run = jax.jit(lambda g, b: activation_quant_contig(g, act=act, recipe=recipe, arch=arch, backend=b),
                  static_argnums=1)
    a, img = run(gateup, "triton")
    ref_a, ref_img = run(gateup, "reference")
    _check_act(_plain(a, recipe, arch), img, _y64(gateup, variant), GROUP[recipe], arch, np.ones(rows, bool))
    _agrees_with_reference(a, ref_a, 0.99)  # + sigmoid/tanh ulps may move a bf16 rounding
    ri, ti = _np(ref_img), _np(img)
    assert ri.shape == ti.shape and (ri[..., rows:] == ti[..., rows:]).all()


@pytest.mark.parametrize("variant,recipe", [("silu", "fp8_block"), ("silu_limit", "fp8_block"), ("oai", "fp8_block"),
                                            ("situ", "fp8_block"), ("silu_limit", "mxfp4")])
def test_activation_masked(variant, recipe):
    e, m_pad, inter = 5, 256, 1024
    arch = 90
    key = jax.random.PRNGKey(4)
    gateup = (jax.random.normal(key, (e, m_pad, 2 * inter)) * 3).astype(jnp.bfloat16)
    masked_m = jnp.array([0, 1, 129, 256, 37], jnp.int32)
    act = ACTS[variant]
    run = jax.jit(lambda g, mm, b: activation_quant_masked(g, mm, act=act, recipe=recipe, arch=arch, backend=b),
                  static_argnums=2)
    a, img = run(gateup, masked_m, "triton")
    ref_a, _ = run(gateup, masked_m, "reference")
    sel = np.arange(m_pad)[None, :] < _np(masked_m)[:, None]
    _check_act(_plain(a, recipe, arch), img, _y64(gateup, variant), 128, arch, sel)
    _agrees_with_reference(_np(a)[sel], _np(ref_a)[sel], 0.99)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_unpermute(out_dtype):
    m, k, rows, h, rsf = 333, 8, 4096, 2176, 2.5
    key = jax.random.PRNGKey(5)
    d = jax.random.normal(key, (rows, h)).astype(jnp.bfloat16)
    s2d = jax.random.permutation(jax.random.fold_in(key, 1), rows)[: m * k].reshape(m, k).astype(jnp.int32)
    s2d = jnp.where(jax.random.uniform(jax.random.fold_in(key, 2), (m, k)) < 0.1, -1, s2d)
    w = jax.random.uniform(jax.random.fold_in(key, 3), (m, k), minval=0.05, maxval=1.0)
    run = jax.jit(lambda d, s, w, b: unpermute(d, s, w, routed_scaling_factor=rsf, out_dtype=out_dtype, backend=b),
                  static_argnums=3)
    out = _np(run(d, s2d, w, "triton")).astype(np.float64)
    ref = _np(run(d, s2d, w, "reference")).astype(np.float64)
    d64, s, w64 = _np(d).astype(np.float64), _np(s2d), _np(w).astype(np.float64)
    terms = np.where((s >= 0)[..., None], d64[np.maximum(s, 0)] * w64[..., None], 0.0)
    want, mag = rsf * terms.sum(1), rsf * np.abs(terms).sum(1)
    rel = 2**-8 if out_dtype == jnp.bfloat16 else 2**-20
    assert (np.abs(out - want) <= rel * mag + 1e-6).all()
    assert (np.abs(out - ref) <= 2 * rel * mag + 1e-6).all()


@pytest.mark.parametrize("recipe,arch", [("fp8_block", 90), ("fp8_block", 100), ("mxfp8", 100), ("mxfp4", 90)])
def test_quantize_activation(recipe, arch):
    from custom_calls.triton.quant_kernel import quantize_activation as tq

    x = _x(jax.random.PRNGKey(6), (3, 131, 2176))
    q, img = jax.jit(lambda x: tq(x, recipe, arch))(x)
    _check_quantized_rows(_plain(q, recipe, arch), img, _np(x).astype(np.float32), GROUP[recipe], arch,
                          "quantize_activation")
    rq, rimg = jax.jit(lambda x: quantize_activation(x, recipe, arch))(x)
    _agrees_with_reference(q, rq, 0.995 if arch == 90 else 1.0)


def test_auto_picks_triton_on_gpu():
    impl = backends.resolve("permute_contig", "auto", num_tokens=4, hidden=256, top_k=2, num_rows=128,
                            recipe="fp8_block", arch=90, dtype=jnp.bfloat16)
    assert impl.backend == "triton"


def test_masked_constraint_rejected_on_gpu():
    gateup = jnp.ones((65, 256, 1024), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"D // 8 >= E violated"):
        activation_quant_masked(gateup, jnp.zeros((65,), jnp.int32), act=ACTS["silu_limit"], recipe="fp8_block",
                                arch=90, backend="triton")


@pytest.mark.parametrize("r,e", [(32768, 32), (1000, 257), (7, 4)])
def test_rank_within_expert_matches_the_argsort(r, e):
    from custom_calls.triton.dispatch_kernel import rank_within_expert

    ids = jax.random.randint(jax.random.PRNGKey(r), (r,), 0, e + 1, jnp.int32)
    counts, rank = jax.jit(lambda i: rank_within_expert(i, num_experts=e))(ids)
    order = np.argsort(_np(ids), kind="stable")
    want = np.empty(r, np.int64)
    sorted_ids = _np(ids)[order]
    starts = np.searchsorted(sorted_ids, np.arange(e + 1))
    want[order] = np.arange(r) - starts[sorted_ids]
    assert np.array_equal(_np(rank), want)
    assert np.array_equal(_np(counts), np.bincount(_np(ids), minlength=e + 1)[:e])


@pytest.mark.parametrize("m,k,e_loc,offset", [(4096, 8, 32, 0), (37, 6, 5, 3), (0, 8, 4, 0)])
def test_dispatch_with_triton_is_the_reference(m, k, e_loc, offset):
    from moe_jax.dispatch import dispatch_contig, dispatch_masked

    ids = jax.random.randint(jax.random.PRNGKey(m + k), (m, k), -1, e_loc + 2 * offset + 1, jnp.int32)
    for be in ("triton", "auto"):
        for fn, kw in ((dispatch_contig, dict(alignment=128)),
                       (dispatch_masked, dict(m_pad=max(128, -(-m // 128) * 128), num_experts_global=64))):
            got = fn(ids, num_local_experts=e_loc, expert_offset=offset, backend=be, **kw)
            want = fn(ids, num_local_experts=e_loc, expert_offset=offset, backend="reference", **kw)
            for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
                assert np.array_equal(_np(a), _np(b)), (fn.__name__, be)


@pytest.mark.parametrize("m,k,e_loc,offset,launches", [
    (128, 8, 32, 0, 1),  # decode: one launch
    (512, 8, 32, 96, 1),  # 4096 routes, an EP slice: still one launch
    (4096, 8, 32, 0, 2),  # prefill: chunk counts + placement
    (16384, 8, 32, 224, 2),  # the last EP slice of 256 experts
    (1000, 6, 257, 5, 2),  # E_local not a power of two
    (37, 6, 5, 3, 1),
])
def test_dispatch_map_kernels_are_the_reference_bit_for_bit(m, k, e_loc, offset, launches):
    """The fused dispatch-map kernels against the op's reference (argsort + XLA), expert_offset
    traced, ids spanning -1 and both sides of the local window; the launch count from the HLO."""
    from custom_calls.dispatch_map import dispatch_map_contig, dispatch_map_masked

    ids = jax.random.randint(jax.random.PRNGKey(m + e_loc), (m, k), -1, 256 + 1, jnp.int32)
    off = jnp.int32(offset)
    m_pad = max(128, -(-m // 128) * 128)
    for fn, kw in ((dispatch_map_contig, dict(alignment=128)), (dispatch_map_masked, dict(m_pad=m_pad)),
                   (dispatch_map_masked, dict(m_pad=128, mark_dropped=True))):  # drops at the larger m, marked
        run = jax.jit(lambda i, o, b, fn=fn, kw=kw: fn(i, o, num_local_experts=e_loc, backend=b, **kw),
                      static_argnums=2)
        got, want = run(ids, off, "triton"), run(ids, off, "reference")
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(_np(a), _np(b)), fn.__name__
        hlo = run.lower(ids, off, "triton").as_text()  # jax_triton's custom call target, once per launch
        assert hlo.count("triton_kernel_call") == launches, (fn.__name__, hlo.count("triton_kernel_call"))


@pytest.mark.parametrize("m,scoring,e,k,n_group,topk_group,bias", [
    (128, "sigmoid", 256, 8, 8, 4, True),  # DeepSeek-V3 at decode: one token per program
    (4096, "sigmoid", 256, 8, 8, 4, True),  # and at prefill
    (333, "sigmoid", 96, 8, 3, 2, True),  # 3 groups of 32 (padded to 4)
    (77, "softmax", 60, 6, 5, 3, False),  # 5 groups of 12 (padded to 8 x 16)
])
def test_route_topk_decode_tiling_and_any_group_count(m, scoring, e, k, n_group, topk_group, bias):
    from custom_calls import route_topk

    key = jax.random.PRNGKey(m + e)
    logits = jax.random.normal(key, (m, e)) * 2
    b = 0.3 * jax.random.normal(jax.random.fold_in(key, 1), (e,)) if bias else None
    run = jax.jit(lambda lg, b, be: route_topk(lg, b, top_k=k, scoring=scoring, n_group=n_group,
                                               topk_group=topk_group, backend=be), static_argnums=2)
    (ids, w), (rids, rw) = run(logits, b, "triton"), run(logits, b, "reference")
    same = (_np(ids) == _np(rids)).all(axis=1)
    assert same.mean() > 0.995  # a near-tie may order differently under different exp/sigmoid ulps
    np.testing.assert_allclose(_np(w)[same], _np(rw)[same], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("scoring,e,k,n_group,topk_group,bias", [
    ("sigmoid", 256, 8, 8, 4, True),  # DeepSeek-V3
    ("sigmoid", 32, 8, 8, 4, False),  # grouped, no bias: groups scored by their maximum
    ("sqrtsoftplus", 256, 6, 1, 1, True),  # DeepSeek-V4
    ("softmax", 60, 6, 1, 1, False),
])
def test_route_topk_matches_routing(scoring, e, k, n_group, topk_group, bias):
    from custom_calls import route_topk

    m = 1000
    key = jax.random.PRNGKey(e + k)
    logits = jax.random.normal(key, (m, e)) * 2
    b = 0.3 * jax.random.normal(jax.random.fold_in(key, 1), (e,)) if bias else None
    ids, w = jax.jit(lambda lg, b: route_topk(lg, b, top_k=k, scoring=scoring, n_group=n_group,
                                              topk_group=topk_group, backend="triton"))(logits, b)
    rids, rw = jax.jit(lambda lg, b: route_topk(lg, b, top_k=k, scoring=scoring, n_group=n_group,
                                                topk_group=topk_group, backend="reference"))(logits, b)
    same = (_np(ids) == _np(rids)).all(axis=1)
    assert same.mean() > 0.995  # a near-tie may order differently under different exp/sigmoid ulps
    np.testing.assert_allclose(_np(w)[same], _np(rw)[same], rtol=1e-5, atol=1e-7)


def test_masked_layer_overflow_marks_the_lost_tokens():
    """Every token repeats one expert, so its slab overflows: the Triton dispatch map marks the
    dropped routes, the permute skips them and the un-permute makes exactly those tokens NaN (the
    DeepGEMM GEMMs in between on "auto"); the other tokens agree with the reference backend."""
    import moe_jax as mj

    cfg = mj.MoEConfig.deepseek_v3(arch=90).scaled(num_experts=16, hidden_size=512, intermediate_size=256,
                                                    top_k=2, masked_m_pad=128)
    p = mj.prepare_params(mj.init_params(jax.random.key(3), cfg), cfg)
    x = _x(jax.random.PRNGKey(4), (100, 512))
    ids = jnp.stack([jnp.zeros((100,), jnp.int32), 1 + jnp.arange(100, dtype=jnp.int32) % 15], axis=1)
    ids = ids.at[:, 1].set(jnp.where(jnp.arange(100) % 3 == 0, 0, ids[:, 1]))  # some tokens name expert 0 twice
    w = jax.random.uniform(jax.random.PRNGKey(5), (100, 2), minval=0.1, maxval=1.0)
    run = jax.jit(lambda v, be: mj.routed_experts(v, ids, w, p, cfg, layout="masked", backend=be,
                                                  out_dtype=jnp.float32), static_argnums=1)
    got, want = _np(run(x, "auto")), _np(run(x, "reference"))
    lost = np.isnan(want).any(1)
    assert 0 < lost.sum() < 100
    np.testing.assert_array_equal(np.isnan(got).any(1), lost)
    assert np.isnan(got[lost]).all() and np.isfinite(got[~lost]).all()
    assert np.linalg.norm(got[~lost] - want[~lost]) / np.linalg.norm(want[~lost]) < 2e-2
