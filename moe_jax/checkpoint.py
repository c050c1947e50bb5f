"""Loading one MoE layer from safetensors files named like DeepSeek-V3/V4 checkpoints, with the
load-time weight paths (layouts/weight_paths.py) applied once, for the target GPU family.

    config, params = load_moe_layer("/ckpt/DeepSeek-V4", layer=5, arch=100)   # config from config.json
    params = load_moe_params("/ckpt/DeepSeek-V3", config, layer=3, arch=90)
    params = load_moe_params(files, config, layer=3, expert_range=(32, 64))   # EP rank 1 of 8

Tensor namings, detected from the tensor names (the index's weight map, else the headers);
`prefix=` overrides the prefix (the leaf names are then detected under it):

    naming   prefix                      router bias                   projections gate / up / down
    v3       model.layers.{L}.mlp.       gate.e_score_correction_bias  gate_proj / up_proj / down_proj
    v4       layers.{L}.ffn.             gate.bias                     w1 / w3 / w2
    v4_hf    model.layers.{L}.ffn.       gate.bias                     w1 / w3 / w2

Leaves under the prefix (E experts, H hidden, I = config.intermediate_size, I_s = I * n_shared_experts):

    gate.weight                          (E, H)  float                 router
    <router bias>                        (E,)    float                 iff config.use_correction_bias
    gate.tid2eid                         (vocab, top_k) int            iff config.hash_routing (no bias)
    experts.{e}.<gate|up>.weight         (I, H)  \\  values, one of the formats below
    experts.{e}.<down>.weight            (H, I)  /
    shared_experts.<gate|up>.weight (I_s, H), shared_experts.<down>.weight (H, I_s)
                                                                       iff config.n_shared_experts

A scale tensor is named `<weight name without .weight>` + `.weight_scale_inv`, `.weight_scale` or
`.scale`. Accepted formats, per projection of shape (N, K) (every routed expert of a layer in one;
the table is `FORMATS` in moe_jax/checkpoint_formats.py, block sizes from the `layouts` recipes):

    format          .weight                 scale: shape, dtype
    bf16            BF16 | F16 | F32 (N, K) none
    fp8_block       F8_E4M3 (N, K)          (ceil(N/128), ceil(K/128)): F32 | BF16 | F8_E8M0
    fp8_per_tensor  F8_E4M3 (N, K)          () or (1,): F32 | BF16
    mxfp8           F8_E4M3 (N, K)          (N, ceil(K/32)): F8_E8M0 | U8 | F32 | BF16 (powers of two)
    mxfp4           I8 | U8 (N, K/2)        (N, ceil(K/32)): F8_E8M0 | U8 | F32 | BF16 (powers of two)
                    (two e2m1 codes per byte, element 2j in the low nibble)

F8_E8M0 (UE8M0) is one exponent byte per scale, value 2^(b-127); bytes 0 and 255 (NaN) are refused.
F32/BF16 block and per-tensor scales must be positive finite numbers. Power-of-two block scales
(e.g. E8M0 ones) stay exact through dequantization and the arch-100 requantization (path C).

Which checkpoint format serves which `config.recipe` (anything else is an error, not a conversion):

    bf16 <- bf16;  fp8_block <- fp8_block, fp8_per_tensor (expanded to 128x128 pseudo blocks);
    mxfp8 <- mxfp8, bf16 (quantized here, weight path D);  mxfp4 <- mxfp4

The shared expert may come in any of the five formats. One stored as FP8 with 128x128 block (or
per-tensor, expanded to pseudo blocks) scales stays FP8, as it ships, and runs through the dense
FP8 GEMM (moe_jax/shared.py), when its intermediate size is a multiple of 128; any other is
dequantized to bf16 (a dense bf16 MLP). `shared_fp8=True` requires FP8, `False` always dequantizes.
The returned `MoEParams` is in GEMM form for `arch` (`prepare=True`) or in
checkpoint form (`prepare=False`, e.g. to shard before preparing).

The config: a checkpoint directory's `config.json` (moe_jax/hf_config.py) gives the layer's
`MoEConfig` when none is passed, says which layers are MoE / hash-MoE / dense, and an explicit
config that disagrees with it is an error naming the field and quoting the file (or, for a key it
lacks, the model_type's default that was assumed).

Reading (moe_jax/safetensors_reader.py): with a `model.safetensors.index.json` the tensor names
come from its weight map and a shard's header is read only when one of its tensors is needed; the
safetensors header (8-byte little-endian length, then JSON) is parsed there; numpy cannot name FP8
dtypes, so
`safetensors.safe_open(framework="numpy")` (0.8) refuses F8_E4M3/F8_E8M0 tensors — ml_dtypes
supplies them. The loader reads with pread (no file pages stay mapped in the process;
`SafetensorsCheckpoint.read` offers read-only memory-mapped views): each expert tensor is copied
once, straight from the file into a preallocated, 64-byte aligned stacked host buffer
(E_local, N, K) that jax on the CPU adopts without a copy, so the layer's experts are never held
twice on the host (`python -m moe_jax.bench load` measures the peak). Every tensor name, dtype and
shape is checked from the headers, and the small tensors whose values can be invalid (scales,
tid2eid) are checked, before any weight is stacked; all problems are reported together in one
`CheckpointError` (the first 20 listed, then a count), and nothing is returned half-loaded.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from layouts import get_recipe
from layouts.checks import ceil_div
from moe_jax import hf_config
from moe_jax.checkpoint_formats import (CHECKPOINT_FORMATS, FORMATS, RECIPE_SOURCES, ProjPlan, classify,
                                        scale_kind, scale_to_f32)
from moe_jax.config import MoEConfig
from moe_jax.params import SHARED_FP8, MoEParams, check_params, prepare_params
from moe_jax.safetensors_reader import (INDEX_FILE, SafetensorsCheckpoint, TensorInfo,
                                        read_safetensors_header)

MAX_LISTED = 20  # problems listed in a CheckpointError's message; the rest are counted
BLOCK = get_recipe("fp8_block").weight_block[0]  # fp8_block weight block: BLOCK x BLOCK values share a scale
MX_GROUP = get_recipe("mxfp8").weight_block[1]  # MXFP8 / MXFP4 scale group along K
HOST_ALIGN = 64  # stacked host buffers: jax's CPU client adopts 64-byte aligned arrays without a copy

_FLOAT = ("BF16", "F16", "F32")
_INT = ("I8", "U8", "I16", "I32", "I64")
_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Naming:
    """How a checkpoint names one MoE layer's tensors (module docstring table)."""

    name: str
    prefix: str  # with {layer}
    bias: str  # router correction bias leaf
    gate: str  # projection leaves
    up: str
    down: str

    def proj(self, p: str) -> str:
        return {"gate_proj": self.gate, "up_proj": self.up, "down_proj": self.down}[p]


NAMINGS = {
    "v3": Naming("v3", "model.layers.{layer}.mlp.", "gate.e_score_correction_bias",
                 "gate_proj", "up_proj", "down_proj"),
    "v4": Naming("v4", "layers.{layer}.ffn.", "gate.bias", "w1", "w3", "w2"),
    "v4_hf": Naming("v4_hf", "model.layers.{layer}.ffn.", "gate.bias", "w1", "w3", "w2"),
}
DEFAULT_PREFIX = NAMINGS["v3"].prefix


class CheckpointError(ValueError):
    """A checkpoint that cannot provide what was asked; `problems` lists every reason (the
    message lists the first MAX_LISTED and counts the rest)."""

    def __init__(self, where: str, problems: Sequence[str]):
        self.problems = list(problems)
        shown = self.problems[:MAX_LISTED]
        more = len(self.problems) - len(shown)
        lines = "\n  ".join(shown + ([f"... and {more} more"] if more else []))
        super().__init__(f"{where}: {len(self.problems)} problem(s):\n  {lines}")


def detect_naming(ckpt: SafetensorsCheckpoint, *, layer: int | None = None, prefix: str | None = None,
                  kinds: tuple[str, ...] | None = None) -> tuple[Naming, str]:
    """(naming, prefix) of layer `layer`, or of the tensors under an explicit `prefix` (its leaf
    names decide v3 vs v4 leaves). Raises CheckpointError when no naming has tensors for the layer
    (listing the layers the files hold, and config.json's layer `kinds` when given) or more than
    one has."""
    if prefix is not None:
        under = [k[len(prefix):] for k in ckpt.keys() if k.startswith(prefix)]
        v4 = any(k == "gate.bias" or re.match(r"(shared_experts|experts\.\d+)\.w[123]\.", k) for k in under)
        return (NAMINGS["v4"] if v4 else NAMINGS["v3"]), prefix
    hits = []
    for naming in NAMINGS.values():
        p = naming.prefix.format(layer=layer)
        if any(k.startswith(p) for k in ckpt.keys()):
            hits.append((naming, p))
    if len(hits) == 1:
        return hits[0]
    held, moe = ckpt.layers()
    tried = ", ".join(n.prefix.format(layer=layer) for n in NAMINGS.values())
    if not hits:
        raise CheckpointError(f"checkpoint layer {layer}", [
            f"no tensor of layer {layer} under any known naming ({tried}); the files hold layers "
            f"{hf_config.format_ranges(held)}, with a MoE router (gate.weight) in layers "
            f"{hf_config.format_ranges(moe)}"
            + (f"; config.json's layers: {hf_config.describe_kinds(kinds)}" if kinds else "")])
    raise CheckpointError(f"checkpoint layer {layer}", [
        f"tensors of layer {layer} under more than one naming ({', '.join(p for _, p in hits)}); "
        f"pass prefix= to pick one"])


# -- planning: which tensors, which format, every problem found from the headers ----------------

@dataclass
class _Plan:
    """The layer's tensors, found and checked from the headers: the routed experts' one format."""

    fmt: str | None = None  # a FORMATS key
    scale_dtype: str | None = None  # the scale's dtype kind: "E8M0" (F8_E8M0 / U8 bytes), "F32", "BF16"
    weight_dtype: str | None = None
    experts: list = dataclasses.field(default_factory=list)  # [e_local][proj] -> ProjPlan
    shared: dict = dataclasses.field(default_factory=dict)  # proj -> (format name, ProjPlan)


def _proj_shapes(h: int, i: int) -> dict[str, tuple[int, int]]:
    return {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def _plan(ckpt: SafetensorsCheckpoint, config: MoEConfig, naming: Naming, prefix: str,
          expert_range: tuple[int, int], problems: list[str]) -> _Plan:
    """Classifies every routed projection of `expert_range` and the shared expert's; appends the
    problems found (including experts whose format or dtypes differ from the first one's)."""
    plan = _Plan()
    h, i = config.hidden_size, config.intermediate_size
    shapes = _proj_shapes(h, i)
    seen: dict[str, str] = {}  # first tensor that fixed the format / dtypes
    for e in range(*expert_range):
        row = {}
        for proj in _PROJ:
            w = f"{prefix}experts.{e}.{naming.proj(proj)}.weight"
            got = classify(ckpt, w, *shapes[proj], problems)
            if got is None:
                continue
            fmt, pp = got
            sdt = scale_kind(ckpt.info(pp.scale).dtype) if pp.scale else None
            wdt = ckpt.info(w).dtype
            if plan.fmt is None:
                plan.fmt, plan.scale_dtype, plan.weight_dtype = fmt, sdt, wdt
                seen["fmt"] = w
            elif (fmt, sdt, wdt) != (plan.fmt, plan.scale_dtype, plan.weight_dtype):
                problems.append(f"{w}: format {fmt} (weight {wdt}, scale {sdt}) differs from "
                                f"{plan.fmt} (weight {plan.weight_dtype}, scale {plan.scale_dtype}) "
                                f"of {seen['fmt']}; every expert of a layer must share one format")
            row[proj] = pp
        plan.experts.append(row)
    if config.n_shared_experts:
        i_s = config.shared_intermediate_size
        for proj, shp in _proj_shapes(h, i_s).items():
            got = classify(ckpt, f"{prefix}shared_experts.{naming.proj(proj)}.weight", *shp, problems)
            if got is not None:
                plan.shared[proj] = got
    return plan


def _check_small(ckpt: SafetensorsCheckpoint, name: str, shape: tuple[int, ...], kinds: tuple[str, ...],
                 problems: list[str], required: bool) -> None:
    if name not in ckpt:
        if required:
            problems.append(f"missing {name}")
        return
    info = ckpt.info(name)
    if info.shape != shape:
        problems.append(f"{name}: expected shape {shape}, got {info.shape}")
    if info.dtype not in kinds:
        problems.append(f"{name}: expected dtype in {kinds}, got {info.dtype}")


# -- reading --------------------------------------------------------------------------------------

def _aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """np.empty, HOST_ALIGN-byte aligned (jax.device_put on the CPU then adopts it without a copy)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + HOST_ALIGN, np.uint8)
    off = (-raw.ctypes.data) % HOST_ALIGN
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def _stack_experts(ckpt: SafetensorsCheckpoint, plan: _Plan, config: MoEConfig, which: str
                   ) -> tuple[np.ndarray, np.ndarray | None]:
    """Stacked checkpoint-form values (E_loc, N, K / k_pack) and scale (E_loc, ceil(N/bn),
    ceil(K/bk)) f32 (None without one) for "w13" (N = 2I, K = H) or "w2" (N = H, K = I). Every scale
    becomes f32 here, exactly, one expert at a time (no whole-layer byte copy beside it); a per-tensor
    scale fills its projection's pseudo blocks."""
    h, i = config.hidden_size, config.intermediate_size
    f = FORMATS[plan.fmt]
    projs = ("gate_proj", "up_proj") if which == "w13" else ("down_proj",)
    n, k = (2 * i, h) if which == "w13" else (h, i)
    values = _aligned_empty((len(plan.experts), *f.weight_shape(n, k)), f.values_dtype)
    scale = None if f.block is None else _aligned_empty((len(plan.experts), *f.block_grid(n, k)), np.float32)
    for e, row in enumerate(plan.experts):
        r0 = 0
        for proj in projs:
            pp = row[proj]
            rows = ckpt.info(pp.weight).shape[0]
            ckpt.read_into(pp.weight, values[e, r0:r0 + rows])  # the one host copy (F16/F32 -> bf16 cast)
            if scale is not None:  # quantized recipes: I is a multiple of the block, none straddles
                b0 = r0 // f.block[0]  # scale values were checked by classify
                scale[e, b0:b0 + ceil_div(rows, f.block[0])] = scale_to_f32(ckpt.read_copy(pp.scale))
            r0 += rows
    return values, scale


def _read_shared_projection(ckpt: SafetensorsCheckpoint, fmt: str, pp: ProjPlan
                            ) -> tuple[np.ndarray, np.ndarray | None]:
    """One shared-expert projection as stored: (values (N, K / k_pack) — int8 packed e2m1 for
    mxfp4 —, scale as exact f32 (None without one)). Host copies, never views of a file map (jax
    may alias host memory)."""
    f = FORMATS[fmt]
    w = ckpt.read_copy(pp.weight)
    if f.values_dtype.kind in "iu":  # packed codes: the stored bytes, reinterpreted
        w = w.view(f.values_dtype)
    s = None if pp.scale is None else scale_to_f32(ckpt.read_copy(pp.scale))
    return w, s


def _fp8_shared(ckpt: SafetensorsCheckpoint, plan: _Plan, h: int, i_s: int, required: bool) -> dict:
    """A shared expert stored in the SHARED_FP8 recipe's form (fp8_block, fp8_per_tensor) kept as
    FP8: {shared_w13 (2*I_s, H) e4m3, shared_w13_scale (2*I_s/bs, ceil(H/bs)) f32, shared_w2 (H, I_s)
    e4m3, shared_w2_scale} in checkpoint form (MoEParams fields), (bs, bs) that recipe's block. {}
    when its projections are not all in that form or I_s is not a multiple of bs (gate and up blocks
    would share scale rows once stacked), unless `required`, which makes those an error."""
    fmts = {p: FORMATS[plan.shared[p][0]] for p in _proj_shapes(h, i_s)}
    if not all(f.recipe == SHARED_FP8 for f in fmts.values()):
        if required:
            raise ValueError(f"shared_fp8=True: the shared expert is stored as "
                             f"{sorted({f.name for f in fmts.values()})}, "
                             "not FP8 with block or per-tensor scales")
        return {}
    bs = get_recipe(SHARED_FP8).weight_block[0]
    if i_s % bs:
        if required:
            raise ValueError(f"shared_fp8=True: the shared intermediate size must be a multiple of {bs}, "
                             f"got {i_s}")
        return {}
    out = {}
    for p, (n, k) in _proj_shapes(h, i_s).items():
        values, scale = _read_shared_projection(ckpt, *plan.shared[p])
        out[p] = (jnp.asarray(values), jnp.asarray(fmts[p].block_scale(scale, n, k)))
    (g, gs), (u, us), (d, ds) = (out[p] for p in ("gate_proj", "up_proj", "down_proj"))
    return {"shared_w13": jnp.concatenate([g, u]), "shared_w13_scale": jnp.concatenate([gs, us]),
            "shared_w2": d, "shared_w2_scale": ds}


def _bf16_shared(ckpt: SafetensorsCheckpoint, plan: _Plan, h: int, i_s: int) -> dict:
    """The shared expert dequantized: {shared_w13 (2*I_s, H) bf16 (gate rows, then up rows),
    shared_w2 (H, I_s) bf16}."""
    g, u, d = (FORMATS[plan.shared[p][0]].dequantize(*_read_shared_projection(ckpt, *plan.shared[p]), *shp)
               for p, shp in _proj_shapes(h, i_s).items())
    return {"shared_w13": jnp.concatenate([g, u], axis=0), "shared_w2": d}


def read_checkpoint_config(ckpt: SafetensorsCheckpoint) -> dict | None:
    """The checkpoint directory's config.json as a dict, or None when there is none."""
    if ckpt.directory is None or not (ckpt.directory / hf_config.CONFIG_FILE).is_file():
        return None
    return hf_config.read_config_json(ckpt.directory)


def _layer_config(ckpt, config, layer, arch, cfg_json) -> tuple[MoEConfig, dict | None]:
    """(the layer's MoEConfig, sources): `config` checked against config.json (sources None), or
    built from it (sources: `hf_config.resolve_layer`'s, which keys were stated or assumed)."""
    where = f"checkpoint layer {layer}"
    if cfg_json is None:
        if config is None:
            raise ValueError(f"config: the checkpoint has no {hf_config.CONFIG_FILE} beside its files "
                             f"(looked in {ckpt.directory}); pass a MoEConfig")
        return config, None
    if layer is None:  # prefix= names the tensors; config.json cannot say which layer they are
        if config is None:
            raise ValueError("config: required with prefix= (config.json describes layers by number; "
                             "or pass layer= instead)")
        return config, None
    kinds = hf_config.layer_kinds(cfg_json)
    if layer >= len(kinds) or kinds[layer] == "dense":
        held, moe = ckpt.layers()
        what = "a dense layer" if layer < len(kinds) else f"not a layer of this model ({len(kinds)} layers)"
        raise CheckpointError(where, [
            f"layer {layer} is {what}; config.json's layers: {hf_config.describe_kinds(kinds)}; the files "
            f"hold layers {hf_config.format_ranges(held)}, MoE routers in {hf_config.format_ranges(moe)}"])
    kwargs, sources = hf_config.resolve_layer(cfg_json, layer)
    if config is None:
        return MoEConfig(**kwargs, arch=arch), sources
    bad = hf_config.disagreements(config, kwargs, sources)
    if bad:
        raise CheckpointError(where, bad)
    return config, None


def _target_arch(config: MoEConfig, arch: int | None) -> int:
    """The arch the params are prepared for: `arch`, or config.gemm_arch; it must run the recipe."""
    if arch is None:
        arch = config.gemm_arch
    runs_on = tuple(sorted(get_recipe(config.recipe).supported_archs))
    if arch not in runs_on:
        raise ValueError(f"arch: target arch {arch!r} cannot run recipe {config.recipe!r} "
                         f"(runs on {runs_on})")
    if arch != config.gemm_arch:  # the layer runs params in the form of config.gemm_arch
        raise ValueError(f"arch: {arch} disagrees with config.gemm_arch={config.gemm_arch} "
                         f"(set MoEConfig.arch={arch})")
    return arch


def _expert_range(config: MoEConfig, expert_range: tuple[int, int] | None) -> tuple[int, int]:
    e = config.num_experts
    if expert_range is None:
        return 0, e
    start, stop = expert_range
    if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= e):
        raise ValueError(f"expert_range: expected (start, stop) with 0 <= start < stop <= "
                         f"num_experts={e}, got {expert_range!r}")
    return expert_range


def _check_routing(ckpt: SafetensorsCheckpoint, config: MoEConfig, names: dict[str, str], layer: int | None,
                   json_sources: dict | None, problems: list[str]) -> None:
    """Appends the problems of the router tensors `names` (gate, bias, tid: tensor names): the gate
    (E, H); a hash layer's tid2eid (vocab, top_k) with ids in [0, E); else the correction bias (E,)
    iff config.use_correction_bias, and no tid2eid."""
    e, gate, bias, tid = config.num_experts, names["gate"], names["bias"], names["tid"]
    _check_small(ckpt, gate, (e, config.hidden_size), _FLOAT, problems, required=True)
    if config.hash_routing:  # routed by tid2eid: a correction bias is neither needed nor read
        if config.use_correction_bias:
            problems.append("config.use_correction_bias=True on a hash-routed layer: hash layers route "
                            "by tid2eid and have no correction bias (set use_correction_bias=False; "
                            "MoEConfig.deepseek_v4(hash_routing=True) and from_pretrained do)")
        n_before = len(problems)
        _check_small(ckpt, tid, (config.vocab_size, config.top_k), _INT, problems, required=True)
        if len(problems) == n_before:  # well-formed: its ids must name experts (routing gathers them)
            ids = ckpt.read_copy(tid)
            bad = int(np.count_nonzero((ids < 0) | (ids >= e)))
            if bad:
                problems.append(f"{tid}: {bad} expert id(s) outside [0, {e}) (values "
                                f"{int(ids.min())}..{int(ids.max())})")
        return
    _check_small(ckpt, bias, (e,), _FLOAT, problems, required=config.use_correction_bias)
    if not config.use_correction_bias and bias in ckpt:
        if json_sources is None:
            problems.append(f"{bias}: present, but config.use_correction_bias is False (routing would "
                            "silently differ from the model's)")
        else:  # the config came from config.json: say how it decided, and what would fix it
            said = hf_config.describe("use_correction_bias", False, json_sources)
            problems.append(f"{bias}: present, but config.json routes layer {layer} without a correction "
                            f"bias (use_correction_bias: {said}); routing would silently differ from the "
                            "model's (a model routed with this bias has topk_method 'noaux_tc')")
    if tid in ckpt:
        problems.append(f"{tid}: present (a hash-routed layer), but config.hash_routing is False")


def _build_params(ckpt: SafetensorsCheckpoint, config: MoEConfig, plan: _Plan, names: dict[str, str],
                  shared_fp8: bool | None) -> MoEParams:
    """Checkpoint-form MoEParams of a checked plan: experts stacked, converted to config.recipe's
    form; router f32, tid2eid int32; the shared expert FP8 (`_fp8_shared`) or bf16."""
    h, f = config.hidden_size, FORMATS[plan.fmt]
    w13, s13 = f.to_checkpoint_form(*_stack_experts(ckpt, plan, config, "w13"), config.recipe)
    w2, s2 = f.to_checkpoint_form(*_stack_experts(ckpt, plan, config, "w2"), config.recipe)
    shared = {"shared_w13": None, "shared_w2": None}
    if config.n_shared_experts:
        i_s = config.shared_intermediate_size
        kept = {} if shared_fp8 is False else _fp8_shared(ckpt, plan, h, i_s, required=shared_fp8 is True)
        shared = kept or _bf16_shared(ckpt, plan, h, i_s)
    use_bias = config.use_correction_bias and not config.hash_routing

    def read(name: str, dtype) -> jax.Array:
        return jnp.asarray(np.array(ckpt.read_copy(name), dtype))

    return MoEParams(
        gate_weight=read(names["gate"], np.float32), w13=w13, w2=w2, w13_scale=s13, w2_scale=s2,
        e_score_correction_bias=read(names["bias"], np.float32) if use_bias else None, **shared,
        tid2eid=read(names["tid"], np.int32) if config.hash_routing else None,
    )


def load_moe_layer(checkpoint: str | os.PathLike | Sequence | SafetensorsCheckpoint, *,
                   layer: int | None = None, config: MoEConfig | None = None, arch: int | None = None,
                   expert_range: tuple[int, int] | None = None, prefix: str | None = None,
                   prepare: bool = True, shared_fp8: bool | None = None) -> tuple[MoEConfig, MoEParams]:
    """(config, params) of MoE layer `layer`: the config from the checkpoint directory's
    config.json when `config` is None (`arch` then sets MoEConfig.arch), else `config` checked
    against it. Arguments and errors as in `load_moe_params`."""
    if config is not None and not isinstance(config, MoEConfig):
        raise TypeError(f"config: expected MoEConfig or None, got {type(config).__name__}")
    if (layer is None) == (prefix is None):
        raise ValueError(f"layer/prefix: give exactly one, got layer={layer!r}, prefix={prefix!r}")
    if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool) or layer < 0):
        raise ValueError(f"layer: expected a non-negative int, got {layer!r}")
    ckpt = checkpoint if isinstance(checkpoint, SafetensorsCheckpoint) else SafetensorsCheckpoint(checkpoint)
    cfg_json = read_checkpoint_config(ckpt)
    config, json_sources = _layer_config(ckpt, config, layer, arch, cfg_json)
    arch = _target_arch(config, arch)
    expert_range = _expert_range(config, expert_range)
    kinds = hf_config.layer_kinds(cfg_json) if cfg_json is not None else None
    naming, prefix = detect_naming(ckpt, layer=layer, prefix=prefix, kinds=kinds)
    where = f"checkpoint layer prefix {prefix!r} ({naming.name} naming)"

    if layer is not None and f"{prefix}gate.weight" not in ckpt:  # e.g. a dense layer's MLP: say so
        held, moe = ckpt.layers()
        raise CheckpointError(where, [
            f"missing {prefix}gate.weight: layer {layer} has no MoE router in the files (a dense layer?); "
            f"MoE routers are in layers {hf_config.format_ranges(moe)}"
            + (f"; config.json's layers: {hf_config.describe_kinds(kinds)}" if kinds else "")])
    problems: list[str] = []
    names = {"gate": f"{prefix}gate.weight", "bias": f"{prefix}{naming.bias}", "tid": f"{prefix}gate.tid2eid"}
    _check_routing(ckpt, config, names, layer, json_sources, problems)
    plan = _plan(ckpt, config, naming, prefix, expert_range, problems)
    if plan.fmt is not None and plan.fmt not in RECIPE_SOURCES[config.recipe]:
        problems.append(f"recipe {config.recipe!r} cannot be loaded from {plan.fmt} expert weights "
                        f"(it loads from {RECIPE_SOURCES[config.recipe]})")
    if problems:
        raise CheckpointError(where, problems)
    params = _build_params(ckpt, config, plan, names, shared_fp8)
    check_params(params, config)
    return config, (prepare_params(params, config, arch) if prepare else params)


def load_moe_params(checkpoint: str | os.PathLike | Sequence | SafetensorsCheckpoint,
                    config: MoEConfig | None = None, *, layer: int | None = None, arch: int | None = None,
                    expert_range: tuple[int, int] | None = None, prefix: str | None = None,
                    prepare: bool = True, shared_fp8: bool | None = None) -> MoEParams:
    """The MoE layer `layer` of a DeepSeek-V3/V4 safetensors checkpoint as `MoEParams`.

    checkpoint: file, list of files, directory, or an open `SafetensorsCheckpoint`.
    config: the layer's MoEConfig; None -> built from the checkpoint directory's config.json
    (`load_moe_layer` returns it too); given -> checked against config.json when there is one.
    layer / prefix: give one; the tensor naming (v3, v4, v4_hf) is detected, prefix overrides it.
    arch: target GPU family 90 | 100 (None -> config.gemm_arch; must equal it); it picks the load-time
    path (weight paths, layouts/weight_paths.py: fp8_block on 100 -> UE8M0 requant C; mxfp4 on 90 ->
    FP4->FP8 B, on 100 -> A; mxfp8 -> D). expert_range: (start, stop) global expert ids held by this
    rank (EP); only those experts are read; the router, bias and shared expert are whole.
    prepare: True -> GEMM form for `arch` (`prepare_params`); False -> checkpoint form.
    shared_fp8: None (default) keeps a shared expert stored as FP8 with block (or per-tensor) scales
    in FP8, as it ships, when its intermediate size is a multiple of 128, and dequantizes any other
    to bf16; True requires FP8 (an error otherwise); False always dequantizes to bf16.
    Returns MoEParams with w13 (E_local, 2I, K[/2]), w2 (E_local, H, I[/2]) and scales; the router
    weight and correction bias in f32, the shared expert in bf16 or FP8 (shared_fp8), tid2eid in int32.
    Raises CheckpointError (a ValueError) listing every missing, mis-shaped or mis-typed tensor,
    a format the recipe cannot be loaded from, invalid scale values, a layer that is dense or not in
    the files (with the layer kinds and the layers held), or a config field config.json contradicts;
    ValueError for a target arch that cannot run the recipe or a bad expert_range.
    """
    if config is not None and not isinstance(config, MoEConfig):
        raise TypeError(f"config: expected MoEConfig or None, got {type(config).__name__}")
    return load_moe_layer(checkpoint, layer=layer, config=config, arch=arch, expert_range=expert_range,
                          prefix=prefix, prepare=prepare, shared_fp8=shared_fp8)[1]


__all__ = ["BLOCK", "CHECKPOINT_FORMATS", "DEFAULT_PREFIX", "HOST_ALIGN", "INDEX_FILE", "MAX_LISTED",
           "MX_GROUP", "NAMINGS", "RECIPE_SOURCES", "CheckpointError", "Naming", "SafetensorsCheckpoint",
           "TensorInfo", "detect_naming", "load_moe_layer", "load_moe_params", "read_checkpoint_config",
           "read_safetensors_header"]
