"""The GEMM format: what the operands of a grouped GEMM are for one (recipe, arch) pair.

This module is the one home of that knowledge. Kernels, references, the layer's checks and the
load-time paths ask a `GemmFormat` instead of branching on recipe names or on `arch`.

Archs (`layouts.archs.ARCHS`): 90 = SM90 (H100/H200), quantized scales stored as fp32; 100 = SM100
(B200/B300), quantized scales stored as packed UE8M0 (four power-of-two exponent bytes per int32).

Operands, "nt": lhs (A) is (rows, K) K-major, rhs (B) is (G, N, K) K-major, D = A . B^T in bf16.

  recipe, arch    scales  lhs                rhs                          lhs scale image              rhs scale
  bf16, 90|100    none    bf16|f16|f32       bf16|f16|f32 (G, N, K)       -                            -
  fp8_block, 90   fp32    e4m3, 1x128        e4m3, 128x128 blocks         (ceil(K/128), align(rows,4))  (G, ceil(N/128), ceil(K/128)) f32
                                                                          f32, MN-major                 row-major blocks
  fp8_block, 100  ue8m0   e4m3, 1x128        e4m3, 1x128 per row          (ceil(ceil(K/128)/4),         (G, ceil(ceil(K/128)/4), align(N,4))
                                                                           align(rows,4)) int32         int32, MN-major
  mxfp8, 100      ue8m0   e4m3, 1x32         e4m3, 1x32                   as above with 32-groups       as above with 32-groups
  mxfp4, 100      ue8m0   e4m3, 1x128        int8 e2m1 pairs (G, N, K/2), as fp8_block, 100             as mxfp8, 100
                                             1x32
  mxfp4, 90       w4a8    e4m3, 1x128,       int8 e2m1 words (G, N, K/2)  as fp8_block, 90              (G, N, ceil(K/128)) int32
  (W4A8)                  W4A8 column order  (layouts.w4a8)                                             scale words (layouts.w4a8)

An image's leading (batch) axes stay outermost; images are described in `layouts.scale_layout`.
A recipe that an arch cannot consume directly is converted at load time (`QuantRecipe.gemm_recipe`:
mxfp4 on 90 becomes fp8_block); GEMM ops are always called with the consumed recipe, whose
format `layouts.gemm_format(recipe, arch)` returns. mxfp4 on 90 also has a 4-bit form, W4A8
(`QuantRecipe.kept_4bit_on`): the weights stay e2m1 and the GEMM widens them to the e4m3 values of
the FP4 -> FP8 conversion in registers; its scale words carry the 128 x 128 block scale of that
conversion per row and 128 columns, with the 32-groups' exponent offsets. Its lhs holds the same
bytes as fp8_block's, each 128-column block permuted (`layouts.w4a8.LHS_ORDER`): `quantize_lhs` writes
that order and `dequantize_lhs` reads it. The two orders have the same shapes and dtypes, so no operand
check can tell them apart: the grouped GEMM ops take the order as a static argument (`lhs_order`,
`GemmFormat.lhs_for_gemm`), which a W4A8 call must state.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from layouts.archs import ARCHS, SCALE_UE8M0, check_arch
from layouts.w4a8 import W4A8_BLOCK, from_w4a8_lhs_order, to_w4a8_lhs_order, widen_w4a8
from layouts.checks import FLOAT_DTYPES, align, ceil_div, check_dtype, check_rank, check_shape
from layouts.fp4 import dequantize_mxfp4
from layouts.fp8 import quantize_fp8_per_token_group
from layouts.rounding import store_as
from layouts.scale_layout import (from_mn_major_tma_aligned, pack_ue8m0_mn_major_tma_aligned,
                                  to_mn_major_tma_aligned, unpack_ue8m0_mn_major_tma_aligned)

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
# The column orders an lhs can be in: "columns" (every format's), "w4a8" (`layouts.w4a8.LHS_ORDER`)
LHS_ORDERS = ("columns", "w4a8")
SCALE_W4A8 = "w4a8"  # rhs: int32 scale words (block scale exponent + 32-group table indices), lhs: fp32


@dataclasses.dataclass(frozen=True)
class GemmFormat:
    """Operand format of the grouped GEMMs for one (recipe, arch); hashable, a static argument.

    recipe: the recipe the GEMM consumes as is; arch: a key of ARCHS.
    scale_kind: None (bf16), SCALE_FP32, SCALE_UE8M0 or SCALE_W4A8.
    act_group: lhs scale group along K (1 x act_group per row), None for bf16.
    weight_block: rhs scale granularity (along N, along K) as the GEMM reads it, None for bf16:
      (128, 128) blocks on SM90; per row (1, 128) or (1, 32) on SM100.
    rhs_k_pack: weight values per stored rhs element along K (2 for int8 e2m1 pairs).
    """

    recipe: str
    arch: int
    scale_kind: Optional[str]
    act_group: Optional[int]
    weight_block: Optional[tuple[int, int]]
    rhs_k_pack: int = 1

    # -- dtypes and shapes ----------------------------------------------------------------------
    @property
    def is_quantized(self) -> bool:
        return self.scale_kind is not None

    @property
    def ue8m0(self) -> bool:
        """Scales are packed UE8M0 int32 images (powers of two)."""
        return self.scale_kind == SCALE_UE8M0

    @property
    def lhs_dtypes(self) -> tuple:
        return (E4M3,) if self.is_quantized else FLOAT_DTYPES

    @property
    def rhs_dtypes(self) -> tuple:
        return value_dtypes(self.is_quantized, self.rhs_k_pack)

    @property
    def w4a8(self) -> bool:
        """rhs is e2m1 in the W4A8 word layout with int32 scale words (`layouts.w4a8`)."""
        return self.scale_kind == SCALE_W4A8

    @property
    def scale_dtype(self):
        """dtype of the lhs scale operand, and of the rhs one unless W4A8 (None for bf16)."""
        if not self.is_quantized:
            return None
        return jnp.dtype(jnp.int32) if self.ue8m0 else jnp.dtype(jnp.float32)

    @property
    def rhs_scale_dtype(self):
        """dtype of the rhs scale operand (None for bf16)."""
        return jnp.dtype(jnp.int32) if self.w4a8 else self.scale_dtype

    def _image(self, mn: int, k: int, group: int) -> tuple[int, int]:
        g = ceil_div(k, group)
        return (ceil_div(g, 4) if self.ue8m0 else g, align(mn, 4))

    def lhs_scale_shape(self, rows: int, k: int) -> Optional[tuple[int, int]]:
        """Shape of the lhs scale image for `rows` rows of width k (no batch axes); None for bf16."""
        if not self.is_quantized:
            return None
        return self._image(rows, k, self.act_group)

    def rhs_scale_shape(self, num_groups: int, n: int, k: int) -> Optional[tuple[int, int, int]]:
        """Shape of the rhs scales of (G, N, K) weights (K = logical width); None for bf16."""
        if not self.is_quantized:
            return None
        bn, bk = self.weight_block
        if self.ue8m0:
            return (num_groups, *self._image(n, k, bk))
        return (num_groups, ceil_div(n, bn), ceil_div(k, bk))  # W4A8: bn 1, bk 128

    def rhs_width(self, k: int) -> int:
        """Stored width of a rhs row holding K values."""
        return k // self.rhs_k_pack

    # -- checks ---------------------------------------------------------------------------------
    def check_operands(self, lhs, rhs, lhs_scale, rhs_scale, *, batch: tuple[int, ...] = (),
                       grouped: bool = True) -> tuple[int, int, int, int]:
        """Trace-time check of lhs (*batch, rows, K), rhs (G, N, K / rhs_k_pack) and the two scales
        against this format; returns (rows, K, G, N). grouped=False: one dense weight, rhs (N, K /
        rhs_k_pack) and its scale without the leading group axis (G = 1). Errors name the argument,
        expected and actual."""
        rows, k = lhs.shape[-2:]
        if grouped:
            check_rank("rhs", rhs, 3, "(G, N, K)")
            g, n, kb = rhs.shape
        else:
            check_rank("rhs", rhs, 2, "(N, K)")
            (n, kb), g = rhs.shape, 1
        if kb != self.rhs_width(k) or k % self.rhs_k_pack:
            if not grouped:
                raise ValueError(f"rhs: expected shape (N, {self.rhs_width(k)}) to match lhs {tuple(lhs.shape)}, "
                                 f"got {tuple(rhs.shape)}")
            want = f"K//2={k // 2} (int8-packed e2m1)" if self.rhs_k_pack == 2 else f"K={k}"
            raise ValueError(f"rhs: expected last axis {want} to match lhs {tuple(lhs.shape)}, "
                             f"got {tuple(rhs.shape)}")
        check_dtype("lhs", lhs, self.lhs_dtypes)
        check_dtype("rhs", rhs, self.rhs_dtypes)
        if not self.is_quantized:
            if lhs_scale is not None or rhs_scale is not None:
                raise ValueError(f"lhs_scale/rhs_scale: recipe {self.recipe!r} takes no scales, got an array")
            return rows, k, g, n
        check_shape("lhs_scale", lhs_scale, (*batch, *self.lhs_scale_shape(rows, k)), self.describe())
        check_dtype("lhs_scale", lhs_scale, (self.scale_dtype,))
        rhs_scale_shape = self.rhs_scale_shape(g, n, k)
        check_shape("rhs_scale", rhs_scale, rhs_scale_shape if grouped else rhs_scale_shape[1:], self.describe())
        check_dtype("rhs_scale", rhs_scale, (self.rhs_scale_dtype,))
        return rows, k, g, n

    def describe(self) -> str:
        return f"recipe {self.recipe!r} on arch {self.arch}" + (" (W4A8)" if self.w4a8 else "")

    @property
    def lhs_order(self) -> str:
        """The column order of the lhs this format's GEMMs read and `quantize_lhs` writes (`LHS_ORDERS`)."""
        return "w4a8" if self.w4a8 else "columns"

    def lhs_for_gemm(self, lhs: jax.Array, lhs_order: Optional[str]) -> jax.Array:
        """lhs (..., rows, K) in `lhs_order` -> the lhs in the order this format's GEMMs read.
        lhs_order: "columns", "w4a8" or None (column order, except that a W4A8 format refuses None: its
        order and column order have the same shapes and dtypes, so only the caller knows which it holds).
        W4A8 and "columns": the op permutes lhs itself (one pass over it); "w4a8" (what `quantize_lhs` and
        the layer's producers write): lhs as is. ValueError naming `lhs_order` for anything else."""
        if lhs_order is not None and lhs_order not in LHS_ORDERS:
            raise ValueError(f"lhs_order: expected one of {LHS_ORDERS} (or None), got {lhs_order!r}")
        if not self.w4a8:
            if lhs_order == "w4a8":
                raise ValueError(f"lhs_order: 'w4a8' is the lhs order of the W4A8 format only (recipe 'mxfp4' "
                                 f"on arch 90), got {self.describe()}")
            return lhs
        if lhs_order is None:
            raise ValueError(
                f"lhs_order: {self.describe()} reads its lhs in the W4A8 column order, which has the shape "
                "and dtype of an lhs in column order, so say which one lhs is: 'w4a8' for an lhs from "
                f"`gemm_format({self.recipe!r}, {self.arch}).quantize_lhs` or the layer's producers, 'columns' "
                "for one in column order (quantized as fp8_block), which the op then permutes (one pass over lhs)")
        return to_w4a8_lhs_order(lhs) if lhs_order == "columns" else lhs

    # -- numerics (the reference's definition of each operand) ----------------------------------
    def quantize_lhs(self, x: jax.Array) -> tuple[jax.Array, Optional[jax.Array]]:
        """x: (..., rows, K) float -> (q, lhs scale image (..., *lhs_scale_shape)) of this format;
        bf16: (x as bf16, None). Power-of-two scales round up, so x / sf never exceeds 448. W4A8: q in
        the W4A8 column order (the scales are per 128 columns, so the same as in column order)."""
        if not self.is_quantized:
            return store_as(x, jnp.bfloat16), None
        if x.ndim < 2:
            raise ValueError(f"x: expected rank >= 2 (..., rows, K), got shape {tuple(x.shape)}")
        q, sf = quantize_fp8_per_token_group(x, group_size=self.act_group, ue8m0=self.ue8m0)
        if self.w4a8:
            q = to_w4a8_lhs_order(q)
        if self.ue8m0:
            # scales computed here are powers of two by construction (rounded up)
            return q, pack_ue8m0_mn_major_tma_aligned(sf, check=False)
        return q, to_mn_major_tma_aligned(sf)

    def dequantize_lhs(self, lhs: jax.Array, lhs_scale: Optional[jax.Array]) -> jax.Array:
        """lhs (..., rows, K) + its scale image -> (..., rows, K) f32, in column order."""
        if not self.is_quantized:
            return lhs.astype(jnp.float32)
        if self.w4a8:
            lhs = from_w4a8_lhs_order(lhs)
        rows, k = lhs.shape[-2:]
        gk = self.act_group
        if self.ue8m0:
            sf = unpack_ue8m0_mn_major_tma_aligned(lhs_scale, rows, ceil_div(k, gk))
        else:
            sf = from_mn_major_tma_aligned(lhs_scale, rows)
        return lhs.astype(jnp.float32) * jnp.repeat(sf, gk, axis=-1)[..., :k]

    def dequantize_rhs(self, rhs: jax.Array, rhs_scale: Optional[jax.Array]) -> jax.Array:
        """rhs (G, N, K / rhs_k_pack) + its scales -> (G, N, K) f32."""
        if not self.is_quantized:
            return rhs.astype(jnp.float32)
        _, n, kb = rhs.shape
        k = kb * self.rhs_k_pack
        bn, bk = self.weight_block
        if self.w4a8:
            w, block = widen_w4a8(rhs, rhs_scale)
            return w.astype(jnp.float32) * jnp.repeat(block, bk, axis=-1)[..., :k]
        if not self.ue8m0:
            sf = jnp.repeat(jnp.repeat(rhs_scale, bn, axis=-2)[..., :n, :], bk, axis=-1)[..., :k]
            return rhs.astype(jnp.float32) * sf
        sf = unpack_ue8m0_mn_major_tma_aligned(rhs_scale, n, ceil_div(k, bk))  # (G, N, K/bk)
        if self.rhs_k_pack == 2:
            return dequantize_mxfp4(rhs, sf, group_size=bk).astype(jnp.float32)
        return rhs.astype(jnp.float32) * jnp.repeat(sf, bk, axis=-1)[..., :k]


def value_dtypes(quantized: bool, k_pack: int) -> tuple:
    """dtypes of stored weight values: floats (bf16 recipe), int8 e2m1 pairs (k_pack 2), else e4m3."""
    if not quantized:
        return FLOAT_DTYPES
    return (jnp.dtype(jnp.int8),) if k_pack == 2 else (E4M3,)


def format_for(recipe, arch: int) -> GemmFormat:
    """The GemmFormat of a `layouts.recipes.QuantRecipe` consumed as is on `arch` (no legality
    check: use `QuantRecipe.gemm_format` or `layouts.gemm_format`)."""
    kind = ARCHS[check_arch(arch)].scale_kind if recipe.is_quantized else None
    block = recipe.weight_block
    if arch in recipe.kept_4bit_on:
        kind, block = SCALE_W4A8, (1, W4A8_BLOCK)
    elif kind == SCALE_UE8M0 and block is not None:
        block = (1, block[1])  # SM100 reads the block scale broadcast to every row
    return GemmFormat(recipe=recipe.name, arch=arch, scale_kind=kind, act_group=recipe.act_group_size,
                      weight_block=block, rhs_k_pack=recipe.weight_k_pack)


__all__ = ["GemmFormat", "SCALE_W4A8", "format_for", "value_dtypes"]
