"""The SM90 W4A8 weight form: MXFP4 experts kept 4-bit for GEMMs that widen them to e4m3 in registers.

The FP4 -> FP8 load path (`layouts.weight_paths.mxfp4_to_fp8_block`) turns each 128 x 128 tile into
e4m3 values RNE(v * 2^s) and one block scale sf128 = max(tile's 32-group scales) / 2^6, where v is
an e2m1 value and s = log2(sf32 / sf128) <= 6 its 32-group's exponent below the block scale. This
form stores the same information in 0.53 bytes per weight instead of 1:

  values (..., N, K/2) int8: the e2m1 codes, 8 per 4-byte word, bits permuted within the word
         (`pack_w4a8_words`) so that two byte permutes widen a word to 8 e4m3 bytes;
  scales (..., N, ceil(K/128)) int32, one word per row and 128 columns: bits 0-7 the UE8M0
         exponent byte of the tile's sf128, bits 8-27 the four 32-groups' e4m3 table indices
         (5 bits each, group j at bit 8 + 5j).

Table index t = s + 13 for s in [-12, 6]; t = 0 for s <= -13 (every value then rounds to zero).
`E4M3_TABLES[t]` holds the e4m3 bytes RNE(v * 2^(t - 13)) of the 8 e2m1 magnitudes, so a widened
weight is exactly the FP4 -> FP8 path's e4m3 byte (subnormal and rounded products included) and the
GEMM multiplies it by the same sf128: W4A8 computes on that path's operands bit for bit
(`w4a8_to_fp8_block` proves it). One case differs: a tile whose largest 32-group scale is below
2^-120 (every weight under 6 * 2^-120) has its block scale raised to 2^-126, the smallest UE8M0
scale, and its values rounded against that.

Word layout (little-endian uint32 of 4 stored bytes; q the word, i in 0..3): the code of column
8q + 2i has its magnitude at bits 4i..4i+2 and its sign at bit 8i + 7; column 8q + 2i + 1 has its
magnitude at bits 16 + 4i..16 + 4i + 2 and its sign at bit 8i + 3. Then, with a table (lo, hi) as
two uint32 of 4 bytes each:
  even bytes = prmt(lo, hi, w & 0x7777)         | (w & 0x80808080)         -> columns 8q + 2i
  odd bytes  = prmt(lo, hi, (w >> 16) & 0x7777) | ((w << 4) & 0x80808080)  -> columns 8q + 2i + 1
and byte i of `even`, `odd` interleaved is column 8q + 2i, 8q + 2i + 1 (stored byte p of a row
widens to columns 2p and 2p + 1).

Activations (the GEMMs' lhs) in the W4A8 column order: e4m3 with fp32 1 x 128 scales as fp8_block on
SM90, but each whole 128-column block stored permuted, byte 32s + 16e + 4c + i holding column
32c + 8s + 2i + e (`LHS_ORDER`; a trailing partial block stays in column order). A kernel thread c
widens words 4c..4c+3 of a row's block, all in 32-group c (one table), and word 4c + s feeds k32 step
s of the MMA as its even (e = 0) and odd (e = 1) columns; in this order a K block's bytes already sit
where the MMA reads step s, so the tokens go to shared memory by one TMA copy, unchanged. The layer's
producers (pre-permute, activation + quantization) write this order directly; `to_w4a8_lhs_order` /
`from_w4a8_lhs_order` convert, and `layouts.gemm_format("mxfp4", 90).quantize_lhs` gives it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from layouts.checks import ceil_div, check_dtype, check_min_ndim
from layouts.fp4 import E2M1_VALUES, MAX_OFFSET_BITS, MXFP4_GROUP, unpack_e2m1
from layouts.fp8 import FP8_BLOCK
from layouts.ue8m0 import ue8m0_bytes_to_fp32

W4A8_BLOCK = FP8_BLOCK  # columns per scale word, rows and columns per block scale
W4A8_WORD = 8  # e2m1 codes per 4-byte word
TABLE_BIAS = 13  # table index = s + TABLE_BIAS
NUM_TABLES = 20  # s in [-12, 6] and the all-zero table
INDEX_BITS = 5
MIN_TILE_EXPONENT = 1  # UE8M0 byte of the smallest block scale, 2^-126


def _lhs_order() -> np.ndarray:
    """(128,) int: the column stored at each byte of a 128-column block (module docstring)."""
    s, e, c, i = np.meshgrid(np.arange(4), np.arange(2), np.arange(4), np.arange(4), indexing="ij")
    return (32 * c + 8 * s + 2 * i + e).reshape(-1)


LHS_ORDER = _lhs_order()
LHS_POSITION = np.argsort(LHS_ORDER)  # the stored byte of each column


def _permute_blocks(x: jax.Array, index: np.ndarray) -> jax.Array:
    """x (..., K): each whole 128-column block gathered by `index`, a partial last block as is."""
    k = x.shape[-1]
    full = k - k % W4A8_BLOCK
    if full == 0:
        return x
    blocks = x[..., :full].reshape(*x.shape[:-1], full // W4A8_BLOCK, W4A8_BLOCK)
    out = jnp.take(blocks, jnp.asarray(index, jnp.int32), axis=-1).reshape(*x.shape[:-1], full)
    return jnp.concatenate([out, x[..., full:]], axis=-1) if full < k else out


def to_w4a8_lhs_order(x: jax.Array) -> jax.Array:
    """x (..., K) in column order -> the same values in the W4A8 column order (module docstring)."""
    check_min_ndim("x", x, 1, "(..., K)")
    return _permute_blocks(x, LHS_ORDER)


def from_w4a8_lhs_order(x: jax.Array) -> jax.Array:
    """x (..., K) in the W4A8 column order -> column order (inverse of `to_w4a8_lhs_order`)."""
    check_min_ndim("x", x, 1, "(..., K)")
    return _permute_blocks(x, LHS_POSITION)


def _e4m3_tables() -> np.ndarray:
    """(NUM_TABLES, 8) uint8: row t = the e4m3 bytes of the e2m1 magnitudes times 2^(t - 13), RNE
    (row 0: zeros)."""
    mags = np.array(E2M1_VALUES, np.float64)
    rows = [np.zeros(8, np.uint8)]
    for t in range(1, NUM_TABLES):
        rows.append((mags * 2.0 ** (t - TABLE_BIAS)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    return np.stack(rows)


E4M3_TABLES = _e4m3_tables()


def table_words() -> np.ndarray:
    """(NUM_TABLES, 2) uint32: each table as the (lo, hi) byte-permute operands (little-endian)."""
    return E4M3_TABLES.view("<u4").reshape(NUM_TABLES, 2)


# bit positions of the 8 codes of a word: (magnitude's lowest bit, sign bit) per column 0..7
_EVEN = [(4 * i, 8 * i + 7) for i in range(4)]
_ODD = [(16 + 4 * i, 8 * i + 3) for i in range(4)]
_COLUMN_BITS = [b for pair in zip(_EVEN, _ODD) for b in pair]


def pack_w4a8_words(codes: jax.Array) -> jax.Array:
    """codes: (..., K) uint8 e2m1 codes, K a multiple of 8 -> (..., K/2) int8 in the W4A8 word layout."""
    check_dtype("codes", codes, (jnp.uint8,))
    check_min_ndim("codes", codes, 1, "(..., K)")
    k = codes.shape[-1]
    if k % W4A8_WORD:
        raise ValueError(f"codes: expected K a multiple of {W4A8_WORD} (8 codes per word), got K = {k}")
    c = codes.reshape(*codes.shape[:-1], k // W4A8_WORD, W4A8_WORD).astype(jnp.uint32)
    word = jnp.zeros(c.shape[:-1], jnp.uint32)
    for col, (mag_bit, sign_bit) in enumerate(_COLUMN_BITS):
        word = word | ((c[..., col] & 7) << mag_bit) | (((c[..., col] >> 3) & 1) << sign_bit)
    as_bytes = jax.lax.bitcast_convert_type(word, jnp.uint8)  # (..., K/8, 4), little-endian
    return jax.lax.bitcast_convert_type(as_bytes.reshape(*codes.shape[:-1], k // 2), jnp.int8)


def unpack_w4a8_words(values: jax.Array) -> jax.Array:
    """values: (..., K/2) int8 in the W4A8 word layout -> codes (..., K) uint8 (inverse of `pack_w4a8_words`)."""
    check_dtype("values", values, (jnp.int8,))
    check_min_ndim("values", values, 1, "(..., K/2)")
    kb = values.shape[-1]
    if kb % 4:
        raise ValueError(f"values: expected a last axis that is a multiple of 4 (whole words), got {kb}")
    b = jax.lax.bitcast_convert_type(values, jnp.uint8).reshape(*values.shape[:-1], kb // 4, 4)
    word = jax.lax.bitcast_convert_type(b, jnp.uint32)
    cols = [(((word >> mag_bit) & 7) | (((word >> sign_bit) & 1) << 3)).astype(jnp.uint8)
            for mag_bit, sign_bit in _COLUMN_BITS]
    return jnp.stack(cols, axis=-1).reshape(*values.shape[:-1], 2 * kb)


def group_tiles(sf: jax.Array) -> jax.Array:
    """Per-32-group values (scales, exponents) of (..., N, G) weights, G = ceil(K/32), gathered by
    128 x 128 tile: -> (..., ceil(N/128), 128, ceil(K/128), 4), zero-padded past N and G (a zero
    never wins a tile's maximum of positive scales). `untile_groups` is the inverse."""
    n, g = sf.shape[-2:]
    nb, gpb = ceil_div(n, W4A8_BLOCK), W4A8_BLOCK // MXFP4_GROUP
    kb = ceil_div(g, gpb)
    padded = jnp.pad(sf, [(0, 0)] * (sf.ndim - 2) + [(0, nb * W4A8_BLOCK - n), (0, kb * gpb - g)])
    return padded.reshape(*sf.shape[:-2], nb, W4A8_BLOCK, kb, gpb)


def untile_groups(tiles: jax.Array, n: int, g: int) -> jax.Array:
    """(..., nb, 128, kb, 4) from `group_tiles` -> (..., N, G): the padding dropped."""
    nb, _, kb, gpb = tiles.shape[-4:]
    return tiles.reshape(*tiles.shape[:-4], nb * W4A8_BLOCK, kb * gpb)[..., :n, :g]


def _exponent(sf: jax.Array) -> jax.Array:
    """Biased fp32 exponent of positive powers of two (0 for 0.0): (...) f32 -> (...) int32."""
    return ((jax.lax.bitcast_convert_type(sf, jnp.uint32) >> 23) & 0xFF).astype(jnp.int32)


def mxfp4_to_w4a8(packed: jax.Array, sf32: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MXFP4 checkpoint weights -> the W4A8 form (module docstring).

    packed: (..., N, K/2) int8 e2m1 pairs (`layouts.fp4` order), K a multiple of 8; sf32: (..., N,
    ceil(K/32)) f32 powers of two (0.0 only as padding) -> values (..., N, K/2) int8 (word layout),
    scales (..., N, ceil(K/128)) int32 (UE8M0 byte of the tile's block scale | table indices).
    """
    check_dtype("packed", packed, (jnp.int8,))
    check_dtype("sf32", sf32, (jnp.float32,))
    check_min_ndim("packed", packed, 2, "(..., N, K/2)")
    n, k = packed.shape[-2], 2 * packed.shape[-1]
    g = ceil_div(k, MXFP4_GROUP)
    if tuple(sf32.shape) != (*packed.shape[:-1], g):
        raise ValueError(f"sf32: expected shape {(*packed.shape[:-1], g)} (packed {tuple(packed.shape)}, "
                         f"K = {k}, 32-groups), got {tuple(sf32.shape)}")
    tiles = group_tiles(_exponent(sf32))  # (..., nb, 128, kb, gpb)
    lead, (kb, gpb) = packed.shape[:-2], tiles.shape[-2:]
    e128 = jnp.maximum(jnp.max(tiles, axis=(-3, -1)) - MAX_OFFSET_BITS, MIN_TILE_EXPONENT)  # (..., nb, kb)
    s = tiles - e128[..., :, None, :, None]  # exponent offsets, <= 6
    t = jnp.where(tiles > 0, jnp.clip(s + TABLE_BIAS, 0, NUM_TABLES - 1), 0)
    t = untile_groups(t, n, kb * gpb).reshape(*lead, n, kb, gpb)
    word = untile_groups(jnp.broadcast_to(e128[..., :, None, :, None], tiles.shape), n, kb * gpb)[..., ::gpb]
    for j in range(gpb):
        word = word | (t[..., j] << (8 + INDEX_BITS * j))
    return pack_w4a8_words(unpack_e2m1(packed)), word.astype(jnp.int32)


def split_w4a8_scales(scales: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """scales: (..., N, ceil(K/128)) int32 W4A8 scale words -> (block scale (..., N, ceil(K/128)) f32,
    table index per 32-group (..., N, ceil(K/32)) int32)."""
    check_dtype("scales", scales, (jnp.int32,))
    u = scales.astype(jnp.uint32)
    block = ue8m0_bytes_to_fp32((u & 0xFF).astype(jnp.uint8))
    idx = jnp.stack([(u >> (8 + INDEX_BITS * j)) & (2**INDEX_BITS - 1) for j in range(W4A8_BLOCK // MXFP4_GROUP)],
                    axis=-1)
    idx = idx.reshape(*scales.shape[:-1], -1)[..., :ceil_div(k, MXFP4_GROUP)]
    return block, idx.astype(jnp.int32)


def widen_w4a8(values: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """What a W4A8 GEMM computes on: values (..., N, K/2) int8 + scales (..., N, ceil(K/128)) int32 ->
    (e4m3 weights (..., N, K), block scale per row and 128 columns (..., N, ceil(K/128)) f32), by the
    table lookup the kernels make."""
    check_dtype("values", values, (jnp.int8,))
    k = 2 * values.shape[-1]
    codes = unpack_w4a8_words(values).astype(jnp.int32)
    block, idx = split_w4a8_scales(scales, k)
    t = jnp.repeat(idx, MXFP4_GROUP, axis=-1)[..., :k]
    byte = jnp.asarray(E4M3_TABLES)[t, codes & 7] | ((codes >> 3) << 7).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(byte, jnp.float8_e4m3fn), block


def w4a8_to_fp8_block(values: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The W4A8 form widened to the FP4 -> FP8 path's operands: (e4m3 (..., N, K), sf128 (...,
    ceil(N/128), ceil(K/128)) f32), equal bit for bit to `mxfp4_to_fp8_block` of the same checkpoint
    weights (block scales below 2^-126 aside, module docstring)."""
    w, block = widen_w4a8(values, scales)
    return w, block[..., ::W4A8_BLOCK, :]


def w4a8_to_fp8_block_lhs_order(values: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`w4a8_to_fp8_block` with each whole 128-column block of the e4m3 weights stored in the W4A8 column
    order: the rhs of an FP8 block-scaled GEMM whose lhs is in that order (`to_w4a8_lhs_order`). Both
    operands permute the same columns within each block, which one block scale covers, so the GEMM sums
    the same products as on the column-order pair."""
    w, sf = w4a8_to_fp8_block(values, scales)
    return to_w4a8_lhs_order(w), sf


__all__ = ["E4M3_TABLES", "LHS_ORDER", "LHS_POSITION", "NUM_TABLES", "W4A8_BLOCK", "from_w4a8_lhs_order", "group_tiles",
           "mxfp4_to_w4a8", "pack_w4a8_words", "split_w4a8_scales", "table_words", "to_w4a8_lhs_order",
           "unpack_w4a8_words", "untile_groups", "w4a8_to_fp8_block", "w4a8_to_fp8_block_lhs_order", "widen_w4a8"]
