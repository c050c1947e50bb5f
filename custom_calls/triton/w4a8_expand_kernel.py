"""W4A8 weights widened to FP8 in memory: prefill through DeepGEMM's FP8 contig GEMM instead of a W4A8 one.

values (G, N, K/2) int8 and scales (G, N, K/128) int32 (`layouts.w4a8`) -> e4m3 (G, N, K) with each
128-column block in the W4A8 column order, and the block scales sf128 (G, ceil(N/128), K/128) f32: the
fp8_block rhs of an FP8 GEMM whose lhs is in the W4A8 column order, as the layer's producers write it
for this weight form (`layouts.w4a8.w4a8_to_fp8_block_lhs_order` is the reference, bit for bit).

Why: at prefill the W4A8 GEMMs widen every weight tile once per token block, and that work does not
hide under the MMA (BENCHMARKS.md: the contig GEMM at 0.48-0.53x DeepGEMM's FP8 kernel); widening the
slice once per call costs one pass over the 4-bit weights and one write of the FP8 ones (at the copy
bandwidth on one H100), after which the FP8 kernel runs at its own speed: the pair is 0.70x DeepGEMM
on the FP8 weights at V4's 4096-token prefill, against 0.53x for the W4A8 kernel. The "w4a8" backend's
contig op runs it where `KernelSettings.w4a8_prefill` says (`custom_calls.w4a8_backend.contig_form`);
`bench w4a8 --layout contig` times the pair beside the W4A8 kernels.

One program widens a 128-row x 128-column tile (`w4a8_gemm_kernel._widen_tile`, the same byte
permutes as the GEMMs; widen="shifts" under Triton's interpreter) and writes its block scale, the
UE8M0 byte of the tile's first row's scale word (every row of a 128-row tile holds the same).

The same kernel widens whole experts for the fused layout (`custom_calls.w4a8_widen`, the "w4a8" backend):
in column order (the fused op quantizes its own tokens) and w13's rows [gate; up] written interleaved.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from custom_calls.triton.launch import triton_call
from custom_calls.triton.w4a8_gemm_kernel import WIDEN_MODES, _widen_tile
from custom_calls.w4a8_widen import check_widen_args
from layouts.checks import ceil_div

TILE = 128  # weight rows and columns a program widens: one block scale


@triton.jit
def w4a8_expand_kernel(w_ptr, sw_ptr, out_ptr, sf_ptr, N: tl.constexpr, K: tl.constexpr, TILE_N: tl.constexpr,
                       PRMT: tl.constexpr, COLUMNS: tl.constexpr, GATE_UP: tl.constexpr):
    """Program (row tile, K block, group): rows pid_n * TILE_N .. of group g (TILE_N = 128, one block
    scale), columns kb * 128 .. . COLUMNS: the tile in column order; GATE_UP > 0: the rows [gate; up]
    stored interleaved in chunks of GATE_UP (`layouts.interleave_gate_up`)."""
    pid_n = tl.program_id(0)
    kb = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    KB: tl.constexpr = K // 128
    n = pid_n * TILE_N + tl.arange(0, TILE_N)
    ok = n < N
    rows = g * N + n.to(tl.int64)
    word = tl.load(sw_ptr + rows * KB + kb, mask=ok, other=0)
    w = _widen_tile(w_ptr + rows[:, None] * (K // 2) + kb * 64 + tl.arange(0, 64)[None, :], word, ok, TILE_N, PRMT,
                    COLUMNS)
    if GATE_UP > 0:
        half = n // (N // 2)  # 0: gate row, 1: up row
        r = n - half * (N // 2)
        rows = g * N + ((r // GATE_UP) * 2 * GATE_UP + half * GATE_UP + r % GATE_UP).to(tl.int64)
    tl.store(out_ptr + rows[:, None] * K + kb * 128 + tl.arange(0, 128)[None, :], w, mask=ok[:, None])
    first = tl.load(sw_ptr + (g * N + pid_n * TILE_N) * KB + kb)  # row pid_n * TILE_N < N
    tl.store(sf_ptr + (g * tl.cdiv(N, TILE_N) + pid_n) * KB + kb, ((first & 0xFF) << 23).to(tl.float32, bitcast=True))


def w4a8_expand(values: jax.Array, scales: jax.Array, *, widen: str = "prmt", column_order: str = "w4a8",
                gate_up_interleave: int = 0) -> tuple[jax.Array, jax.Array]:
    """values (G, N, K/2) int8, scales (G, N, K/128) int32, K a multiple of 128 -> (e4m3 (G, N, K), sf128
    (G, ceil(N/128), K/128) f32), as `layouts.w4a8.w4a8_to_fp8_block_lhs_order` (column_order "w4a8") or
    `w4a8_to_fp8_block` ("columns"); gate_up_interleave g > 0: the N = 2I rows [gate; up] stored interleaved
    in chunks of g, as `layouts.interleave_gate_up` (the scales stay [gate; up]; I a multiple of 128, so
    no scale block mixes the halves). widen: "prmt" (PTX, GPU) or "shifts" (the same bytes by integer
    ops, what the interpreter runs)."""
    if widen not in WIDEN_MODES:
        raise ValueError(f"widen: expected one of {WIDEN_MODES}, got {widen!r}")
    g, n, k = check_widen_args(values, scales, column_order, gate_up_interleave)
    nt = ceil_div(n, TILE)
    out, sf = triton_call(values, scales, kernel=w4a8_expand_kernel,
                          out_shape=[jax.ShapeDtypeStruct((g, n, k), jnp.float8_e4m3fn),
                                     jax.ShapeDtypeStruct((g, nt, k // 128), jnp.float32)],
                          grid=(nt, k // 128, g), num_warps=4, name="w4a8_expand", N=n, K=k, TILE_N=TILE,
                          PRMT=widen == "prmt", COLUMNS=column_order == "columns", GATE_UP=gate_up_interleave)
    return out, sf


__all__ = ["TILE", "w4a8_expand", "w4a8_expand_kernel"]
