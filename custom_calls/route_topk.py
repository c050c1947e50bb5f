"""Routing epilogue: router logits -> scores -> (grouped) top-k on the bias-corrected
scores -> weights from the unbiased scores, renormalized. The gate GEMM before it and hash routing
stay in moe_jax.routing; the gate GEMM as split-K partial sums (`router_partials_reference`, the
model of the Triton router kernel that feeds the fused op's routing) is here.

Ties are broken by the lower expert (and group) id: `jax.lax.top_k` keeps the lower index first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from layouts.checks import check_dtype, check_rank
from custom_calls.backends import declare_op, resolve

OP = "route_topk"
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
_SQRTSOFTPLUS_LOW = -30.0  # exp(l) == softplus(l) in fp32 below this
# added to the renormalization denominator (as DeepSeek does) so all-underflowed weights give 0, not nan
NORM_EPS = 1e-20


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
    raise ValueError(f"scoring: expected one of {SCORINGS}, got {scoring!r}")


def select_topk(sel: jax.Array, *, top_k: int, n_group: int = 1, topk_group: int = 1,
                group_by_top2: bool = False) -> jax.Array:
    """Top-k on selection scores sel: (M, E) f32 -> ids (M, top_k) int32. With n_group > 1, each of
    the n_group equal groups is scored by the sum of its top-2 selection scores (group_by_top2: V3's
    biased grouped top-k) or by its maximum (V2's, as SGLang and vLLM do); only the topk_group best
    groups stay eligible."""
    if n_group > 1:
        m, e = sel.shape
        grouped = sel.reshape(m, n_group, e // n_group)
        if group_by_top2:
            group_score = jax.lax.top_k(grouped, min(2, e // n_group))[0].sum(-1)  # (M, G)
        else:
            group_score = jnp.max(grouped, axis=-1)
        _, keep = jax.lax.top_k(group_score, topk_group)  # (M, topk_group)
        group_mask = jnp.zeros((m, n_group), bool).at[jnp.arange(m)[:, None], keep].set(True)
        sel = jnp.where(jnp.repeat(group_mask, e // n_group, axis=1), sel, -jnp.inf)
    _, ids = jax.lax.top_k(sel, top_k)
    return ids.astype(jnp.int32)


def renormalize(weights: jax.Array) -> jax.Array:
    """(M, k) f32 -> weights / (row sum + NORM_EPS)."""
    return weights / (jnp.sum(weights, axis=-1, keepdims=True) + NORM_EPS)


def router_partials_reference(x: jax.Array, gate_weight: jax.Array, *, split_k: int) -> jax.Array:
    """The router GEMM as split-K partial sums: x (M, H) bf16, gate_weight (E, H) bf16 ->
    (S, M, E) f32 with S = ceil(H / split_k), partials[s] = x[:, cols] @ gate_weight[:, cols]^T over
    the columns [s * split_k, (s + 1) * split_k) (bf16 products, exact in fp32; fp32 sums)."""
    m, h = x.shape
    e = gate_weight.shape[0]
    s = -(-h // split_k)
    pad = s * split_k - h
    xs = jnp.pad(x, ((0, 0), (0, pad))).reshape(m, s, split_k)
    ws = jnp.pad(gate_weight, ((0, 0), (0, pad))).reshape(e, s, split_k)
    return jnp.einsum("msk,esk->sme", xs, ws, preferred_element_type=jnp.float32)


def sum_partials(partials: jax.Array) -> jax.Array:
    """(S, M, E) f32 -> (M, E): the partials added in order s = 0, 1, ..., as the kernels that read
    them do (so the logits are the same bits everywhere)."""
    acc = partials[0]
    for s in range(1, partials.shape[0]):
        acc = acc + partials[s]
    return acc


def _reference(logits, bias, *, top_k, scoring, n_group, topk_group, norm_topk_prob):
    scores = score(logits, scoring)
    sel = jax.lax.stop_gradient(scores)
    if bias is not None:
        sel = sel + bias.astype(jnp.float32)
    ids = select_topk(sel, top_k=top_k, n_group=n_group, topk_group=topk_group, group_by_top2=bias is not None)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    return ids, renormalize(weights) if norm_topk_prob else weights


declare_op(OP, stage="route", static_args=("num_experts", "top_k", "scoring", "n_group", "topk_group"),
           reference=jax.jit(_reference, static_argnames=("top_k", "scoring", "n_group", "topk_group",
                                                          "norm_topk_prob")))


def route_topk(logits: jax.Array, bias: jax.Array | None, *, top_k: int, scoring: str, n_group: int = 1,
               topk_group: int = 1, norm_topk_prob: bool = True,
               backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """logits: (M, E) f32, bias: (E,) f32 correction bias (selection only) or None
    -> (topk_ids (M, top_k) int32, topk_weights (M, top_k) f32 unbiased scores, renormalized when
    norm_topk_prob). A bias also switches grouped selection to the top-2-sum group score.
    Differentiable in logits on the reference backend."""
    check_rank("logits", logits, 2, "(M, E)")
    check_dtype("logits", logits, (jnp.float32,))
    m, e = logits.shape
    if scoring not in SCORINGS:
        raise ValueError(f"scoring: expected one of {SCORINGS}, got {scoring!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise ValueError(f"top_k: expected an int in [1, {e}] (E = logits.shape[1]), got {top_k!r}")
    if n_group > 1:
        if e % n_group:
            raise ValueError(f"n_group: expected a divisor of E = {e}, got {n_group}")
        if not 1 <= topk_group <= n_group or top_k > topk_group * (e // n_group):
            raise ValueError(f"topk_group: expected 1..{n_group} groups holding at least top_k={top_k} "
                             f"experts, got {topk_group}")
    if bias is not None and tuple(bias.shape) != (e,):
        raise ValueError(f"bias: expected shape ({e},), got {tuple(bias.shape)}")
    impl = resolve(OP, backend, num_experts=e, top_k=top_k, scoring=scoring, n_group=n_group,
                   topk_group=topk_group)
    return impl.impl(logits, bias, top_k=top_k, scoring=scoring, n_group=n_group, topk_group=topk_group,
                     norm_topk_prob=bool(norm_topk_prob))
