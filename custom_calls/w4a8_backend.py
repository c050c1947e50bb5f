"""The "w4a8" backend: the W4A8 grouped GEMMs behind `m_grouped_gemm_contig` / `m_grouped_gemm_masked`,
for recipe mxfp4 kept 4-bit on arch 90 (`layouts.w4a8`). A backend of its own so that "triton" keeps
meaning the layer's non-GEMM stages (whose GEMM stage runs the reference); "auto" tries it after
DeepGEMM, which has no W4A8 kernel. Registered when the registry first needs it.

Kernels: on an SM90 GPU masked (decode) runs the register-operand CUDA kernel (`custom_calls.cuda.w4a8_gemm`:
the weights go from registers into the tensor core) at `heuristic_config(expected_m)`; contig (prefill)
runs the warp-specialized one (`custom_calls.cuda.w4a8_contig_ws`: the weight tile widened once into
shared memory for 128 tokens, measured faster) where the alignment is a multiple of its 128-row blocks,
else the register-operand kernel at `contig_config(alignment)`; the two compute the same sums in the same
order (bit-identical outputs in the GPU tests). The Triton kernels of the same ops
(`custom_calls.triton.w4a8_gemm_kernel`, measured slower: BENCHMARKS.md) stay as the CPU path. Under
Triton's interpreter (CPU tests) both layouts run them: they read the same weight format and compute
the same sums, and the GPU tests compare them with the CUDA kernel. The GPU needs what "triton" needs
(the layer's producers) and what "deep_gemm" needs (nvcc, the launcher, an SM90 device).
"""

from __future__ import annotations

import importlib

import jax

from custom_calls.backends import register, set_environment
from custom_calls.triton.support import environment as triton_environment
from custom_calls.triton.support import supports_w4a8_contig, supports_w4a8_masked

BACKEND = "w4a8"


def _interpreting() -> bool:
    from custom_calls.triton.interpret import interpreting

    return interpreting()


def _widen() -> str:
    # the interpreter runs no PTX: there the same bytes come from integer shifts (tests compare both)
    return "shifts" if _interpreting() else "prmt"


def environment(platform: str, *, op: str | None = None, settings=None, **static) -> str:
    """The registry's environment check: Triton's (the interpreter on the CPU) and on a GPU the native
    toolchain and an SM90 device (the CUDA kernels of both ops)."""
    del op  # both ops need the same
    reason = triton_environment(platform, **static)
    if reason or platform != "gpu":
        return reason
    from custom_calls.deep_gemm.ops import environment as native_environment

    reason = native_environment(platform, arch=90, settings=settings)
    return f"the CUDA W4A8 kernel: {reason}" if reason else ""


def grouped_gemm_contig(lhs: jax.Array, rhs: jax.Array, m_indices: jax.Array, *, lhs_scale: jax.Array,
                        rhs_scale: jax.Array, recipe: str, arch: int, alignment: int, settings=None) -> jax.Array:
    """As `custom_calls.grouped_gemm.m_grouped_gemm_contig` for the W4A8 form of mxfp4 on arch 90:
    lhs (M_cap, K) e4m3, rhs (G, N, K/2) int8 words, rhs_scale (G, N, K/128) int32 -> (M_cap, N) bf16."""
    del recipe, arch, settings  # one format (supports_w4a8_contig); no tuning settings of its own
    if _interpreting():
        from custom_calls.triton import w4a8_gemm_kernel

        return w4a8_gemm_kernel.w4a8_contig(lhs, lhs_scale, rhs, rhs_scale, m_indices, alignment=alignment,
                                            widen=_widen())
    from custom_calls.cuda import w4a8_contig_ws
    from custom_calls.cuda.w4a8_gemm import w4a8_contig_cuda

    if alignment % w4a8_contig_ws.BLOCK == 0:
        return w4a8_contig_ws.w4a8_contig_ws(lhs, lhs_scale, rhs, rhs_scale, m_indices, alignment=alignment)
    return w4a8_contig_cuda(lhs, lhs_scale, rhs, rhs_scale, m_indices, alignment=alignment)


def grouped_gemm_masked(lhs: jax.Array, rhs: jax.Array, masked_m: jax.Array, *, expected_m: int,
                        lhs_scale: jax.Array, rhs_scale: jax.Array, recipe: str, arch: int, settings=None) -> jax.Array:
    """As `custom_calls.grouped_gemm.m_grouped_gemm_masked` for the W4A8 form of mxfp4 on arch 90:
    lhs (G, m_pad, K) e4m3, rhs (G, N, K/2) int8 words, rhs_scale (G, N, K/128) int32 -> (G, m_pad, N) bf16."""
    del recipe, arch, settings  # one format (supports_w4a8_masked); no tuning settings of its own
    if _interpreting():
        from custom_calls.triton import w4a8_gemm_kernel

        return w4a8_gemm_kernel.w4a8_masked(lhs, lhs_scale, rhs, rhs_scale, masked_m, expected_m=expected_m,
                                            widen=_widen())
    from custom_calls.cuda.w4a8_gemm import w4a8_masked_cuda

    return w4a8_masked_cuda(lhs, lhs_scale, rhs, rhs_scale, masked_m, expected_m=expected_m)


def _register() -> None:
    gemm = importlib.import_module("custom_calls.grouped_gemm")
    register(gemm.OP_CONTIG, BACKEND, grouped_gemm_contig, supports_w4a8_contig)
    register(gemm.OP_MASKED, BACKEND, grouped_gemm_masked, supports_w4a8_masked)
    set_environment(BACKEND, environment)


_register()

__all__ = ["BACKEND", "grouped_gemm_contig", "grouped_gemm_masked"]
