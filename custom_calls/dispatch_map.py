"""Dispatch maps: where each (token, k) route goes in the grouped layouts, as two ops.

  dispatch_map_contig(topk_ids (M, k) int, expert_offset, *, num_local_experts, alignment)
      -> (src2dst (M, k) int32, m_indices (M_cap,) int32, num_rows () int32, counts (E_local,) int32)
  dispatch_map_masked(topk_ids (M, k) int, expert_offset, *, num_local_experts, m_pad, mark_dropped=False)
      -> (src2dst (M, k) int32, masked_m (E_local,) int32, num_dropped () int32)

A route is held here when its global id lies in [expert_offset, expert_offset + E_local) (ids < 0
are routes to nowhere); its local expert is id - expert_offset. Routes not held here get
src2dst = -1 and are not counted. Within an expert, routes keep (token, k) order.

Contig: expert e's segment starts at seg_start[e] = sum over e' < e of align(counts[e'], alignment)
and holds its counts[e] routes, src2dst = seg_start[e] + rank; m_indices[row] = the expert whose
routes fill that row, -1 for padding rows and rows past num_rows (= the sum of the padded
segments). M_cap = `contig_capacity(M, k, E_local, alignment)`, the smallest static bound that
no set of ids can overflow (derivation in moe_jax/dispatch.py).
Masked: expert e's slab holds rows [e * m_pad, (e + 1) * m_pad); src2dst = e * m_pad + rank for
rank < m_pad, else -1 and counted in num_dropped; masked_m = min(counts, m_pad). With
mark_dropped, a route held here but dropped gets E_local * m_pad (the row one past the last slab)
instead of -1: the permute skips it like any row outside its buffer, and the un-permute turns it
into NaN for its token (`custom_calls.contracts`), so a drop is never silent without a separate
pass over the routes.

The reference ranks with the stable argsort of `custom_calls.expert_rank` and places with XLA
ops; the Triton backend does it all without a sort in one launch (decode sizes) or two
(`custom_calls/triton/dispatch_map_kernel.py`). Both give the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from custom_calls.backends import declare_op, resolve
from custom_calls.expert_rank import rank_within_expert, stable_rank
from custom_calls.limits import check_index_extents, routes_and_rows
from layouts.checks import check_positive_int, check_rank

OP_CONTIG = "dispatch_map_contig"
OP_MASKED = "dispatch_map_masked"


def contig_capacity(num_tokens: int, top_k: int, num_local_experts: int, alignment: int) -> int:
    """Static row count M_cap of the contig layout: alignment * (n + (R - n) // alignment) with
    R = M * k routes and n = min(E_local, R) (derivation in moe_jax/dispatch.py)."""
    r = num_tokens * top_k
    n = min(num_local_experts, r)
    return alignment * (n + (r - n) // alignment)


def local_expert_ids(topk_ids: jax.Array, expert_offset, num_local_experts: int) -> jax.Array:
    """Global ids (M, k) -> local ids in [0, E_local), or E_local for routes not held here
    (outside [offset, offset + E_local), or -1). expert_offset: python int or traced int32 scalar."""
    local = topk_ids.astype(jnp.int32) - jnp.asarray(expert_offset, jnp.int32)
    here = (topk_ids >= 0) & (local >= 0) & (local < num_local_experts)
    return jnp.where(here, local, num_local_experts)


def _rank(e_flat: jax.Array, num_experts: int, rank_backend: str) -> tuple[jax.Array, jax.Array]:
    # the reference ranks directly: it resolves no other op
    if rank_backend == "reference":
        return stable_rank(e_flat, num_experts=num_experts)
    return rank_within_expert(e_flat, num_experts=num_experts, backend=rank_backend)


def dispatch_map_contig_xla(topk_ids, expert_offset, *, num_local_experts: int, alignment: int,
                            rank_backend: str = "reference"):
    """The reference of `dispatch_map_contig`: XLA placement around `rank_within_expert` run on
    `rank_backend` (the reference's stable argsort, or the three Triton ranking kernels: the
    dispatcher's path before the fused dispatch-map kernels, kept for comparison)."""
    m, k = topk_ids.shape
    e_loc = num_local_experts
    cap = contig_capacity(m, k, e_loc, alignment)
    e_flat = local_expert_ids(topk_ids, expert_offset, e_loc).reshape(-1)
    counts, rank = _rank(e_flat, e_loc, rank_backend)
    padded = (counts + alignment - 1) // alignment * alignment
    seg_start = jnp.cumsum(padded) - padded
    here = e_flat < e_loc
    dst = jnp.where(here, seg_start[jnp.minimum(e_flat, e_loc - 1)] + rank, -1)
    # row r belongs to the last expert whose segment starts at or before r (empty segments start
    # where the next one does), and holds a route if it lies within that expert's count: one
    # compare-and-count pass instead of a scatter
    row = jnp.arange(cap, dtype=jnp.int32)
    owner = jnp.sum(seg_start[None, :] <= row[:, None], axis=1, dtype=jnp.int32) - 1
    m_indices = jnp.where(row < seg_start[owner] + counts[owner], owner, -1)
    return (dst.reshape(m, k).astype(jnp.int32), m_indices.astype(jnp.int32),
            jnp.sum(padded).astype(jnp.int32), counts.astype(jnp.int32))


def dispatch_map_masked_xla(topk_ids, expert_offset, *, num_local_experts: int, m_pad: int,
                            mark_dropped: bool = False, rank_backend: str = "reference"):
    """The reference of `dispatch_map_masked` (`rank_backend` as in `dispatch_map_contig_xla`)."""
    m, k = topk_ids.shape
    e_loc = num_local_experts
    e_flat = local_expert_ids(topk_ids, expert_offset, e_loc).reshape(-1)
    counts, rank = _rank(e_flat, e_loc, rank_backend)
    held = e_flat < e_loc
    dropped_row = e_loc * m_pad if mark_dropped else -1
    dst = jnp.where(held, jnp.where(rank < m_pad, e_flat * m_pad + rank, dropped_row), -1)
    return (dst.reshape(m, k).astype(jnp.int32), jnp.minimum(counts, m_pad).astype(jnp.int32),
            jnp.sum(jnp.maximum(counts - m_pad, 0)).astype(jnp.int32))


declare_op(OP_CONTIG, stage="dispatch", static_args=("num_routes", "num_experts", "alignment"),
           reference=jax.jit(dispatch_map_contig_xla, static_argnames=("num_local_experts", "alignment")))
declare_op(OP_MASKED, stage="dispatch", static_args=("num_routes", "num_experts", "m_pad"),
           reference=jax.jit(dispatch_map_masked_xla, static_argnames=("num_local_experts", "m_pad", "mark_dropped")))


def _check_common(topk_ids: jax.Array, expert_offset, num_local_experts: int) -> jax.Array:
    check_rank("topk_ids", topk_ids, 2, "(M, top_k)")
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise TypeError(f"topk_ids: expected an integer dtype, got {topk_ids.dtype}")
    check_positive_int("num_local_experts", num_local_experts)
    offset = jnp.asarray(expert_offset)
    if offset.shape != () or not jnp.issubdtype(offset.dtype, jnp.integer):
        raise ValueError(f"expert_offset: expected an integer scalar, got shape {offset.shape} dtype {offset.dtype}")
    return offset.astype(jnp.int32)


def _run(op: str, topk_ids, expert_offset, num_local_experts: int, backend, options: dict, **size: int):
    """Check, resolve and call `op`; `size` is its one layout size (alignment or m_pad), `options`
    static keywords of the implementation that do not decide whether a backend can run it."""
    offset = _check_common(topk_ids, expert_offset, num_local_experts)
    ((name, value),) = size.items()
    check_positive_int(name, value)
    m, k = topk_ids.shape
    e = num_local_experts
    if op == OP_CONTIG:
        rows, rows_name = (lambda n: contig_capacity(n, k, e, value)), "contig rows (M_cap)"
    else:  # the drop mark's row E_local * m_pad is an index value too
        rows, rows_name = (lambda n: e * value), "masked rows (E_local * m_pad)"
    check_index_extents("topk_ids", m, lambda n: routes_and_rows(n, k, rows, rows_name))
    impl = resolve(op, backend, num_routes=m * k, num_experts=num_local_experts, **size)
    return impl.impl(topk_ids.astype(jnp.int32), offset, num_local_experts=num_local_experts, **options, **size)


def dispatch_map_contig(topk_ids: jax.Array, expert_offset=0, *, num_local_experts: int, alignment: int,
                        backend: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """topk_ids (M, k) global expert ids, expert_offset () int (python or traced) ->
    (src2dst (M, k) int32, m_indices (M_cap,) int32, num_rows () int32, counts (E_local,) int32);
    module docstring for the layout."""
    return _run(OP_CONTIG, topk_ids, expert_offset, num_local_experts, backend, {}, alignment=alignment)


def dispatch_map_masked(topk_ids: jax.Array, expert_offset=0, *, num_local_experts: int, m_pad: int,
                        mark_dropped: bool = False, backend: str | None = None
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """topk_ids (M, k) global expert ids, expert_offset () int (python or traced) ->
    (src2dst (M, k) int32 flat slab row or -1 (E_local * m_pad for a dropped route with
    mark_dropped), masked_m (E_local,) int32, num_dropped () int32); module docstring for the
    layout."""
    if not isinstance(mark_dropped, bool):
        raise TypeError(f"mark_dropped: expected a bool, got {mark_dropped!r}")
    return _run(OP_MASKED, topk_ids, expert_offset, num_local_experts, backend, {"mark_dropped": mark_dropped},
                m_pad=m_pad)
