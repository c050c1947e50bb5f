"""`bench gemm`'s W4A8 rows: MXFP4 weights kept 4-bit (backend "w4a8": the CUDA masked kernel; the contig op
as `KernelSettings.w4a8_prefill` chooses, the persistent contig kernel or the widening then DeepGEMM's FP8
GEMM, whose kernel time is both kernels') beside DeepGEMM's FP8 kernel on the FP4 -> FP8 expansion of the
same weights, at each contig and masked shape.

The weights are the FP8 rows' random weights quantized to MXFP4; both rows compute on the same
e4m3 operands and block scales (`layouts.w4a8`; the W4A8 row's tokens are the FP8 row's bytes in the
W4A8 column order, converted before timing), so "err" is each row's difference to the FP8
expansion's output: accumulation order only. Bytes (masked): the weights as each form stores them
(values + scales), plus the real activation rows and output rows, as the FP8 row counts them.
"""

from __future__ import annotations

from typing import Any, Callable


def w4a8_weights(w: Any) -> tuple[Any, Any, Any, Any]:
    """w (G, N, K) f32 -> (W4A8 values, scale words, FP4->FP8 e4m3 values, their block scales)."""
    import jax

    import layouts
    from layouts.w4a8 import mxfp4_to_w4a8

    packed, sf32 = jax.jit(layouts.quantize_mxfp4)(w)
    w4, s4 = jax.jit(mxfp4_to_w4a8)(packed, sf32)
    w8, s8 = jax.jit(layouts.mxfp4_to_fp8_block)(packed, sf32)
    return w4, s4, w8, s8


def bench_w4a8(kind: str, shape: str, w: Any, lhs: tuple, row: Callable, timeit: Callable, *, flops: float,
               act_bytes: int, sustained_iters: int, step: Callable) -> None:
    """Two rows at one shape: "deep_gemm fp8 (FP4->FP8)" and "w4a8" (the registry's W4A8 backend).
    kind: "contig" (lhs = (qa, image, m_indices)) or "masked" (lhs = (qa (G, m_pad, K), image, masked_m,
    expected_m)); act_bytes: activation and output bytes a masked call moves (None of the bytes
    columns for contig)."""
    import jax

    from custom_calls.grouped_gemm import m_grouped_gemm_contig, m_grouped_gemm_masked
    from custom_calls.w4a8_backend import BACKEND as W4A8
    from layouts import gemm_format
    from layouts.w4a8 import to_w4a8_lhs_order
    from moe_jax.bench._cli import rel_errors

    step("w4a8 weights")
    w4, s4, w8, s8 = w4a8_weights(w)
    if kind == "contig":
        qa, img, m_idx = lhs

        def gemm(a, b, sb, recipe, backend):
            return jax.jit(lambda: m_grouped_gemm_contig(a, b, m_idx, lhs_scale=img, rhs_scale=sb, recipe=recipe,
                                                         arch=90, lhs_order=gemm_format(recipe, 90).lhs_order,
                                                         backend=backend, assume_canonical=True))
    else:
        qa, img, masked_m, em = lhs

        def gemm(a, b, sb, recipe, backend):
            return jax.jit(lambda: m_grouped_gemm_masked(a, b, masked_m, expected_m=em, lhs_scale=img, rhs_scale=sb,
                                                         recipe=recipe, arch=90,
                                                         lhs_order=gemm_format(recipe, 90).lhs_order,
                                                         backend=backend, assume_canonical=True))
    fp8 = gemm(qa, w8, s8, "fp8_block", "deep_gemm")
    w4a8 = gemm(jax.block_until_ready(jax.jit(to_w4a8_lhs_order)(qa)), w4, s4, "mxfp4", W4A8)
    step("deep_gemm fp8 on the FP4->FP8 expansion")
    want = jax.block_until_ready(fp8())
    valid = (slice(None), slice(0, lhs[3])) if kind == "masked" else (slice(None),)
    # the W4A8 contig op may widen the weights and then run DeepGEMM's FP8 GEMM (w4a8_prefill): both kernels
    for impl, f, b, sb, needle in (("deep_gemm fp8 (FP4->FP8)", fp8, w8, s8, "sm90_fp8_gemm_1d2d"),
                                   (W4A8, w4a8, w4, s4, ("w4a8", "sm90_fp8_gemm_1d2d"))):
        step(impl)
        out = jax.block_until_ready(f())
        iters = sustained_iters * (4 if kind == "masked" else 1)
        weight_bytes = b.nbytes + sb.nbytes
        row(impl, kind, shape, timeit(f, (), sustained_iters=iters, kernel=needle), flops,
            bytes_=weight_bytes + act_bytes if kind == "masked" else None,
            err=rel_errors(out[valid], want[valid]), note="err: vs the FP4->FP8 expansion's output")
