"""EP "ring" (all-gather) mode: all-gather the tokens over the EP group, every rank runs its own
experts on every token, `psum_scatter` returns each rank its tokens' sums.

Trade-off (the user's choice, see ParallelConfig.ep_mode): it moves n x the tokens of an exact
all-to-all (every token reaches every rank, FP8 when the recipe allows) and computes on n * M rows,
but uses only two dense, bandwidth-optimal collectives with no data-dependent sizes. Public reports
measured `ragged_all_to_all` at 1-3% MFU on 8xB200 (~12 us per empty peer slice) against ~13% for
this scheme (marin#7012, openxla/xla#46982); at small EP sizes and decode batches it can win.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from moe_jax.parallel.a2a import axis_name
from moe_jax.parallel.ep_common import (EPGroup, SendQuant, check_routes, decode_rows, encode_rows,
                                        local_routes)


def ep_moe_ring(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, group: EPGroup,
                expert_fn: Callable[[jax.Array, jax.Array, jax.Array], jax.Array], *,
                quant: SendQuant | None, reduce_dtype) -> tuple[jax.Array, jax.Array]:
    """x: (M, H), topk_ids (M, k) int32 global (-1 = no route), topk_weights (M, k) f32.
    expert_fn(x (n*M, H), ids (n*M, k) this rank's experts else -1, weights) -> (n*M, H) f32.
    Returns (y (M, H) f32, dropped () int32 = 0)."""
    check_routes(x, topk_ids, topk_weights)
    packed, fmt = encode_rows(x, quant, topk_ids=topk_ids, topk_weights=topk_weights.astype(jnp.float32))
    everyone = jax.lax.all_gather(packed, axis_name(group.axes), axis=0, tiled=True)  # (n*M, B)
    f = decode_rows(everyone, fmt, quant, x.dtype)
    ids, w = local_routes(f["topk_ids"], f["topk_weights"], group, group.rank())
    y = expert_fn(f["x"], ids, w).astype(reduce_dtype)
    out = jax.lax.psum_scatter(y, axis_name(group.axes), scatter_dimension=0, tiled=True)
    return out.astype(jnp.float32), jnp.zeros((), jnp.int32)
