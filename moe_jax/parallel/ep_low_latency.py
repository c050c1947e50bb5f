"""EP "low-latency" mode (DeepEP LL): buffers of a fixed per-peer capacity, masked layout on arrival.

The exchange is the normal mode's dense one (ep_normal.py: each token travels once to each rank
holding one of its experts, one all-to-all out, one back, no count exchange), with every rank
reserving C = num_max_dispatch_tokens_per_rank (default 128) rows per peer instead of M: buffers
of n * C rows whatever the batch, so one compiled step serves every batch size up to C (the
decode / CUDA-graph regime the mode exists for). On arrival the rows are laid out as masked slabs
(E_local, m_pad, H) + masked_m by the layer's masked dispatch (`routed_experts(layout="masked")`,
m_pad >= n * C: one expert may receive every arrival).

A rank sending more than C tokens to one peer cannot fit them: those (token, rank) rows are not
sent and their routes are COUNTED (`dropped`), never silently lost. C >= M, the rank's token
buffer, is the static worst case and never drops; `sharded_moe_forward` accepts a smaller C only
with `return_stats=True`, and `ParallelConfig.strict_capacity` turns it into a trace-time error.

Why not DeepEP's (source, expert) slots: a dense XLA all-to-all moves the whole buffer, and
E * C rows (256 * 128 for DeepSeek-V3) would move 32x the rows of n * C per decode step.
"""

from __future__ import annotations

from typing import Callable

import jax

from moe_jax.parallel.ep_common import EPGroup, SendQuant
from moe_jax.parallel.ep_normal import NormalHandle, NormalRecv, normal_combine, normal_dispatch


def ll_dispatch(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, group: EPGroup, *,
                capacity: int, quant: SendQuant | None) -> tuple[NormalRecv, NormalHandle]:
    """x: (M, H), topk_ids (M, k) int32 global (-1 = no route), topk_weights (M, k) f32
    -> arrival rows (n * capacity of them, normal-mode format) and the return-trip handle
    (handle.dropped: routes not sent)."""
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"num_max_dispatch_tokens_per_rank: expected a positive int, got {capacity!r}")
    return normal_dispatch(x, topk_ids, topk_weights, group, impl="dense", quant=quant, slots=capacity)


def ll_combine(y: jax.Array, handle: NormalHandle, group: EPGroup, *, combine_dtype) -> jax.Array:
    """y: (n * capacity, H) f32 per arrival row (weighted sum over this rank's experts) -> (M, H) f32."""
    return normal_combine(y, handle, group, impl="dense", combine_dtype=combine_dtype)


def ep_moe_low_latency(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, group: EPGroup,
                       masked_expert_fn: Callable[[jax.Array, jax.Array, jax.Array], jax.Array], *,
                       capacity: int, quant: SendQuant | None, combine_dtype) -> tuple[jax.Array, jax.Array]:
    """dispatch -> masked_expert_fn(x (n*C, H), ids (n*C, k), weights) -> (n*C, H) f32 (this rank's
    experts on the masked layout) -> combine. Returns (y (M, H) f32, dropped () int32)."""
    recv, handle = ll_dispatch(x, topk_ids, topk_weights, group, capacity=capacity, quant=quant)
    y = masked_expert_fn(recv.x, recv.topk_ids, recv.topk_weights)
    return ll_combine(y, handle, group, combine_dtype=combine_dtype), handle.dropped
