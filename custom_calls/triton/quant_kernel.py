"""Triton kernel: per-token-group FP8 quantization with the scales written in the GEMM's image.

x (S, MN, K) bf16/f32 -> q (S, MN, K) e4m3 and, per slab s, the image of sf (MN, G):
  fp32 (S, G, align(MN, 4)) or packed UE8M0 int32 (S, ceil(G/4), align(MN, 4)).
S = 1 for a plain (M, K) activation, S = E for masked slabs. Image padding columns
(MN <= m < align(MN, 4)) are written as 0. Tiling: `GroupQuantConfig` (`config=`; None:
`heuristic_config(recipe, arch)`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from layouts import ceil_div, gemm_format
from custom_calls.triton.launch import triton_call
from custom_calls.triton.tile_quant import (lhs_load_cols, lhs_order_tile, quantize_tile, store_scale_image,
                                            tile_ids)
from custom_calls.triton.tuning import BlockTiling, config_or_default, tile_groups


@dataclasses.dataclass(frozen=True)
class GroupQuantConfig(BlockTiling):
    """Tiling of `per_token_group_quant_kernel` (`heuristic_config` gives the default; see
    `custom_calls.triton.tuning`): one [block_m, tile] block of x per program, tile along K, a
    multiple of 4 groups for the packed UE8M0 image."""


def heuristic_config(recipe: str, arch: int) -> GroupQuantConfig:
    """The default tiling: 1024 elements of K per program (at least 4 groups for UE8M0), 4 rows,
    4 warps."""
    fmt = gemm_format(recipe, arch)
    group = fmt.act_group
    return GroupQuantConfig(tile=group * max(1024 // group, 4 if fmt.ue8m0 else 1), block_m=4, num_warps=4,
                            chunks_fastest=True)


@triton.jit
def per_token_group_quant_kernel(
    x_ptr, q_ptr, img_ptr,
    MN: tl.constexpr, K: tl.constexpr, G: tl.constexpr, IMG_LD: tl.constexpr,
    IMG_SLAB: tl.constexpr, GROUP: tl.constexpr, UE8M0: tl.constexpr, W4A8_ORDER: tl.constexpr,
    BLOCK_M: tl.constexpr, GROUPS: tl.constexpr, ROW_BLOCKS: tl.constexpr, CHUNKS_FASTEST: tl.constexpr,
):
    """Grid (ROW_BLOCKS * cdiv(G, GROUPS),), ROW_BLOCKS = S * cdiv(IMG_LD, BLOCK_M); one
    [BLOCK_M, GROUPS * GROUP] tile each."""
    BLOCKS_PER_SLAB: tl.constexpr = (IMG_LD + BLOCK_M - 1) // BLOCK_M
    pid_m, pid_g = tile_ids(ROW_BLOCKS, (G + GROUPS - 1) // GROUPS, CHUNKS_FASTEST)
    slab = pid_m // BLOCKS_PER_SLAB
    m = (pid_m % BLOCKS_PER_SLAB) * BLOCK_M + tl.arange(0, BLOCK_M)
    group0 = pid_g * GROUPS
    k = group0 * GROUP + tl.arange(0, GROUPS * GROUP)
    row = slab.to(tl.int64) * MN + m
    in_x = tl.expand_dims(m < MN, 1) & tl.expand_dims(k < K, 0)
    offs = tl.expand_dims(row * K, 1) + tl.expand_dims(k, 0)
    src = tl.expand_dims(row * K, 1) + tl.expand_dims(lhs_load_cols(k, K, W4A8_ORDER), 0)
    x = lhs_order_tile(tl.load(x_ptr + src, mask=in_x, other=0.0).to(tl.float32), BLOCK_M, GROUPS * GROUP, K,
                       W4A8_ORDER)
    q, sf, exp = quantize_tile(x, BLOCK_M, GROUPS, GROUP, UE8M0)
    tl.store(q_ptr + offs, q, mask=in_x)
    # Padding columns of the image hold 0.
    real = tl.expand_dims(m < MN, 1)
    sf = tl.where(real, sf, 0.0)
    exp = tl.where(real, exp, 0)
    col = slab.to(tl.int64) * IMG_SLAB + m
    store_scale_image(img_ptr, sf, exp, col, m < IMG_LD, group0, G, IMG_LD,
                      BLOCK_M, GROUPS, UE8M0)


def quantize_activation(x: jax.Array, recipe: str, arch: int,
                        config: GroupQuantConfig | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Same signature and results as `custom_calls.act_quant.quantize_activation`:
    x (..., rows, K) float -> (q (..., rows, K) e4m3, scale image (..., G', align(rows, 4)))
    with the image fp32 (arch 90) or packed UE8M0 int32 (arch 100); bf16 recipe: (x as bf16, None).
    config: the tiling (None: `heuristic_config(recipe, arch)`)."""
    fmt = gemm_format(recipe, arch)
    if not fmt.is_quantized:
        return x.astype(jnp.bfloat16), None
    if x.ndim < 2:
        raise ValueError(f"x: expected rank >= 2 (..., rows, K), got shape {tuple(x.shape)}")
    config = config_or_default(config, GroupQuantConfig, lambda: heuristic_config(recipe, arch))
    *lead, mn, k = x.shape
    slabs = math.prod(lead)
    group = fmt.act_group
    groups = tile_groups(config, "tile", group=group, packed=fmt.ue8m0)
    (gi, img_ld), img_dtype = fmt.lhs_scale_shape(mn, k), fmt.scale_dtype
    g = ceil_div(k, group)
    row_blocks = slabs * ceil_div(img_ld, config.block_m)
    if row_blocks == 0:  # no rows
        return jnp.zeros(x.shape, jnp.float8_e4m3fn), jnp.zeros((*lead, gi, img_ld), img_dtype)
    q, img = triton_call(
        x, kernel=per_token_group_quant_kernel,
        out_shape=[jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn),
                   jax.ShapeDtypeStruct((*lead, gi, img_ld), img_dtype)],
        grid=(row_blocks * ceil_div(g, groups),), num_warps=config.num_warps, name="moe_group_quant",
        MN=mn, K=k, G=g, IMG_LD=img_ld, IMG_SLAB=gi * img_ld, GROUP=group, UE8M0=fmt.ue8m0,
        W4A8_ORDER=fmt.w4a8, BLOCK_M=config.block_m, GROUPS=groups, ROW_BLOCKS=row_blocks,
        CHUNKS_FASTEST=config.chunks_fastest)
    return q, img
