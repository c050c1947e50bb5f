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
    each of n_group equal groups is scored by the sum of its top-2 selection scores when the layer
    has a correction bias (V3's biased grouped top-k), else by its maximum (V2's grouped top-k, as
    SGLang and vLLM do); only the topk_group best groups stay eligible."""
    if config.use_grouped_topk and config.n_group > 1:
        m, e = sel.shape
        g = config.n_group
        grouped = sel.reshape(m, g, e // g)
        if config.use_correction_bias:
            group_score = jax.lax.top_k(grouped, min(2, e // g))[0].sum(-1)  # (M, G)
        else:
            group_score = jnp.max(grouped, axis=-1)
        _, keep = jax.lax.top_k(group_score, config.topk_group)  # (M, topk_group)
        group_mask = jnp.zeros((m, g), bool).at[jnp.arange(m)[:, None], keep].set(True)
        sel = jnp.where(jnp.repeat(group_mask, e // g, axis=1), sel, -jnp.inf)
    _, ids = jax.lax.top_k(sel, config.top_k)
    return ids.astype(jnp.int32)


def route(x: jax.Array, params: MoEParams, config: MoEConfig, *,
          token_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x: (M, H) float -> (topk_ids (M, k) int32 global expert ids, topk_weights (M, k) f32).

    Hash-routed layers (`config.hash_routing`) take ids from `params.tid2eid[token_ids]`
    (token_ids: (M,) int) and weights from the scores at those ids; other layers ignore
    token_ids, and a tid2eid table in their params is an error (it would mean the wrong config). Weights are the unbiased scores of the chosen
    experts, divided by their sum when `config.norm_topk_prob`. Differentiable w.r.t. x and
    gate_weight (the selection itself is integer-valued).
    """
    check_x(x, config)
    e, h = config.num_experts, config.hidden_size
    if params.gate_weight.shape != (e, h):
        raise ValueError(f"params.gate_weight: expected shape {(e, h)}, got {tuple(params.gate_weight.shape)}")
    if config.hash_routing and params.tid2eid is None:
        raise ValueError("params.tid2eid: required when config.hash_routing is True, got None")
    if not config.hash_routing and params.tid2eid is not None:
        raise ValueError(f"params.tid2eid: expected None for a layer with config.hash_routing=False, "
                         f"got an array of shape {tuple(params.tid2eid.shape)}")
    scores = score(router_logits(x, params.gate_weight), config.scoring)
    if config.hash_routing:
        if token_ids is None:
            raise ValueError("token_ids: required for a hash-routed layer (config.hash_routing), got None")
        if token_ids.shape != (x.shape[0],):
            raise ValueError(f"token_ids: expected shape ({x.shape[0]},), got {tuple(token_ids.shape)}")
        if not jnp.issubdtype(token_ids.dtype, jnp.integer):
            raise TypeError(f"token_ids: expected an integer dtype, got {token_ids.dtype}")
        ids = params.tid2eid[token_ids].astype(jnp.int32)
    else:
        sel = jax.lax.stop_gradient(scores)
        bias = params.e_score_correction_bias
        if config.use_correction_bias:
            if bias is None or bias.shape != (e,):
                got = None if bias is None else tuple(bias.shape)
                raise ValueError(f"params.e_score_correction_bias: expected shape {(e,)} "
                                 f"(config.use_correction_bias), got {got}")
            sel = sel + bias.astype(jnp.float32)
        elif bias is not None:
            raise ValueError(f"params.e_score_correction_bias: expected None for "
                             f"config.use_correction_bias=False, got shape {tuple(bias.shape)}")
        ids = select_experts(sel, config)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if config.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + _NORM_EPS)
    return ids, weights
