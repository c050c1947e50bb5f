"""Triton device helpers shared by every kernel that ends in per-token-group FP8 quantization.

Numerics follow `layouts.fp8.quantize_fp8_per_token_group` exactly:
  amax = max(max|x| over the group, 1e-4)
  sf   = amax / 448 (IEEE division), or with UE8M0 the smallest power of two p with p * 448 >= amax
  q    = e4m3(clip(x * (1/sf), -448, 448)), round-to-nearest-even, computed in fp32.
The UE8M0 scale is computed on the fp32 bit pattern of amax / 448: for the constant 448 the
correctly rounded quotient sits on a power of two only when the exact one does, so the bit-level
ceiling is the exact ceiling.

Scales are written straight into DeepGEMM's memory image (see `layouts.scale_layout`):
  fp32 (SM90):          image[slab, g, m]          = sf[slab, m, g]
  packed UE8M0 (SM100): image[slab, g // 4, m] byte g % 4 = exponent byte of sf[slab, m, g]
so no transpose pass follows the kernel. The caller gives, per tile row, the element offset of
its image column (`slab * slab_stride + m`) and the image row stride (`align(MN, 4)`).
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
AMAX_FLOOR = tl.constexpr(1e-4)


@triton.jit
def tile_ids(ROW_BLOCKS: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_FASTEST: tl.constexpr):
    """(row block, column chunk) of this program on a 1-D grid of ROW_BLOCKS * CHUNKS programs.
    CHUNKS_FASTEST: the chunks of one row block are neighbouring programs, so the programs in flight
    sweep whole rows (contiguous memory) instead of one column chunk of many rows."""
    pid = tl.program_id(0)
    if CHUNKS_FASTEST:
        row_block = pid // CHUNKS
        chunk = pid % CHUNKS
    else:
        row_block = pid % ROW_BLOCKS
        chunk = pid // ROW_BLOCKS
    return row_block, chunk


@triton.jit
def lhs_source_cols(pos, K: tl.constexpr, W4A8_ORDER: tl.constexpr):
    """The column whose value an lhs row of width K stores at each position `pos`: pos itself, or with
    W4A8_ORDER the W4A8 column order (`layouts.w4a8.LHS_ORDER`: position 32s + 16e + 4c + i of a whole
    128-column block holds column 32c + 8s + 2i + e). Where K is not a multiple of 128 producers gather
    their inputs at these columns (`lhs_load_cols`) and store contiguously; a 128-column quantization
    group keeps its columns, so its scale is unchanged."""
    if W4A8_ORDER:
        r = pos % 128
        col = pos - r + 32 * ((r // 4) % 4) + 8 * (r // 32) + 2 * (r % 4) + (r // 16) % 2
        return tl.where(pos - r + 128 <= K, col, pos)
    else:
        return pos


@triton.jit
def lhs_load_cols(pos, K: tl.constexpr, W4A8_ORDER: tl.constexpr):
    """The columns a producer loads for the lhs positions `pos`. Where K is a multiple of 128 every block
    is whole and the loads stay contiguous (`pos` itself; `lhs_order_tile` then puts the loaded tile in
    the W4A8 column order in registers), else `lhs_source_cols` (a gather)."""
    if W4A8_ORDER and K % 128 != 0:
        return lhs_source_cols(pos, K, W4A8_ORDER)
    else:
        return pos


@triton.jit
def lhs_order_tile(x, ROWS: tl.constexpr, WIDTH: tl.constexpr, K: tl.constexpr, W4A8_ORDER: tl.constexpr):
    """x [ROWS, WIDTH], loaded at `lhs_load_cols` of WIDTH positions from a multiple of 128 -> the values
    each position stores. With W4A8_ORDER and K a multiple of 128, column 32c + 8s + 2i + e of each
    block moves to position 32s + 16e + 4c + i (`layouts.w4a8.LHS_ORDER`) by a reshape and a permute,
    which Triton lowers to one exchange through shared memory, so the loads stay 16-byte vectors instead
    of 2-byte gathers."""
    if W4A8_ORDER and K % 128 == 0:
        x = tl.reshape(x, (ROWS, WIDTH // 128, 4, 4, 4, 2))  # (c, s, i, e) of each block
        x = tl.reshape(tl.permute(x, (0, 1, 3, 5, 2, 4)), (ROWS, WIDTH))  # -> (s, e, c, i)
    return x


@triton.jit
def ue8m0_exponent(sf):
    """Biased exponent (int32, 1..254) of the smallest power of two >= sf (sf: fp32 > 0, normal)."""
    bits = sf.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    bump = ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.minimum(tl.maximum(exp + bump, 1), 254)


@triton.jit
def ue8m0_bits_exponent(sf):
    """Exponent byte (int32) of power-of-two scales sf (fp32): their UE8M0 encoding; 0 for sf = 0."""
    return (sf.to(tl.int32, bitcast=True) >> 23) & 0xFF


@triton.jit
def scale_from_amax(amax, UE8M0: tl.constexpr):
    """amax (floored, fp32) -> (sf fp32, exp int32: its UE8M0 byte, meaningful only when UE8M0)."""
    sf = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    exp = tl.zeros(amax.shape, tl.int32)
    if UE8M0:
        exp = ue8m0_exponent(sf)
        sf = (exp << 23).to(tl.float32, bitcast=True)
    return sf, exp


@triton.jit
def zero_row_scale(UE8M0: tl.constexpr):
    """The scale `quantize_tile` gives a group of zeros (amax at its floor), as an fp32 scalar."""
    sf, _ = scale_from_amax(tl.full((1,), AMAX_FLOOR, tl.float32), UE8M0)
    return tl.sum(sf, axis=0)


@triton.jit
def quantize_tile(x, ROWS: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr,
                  UE8M0: tl.constexpr, FLOOR: tl.constexpr = AMAX_FLOOR):
    """x: [ROWS, GROUPS * GROUP] fp32 (out-of-range elements already 0). FLOOR: the amax floor
    (1e-4 as `layouts.fp8`; the fused MoE kernel's input stage floors at 1e-10).

    Returns q [ROWS, GROUPS * GROUP] fp8e4nv, sf [ROWS, GROUPS] fp32, exp [ROWS, GROUPS] int32
    (the UE8M0 exponent byte of sf; meaningful only when UE8M0).
    """
    xg = tl.reshape(x, (ROWS, GROUPS, GROUP))
    amax = tl.maximum(tl.max(tl.abs(xg), axis=2), FLOOR)
    sf, exp = scale_from_amax(amax, UE8M0)
    inv = tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf)
    y = xg * tl.expand_dims(inv, 2)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    q = tl.reshape(y, (ROWS, GROUPS * GROUP)).to(tl.float8e4nv)
    return q, sf, exp


@triton.jit
def store_scale_image(img_ptr, sf, exp, col_off, row_ok, group0, num_groups, img_ld,
                      ROWS: tl.constexpr, GROUPS: tl.constexpr, UE8M0: tl.constexpr):
    """Write the scales of a [ROWS, GROUPS] tile whose first group is `group0` (a multiple of 4
    when UE8M0) into the image.

    col_off: [ROWS] int64 element offset of each row's image column (slab * slab_stride + m);
    row_ok: [ROWS] bool, rows to write; num_groups: G; img_ld: align(MN, 4).
    """
    if UE8M0:
        WORDS: tl.constexpr = GROUPS // 4
        g = group0 + tl.arange(0, GROUPS)
        # Groups past G are padding bytes: 0, as `layouts.ue8m0.pack_ue8m0` writes them.
        e = tl.where(tl.expand_dims(g < num_groups, 0), exp, 0)
        shifts = tl.arange(0, 4) * 8
        words = tl.sum(tl.reshape(e, (ROWS, WORDS, 4)) << tl.reshape(shifts, (1, 1, 4)), axis=2)
        w = group0 // 4 + tl.arange(0, WORDS)
        ok = tl.expand_dims(row_ok, 1) & tl.expand_dims(w < (num_groups + 3) // 4, 0)
        ptrs = img_ptr + tl.expand_dims(col_off, 1) + tl.expand_dims(w.to(tl.int64) * img_ld, 0)
        tl.store(ptrs, words, mask=ok)
    else:
        g = group0 + tl.arange(0, GROUPS)
        ok = tl.expand_dims(row_ok, 1) & tl.expand_dims(g < num_groups, 0)
        ptrs = img_ptr + tl.expand_dims(col_off, 1) + tl.expand_dims(g.to(tl.int64) * img_ld, 0)
        tl.store(ptrs, sf, mask=ok)
