"""`MoE`: the layer as a Flax nnx module (needs the `nn` extra: flax).

    moe = MoE(config, rngs=nnx.Rngs(0))                        # random weights, GEMM form
    moe = MoE.from_pretrained("/ckpt/DeepSeek-V4", layer=5)   # config from config.json
    moe = MoE.from_checkpoint("/ckpt", config, layer=3)       # DeepSeek-style safetensors
    y = nnx.jit(lambda m, x: m(x))(moe, x)                    # x: (M, H) bf16 -> (M, H) bf16

Variables (nnx.Param unless noted), shapes for E experts (E_local after `expert_range`), hidden H,
intermediate I, shared intermediate I_s; K' = K/2 for int8-packed MXFP4 values:
    gate_weight (E, H) f32 or bf16 (as loaded), e_score_correction_bias (E,) f32 (if configured)
    w13 (E, 2, I, H') — gate rows [:, 0], up rows [:, 1] (the "TP view" of the parallel package,
        so the intermediate axis can be sharded without splitting gate from up); w13_scale alike
        when its layout has N on axis 1 (checkpoint form, arch-90 GEMM form), else as stored.
        A fused-layout config's w13 (rows interleaved gate/up by 8, `w13_interleave`) is kept as
        (E, 2I, H): its rows mix gate and up, and the TP patterns refuse it anyway
    w2 (E, H, I'), w2_scale; shared_w13 (2*I_s, H), shared_w2 (H, I_s): bf16, or e4m3 with
        shared_w13_scale / shared_w2_scale (FP8 shared experts, moe_jax/params.py); with
        config.fuse_shared_experts the shared experts are experts E..E+n_s-1 of w13/w2 instead
    tid2eid (vocab, top_k) int32 — a `Table` variable (not trainable), hash-routed layers only
Each variable carries an `out_sharding` annotation (`nnx.get_partition_spec(nnx.state(m))`):
expert arrays on `expert_axis` (axis 0) and `intermediate_axis` (I), everything else replicated.
The axis names default to the parallel pattern's `moe_axes` (EP patterns: experts; TP patterns:
intermediate), or "ep" / "tp" without one. With `mesh` the variables are placed at construction.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

try:
    from flax import nnx
except ModuleNotFoundError as e:  # flax is the optional `nn` extra
    if (e.name or "").split(".")[0] != "flax":
        raise
    raise ImportError("moe_jax.nn needs flax, which is not installed: pip install 'moe-jax[nn]'") from e

from custom_calls import KernelSettings
from custom_calls.settings import resolve_settings
from moe_jax.config import MoEConfig
from moe_jax.dispatch import LAYOUTS
from moe_jax.layer import moe_forward, stage_backends
from moe_jax.params import MoEParams, init_params, prepare_params
from moe_jax.params import check_params

DEFAULT_EXPERT_AXIS = "ep"
DEFAULT_INTERMEDIATE_AXIS = "tp"
_DERIVE = object()  # sentinel: derive the axis name from `parallel` / defaults


class Table(nnx.Variable):
    """A non-trainable integer table (hash routing's tid2eid)."""


def _w13_scale_viewable(p: MoEParams) -> bool:
    # arch-100 GEMM-form scales are packed MN-major (E, K-packs, align(N, 4)): no N axis to split
    return p.w13_scale is not None and not p.scales_packed


def _axes(name, value, default, mesh: Mesh | None):
    """An annotation axis: explicit names are checked against the mesh, derived ones dropped there
    when the mesh lacks them (a 1-D "ep" mesh then gets no intermediate sharding)."""
    if value is _DERIVE:
        if mesh is not None and default is not None:
            names = default if isinstance(default, tuple) else (default,)
            if not all(a in mesh.axis_names for a in names):
                return None
        return default
    if value is None:
        return None
    names = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (tuple, list)) else ()
    if not names or not all(isinstance(a, str) for a in names):
        raise TypeError(f"{name}: expected a mesh axis name, a tuple of names or None, got {value!r}")
    if mesh is not None:
        missing = [a for a in names if a not in mesh.axis_names]
        if missing:
            raise ValueError(f"{name}: axis {missing} not in mesh axes {tuple(mesh.axis_names)}")
    return names[0] if len(names) == 1 else names


def _default_axes(parallel, mesh: Mesh | None):
    """(expert axis, intermediate axis) the annotations default to: the pattern's MoE axes on the
    experts (EP) or on the intermediate size (TP), else the module defaults."""
    if parallel is None:
        return DEFAULT_EXPERT_AXIS, DEFAULT_INTERMEDIATE_AXIS
    from moe_jax.parallel import ParallelConfig
    from moe_jax.parallel.a2a import axis_name

    if not isinstance(parallel, ParallelConfig):
        raise TypeError(f"parallel: expected ParallelConfig or None, got {type(parallel).__name__}")
    if mesh is None:
        raise ValueError(f"mesh: required with parallel={parallel.pattern!r}, got None")
    axes = axis_name(parallel.moe_axes)
    return (axes, None) if parallel.is_ep else (None, axes)


class MoE(nnx.Module):
    """A DeepSeek-style MoE layer (routed + shared experts), `moe_forward` inside.

    config: MoEConfig (static). rngs: initializes random weights (`init_params`) unless `params`
    (a MoEParams, checkpoint or GEMM form) is given. prepare: convert checkpoint-form weights to
    the GEMM form of `config.gemm_arch` once, here (the load-time paths); False keeps checkpoint form (the
    layer then converts on every call). backend / layout / settings: as in `moe_forward` (static;
    settings None: the environment's `KernelSettings`, read here, once).
    mesh + parallel (a `moe_jax.parallel.ParallelConfig`): run `sharded_moe_forward` over the mesh;
    mesh alone only places the variables. expert_axis / intermediate_axis: annotation axis names
    (module docstring); None disables that axis.
    """

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs | None = None,
                 params: MoEParams | None = None, backend="auto", layout: str = "auto",
                 prepare: bool = True, mesh: Mesh | None = None, parallel=None,
                 expert_axis=_DERIVE, intermediate_axis=_DERIVE, settings: KernelSettings | None = None):
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config: expected MoEConfig, got {type(config).__name__}")
        stage_backends(backend)  # unknown backend or stage names are an error here, not at the first call
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        # its FP8 weights are prepared for it; W4A8 weights are widened into its order at each call
        if layout == "fused" and config.layout != "fused" and not config.keeps_4bit:
            raise ValueError("layout: 'fused' is chosen by MoEConfig(layout='fused'), which prepares the weights "
                             f"for it (or by a config whose experts stay 4-bit); got "
                             f"config.layout={config.layout!r}")
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(f"mesh: expected jax.sharding.Mesh or None, got {type(mesh).__name__}")
        ep_default, tp_default = _default_axes(parallel, mesh)
        if params is None:
            if rngs is None:
                raise ValueError("rngs: required to initialize weights when params is None, got None")
            params = init_params(rngs.params(), config)
        elif not isinstance(params, MoEParams):
            raise TypeError(f"params: expected MoEParams, got {type(params).__name__}")
        check_params(params, config)
        if prepare:
            params = prepare_params(params, config)
        if parallel is not None:  # the pattern's own errors, before any placement
            from moe_jax.parallel.sharding import check_divisibility

            check_divisibility(params, config, mesh, parallel)
        self.config = config
        self.backend = backend
        self.settings = resolve_settings(settings)  # fixed with the module, as its backend is
        self.layout = layout
        self.mesh = mesh
        self.parallel = parallel
        self.gemm_recipe = params.gemm_recipe
        self.gemm_arch = params.gemm_arch
        self.fused_shared = params.fused_shared
        self.w13_interleave = params.w13_interleave
        ea = _axes("expert_axis", expert_axis, ep_default, mesh)
        ia = _axes("intermediate_axis", intermediate_axis, tp_default, mesh)
        self.expert_axis, self.intermediate_axis = ea, ia

        def var(value, spec, kind=nnx.Param):
            if value is None:
                return None
            if mesh is None:  # annotate only; nnx.get_partition_spec + device_put place it later
                return kind(value, out_sharding=spec, eager_sharding=False)
            return kind(value, out_sharding=spec, mesh=mesh)

        def view(a):  # (E, 2I', K) -> (E, 2, I', K)
            return a.reshape(a.shape[0], 2, a.shape[1] // 2, a.shape[2])

        self.gate_weight = var(params.gate_weight, (None, None))
        self.e_score_correction_bias = var(params.e_score_correction_bias, (None,))
        if params.w13_interleave:
            self.w13 = var(params.w13, (ea, None, None))
        else:
            self.w13 = var(view(params.w13), (ea, None, ia, None))
        s13 = params.w13_scale
        if _w13_scale_viewable(params):
            self.w13_scale = var(view(s13), (ea, None, ia, None))
        else:
            self.w13_scale = var(s13, None if s13 is None else (ea, None, None))
        self.w2 = var(params.w2, (ea, None, ia))
        s2 = params.w2_scale
        self.w2_scale = var(s2, None if s2 is None else ((ea, None, None) if params.scales_packed else (ea, None, ia)))
        self.shared_w13 = var(params.shared_w13, (None, None))
        self.shared_w2 = var(params.shared_w2, (None, None))
        self.shared_w13_scale = var(params.shared_w13_scale, (None, None))
        self.shared_w2_scale = var(params.shared_w2_scale, (None, None))
        self.tid2eid = var(params.tid2eid, (None, None), Table)

    # -- construction from weights ---------------------------------------------------------------
    @classmethod
    def from_params(cls, params: MoEParams, config: MoEConfig, **kwargs) -> "MoE":
        """A module holding `params` (checkpoint or GEMM form); kwargs as in `MoE(...)`."""
        return cls(config, params=params, **kwargs)

    @classmethod
    def from_checkpoint(cls, checkpoint: str | os.PathLike | Sequence, config: MoEConfig, *,
                        layer: int | None = None, prefix: str | None = None,
                        expert_range: tuple[int, int] | None = None, **kwargs) -> "MoE":
        """Load layer `layer` of a DeepSeek-style safetensors checkpoint (`load_moe_params`, GEMM
        form for config.gemm_arch); kwargs as in `MoE(...)`. With `expert_range` the module holds
        only those experts (one EP rank's weights): calling it is refused, the layer needs all."""
        from moe_jax.checkpoint import load_moe_params

        params = load_moe_params(checkpoint, config, layer=layer, prefix=prefix,
                                 expert_range=expert_range, prepare=kwargs.get("prepare", True))
        return cls(config, params=params, **kwargs)

    @classmethod
    def from_pretrained(cls, checkpoint: str | os.PathLike | Sequence, *, layer: int,
                        arch: int | None = None, config: MoEConfig | None = None,
                        expert_range: tuple[int, int] | None = None, **kwargs) -> "MoE":
        """Layer `layer` of a DeepSeek-V3/V4 checkpoint directory, config and all: the MoEConfig
        comes from its config.json (`arch` sets MoEConfig.arch; `config` instead is checked against
        config.json), the tensor naming is detected (`load_moe_layer`); kwargs as in `MoE(...)`."""
        from moe_jax.checkpoint import load_moe_layer

        config, params = load_moe_layer(checkpoint, layer=layer, config=config, arch=arch,
                                        expert_range=expert_range, prepare=kwargs.get("prepare", True))
        return cls(config, params=params, **kwargs)

    # -- the layer -------------------------------------------------------------------------------
    def moe_params(self, *, tp_view: bool = False) -> MoEParams:
        """The variables as MoEParams; w13 (and its scale) as (E, 2I, K) unless tp_view."""
        def get(v):
            return None if v is None else v.get_value()

        def unview(a):
            if a is None or tp_view or a.ndim != 4:
                return a
            return a.reshape(a.shape[0], 2 * a.shape[2], a.shape[3])

        return MoEParams(
            gate_weight=get(self.gate_weight), w13=unview(get(self.w13)), w2=get(self.w2),
            e_score_correction_bias=get(self.e_score_correction_bias),
            w13_scale=unview(get(self.w13_scale)), w2_scale=get(self.w2_scale),
            shared_w13=get(self.shared_w13), shared_w2=get(self.shared_w2), tid2eid=get(self.tid2eid),
            shared_w13_scale=get(self.shared_w13_scale), shared_w2_scale=get(self.shared_w2_scale),
            gemm_recipe=self.gemm_recipe, gemm_arch=self.gemm_arch, fused_shared=self.fused_shared,
            w13_interleave=self.w13_interleave,
        )

    def __call__(self, x: jax.Array, *, token_ids: jax.Array | None = None,
                 num_tokens: jax.Array | None = None, return_stats: bool = False, debug_checks: bool = False):
        """x: (..., H) float -> (..., H) x.dtype. token_ids: (...) int for hash-routed layers.
        num_tokens / return_stats (parallel patterns only): (n_token_shards,) int32 real rows per
        shard; True -> (y, stats) as in `sharded_moe_forward`. debug_checks (single device): the
        checked mode of `moe_forward`; call the module under `custom_calls.checked`."""
        if debug_checks and self.parallel is not None:
            raise ValueError("debug_checks: the checked mode runs on a single device (parallel=None); "
                             f"this module uses the parallel pattern {self.parallel.pattern!r}")
        if self.parallel is None:
            if num_tokens is not None:
                raise ValueError("num_tokens: only used with a parallel pattern (parallel=...), got an array")
            if return_stats:
                raise ValueError("return_stats: only used with a parallel pattern (parallel=...), got True")
            e_loc = self.w13.get_value().shape[0] - self.fused_shared
            if e_loc != self.config.num_experts:
                # moe_forward would take the held experts for experts 0..E_local-1: wrong routes
                raise ValueError(f"w13: the layer needs all {self.config.num_experts} experts, this module "
                                 f"holds {e_loc} (loaded with expert_range); run one EP rank's share "
                                 f"with moe_jax.routed_experts(..., expert_offset=start) on moe_params()")
            return moe_forward(x, self.moe_params(), self.config, token_ids=token_ids,
                               layout=self.layout, backend=self.backend, debug_checks=debug_checks,
                               settings=self.settings)
        from moe_jax.parallel import sharded_moe_forward

        params = self.moe_params(tp_view=not self.parallel.is_ep)
        return sharded_moe_forward(x, params, self.config, self.mesh, self.parallel,
                                   token_ids=token_ids, num_tokens=num_tokens, layout=self.layout,
                                   backend=self.backend, return_stats=return_stats, settings=self.settings)


def partition_specs(module: MoE):
    """`jax.sharding.PartitionSpec` of every variable of `module` (an nnx.State of specs)."""
    return nnx.get_partition_spec(nnx.state(module))


__all__ = ["DEFAULT_EXPERT_AXIS", "DEFAULT_INTERMEDIATE_AXIS", "MoE", "Table", "partition_specs"]
