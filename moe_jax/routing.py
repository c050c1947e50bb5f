"""Routing (SPEC §3): scores, (grouped) top-k with correction bias, hash routing, renormalization.

`route(x, params, config, *, token_ids=None) -> (topk_ids (M, k) int32, topk_weights (M, k) f32)`.
Ties are broken by the lower expert (and group) id: `jax.lax.top_k` keeps the lower index first.
`routed_scaling_factor` is NOT applied here; the un-permute applies it once (SPEC §5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.config import MoEConfig
from moe_jax.params import MoEParams
from moe_jax.validate import check_x


_SQRTSOFTPLUS_LOW = -30.0  # exp(l) == softplus(l) in fp32 below this
# added to the renormalization denominator (as DeepSeek does) so all-underflowed weights give 0, not nan
_NORM_EPS = 1e-20


def router_logits(x: jax.Array, gate_weight: jax.Array) -> jax.Array:
    """x: (M, H) float, gate_weight: (E, H) float -> (M, E) f32 (fp32 products and sums)."""
    return jnp.einsum("mh,eh->me", x.astype(jnp.float32), gate_weight.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def score(logits: jax.Array, scoring: str) -> jax.Array:
    """logits: (M, E) f32 -> scores (M, E) f32. sqrtsoftplus = sqrt(softplus(l)), stable for large |l|."""
    if scoring == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    if scoring == "sigmoid":
        return jax.nn.sigmoid(logits)
    if scoring == "sqrtsoftplus":
        # for l << 0, softplus(l) ~ exp(l): use exp(l/2) there, so neither the value nor the
        # gradient of sqrt meets 0 (sqrt'(0) = inf would turn the gradient into nan)
        low = logits < _SQRTSOFTPLUS_LOW
        tail = jnp.exp(0.5 * jnp.where(low, logits, _SQRTSOFTPLUS_LOW))
        body = jnp.sqrt(jax.nn.softplus(jnp.where(low, 0.0, logits)))
        return jnp.where(low, tail, body)
    raise ValueError(f"scoring: expected softmax/sigmoid/sqrtsoftplus, got {scoring!r}")


def select_experts(sel: jax.Array, config: MoEConfig) -> jax.Array:
    """Top-k on selection scores sel: (M, E) f32 -> ids (M, k) int32, grouped when configured:
    group score = sum of the top-2 selection scores of each of n_group equal groups; only the
    topk_group best groups stay eligible."""
    if config.use_grouped_topk and config.n_group > 1:
        m, e = sel.shape
        g = config.n_group
        grouped = sel.reshape(m, g, e // g)
        top2 = jax.lax.top_k(grouped, min(2, e // g))[0].sum(-1)  # (M, G)
        _, keep = jax.lax.top_k(top2, config.topk_group)  # (M, topk_group)
        group_mask = jnp.zeros((m, g), bool).at[jnp.arange(m)[:, None], keep].set(True)
        sel = jnp.where(jnp.repeat(group_mask, e // g, axis=1), sel, -jnp.inf)
    _, ids = jax.lax.top_k(sel, config.top_k)
    return ids.astype(jnp.int32)


def route(x: jax.Array, params: MoEParams, config: MoEConfig, *,
          token_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x: (M, H) float -> (topk_ids (M, k) int32 global expert ids, topk_weights (M, k) f32).

    Hash-routed layers (`params.tid2eid` set) take ids from `tid2eid[token_ids]` (token_ids: (M,)
    int) and weights from the scores at those ids. Weights are the unbiased scores of the chosen
    experts, divided by their sum when `config.norm_topk_prob`. Differentiable w.r.t. x and
    gate_weight (the selection itself is integer-valued).
    """
    check_x(x, config)
    e, h = config.num_experts, config.hidden_size
    if params.gate_weight.shape != (e, h):
        raise ValueError(f"params.gate_weight: expected shape {(e, h)}, got {tuple(params.gate_weight.shape)}")
    scores = score(router_logits(x, params.gate_weight), config.scoring)
    if params.tid2eid is not None:
        if token_ids is None:
            raise ValueError("token_ids: required for a hash-routed layer (params.tid2eid is set), got None")
        if token_ids.shape != (x.shape[0],):
            raise ValueError(f"token_ids: expected shape ({x.shape[0]},), got {tuple(token_ids.shape)}")
        if not jnp.issubdtype(token_ids.dtype, jnp.integer):
            raise TypeError(f"token_ids: expected an integer dtype, got {token_ids.dtype}")
        ids = params.tid2eid[token_ids].astype(jnp.int32)
    else:
        sel = jax.lax.stop_gradient(scores)
        bias = params.e_score_correction_bias
        if bias is not None:
            if bias.shape != (e,):
                raise ValueError(f"params.e_score_correction_bias: expected shape {(e,)}, got {tuple(bias.shape)}")
            sel = sel + bias.astype(jnp.float32)
        ids = select_experts(sel, config)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if config.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + _NORM_EPS)
    return ids, weights
