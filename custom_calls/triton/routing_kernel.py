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

Tie policy (the reference's, kept exactly): among equal selection scores the lower expert id wins,
among equal group scores the lower group id wins.

One program handles BLOCK_T tokens, the whole expert row in registers; top-k is k rounds of
(max, lowest index at the max, mask). Any n_group dividing E: each group is laid out as a
power-of-two run of register columns (`support.route_row_width`), so DeepSeek-V3's 8 groups of 32
need no padding and e.g. 3 groups of 32 take 4 x 32 columns. Without a correction bias the weight
of a pick is the maximum itself (no extra reduction).
Tiling: `RouteTopkConfig` (`config=`; None: `heuristic_config(E, M, n_group)`: one token per
single-warp program at decode sizes, 2048-element blocks on 4 warps at prefill).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from layouts import ceil_div
from custom_calls.route_topk import NORM_EPS
from custom_calls.triton.launch import triton_call
from custom_calls.triton.support import SCORINGS, route_row_width, route_topk_reason
from custom_calls.triton.tuning import check_launch, check_powers_of_two, config_or_default

_NORM_EPS = tl.constexpr(NORM_EPS)
PREFILL_ELEMENTS = 2048  # elements of the (tokens, width) block of one program at large M (measured)
LATENCY_PROGRAMS = 264  # small M: at least two programs per SM of an H200 (132 SMs), one token each


@dataclasses.dataclass(frozen=True)
class RouteTopkConfig:
    """Tiling of `route_topk_kernel` (see `custom_calls.triton.tuning`): block_t tokens (a power of
    two) per program, each holding its whole expert row."""

    block_t: int
    num_warps: int

    def __post_init__(self) -> None:
        check_powers_of_two(self, "block_t")
        check_launch(self)


def heuristic_config(num_experts: int, num_tokens: int | None = None, n_group: int = 1) -> RouteTopkConfig:
    """The default tiling. Large M (or M unknown): block_t x row width = PREFILL_ELEMENTS per
    program (register-bound: ~7 live copies of the row), 1 to 64 tokens, 4 warps (the measured
    throughput tiling). Small M (decode): fewer tokens per program, down to one token per program
    on one warp, so that at least LATENCY_PROGRAMS programs run when M allows: the epilogue is then
    one short wave of single-warp reductions (launch-latency bound)."""
    width = route_row_width(num_experts, n_group)
    block_t = max(1, min(64, PREFILL_ELEMENTS // width))
    if num_tokens is None or num_tokens >= block_t * LATENCY_PROGRAMS:
        return RouteTopkConfig(block_t=block_t, num_warps=4)
    block_t = min(block_t, triton.next_power_of_2(max(1, num_tokens // LATENCY_PROGRAMS)))
    return RouteTopkConfig(block_t=block_t, num_warps=min(4, max(1, block_t * width // 256)))


@triton.jit
def _argmax_lowest(v, idx, N: tl.constexpr):
    """Per row of v [T, N]: the max and the lowest index holding it (jax.lax.top_k's tie order)."""
    best = tl.max(v, axis=1)
    at = tl.min(tl.where(v == tl.expand_dims(best, 1), idx, N), axis=1)
    return best, at


@triton.jit
def route_columns(E: tl.constexpr, N_GROUP: tl.constexpr, NG_PAD: tl.constexpr, GS_PAD: tl.constexpr):
    """The register layout of a token's row: column c holds expert (c // GS_PAD) * GS + c % GS_PAD,
    each group a power-of-two run of columns (padding columns are -inf), so groups are a plain
    reshape. Returns (expert of each column [W], column holds an expert [W])."""
    GS: tl.constexpr = E // N_GROUP
    W: tl.constexpr = NG_PAD * GS_PAD
    c = tl.arange(0, W)
    col_g = c // GS_PAD
    col_j = c % GS_PAD
    return col_g * GS + col_j, (col_j < GS) & (col_g < N_GROUP)


@triton.jit
def load_logits(logits_ptr, t, t_ok, e, e_ok1, M: tl.constexpr, E: tl.constexpr, SPLITS: tl.constexpr):
    """Rows t of the logits [BLOCK_T, W] in `route_columns`' layout, from SPLITS partial sums
    (SPLITS, M, E) f32 added in order s = 0, 1, ... (SPLITS = 1: the logits (M, E) themselves)."""
    ok = tl.expand_dims(t_ok, 1) & tl.expand_dims(e_ok1, 0)
    offs = tl.expand_dims(t.to(tl.int64) * E, 1) + tl.expand_dims(e, 0)
    lg = tl.load(logits_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLITS):
        lg = lg + tl.load(logits_ptr + s * M * E + offs, mask=ok, other=0.0)
    return lg


@triton.jit
def route_rows(
    lg, e, e_ok1, bias_ptr,
    BLOCK_T: tl.constexpr, E: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, NG_PAD: tl.constexpr,
    GS_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, RENORM: tl.constexpr,
):
    """The routing epilogue of BLOCK_T tokens: logits lg [BLOCK_T, W] in `route_columns`' layout
    -> (ids [BLOCK_T, K_PAD] int32, weights [BLOCK_T, K_PAD] f32); slots >= TOPK are 0."""
    GS: tl.constexpr = E // N_GROUP
    W: tl.constexpr = NG_PAD * GS_PAD
    e_ok = tl.expand_dims(e_ok1, 0)
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
        sel = sel + tl.expand_dims(tl.load(bias_ptr + e, mask=e_ok1, other=0.0), 0)
    sel = tl.where(e_ok, sel, float("-inf"))
    # padding columns carry index E: never the lowest index at a finite max
    idx = tl.broadcast_to(tl.expand_dims(tl.where(e_ok1, e, E), 0), (BLOCK_T, W))
    if N_GROUP > 1:
        g3 = tl.reshape(sel, (BLOCK_T, NG_PAD, GS_PAD))
        gi = tl.broadcast_to(tl.reshape(tl.arange(0, GS_PAD), (1, 1, GS_PAD)), (BLOCK_T, NG_PAD, GS_PAD))
        top1 = tl.max(g3, axis=2)
        # group score as in moe_jax.routing: top-2 sum with a correction bias (V3; the one value of
        # a one-expert group), else the max; padding groups stay at -inf and are never kept
        if HAS_BIAS and GS > 1:
            at1 = tl.min(tl.where(g3 == tl.expand_dims(top1, 2), gi, GS_PAD), axis=2)
            top2 = tl.max(tl.where(gi == tl.expand_dims(at1, 2), float("-inf"), g3), axis=2)
            gscore = top1 + top2  # [BLOCK_T, NG_PAD]
        else:
            gscore = top1
        gidx = tl.broadcast_to(tl.expand_dims(tl.arange(0, NG_PAD), 0), (BLOCK_T, NG_PAD))
        keep = tl.zeros((BLOCK_T, NG_PAD), tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            _, g_at = _argmax_lowest(gscore, gidx, NG_PAD)
            hit = gidx == tl.expand_dims(g_at, 1)
            keep = keep | hit
            gscore = tl.where(hit, float("-inf"), gscore)
        keep3 = tl.broadcast_to(tl.expand_dims(keep, 2), (BLOCK_T, NG_PAD, GS_PAD))
        sel = tl.reshape(tl.where(keep3, g3, float("-inf")), (BLOCK_T, W))
    kk = tl.broadcast_to(tl.expand_dims(tl.arange(0, K_PAD), 0), (BLOCK_T, K_PAD))
    ids = tl.zeros((BLOCK_T, K_PAD), tl.int32)
    w = tl.zeros((BLOCK_T, K_PAD), tl.float32)
    for j in tl.static_range(TOPK):
        best, at = _argmax_lowest(sel, idx, E)
        hit = idx == tl.expand_dims(at, 1)
        if HAS_BIAS:
            wj = tl.sum(tl.where(hit, s, 0.0), axis=1)
        else:  # the selection score is the score itself: no third reduction
            wj = best
        ids = tl.where(kk == j, tl.expand_dims(at, 1), ids)
        w = tl.where(kk == j, tl.expand_dims(wj, 1), w)
        sel = tl.where(hit, float("-inf"), sel)
    if RENORM:
        w = w / (tl.expand_dims(tl.sum(w, axis=1), 1) + _NORM_EPS)
    return ids, w


@triton.jit
def route_topk_kernel(
    logits_ptr, bias_ptr,
    ids_ptr, w_ptr,
    M: tl.constexpr, E: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, NG_PAD: tl.constexpr,
    GS_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, RENORM: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < M
    e, e_ok1 = route_columns(E, N_GROUP, NG_PAD, GS_PAD)
    lg = load_logits(logits_ptr, t, t_ok, e, e_ok1, M, E, 1)
    ids, w = route_rows(lg, e, e_ok1, bias_ptr, BLOCK_T, E, TOPK, K_PAD, SCORING, HAS_BIAS, N_GROUP, NG_PAD,
                        GS_PAD, TOPK_GROUP, RENORM)
    kk = tl.expand_dims(tl.arange(0, K_PAD), 0)
    out = tl.expand_dims(t.to(tl.int64) * TOPK, 1) + kk
    st = tl.expand_dims(t_ok, 1) & (kk < TOPK)
    tl.store(ids_ptr + out, ids, mask=st)
    tl.store(w_ptr + out, w, mask=st)


def route_topk(logits: jax.Array, bias: jax.Array | None, *, top_k: int, scoring: str, n_group: int = 1,
               topk_group: int = 1, norm_topk_prob: bool = True,
               config: RouteTopkConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """logits: (M, E) float -> (topk_ids (M, top_k) int32, topk_weights (M, top_k) f32).
    config: the tiling (None: `heuristic_config(E, M, n_group)`)."""
    m, e = logits.shape
    config = config_or_default(config, RouteTopkConfig, lambda: heuristic_config(e, m, n_group))
    reason = route_topk_reason(e, top_k, scoring, n_group, topk_group)
    if reason:
        raise ValueError(f"route_topk: {reason}")
    if bias is not None and bias.shape != (e,):
        raise ValueError(f"bias: expected shape ({e},), got {tuple(bias.shape)}")
    if m == 0:
        return jnp.zeros((0, top_k), jnp.int32), jnp.zeros((0, top_k), jnp.float32)
    block_t = config.block_t
    ids, w = triton_call(
        logits.astype(jnp.float32), bias_operand(bias), kernel=route_topk_kernel,
        out_shape=[jax.ShapeDtypeStruct((m, top_k), jnp.int32), jax.ShapeDtypeStruct((m, top_k), jnp.float32)],
        grid=(ceil_div(m, block_t),), num_warps=config.num_warps, name="moe_route_topk",
        M=m, E=e, TOPK=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_T=block_t,
        **epilogue_constexprs(e, scoring=scoring, n_group=n_group, topk_group=topk_group,
                              has_bias=bias is not None, norm_topk_prob=norm_topk_prob))
    return ids, w


def epilogue_constexprs(num_experts: int, *, scoring: str, n_group: int, topk_group: int, has_bias: bool,
                        norm_topk_prob: bool) -> dict:
    """`route_rows`' compile-time values (SCORING, HAS_BIAS, N_GROUP, NG_PAD, GS_PAD, TOPK_GROUP,
    RENORM) for logits over num_experts experts; n_group <= 1 routes without groups."""
    ng = n_group if n_group > 1 else 1
    return dict(SCORING=SCORINGS[scoring], HAS_BIAS=bool(has_bias), N_GROUP=ng, NG_PAD=triton.next_power_of_2(ng),
                GS_PAD=triton.next_power_of_2(num_experts // ng), TOPK_GROUP=topk_group if ng > 1 else 1,
                RENORM=bool(norm_topk_prob))


def bias_operand(bias: jax.Array | None) -> jax.Array:
    """The correction bias as `route_rows` reads it: (E,) f32, or an unread (1,) f32 without one."""
    return (bias if bias is not None else jnp.zeros((1,), jnp.float32)).astype(jnp.float32)
