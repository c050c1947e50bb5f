"""Post-permute as one Triton kernel: out[m] = routed_scaling_factor * sum_j w[m, j] * d[src2dst[m, j]],
fp32 accumulation, one pass (each GEMM2 output row read once, each output row written once).

Same signature and numerics as `custom_calls.unpermute` (the reference); a -1 route contributes
exactly nothing (its row is never loaded); a token with a row index >= R gets a NaN row, as in the
reference, and that index is never loaded (no memory outside `d` is read).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from layouts import ceil_div
from custom_calls.triton.launch import triton_call

_BLOCK_H = 1024
_NUM_WARPS = 4


@triton.jit
def weighted_gather_kernel(
    d_ptr, src2dst_ptr, w_ptr,
    out_ptr,
    R: tl.constexpr, H: tl.constexpr, TOPK: tl.constexpr, SCALE: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Grid (M, cdiv(H, BLOCK_H)); d is (R, H)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.zeros((BLOCK_H,), tl.float32)
    beyond = False
    for j in tl.static_range(TOPK):
        dst = tl.load(src2dst_ptr + t * TOPK + j)
        w = tl.load(w_ptr + t * TOPK + j).to(tl.float32)
        ok = (dst >= 0) & (dst < R)
        beyond = beyond | (dst >= R)
        row = tl.load(d_ptr + tl.maximum(dst, 0).to(tl.int64) * H + cols, mask=col_ok & ok, other=0.0)
        acc += tl.where(ok, w, 0.0) * row.to(tl.float32)
    acc = tl.where(beyond, float("nan"), acc * SCALE)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def unpermute(d: jax.Array, src2dst: jax.Array, topk_weights: jax.Array, *,
              routed_scaling_factor: float, out_dtype) -> jax.Array:
    """d: (R, H), src2dst: (M, k) int32 (-1 = none), topk_weights: (M, k) float -> (M, H) out_dtype."""
    m, top_k = src2dst.shape
    h = d.shape[1]
    if m == 0:
        return jnp.zeros((0, h), out_dtype)
    (out,) = triton_call(
        d, src2dst, topk_weights.astype(jnp.float32), kernel=weighted_gather_kernel,
        out_shape=[jax.ShapeDtypeStruct((m, h), out_dtype)], grid=(m, ceil_div(h, _BLOCK_H)),
        num_warps=_NUM_WARPS, name="moe_unpermute", R=d.shape[0], H=h, TOPK=top_k,
        SCALE=float(routed_scaling_factor), BLOCK_H=_BLOCK_H)
    return out
