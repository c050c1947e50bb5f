"""EP "normal" mode (DeepEP normal): exact, variable-size dispatch and combine.

Each token travels once to every rank that holds at least one of its experts (not once per
expert), carrying all its top-k ids and weights; the receiver keeps the routes to its own experts.
Rows with no route (topk_ids all -1, e.g. DP padding) are never sent.

Receive buffer: (n * M, H) — rank i's rows land in slot block [i*M, (i+1)*M), M = this rank's
token buffer (static; a peer sends a token at most once, so M rows per peer is the exact worst
case: nothing is ever dropped). Both exchange implementations (a2a.py) fill it identically.
The receiver's routed experts scatter the arrived rows into the contig layout (m_indices, src2dst:
`routed_experts(layout="contig")`, DeepEP normal's ep_scatter); each row's weighted sum over this
rank's experts goes back on the reverse path, and `NormalHandle.send_pos` (the return-trip map,
DeepEP's output_index) sums every token's rows from all ranks.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from moe_jax.parallel.a2a import all_to_all_rows, ragged_all_to_all
from moe_jax.parallel.ep_common import (EPGroup, SendQuant, check_routes, decode_rows, empty_rows,
                                        encode_rows, local_routes)


class NormalRecv(NamedTuple):
    """What a rank received: x (n*M, H), topk_ids (n*M, k) global ids of ITS experts (-1 for
    other ranks' experts and empty slots), topk_weights (n*M, k) f32 (0 where the id is -1),
    num_recv_tokens_per_expert (E_local,) int32."""

    x: jax.Array
    topk_ids: jax.Array
    topk_weights: jax.Array
    num_recv_tokens_per_expert: jax.Array


class NormalHandle(NamedTuple):
    """Return-trip state (per rank, n = EP size):
    has_route (M, n) bool      row (token, rank) was sent
    send_pos (M, n) int32      its row in the send buffer
    send_counts (n,) int32     rows sent to each rank; send_offsets (n,) their first row (ragged)
    recv_counts (n,) int32     rows received from each rank (ragged)
    peer_offsets (n,) int32    where my rows sit in each source's send buffer (ragged)
    send_src (S,) int32        token of each send row, -1 = empty
    dropped () int32           routes not sent for lack of slots (0 unless slots < M)"""

    has_route: jax.Array
    send_pos: jax.Array
    send_counts: jax.Array
    send_offsets: jax.Array
    recv_counts: jax.Array
    peer_offsets: jax.Array
    send_src: jax.Array
    dropped: jax.Array


def _plan(topk_ids: jax.Array, group: EPGroup, ragged: bool, slots: int):
    n = group.size
    dest = jnp.where(topk_ids >= 0, topk_ids // group.num_local_experts, -1)  # (M, k)
    has = jnp.any(dest[:, :, None] == jnp.arange(n, dtype=jnp.int32)[None, None, :], axis=1)  # (M, n)
    slot = jnp.cumsum(has, axis=0, dtype=jnp.int32) - 1  # (M, n): order among rows to that rank
    sent = has & (slot < slots)
    # routes whose (token, rank) row did not fit (only when slots < M)
    lost = jnp.take_along_axis(sent, jnp.maximum(dest, 0), axis=1)
    dropped = jnp.sum((topk_ids >= 0) & ~lost, dtype=jnp.int32)
    counts = jnp.sum(sent, axis=0, dtype=jnp.int32)  # (n,)
    if ragged:
        offsets = jnp.cumsum(counts) - counts  # packed: destinations back to back
    else:
        offsets = jnp.arange(n, dtype=jnp.int32) * slots  # fixed slot block per destination
    pos = offsets[None, :] + slot
    return sent, pos, counts, offsets.astype(jnp.int32), dropped


def send_capacity(m: int, top_k: int, n: int, ragged: bool, slots: int | None = None) -> int:
    """Static rows of the send buffer: ragged packs at most M * min(top_k, n) (token, rank) pairs;
    dense reserves `slots` (default M) rows for each of the n destinations."""
    return m * min(top_k, n) if ragged else (m if slots is None else slots) * n


def normal_dispatch(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, group: EPGroup, *,
                    impl: str, quant: SendQuant | None, slots: int | None = None
                    ) -> tuple[NormalRecv, NormalHandle]:
    """x: (M, H) bf16/f32, topk_ids (M, k) int32 global (-1 = no route), topk_weights (M, k) f32.
    impl: "dense" | "ragged" | "ragged_emulated" (a2a.py). quant: FP8 rows on the wire, or None.
    slots ("dense" only): rows reserved per peer, default M (exact); fewer makes the buffers
    independent of M, and (token, rank) rows past it are not sent: their routes are counted in
    handle.dropped (the low-latency mode)."""
    check_routes(x, topk_ids, topk_weights)
    m, k = topk_ids.shape
    n = group.size
    ragged = impl != "dense"
    if slots is None:
        slots = m
    if ragged and slots != m:
        raise ValueError(f"slots: the ragged exchange is exact (slots = M = {m}), got {slots}")
    if slots < 1:
        raise ValueError(f"slots: expected >= 1 rows per peer, got {slots}")
    rank = group.rank()
    sent, pos, counts, offsets, dropped = _plan(topk_ids, group, ragged, slots)
    packed, fmt = encode_rows(x, quant, topk_ids=topk_ids, topk_weights=topk_weights.astype(jnp.float32))
    s = send_capacity(m, k, n, ragged, slots)
    # token of each send row (-1: empty): scatter token ids, then gather rows — no (M, n, B) temp
    tok = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32)[:, None], (m, n))
    src = jnp.full((s,), -1, jnp.int32).at[jnp.where(sent, pos, s).reshape(-1)].set(
        tok.reshape(-1), mode="drop")
    empty = empty_rows(1, fmt)[0]
    send = jnp.where((src >= 0)[:, None], packed[jnp.maximum(src, 0)], empty)
    if not ragged:
        recv = all_to_all_rows(send, group.axes)  # (n*slots, B)
        recv_counts = jnp.zeros((n,), jnp.int32)  # dense: validity is in the rows (ids -1)
        peer_offsets = jnp.zeros((n,), jnp.int32)
    else:
        meta = all_to_all_rows(jnp.stack([counts, offsets], axis=1), group.axes)  # (n, 2)
        recv_counts, peer_offsets = meta[:, 0], meta[:, 1]
        out = empty_rows(n * m, fmt)
        recv = ragged_all_to_all(send, out, offsets, counts, jnp.full((n,), rank * m, jnp.int32),
                                 recv_counts, group.axes, impl=impl, chunk=m)
    f = decode_rows(recv, fmt, quant, x.dtype)
    ids, w = local_routes(f["topk_ids"], f["topk_weights"], group, rank)
    e_lo = rank * group.num_local_experts
    local = jnp.arange(group.num_local_experts, dtype=jnp.int32) + e_lo
    per_expert = jnp.sum(ids[:, :, None] == local[None, None, :], axis=(0, 1), dtype=jnp.int32)
    return (NormalRecv(f["x"], ids, w, per_expert),
            NormalHandle(sent, pos, counts, offsets, recv_counts, peer_offsets, src, dropped))


def normal_combine(y: jax.Array, handle: NormalHandle, group: EPGroup, *, impl: str,
                   combine_dtype) -> jax.Array:
    """y: (R, H) f32 (R = received rows, n*M or n*slots) — each received row's weighted sum over
    this rank's experts -> (M, H) f32, each token's sum over all ranks. Rows travel back in
    `combine_dtype`."""
    n = group.size
    m = handle.has_route.shape[0]
    rows = handle.send_src.shape[0] if impl == "dense" else n * m  # what was received
    if y.shape[0] != rows:
        raise ValueError(f"y: expected {rows} rows (one per received row), got shape {tuple(y.shape)}")
    y = y.astype(combine_dtype)
    if impl == "dense":
        back = all_to_all_rows(y, group.axes)  # (n*slots, H): block d from rank d
    else:
        out = jnp.zeros((handle.send_src.shape[0], y.shape[1]), y.dtype)
        back = ragged_all_to_all(y, out, jnp.arange(n, dtype=jnp.int32) * m, handle.recv_counts,
                                 handle.peer_offsets, handle.send_counts, group.axes, impl=impl, chunk=m)
    rows = back[jnp.clip(handle.send_pos, 0, back.shape[0] - 1)]  # (M, n, H)
    rows = jnp.where(handle.has_route[:, :, None], rows.astype(jnp.float32), 0.0)
    return jnp.sum(rows, axis=1)


def ep_moe_normal(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, group: EPGroup,
                  expert_fn: Callable[[jax.Array, jax.Array, jax.Array], jax.Array], *, impl: str,
                  quant: SendQuant | None, combine_dtype) -> tuple[jax.Array, jax.Array]:
    """dispatch -> expert_fn(x (R, H), topk_ids (R, k), topk_weights (R, k)) -> (R, H) f32 -> combine.
    Returns (y (M, H) f32, dropped () int32 = 0: this mode is exact)."""
    recv, handle = normal_dispatch(x, topk_ids, topk_weights, group, impl=impl, quant=quant)
    y = expert_fn(recv.x, recv.topk_ids, recv.topk_weights)
    out = normal_combine(y, handle, group, impl=impl, combine_dtype=combine_dtype)
    return out, jnp.zeros((), jnp.int32)
