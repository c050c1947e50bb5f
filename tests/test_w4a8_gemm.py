"""The W4A8 grouped GEMM (mxfp4 kept 4-bit on arch 90): its reference against a float64 model and
against the FP4 -> FP8 path, the operand checks, and which backend serves it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from custom_calls.backends import static_supports
from custom_calls.grouped_gemm import OP_CONTIG, OP_MASKED, m_grouped_gemm_masked
from layouts import gemm_format
from layouts.fp4 import E2M1_VALUES, pack_e2m1
from layouts.scale_layout import from_mn_major_tma_aligned
from layouts.w4a8 import LHS_ORDER, from_w4a8_lhs_order, mxfp4_to_w4a8, to_w4a8_lhs_order
from layouts.weight_paths import mxfp4_to_fp8_block

W4A8 = gemm_format("mxfp4", 90)


def _operands(seed, g=3, m_pad=128, n=72, k=256, spread=12):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (g, n, k), dtype=np.uint8)
    sf32 = (2.0 ** rng.integers(-8 - spread, -8, (g, n, k // 32))).astype(np.float32)
    packed = pack_e2m1(jnp.asarray(codes))
    x = rng.standard_normal((g, m_pad, k)) * rng.uniform(0.1, 10, (g, m_pad, 1))
    a, sa = W4A8.quantize_lhs(jnp.asarray(x.astype(np.float32)))
    return codes, sf32, packed, a, sa


def _model(codes, sf32, a, sa):
    """Float64: e2m1 values times their 32-group scales, e4m3 activations (stored in the W4A8 column order)
    times their 1x128 scales."""
    mag = np.array(E2M1_VALUES)[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    w = mag * np.repeat(sf32.astype(np.float64), 32, axis=-1)
    rows = np.asarray(from_mn_major_tma_aligned(sa, a.shape[1])).astype(np.float64)
    plain = np.asarray(from_w4a8_lhs_order(a).astype(jnp.float32)).astype(np.float64)
    x = plain * np.repeat(rows, 128, axis=-1)
    return np.einsum("gmk,gnk->gmn", x, w), np.einsum("gmk,gnk->gmn", np.abs(x), np.abs(w))


def test_format_is_the_4bit_form_of_mxfp4_on_hopper():
    assert W4A8.w4a8 and W4A8.is_quantized and not W4A8.ue8m0 and W4A8.rhs_k_pack == 2
    assert W4A8.rhs_scale_shape(3, 200, 384) == (3, 200, 3) and W4A8.rhs_scale_dtype == jnp.int32
    fp8 = gemm_format("fp8_block", 90)
    assert W4A8.lhs_scale_shape(130, 384) == fp8.lhs_scale_shape(130, 384) and W4A8.scale_dtype == fp8.scale_dtype
    assert "W4A8" in W4A8.describe()


def test_reference_matches_the_float64_model():
    codes, sf32, packed, a, sa = _operands(1)
    w, sw = mxfp4_to_w4a8(packed, sf32)
    masked_m = jnp.array([5, 0, 128], jnp.int32)
    d = np.asarray(m_grouped_gemm_masked(a, w, masked_m, expected_m=32, lhs_scale=sa, rhs_scale=sw,
                                         recipe="mxfp4", arch=90, lhs_order="w4a8",
                                         backend="reference")).astype(np.float64)
    want, mag = _model(codes, sf32, a, sa)
    valid = np.arange(128)[None, :] < np.asarray(masked_m)[:, None]
    assert (np.abs(d[valid] - want[valid]) <= 2.0**-8 * np.abs(want[valid]) + 1e-6 * mag[valid]).all()
    assert (d[~valid] == 0).all() and np.abs(want[valid]).max() > 0


def test_reference_equals_the_fp4_to_fp8_path_bit_for_bit():
    """Same e4m3 operands and block scales as the load-time expansion, so the same bf16 output, also
    where 32-groups sit 15+ binades below their tile (rounded products)."""
    codes, sf32, packed, a, sa = _operands(2, spread=20)
    w, sw = mxfp4_to_w4a8(packed, sf32)
    w8, s8 = mxfp4_to_fp8_block(packed, sf32)
    masked_m = jnp.array([7, 100, 1], jnp.int32)
    kw = dict(expected_m=32, lhs_scale=sa, backend="reference", arch=90)
    d4 = m_grouped_gemm_masked(a, w, masked_m, rhs_scale=sw, recipe="mxfp4", lhs_order="w4a8", **kw)
    d8 = m_grouped_gemm_masked(from_w4a8_lhs_order(a), w8, masked_m, rhs_scale=s8, recipe="fp8_block", **kw)
    np.testing.assert_array_equal(np.asarray(d4).view(np.uint16), np.asarray(d8).view(np.uint16))


def test_weights_expanded_in_the_w4a8_order_pair_with_the_w4a8_lhs():
    """Prefill by expansion (`custom_calls.triton.w4a8_expand_kernel`): the FP8 weights in the W4A8 column
    order with the lhs as the layer writes it (that order) are the FP4 -> FP8 path's operands with both
    operands' columns permuted alike within each block, so the FP8 GEMM gives the W4A8 GEMM's result (to
    the fp32 summation order), and undoing the permutation gives the FP4 -> FP8 weights bit for bit."""
    from layouts.w4a8 import w4a8_to_fp8_block_lhs_order

    codes, sf32, packed, a, sa = _operands(5, spread=20)
    w, sw = mxfp4_to_w4a8(packed, sf32)
    w8, s8 = w4a8_to_fp8_block_lhs_order(w, sw)
    w8_plain, s8_plain = mxfp4_to_fp8_block(packed, sf32)
    np.testing.assert_array_equal(np.asarray(from_w4a8_lhs_order(w8)).view(np.uint8),
                                  np.asarray(w8_plain).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(s8), np.asarray(s8_plain))
    masked_m = jnp.array([7, 100, 128], jnp.int32)
    kw = dict(expected_m=32, lhs_scale=sa, backend="reference", arch=90)
    d4 = np.asarray(m_grouped_gemm_masked(a, w, masked_m, rhs_scale=sw, recipe="mxfp4", lhs_order="w4a8", **kw),
                    np.float32)
    d8 = np.asarray(m_grouped_gemm_masked(a, w8, masked_m, rhs_scale=s8, recipe="fp8_block", **kw), np.float32)
    valid = np.arange(128)[None, :] < np.asarray(masked_m)[:, None]
    want, mag = _model(codes, sf32, a, sa)
    assert np.abs(want[valid]).max() > 0
    np.testing.assert_allclose(d8[valid], d4[valid], rtol=2**-7, atol=1e-6 * mag[valid].max())


def test_lhs_order_is_a_permutation_of_each_whole_128_column_block():
    """The W4A8 column order: byte 32s + 16e + 4c + i of a block holds column 32c + 8s + 2i + e (thread
    column c's 32-group, k32 step s, even / odd half e, byte i); a partial last block stays in place."""
    assert sorted(LHS_ORDER) == list(range(128))
    for s_, e, c, i in np.ndindex(4, 2, 4, 4):
        assert LHS_ORDER[32 * s_ + 16 * e + 4 * c + i] == 32 * c + 8 * s_ + 2 * i + e
    x = jnp.asarray(np.random.default_rng(0).permutation(2 * 300).reshape(2, 300), jnp.int32)
    y = np.asarray(to_w4a8_lhs_order(x))
    np.testing.assert_array_equal(y[:, 128:256], np.asarray(x)[:, 128 + LHS_ORDER])
    np.testing.assert_array_equal(y[:, 256:], np.asarray(x)[:, 256:])
    np.testing.assert_array_equal(np.asarray(from_w4a8_lhs_order(jnp.asarray(y))), np.asarray(x))
    for convert in (to_w4a8_lhs_order, from_w4a8_lhs_order):
        with pytest.raises(ValueError, match=r"x: expected at least 1 dims \(\.\.\., K\), got shape \(\)"):
            convert(jnp.float32(1.0))


def test_w4a8_lhs_is_the_fp8_block_lhs_in_the_w4a8_order():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 5, 384)) * 7, jnp.float32)
    q4, s4 = W4A8.quantize_lhs(x)
    q8, s8 = gemm_format("fp8_block", 90).quantize_lhs(x)
    np.testing.assert_array_equal(np.asarray(s4), np.asarray(s8))
    np.testing.assert_array_equal(np.asarray(q4).view(np.uint8), np.asarray(to_w4a8_lhs_order(q8)).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(W4A8.dequantize_lhs(q4, s4)),
                                  np.asarray(gemm_format("fp8_block", 90).dequantize_lhs(q8, s8)))


def test_the_lhs_order_is_stated_and_an_lhs_in_column_order_is_permuted_by_the_op():
    """The W4A8 order and column order have the same shapes and dtypes, so a W4A8 GEMM takes the order as
    a static argument and refuses to guess; "columns" (an lhs quantized as fp8_block) gives the same bits
    as the W4A8 order's lhs, and a wrong statement is what the argument exists to prevent (different
    sums). Other formats take None or "columns" only."""
    from custom_calls.grouped_gemm import m_grouped_gemm_contig

    codes, sf32, packed, a, sa = _operands(6)
    w, sw = mxfp4_to_w4a8(packed, sf32)
    plain = from_w4a8_lhs_order(a)  # = gemm_format("fp8_block", 90).quantize_lhs of the same x
    masked_m = jnp.array([9, 128, 3], jnp.int32)
    kw = dict(expected_m=32, lhs_scale=sa, rhs_scale=sw, recipe="mxfp4", arch=90, backend="reference")
    with pytest.raises(ValueError, match=r"lhs_order: recipe 'mxfp4' on arch 90 \(W4A8\) reads its lhs in the "
                                         r"W4A8 column order.*'w4a8' for an lhs from.*'columns' for one in "
                                         r"column order"):
        m_grouped_gemm_masked(a, w, masked_m, **kw)
    with pytest.raises(ValueError, match=r"lhs_order: expected one of \('columns', 'w4a8'\) \(or None\), got 'rows'"):
        m_grouped_gemm_masked(a, w, masked_m, lhs_order="rows", **kw)
    ordered = np.asarray(m_grouped_gemm_masked(a, w, masked_m, lhs_order="w4a8", **kw))
    columns = np.asarray(m_grouped_gemm_masked(plain, w, masked_m, lhs_order="columns", **kw))
    np.testing.assert_array_equal(columns.view(np.uint16), ordered.view(np.uint16))
    misstated = np.asarray(m_grouped_gemm_masked(plain, w, masked_m, lhs_order="w4a8", **kw))
    assert not np.array_equal(misstated.view(np.uint16), ordered.view(np.uint16))
    # contig: the experts' rows one after another, 128-row blocks
    g, m_pad, k = a.shape
    m_indices = jnp.repeat(jnp.arange(g, dtype=jnp.int32), m_pad)
    a2, plain2 = a.reshape(g * m_pad, k), plain.reshape(g * m_pad, k)
    sa2 = W4A8.quantize_lhs(W4A8.dequantize_lhs(a, sa).reshape(g * m_pad, k))[1]
    ckw = dict(lhs_scale=sa2, rhs_scale=sw, recipe="mxfp4", arch=90, alignment=128, backend="reference")
    with pytest.raises(ValueError, match="lhs_order: recipe 'mxfp4' on arch 90"):
        m_grouped_gemm_contig(a2, w, m_indices, **ckw)
    np.testing.assert_array_equal(
        np.asarray(m_grouped_gemm_contig(plain2, w, m_indices, lhs_order="columns", **ckw)).view(np.uint16),
        np.asarray(m_grouped_gemm_contig(a2, w, m_indices, lhs_order="w4a8", **ckw)).view(np.uint16))
    w8, s8 = mxfp4_to_fp8_block(packed, sf32)
    fp8 = dict(kw, rhs_scale=s8, recipe="fp8_block")
    with pytest.raises(ValueError, match=r"lhs_order: 'w4a8' is the lhs order of the W4A8 format only \(recipe "
                                         r"'mxfp4' on arch 90\), got recipe 'fp8_block' on arch 90"):
        m_grouped_gemm_masked(plain, w8, masked_m, lhs_order="w4a8", **fp8)
    np.testing.assert_array_equal(np.asarray(m_grouped_gemm_masked(plain, w8, masked_m, lhs_order="columns", **fp8)),
                                  np.asarray(m_grouped_gemm_masked(plain, w8, masked_m, **fp8)))


def test_operands_are_checked_by_name():
    _, sf32, packed, a, sa = _operands(3, g=2)
    w, sw = mxfp4_to_w4a8(packed, sf32)
    mm = jnp.array([1, 2], jnp.int32)
    kw = dict(expected_m=8, lhs_scale=sa, recipe="mxfp4", arch=90, lhs_order="w4a8", backend="reference")
    with pytest.raises(TypeError, match="rhs_scale: expected dtype int32, got float32"):
        m_grouped_gemm_masked(a, w, mm, rhs_scale=sw.astype(jnp.float32), **kw)
    with pytest.raises(ValueError, match=r"rhs_scale: expected shape \(2, 72, 2\).*W4A8"):
        m_grouped_gemm_masked(a, w, mm, rhs_scale=sw[..., :1], **kw)
    with pytest.raises(ValueError, match=r"rhs: expected last axis K//2=128"):
        m_grouped_gemm_masked(a, w[..., :64], mm, rhs_scale=sw, **kw)


def test_backends_say_who_serves_it():
    """Backend "w4a8" runs the W4A8 form and nothing else; DeepGEMM has no W4A8 family."""
    static = dict(num_groups=4, m_pad=128, n=4096, k=7168, expected_m=8, arch=90, lhs_dtype=jnp.float8_e4m3fn,
                  rhs_dtype=jnp.int8, settings=None)
    ok, reason = static_supports(OP_MASKED, "w4a8", recipe="mxfp4", **static)
    assert ok, reason
    ok, reason = static_supports(OP_MASKED, "w4a8", recipe="fp8_block", **static)
    assert not ok and "W4A8 kernels only" in reason and "'fp8_block'" in reason
    ok, reason = static_supports(OP_MASKED, "w4a8", recipe="mxfp4", **dict(static, k=7200))
    assert not ok and "K a multiple of 128, got 7200" in reason
    ok, reason = static_supports(OP_MASKED, "deep_gemm", recipe="mxfp4", **static)
    assert not ok and "W4A8" in reason
    contig = dict(m_cap=1024, n=4096, k=7168, num_groups=4, arch=90, alignment=128, lhs_dtype=jnp.float8_e4m3fn,
                  rhs_dtype=jnp.int8, settings=None)
    assert static_supports(OP_CONTIG, "w4a8", recipe="mxfp4", **contig) == (True, "")
    ok, reason = static_supports(OP_CONTIG, "w4a8", recipe="mxfp4", **dict(contig, alignment=32))
    assert not ok and "alignment: the W4A8 contig kernel needs a multiple of 64, got 32" in reason


def test_contig_form_follows_w4a8_prefill():
    """`KernelSettings.w4a8_prefill`: "auto" expands from `EXPAND_MIN_ROWS_PER_EXPERT` rows of contig
    capacity per expert, where DeepGEMM's FP8 contig GEMM takes the shapes, else runs the kernel; a forced
    "expand" that DeepGEMM cannot run is refused, naming the argument."""
    from custom_calls import KernelSettings
    from custom_calls.w4a8_backend import EXPAND_MIN_ROWS_PER_EXPERT as rows
    from custom_calls.w4a8_backend import contig_form

    auto, kernel, expand = (KernelSettings(w4a8_prefill=m) for m in ("auto", "kernel", "expand"))
    shape = dict(n=4096, k=4096, num_groups=32, alignment=128)
    assert contig_form(m_cap=32 * rows, settings=auto, **shape) == "expand"
    assert contig_form(m_cap=32 * rows - 128, settings=auto, **shape) == "kernel"
    assert contig_form(m_cap=32 * rows, settings=kernel, **shape) == "kernel"
    assert contig_form(m_cap=128, settings=expand, **shape) == "expand"
    assert contig_form(m_cap=32 * rows, settings=auto, **dict(shape, n=4032 + 8)) == "kernel"  # N % 64
    assert contig_form(m_cap=32 * rows, settings=auto, **dict(shape, alignment=256)) == "kernel"
    from moe_jax import contig_capacity

    # V4-Flash's prefill (top-6): the 32-expert slice expands at 4096 tokens (892 rows per expert), not at
    # 2048 (508, a tie where the kernel form keeps the memory); all 256 experts on one GPU do not (223)
    for tokens, experts, form in ((4096, 32, "expand"), (2048, 32, "kernel"), (4096, 256, "kernel")):
        m_cap = contig_capacity(tokens, 6, experts, 128)
        assert contig_form(m_cap=m_cap, settings=auto, **dict(shape, num_groups=experts)) == form, (tokens, experts)
    big = dict(m_cap=32 * rows, n=4096, k=4096, num_groups=32, recipe="mxfp4", arch=90, alignment=128,
               lhs_dtype=jnp.float8_e4m3fn, rhs_dtype=jnp.int8)
    for settings in (auto, kernel, expand):
        assert static_supports(OP_CONTIG, "w4a8", **big, settings=settings) == (True, "")
    assert static_supports(OP_CONTIG, "w4a8", **dict(big, n=4040), settings=auto) == (True, "")
    prefix = "w4a8_prefill='expand' runs DeepGEMM's FP8 contig GEMM on the widened weights: "
    assert static_supports(OP_CONTIG, "w4a8", **dict(big, n=4040), settings=expand) == (
        False, prefix + "N must be a positive multiple of 64, got 4040")
    assert static_supports(OP_CONTIG, "w4a8", **dict(big, alignment=256), settings=expand) == (
        False, prefix + "alignment must be 128 (the kernels' BLOCK_M), got 256")


def test_contig_by_expansion_gives_the_w4a8_gemm(monkeypatch):
    """The "w4a8" contig op by expansion (the expansion's reference standing in for its Triton kernel, which
    the interpreter case checks bit for bit, and the reference FP8 GEMM for DeepGEMM's, as under the
    interpreter): the W4A8 reference GEMM's output to the fp32 summation order, padding rows 0."""
    import custom_calls.w4a8_backend as backend
    from custom_calls import KernelSettings
    from custom_calls.grouped_gemm import m_grouped_gemm_contig
    from custom_calls.triton import w4a8_expand_kernel
    from layouts.w4a8 import w4a8_to_fp8_block_lhs_order

    expanded = []

    def expand(w, s, *, widen, column_order, gate_up_interleave):
        expanded.append((w.shape, column_order, gate_up_interleave))
        return w4a8_to_fp8_block_lhs_order(w, s)

    monkeypatch.setattr(backend, "_interpreting", lambda: True)
    monkeypatch.setattr(w4a8_expand_kernel, "w4a8_expand", expand)
    rng = np.random.default_rng(11)
    g, n, k = 3, 192, 384
    codes = rng.integers(0, 16, (g, n, k), dtype=np.uint8)
    sf32 = (2.0 ** rng.integers(-20, -8, (g, n, k // 32))).astype(np.float32)
    w, sw = mxfp4_to_w4a8(pack_e2m1(jnp.asarray(codes)), jnp.asarray(sf32))
    m_indices = np.r_[[0] * 100, [-1] * 28, [1] * 128, [2] * 50, [-1] * 78, [-1] * 128].astype(np.int32)
    x = rng.standard_normal((m_indices.size, k)) * rng.uniform(0.1, 10, (m_indices.size, 1)) * (m_indices >= 0)[:, None]
    a, sa = W4A8.quantize_lhs(jnp.asarray(x.astype(np.float32)))
    kw = dict(lhs_scale=sa, rhs_scale=sw, recipe="mxfp4", arch=90, alignment=128)
    got = np.asarray(backend.grouped_gemm_contig(a, w, jnp.asarray(m_indices), **kw,
                                                 settings=KernelSettings(w4a8_prefill="expand")), np.float32)
    assert expanded == [((g, n, k // 2), "w4a8", 0)]  # the lhs's column order, w13's rows as stored
    want = np.asarray(m_grouped_gemm_contig(a, w, jnp.asarray(m_indices), **kw, lhs_order="w4a8", backend="reference"),
                      np.float32)
    rows = m_indices >= 0
    assert np.abs(want[rows]).min() > 0
    np.testing.assert_allclose(got[rows], want[rows], rtol=2**-7, atol=1e-6 * np.abs(want).max())
    assert (got[~rows] == 0).all()


# -- the layer -----------------------------------------------------------------------------------

def _v4_small(**kw):
    from moe_jax import MoEConfig

    return MoEConfig.deepseek_v4(**{**dict(num_experts=16, hidden_size=256, intermediate_size=512, top_k=4,
                                           n_shared_experts=0, arch=90), **kw})


def test_config_says_where_w4a8_runs():
    from moe_jax import MoEConfig

    cfg = _v4_small(mxfp4_sm90_form="w4a8")
    assert cfg.gemm_recipe == "mxfp4" and _v4_small().gemm_recipe == "fp8_block"
    assert cfg.gemm_recipe_on(100) == "mxfp4"  # arch 100 reads MXFP4 natively
    with pytest.raises(ValueError, match="mxfp4_sm90_form must be one of \\('fp8', 'w4a8'\\), got 'fp4'"):
        _v4_small(mxfp4_sm90_form="fp4")
    with pytest.raises(ValueError, match="needs recipe 'mxfp4' on arch 90, got recipe 'fp8_block' on arch 90"):
        MoEConfig.deepseek_v3(num_experts=16, mxfp4_sm90_form="w4a8")
    with pytest.raises(ValueError, match="got recipe 'mxfp4' on arch 100"):
        _v4_small(mxfp4_sm90_form="w4a8").__class__(**{**cfg.__dict__, "arch": 100})
    assert cfg.keeps_4bit and not _v4_small().keeps_4bit
    assert _v4_small(mxfp4_sm90_form="w4a8", layout="fused").keeps_4bit  # widened at each fused call


def test_prepared_params_stay_4bit_and_the_layer_gives_the_fp8_forms_bits():
    """prepare_params keeps the experts 4-bit (values + scale words, 0.53x the FP8 expansion's bytes);
    the reference layer on them equals the FP4 -> FP8 form's output bit for bit, contig and masked."""
    import jax

    from moe_jax import init_params, moe_forward, prepare_params

    fp8, w4a8 = _v4_small(), _v4_small(mxfp4_sm90_form="w4a8")
    ckpt = init_params(jax.random.key(0), fp8)
    p8, p4 = prepare_params(ckpt, fp8), prepare_params(ckpt, w4a8)
    assert (p4.gemm_recipe, p4.gemm_arch, p4.w13.dtype, p4.w13_scale.dtype) == ("mxfp4", 90, jnp.int8, jnp.int32)
    assert p4.w13.shape == (16, 1024, 128) and p4.w13_scale.shape == (16, 1024, 2)
    nbytes = lambda p: sum(a.nbytes for a in (p.w13, p.w13_scale, p.w2, p.w2_scale))  # noqa: E731
    assert nbytes(p4) / nbytes(p8) < 0.55
    with pytest.raises(ValueError, match="prepared as 'mxfp4' for arch 90, but config.recipe='mxfp4' needs 'fp8_block'"):
        moe_forward(jnp.zeros((4, 256), jnp.bfloat16), p4, fp8, backend="reference")
    x = jax.random.normal(jax.random.key(1), (40, 256), jnp.bfloat16)
    forward = jax.jit(moe_forward, static_argnames=("config", "layout", "backend"))
    for layout in ("contig", "masked"):
        o8 = forward(x, p8, fp8, layout=layout, backend="reference")
        o4 = forward(x, p4, w4a8, layout=layout, backend="reference")
        np.testing.assert_array_equal(np.asarray(o4).view(np.uint16), np.asarray(o8).view(np.uint16))


def test_bench_gemm_w4a8_rows_use_one_set_of_operands():
    """`bench gemm`'s W4A8 rows: the 4-bit form and the FP4 -> FP8 expansion of the same MXFP4 weights."""
    import jax

    from layouts.w4a8 import w4a8_to_fp8_block
    from moe_jax.bench.gemm_w4a8 import w4a8_weights

    w = jax.random.normal(jax.random.key(0), (2, 256, 512)) * 0.05
    w4, s4, w8, s8 = w4a8_weights(w)
    assert w4.shape == (2, 256, 256) and s4.shape == (2, 256, 4) and w8.shape == (2, 256, 512)
    wide, sf = w4a8_to_fp8_block(w4, s4)
    np.testing.assert_array_equal(np.asarray(wide).view(np.uint8), np.asarray(w8).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(sf), np.asarray(s8))


def test_bench_gemm_kernel_time_sums_the_kernels_of_a_call(monkeypatch):
    """`bench gemm`'s kernel time of a call that runs two kernels (the W4A8 contig op by expansion: the
    widening, then DeepGEMM's FP8 GEMM) is the sum of their medians, not the widening's alone; kernels
    that match no needle (an XLA fusion) are left out."""
    from moe_jax.bench import _timing, gemm

    traced = {"w4a8_expand_kernel": [3e-4, 2e-4, 2.5e-4], "sm90_fp8_gemm_1d2d_impl<...>": [6e-4, 7e-4, 6.5e-4],
              "loop_convert_fusion": [1e-5] * 3}
    monkeypatch.setattr(_timing, "trace_kernels", lambda run: traced)
    both = ("w4a8", "sm90_fp8_gemm_1d2d")
    assert gemm._kernel_s(None, both) == pytest.approx(2.5e-4 + 6.5e-4)
    assert gemm._kernel_s(None, "sm90_fp8_gemm_1d2d") == pytest.approx(6.5e-4)
    traced.pop("sm90_fp8_gemm_1d2d_impl<...>")  # the kernel form: one W4A8 kernel, the second needle unmatched
    assert gemm._kernel_s(None, both) == pytest.approx(2.5e-4)
    assert gemm._kernel_s(None, ("deep_gemm_bf16",)) is None


def test_flax_module_runs_the_4bit_form():
    """`moe_jax.nn.MoE` with mxfp4_sm90_form="w4a8": 4-bit experts, the same output bits as the FP8 form
    built from the same draws (shared expert included), staged and fused."""
    import jax
    from flax import nnx

    from moe_jax.nn import MoE

    outs = {}
    x = jax.random.normal(jax.random.key(1), (8, 256), jnp.bfloat16)
    for form in ("fp8", "w4a8"):
        for layout in ("auto", "fused"):
            module = MoE(_v4_small(mxfp4_sm90_form=form, n_shared_experts=1, layout=layout), rngs=nnx.Rngs(0))
            assert module.gemm_recipe == ("mxfp4" if form == "w4a8" else "fp8_block")
            outs[form, layout] = np.asarray(module(x)).view(np.uint16)
    for layout in ("auto", "fused"):
        np.testing.assert_array_equal(outs["w4a8", layout], outs["fp8", layout])
    # 4-bit experts take the fused layout per call too (widened at each call; FP8 ones need it prepared)
    per_call = MoE(_v4_small(mxfp4_sm90_form="w4a8", n_shared_experts=1), rngs=nnx.Rngs(0), layout="fused")
    np.testing.assert_array_equal(np.asarray(per_call(x)).view(np.uint16), outs["fp8", "fused"])
    with pytest.raises(ValueError, match=r"layout: 'fused' is chosen by MoEConfig\(layout='fused'\)"):
        MoE(_v4_small(n_shared_experts=1), rngs=nnx.Rngs(0), layout="fused")


def test_gpu_environment_asks_for_nvcc_and_triton(monkeypatch):
    """On a GPU both ops run the CUDA kernel (nvcc, the launcher, SM90) beside the Triton producers:
    without the native toolchain the registry refuses both saying why, "auto" passes over the backend,
    and so does the backend asked without an op; without Triton, Triton's reason comes first."""
    import custom_calls.deep_gemm.ops as native
    import custom_calls.w4a8_backend as w4a8
    from custom_calls.backends import resolve, unavailable_reason
    from custom_calls.grouped_gemm import OP_CONTIG, OP_MASKED

    monkeypatch.setattr(w4a8, "triton_environment", lambda platform, **static: "")
    monkeypatch.setattr(native, "environment", lambda platform, arch, settings=None: "nvcc: not found")
    dtypes = dict(lhs_dtype=jnp.float8_e4m3fn, rhs_dtype=jnp.int8, settings=None)
    contig = dict(m_cap=256, n=64, k=128, num_groups=2, recipe="mxfp4", arch=90, alignment=64, **dtypes)
    masked = dict(num_groups=2, m_pad=128, n=64, k=128, expected_m=8, recipe="mxfp4", arch=90, **dtypes)
    for op, static in ((OP_CONTIG, contig), (OP_MASKED, masked)):
        with pytest.raises(ValueError, match="backend 'w4a8' cannot run op .*: the CUDA W4A8 kernel: nvcc: not found"):
            resolve(op, "w4a8", platform="gpu", **static)
        assert resolve(op, "auto", platform="gpu", **static).backend != "w4a8"
    assert unavailable_reason("w4a8", platform="gpu") == "the CUDA W4A8 kernel: nvcc: not found"
    assert w4a8.environment("cpu", op=OP_CONTIG, **contig) == ""  # the interpreter runs the Triton kernels
    monkeypatch.setattr(w4a8, "triton_environment", lambda platform, **static: "triton: not installed")
    assert w4a8.environment("gpu", op=OP_CONTIG, **contig) == "triton: not installed"


def test_expansion_checks_its_operands_by_name():
    """`w4a8_expand` and the op `widen_w4a8_weights` refuse, naming the argument, the expected and the actual:
    a widen mode or column order they do not have, values not (G, N, K/2) int8, K not whole W4A8 blocks,
    scales of the wrong shape or dtype, a gate/up interleave that is not a positive int or does not fit N."""
    pytest.importorskip("triton")
    from custom_calls import widen_w4a8_weights
    from custom_calls.triton.w4a8_expand_kernel import w4a8_expand

    values, scales = jnp.zeros((2, 64, 128), jnp.int8), jnp.zeros((2, 64, 2), jnp.int32)
    w13 = (jnp.zeros((2, 512, 128), jnp.int8), jnp.zeros((2, 512, 2), jnp.int32))  # I = 256
    with pytest.raises(ValueError, match=r"widen: expected one of \('prmt', 'shifts'\), got 'ptx'"):
        w4a8_expand(values, scales, widen="ptx")
    cases = [((values[0], scales), {}, r"values: expected \(G, N, K/2\) int8, got \(64, 128\) int8"),
             ((values.astype(jnp.uint8), scales), {},
              r"values: expected \(G, N, K/2\) int8, got \(2, 64, 128\) uint8"),
             ((values[..., :96], scales), {}, r"values: K = 2 x 96 = 192 must be a positive multiple of 128"),
             ((values, scales[..., :1]), {}, r"scales: expected \(2, 64, 2\) int32 \(one word per row and 128 "
                                             r"columns of values \(2, 64, 128\)\), got \(2, 64, 1\) int32"),
             ((values, scales.astype(jnp.float32)), {}, r"scales: expected \(2, 64, 2\) int32 .* float32"),
             ((values, scales), dict(column_order="rows"),
              r"column_order: expected one of \('columns', 'w4a8'\), got 'rows'"),
             ((values, scales), dict(gate_up_interleave=True),
              "gate_up_interleave: expected 0 or a positive int, got True"),
             ((values, scales), dict(gate_up_interleave=8),
              r"values: gate_up_interleave=8 needs N = 2I rows \[gate; up\] with I a multiple of 128 and of 8, "
              r"got N = 64"),
             (w13, dict(gate_up_interleave=3), "with I a multiple of 128 and of 3, got N = 512")]
    for args, kw, match in cases:
        for fn in (w4a8_expand, widen_w4a8_weights):
            with pytest.raises(ValueError, match=match):
                fn(*args, **kw)


def test_widening_gives_the_fp4_to_fp8_paths_operands():
    """`widen_w4a8_weights` (reference) gives the FP4 -> FP8 load path's operands of the same checkpoint weights bit
    for bit: in column order, in the W4A8 column order, and for w13 with its rows interleaved as the fused
    kernel reads them (`interleave_gate_up` of the load path's w13, its scales [gate; up])."""
    from custom_calls import widen_w4a8_weights
    from layouts import interleave_gate_up

    codes, sf32, packed, _, _ = _operands(5, g=2, n=512, k=384)
    w, sw = mxfp4_to_w4a8(packed, jnp.asarray(sf32))
    want_w, want_s = mxfp4_to_fp8_block(packed, jnp.asarray(sf32))
    as_bytes = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
    for order, gran, expect in (("columns", 0, want_w), ("w4a8", 0, to_w4a8_lhs_order(want_w)),
                                ("columns", 8, interleave_gate_up(want_w, 8))):
        got_w, got_s = widen_w4a8_weights(w, sw, column_order=order, gate_up_interleave=gran, backend="reference")
        np.testing.assert_array_equal(as_bytes(got_w), as_bytes(expect), err_msg=f"{order}/{gran}")
        np.testing.assert_array_equal(np.asarray(got_s), np.asarray(want_s))
