"""Dense GEMM `gemm_nt`: D = A . B^T for one weight matrix ("nt": A (M, K) K-major, B (N, K)
K-major), bf16 output: the shared expert's GEMMs.

Operand formats: `layouts.gemm_format(recipe, arch)` with one group (the rhs scale is the grouped
GEMM's rhs scale without its leading axis). The reference dequantizes both operands as the format
states, multiplies in fp32 and rounds to bf16, as the grouped GEMM references do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from custom_calls.backends import declare_op, resolve
from custom_calls.settings import KernelSettings, resolve_settings
from layouts import GemmFormat, gemm_format, store_as
from layouts.checks import check_rank

OP = "gemm_nt"
_HI = jax.lax.Precision.HIGHEST


def _reference(lhs, rhs, *, lhs_scale, rhs_scale, recipe, arch, settings=None):
    del settings  # how kernels are chosen and launched; the reference has none
    fmt = gemm_format(recipe, arch)
    a = fmt.dequantize_lhs(lhs, lhs_scale)  # (M, K)
    b = fmt.dequantize_rhs(rhs[None], None if rhs_scale is None else rhs_scale[None])[0]  # (N, K)
    d = jnp.einsum("mk,nk->mn", a, b, precision=_HI, preferred_element_type=jnp.float32)
    return store_as(d, jnp.bfloat16)


# jitted: one fused computation per static configuration, also when called eagerly
declare_op(OP, stage="gemm", static_args=("m", "n", "k", "recipe", "arch", "lhs_dtype", "rhs_dtype", "settings"),
           reference=jax.jit(_reference, static_argnames=("recipe", "arch", "settings")))


def check_gemm_nt(lhs, rhs, lhs_scale, rhs_scale, fmt: GemmFormat) -> tuple[int, int, int]:
    """Trace-time checks of a dense GEMM call against `fmt` (`GemmFormat.check_operands` with one
    ungrouped weight); returns (M, N, K). Errors name the argument, the expected and the actual value."""
    check_rank("lhs", lhs, 2, "(M, K)")
    m, k, _, n = fmt.check_operands(lhs, rhs, lhs_scale, rhs_scale, grouped=False)
    return m, n, k


def gemm_nt(lhs: jax.Array, rhs: jax.Array, *, lhs_scale: jax.Array | None = None,
            rhs_scale: jax.Array | None = None, recipe: str, arch: int,
            backend: str | None = None, settings: KernelSettings | None = None) -> jax.Array:
    """Dense GEMM D = lhs . rhs^T.

    lhs: (M, K) bf16 | e4m3 (+ its scale image `lhs_scale`, `GemmFormat.lhs_scale_shape(M, K)`);
    rhs: (N, K) bf16 | e4m3 (+ `rhs_scale`, `GemmFormat.rhs_scale_shape(1, N, K)` without the
    leading 1: (ceil(N/128), ceil(K/128)) f32 blocks for fp8_block on arch 90) -> (M, N) bf16.
    settings: `custom_calls.KernelSettings` for an accelerated backend (None: the environment's).
    """
    fmt = gemm_format(recipe, arch)
    if fmt.rhs_k_pack != 1:
        raise ValueError(f"recipe: gemm_nt takes unpacked weights (bf16 or e4m3 values), got {fmt.describe()}")
    m, n, k = check_gemm_nt(lhs, rhs, lhs_scale, rhs_scale, fmt)
    settings = resolve_settings(settings)
    impl = resolve(OP, backend, m=m, n=n, k=k, recipe=recipe, arch=arch, lhs_dtype=lhs.dtype,
                   rhs_dtype=rhs.dtype, settings=settings)
    return impl.impl(lhs, rhs, lhs_scale=lhs_scale, rhs_scale=rhs_scale, recipe=recipe, arch=arch,
                     settings=settings)
