"""The whole layer (SPEC §1): route -> dispatch/permute -> core -> un-permute, plus the shared
experts and the tail rule (routed + shared).

Backends: `backend` is a name applied to every stage ("reference", "auto"), the name of an
accelerated backend that implements some stages (`BACKEND_STAGES`: "deep_gemm" runs the GEMMs,
"triton" the routing epilogue, dispatch ranking, permute, activation and un-permute; the other
stages use the reference), or a dict {stage: name} over the stages "route", "dispatch", "permute",
"gemm", "activation", "unpermute" (missing stages -> "reference"; as a tuple of (stage, name)
pairs it is hashable, for static jit arguments). None -> the `custom_calls.use_backend` default.
Resolution happens at trace time.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from custom_calls import gated_activation, permute_contig, permute_masked, unpermute
from layouts import get_recipe, store_as
from moe_jax.config import MoEConfig
from moe_jax.core import activation_spec, expert_core_contig, expert_core_masked
from moe_jax.dispatch import (choose_layout, default_masked_m_pad, dispatch_contig, dispatch_masked,
                              local_expert_ids)
from moe_jax.params import MoEParams, prepare_params
from moe_jax.routing import route
from moe_jax.validate import check_params, check_shared, check_x

STAGES = ("route", "dispatch", "permute", "gemm", "activation", "unpermute")
# Accelerated backends that implement only some stages: a bare name runs those stages on it and the
# others on the reference (backend="deep_gemm" = DeepGEMM GEMMs around reference permute/activation).
BACKEND_STAGES = {"deep_gemm": ("gemm",),
                  "triton": ("route", "dispatch", "permute", "activation", "unpermute")}


def _stage_backends(backend) -> dict[str, str | None]:
    if isinstance(backend, str) and backend in BACKEND_STAGES:
        return {s: backend if s in BACKEND_STAGES[backend] else "reference" for s in STAGES}
    if backend is None or isinstance(backend, str):
        return {s: backend for s in STAGES}
    if isinstance(backend, tuple):  # hashable form for static jit arguments: (("gemm", name), ...)
        backend = dict(backend)
    if isinstance(backend, Mapping):
        unknown = set(backend) - set(STAGES)
        if unknown:
            raise ValueError(f"backend: unknown stage(s) {sorted(unknown)}; stages are {STAGES}")
        return {s: backend.get(s, "reference") for s in STAGES}
    raise TypeError(f"backend: expected a name, a {{stage: name}} dict / pairs, or None, got "
                    f"{type(backend).__name__}")


def stage_backend(backend, stage: str) -> str | None:
    """The backend name `backend` (as `moe_forward` takes it) gives stage `stage` (one of STAGES)."""
    return _stage_backends(backend)[stage]


def resolve_layout(layout: str, config: MoEConfig, *, num_tokens: int, num_local_experts: int,
                   local_intermediate_size: int) -> str:
    """"contig" | "masked": an explicit argument wins, then config.layout, else the auto rule."""
    if layout not in ("auto", "contig", "masked"):
        raise ValueError(f"layout: expected 'auto', 'contig' or 'masked', got {layout!r}")
    if layout == "auto":
        layout = config.layout
    if layout != "auto":
        return layout
    return choose_layout(num_tokens=num_tokens, num_local_experts=num_local_experts,
                         hidden_size=config.hidden_size, intermediate_size=local_intermediate_size,
                         recipe=config.recipe, act_group_size=get_recipe(config.recipe).act_group_size,
                         swiglu_limit=config.swiglu_limit, m_pad=config.masked_m_pad,
                         memory_budget_bytes=config.masked_memory_budget_bytes)


def routed_experts(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, params: MoEParams,
                   config: MoEConfig, *, expert_offset=0, layout: str = "auto",
                   backend="reference", out_dtype=None) -> jax.Array:
    """Routed branch for the experts held in `params`.

    x: (M, H) float; topk_ids: (M, k) int32 GLOBAL expert ids (-1 = excluded row/route);
    topk_weights: (M, k) f32 -> (M, H) out_dtype (None -> x.dtype), routed_scaling_factor included.
    E_local = params.w13.shape[0] experts are held, global ids [expert_offset, expert_offset +
    E_local) (expert_offset: python int or traced int32 scalar, e.g. axis_index * E_local under
    shard_map); other ids contribute nothing. The intermediate size is read from params (I_local
    may be a tensor-parallel shard of config.intermediate_size; the result is then a partial sum).
    Checkpoint-form params are converted with `prepare_params` on every call: prepare once and pass
    the result.
    """
    check_x(x, config)
    m = x.shape[0]
    k = config.top_k
    if topk_ids.shape != (m, k) or topk_weights.shape != (m, k):
        raise ValueError(f"topk_ids/topk_weights: expected shape ({m}, {k}), got "
                         f"{tuple(topk_ids.shape)} / {tuple(topk_weights.shape)}")
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise TypeError(f"topk_ids: expected an integer dtype, got {topk_ids.dtype}")
    if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
        raise TypeError(f"topk_weights: expected a float dtype, got {topk_weights.dtype}")
    e_loc, i_loc = check_params(params, config)
    if not params.is_prepared:
        params = prepare_params(params, config)
    elif config.arch is not None and params.gemm_arch != config.arch:
        raise ValueError(f"params: prepared for arch {params.gemm_arch}, but config.arch={config.arch}")
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    be = _stage_backends(backend)
    recipe, arch = params.gemm_recipe, params.gemm_arch
    act = activation_spec(config)
    layout = resolve_layout(layout, config, num_tokens=m, num_local_experts=e_loc,
                            local_intermediate_size=i_loc)
    if layout == "contig":
        disp = dispatch_contig(topk_ids, num_local_experts=e_loc, alignment=config.alignment,
                               expert_offset=expert_offset, backend=be["dispatch"])
        lhs, lhs_scale = permute_contig(x, disp.src2dst, num_rows=disp.num_rows_cap, recipe=recipe,
                                        arch=arch, backend=be["permute"])
        d = expert_core_contig(lhs, lhs_scale, disp, params, act, gemm_backend=be["gemm"],
                               act_backend=be["activation"])
    else:
        m_pad = config.masked_m_pad if config.masked_m_pad is not None else default_masked_m_pad(m)
        disp = dispatch_masked(topk_ids, num_local_experts=e_loc, m_pad=m_pad,
                               num_experts_global=config.num_experts, expert_offset=expert_offset,
                               backend=be["dispatch"])
        lhs, lhs_scale = permute_masked(x, disp.src2dst, num_groups=e_loc, m_pad=m_pad,
                                        recipe=recipe, arch=arch, backend=be["permute"])
        d = expert_core_masked(lhs, lhs_scale, disp, params, act, gemm_backend=be["gemm"],
                               act_backend=be["activation"]).reshape(e_loc * m_pad, -1)
    out = unpermute(d, disp.src2dst, topk_weights.astype(jnp.float32),
                    routed_scaling_factor=config.routed_scaling_factor, out_dtype=out_dtype,
                    backend=be["unpermute"])
    if layout == "masked":
        # a route held here but dropped for lack of slab rows (only possible when a caller repeats
        # an expert within a token's row) poisons that token's output: reported, never silent
        held = local_expert_ids(topk_ids, expert_offset, e_loc) < e_loc
        lost = jnp.any(held & (disp.src2dst < 0), axis=1)
        out = jnp.where(lost[:, None], jnp.asarray(jnp.nan, out.dtype), out)
    return out


def shared_experts(x: jax.Array, params: MoEParams, config: MoEConfig, *, out_dtype=None) -> jax.Array:
    """Shared-expert MLP, same activation (clamps included) as the routed experts, bf16 weights,
    fp32 accumulation, bf16 rounding between the stages like the routed bf16 path.
    x: (M, H) -> (M, H) out_dtype (None -> x.dtype); zeros when config.n_shared_experts == 0.
    Its intermediate size is read from params (may be a tensor-parallel shard)."""
    check_x(x, config)
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    if not config.n_shared_experts:
        return jnp.zeros(x.shape, out_dtype)
    check_shared(params, config)
    w13, w2 = params.shared_w13, params.shared_w2
    hi = jax.lax.Precision.HIGHEST
    xb = store_as(x, jnp.bfloat16).astype(jnp.float32)
    gateup = store_as(jnp.einsum("mh,nh->mn", xb, w13.astype(jnp.float32), precision=hi), jnp.bfloat16)
    a = store_as(gated_activation(gateup, activation_spec(config)), jnp.bfloat16)
    y = jnp.einsum("mi,hi->mh", a.astype(jnp.float32), w2.astype(jnp.float32), precision=hi)
    return y.astype(out_dtype)


def moe_forward(x: jax.Array, params: MoEParams, config: MoEConfig, *,
                token_ids: jax.Array | None = None, layout: str = "auto",
                backend="reference") -> jax.Array:
    """The MoE layer: route -> routed_experts + shared_experts (tail rule: the routed output
    already carries routed_scaling_factor; the two are added in fp32 and cast once).
    x: (M, H) float (bf16 typical) -> (M, H) x.dtype. jit-able with `config` (and layout/backend)
    static: `jax.jit(moe_forward, static_argnames=("config", "layout", "backend"))`.
    Pass `prepare_params(params, config)` to keep the load-time conversion out of the call."""
    check_x(x, config)
    if params.w13.shape[0] != config.num_experts:
        # a shard of the experts would silently run as experts 0..E_local-1
        raise ValueError(f"params.w13: moe_forward needs all {config.num_experts} experts, got "
                         f"{params.w13.shape[0]}; for an expert shard call routed_experts(..., "
                         f"expert_offset=first_expert) or moe_jax.parallel.sharded_moe_forward")
    topk_ids, topk_weights = route(x, params, config, token_ids=token_ids,
                                   backend=stage_backend(backend, "route"))
    routed = routed_experts(x, topk_ids, topk_weights, params, config, layout=layout,
                            backend=backend, out_dtype=jnp.float32)
    shared = shared_experts(x, params, config, out_dtype=jnp.float32)
    return (routed + shared).astype(x.dtype)
