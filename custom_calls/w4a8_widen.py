"""MXFP4 experts kept 4-bit (the W4A8 form, `layouts.w4a8`) widened to FP8 block weights in memory, for a
kernel that reads FP8 weights only: `widen_w4a8_weights`. The layer calls it where the fused MoE op runs
W4A8 params (moe_jax/layer.py: at prefill the fused kernel on the widened copy beats the W4A8 GEMMs).

values (G, N, K/2) int8 + scales (G, N, K/128) int32 -> (e4m3 (G, N, K), sf128 (G, ceil(N/128), K/128) f32):
the FP4 -> FP8 load path's operands bit for bit (`layouts.w4a8.w4a8_to_fp8_block`; block scales below
2^-126 aside), each 128-column block in column order ("columns") or in the W4A8 column order ("w4a8",
`layouts.w4a8.LHS_ORDER`), and w13's rows [gate; up] optionally interleaved (`gate_up_interleave`,
`layouts.interleave_gate_up`; the scales stay [gate; up]). Reference: those layouts functions. Backend
"w4a8": one Triton program per 128 x 128 tile (`custom_calls.triton.w4a8_expand_kernel`): one read of
the 4-bit weights and one write of the FP8 copy, which lives as long as the caller keeps it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from custom_calls.backends import declare_op, resolve
from layouts import interleave_gate_up
from layouts.w4a8 import W4A8_BLOCK, to_w4a8_lhs_order, w4a8_to_fp8_block

OP = "widen_w4a8_weights"
COLUMN_ORDERS = ("columns", "w4a8")


def _reference(values, scales, *, column_order: str, gate_up_interleave: int):
    w, sf = w4a8_to_fp8_block(values, scales)
    if column_order == "w4a8":
        w = to_w4a8_lhs_order(w)
    if gate_up_interleave:
        w = interleave_gate_up(w, gate_up_interleave)
    return w, sf


declare_op(OP, stage="gemm", static_args=("n", "k", "column_order", "gate_up_interleave"),
           reference=jax.jit(_reference, static_argnames=("column_order", "gate_up_interleave")))


def check_widen_args(values, scales, column_order: str, gate_up_interleave: int) -> tuple[int, int, int]:
    """Trace-time checks of `widen_w4a8_weights`' arguments (also the Triton kernel's host code) -> (G, N, K)."""
    if values.ndim != 3 or values.dtype != jnp.int8:
        raise ValueError(f"values: expected (G, N, K/2) int8, got {tuple(values.shape)} {values.dtype}")
    g, n, half_k = values.shape
    k = 2 * half_k
    if k == 0 or k % W4A8_BLOCK:
        raise ValueError(f"values: K = 2 x {half_k} = {k} must be a positive multiple of {W4A8_BLOCK} (whole "
                         f"scale words)")
    if tuple(scales.shape) != (g, n, k // W4A8_BLOCK) or scales.dtype != jnp.int32:
        raise ValueError(f"scales: expected {(g, n, k // W4A8_BLOCK)} int32 (one word per row and 128 columns of "
                         f"values {tuple(values.shape)}), got {tuple(scales.shape)} {scales.dtype}")
    if column_order not in COLUMN_ORDERS:
        raise ValueError(f"column_order: expected one of {COLUMN_ORDERS}, got {column_order!r}")
    if isinstance(gate_up_interleave, bool) or not isinstance(gate_up_interleave, int) or gate_up_interleave < 0:
        raise ValueError(f"gate_up_interleave: expected 0 or a positive int, got {gate_up_interleave!r}")
    if gate_up_interleave and (n % (2 * W4A8_BLOCK) or (n // 2) % gate_up_interleave):
        raise ValueError(f"values: gate_up_interleave={gate_up_interleave} needs N = 2I rows [gate; up] with I a "
                         f"multiple of {W4A8_BLOCK} and of {gate_up_interleave}, got N = {n}")
    return g, n, k


def widen_w4a8_weights(values: jax.Array, scales: jax.Array, *, column_order: str = "columns",
                       gate_up_interleave: int = 0, backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """W4A8 weights -> FP8 block weights (module docstring).

    values: (G, N, K/2) int8 (`layouts.w4a8` word layout); scales: (G, N, K/128) int32 scale words; K a
    multiple of 128 -> (w (G, N, K) float8_e4m3fn, sf128 (G, ceil(N/128), K/128) f32). column_order:
    "columns" | "w4a8"; gate_up_interleave: 0, or g > 0 for w13 (N = 2I rows [gate; up], I a multiple of
    128 and of g) stored interleaved in chunks of g. backend: as every op's (None: the default).
    """
    _, n, k = check_widen_args(values, scales, column_order, gate_up_interleave)
    impl = resolve(OP, backend, n=n, k=k, column_order=column_order, gate_up_interleave=gate_up_interleave)
    return impl.impl(values, scales, column_order=column_order, gate_up_interleave=gate_up_interleave)


__all__ = ["COLUMN_ORDERS", "OP", "check_widen_args", "widen_w4a8_weights"]
