"""The CUDA W4A8 kernels, masked and contig (`custom_calls.cuda.w4a8_gemm`), on an SM90 GPU: against the
XLA reference, against the Triton W4A8 kernels and DeepGEMM's FP8 kernels on the FP4 -> FP8 path's
operands (the same e4m3 values and block scales: equal within accumulation order); odd N, K not a
multiple of 512, m_pad not a multiple of the token tile, empty and full groups, padding blocks."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from custom_calls.cuda.w4a8_gemm import W4A8CudaConfig, w4a8_masked_cuda
from custom_calls.grouped_gemm import m_grouped_gemm_masked
from custom_calls.triton.w4a8_gemm_kernel import w4a8_masked
from layouts.w4a8 import from_w4a8_lhs_order, mxfp4_to_w4a8
from layouts.weight_paths import mxfp4_to_fp8_block
from test_w4a8_gpu import _contig_operands, _operands

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("g,m_pad,n,k,cfg", [
    (4, 128, 200, 384, None),
    (8, 256, 4096, 1024, W4A8CudaConfig(token_tiles=4, stages=3, min_blocks=5)),
    (3, 128, 584, 2048, W4A8CudaConfig(token_tiles=3, warpgroups=2, stages=2)),
    (3, 128, 264, 1152, W4A8CudaConfig(token_tiles=4, warpgroups=2, stages=6, min_blocks=2)),
    (2, 128, 136, 640, W4A8CudaConfig(token_tiles=1, warpgroups=2, stages=4)),
    (5, 384, 72, 128, W4A8CudaConfig(token_tiles=8, stages=2, min_blocks=1)),
])
def test_w4a8_cuda_masked(g, m_pad, n, k, cfg):
    packed, sf32, a, sa, masked_m = _operands(g * n + k + 1, g, m_pad, n, k)
    w, sw = mxfp4_to_w4a8(packed, sf32)
    valid = np.arange(m_pad)[None, :] < np.asarray(masked_m)[:, None]
    out = np.asarray(jax.jit(lambda: w4a8_masked_cuda(a, sa, w, sw, masked_m, expected_m=24, config=cfg))(),
                     np.float32)
    assert np.isfinite(out[valid]).all()
    ref = np.asarray(m_grouped_gemm_masked(a, w, masked_m, expected_m=24, lhs_scale=sa, rhs_scale=sw,
                                           recipe="mxfp4", arch=90, lhs_order="w4a8", backend="reference"),
                     np.float32)
    np.testing.assert_allclose(out[valid], ref[valid], rtol=2**-7, atol=1e-3 * np.abs(ref[valid]).max())
    others = [("Triton W4A8", np.asarray(w4a8_masked(a, sa, w, sw, masked_m, expected_m=24), np.float32))]
    if n % 64 == 0:  # DeepGEMM's N granularity
        w8, s8 = mxfp4_to_fp8_block(packed, sf32)
        others.append(("DeepGEMM FP8", np.asarray(m_grouped_gemm_masked(
            from_w4a8_lhs_order(a), w8, masked_m, expected_m=24, lhs_scale=sa, rhs_scale=s8, recipe="fp8_block",
            arch=90, backend="deep_gemm"), np.float32)))
    scale = np.abs(ref[valid]).max()
    for name, other in others:
        diff = np.abs(out[valid] - other[valid])
        print(f"CUDA W4A8 vs {name}: max |diff| {diff.max():.3e} (max |out| {scale:.3e}), "
              f"{np.mean(diff == 0) * 100:.1f} % identical")
        assert diff.max() <= 2**-7 * scale


@pytest.mark.parametrize("m_pad,cfg", [(48, W4A8CudaConfig()),
                                       (77, W4A8CudaConfig(token_tiles=3, warpgroups=2, stages=2))])
def test_w4a8_cuda_writes_exactly_the_rows_below_masked_m(m_pad, cfg):
    """Every row below masked_m is written and no other: an output filled with NaN beforehand keeps its
    other rows; m_pad not a multiple of the token tile (the op itself takes multiples of 128: here the
    kernel runs on the first m_pad rows of 128-row operands, and agrees with the reference on them)."""
    from custom_calls.native.launch import launch
    from custom_calls.cuda import w4a8_gemm as cw
    from custom_calls.native.compiler import compile_cubin
    import jax.numpy as jnp

    g, n, k = 3, 136, 256
    packed, sf32, a128, sa128, mm128 = _operands(7 + m_pad, g, 128, n, k)
    w, sw = mxfp4_to_w4a8(packed, sf32)
    masked_m = jnp.minimum(mm128, m_pad).at[1].set(m_pad)
    a, sa = a128[:, :m_pad], sa128[:, :, :-(-m_pad // 4) * 4]
    cubin = compile_cubin(cw.kernel_name(cfg, n=n, k=k, m_pad=m_pad), cw.source(cfg, n=n, k=k, m_pad=m_pad), 90)
    plan = cw.plan(cfg, str(cubin.path), g=g, m_pad=m_pad, n=n, k=k)
    fill = jnp.full((g, m_pad, n), jnp.nan, jnp.bfloat16)
    run = jax.jit(lambda fill: launch(plan, [a, sa, w, sw, masked_m, fill],
                                      [jax.ShapeDtypeStruct(fill.shape, fill.dtype)], {5: 0})[0])
    out = np.asarray(run(fill), np.float32)
    valid = np.arange(m_pad)[None, :] < np.asarray(masked_m)[:, None]
    assert np.isfinite(out[valid]).all() and np.isnan(out[~valid]).all()
    ref = np.asarray(m_grouped_gemm_masked(a128, w, masked_m, expected_m=24, lhs_scale=sa128, rhs_scale=sw,
                                           recipe="mxfp4", arch=90, lhs_order="w4a8", backend="reference"),
                     np.float32)[:, :m_pad]
    np.testing.assert_allclose(out[valid], ref[valid], rtol=2**-7, atol=1e-3 * np.abs(ref[valid]).max())


@pytest.mark.parametrize("alignment,n,k,cfg", [
    (128, 4096, 2048, None),
    (64, 200, 384, None),
    (128, 584, 1152, W4A8CudaConfig(token_tiles=8, stages=3, min_blocks=2)),
    (128, 584, 2432, W4A8CudaConfig(token_tiles=16, warpgroups=2, stages=4, min_blocks=1)),
])
def test_w4a8_cuda_contig(alignment, n, k, cfg):
    """The contig kernel writes every row of D (into a NaN-filled output): expert rows against the
    reference, the Triton contig kernel and DeepGEMM's FP8 contig kernel on the FP4 -> FP8 operands;
    padding rows, and the all-padding blocks, 0."""
    from custom_calls.cuda import w4a8_gemm as cw
    from custom_calls.grouped_gemm import m_grouped_gemm_contig
    from custom_calls.native.compiler import compile_cubin
    from custom_calls.native.launch import launch
    from custom_calls.triton.w4a8_gemm_kernel import w4a8_contig
    import jax.numpy as jnp

    g = 4
    packed, sf32, a, sa, m_indices = _contig_operands(n + k + 3, g, n, k)
    m_cap = m_indices.size
    w, sw = mxfp4_to_w4a8(packed, sf32)
    mi = jnp.asarray(m_indices)
    cfg = cfg or cw.contig_config(alignment)
    cubin = compile_cubin(cw.kernel_name(cfg, n=n, k=k, contig=True), cw.source(cfg, n=n, k=k, contig=True), 90)
    plan = cw.plan(cfg, str(cubin.path), g=g, m_pad=m_cap, n=n, k=k, contig=True)
    run = jax.jit(lambda fill: launch(plan, [a, sa, w, sw, mi, fill], [jax.ShapeDtypeStruct(fill.shape, fill.dtype)],
                                      {5: 0})[0])
    out = np.asarray(run(jnp.full((m_cap, n), jnp.nan, jnp.bfloat16)), np.float32)
    assert np.isfinite(out).all() and (out[m_indices < 0] == 0).all()
    np.testing.assert_array_equal(out, np.asarray(cw.w4a8_contig_cuda(a, sa, w, sw, mi, alignment=alignment,
                                                                      config=cfg), np.float32))
    kw = dict(lhs_scale=sa, arch=90, alignment=alignment)
    ref = np.asarray(m_grouped_gemm_contig(a, w, mi, rhs_scale=sw, recipe="mxfp4", lhs_order="w4a8",
                                           backend="reference", **kw), np.float32)
    rows = m_indices >= 0
    np.testing.assert_allclose(out[rows], ref[rows], rtol=2**-7, atol=1e-3 * np.abs(ref[rows]).max())
    others = [("Triton W4A8", np.asarray(w4a8_contig(a, sa, w, sw, mi, alignment=alignment), np.float32))]
    if alignment == 128 and n % 64 == 0:
        w8, s8 = mxfp4_to_fp8_block(packed, sf32)
        others.append(("DeepGEMM FP8", np.asarray(m_grouped_gemm_contig(
            from_w4a8_lhs_order(a), w8, mi, rhs_scale=s8, recipe="fp8_block", backend="deep_gemm", **kw), np.float32)))
    scale = np.abs(ref[rows]).max()
    for name, other in others:
        diff = np.abs(out[rows] - other[rows])
        print(f"CUDA W4A8 contig vs {name}: max |diff| {diff.max():.3e} (max |out| {scale:.3e})")
        assert diff.max() <= 2**-7 * scale


@pytest.mark.parametrize("n,k,stages,num_sms,ahead", [(4096, 2048, 6, None, False), (4096, 2048, 6, None, True),
                                                      (200, 384, 2, 3, True), (584, 1152, 7, 5, False),
                                                      (196, 128, 3, 1, True), (264, 256, 4, 2, False)])
def test_w4a8_cuda_contig_rs(n, k, stages, num_sms, ahead):
    """The persistent register-operand contig kernel writes every row of D (into a NaN-filled output): expert
    rows against the reference, and bit for bit the register-operand contig kernel (the same products, the
    same promotion), padding rows and all-padding tiles 0; a partial last weight tile (N 200, 196: not a
    multiple of 8, the scalar stores), one K block, grids of 1 to 5 blocks (each block many tiles: the ring's
    phases across tiles), each stage count, with and without the next K block widened ahead."""
    from custom_calls.cuda import w4a8_contig_rs as rs
    from custom_calls.cuda import w4a8_gemm as cw
    from custom_calls.grouped_gemm import m_grouped_gemm_contig
    from custom_calls.native.compiler import compile_cubin
    from custom_calls.native.launch import launch
    import jax.numpy as jnp

    g = 4
    packed, sf32, a, sa, m_indices = _contig_operands(n + k + 7, g, n, k)
    m_cap = m_indices.size
    w, sw = mxfp4_to_w4a8(packed, sf32)
    mi = jnp.asarray(m_indices)
    cfg = rs.W4A8RsConfig(stages, num_sms, ahead)
    cubin = compile_cubin(rs.kernel_name(cfg, n=n, k=k), rs.source(cfg, n=n, k=k), 90)
    plan = rs.plan(cfg, str(cubin.path), g=g, m_cap=m_cap, n=n, k=k)
    run = jax.jit(lambda fill: launch(plan, [a, sa, w, sw, mi, fill], [jax.ShapeDtypeStruct(fill.shape, fill.dtype)],
                                      {5: 0})[0])
    out = np.asarray(run(jnp.full((m_cap, n), jnp.nan, jnp.bfloat16)), np.float32)
    assert np.isfinite(out).all() and (out[m_indices < 0] == 0).all()
    ref = np.asarray(m_grouped_gemm_contig(a, w, mi, lhs_scale=sa, rhs_scale=sw, recipe="mxfp4", arch=90,
                                           alignment=128, lhs_order="w4a8", backend="reference"), np.float32)
    rows = m_indices >= 0
    np.testing.assert_allclose(out[rows], ref[rows], rtol=2**-7, atol=1e-3 * np.abs(ref[rows]).max())
    other = np.asarray(cw.w4a8_contig_cuda(a, sa, w, sw, mi, alignment=128), np.float32)
    diff = np.abs(out[rows] - other[rows])
    print(f"persistent register-operand vs register-operand contig: max |diff| {diff.max():.3e}, "
          f"{np.mean(diff == 0) * 100:.1f} % identical")
    np.testing.assert_array_equal(out.view(np.uint32), other.view(np.uint32))
