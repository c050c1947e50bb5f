"""W4A8 grouped GEMMs on SM90: MXFP4 weights kept 4-bit (`layouts.w4a8`), e4m3 activations.

Masked: D[g, m, :] = A[g, m, :] . W[g]^T for m < masked_m[g], as `m_grouped_gemm_masked` with recipe
"mxfp4" on arch 90 (its W4A8 form): A (G, m_pad, K) e4m3 in the W4A8 column order (`layouts.w4a8`)
with fp32 1x128 scales in the MN-major image; W (G, N, K/2) int8 e2m1 words and (G, N, K/128) int32
scale words -> D (G, m_pad, N) bf16.
Contig: as `m_grouped_gemm_contig`, A (M_cap, K) rows grouped by expert (m_indices).

Masked, per program: one group g, BLOCK_N weight rows and BLOCK_M token rows; it computes the
transposed tile D^T = W . A^T so the weights are the MMA's M side (64-row wgmma tiles), the few
decode tokens its N side. Contig: a BLOCK_M x BLOCK_N tile of one expert's rows, D = A . W^T.
Per 128 columns of K: load BLOCK_N x 64 weight bytes and BLOCK_N scale words, widen the bytes to
e4m3 in registers (two byte permutes per 4 bytes from the 32-group's e4m3 table, `layouts.w4a8`;
the table's two words computed from its index), arranged in the tokens' column order,
one FP8 MMA over the 128 columns, then the fp32 promotion
acc += partial * (weight block scale per row) * (activation scale per token): DeepGEMM's 1D2D
recipe, on exactly the e4m3 operands the FP4 -> FP8 load path makes. widen="prmt" is that
conversion in PTX (GPU only); "shifts" selects the same bytes from the same words with integer shifts
(what Triton's interpreter can run; the GPU tests compare the two bit for bit).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from layouts.checks import align, ceil_div
from custom_calls.triton.launch import triton_call

WIDEN_MODES = ("prmt", "shifts")

_PRMT_ASM = tl.constexpr("""{
.reg .b32 sel, sgn;
and.b32 sel, $2, 0x7777;
prmt.b32 $0, $3, $7, sel;
and.b32 sgn, $2, 0x80808080;
or.b32 $0, $0, sgn;
shr.u32 sel, $2, 16;
and.b32 sel, sel, 0x7777;
prmt.b32 $1, $3, $7, sel;
shl.b32 sgn, $2, 4;
and.b32 sgn, sgn, 0x80808080;
or.b32 $1, $1, sgn;
}""")


@dataclasses.dataclass(frozen=True)
class W4A8Config:
    """Tiling of the W4A8 GEMM: weight rows and token rows per program, warps, pipeline stages."""

    block_n: int = 128
    block_m: int = 32
    num_warps: int = 4
    num_stages: int = 4


def heuristic_config(expected_m: int) -> W4A8Config:
    """Masked: the token tile from the expected rows per group, the smallest of 16 / 32 / 64 / 128
    covering it; 64 weight rows per program (more programs per SM: faster than 128 at decode)."""
    block_m = 16
    while block_m < min(max(expected_m, 1), 128):
        block_m *= 2
    return W4A8Config(block_n=64, block_m=block_m, num_stages=4 if block_m <= 64 else 3)


def contig_config(alignment: int) -> W4A8Config:
    """Contig: 128 x 128 tiles (64 token rows where the alignment is 64), tensor-core bound."""
    return W4A8Config(block_n=128, block_m=min(128, alignment), num_warps=8, num_stages=3)


@triton.jit
def _table_words(idx):
    """idx [...] int32 table indices -> (lo, hi) [...] int32: `E4M3_TABLES[idx]` as two little-endian
    words, computed rather than gathered so that no load's address depends on a loaded value (Triton
    pipelines the weight loads only then). Tables 8+ (6+ for hi) hold normal e4m3 numbers: the s = 0
    table with s added to each nonzero byte's exponent field. Below that, e4m3 subnormals rounded to
    nearest even, spelled out (tests check every index against `layouts.w4a8.table_words`)."""
    s = idx - 13
    lo = 0x3C383000 + s * 0x08080800
    hi = 0x4C484440 + s * 0x08080808
    lo = tl.where(idx >= 8, lo, tl.where(idx == 7, 0x0C080400, tl.where(idx == 6, 0x06040200, tl.where(
        idx == 5, 0x03020100, tl.where(idx == 4, 0x02010000, tl.where(idx == 3, 0x01000000, 0))))))
    hi = tl.where(idx >= 6, hi, tl.where(idx == 5, 0x0C080604, tl.where(idx == 4, 0x06040302, tl.where(
        idx == 3, 0x03020201, tl.where(idx == 2, 0x02010100, tl.where(idx == 1, 0x01000000, 0))))))
    return lo, hi


@triton.jit
def _widen_prmt(wbytes, t_lo, t_hi):
    """wbytes [R, C] int8 (4 bytes = one word, C a multiple of 4), t_lo / t_hi [R, C] int32 (the
    word's table) -> (even [R, C], odd [R, C]) float8e4nv: columns 2p and 2p + 1 of stored byte p."""
    return tl.inline_asm_elementwise(_PRMT_ASM, "=r,=r,r,r,r,r,r,r,r,r,r", [wbytes, t_lo, t_hi],
                                     dtype=(tl.float8e4nv, tl.float8e4nv), is_pure=True, pack=4)


@triton.jit
def _widen_tile(w_ptrs, word, ok, BLOCK_N: tl.constexpr, PRMT: tl.constexpr, COLUMNS: tl.constexpr):
    """The [BLOCK_N, 128] e4m3 weight tile of one K block in the tokens' W4A8 column order
    (`layouts.w4a8.LHS_ORDER`: position 32s + 16e + 4c + i holds column 32c + 8s + 2i + e, i.e. byte i
    of the even (e = 0) or odd (e = 1) half of word 4c + s), so the MMA pairs each weight with its
    token column; COLUMNS: in column order instead. w_ptrs [BLOCK_N, 64] byte pointers, word [BLOCK_N]
    int32 scale words, ok [BLOCK_N] rows in range (others read as +0)."""
    wbytes = tl.load(w_ptrs, mask=ok[:, None], other=0)
    # a 32-group's table index: 5 bits per group from bit 8; 16 stored bytes per group
    shifts = 8 + 5 * tl.arange(0, 4)
    t_lo, t_hi = _table_words((word[:, None] >> shifts[None, :]) & 31)  # [BLOCK_N, 4]
    if PRMT:
        t_lo = tl.reshape(tl.broadcast_to(t_lo[:, :, None], (BLOCK_N, 4, 16)), (BLOCK_N, 64))
        t_hi = tl.reshape(tl.broadcast_to(t_hi[:, :, None], (BLOCK_N, 4, 16)), (BLOCK_N, 64))
        even, odd = _widen_prmt(wbytes, t_lo, t_hi)  # [BLOCK_N, 64]: byte 4q + i of word q = 4c + s
        if COLUMNS:  # stored byte p widens to columns 2p (even) and 2p + 1 (odd)
            return tl.reshape(tl.join(even, odd), (BLOCK_N, 128))
        even = tl.permute(tl.reshape(even, (BLOCK_N, 4, 4, 4)), (0, 2, 1, 3))  # (c, s, i) -> (s, c, i)
        odd = tl.permute(tl.reshape(odd, (BLOCK_N, 4, 4, 4)), (0, 2, 1, 3))
        return tl.reshape(tl.permute(tl.join(even, odd), (0, 1, 4, 2, 3)), (BLOCK_N, 128))  # (s, e, c, i)
    else:
        # prmt's byte selection in integer ops, on the same words
        b = tl.reshape(wbytes.to(tl.uint8, bitcast=True).to(tl.uint32), (BLOCK_N, 16, 4))
        words = tl.sum(b << (8 * tl.arange(0, 4))[None, None, :].to(tl.uint32), axis=2)  # [BLOCK_N, 16]
        # even column 2i of a word: magnitude at bit 4i, sign at bit 8i + 7; odd 2i + 1: 16 + 4i, 8i + 3
        col = tl.arange(0, 8)
        mag_shift = tl.where(col % 2 == 0, 4 * (col // 2), 16 + 4 * (col // 2)).to(tl.uint32)
        sign_shift = tl.where(col % 2 == 0, 8 * (col // 2) + 7, 8 * (col // 2) + 3).to(tl.uint32)
        mag = (words[:, :, None] >> mag_shift[None, None, :]) & 7  # [BLOCK_N, 16, 8]
        sign = (words[:, :, None] >> sign_shift[None, None, :]) & 1
        # word -> its group's table
        t_lo = tl.reshape(tl.broadcast_to(t_lo[:, :, None], (BLOCK_N, 4, 4)), (BLOCK_N, 16)).to(tl.uint32, bitcast=True)
        t_hi = tl.reshape(tl.broadcast_to(t_hi[:, :, None], (BLOCK_N, 4, 4)), (BLOCK_N, 16)).to(tl.uint32, bitcast=True)
        table = tl.where(mag < 4, t_lo[:, :, None], t_hi[:, :, None])
        byte = ((table >> (8 * (mag & 3))) & 0xFF) | (sign << 7)  # [BLOCK_N, word 4c + s, column 2i + e]
        if COLUMNS:
            return tl.reshape(byte.to(tl.uint8), (BLOCK_N, 128)).to(tl.float8e4nv, bitcast=True)
        byte = tl.permute(tl.reshape(byte.to(tl.uint8), (BLOCK_N, 4, 4, 4, 2)), (0, 2, 4, 1, 3))  # (s, e, c, i)
        return tl.reshape(byte, (BLOCK_N, 128)).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _weight_block(w_rows, sw_rows, kb, n_ok, BLOCK_N: tl.constexpr, PRMT: tl.constexpr):
    """K block kb of BLOCK_N weight rows: (e4m3 tile [BLOCK_N, 128], block scale per row [BLOCK_N] f32).
    w_rows [BLOCK_N, 1] / sw_rows [BLOCK_N]: the rows' value and scale-word pointers."""
    word = tl.load(sw_rows + kb, mask=n_ok, other=0)
    w = _widen_tile(w_rows + kb * 64 + tl.arange(0, 64)[None, :], word, n_ok, BLOCK_N, PRMT, False)
    return w, ((word & 0xFF) << 23).to(tl.float32, bitcast=True)


@triton.jit
def w4a8_masked_kernel(a_ptr, sa_ptr, w_ptr, sw_ptr, masked_m_ptr, d_ptr,
                       M_PAD: tl.constexpr, N: tl.constexpr, K: tl.constexpr, SA_LD: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRMT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    g = tl.program_id(2)
    rows = tl.load(masked_m_ptr + g)
    if pid_m * BLOCK_M >= rows:
        return
    KB: tl.constexpr = K // 128
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = n < N
    m_ok = m < rows
    g64 = g.to(tl.int64)
    w_rows = w_ptr + g64 * N * (K // 2) + n.to(tl.int64)[:, None] * (K // 2)
    sw_rows = sw_ptr + g64 * N * KB + n.to(tl.int64) * KB
    a_rows = a_ptr + g64 * M_PAD * K + m.to(tl.int64)[:, None] * K
    sa_cols = sa_ptr + g64 * KB * SA_LD + m
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for kb in range(KB):
        # issued before the MMA so that its latency hides under it (Triton pipelines only the operands)
        a_scale = tl.load(sa_cols + kb * SA_LD, mask=m_ok, other=0.0)
        w, w_scale = _weight_block(w_rows, sw_rows, kb, n_ok, BLOCK_N, PRMT)
        a = tl.load(a_rows + kb * 128 + tl.arange(0, 128)[None, :], mask=m_ok[:, None], other=0.0)
        part = tl.dot(w, tl.trans(a))
        acc += part * w_scale[:, None] * a_scale[None, :]
    d = d_ptr + g64 * M_PAD * N + m.to(tl.int64)[None, :] * N + n[:, None]
    tl.store(d, acc.to(tl.bfloat16), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def w4a8_contig_kernel(a_ptr, sa_ptr, w_ptr, sw_ptr, m_indices_ptr, d_ptr,
                       M_CAP: tl.constexpr, N: tl.constexpr, K: tl.constexpr, SA_LD: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRMT: tl.constexpr):
    """Rows grouped by expert, BLOCK_M rows of one expert per program (BLOCK_M divides the op's
    alignment): its expert is its first row's m_indices entry; rows with -1 (padding) are written 0."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    KB: tl.constexpr = K // 128
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    expert = tl.load(m_indices_ptr + pid_m * BLOCK_M)
    row_ok = tl.load(m_indices_ptr + m) >= 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if expert >= 0:
        e64 = expert.to(tl.int64)
        w_rows = w_ptr + e64 * N * (K // 2) + n.to(tl.int64)[:, None] * (K // 2)
        sw_rows = sw_ptr + e64 * N * KB + n.to(tl.int64) * KB
        a_rows = a_ptr + m.to(tl.int64)[:, None] * K
        for kb in range(KB):
            a_scale = tl.load(sa_ptr + kb * SA_LD + m)
            w, w_scale = _weight_block(w_rows, sw_rows, kb, n_ok, BLOCK_N, PRMT)
            a = tl.load(a_rows + kb * 128 + tl.arange(0, 128)[None, :])
            part = tl.dot(a, tl.trans(w))
            acc += part * a_scale[:, None] * w_scale[None, :]
    acc = tl.where(row_ok[:, None], acc, 0.0)
    d = d_ptr + m.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(d, acc.to(tl.bfloat16), mask=n_ok[None, :])


def w4a8_masked(lhs: jax.Array, lhs_scale: jax.Array, rhs: jax.Array, rhs_scale: jax.Array, masked_m: jax.Array,
                *, expected_m: int, config: W4A8Config | None = None, widen: str = "prmt") -> jax.Array:
    """lhs (G, m_pad, K) e4m3, lhs_scale (G, ceil(K/128), align(m_pad, 4)) f32, rhs (G, N, K/2) int8,
    rhs_scale (G, N, K/128) int32, masked_m (G,) int32 in [0, m_pad] -> (G, m_pad, N) bf16; rows
    >= masked_m[g] are left unwritten (unspecified). Operands already checked (`m_grouped_gemm_masked`);
    K a multiple of 128."""
    if widen not in WIDEN_MODES:
        raise ValueError(f"widen: expected one of {WIDEN_MODES}, got {widen!r}")
    g, m_pad, k = lhs.shape
    n = rhs.shape[1]
    cfg = config or heuristic_config(expected_m)
    grid = (ceil_div(n, cfg.block_n), ceil_div(m_pad, cfg.block_m), g)
    (d,) = triton_call(lhs, lhs_scale, rhs, rhs_scale, masked_m, kernel=w4a8_masked_kernel,
                       out_shape=[jax.ShapeDtypeStruct((g, m_pad, n), jnp.bfloat16)], grid=grid,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages, name="w4a8_masked",
                       M_PAD=m_pad, N=n, K=k, SA_LD=align(m_pad, 4), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                       PRMT=widen == "prmt")
    return d


def w4a8_contig(lhs: jax.Array, lhs_scale: jax.Array, rhs: jax.Array, rhs_scale: jax.Array, m_indices: jax.Array,
                *, alignment: int, config: W4A8Config | None = None, widen: str = "prmt") -> jax.Array:
    """lhs (M_cap, K) e4m3, lhs_scale (ceil(K/128), align(M_cap, 4)) f32, rhs (G, N, K/2) int8,
    rhs_scale (G, N, K/128) int32, m_indices (M_cap,) int32 (canonical: each block of `alignment` rows
    one expert's from its first row, -1 padding) -> (M_cap, N) bf16, padding rows 0. Operands already
    checked (`m_grouped_gemm_contig`); K a multiple of 128; config.block_m divides `alignment`."""
    if widen not in WIDEN_MODES:
        raise ValueError(f"widen: expected one of {WIDEN_MODES}, got {widen!r}")
    m_cap, k = lhs.shape
    n = rhs.shape[1]
    cfg = config or contig_config(alignment)
    if alignment % cfg.block_m:
        raise ValueError(f"config.block_m: expected a divisor of alignment={alignment}, got {cfg.block_m}")
    grid = (ceil_div(n, cfg.block_n), m_cap // cfg.block_m)
    (d,) = triton_call(lhs, lhs_scale, rhs, rhs_scale, m_indices, kernel=w4a8_contig_kernel,
                       out_shape=[jax.ShapeDtypeStruct((m_cap, n), jnp.bfloat16)], grid=grid,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages, name="w4a8_contig",
                       M_CAP=m_cap, N=n, K=k, SA_LD=align(m_cap, 4), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                       PRMT=widen == "prmt")
    return d

