"""Slot assignment for dispatch as three small Triton kernels: per-expert counts and the rank of every
route among the routes of its expert, in (token, k) order — what `moe_jax.dispatch` computes with a
stable argsort (`custom_calls.expert_rank`, the reference), without the sort.

  rank_within_expert(e_flat (R,) int32 in [0, E], num_experts=E) -> (counts (E,) int32, rank (R,) int32)
  (value E marks a route not held here; its rank is among those routes, as the argsort gives it;
  a value outside [0, E] is not counted and never indexes memory out of bounds)

Pass 1: each program one-hot counts its chunk of CHUNK routes -> chunk_counts (NC, E + 1).
Between: one program per expert column turns the counts into each chunk's offset (an exclusive
cumulative sum over chunks) and the expert's total (XLA runs such a scan as a chain of small kernels).
Pass 2: each program ranks its chunk with a cumulative sum of the one-hot matrix along the chunk
and adds the chunk's offset for the route's expert. Deterministic, no atomics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from layouts import ceil_div
from custom_calls.triton.launch import triton_call
from custom_calls.triton.support import rank_chunk_size



@triton.jit
def chunk_count_kernel(e_ptr, counts_ptr, R: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    i = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(e_ptr + i, mask=i < R, other=E_PAD)  # out of range: matches no column
    hot = (tl.expand_dims(e, 1) == tl.expand_dims(tl.arange(0, E_PAD), 0)).to(tl.int32)
    tl.store(counts_ptr + c * E_PAD + tl.arange(0, E_PAD), tl.sum(hot, axis=0))


@triton.jit
def chunk_offsets_kernel(counts_ptr, offs_ptr, totals_ptr, NC: tl.constexpr, NC_PAD: tl.constexpr,
                         E_PAD: tl.constexpr):
    e = tl.program_id(0)
    rows = tl.arange(0, NC_PAD)
    v = tl.load(counts_ptr + rows * E_PAD + e, mask=rows < NC, other=0)
    incl = tl.cumsum(v, axis=0)
    tl.store(offs_ptr + rows * E_PAD + e, incl - v, mask=rows < NC)
    tl.store(totals_ptr + e, tl.sum(v, axis=0))


@triton.jit
def chunk_rank_kernel(e_ptr, offs_ptr, rank_ptr, R: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    i = c * CHUNK + tl.arange(0, CHUNK)
    ok = i < R
    e = tl.load(e_ptr + i, mask=ok, other=E_PAD)
    hot = tl.expand_dims(e, 1) == tl.expand_dims(tl.arange(0, E_PAD), 0)
    seen = tl.cumsum(hot.to(tl.int32), axis=0)  # inclusive: routes of each expert so far in the chunk
    within = tl.sum(tl.where(hot, seen, 0), axis=1) - 1
    # a value outside [0, E_PAD) matches no column (rank -1) and must not index offs
    base = tl.load(offs_ptr + c * E_PAD + e, mask=ok & (e >= 0) & (e < E_PAD), other=0)
    tl.store(rank_ptr + i, within + base, mask=ok)


def rank_within_expert(e_flat: jax.Array, *, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """e_flat: (R,) int32 in [0, num_experts] -> (counts (num_experts,) int32, rank (R,) int32)."""
    (r,) = e_flat.shape
    if r == 0:  # nothing to launch over
        return jnp.zeros((num_experts,), jnp.int32), jnp.zeros((0,), jnp.int32)
    e_pad = triton.next_power_of_2(num_experts + 1)
    chunk = rank_chunk_size(num_experts)
    nc = max(1, ceil_div(r, chunk))
    e_flat = e_flat.astype(jnp.int32)
    (chunk_counts,) = triton_call(e_flat, kernel=chunk_count_kernel,
                                  out_shape=[jax.ShapeDtypeStruct((nc, e_pad), jnp.int32)], grid=(nc,),
                                  num_warps=4, name="moe_dispatch_count", R=r, E_PAD=e_pad, CHUNK=chunk)
    offs, totals = triton_call(chunk_counts, kernel=chunk_offsets_kernel,
                               out_shape=[jax.ShapeDtypeStruct((nc, e_pad), jnp.int32),
                                          jax.ShapeDtypeStruct((e_pad,), jnp.int32)],
                               grid=(e_pad,), num_warps=4, name="moe_dispatch_offsets", NC=nc,
                               NC_PAD=triton.next_power_of_2(nc), E_PAD=e_pad)
    (rank,) = triton_call(e_flat, offs, kernel=chunk_rank_kernel,
                          out_shape=[jax.ShapeDtypeStruct((r,), jnp.int32)], grid=(nc,), num_warps=4,
                          name="moe_dispatch_rank", R=r, E_PAD=e_pad, CHUNK=chunk)
    return totals[:num_experts], rank
