"""Where each parameter lives on the mesh, per pattern.

EP patterns shard every expert array on its expert axis (axis 0), in any form (checkpoint or GEMM).
TP patterns shard the intermediate dim I. w13 stacks gate rows (0..I-1) then up rows (I..2I-1);
a contiguous shard of the 2I axis would hand a rank gate rows only, so w13 (and its scale) is viewed
as (E, 2, I', K) — the "TP view" — and sharded on I'. w2 (and its scale) is sharded on its last
axis (K = I, or I/2 packed, or I/128 or I/32 scale groups). Quantized recipes need I/tp to stay a
multiple of 128 (weight blocks / activation groups). Arch-100 GEMM-form scales are packed along K in
fours and cannot be split on I: shard checkpoint-form params; `routed_experts` prepares each shard.
The router, correction bias, shared expert and tid2eid are replicated (the shared expert is TP1:
added once, after the reduction).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from layouts import get_recipe
from moe_jax.config import QUANT_SIZE_MULTIPLE, MoEConfig
from moe_jax.params import MoEParams
from moe_jax.parallel.a2a import axis_name
from moe_jax.parallel.config import ParallelConfig

_EXPERT_FIELDS = ("w13", "w2", "w13_scale", "w2_scale")


def axes_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """Number of devices spanned by mesh axes `axes` (1 for ()); ValueError for an unknown axis."""
    for a in axes:
        if a not in mesh.shape:
            raise ValueError(f"mesh: axis {a!r} not in mesh axes {tuple(mesh.axis_names)}")
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    return n


def check_divisibility(params: MoEParams, config: MoEConfig, mesh: Mesh, pc: ParallelConfig) -> None:
    """Trace-time errors for params that do not hold every expert, and for mesh axes that do not
    divide E (EP) or I (TP)."""
    n = axes_size(mesh, pc.moe_axes)
    e = params.w13.shape[0]
    if e != config.num_experts:
        # global params: EP shards them here, TP routes over all of them (expert_offset 0)
        raise ValueError(f"params.w13: expected all {config.num_experts} experts on axis 0 (pattern "
                         f"{pc.pattern!r} takes global params), got shape {tuple(params.w13.shape)}")
    if pc.is_ep:
        if e % n:
            raise ValueError(f"moe_axes {pc.moe_axes} (size {n}) must divide num_experts={e} for "
                             f"pattern {pc.pattern!r}")
        return
    if params.w13_interleave:
        # the TP view splits w13 into its gate and up halves, which the fused layout's row order mixes
        raise ValueError(f"params.w13: pattern {pc.pattern!r} shards I, which needs w13 rows [gate; up]; got "
                         f"w13_interleave={params.w13_interleave} (the fused layout's order): prepare the "
                         f"params for a contig or masked config")
    if params.scales_packed:
        raise ValueError(f"params: arch-100 GEMM-form scales are packed along K and cannot be sharded "
                         f"on I for pattern {pc.pattern!r}; pass checkpoint-form params "
                         f"(routed_experts prepares each shard)")
    i = config.intermediate_size
    if i % n:
        raise ValueError(f"moe_axes {pc.moe_axes} (size {n}) must divide intermediate_size={i} for "
                         f"pattern {pc.pattern!r}")
    if get_recipe(config.recipe).is_quantized and (i // n) % QUANT_SIZE_MULTIPLE:
        raise ValueError(f"intermediate_size/tp = {i}/{n} = {i // n} must be a multiple of {QUANT_SIZE_MULTIPLE} for "
                         f"recipe {config.recipe!r} (weight blocks and activation groups)")
    for name in _EXPERT_FIELDS:
        a = getattr(params, name)
        if a is None:
            continue
        if name.startswith("w13"):
            dim = a.shape[2] if a.ndim == 4 else a.shape[1] // 2
        else:
            dim = a.shape[-1]
        if dim % n:
            raise ValueError(f"params.{name}: shape {tuple(a.shape)} cannot be split {n} ways on its "
                             f"intermediate axis ({dim} per gate/up half)")


def to_tp_view(params: MoEParams) -> MoEParams:
    """w13 / w13_scale (E, 2I', K) -> (E, 2, I', K); already-viewed params pass through."""
    def view(a):
        if a is None or a.ndim == 4:
            return a
        return a.reshape(a.shape[0], 2, a.shape[1] // 2, a.shape[2])

    return params.replace(w13=view(params.w13), w13_scale=view(params.w13_scale))


def from_tp_view(params: MoEParams) -> MoEParams:
    """Inverse of `to_tp_view` (inside shard_map: the local (E, 2, I_local, K) -> (E, 2*I_local, K))."""
    def unview(a):
        if a is None or a.ndim == 3:
            return a
        return a.reshape(a.shape[0], 2 * a.shape[2], a.shape[3])

    return params.replace(w13=unview(params.w13), w13_scale=unview(params.w13_scale))


def param_specs(params: MoEParams, pc: ParallelConfig) -> MoEParams:
    """A MoEParams of PartitionSpecs (None where the field is None). TP patterns expect the TP view."""
    ax = axis_name(pc.moe_axes)

    def spec(name, a):
        if a is None:
            return None
        if name not in _EXPERT_FIELDS:
            return P()
        if pc.is_ep:
            return P(ax)
        if name.startswith("w13"):
            if a.ndim != 4:
                raise ValueError(f"params.{name}: expected the TP view (E, 2, I', K) (to_tp_view), "
                                 f"got shape {tuple(a.shape)}")
            return P(None, None, ax, None)
        return P(*([None] * (a.ndim - 1)), ax)

    fields = {f: spec(f, getattr(params, f)) for f in
              ("gate_weight", "w13", "w2", "e_score_correction_bias", "w13_scale", "w2_scale",
               "shared_w13", "shared_w2", "tid2eid", "shared_w13_scale", "shared_w2_scale")}
    return params.replace(**fields)


def place(a, mesh: Mesh, spec: P) -> jax.Array:
    """A global array on `mesh` laid out as `spec`. Host data (numpy, or a jax array every process
    holds whole) is cut per device with make_array_from_callback, so each process of a multi-host
    program uploads only its own devices' shards; an array already spread over processes is
    resharded by jax."""
    sharding = NamedSharding(mesh, spec)
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return jax.device_put(a, sharding)
    host = np.asarray(a)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_params(params: MoEParams, config: MoEConfig, mesh: Mesh, pc: ParallelConfig) -> MoEParams:
    """Place `params` on `mesh` for pattern `pc` (TP patterns: in the TP view), so that a jitted
    `sharded_moe_forward` moves no weights. Works in multi-host programs (see `place`)."""
    check_divisibility(params, config, mesh, pc)
    if not pc.is_ep:
        params = to_tp_view(params)
    specs = param_specs(params, pc)
    return jax.tree.map(lambda a, s: place(a, mesh, s), params, specs)
