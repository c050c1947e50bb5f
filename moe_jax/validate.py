"""Trace-time checks of the layer's per-call inputs (tokens, token ids, routes) against the config:
clear ValueError/TypeError naming the argument, the expected and the actual value. Each public
entry point of `moe_jax.layer` / `moe_jax.routing` runs them once; the parameters are checked by
`moe_jax.params.check_params`.

Tokens may carry any number of leading dimensions, `(..., H)`: the entry points flatten them to
`(M, H)` (M = their product) and restore them on the way out.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from layouts import FLOAT_DTYPES
from layouts.checks import check_dtype
from moe_jax.config import MoEConfig


def check_x(x: jax.Array, config: MoEConfig) -> tuple[int, ...]:
    """x: (..., H) float with at least one token; returns the leading shape."""
    if x.ndim < 2:
        raise ValueError(f"x: expected rank >= 2 (..., H={config.hidden_size}), got shape {tuple(x.shape)}")
    if x.shape[-1] != config.hidden_size:
        raise ValueError(f"x: expected shape (..., H={config.hidden_size}), got {tuple(x.shape)}")
    if math.prod(x.shape[:-1]) < 1:
        raise ValueError(f"x: expected at least one token (..., H={config.hidden_size}), got shape "
                         f"{tuple(x.shape)}")
    check_dtype("x", x, FLOAT_DTYPES)
    return tuple(x.shape[:-1])


def flatten_tokens(x: jax.Array, config: MoEConfig) -> tuple[jax.Array, tuple[int, ...]]:
    """Checked x (..., H) -> ((M, H), leading shape)."""
    lead = check_x(x, config)
    return x.reshape(-1, x.shape[-1]), lead


def check_token_ids(token_ids: jax.Array | None, lead: tuple[int, ...], config: MoEConfig) -> jax.Array | None:
    """token_ids: lead-shaped int (hash-routed layers need them) -> (M,) or None."""
    if not config.hash_routing:
        return None if token_ids is None else token_ids.reshape(-1)
    if token_ids is None:
        raise ValueError("token_ids: required for a hash-routed layer (config.hash_routing), got None")
    if tuple(token_ids.shape) != lead:
        raise ValueError(f"token_ids: expected shape {lead} (the leading dims of x), got {tuple(token_ids.shape)}")
    if not jnp.issubdtype(token_ids.dtype, jnp.integer):
        raise TypeError(f"token_ids: expected an integer dtype, got {token_ids.dtype}")
    return token_ids.reshape(-1)


def flatten_routes(topk_ids: jax.Array, topk_weights: jax.Array, lead: tuple[int, ...],
                   config: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """topk_ids / topk_weights (*lead, k) int / float -> (M, k) each."""
    want = (*lead, config.top_k)
    if tuple(topk_ids.shape) != want or tuple(topk_weights.shape) != want:
        raise ValueError(f"topk_ids/topk_weights: expected shape {want}, got "
                         f"{tuple(topk_ids.shape)} / {tuple(topk_weights.shape)}")
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise TypeError(f"topk_ids: expected an integer dtype, got {topk_ids.dtype}")
    if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
        raise TypeError(f"topk_weights: expected a float dtype, got {topk_weights.dtype}")
    k = config.top_k
    return topk_ids.reshape(-1, k), topk_weights.reshape(-1, k)
