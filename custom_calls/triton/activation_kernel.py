"""Gated activation fused with GEMM2's input quantization as one Triton kernel, contig and masked
(varlen), every `ActivationSpec` variant (silu, swiglu_limit clamps, swiglu_oai with gemm1_alpha,
SiTU, keep_fp32). Reads 2I bf16 once, writes I e4m3 + scales (in the GEMM's image) once.

Same signatures and numerics as `custom_calls.activation` (the reference): fp32 math, the result
rounded to bf16 before quantization unless `keep_fp32`.
  activation_quant_contig(gateup (rows, 2I), *, act, recipe, arch) -> (a (rows, I), image | None)
  activation_quant_masked(gateup (G, m_pad, 2I), masked_m (G,), *, act, recipe, arch)
Both also take `config=`, an `ActQuantConfig` (tiling; None: `heuristic_config(I, recipe)`, what
the registered "triton" implementations use).
Masked: programs whose row block starts at or past masked_m[g] exit at once; only rows
< masked_m[g] are read or written (the rest of `a` and of its image is left unspecified, as the
op's contract allows: the GEMM never reads them).

The masked clamp / SiTU / keep_fp32 kernels carry the seed's hard constraints (checked by
`support.activation_masked_constraints` at trace time): N = m_pad % 4 == 0, G = I / group % 4 == 0,
I // 8 >= number of slabs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from layouts import align, ceil_div, gemm_format, get_recipe
from custom_calls.triton.launch import triton_call
from custom_calls.triton.tile_quant import (lhs_load_cols, lhs_order_tile, quantize_tile, store_scale_image,
                                            tile_ids)
from custom_calls.triton.tuning import BlockTiling, column_group, config_or_default, tile_groups

KIND_CODES = {"silu": 0, "swiglu_oai": 1, "situ": 2}


@dataclasses.dataclass(frozen=True)
class ActQuantConfig(BlockTiling):
    """Tiling of `act_quant_kernel` (`heuristic_config` gives the default; see
    `custom_calls.triton.tuning`): one [block_m, tile] block of the output per program, tile along I
    (bf16: chunks of `tuning.BF16_CHUNK`), a multiple of 4 groups when the image is packed UE8M0."""


def heuristic_config(inter: int, recipe: str) -> ActQuantConfig:
    """The default tiling for I = inter: as many scale groups as I has, rounded up to a power of two,
    at least 4 and at most 1024 elements' worth; block_m fills 4096 elements per program; 4 warps."""
    group = column_group(recipe)
    groups = max(4, min(triton.next_power_of_2(ceil_div(inter, group)), 1024 // group))
    return ActQuantConfig(tile=groups * group, block_m=max(1, 4096 // (groups * group)), num_warps=4,
                          chunks_fastest=True)


@triton.jit
def _tanh(x):
    """fp32 tanh from exp (Triton's interpreter has no libdevice): odd Taylor polynomial near 0,
    where 1 - 2 / (e^2x + 1) would cancel; relative error below 2e-6 everywhere, +-1 at +-inf."""
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    large = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
    return tl.where(tl.abs(x) < 0.125, small, large)


@triton.jit
def act_quant_kernel(
    y_ptr, masked_m_ptr,
    a_ptr, img_ptr,
    MN: tl.constexpr, I: tl.constexpr, G: tl.constexpr, IMG_LD: tl.constexpr,
    IMG_SLAB: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr, UE8M0: tl.constexpr,
    W4A8_ORDER: tl.constexpr, MASKED: tl.constexpr, KIND: tl.constexpr, HAS_LIMIT: tl.constexpr,
    LIMIT: tl.constexpr,
    ALPHA: tl.constexpr, BETA_S: tl.constexpr, BETA_L: tl.constexpr, KEEP_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, GROUPS: tl.constexpr, ROW_BLOCKS: tl.constexpr, CHUNKS_FASTEST: tl.constexpr,
):
    """Grid (ROW_BLOCKS * cdiv(G, GROUPS),), ROW_BLOCKS = S * cdiv(ROWS_COVERED, BLOCK_M);
    ROWS_COVERED = MN (masked) or IMG_LD (contig, so the image padding columns get their zero
    scales)."""
    ROWS_COVERED: tl.constexpr = MN if MASKED else IMG_LD
    BLOCKS: tl.constexpr = (ROWS_COVERED + BLOCK_M - 1) // BLOCK_M
    pid_m, chunk = tile_ids(ROW_BLOCKS, (G + GROUPS - 1) // GROUPS, CHUNKS_FASTEST)
    slab = pid_m // BLOCKS
    start = (pid_m % BLOCKS) * BLOCK_M
    if MASKED:
        # a count above m_pad must not reach the next slab (or past the last one)
        limit = tl.minimum(tl.load(masked_m_ptr + slab), MN)
    else:
        limit = MN
    if start < limit:
        group0 = chunk * GROUPS
        m = start + tl.arange(0, BLOCK_M)
        cols = group0 * GROUP + tl.arange(0, GROUPS * GROUP)
        row_ok = m < limit
        ok = tl.expand_dims(row_ok, 1) & tl.expand_dims(cols < I, 0)
        row = slab.to(tl.int64) * MN + m
        in_offs = tl.expand_dims(row * (2 * I), 1) + tl.expand_dims(lhs_load_cols(cols, I, W4A8_ORDER), 0)
        gate = tl.load(y_ptr + in_offs, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(y_ptr + in_offs + I, mask=ok, other=0.0).to(tl.float32)
        if KIND == 2:
            y = BETA_S * _tanh(gate / BETA_S) * tl.sigmoid(gate) * (BETA_L * _tanh(up / BETA_L))
        else:
            if HAS_LIMIT:
                gate = tl.minimum(gate, LIMIT)
                up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
            if KIND == 1:
                y = gate * tl.sigmoid(ALPHA * gate) * (up + 1.0)
            else:
                y = gate * tl.sigmoid(gate) * up
        y = lhs_order_tile(y, BLOCK_M, GROUPS * GROUP, I, W4A8_ORDER)
        if not KEEP_FP32:
            y = y.to(tl.bfloat16).to(tl.float32)
        out_offs = tl.expand_dims(row * I, 1) + tl.expand_dims(cols, 0)
        if QUANT:
            q, sf, exp = quantize_tile(y, BLOCK_M, GROUPS, GROUP, UE8M0)
            tl.store(a_ptr + out_offs, q, mask=ok)
            if MASKED:
                img_rows = row_ok
            else:
                # contig: rows [MN, IMG_LD) are the image's zero padding columns
                pad = tl.expand_dims(m >= MN, 1)
                sf = tl.where(pad, 0.0, sf)
                exp = tl.where(pad, 0, exp)
                img_rows = m < IMG_LD
            col = slab.to(tl.int64) * IMG_SLAB + m
            store_scale_image(img_ptr, sf, exp, col, img_rows, group0, G, IMG_LD,
                              BLOCK_M, GROUPS, UE8M0)
        else:
            tl.store(a_ptr + out_offs, y.to(a_ptr.dtype.element_ty), mask=ok)


def kernel_config(inter: int, recipe: str, act, config: ActQuantConfig | None = None, *,
                  ue8m0: bool = False) -> dict:
    """The kernel's static arguments for I = inter, the activation `act` and the tiling `config`
    (None: `heuristic_config(inter, recipe)`), except the shape ones; ValueError naming the field of
    a config that does not fit the recipe (with `ue8m0`, the packed scale image: 4 groups a word)."""
    quant = get_recipe(recipe).is_quantized
    group = column_group(recipe)
    config = config_or_default(config, ActQuantConfig, lambda: heuristic_config(inter, recipe))
    groups = tile_groups(config, "tile", group=group, packed=quant and ue8m0)
    return dict(
        GROUP=group, GROUPS=groups, BLOCK_M=config.block_m, QUANT=quant,
        KIND=KIND_CODES[act.kind], HAS_LIMIT=act.swiglu_limit is not None,
        LIMIT=float(act.swiglu_limit) if act.swiglu_limit is not None else 0.0,
        ALPHA=float(act.gemm1_alpha) if act.gemm1_alpha is not None else 1.0,
        BETA_S=float(act.situ_beta), BETA_L=float(act.situ_linear_beta), KEEP_FP32=bool(act.keep_fp32))


def _act_quant(gateup: jax.Array, masked_m: jax.Array | None, *, act, recipe: str, arch: int,
               config: ActQuantConfig | None):
    masked = masked_m is not None
    slabs, mn, two_i = gateup.shape if masked else (1, *gateup.shape)
    inter = two_i // 2
    config = config_or_default(config, ActQuantConfig, lambda: heuristic_config(inter, recipe))
    fmt = gemm_format(recipe, arch)
    cfg = kernel_config(inter, recipe, act, config, ue8m0=fmt.ue8m0)
    if cfg["QUANT"]:
        (gi, img_ld), img_dtype = fmt.lhs_scale_shape(mn, inter), fmt.scale_dtype
        img_shape = (slabs, gi, img_ld) if masked else (gi, img_ld)
        a_dtype = jnp.float8_e4m3fn
    else:
        gi, img_ld, img_dtype, img_shape, a_dtype = 1, align(mn, 4), jnp.int32, (1,), jnp.bfloat16
    g = ceil_div(inter, cfg["GROUP"])
    covered = mn if masked else img_ld
    row_blocks = slabs * ceil_div(covered, cfg["BLOCK_M"])
    if masked_m is None:
        masked_m = jnp.zeros((1,), jnp.int32)  # not read by the contig kernel
    a_shape = (slabs, mn, inter) if masked else (mn, inter)
    if row_blocks == 0:  # no rows
        return jnp.zeros(a_shape, a_dtype), (jnp.zeros(img_shape, img_dtype) if cfg["QUANT"] else None)
    a, img = triton_call(
        gateup, masked_m, kernel=act_quant_kernel,
        out_shape=[jax.ShapeDtypeStruct(a_shape, a_dtype), jax.ShapeDtypeStruct(img_shape, img_dtype)],
        grid=(row_blocks * ceil_div(g, cfg["GROUPS"]),), num_warps=config.num_warps, name="moe_act_quant",
        MN=mn, I=inter, G=g, IMG_LD=img_ld, IMG_SLAB=gi * img_ld, UE8M0=fmt.ue8m0,
        W4A8_ORDER=fmt.w4a8, MASKED=masked, ROW_BLOCKS=row_blocks, CHUNKS_FASTEST=config.chunks_fastest, **cfg)
    return a, (img if cfg["QUANT"] else None)


def activation_quant_contig(gateup: jax.Array, *, act, recipe: str, arch: int,
                            config: ActQuantConfig | None = None):
    """gateup: (rows, 2I) float -> (a (rows, I) e4m3 | bf16, a_scale image | None).
    config: the tiling (None: `heuristic_config(I, recipe)`)."""
    return _act_quant(gateup, None, act=act, recipe=recipe, arch=arch, config=config)


def activation_quant_masked(gateup: jax.Array, masked_m: jax.Array, *, act, recipe: str, arch: int,
                            config: ActQuantConfig | None = None):
    """gateup: (G, m_pad, 2I) float, masked_m: (G,) int32 -> (a (G, m_pad, I), a_scale (G, ...) image
    | None); rows >= masked_m[g] (and their scale columns) are left unspecified.
    config: the tiling (None: `heuristic_config(I, recipe)`)."""
    return _act_quant(gateup, masked_m, act=act, recipe=recipe, arch=arch, config=config)
