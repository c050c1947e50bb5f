"""Pre-permute as one Triton kernel: scatter each (token, k) route into its grouped-layout row fused
with the per-token-group quantization for GEMM1 (scales written in the GEMM's image), and zero
the rows no route lands on.

Same signatures and results as `custom_calls.permute` (the reference):
  permute_contig(x, src2dst, *, num_rows, recipe, arch) -> (lhs (num_rows, H), lhs_scale image | None)
  permute_masked(x, src2dst, *, num_groups, m_pad, recipe, arch) -> (lhs (G, m_pad, H), image | None)
The placement (`src2dst`) comes from the dispatcher; this op only moves and quantizes data.

One launch, two kinds of programs (grid axis 0):
  * programs [0, M): token t reads its row chunk once, quantizes it once and stores it to each
    of its top_k destinations (reads x once instead of top_k times);
  * programs [M, M + Z): a block of ZERO_ROWS destination rows; the rows nothing lands on
    (inv[r] < 0) get q = 0 and the scale of a zero row, as the reference quantizer gives them, and
    each slab's image padding columns (MN % 4 != 0) get scale 0.
`inv` (row -> token, -1 = empty) is a small jnp scatter of M * k int32 before the kernel.
Grid axis 1 splits H into chunks of GROUPS groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from custom_calls._checks import ACT_GROUP, act_scale_image_shape, ceil_div, round_up
from custom_calls.act_quant import quantize_activation
from custom_calls.triton.launch import triton_call
from custom_calls.triton.tile_quant import quantize_tile, store_scale_image

_TILE = 1024  # elements of H per program: 2 KiB of bf16 in, 1 KiB of e4m3 out per destination
_ZERO_ROWS = 64  # rows checked per zero-fill program
_ZERO_SUB = 4  # rows written at once by it
_NUM_WARPS = 4
_BF16_CHUNK = 128  # H chunking unit when nothing is quantized


@triton.jit
def scatter_quant_kernel(
    x_ptr, src2dst_ptr, inv_ptr,
    lhs_ptr, img_ptr,
    M: tl.constexpr, H: tl.constexpr, TOPK: tl.constexpr, R: tl.constexpr, MN: tl.constexpr,
    G: tl.constexpr, IMG_LD: tl.constexpr, IMG_SLAB: tl.constexpr, ZERO_LD: tl.constexpr,
    ZERO_PROGRAMS_ROWS: tl.constexpr,
    GROUP: tl.constexpr, QUANT: tl.constexpr, UE8M0: tl.constexpr,
    GROUPS: tl.constexpr, ZERO_ROWS: tl.constexpr, ZERO_SUB: tl.constexpr,
):
    """Grid (M + cdiv(ZERO_PROGRAMS_ROWS, ZERO_ROWS), cdiv(G, GROUPS)).

    Zero programs walk virtual rows v = slab * ZERO_LD + r, r < ZERO_LD: ZERO_LD = IMG_LD when
    quantizing (r >= MN is an image padding column of the slab, scale 0), else MN;
    ZERO_PROGRAMS_ROWS = R // MN * ZERO_LD.
    """
    pid = tl.program_id(0)
    group0 = tl.program_id(1) * GROUPS
    cols = group0 * GROUP + tl.arange(0, GROUPS * GROUP)
    col_ok = tl.expand_dims(cols < H, 0)
    if pid < M:
        t = pid.to(tl.int64)
        x = tl.load(x_ptr + t * H + tl.expand_dims(cols, 0), mask=col_ok, other=0.0).to(tl.float32)
        if QUANT:
            q, sf, exp = quantize_tile(x, 1, GROUPS, GROUP, UE8M0)
        else:
            q = x.to(lhs_ptr.dtype.element_ty)
        one = tl.arange(0, 1)
        for j in tl.static_range(TOPK):
            dst = tl.load(src2dst_ptr + t * TOPK + j + one)  # [1]
            ok = (dst >= 0) & (dst < R)  # a row outside the buffer is dropped, as the reference drops it
            d64 = tl.minimum(tl.maximum(dst, 0), R - 1).to(tl.int64)
            tl.store(lhs_ptr + tl.expand_dims(d64 * H, 1) + tl.expand_dims(cols, 0), q,
                     mask=tl.expand_dims(ok, 1) & col_ok)
            if QUANT:
                col = (d64 // MN) * IMG_SLAB + d64 % MN
                store_scale_image(img_ptr, sf, exp, col, ok, group0, G, IMG_LD, 1, GROUPS, UE8M0)
    else:
        # A zero program owns ZERO_ROWS virtual rows but writes them ZERO_SUB at a time: a
        # [ZERO_ROWS, tile] block held at once would set the register count (and occupancy) of the
        # whole kernel.
        z0 = (pid - M) * ZERO_ROWS
        v = z0 + tl.arange(0, ZERO_ROWS)
        live = v < ZERO_PROGRAMS_ROWS
        real = live & (v % ZERO_LD < MN)
        src = tl.load(inv_ptr + (v // ZERO_LD) * MN + v % ZERO_LD, mask=real, other=0)
        need = (real & (src < 0)) | (live & ~real)
        if tl.max(need.to(tl.int32), axis=0) > 0:
            zero_row = tl.zeros((1, GROUPS * GROUP), tl.float32)
            if QUANT:
                q0, sf0, exp0 = quantize_tile(zero_row, 1, GROUPS, GROUP, UE8M0)
            else:
                q0 = zero_row.to(lhs_ptr.dtype.element_ty)
            q = tl.broadcast_to(q0, (ZERO_SUB, GROUPS * GROUP))
            for sub in range(ZERO_ROWS // ZERO_SUB):
                vs = (z0 + sub * ZERO_SUB + tl.arange(0, ZERO_SUB)).to(tl.int64)
                slab = vs // ZERO_LD
                r = vs % ZERO_LD
                live_s = vs < ZERO_PROGRAMS_ROWS
                real_s = live_s & (r < MN)
                rows = slab * MN + r
                srcs = tl.load(inv_ptr + rows, mask=real_s, other=0)
                empty = real_s & (srcs < 0)
                img_pad = live_s & ~real_s
                tl.store(lhs_ptr + tl.expand_dims(rows * H, 1) + tl.expand_dims(cols, 0), q,
                         mask=tl.expand_dims(empty, 1) & col_ok)
                if QUANT:
                    pad = tl.expand_dims(img_pad, 1)
                    sf = tl.where(pad, 0.0, tl.broadcast_to(sf0, (ZERO_SUB, GROUPS)))
                    exp = tl.where(pad, 0, tl.broadcast_to(exp0, (ZERO_SUB, GROUPS)))
                    store_scale_image(img_ptr, sf, exp, slab * IMG_SLAB + r, empty | img_pad, group0, G, IMG_LD,
                                      ZERO_SUB, GROUPS, UE8M0)


def inverse_map(src2dst: jax.Array, num_rows: int) -> jax.Array:
    """src2dst: (M, k) int32 rows or -1 -> inv (num_rows,) int32: the token placed at each row, or -1."""
    m, k = src2dst.shape
    flat = src2dst.reshape(-1)
    tok = jnp.arange(m * k, dtype=jnp.int32) // k
    dst = jnp.where(flat >= 0, flat, num_rows)
    return jnp.full((num_rows,), -1, jnp.int32).at[dst].set(tok, mode="drop", unique_indices=True)


def kernel_config(hidden: int, recipe: str) -> dict:
    """Static tiling: group size along H and groups per program (a multiple of 4, so packed UE8M0
    words never straddle two programs)."""
    quant = recipe != "bf16"
    group = ACT_GROUP[recipe] if quant else _BF16_CHUNK
    return dict(GROUP=group, GROUPS=max(4, _TILE // group), QUANT=quant)


def _permute(x: jax.Array, src2dst: jax.Array, *, slabs: int, mn: int, recipe: str, arch: int):
    m, h = x.shape
    top_k = src2dst.shape[1]
    rows = slabs * mn
    cfg = kernel_config(h, recipe)
    quant = cfg["QUANT"]
    if quant:
        (gi, img_ld), img_dtype = act_scale_image_shape(recipe, arch, mn, h)
        img_shape = (gi, img_ld) if slabs == 1 else (slabs, gi, img_ld)
        lhs_dtype = jnp.float8_e4m3fn
    else:
        gi, img_ld, img_dtype, img_shape = 1, round_up(mn, 4), jnp.int32, (1,)  # unused output
        lhs_dtype = jnp.bfloat16
    g = ceil_div(h, cfg["GROUP"])
    # zero programs also cover each slab's image padding columns [MN, align(MN, 4))
    zero_ld = img_ld if quant else mn
    zero_rows = slabs * zero_ld
    grid = (m + ceil_div(zero_rows, _ZERO_ROWS), ceil_div(g, cfg["GROUPS"]))
    inv = inverse_map(src2dst, rows)
    lhs, img = triton_call(
        x, src2dst, inv, kernel=scatter_quant_kernel,
        out_shape=[jax.ShapeDtypeStruct((rows, h), lhs_dtype), jax.ShapeDtypeStruct(img_shape, img_dtype)],
        grid=grid, num_warps=_NUM_WARPS, name="moe_permute_quant",
        M=m, H=h, TOPK=top_k, R=rows, MN=mn, G=g, IMG_LD=img_ld, IMG_SLAB=gi * img_ld, ZERO_LD=zero_ld,
        ZERO_PROGRAMS_ROWS=zero_rows, UE8M0=arch == 100, ZERO_ROWS=_ZERO_ROWS, ZERO_SUB=_ZERO_SUB, **cfg)
    return lhs, (img if quant else None)


def permute_contig(x: jax.Array, src2dst: jax.Array, *, num_rows: int, recipe: str, arch: int):
    """x: (M, H) float, src2dst: (M, k) int32 in [0, num_rows) or -1
    -> (lhs (num_rows, H) e4m3 | bf16, lhs_scale image (see custom_calls.act_quant) | None)."""
    if x.shape[0] == 0:  # no token: every row is a zero row
        return quantize_activation(jnp.zeros((num_rows, x.shape[1]), x.dtype), recipe, arch)
    return _permute(x, src2dst, slabs=1, mn=num_rows, recipe=recipe, arch=arch)


def permute_masked(x: jax.Array, src2dst: jax.Array, *, num_groups: int, m_pad: int, recipe: str,
                   arch: int):
    """x: (M, H) float, src2dst: (M, k) int32 flat slab rows g * m_pad + r, or -1
    -> (lhs (G, m_pad, H) e4m3 | bf16, lhs_scale (G, ...) image | None)."""
    if x.shape[0] == 0:  # no token: every row is a zero row
        return quantize_activation(jnp.zeros((num_groups, m_pad, x.shape[1]), x.dtype), recipe, arch)
    lhs, img = _permute(x, src2dst, slabs=num_groups, mn=m_pad, recipe=recipe, arch=arch)
    return lhs.reshape(num_groups, m_pad, x.shape[1]), img
