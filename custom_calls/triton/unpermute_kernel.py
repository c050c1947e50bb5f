"""Post-permute as one Triton kernel: out[m] = routed_scaling_factor * sum_j w[m, j] * d[src2dst[m, j]]
(+ addend[m]), fp32 accumulation, one pass (each GEMM2 output row read once, each output row
written once).

Same signature and numerics as `custom_calls.unpermute` (the reference); a -1 route contributes
exactly nothing (its row is never loaded); a token with a row index >= R gets a NaN row, as in the
reference, and that index is never loaded (no memory outside `d` is read). Tiling:
`UnpermuteConfig` (`config=`; None: `heuristic_config()`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from layouts import ceil_div
from custom_calls.triton.launch import triton_call
from custom_calls.triton.tuning import check_launch, check_powers_of_two, config_or_default


@dataclasses.dataclass(frozen=True)
class UnpermuteConfig:
    """Tiling of `weighted_gather_kernel` (see `custom_calls.triton.tuning`): one output row's
    block_h columns (a power of two) per program."""

    block_h: int
    num_warps: int

    def __post_init__(self) -> None:
        check_powers_of_two(self, "block_h")
        check_launch(self)


def heuristic_config() -> UnpermuteConfig:
    """The default tiling: 1024 columns per program, 4 warps (every shape)."""
    return UnpermuteConfig(block_h=1024, num_warps=4)


@triton.jit
def weighted_gather_kernel(
    d_ptr, src2dst_ptr, w_ptr, add_ptr,
    out_ptr,
    R: tl.constexpr, H: tl.constexpr, TOPK: tl.constexpr, SCALE: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
):
    """Grid (M, cdiv(H, BLOCK_H)); d is (R, H); add (M, H) when HAS_ADDEND, added in fp32 after the
    scaling."""
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
    if HAS_ADDEND:
        acc += tl.load(add_ptr + t * H + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def unpermute(d: jax.Array, src2dst: jax.Array, topk_weights: jax.Array, addend: jax.Array | None = None, *,
              routed_scaling_factor: float, out_dtype, config: UnpermuteConfig | None = None) -> jax.Array:
    """d: (R, H), src2dst: (M, k) int32 (-1 = none), topk_weights: (M, k) float, addend: (M, H)
    float | None -> (M, H) out_dtype. config: the tiling (None: `heuristic_config()`)."""
    config = config_or_default(config, UnpermuteConfig, heuristic_config)
    m, top_k = src2dst.shape
    h = d.shape[1]
    if m == 0:
        return jnp.zeros((0, h), out_dtype)
    (out,) = triton_call(
        d, src2dst, topk_weights.astype(jnp.float32), jnp.zeros((1,), jnp.float32) if addend is None else addend,
        kernel=weighted_gather_kernel,
        out_shape=[jax.ShapeDtypeStruct((m, h), out_dtype)], grid=(m, ceil_div(h, config.block_h)),
        num_warps=config.num_warps, name="moe_unpermute", R=d.shape[0], H=h, TOPK=top_k,
        SCALE=float(routed_scaling_factor), BLOCK_H=config.block_h, HAS_ADDEND=addend is not None)
    return out
