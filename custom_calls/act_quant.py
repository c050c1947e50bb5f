"""Per-token-group activation quantization into the scale image the grouped GEMM consumes.

`quantize_activation(x, recipe, arch) -> (q, lhs_scale)`: x (..., rows, K) float -> the lhs operand
of `layouts.gemm_format(recipe, arch)` (`GemmFormat.quantize_lhs`): bf16 -> (x as bf16, None);
quantized recipes -> (e4m3, the lhs scale image). Power-of-two scales round UP
(sf = ceil_to_ue8m0(amax/448)), so x/sf never exceeds 448.
"""

from __future__ import annotations

import jax

from layouts import gemm_format


def quantize_activation(x: jax.Array, recipe: str, arch: int) -> tuple[jax.Array, jax.Array | None]:
    """x: (..., rows, K) float -> (q, lhs_scale) in the lhs format of (recipe, arch), q in its column
    order (`GemmFormat.lhs_order`, the `lhs_order=` to give the grouped GEMMs)."""
    return gemm_format(recipe, arch).quantize_lhs(x)
