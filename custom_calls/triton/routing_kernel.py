"""Routing epilogue as one Triton kernel: scores from router logits, optional correction bias
(selection only), grouped top-k, top-k, renormalized weights — what `moe_jax.routing.route` does
after the gate GEMM, for E <= 1024 experts.

  route_topk(logits (M, E) f32, bias (E,) f32 | None, *, top_k, scoring, n_group, topk_group,
             norm_topk_prob) -> (topk_ids (M, top_k) int32, topk_weights (M, top_k) f32)

Semantics of the reference (moe_jax.routing): scores = softmax | sigmoid | sqrt(softplus) of the
logits; sel = scores + bias; grouped (n_group > 1): group score = sum of the two largest sel of
each of n_group equal groups with a correction bias, the largest without one, only the topk_group best groups stay eligible; ids = top_k of sel,
ties to the lower index (as jax.lax.top_k); weights = scores at ids, divided by their sum + 1e-20
when norm_topk_prob. routed_scaling_factor is not applied here.

One program handles BLOCK_T tokens, the whole expert row in registers; top-k is k rounds of
(max, lowest index at the max, mask). The grouped path needs E and n_group powers of two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from layouts import ceil_div
from custom_calls.route_topk import NORM_EPS
from custom_calls.triton.launch import triton_call
from custom_calls.triton.support import SCORINGS, route_topk_reason

_ROW_ELEMS = 2048  # BLOCK_T x E_PAD per program (register-bound: ~7 live copies of the row)
_NORM_EPS = tl.constexpr(NORM_EPS)


@triton.jit
def _argmax_lowest(v, idx, N: tl.constexpr):
    """Per row of v [T, N]: the max and the lowest index holding it (jax.lax.top_k's tie order)."""
    best = tl.max(v, axis=1)
    at = tl.min(tl.where(v == tl.expand_dims(best, 1), idx, N), axis=1)
    return best, at


@triton.jit
def route_topk_kernel(
    logits_ptr, bias_ptr,
    ids_ptr, w_ptr,
    M: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    RENORM: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, E_PAD)
    t_ok = t < M
    e_ok = tl.expand_dims(e < E, 0)
    ok = tl.expand_dims(t_ok, 1) & e_ok
    lg = tl.load(logits_ptr + tl.expand_dims(t.to(tl.int64) * E, 1) + tl.expand_dims(e, 0), mask=ok, other=0.0)
    if SCORING == 0:
        lg = tl.where(e_ok, lg, float("-inf"))
        p = tl.exp(lg - tl.expand_dims(tl.max(lg, axis=1), 1))
        s = p / tl.expand_dims(tl.sum(p, axis=1), 1)
    elif SCORING == 1:
        s = tl.sigmoid(lg)
    else:
        # softplus, stable at both ends (exp(x) alone where 1 + exp(x) would round to 1)
        sp = tl.where(lg > 15.0, lg, tl.where(lg < -15.0, tl.exp(lg), tl.log(1.0 + tl.exp(lg))))
        s = tl.sqrt(sp)
    s = tl.where(e_ok, s, 0.0)
    sel = s
    if HAS_BIAS:
        sel = sel + tl.expand_dims(tl.load(bias_ptr + e, mask=e < E, other=0.0), 0)
    sel = tl.where(e_ok, sel, float("-inf"))
    idx = tl.broadcast_to(tl.expand_dims(e, 0), (BLOCK_T, E_PAD))
    if N_GROUP > 1:
        GS: tl.constexpr = E // N_GROUP
        g3 = tl.reshape(sel, (BLOCK_T, N_GROUP, GS))
        gi = tl.broadcast_to(tl.reshape(tl.arange(0, GS), (1, 1, GS)), (BLOCK_T, N_GROUP, GS))
        top1 = tl.max(g3, axis=2)
        at1 = tl.min(tl.where(g3 == tl.expand_dims(top1, 2), gi, GS), axis=2)
        top2 = tl.max(tl.where(gi == tl.expand_dims(at1, 2), float("-inf"), g3), axis=2)
        # group score as in moe_jax.routing: top-2 sum with a correction bias (V3), else the max
        if HAS_BIAS:
            gscore = top1 + top2  # [BLOCK_T, N_GROUP]
        else:
            gscore = top1
        gidx = tl.broadcast_to(tl.expand_dims(tl.arange(0, N_GROUP), 0), (BLOCK_T, N_GROUP))
        keep = tl.zeros((BLOCK_T, N_GROUP), tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            _, g_at = _argmax_lowest(gscore, gidx, N_GROUP)
            hit = gidx == tl.expand_dims(g_at, 1)
            keep = keep | hit
            gscore = tl.where(hit, float("-inf"), gscore)
        keep3 = tl.broadcast_to(tl.expand_dims(keep, 2), (BLOCK_T, N_GROUP, GS))
        sel = tl.reshape(tl.where(keep3, g3, float("-inf")), (BLOCK_T, E_PAD))
    kk = tl.broadcast_to(tl.expand_dims(tl.arange(0, K_PAD), 0), (BLOCK_T, K_PAD))
    ids = tl.zeros((BLOCK_T, K_PAD), tl.int32)
    w = tl.zeros((BLOCK_T, K_PAD), tl.float32)
    for j in tl.static_range(TOPK):
        _, at = _argmax_lowest(sel, idx, E_PAD)
        hit = idx == tl.expand_dims(at, 1)
        wj = tl.sum(tl.where(hit, s, 0.0), axis=1)
        ids = tl.where(kk == j, tl.expand_dims(at, 1), ids)
        w = tl.where(kk == j, tl.expand_dims(wj, 1), w)
        sel = tl.where(hit, float("-inf"), sel)
    if RENORM:
        w = w / (tl.expand_dims(tl.sum(w, axis=1), 1) + _NORM_EPS)
    out = tl.expand_dims(t.to(tl.int64) * TOPK, 1) + kk
    st = tl.expand_dims(t_ok, 1) & (kk < TOPK)
    tl.store(ids_ptr + out, ids, mask=st)
    tl.store(w_ptr + out, w, mask=st)


def route_topk(logits: jax.Array, bias: jax.Array | None, *, top_k: int, scoring: str, n_group: int = 1,
               topk_group: int = 1, norm_topk_prob: bool = True) -> tuple[jax.Array, jax.Array]:
    """logits: (M, E) float -> (topk_ids (M, top_k) int32, topk_weights (M, top_k) f32)."""
    m, e = logits.shape
    reason = route_topk_reason(e, top_k, scoring, n_group, topk_group)
    if reason:
        raise ValueError(f"route_topk: {reason}")
    if bias is not None and bias.shape != (e,):
        raise ValueError(f"bias: expected shape ({e},), got {tuple(bias.shape)}")
    if m == 0:
        return jnp.zeros((0, top_k), jnp.int32), jnp.zeros((0, top_k), jnp.float32)
    e_pad = triton.next_power_of_2(e)
    block_t = max(1, min(64, _ROW_ELEMS // e_pad))
    bias_arr = (bias if bias is not None else jnp.zeros((1,), jnp.float32)).astype(jnp.float32)
    ids, w = triton_call(
        logits.astype(jnp.float32), bias_arr, kernel=route_topk_kernel,
        out_shape=[jax.ShapeDtypeStruct((m, top_k), jnp.int32), jax.ShapeDtypeStruct((m, top_k), jnp.float32)],
        grid=(ceil_div(m, block_t),), num_warps=4, name="moe_route_topk",
        M=m, E=e, E_PAD=e_pad, TOPK=top_k, K_PAD=triton.next_power_of_2(top_k), SCORING=SCORINGS[scoring],
        HAS_BIAS=bias is not None, N_GROUP=n_group if n_group > 1 else 1, TOPK_GROUP=topk_group,
        RENORM=bool(norm_topk_prob), BLOCK_T=block_t)
    return ids, w
