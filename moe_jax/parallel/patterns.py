"""`sharded_moe_forward`: one MoE layer over a `Mesh`, in any attention x MoE pattern, as a `shard_map`
program (the same program runs single- and multi-host).

Reductions happen exactly once: TP partial sums in the one psum / psum_scatter after the experts
(the MoE itself never reduces), EP sums inside the combine; the replicated (TP1) shared expert is
added after the reduction, never summed tp times. See config.py for the patterns and EP modes.

Variable per-rank lengths (DP attention): every token shard is a static buffer of M rows; the real
count of each shard travels as an array (`num_tokens`), rows past it are padding. Padding rows are
routed nowhere (topk_ids = -1: never sent, never computed) and their output rows are 0. XLA has no
variable-length reduce-scatter (SGLang's reduce_scatterv): the DP x TP-MoE return trip is the
padded, equal-length psum_scatter with the counts as data — still one collective, and the MoE's
own all-reduce is skipped, so nothing is reduced twice.

Wire formats: EP rows travel as FP8 + scales where the recipe quantizes activations anyway
(routing already happened at the source, so it is unaffected). The DP x TP-MoE gather stays bf16:
routing and the shared expert run after it, on the gathered rows, and need them unquantized.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from moe_jax.config import MoEConfig
from custom_calls import KernelSettings
from custom_calls.settings import resolve_settings
from moe_jax.layer import routed_experts, shared_experts, stage_backend
from moe_jax.params import MoEParams
from moe_jax.parallel._compat import check_auto_axes, mesh_platform, shard_map
from moe_jax.parallel.a2a import axis_index, axis_name, resolve_impl
from moe_jax.parallel.config import ParallelConfig
from moe_jax.parallel.ep_common import EPGroup, send_quant_for
from moe_jax.parallel.ep_low_latency import ep_moe_low_latency
from moe_jax.parallel.ep_normal import ep_moe_normal
from moe_jax.parallel.ep_ring import ep_moe_ring
from moe_jax.parallel.packing import pack_rows, row_format, unpack_rows
from moe_jax.routing import route
from moe_jax.validate import check_token_id_values
from moe_jax.parallel.sharding import (axes_size, check_divisibility, from_tp_view, param_specs,
                                       to_tp_view)


def _spec(axes: tuple[str, ...]):
    """PartitionSpec entry for rows sharded over `axes` (None: replicated)."""
    return axis_name(axes) if axes else None


def _routed_only(params: MoEParams, config: MoEConfig) -> tuple[MoEParams, MoEConfig]:
    """The routed call sees no shared expert: under TP its shards would be expected I-sharded, and
    the shared expert is replicated (TP1) and added after the reduction."""
    return (params.replace(shared_w13=None, shared_w2=None, shared_w13_scale=None, shared_w2_scale=None),
            dataclasses.replace(config, n_shared_experts=0))


def _local_rank_rows(n_valid, m: int, start=0) -> jax.Array:
    """(m,) bool: row start+i of a token buffer is real."""
    return (start + jnp.arange(m, dtype=jnp.int32)) < n_valid


def _ep(x, topk_ids, topk_weights, params, config, pc: ParallelConfig, group: EPGroup, *,
        impl: str, layout, backend, settings):
    """The EP exchange + this rank's experts: (M, H) -> ((M, H) f32, dropped () int32)."""
    p, cfg = _routed_only(params, config)
    rank = group.rank()
    # the wire carries what the GEMMs quantize to: prepared params fix the GEMM form (their arch may
    # differ from config.gemm_arch when config.arch is None), checkpoint form is prepared for config's
    if params.is_prepared:
        recipe, arch = params.gemm_recipe, params.gemm_arch
    else:
        recipe, arch = config.recipe, config.gemm_arch
    quant = send_quant_for(recipe, arch) if pc.quantize_dispatch else None
    combine_dtype = jnp.dtype(pc.combine_dtype)

    def expert_fn(xr, ids, w, layout=layout):
        return routed_experts(xr, ids, w, p, cfg, expert_offset=rank * group.num_local_experts,
                              layout=layout, backend=backend, settings=settings, out_dtype=jnp.float32)

    if pc.ep_mode == "normal":
        return ep_moe_normal(x, topk_ids, topk_weights, group, expert_fn, impl=impl, quant=quant,
                             combine_dtype=combine_dtype)
    if pc.ep_mode == "ring":
        return ep_moe_ring(x, topk_ids, topk_weights, group, expert_fn, quant=quant,
                           reduce_dtype=jnp.dtype(pc.reduce_dtype))
    # the arrival rows go to the masked layout (DeepEP LL hands masked slabs to the GEMMs)
    return ep_moe_low_latency(x, topk_ids, topk_weights, group, partial(expert_fn, layout="masked"),
                              capacity=pc.num_max_dispatch_tokens_per_rank, quant=quant,
                              combine_dtype=combine_dtype)


def _tp_moe(x, token_ids, valid, params, config, pc: ParallelConfig, *, layout, backend, settings):
    """TP x TP-MoE: x (M, H) replicated over moe_axes; one psum of the routed partial sums, the
    replicated shared expert added after it."""
    params = from_tp_view(params)
    ids, w = route(x, params, config, token_ids=token_ids, backend=stage_backend(backend, "route"))
    ids = jnp.where(valid[:, None], ids, -1)
    p, cfg = _routed_only(params, config)
    part = routed_experts(x, ids, w, p, cfg, layout=layout, backend=backend, settings=settings, out_dtype=jnp.float32)
    routed = jax.lax.psum(part.astype(pc.reduce_dtype), axis_name(pc.moe_axes)).astype(jnp.float32)
    return routed + shared_experts(x, params, config, out_dtype=jnp.float32, backend=backend, settings=settings)


def _gathered_tp_moe(x, token_ids, valid, params, config, pc: ParallelConfig, *, layout, backend, settings,
                     padded: bool):
    """DP-attention (or CP) x TP-MoE: all-gather the group's rows (replicate semantics), TP-MoE on
    all of them, one psum_scatter returns each rank its rows summed — the MoE never all-reduces."""
    params = from_tp_view(params)
    moe = axis_name(pc.moe_axes)
    m = x.shape[0]
    # one all-gather carries the rows and what routing needs (token ids, padding flags)
    extra = {}
    if token_ids is not None:
        extra["token_ids"] = token_ids.astype(jnp.int32)
    if padded:
        extra["valid"] = valid.astype(jnp.int32)
    if extra:
        fmt = row_format(x=x, **extra)
        g = unpack_rows(jax.lax.all_gather(pack_rows(fmt, x=x, **extra), moe, axis=0, tiled=True), fmt)
        xg = g["x"]
        tg = g["token_ids"][:, 0] if token_ids is not None else None
    else:
        g, xg, tg = {}, jax.lax.all_gather(x, moe, axis=0, tiled=True), None
    ids, w = route(xg, params, config, token_ids=tg, backend=stage_backend(backend, "route"))
    if padded:
        ids = jnp.where(g["valid"] > 0, ids, -1)  # DP padding rows are never dispatched
    p, cfg = _routed_only(params, config)
    part = routed_experts(xg, ids, w, p, cfg, layout=layout, backend=backend, settings=settings, out_dtype=jnp.float32)
    routed = jax.lax.psum_scatter(part.astype(pc.reduce_dtype), moe, scatter_dimension=0,
                                  tiled=True).astype(jnp.float32)
    if pc.shared_on_local_tokens:  # 1/n of the rows: the rank's own, before the gather
        shared = shared_experts(x, params, config, out_dtype=jnp.float32, backend=backend, settings=settings)
    else:
        shared = jax.lax.dynamic_slice_in_dim(
            shared_experts(xg, params, config, out_dtype=jnp.float32, backend=backend, settings=settings),
            axis_index(pc.moe_axes) * m, m, axis=0)
    return routed + shared


def _ep_pattern(x, token_ids, n_valid, params, config, pc: ParallelConfig, sizes: dict, *, impl,
                layout, backend, settings):
    """attention-TP x EP (keep 1/attn_tp of the rows, EP, one all-gather back) and DP x EP (EP
    only). Returns ((M, H) f32 with padding rows 0, dropped () int32)."""
    m = x.shape[0]
    group = EPGroup(pc.moe_axes, sizes["moe"], config.num_experts)
    if pc.pattern == "tp_ep":
        a = sizes["attn_tp"]
        ms = -(-m // a)  # rows per attention-TP rank; the last ones may be padding
        start = axis_index(pc.attn_tp_axes) * ms
        x = jax.lax.dynamic_slice_in_dim(jnp.pad(x, ((0, a * ms - m), (0, 0))), start, ms, axis=0)
        if token_ids is not None:  # hash routing: ids travel with their tokens
            token_ids = jax.lax.dynamic_slice_in_dim(jnp.pad(token_ids, (0, a * ms - m)), start, ms)
        valid = _local_rank_rows(n_valid, ms, start=start)
    else:
        valid = _local_rank_rows(n_valid, m)
    ids, w = route(x, params, config, token_ids=token_ids, backend=stage_backend(backend, "route"))
    ids = jnp.where(valid[:, None], ids, -1)  # padding rows are never sent
    routed, dropped = _ep(x, ids, w, params, config, pc, group, impl=impl, layout=layout,
                          backend=backend, settings=settings)
    shared = shared_experts(x, params, config, out_dtype=jnp.float32, backend=backend, settings=settings)
    y = jnp.where(valid[:, None], routed + shared, 0)
    if pc.pattern == "tp_ep":
        y = jax.lax.all_gather(y.astype(x.dtype), axis_name(pc.attn_tp_axes), axis=0, tiled=True)[:m]
    return y, dropped


def _body(x, token_ids, num_tokens, params, *, config: MoEConfig, pc: ParallelConfig,
          mesh_axes: tuple[str, ...], sizes: dict, impl: str, layout, backend, settings,
          return_stats: bool):
    """Per device: x (M, H) -> (y (M, H) x.dtype, dropped (1,), num_tokens_out_of_range (1,))."""
    m = x.shape[0]
    tok_axes = pc.token_axes(mesh_axes)
    bad_len = jnp.zeros((), jnp.int32)
    n_valid = jnp.int32(m)
    if num_tokens is not None:
        # under jit the counts are data: out-of-range ones are clamped AND reported (stats)
        n_valid = num_tokens[axis_index(tok_axes) if tok_axes else 0].astype(jnp.int32)
        bad_len = ((n_valid < 0) | (n_valid > m)).astype(jnp.int32)
        n_valid = jnp.clip(n_valid, 0, m)
    valid = _local_rank_rows(n_valid, m)
    dropped = jnp.zeros((), jnp.int32)
    kw = dict(layout=layout, backend=backend, settings=settings)
    if pc.pattern == "tp":
        y = _tp_moe(x, token_ids, valid, params, config, pc, **kw)
    elif pc.pattern in ("dp_tp", "cp"):
        y = _gathered_tp_moe(x, token_ids, valid, params, config, pc, padded=num_tokens is not None, **kw)
    else:
        y, dropped = _ep_pattern(x, token_ids, n_valid, params, config, pc, sizes, impl=impl, **kw)
    y = jnp.where(valid[:, None], y, 0)
    if not return_stats:  # nobody would see the count: the shard's rows carry it instead (nan)
        y = jnp.where(bad_len > 0, jnp.asarray(jnp.nan, y.dtype), y)
    return y.astype(x.dtype), dropped[None], bad_len[None]


def _check_inputs(x, token_ids, num_tokens, config: MoEConfig, pc: ParallelConfig, n_tok: int,
                  tp_ep_size: int, return_stats: bool) -> int:
    if x.ndim != 2 or x.shape[1] != config.hidden_size:
        raise ValueError(f"x: expected (T, H={config.hidden_size}), got shape {tuple(x.shape)}")
    t = x.shape[0]
    if t % n_tok:
        raise ValueError(f"x: {t} rows cannot be split over the {n_tok} token shards of pattern "
                         f"{pc.pattern!r} (T must be a multiple of {n_tok})")
    m = t // n_tok
    if token_ids is not None:
        if tuple(token_ids.shape) != (t,):
            raise ValueError(f"token_ids: expected shape ({t},), got {tuple(token_ids.shape)}")
        if not jnp.issubdtype(token_ids.dtype, jnp.integer):  # the DP gather packs them as int32
            raise TypeError(f"token_ids: expected an integer dtype, got {token_ids.dtype}")
        if config.hash_routing and not isinstance(token_ids, jax.core.Tracer):
            check_token_id_values(token_ids, config.vocab_size)
    if num_tokens is not None:
        if pc.pattern == "cp":
            raise ValueError("num_tokens: pattern 'cp' gathers sequence segments whose every row is "
                             "real; got per-rank lengths (use pattern 'dp_tp' for padded DP buffers)")
        if tuple(num_tokens.shape) != (n_tok,):
            raise ValueError(f"num_tokens: expected one count per token shard, shape ({n_tok},), got "
                             f"{tuple(num_tokens.shape)}")
        if not jnp.issubdtype(num_tokens.dtype, jnp.integer):
            raise TypeError(f"num_tokens: expected an integer dtype, got {num_tokens.dtype}")
        if not isinstance(num_tokens, jax.core.Tracer):
            v = np.asarray(num_tokens)
            if (v < 0).any() or (v > m).any():
                raise ValueError(f"num_tokens: every count must be in [0, {m}] (the padded per-rank "
                                 f"buffer of {m} rows), got {v.tolist()}")
    if pc.is_ep and pc.ep_mode == "low_latency":
        per_rank = -(-m // tp_ep_size) if pc.pattern == "tp_ep" else m
        c = pc.num_max_dispatch_tokens_per_rank
        if c < per_rank and pc.strict_capacity:
            raise ValueError(f"num_max_dispatch_tokens_per_rank={c} is below the static worst case of "
                             f"{per_rank} tokens per rank (one expert can receive all of them); "
                             f"raise it or drop strict_capacity to get a dropped-route count instead")
        if c < per_rank and not return_stats:
            # routes past the capacity are dropped; without stats nobody would see the count
            raise ValueError(f"num_max_dispatch_tokens_per_rank={c} is below the static worst case of "
                             f"{per_rank} tokens per rank, so routes can be dropped, and return_stats="
                             f"False would hide their count: pass return_stats=True (check_stats) or "
                             f"raise the capacity to {per_rank}")
    return m


def sharded_moe_forward(x: jax.Array, params: MoEParams, config: MoEConfig, mesh: Mesh,
                        pc: ParallelConfig, *, token_ids: jax.Array | None = None,
                        num_tokens: jax.Array | None = None, layout: str = "auto",
                        backend="reference", return_stats: bool = False, settings: KernelSettings | None = None):
    """The MoE layer (routed + shared experts) over `mesh` in pattern `pc.pattern`.

    x: (T, H) float, global; its rows are split over `pc.token_axes(mesh.axis_names)` into n_tok
    shards of M = T / n_tok rows (replicated over the other axes). token_ids: (T,) int, sharded
    like x (hash-routed layers). num_tokens: (n_tok,) int32, real rows of each shard (the rest is
    padding; output rows 0), replicated; None = every row real. params: global MoEParams (any
    placement; `shard_params` places them so that no weight moves). layout/backend/settings: as in
    `moe_forward`. Call under `jax.jit` with config, mesh, pc, layout, backend, settings static.

    Returns y (T, H) x.dtype sharded like x, and with return_stats also a dict of (n_devices,)
    int32 per device: "dropped" routes (LL mode over capacity; else 0; a capacity below the static
    worst case needs return_stats=True, else ValueError: drops are never silent) and
    "num_tokens_out_of_range" (1 where the shard's count was outside [0, M]: concrete counts raise
    ValueError at call time, traced ones are clamped and reported here; without return_stats that
    shard's output rows are nan instead, never a silent clamp). `check_stats` raises on either
    after the step.
    """
    check_auto_axes(mesh)
    if not isinstance(pc, ParallelConfig):
        raise TypeError(f"pc: expected ParallelConfig, got {type(pc).__name__}")
    if config.fuse_shared_experts:  # the appended experts would take other ranks' ids / I-shards
        raise ValueError("config.fuse_shared_experts: single-device moe_forward only; the parallel patterns "
                         "run the shared expert unfused (replicated, added after the routed reduction)")
    mesh_axes = tuple(mesh.axis_names)
    sizes = {"moe": axes_size(mesh, pc.moe_axes), "attn_tp": axes_size(mesh, pc.attn_tp_axes)}
    tok_axes = pc.token_axes(mesh_axes)
    n_tok = axes_size(mesh, tok_axes)
    _check_inputs(x, token_ids, num_tokens, config, pc, n_tok, sizes["attn_tp"], return_stats)
    check_divisibility(params, config, mesh, pc)
    if config.hash_routing and token_ids is None:
        raise ValueError("token_ids: required for a hash-routed layer (config.hash_routing), got None")
    if pc.is_ep and pc.ep_mode == "low_latency" and layout not in ("auto", "masked"):
        raise ValueError(f"layout: the low-latency EP mode computes on the masked layout it arrives in, "
                         f"got layout={layout!r} (use 'auto' or 'masked')")
    impl = resolve_impl(pc.a2a_impl, mesh_platform(mesh)) if pc.is_ep and pc.ep_mode == "normal" else "dense"
    if not pc.is_ep:
        params = to_tp_view(params)
    pspecs = param_specs(params, pc)
    xspec = P(_spec(tok_axes), None)
    all_spec = P(_spec(mesh_axes))

    args, specs, names = [x], [xspec], ["x"]
    for name, a, s in (("token_ids", token_ids, P(_spec(tok_axes))), ("num_tokens", num_tokens, P())):
        if a is not None:
            args.append(a)
            specs.append(s)
            names.append(name)
    args.append(params)
    specs.append(pspecs)

    body = partial(_body, config=config, pc=pc, mesh_axes=mesh_axes, sizes=sizes, impl=impl,
                   layout=layout, backend=backend, settings=resolve_settings(settings),
                   return_stats=return_stats)

    def f(*a):
        kw = dict(zip(names, a[:-1]))
        return body(kw["x"], kw.get("token_ids"), kw.get("num_tokens"), a[-1])

    y, dropped, bad_len = shard_map(f, mesh, tuple(specs), (xspec, all_spec, all_spec))(*args)
    if return_stats:
        return y, {"dropped": dropped, "num_tokens_out_of_range": bad_len}
    return y


def check_stats(stats: dict) -> None:
    """Host-side check after a step (outside jit) of what jit could only report: ValueError if any
    low-latency route was dropped or any num_tokens entry was outside [0, M] (it was clamped)."""
    d = np.asarray(stats["dropped"])
    if d.any():
        raise ValueError(f"low-latency dispatch dropped {int(d.sum())} routes (per device "
                         f"{d.tolist()}): raise num_max_dispatch_tokens_per_rank to at least the "
                         f"per-rank token count")
    b = np.asarray(stats["num_tokens_out_of_range"])
    if b.any():
        raise ValueError(f"num_tokens: devices {np.flatnonzero(b).tolist()} got a count outside "
                         f"[0, rows per shard]; it was clamped")
