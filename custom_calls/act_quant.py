"""Per-token-group activation quantization into the scale image the grouped GEMM consumes.

`quantize_activation(x, recipe, arch) -> (q, lhs_scale)`: x (..., rows, K) float ->
    bf16            (x as bf16, None)
    fp8_block, 90   (e4m3, fp32 MN-major TMA-aligned image (..., ceil(K/128), align(rows,4)))
    fp8_block, 100  (e4m3, packed UE8M0 image (..., ceil(ceil(K/128)/4), align(rows,4)) int32)
    mxfp4, 100      as fp8_block, 100 (activations are FP8 with 128-groups: W4A8)
    mxfp8, 100      (e4m3, packed UE8M0 image of 32-groups (..., ceil(ceil(K/32)/4), align(rows,4)))
Power-of-two scales round UP (sf = ceil_to_ue8m0(amax/448)), so x/sf never exceeds 448.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import layouts
from custom_calls._checks import ACT_GROUP, check_recipe_arch


def quantize_activation(x: jax.Array, recipe: str, arch: int) -> tuple[jax.Array, jax.Array | None]:
    """x: (..., rows, K) float -> (q, lhs_scale) in the (recipe, arch) format of the module table."""
    check_recipe_arch(recipe, arch)
    if recipe == "bf16":
        return layouts.store_as(x, jnp.bfloat16), None
    if x.ndim < 2:
        raise ValueError(f"x: expected rank >= 2 (..., rows, K), got shape {tuple(x.shape)}")
    if recipe == "mxfp8":
        q, sf = layouts.quantize_mxfp8(x, group_size=ACT_GROUP[recipe])
    else:
        q, sf = layouts.quantize_fp8_per_token_group(x, group_size=ACT_GROUP[recipe], ue8m0=arch == 100)
    if arch == 90:
        return q, layouts.to_mn_major_tma_aligned(sf)
    # scales computed under jit are powers of two by construction (rounded up)
    return q, layouts.pack_ue8m0_mn_major_tma_aligned(sf, check=False)
