"""Routing: scores, (grouped) top-k with correction bias, hash routing, renormalization.

`route(x, params, config, *, token_ids=None) -> (topk_ids (..., k) int32, topk_weights (..., k) f32)`.
Ties are broken by the lower expert (and group) id: `jax.lax.top_k` keeps the lower index first.
`routed_scaling_factor` is NOT applied here; the un-permute applies it once.

Hash routing and token ids outside the vocabulary: checked mode (`debug_checks=True` under
`custom_calls.checked`, jitted or not) reports the first position outside [0, vocab_size) and its
value; without it, an eager call with concrete token_ids raises a ValueError naming them, and under jit
such a token is routed nowhere: its topk_ids row is -1 and its weights 0, so its routed output is
exactly 0 on every backend (a -1 route is dropped by the dispatch and the fused op alike), and
`moe_forward` returns its shared-expert output alone. It never takes another token's routes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from custom_calls.route_topk import renormalize, route_topk, score, select_topk
from moe_jax.config import MoEConfig
from moe_jax.params import MoEParams
from moe_jax.validate import check_call_size, check_token_ids, flatten_tokens


def router_logits(x: jax.Array, gate_weight: jax.Array) -> jax.Array:
    """x: (M, H) float, gate_weight: (E, H) float -> (M, E) f32 (fp32 products and sums).

    With bf16 tokens and a bf16 gate (DeepSeek's checkpoints store it so) the GEMM runs on bf16
    operands with fp32 accumulation: a bf16 x bf16 product is exact in fp32, so it computes the
    same products as the fp32 path at a fraction of the cost (only the summation order may differ,
    which can reorder near-tied experts: ties go to the lower expert id in both). Other dtypes
    are multiplied in fp32 at HIGHEST precision."""
    if x.dtype == jnp.bfloat16 and gate_weight.dtype == jnp.bfloat16:
        return jnp.einsum("mh,eh->me", x, gate_weight, preferred_element_type=jnp.float32)
    return jnp.einsum("mh,eh->me", x.astype(jnp.float32), gate_weight.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def select_experts(sel: jax.Array, config: MoEConfig) -> jax.Array:
    """Top-k on selection scores sel: (M, E) f32 -> ids (M, k) int32, grouped as the config says
    (`custom_calls.route_topk.select_topk`: groups scored by their top-2 sum when the layer has a
    correction bias, else by their maximum)."""
    return select_topk(sel, top_k=config.top_k, n_group=routing_groups(config), topk_group=config.topk_group,
                       group_by_top2=config.use_correction_bias)


def routing_groups(config: MoEConfig) -> int:
    """The n_group the routing epilogue runs with: config.n_group for grouped top-k, else 1."""
    return config.n_group if config.use_grouped_topk and config.n_group > 1 else 1


def check_router(params: MoEParams, config: MoEConfig) -> None:
    """The routing parameters against the config (gate weight, correction bias, tid2eid)."""
    e, h = config.num_experts, config.hidden_size
    if params.gate_weight.shape != (e, h):
        raise ValueError(f"params.gate_weight: expected shape {(e, h)}, got {tuple(params.gate_weight.shape)}")
    if config.hash_routing and params.tid2eid is None:
        raise ValueError("params.tid2eid: required when config.hash_routing is True, got None")
    if config.hash_routing and tuple(params.tid2eid.shape) != (config.vocab_size, config.top_k):
        raise ValueError(f"params.tid2eid: expected shape {(config.vocab_size, config.top_k)} "
                         f"(vocab_size, top_k), got {tuple(params.tid2eid.shape)}")
    if not config.hash_routing and params.tid2eid is not None:
        raise ValueError(f"params.tid2eid: expected None for a layer with config.hash_routing=False, "
                         f"got an array of shape {tuple(params.tid2eid.shape)}")
    bias = params.e_score_correction_bias
    if config.use_correction_bias:
        if bias is None or bias.shape != (e,):
            got = None if bias is None else tuple(bias.shape)
            raise ValueError(f"params.e_score_correction_bias: expected shape {(e,)} "
                             f"(config.use_correction_bias), got {got}")
    elif bias is not None:
        raise ValueError(f"params.e_score_correction_bias: expected None for "
                         f"config.use_correction_bias=False, got shape {tuple(bias.shape)}")


def route(x: jax.Array, params: MoEParams, config: MoEConfig, *, token_ids: jax.Array | None = None,
          backend: str | None = None, debug_checks: bool = False) -> tuple[jax.Array, jax.Array]:
    """x: (..., H) float -> (topk_ids (..., k) int32 global expert ids, topk_weights (..., k) f32).

    Hash-routed layers (`config.hash_routing`) take ids from `params.tid2eid[token_ids]`
    (token_ids: (...) int, the leading dims of x, values in [0, vocab_size)) and weights from the
    scores at those ids; other layers ignore token_ids, and a tid2eid table in their params is an
    error (it would mean the wrong config). A token id outside [0, vocab_size): ValueError naming
    its position and value when token_ids are concrete; reported in checked mode (debug_checks,
    static, under `custom_calls.checked`); else, under jit, that token gets topk_ids -1 and
    weights 0 (routed nowhere, `hash_route_ids`). Weights are the unbiased scores of the chosen
    experts, divided by their sum when `config.norm_topk_prob`. Differentiable w.r.t. x and
    gate_weight (the selection itself is integer-valued) on the reference backend. `backend` runs
    the epilogue after the gate GEMM (`custom_calls.route_topk`); hash routing has none. The
    batch must fit the layer's size limits (`moe_jax.validate.check_call_size`, config sizes).
    """
    x2, lead = flatten_tokens(x, config)
    check_router(params, config)
    check_call_size(x2.shape[0], config)
    tok = check_token_ids(token_ids, lead, config, debug_checks=debug_checks)
    ids, weights = route_tokens(x2, params, config, tok, backend)
    k = config.top_k
    return ids.reshape(*lead, k), weights.reshape(*lead, k)


def hash_route_ids(tid2eid: jax.Array, token_ids: jax.Array) -> jax.Array:
    """tid2eid (V, k) int, token_ids (M,) int -> (M, k) int32 tid2eid rows; a token id outside
    [0, V) gets a row of -1 (routed nowhere), never another token's row."""
    v = tid2eid.shape[0]
    ok = (token_ids >= 0) & (token_ids < v)
    rows = jnp.take(tid2eid, jnp.where(ok, token_ids, 0), axis=0).astype(jnp.int32)
    return jnp.where(ok[:, None], rows, -1)


def route_tokens(x: jax.Array, params: MoEParams, config: MoEConfig, token_ids: jax.Array | None,
                 backend: str | None) -> tuple[jax.Array, jax.Array]:
    """`route` on checked inputs: x (M, H), token_ids (M,) int or None -> ((M, k), (M, k)). A hash
    route whose id is outside [0, E) (an out-of-vocabulary token's -1) gets weight 0 and does not
    count in the renormalization."""
    logits = router_logits(x, params.gate_weight)
    if config.hash_routing:
        ids = hash_route_ids(params.tid2eid, token_ids)
        valid = (ids >= 0) & (ids < config.num_experts)
        picked = jnp.take_along_axis(score(logits, config.scoring), jnp.where(valid, ids, 0), axis=1)
        weights = jnp.where(valid, picked, 0.0)
        return ids, renormalize(weights) if config.norm_topk_prob else weights
    return route_topk(logits, params.e_score_correction_bias, top_k=config.top_k, scoring=config.scoring,
                      n_group=routing_groups(config), topk_group=config.topk_group,
                      norm_topk_prob=config.norm_topk_prob, backend=backend)
