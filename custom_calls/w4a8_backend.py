"""The "w4a8" backend: the W4A8 grouped GEMMs behind `m_grouped_gemm_contig` / `m_grouped_gemm_masked`,
for recipe mxfp4 kept 4-bit on arch 90 (`layouts.w4a8`). A backend of its own so that "triton" keeps
meaning the layer's non-GEMM stages (whose GEMM stage runs the reference); "auto" tries it after
DeepGEMM, which has no W4A8 kernel. Registered when the registry first needs it.

Kernels: on an SM90 GPU masked (decode) runs the register-operand CUDA kernel (`custom_calls.cuda.w4a8_gemm`:
the weights go from registers into the tensor core) at `heuristic_config(expected_m)`; contig (prefill)
runs the persistent one (`custom_calls.cuda.w4a8_contig_rs`: each widened weight fragment feeds 128 tokens,
measured faster) where the alignment is a multiple of its 128-row tiles, else the per-block register-operand
kernel at `contig_config(alignment)`; the two compute the same sums in the same order (bit-identical outputs
in the GPU tests). Or contig runs by expansion (`KernelSettings.w4a8_prefill`,
`contig_form`): the weights widened to a temporary FP8 copy in the W4A8 column order
(`custom_calls.triton.w4a8_expand_kernel`), then DeepGEMM's FP8 contig GEMM, whose lhs the layer already
writes in that order; where many rows share each expert the tensor core bounds the GEMM and the FP8
kernel's speed pays for the copy. The Triton kernels of the same ops
(`custom_calls.triton.w4a8_gemm_kernel`, measured slower: BENCHMARKS.md) stay as the CPU path. Under
Triton's interpreter (CPU tests) both layouts run them: they read the same weight format and compute
the same sums, and the GPU tests compare them with the CUDA kernel. The GPU needs what "triton" needs
(the layer's producers) and what "deep_gemm" needs (nvcc, the launcher, an SM90 device). The backend also
widens whole weights to FP8 for the fused op (`custom_calls.w4a8_widen`: the expansion's Triton kernel in
column order), which needs Triton only.
"""

from __future__ import annotations

import importlib

import jax

from custom_calls.backends import register, set_environment
from custom_calls.settings import KernelSettings, resolve_settings
from custom_calls.triton.support import environment as triton_environment
from custom_calls.triton.support import supports_w4a8_contig, supports_w4a8_masked
from custom_calls.w4a8_widen import OP as WIDEN_OP

BACKEND = "w4a8"
# Rows of contig capacity per expert (M_cap / G) from which w4a8_prefill="auto" expands: there the GEMM is
# bound by the tensor core, where DeepGEMM's FP8 kernel is about twice the W4A8 kernels' speed, and the
# expansion (one read of the 4-bit weights, one write of the FP8 copy) costs less than it saves
# (BENCHMARKS.md, "W4A8 prefill by expansion": the GEMMs 1.36-1.38x faster at V4's 4096-token capacity, 892 rows; a
# tie at 2048 tokens, 508, where the kernel form keeps the memory). With fewer rows the weights' bytes bound the
# GEMM and the 4-bit kernel reads half of them.
EXPAND_MIN_ROWS_PER_EXPERT = 512


def _interpreting() -> bool:
    from custom_calls.triton.interpret import interpreting

    return interpreting()


def _widen() -> str:
    # the interpreter runs no PTX: there the same bytes come from integer shifts (tests compare both)
    return "shifts" if _interpreting() else "prmt"


def environment(platform: str, *, op: str | None = None, settings=None, **static) -> str:
    """The registry's environment check: Triton's (the interpreter on the CPU) and on a GPU, for the GEMMs,
    the native toolchain and an SM90 device (their CUDA kernels; the widening is a Triton kernel only)."""
    reason = triton_environment(platform, **static)
    if reason or platform != "gpu" or op == WIDEN_OP:
        return reason
    from custom_calls.deep_gemm.ops import environment as native_environment

    reason = native_environment(platform, arch=90, settings=settings)
    return f"the CUDA W4A8 kernel: {reason}" if reason else ""


def _expand_reason(*, m_cap: int, n: int, k: int, num_groups: int, alignment: int) -> str:
    """Why DeepGEMM's FP8 contig GEMM cannot take the expanded weights ("" if it can)."""
    import jax.numpy as jnp

    from custom_calls.deep_gemm.ops import static_supports_contig

    ok, reason = static_supports_contig(m_cap=m_cap, n=n, k=k, num_groups=num_groups, recipe="fp8_block", arch=90,
                                        alignment=alignment, lhs_dtype=jnp.float8_e4m3fn, rhs_dtype=jnp.float8_e4m3fn)
    return "" if ok else f"w4a8_prefill='expand' runs DeepGEMM's FP8 contig GEMM on the widened weights: {reason}"


def contig_form(*, m_cap: int, n: int, k: int, num_groups: int, alignment: int,
                settings: KernelSettings | None = None) -> str:
    """How the contig op runs these static shapes: "kernel" (the 4-bit weights widened inside the GEMM) or
    "expand" (`KernelSettings.w4a8_prefill`; "auto": "expand" from `EXPAND_MIN_ROWS_PER_EXPERT` rows of
    capacity per expert, where DeepGEMM takes the shapes)."""
    mode = resolve_settings(settings).w4a8_prefill
    if mode != "auto":
        return mode
    # DeepGEMM's shape check only where the rows ask for the expansion (it imports the DeepGEMM host code)
    expand = (m_cap // max(num_groups, 1) >= EXPAND_MIN_ROWS_PER_EXPERT
              and not _expand_reason(m_cap=m_cap, n=n, k=k, num_groups=num_groups, alignment=alignment))
    return "expand" if expand else "kernel"


def supports_contig(*, m_cap: int, n: int, k: int, num_groups: int, recipe: str, arch: int, alignment: int,
                    settings: KernelSettings | None = None, **static) -> tuple[bool, str]:
    """`supports_w4a8_contig`, and with w4a8_prefill='expand' what DeepGEMM's FP8 contig GEMM takes."""
    ok, reason = supports_w4a8_contig(k=k, recipe=recipe, arch=arch, alignment=alignment, **static)
    if ok and resolve_settings(settings).w4a8_prefill == "expand":
        reason = _expand_reason(m_cap=m_cap, n=n, k=k, num_groups=num_groups, alignment=alignment)
        ok = not reason
    return ok, reason


def grouped_gemm_contig(lhs: jax.Array, rhs: jax.Array, m_indices: jax.Array, *, lhs_scale: jax.Array,
                        rhs_scale: jax.Array, recipe: str, arch: int, alignment: int, settings=None) -> jax.Array:
    """As `custom_calls.grouped_gemm.m_grouped_gemm_contig` for the W4A8 form of mxfp4 on arch 90:
    lhs (M_cap, K) e4m3, rhs (G, N, K/2) int8 words, rhs_scale (G, N, K/128) int32 -> (M_cap, N) bf16.
    By expansion (`contig_form`) a temporary (G, N, K) e4m3 copy of rhs lives for the call."""
    del recipe, arch  # one format (supports_w4a8_contig)
    g, n, _ = rhs.shape
    form = contig_form(m_cap=lhs.shape[0], n=n, k=lhs.shape[1], num_groups=g, alignment=alignment, settings=settings)
    if form == "expand":
        from custom_calls.grouped_gemm import m_grouped_gemm_contig

        # the lhs is in the W4A8 column order (the layer's producers write it so): the weights follow
        wide, wide_scale = widen_weights(rhs, rhs_scale, column_order="w4a8", gate_up_interleave=0)
        # the reference GEMM under the interpreter: the CPU tests' stand-in for DeepGEMM
        return m_grouped_gemm_contig(lhs, wide, m_indices, lhs_scale=lhs_scale, rhs_scale=wide_scale,
                                     recipe="fp8_block", arch=90, alignment=alignment, assume_canonical=True,
                                     backend="reference" if _interpreting() else "deep_gemm", settings=settings)
    if _interpreting():
        from custom_calls.triton import w4a8_gemm_kernel

        return w4a8_gemm_kernel.w4a8_contig(lhs, lhs_scale, rhs, rhs_scale, m_indices, alignment=alignment,
                                            widen=_widen())
    from custom_calls.cuda import w4a8_contig_rs
    from custom_calls.cuda.w4a8_gemm import w4a8_contig_cuda

    if alignment % w4a8_contig_rs.BLOCK == 0:
        return w4a8_contig_rs.w4a8_contig_rs(lhs, lhs_scale, rhs, rhs_scale, m_indices, alignment=alignment)
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


def widen_weights(values: jax.Array, scales: jax.Array, *, column_order: str, gate_up_interleave: int):
    """`custom_calls.w4a8_widen.widen_w4a8_weights` by the Triton kernel (`w4a8_expand_kernel`)."""
    from custom_calls.triton.w4a8_expand_kernel import w4a8_expand

    return w4a8_expand(values, scales, widen=_widen(), column_order=column_order,
                       gate_up_interleave=gate_up_interleave)


def _register() -> None:
    gemm = importlib.import_module("custom_calls.grouped_gemm")
    register(gemm.OP_CONTIG, BACKEND, grouped_gemm_contig, supports_contig)
    register(gemm.OP_MASKED, BACKEND, grouped_gemm_masked, supports_w4a8_masked)
    register(WIDEN_OP, BACKEND, widen_weights)
    set_environment(BACKEND, environment)


_register()

__all__ = ["BACKEND", "EXPAND_MIN_ROWS_PER_EXPERT", "contig_form", "grouped_gemm_contig", "grouped_gemm_masked",
           "supports_contig", "widen_weights"]
