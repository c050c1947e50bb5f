"""The W4A8 masked grouped GEMM on a CUDA GPU (SM90): the PTX widening against the integer-shift one (bit
for bit), against the XLA reference, and against DeepGEMM's FP8 kernel on the FP4 -> FP8 path's
operands (the same e4m3 values: equal within accumulation order); odd N, K not a multiple of 512,
empty and full groups."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from custom_calls import KernelSettings
from custom_calls.grouped_gemm import m_grouped_gemm_masked
from custom_calls.triton.w4a8_gemm_kernel import W4A8Config, w4a8_masked
from layouts import gemm_format
from layouts.fp4 import pack_e2m1
from layouts.w4a8 import from_w4a8_lhs_order, mxfp4_to_w4a8
from layouts.weight_paths import mxfp4_to_fp8_block

pytestmark = pytest.mark.gpu


def _operands(seed, g, m_pad, n, k):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (g, n, k), dtype=np.uint8)
    # a spread of 20 exponents: every e4m3 table, subnormal and all-zero ones included
    sf32 = (2.0 ** rng.integers(-24, -4, (g, n, k // 32))).astype(np.float32)
    packed, sf32 = pack_e2m1(jnp.asarray(codes)), jnp.asarray(sf32)
    x = rng.standard_normal((g, m_pad, k)) * rng.uniform(0.1, 10, (g, m_pad, 1))
    a, sa = gemm_format("mxfp4", 90).quantize_lhs(jnp.asarray(x.astype(np.float32)))
    masked_m = jnp.asarray(rng.integers(1, m_pad + 1, g).astype(np.int32)).at[0].set(0).at[-1].set(m_pad)
    return packed, sf32, a, sa, masked_m


def _contig_operands(seed, g, n, k, m_cap=1024):
    """Contig operands: MXFP4 weights (seed), rows grouped by expert (segments of 300, 128 and 5 rows;
    expert 2 has none), tokens (seed k) zero on the padding rows -> (packed, sf32, a, sa, m_indices)."""
    packed, sf32, _, _, _ = _operands(seed, g, 128, n, k)
    m_indices = np.full(m_cap, -1, np.int32)
    m_indices[:300], m_indices[384:512], m_indices[640:645] = 3, 0, 1
    x = np.random.default_rng(k).standard_normal((m_cap, k)) * (m_indices >= 0)[:, None]
    a, sa = gemm_format("mxfp4", 90).quantize_lhs(jnp.asarray(x.astype(np.float32)))
    return packed, sf32, a, sa, m_indices


@pytest.mark.parametrize("g,m_pad,n,k,cfg", [(4, 128, 200, 384, None), (8, 256, 4096, 1024, None),
                                             (3, 128, 584, 2048, W4A8Config(block_n=64, block_m=64)),
                                             (2, 384, 256, 640, W4A8Config(block_n=128, block_m=128, num_stages=3))])
def test_w4a8_masked_on_gpu(g, m_pad, n, k, cfg):
    packed, sf32, a, sa, masked_m = _operands(g * n + k, g, m_pad, n, k)
    w, sw = mxfp4_to_w4a8(packed, sf32)
    run = jax.jit(lambda widen: w4a8_masked(a, sa, w, sw, masked_m, expected_m=32, config=cfg, widen=widen),
                  static_argnums=0)
    fast, shifts = np.asarray(run("prmt"), np.float32), np.asarray(run("shifts"), np.float32)
    valid = np.arange(m_pad)[None, :] < np.asarray(masked_m)[:, None]
    np.testing.assert_array_equal(fast[valid].view(np.uint32), shifts[valid].view(np.uint32))
    ref = np.asarray(m_grouped_gemm_masked(a, w, masked_m, expected_m=32, lhs_scale=sa, rhs_scale=sw,
                                           recipe="mxfp4", arch=90, lhs_order="w4a8", backend="reference"),
                     np.float32)
    assert np.isfinite(fast[valid]).all()
    np.testing.assert_allclose(fast[valid], ref[valid], rtol=2**-7, atol=1e-3 * np.abs(ref[valid]).max())
    # the op through the registry ("auto" on a GPU: backend "w4a8") runs the CUDA masked kernel
    from custom_calls.cuda.w4a8_gemm import w4a8_masked_cuda

    auto = np.asarray(m_grouped_gemm_masked(a, w, masked_m, expected_m=32, lhs_scale=sa, rhs_scale=sw,
                                            recipe="mxfp4", arch=90, lhs_order="w4a8", backend="auto"), np.float32)
    cuda = np.asarray(w4a8_masked_cuda(a, sa, w, sw, masked_m, expected_m=32), np.float32)
    np.testing.assert_array_equal(auto[valid].view(np.uint32), cuda[valid].view(np.uint32))


def test_w4a8_equals_deep_gemm_on_the_fp4_to_fp8_operands():
    """DeepGEMM's FP8 masked kernel on `mxfp4_to_fp8_block`'s operands computes on the same e4m3 values
    and block scales (its lhs the same bytes in column order): the outputs differ only by accumulation
    order (bf16 rounding of the fp32 sums)."""
    g, m_pad, n, k = 8, 128, 1024, 2048
    packed, sf32, a, sa, masked_m = _operands(5, g, m_pad, n, k)
    w, sw = mxfp4_to_w4a8(packed, sf32)
    w8, s8 = mxfp4_to_fp8_block(packed, sf32)
    kw = dict(expected_m=32, lhs_scale=sa, arch=90)
    d4 = np.asarray(m_grouped_gemm_masked(a, w, masked_m, rhs_scale=sw, recipe="mxfp4", lhs_order="w4a8",
                                          backend="w4a8", **kw), np.float32)
    d8 = np.asarray(m_grouped_gemm_masked(from_w4a8_lhs_order(a), w8, masked_m, rhs_scale=s8, recipe="fp8_block",
                                          backend="deep_gemm", **kw), np.float32)
    valid = np.arange(m_pad)[None, :] < np.asarray(masked_m)[:, None]
    diff = np.abs(d4[valid] - d8[valid])
    scale = np.abs(d8[valid]).max()
    print(f"W4A8 vs DeepGEMM FP8 on the FP4->FP8 operands: max |diff| {diff.max():.3e} "
          f"(max |out| {scale:.3e}), {np.mean(diff == 0) * 100:.1f} % of elements identical")
    assert diff.max() <= 2**-7 * scale


@pytest.mark.parametrize("alignment,n,k", [(128, 4096, 2048), (64, 200, 384)])
def test_w4a8_contig_on_gpu(alignment, n, k):
    """Contig, the Triton kernel: PTX widening against the integer-shift one bit for bit, the reference within
    bf16 rounding, padding rows 0, and DeepGEMM's FP8 contig kernel on the FP4 -> FP8 operands within
    accumulation order; the op through the registry is the persistent CUDA kernel at alignment 128
    (bit-identical to the per-block register-operand one: the same sums in the same order) and the per-block
    kernel at 64, within bf16 rounding of the reference."""
    from custom_calls.grouped_gemm import m_grouped_gemm_contig
    from custom_calls.triton.w4a8_gemm_kernel import w4a8_contig

    packed, sf32, a, sa, m_indices = _contig_operands(n + k, 4, n, k)
    w, sw = mxfp4_to_w4a8(packed, sf32)
    mi = jnp.asarray(m_indices)
    run = jax.jit(lambda widen: w4a8_contig(a, sa, w, sw, mi, alignment=alignment, widen=widen), static_argnums=0)
    fast, shifts = np.asarray(run("prmt"), np.float32), np.asarray(run("shifts"), np.float32)
    np.testing.assert_array_equal(fast.view(np.uint32), shifts.view(np.uint32))
    assert (fast[m_indices < 0] == 0).all() and np.isfinite(fast).all()
    kw = dict(lhs_scale=sa, arch=90, alignment=alignment)
    w4 = dict(rhs_scale=sw, recipe="mxfp4", lhs_order="w4a8")
    ref = np.asarray(m_grouped_gemm_contig(a, w, mi, backend="reference", **w4, **kw), np.float32)
    np.testing.assert_allclose(fast, ref, rtol=2**-7, atol=1e-3 * np.abs(ref).max())
    # the op through the registry ("auto" on a GPU: backend "w4a8") runs a CUDA contig kernel
    from custom_calls.cuda.w4a8_contig_rs import w4a8_contig_rs
    from custom_calls.cuda.w4a8_gemm import w4a8_contig_cuda

    auto = np.asarray(m_grouped_gemm_contig(a, w, mi, backend="auto", **w4, **kw), np.float32)
    cuda = np.asarray(w4a8_contig_cuda(a, sa, w, sw, mi, alignment=alignment), np.float32)
    np.testing.assert_array_equal(auto.view(np.uint32), cuda.view(np.uint32))
    if alignment % 128 == 0:
        persistent = np.asarray(w4a8_contig_rs(a, sa, w, sw, mi, alignment=alignment), np.float32)
        np.testing.assert_array_equal(persistent.view(np.uint32), cuda.view(np.uint32))
    np.testing.assert_allclose(cuda, ref, rtol=2**-7, atol=1e-3 * np.abs(ref).max())
    assert (cuda[m_indices < 0] == 0).all()
    if alignment == 128:
        w8, s8 = mxfp4_to_fp8_block(packed, sf32)
        d8 = np.asarray(m_grouped_gemm_contig(from_w4a8_lhs_order(a), w8, mi, rhs_scale=s8, recipe="fp8_block",
                                              backend="deep_gemm", **kw), np.float32)
        rows = m_indices >= 0
        diff = np.abs(fast[rows] - d8[rows])
        print(f"W4A8 contig vs DeepGEMM FP8: max |diff| {diff.max():.3e} (max |out| {np.abs(d8).max():.3e})")
        assert diff.max() <= 2**-7 * np.abs(d8).max()


@pytest.mark.parametrize("n,k", [(200, 384), (4096, 2048)])
def test_w4a8_expand_then_deep_gemm_on_gpu(n, k):
    """Prefill by expansion: the Triton expansion (PTX byte permutes) equals its reference bit for bit
    (odd N: a partial last row tile), and DeepGEMM's FP8 contig GEMM on the expanded weights with the lhs
    in the W4A8 column order agrees with the W4A8 contig kernel within accumulation order; the registry's
    contig op by expansion (`KernelSettings.w4a8_prefill="expand"`) is that pair, bit for bit."""
    from custom_calls.grouped_gemm import m_grouped_gemm_contig
    from custom_calls.triton.w4a8_expand_kernel import w4a8_expand
    from layouts.w4a8 import w4a8_to_fp8_block_lhs_order

    packed, sf32, a, sa, m_indices = _contig_operands(n + k + 7, 4, n, k)
    w, sw = mxfp4_to_w4a8(packed, sf32)
    w8, s8 = jax.jit(w4a8_expand)(w, sw)
    want_w, want_s = w4a8_to_fp8_block_lhs_order(w, sw)
    np.testing.assert_array_equal(np.asarray(w8).view(np.uint8), np.asarray(want_w).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(s8), np.asarray(want_s))
    if n % 64:  # DeepGEMM's N granularity
        return
    mi = jnp.asarray(m_indices)
    kw = dict(lhs_scale=sa, arch=90, alignment=128)
    d8 = np.asarray(m_grouped_gemm_contig(a, w8, mi, rhs_scale=s8, recipe="fp8_block", backend="deep_gemm", **kw),
                    np.float32)
    w4 = dict(rhs_scale=sw, recipe="mxfp4", lhs_order="w4a8")
    d4 = np.asarray(m_grouped_gemm_contig(a, w, mi, backend="auto", **w4, **kw,
                                          settings=KernelSettings(w4a8_prefill="kernel")), np.float32)
    rows = m_indices >= 0
    diff = np.abs(d8[rows] - d4[rows])
    print(f"expand + DeepGEMM FP8 vs W4A8 contig: max |diff| {diff.max():.3e} (max |out| {np.abs(d4).max():.3e})")
    assert diff.max() <= 2**-7 * np.abs(d4[rows]).max()
    # the registry's contig op by expansion is that pair
    by_expansion = m_grouped_gemm_contig(a, w, mi, backend="w4a8", **w4, **kw,
                                         settings=KernelSettings(w4a8_prefill="expand"))
    np.testing.assert_array_equal(np.asarray(by_expansion, np.float32), d8)
