"""The whole layer: route -> dispatch/permute -> expert MLP -> un-permute, plus the shared experts
and the tail rule (routed + shared).

Shared-expert fusion (`config.fuse_shared_experts`, params prepared with it: `MoEParams.fused_shared`
= n_s experts appended after the E_local routed ones): `moe_forward` appends n_s routes to every
token, to experts E_local..E_local+n_s-1, with weight 1.0, and multiplies the routed weights by
`routed_scaling_factor` BEFORE the un-permute, which then scales by 1: the shared experts' net
weight is exactly 1 (a weight of 1/routed_scaling_factor, scaled after the sum, would not be in
floating point), and each routed product rounds once more in fp32 than in the unfused order. The
dispatch sizes its buffers from the widened route list (M, k + n_s) and the E_local + n_s experts,
so the static capacities of moe_jax/dispatch.py hold unchanged.

The fused layout (`layout="fused"`) runs the routed branch as one op; with a bf16 router, one
backend for the route and gemm stages, no hash routing and checked mode off, `moe_forward` routes
inside that op too (`fused_moe_routed`: the router GEMM and the routing epilogue fused with the
branch's launches), else it routes first and calls `fused_moe`. Weights kept 4-bit (W4A8) take it too:
each call widens them to a temporary FP8 copy in the op's order (`fused_weights`), which pays at prefill.

Planned once: each public function parses its backends, resolves the layout and checks the call's
size once (`plan_routed` -> `RoutedPlan`), then runs the stages the plan names.

Backends: `backend` is a name applied to every stage ("reference", "auto"), the name of an
accelerated backend that implements some stages (a bare name runs the stages the registry says it
implements — `custom_calls.backend_stages`: "deep_gemm" the GEMMs, "triton" the routing
epilogue, dispatch ranking, permute, activation and un-permute — and the others on the
reference), or a dict {stage: name} over `STAGES` (missing stages -> "reference"; as a tuple of
(stage, name) pairs it is hashable, for static jit arguments). None -> the
`custom_calls.use_backend` default. Names are checked when parsed; implementations are resolved at
trace time. `settings` (a `custom_calls.KernelSettings`, static; None: the environment's defaults
when traced) goes to every op that launches native kernels: the GEMMs and the fused ops.

Every public function here takes tokens with any leading dims, `x: (..., H)`, checks its inputs once
and returns the same leading shape. Each also checks the size of the call at trace time, before
any stage or backend is resolved (`moe_jax.validate.check_call_size`: the int32 index extents of
routes and buffer rows, and the estimate of its temporaries against MAX_TEMPORARY_BYTES): a batch
past them is a ValueError naming the chunk size to split it into.

Hash routing: a token id outside [0, vocab_size) is a ValueError when token_ids are concrete and a
checked-mode report under jit; unchecked under jit, its token is routed nowhere (routed output 0,
shared experts only; `moe_jax.routing`), on every backend and layout.

Checked mode: `debug_checks=True` (a static argument) reports non-finite tokens and token ids
outside the vocabulary by index and turns
on the ops' checks of their index contracts (m_indices, masked_m, src2dst, and on the fused layout
topk_ids: a token naming an expert twice; `custom_calls.contracts`);
run the function under `custom_calls.checked`. Off (the default), no check is traced.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp

from custom_calls import (AUTO, REFERENCE, KernelSettings, backend_stages, contracts, fused_moe, fused_moe_routed,
                          get_default_backend, known_backends, permute_contig, permute_masked, unpermute,
                          widen_w4a8_weights)
from custom_calls.settings import resolve_settings
from custom_calls.dispatch_map import local_expert_ids
from layouts import FUSED_GATE_UP_GRAN
from moe_jax.config import MoEConfig
from moe_jax.dispatch import LAYOUTS, choose_layout, default_masked_m_pad, dispatch_contig, dispatch_masked
from moe_jax.experts import expert_core_contig, expert_core_masked
from moe_jax.params import MoEParams, check_params, check_shared, prepare_params
from moe_jax.routing import check_router, route_tokens, routing_groups
from moe_jax.shared import shared_mlp
from moe_jax.validate import check_call_size, check_token_ids, flatten_routes, flatten_tokens

# The layer's stages in data-flow order; every registered op names one of them (or none).
STAGES = ("route", "dispatch", "permute", "gemm", "activation", "unpermute")
assert backend_stages(REFERENCE) <= set(STAGES), "an op declares a stage the layer does not have"


def stage_backends(backend) -> dict[str, str | None]:
    """{stage: backend name or None} for every stage of `STAGES`, from `backend` as `moe_forward`
    takes it. Unknown backend or stage names are a ValueError listing the known ones."""
    known = known_backends()
    if isinstance(backend, str) and backend not in (REFERENCE, AUTO):
        if backend not in known:
            raise ValueError(f"backend: expected one of {known}, a {{stage: name}} dict or None, got {backend!r}")
        covered = backend_stages(backend)
        return {s: backend if s in covered else REFERENCE for s in STAGES}
    if backend is None or isinstance(backend, str):
        return {s: backend for s in STAGES}
    if isinstance(backend, tuple):  # hashable form for static jit arguments: (("gemm", name), ...)
        backend = dict(backend)
    if isinstance(backend, Mapping):
        unknown = set(backend) - set(STAGES)
        if unknown:
            raise ValueError(f"backend: unknown stage(s) {sorted(unknown)}; stages are {STAGES}")
        for stage, name in backend.items():
            if name is not None and name not in known:
                raise ValueError(f"backend[{stage!r}]: expected one of {known} or None, got {name!r}")
        return {s: backend.get(s, REFERENCE) for s in STAGES}
    raise TypeError(f"backend: expected a name, a {{stage: name}} dict / pairs, or None, got "
                    f"{type(backend).__name__}")


def stage_backend(backend, stage: str) -> str | None:
    """The backend name `backend` (as `moe_forward` takes it) gives stage `stage` (one of STAGES)."""
    return stage_backends(backend)[stage]


def resolve_layout(layout: str, config: MoEConfig, *, num_tokens: int, num_local_experts: int,
                   local_intermediate_size: int, arch: int | None = None,
                   act_backend: str | None = AUTO) -> str:
    """"contig" | "masked": an explicit argument wins, then config.layout, else `choose_layout` for
    the GEMMs of `arch` (None -> config.gemm_arch) with the activation stage's backend."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if layout == "auto":
        layout = config.layout
    if layout != "auto":
        return layout
    arch = config.gemm_arch if arch is None else arch
    return choose_layout(num_tokens=num_tokens, num_local_experts=num_local_experts,
                         hidden_size=config.hidden_size, intermediate_size=local_intermediate_size,
                         recipe=config.gemm_recipe_on(arch), arch=arch,
                         act=config.activation, backend=act_backend, m_pad=config.masked_m_pad,
                         memory_budget_bytes=config.masked_memory_budget_bytes)


@dataclasses.dataclass(frozen=True)
class RoutedPlan:
    """How one call of the routed branch runs, decided once at trace time (`plan_routed`).

    layout: "contig" | "masked" | "fused"; backends: {stage: name} over `STAGES`; settings: the
    native kernels' `KernelSettings`; num_local_experts, intermediate_size: E_local and I_local of
    the GEMM-form params; m_pad: rows per masked slab (masked only, else None)."""

    layout: str
    backends: Mapping[str, str | None]
    settings: KernelSettings
    num_local_experts: int
    intermediate_size: int
    m_pad: int | None


def plan_routed(num_tokens: int, config: MoEConfig, gemm_params: MoEParams, sizes: tuple[int, int], *,
                layout: str, backend, settings: KernelSettings | None, routes_per_token: int,
                shared_intermediate_size: int) -> RoutedPlan:
    """The plan of a call of num_tokens tokens with GEMM-form params (`check_params`' sizes): the
    backends parsed, the layout resolved (`resolve_layout`) and checked against how w13 is stored,
    the call's size checked (`check_call_size`, routes_per_token routes per token and a dense shared
    MLP of shared_intermediate_size, 0 for none)."""
    be = stage_backends(backend)
    e_loc, i_loc = int(gemm_params.w13.shape[0]), sizes[1]
    lay = resolve_layout(layout, config, num_tokens=num_tokens, num_local_experts=e_loc,
                         local_intermediate_size=i_loc, arch=gemm_params.gemm_arch, act_backend=be["activation"])
    check_call_size(num_tokens, config, layout=lay, routes_per_token=routes_per_token, num_local_experts=e_loc,
                    intermediate_size=i_loc, shared_intermediate_size=shared_intermediate_size)
    # weights kept 4-bit stay [gate; up]: the fused layout widens them into its order (`fused_weights`)
    if (lay == "fused" and not gemm_params.kept_4bit) != bool(gemm_params.w13_interleave):
        raise ValueError(f"params.w13: layout {lay!r} needs w13 rows "
                         f"{'interleaved (w13_interleave=8)' if lay == 'fused' else '[gate; up] (w13_interleave=0)'}, "
                         f"got w13_interleave={gemm_params.w13_interleave}; prepare the params with "
                         f"prepare_params(params, config) for a config of that layout")
    m_pad = None
    if lay == "masked":
        m_pad = config.masked_m_pad if config.masked_m_pad is not None else default_masked_m_pad(num_tokens)
    return RoutedPlan(lay, be, resolve_settings(settings), e_loc, i_loc, m_pad)


def routed_experts(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, params: MoEParams,
                   config: MoEConfig, *, expert_offset=0, layout: str = "auto",
                   backend="reference", out_dtype=None, debug_checks: bool = False,
                   settings: KernelSettings | None = None) -> jax.Array:
    """Routed branch for the experts held in `params`.

    x: (..., H) float; topk_ids: (..., k) int32 GLOBAL expert ids (-1 = excluded row/route);
    topk_weights: (..., k) f32 -> (..., H) out_dtype (None -> x.dtype), routed_scaling_factor
    included. E_local = params.w13.shape[0] experts are held, global ids [expert_offset,
    expert_offset + E_local) (expert_offset: python int or traced int32 scalar, e.g. axis_index *
    E_local under shard_map); other ids contribute nothing. The intermediate size is read from
    params (I_local may be a tensor-parallel shard of config.intermediate_size; the result is then
    a partial sum). Checkpoint-form params are converted with `prepare_params` on every call:
    prepare once and pass the result. debug_checks: checked mode (module docstring); settings: as
    in `moe_forward`.
    """
    x2, lead = flatten_tokens(x, config)
    ids, weights = flatten_routes(topk_ids, topk_weights, lead, config)
    params, sizes = _checked_params(params, config)
    plan = plan_routed(x2.shape[0], config, params, sizes, layout=layout, backend=backend, settings=settings,
                       routes_per_token=ids.shape[1], shared_intermediate_size=0)
    if debug_checks:
        contracts.check_finite_rows("x", x2, "tokens")
    out = _routed(x2, ids, weights, params, config, plan, expert_offset=expert_offset,
                  out_dtype=x.dtype if out_dtype is None else jnp.dtype(out_dtype), debug_checks=debug_checks)
    return out.reshape(*lead, -1)


def _checked_params(params: MoEParams, config: MoEConfig) -> tuple[MoEParams, tuple[int, int]]:
    """check_params once; GEMM-form params for config (prepared here if in checkpoint form)."""
    sizes = check_params(params, config)
    if not params.is_prepared:
        params = prepare_params(params, config)
    elif config.arch is not None and params.gemm_arch != config.arch:
        raise ValueError(f"params: prepared for arch {params.gemm_arch}, but config.arch={config.arch}")
    return params, sizes


def _routed(x, topk_ids, topk_weights, params, config, plan: RoutedPlan, *, expert_offset, out_dtype,
            routed_scaling_factor=None, debug_checks: bool = False, addend=None) -> jax.Array:
    """`routed_experts` on checked inputs, as `plan` says: x (M, H), ids/weights (M, k), GEMM-form
    params (all w13 groups dispatched, fused shared experts included); routed_scaling_factor None
    -> config's; addend (M, H) or None: added to the routed sum in fp32 before the cast (the
    un-permute's addend)."""
    e_loc, be, settings = plan.num_local_experts, plan.backends, plan.settings
    rsf = config.routed_scaling_factor if routed_scaling_factor is None else routed_scaling_factor
    recipe, arch, act = params.gemm_recipe, params.gemm_arch, config.activation
    layout = plan.layout
    if layout == "fused":
        return _routed_fused(x, topk_ids, topk_weights, params, config, expert_offset=expert_offset,
                             backend=be["gemm"], settings=settings, out_dtype=out_dtype,
                             routed_scaling_factor=rsf, debug_checks=debug_checks, addend=addend)
    if layout == "contig":
        disp = dispatch_contig(topk_ids, num_local_experts=e_loc, alignment=config.alignment,
                               expert_offset=expert_offset, backend=be["dispatch"])
        lhs, lhs_scale = permute_contig(x, disp.src2dst, num_rows=disp.num_rows_cap, recipe=recipe,
                                        arch=arch, backend=be["permute"], debug_checks=debug_checks,
                                        assume_canonical=True)
        d = expert_core_contig(lhs, lhs_scale, disp, params, act, gemm_backend=be["gemm"],
                               act_backend=be["activation"], debug_checks=debug_checks, settings=settings)
    else:
        m_pad = plan.m_pad
        # a route held here but dropped for lack of slab rows (possible only when a caller repeats
        # an expert within a token's row: dispatch_masked refuses m_pad < M) poisons that token's
        # output: reported, never silent. The dispatch map marks it with the row one past d (mark_dropped), which the
        # permute skips and the un-permute turns into NaN for its token (assume_canonical keeps
        # the mark); checked mode, which would report the mark as a violation, poisons after the
        # un-permute instead.
        disp = dispatch_masked(topk_ids, num_local_experts=e_loc, m_pad=m_pad,
                               num_experts_global=config.num_experts + params.fused_shared,
                               expert_offset=expert_offset, mark_dropped=not debug_checks,
                               backend=be["dispatch"])
        lhs, lhs_scale = permute_masked(x, disp.src2dst, num_groups=e_loc, m_pad=m_pad,
                                        recipe=recipe, arch=arch, backend=be["permute"],
                                        debug_checks=debug_checks, assume_canonical=True)
        d = expert_core_masked(lhs, lhs_scale, disp, params, act, gemm_backend=be["gemm"],
                               act_backend=be["activation"], debug_checks=debug_checks,
                               settings=settings).reshape(e_loc * m_pad, -1)
    lost = None  # (M,) tokens that lost a route, computed in checked mode only
    if layout == "masked" and debug_checks:
        lost = jnp.any((local_expert_ids(topk_ids, expert_offset, e_loc) < e_loc) & (disp.src2dst < 0), axis=1)
    out = unpermute(d, disp.src2dst, topk_weights.astype(jnp.float32), routed_scaling_factor=rsf,
                    out_dtype=out_dtype, addend=addend, backend=be["unpermute"], debug_checks=debug_checks,
                    assume_canonical=True)
    if lost is not None:
        out = jnp.where(lost[:, None], jnp.asarray(jnp.nan, out.dtype), out)
    return out


def _routed_fused(x, topk_ids, topk_weights, params, config, *, expert_offset, backend, settings, out_dtype,
                  routed_scaling_factor, debug_checks, addend) -> jax.Array:
    """The routed branch as one `fused_moe` op (its numerics: custom_calls/fused_moe.py: the route
    weight scales the SwiGLU output before its quantization). A route to an expert not held here
    becomes an id outside [0, E_local), which the op drops; in checked mode it gets -1, so that the
    check reports only repeated experts. addend is added in fp32 before the cast."""
    e_loc = int(params.w13.shape[0])
    if debug_checks:
        ids = local_expert_ids(topk_ids, expert_offset, e_loc)
        ids = jnp.where(ids < e_loc, ids, -1)
        contracts.check_finite_rows("topk_weights", topk_weights, "tokens")
    else:  # the op drops ids outside [0, E_local) itself (no separate pass over the ids)
        ids = topk_ids.astype(jnp.int32) - jnp.asarray(expert_offset, jnp.int32)
    w13, w13_scale, w2, w2_scale, interleave = fused_weights(params, backend)
    out = fused_moe(x.astype(jnp.bfloat16), ids, topk_weights.astype(jnp.float32), w13, w13_scale, w2, w2_scale,
                    routed_scaling_factor=routed_scaling_factor, activation_clamp=config.activation.swiglu_limit,
                    w13_interleave=interleave, arch=params.gemm_arch, backend=backend, debug_checks=debug_checks,
                    settings=settings)
    return _fused_tail(out, addend, out_dtype)


def fused_weights(params: MoEParams, backend) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, int]:
    """The fused op's weight operands (w13, w13_scale, w2, w2_scale, w13_interleave) from GEMM-form params:
    their own, or for weights kept 4-bit (W4A8, `MoEParams.kept_4bit`) an FP8 copy widened from them
    (`custom_calls.widen_w4a8_weights`: the FP4 -> FP8 load path's operands bit for bit, w13 interleaved),
    a temporary of E x 3 x H x I bytes that lives for the call. The widening runs on the reference where the
    gemm stage does (`backend`), else on the backend "auto" picks for it (the "w4a8" backend's Triton kernel
    on a GPU)."""
    if not params.kept_4bit:
        return params.w13, params.w13_scale, params.w2, params.w2_scale, params.w13_interleave
    be = REFERENCE if (backend or get_default_backend()) == REFERENCE else AUTO
    w13, w13_scale = widen_w4a8_weights(params.w13, params.w13_scale, gate_up_interleave=FUSED_GATE_UP_GRAN,
                                        backend=be)
    w2, w2_scale = widen_w4a8_weights(params.w2, params.w2_scale, backend=be)
    return w13, w13_scale, w2, w2_scale, FUSED_GATE_UP_GRAN


def shared_experts(x: jax.Array, params: MoEParams, config: MoEConfig, *, out_dtype=None,
                   backend="reference", settings: KernelSettings | None = None) -> jax.Array:
    """Shared-expert MLP, same activation (clamps included) as the routed experts
    (moe_jax/shared.py): bf16 weights as a dense bf16 MLP (fp32 accumulation, bf16 rounding between
    the stages like the routed bf16 path); FP8 weights ("fp8_block") through the dense FP8 GEMM
    op `custom_calls.gemm_nt` with 1x128 activation quantization, like the routed FP8 path.
    x: (..., H) -> (..., H) out_dtype (None -> x.dtype); zeros when config.n_shared_experts == 0.
    Its intermediate size is read from params (may be a tensor-parallel shard). backend: as in
    `moe_forward` (FP8: stages "permute" (the input quantization), "gemm" and "activation"; the bf16
    MLP always runs on XLA); settings: as in `moe_forward`."""
    x2, lead = flatten_tokens(x, config)
    if params.fused_shared:
        raise ValueError(f"params: the shared experts are fused into the routed experts "
                         f"(params.fused_shared={params.fused_shared}); moe_forward runs them")
    if config.n_shared_experts:
        check_shared(params, config)
    check_call_size(x2.shape[0], config, routes_per_token=0,
                    shared_intermediate_size=int(params.shared_w2.shape[1]) if config.n_shared_experts else 0)
    be = stage_backends(backend)
    out = shared_mlp(x2, params, config, out_dtype=x.dtype if out_dtype is None else jnp.dtype(out_dtype),
                     gemm_backend=be["gemm"], act_backend=be["activation"], permute_backend=be["permute"],
                     settings=resolve_settings(settings))
    return out.reshape(*lead, -1)


def moe_forward(x: jax.Array, params: MoEParams, config: MoEConfig, *,
                token_ids: jax.Array | None = None, layout: str = "auto",
                backend="reference", debug_checks: bool = False,
                settings: KernelSettings | None = None) -> jax.Array:
    """The MoE layer: route -> routed_experts + shared_experts (tail rule: the routed output
    already carries routed_scaling_factor; the two are added in fp32 and cast once, inside the
    un-permute, whose `addend` the dense shared MLP's output is).
    x: (..., H) float (bf16 typical) -> (..., H) x.dtype; token_ids (...) int in [0, vocab_size)
    for hash-routed layers (concrete ids outside: ValueError naming position and value; traced
    ones: reported in checked mode, else that token's routes are dropped and its row is the
    shared-expert output alone, `moe_jax.routing`). jit-able with `config` (and layout/backend/settings)
    static: `jax.jit(moe_forward, static_argnames=("config", "layout", "backend", "settings"))`.
    Pass `prepare_params(params, config)` to keep the load-time conversion out of the call.
    debug_checks (static): checked mode, run under `custom_calls.checked` (module docstring).
    settings (static): the native kernels' `custom_calls.KernelSettings` (GEMM tuning, command
    buffers, SM count, SM100 opt-in); None reads the environment's defaults when traced, so a
    function already compiled keeps them: pass one to change them."""
    x2, lead = flatten_tokens(x, config)
    if params.num_local_experts != config.num_experts:
        # a shard of the experts would silently run as experts 0..E_local-1
        raise ValueError(f"params.w13: moe_forward needs all {config.num_experts} experts, got "
                         f"{params.w13.shape[0]}; for an expert shard call routed_experts(..., "
                         f"expert_offset=first_expert) or moe_jax.parallel.sharded_moe_forward")
    tok = check_token_ids(token_ids, lead, config, debug_checks=debug_checks)
    check_router(params, config)
    gemm_params, sizes = _checked_params(params, config)
    dense_shared = bool(config.n_shared_experts) and not gemm_params.fused_shared
    plan = plan_routed(x2.shape[0], config, gemm_params, sizes, layout=layout, backend=backend, settings=settings,
                       routes_per_token=config.top_k + gemm_params.fused_shared,
                       shared_intermediate_size=int(gemm_params.shared_w2.shape[1]) if dense_shared else 0)
    be = plan.backends
    if debug_checks:
        contracts.check_finite_rows("x", x2, "tokens")
    # the dense shared MLP's output is the routed branch's addend: routed + shared summed in fp32 and
    # cast once (inside the un-permute on the staged path), without a pass over an fp32 (M, H) array
    shared = None
    if dense_shared:
        shared = shared_mlp(x2, gemm_params, config, out_dtype=None, gemm_backend=be["gemm"],
                            act_backend=be["activation"], permute_backend=be["permute"], settings=plan.settings)
    if _routes_inside_fused_op(x2, params, gemm_params, config, plan, debug_checks):
        w13, w13_scale, w2, w2_scale, interleave = fused_weights(gemm_params, be["gemm"])
        out = fused_moe_routed(
            x2, params.gate_weight, _bias_f32(params.e_score_correction_bias), w13, w13_scale, w2, w2_scale,
            top_k=config.top_k, scoring=config.scoring, n_group=routing_groups(config), topk_group=config.topk_group,
            norm_topk_prob=config.norm_topk_prob, routed_scaling_factor=config.routed_scaling_factor,
            activation_clamp=config.activation.swiglu_limit, w13_interleave=interleave,
            arch=gemm_params.gemm_arch, backend=be["gemm"], settings=plan.settings)
        return _fused_tail(out, shared, x.dtype).reshape(*lead, -1)
    topk_ids, topk_weights = route_tokens(x2, params, config, tok, be["route"])
    rsf = None
    if gemm_params.fused_shared:
        topk_ids, topk_weights, rsf = fuse_shared_routes(topk_ids, topk_weights, config.routed_scaling_factor,
                                                         num_routed=config.num_experts,
                                                         num_shared=gemm_params.fused_shared)
    if config.hash_routing and plan.layout == "fused":
        # a tid2eid row may name an expert twice; the fused op holds a token once per expert
        topk_ids, topk_weights = merge_repeated_routes(topk_ids, topk_weights)
    out = _routed(x2, topk_ids, topk_weights, gemm_params, config, plan, expert_offset=0, out_dtype=x.dtype,
                  routed_scaling_factor=rsf, debug_checks=debug_checks, addend=shared)
    return out.reshape(*lead, -1)


def merge_repeated_routes(topk_ids: jax.Array, topk_weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """ids (M, k) int, weights (M, k) float -> the same routes with each expert named once per token:
    a later slot naming an expert again adds its weight to the first slot naming it and becomes -1
    (routed nowhere). The layer's sum over slots is unchanged, and the fused op, whose pool holds a
    token once per expert (it drops a repeat), computes it."""
    same = topk_ids[:, :, None] == topk_ids[:, None, :]  # (M, k_first, k_slot)
    first = jnp.argmax(same, axis=1)  # the first slot naming each slot's expert (<= the slot)
    k = topk_ids.shape[1]
    owner = first[:, None, :] == jnp.arange(k)[None, :, None]  # (M, k_first, k_slot)
    weights = jnp.sum(jnp.where(owner, topk_weights[:, None, :], 0), axis=2).astype(topk_weights.dtype)
    ids = jnp.where(first == jnp.arange(k)[None, :], topk_ids, -1).astype(topk_ids.dtype)
    return ids, weights


def _routes_inside_fused_op(x2, params, gemm_params, config, plan: RoutedPlan, debug_checks) -> bool:
    """Does `moe_forward` route inside the fused op (`fused_moe_routed`)? When the plan's layout is
    "fused", the route and gemm stages have the same backend, the router is the bf16 x bf16 GEMM
    (bf16 tokens and gate), routing is not by hash, and checked mode is off (it checks the routes
    between the two stages)."""
    be = plan.backends
    if plan.layout != "fused" or debug_checks or config.hash_routing or gemm_params.fused_shared:
        return False
    return (be["route"] == be["gemm"] and x2.dtype == jnp.bfloat16
            and params.gate_weight.dtype == jnp.bfloat16)


def _bias_f32(bias: jax.Array | None) -> jax.Array | None:
    return None if bias is None else bias.astype(jnp.float32)


def _fused_tail(out: jax.Array, addend: jax.Array | None, out_dtype) -> jax.Array:
    """The fused op's bf16 output, with addend (M, H) or None added in fp32, cast to out_dtype."""
    if addend is not None:
        return (out.astype(jnp.float32) + addend.astype(jnp.float32)).astype(out_dtype)
    return out.astype(out_dtype)


def fuse_shared_routes(topk_ids: jax.Array, topk_weights: jax.Array, routed_scaling_factor: float, *,
                       num_routed: int, num_shared: int) -> tuple[jax.Array, jax.Array, float]:
    """The route list of shared-expert fusion (module docstring): ids (M, k) int32, weights (M, k)
    f32 -> ids (M, k + n_s) with experts num_routed..num_routed+n_s-1 appended, weights (M, k + n_s)
    f32 = (routed weights * routed_scaling_factor, 1.0 per shared expert), and the scaling factor
    the un-permute then applies (1.0)."""
    m = topk_ids.shape[0]
    shared_ids = jnp.broadcast_to(num_routed + jnp.arange(num_shared, dtype=jnp.int32), (m, num_shared))
    ids = jnp.concatenate([topk_ids.astype(jnp.int32), shared_ids], axis=1)
    weights = jnp.concatenate([topk_weights.astype(jnp.float32) * jnp.float32(routed_scaling_factor),
                               jnp.ones((m, num_shared), jnp.float32)], axis=1)
    return ids, weights, 1.0
