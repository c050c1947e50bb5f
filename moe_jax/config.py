"""`MoEConfig`: the static description of one MoE layer (routing, experts, core; docs/ARCHITECTURE.md).

A frozen, hashable dataclass: pass it as a static argument to `jax.jit`. Sizes here are the model's
(global) sizes; the sharded paths read per-rank sizes (E_local, I_local) from the parameter shapes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from custom_calls.activation import ActivationSpec
from custom_calls.route_topk import SCORINGS
from layouts import RECIPE_NAMES as RECIPES
from layouts import SUPPORTED_ARCHS as ARCHS
from layouts import get_recipe
from moe_jax.dispatch import LAYOUTS

# Quantized recipes: H and I must be multiples of this (128x128 weight blocks, 128-wide activation
# groups, and the FP4 -> FP8 re-grouping to 128 on SM90).
QUANT_SIZE_MULTIPLE = 128
# Row alignment of contig segments for quantized GEMMs (DeepGEMM's M block on SM90 and SM100).
QUANT_ALIGNMENT_MULTIPLE = 128
# MXFP4 experts on arch 90: expanded to FP8 at load, or kept 4-bit for the W4A8 GEMMs
MXFP4_SM90_FORMS = ("fp8", "w4a8")


@dataclass(frozen=True)
class MoEConfig:
    """Static configuration of a DeepSeek-style MoE layer.

    Routing: `scoring` ("softmax" | "sigmoid" | "sqrtsoftplus"), optional additive
    `use_correction_bias` (selection only), grouped top-k (`use_grouped_topk`, `n_group`,
    `topk_group`), `norm_topk_prob` renormalizes the chosen weights, `routed_scaling_factor`
    multiplies the routed output once. `hash_routing` marks a hash-routed layer (params carry
    `tid2eid (vocab_size, top_k)`; `route` needs token ids).

    Experts: `activation`, a `custom_calls.ActivationSpec` (routed and shared experts): kind "silu"
    (`swiglu_limit` clamps up to [-l, l], gate above only), "swiglu_oai"
    (gate*sigmoid(gemm1_alpha*gate)*(up+1), same clamps), "situ"
    (situ_beta*tanh(gate/situ_beta)*sigmoid(gate) * situ_linear_beta*tanh(up/situ_linear_beta));
    `keep_fp32` quantizes SiLU*up from fp32 instead of rounding to bf16 first (FP8 expert weights,
    silu only). A kind name alone (`activation="situ"`) means `ActivationSpec(kind=...)`.

    Core: `recipe` ("bf16" | "fp8_block" | "mxfp8" | "mxfp4"), `arch` (90 | 100 | None: which GPU
    family's GEMM scale formats the core produces; None -> 90 unless the recipe needs 100),
    `mxfp4_sm90_form` (MXFP4 experts on arch 90: "fp8", expanded to fp8_block at load, twice the
    bytes, every GEMM backend and layout; or "w4a8", kept 4-bit, `layouts.w4a8`, the W4A8 grouped
    GEMMs (backend "w4a8") widen them to the same e4m3 values in registers; contig and masked layouts, and
    the fused one on FP8 weights widened from them at each call; half the expert memory; at decode
    1.3-1.4x faster than the fused FP8 layer on one H100; at prefill 1.27x the FP8 staged layer's time,
    1.13x with layout "fused", BENCHMARKS.md),
    `layout` ("auto" | "contig" | "masked" | "fused": the whole routed branch in one kernel, FP8
    block weights and SiLU only, its w13 prepared for it by `prepare_params` (W4A8 weights: widened
    into its order at each call, a temporary FP8 copy of the experts, for prefill); never chosen by
    "auto"), contig `alignment` (rows per expert segment block),
    `masked_m_pad` (static rows per masked slab; None -> round_up(M, 256)),
    `masked_memory_budget_bytes` (auto layout: masked only if its estimated peak fits; None ->
    contig, the choice that needs no memory query).

    Shared experts (`n_shared_experts` of them, one dense MLP of intermediate size
    I * n_shared_experts): bf16 or FP8 as the params hold them (`MoEParams.shared_recipe`).
    `fuse_shared_experts` runs them inside the routed grouped GEMMs instead (as SGLang's
    shared-expert fusion does): `prepare_params` appends them as experts E..E+n_s-1 and every token
    routes to each of them with net weight exactly 1 (moe_jax/layer.py); it needs the shared expert
    in the routed GEMM recipe and single-device `moe_forward` (the sharded patterns refuse it).
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    n_shared_experts: int = 0
    scoring: str = "softmax"
    use_correction_bias: bool = False
    use_grouped_topk: bool = False
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    hash_routing: bool = False
    vocab_size: int | None = None
    activation: ActivationSpec = ActivationSpec()
    recipe: str = "bf16"
    arch: int | None = None
    layout: str = "auto"
    alignment: int = 128
    masked_m_pad: int | None = None
    masked_memory_budget_bytes: int | None = None
    fuse_shared_experts: bool = False
    mxfp4_sm90_form: str = "fp8"

    def __post_init__(self) -> None:
        if isinstance(self.activation, str):
            object.__setattr__(self, "activation", ActivationSpec(kind=self.activation))
        _validate(self)

    # -- derived static properties ---------------------------------------------------------------
    @property
    def gemm_arch(self) -> int:
        """GPU family whose GEMM formats the core produces: `arch`, or 90 unless the recipe needs 100."""
        if self.arch is not None:
            return self.arch
        return min(get_recipe(self.recipe).supported_archs)

    @property
    def gemm_recipe(self) -> str:
        """Recipe the GEMMs actually run: mxfp4 on 90 is converted to fp8_block at load time, unless
        `mxfp4_sm90_form` is "w4a8" (then the GEMMs run mxfp4 in its 4-bit form)."""
        return self.gemm_recipe_on(self.gemm_arch)

    def gemm_recipe_on(self, arch: int) -> str:
        """The recipe the GEMMs run on `arch` (`gemm_recipe` for another arch than `gemm_arch`)."""
        rec = get_recipe(self.recipe)
        if self.mxfp4_sm90_form == "w4a8" and arch in rec.kept_4bit_on:
            return rec.name
        return rec.gemm_recipe(arch).name

    @property
    def keeps_4bit(self) -> bool:
        """The expert weights stay 4-bit in GEMM form (mxfp4 on arch 90 with mxfp4_sm90_form "w4a8")."""
        return self.gemm_recipe == self.recipe and self.gemm_arch in get_recipe(self.recipe).kept_4bit_on

    @property
    def shared_intermediate_size(self) -> int:
        return self.intermediate_size * self.n_shared_experts

    def scaled(self, *, fit_routing: bool = False, **overrides) -> "MoEConfig":
        """A copy with some fields replaced, e.g. `scaled(num_experts=16, hidden_size=256,
        intermediate_size=128)`.

        Routing fields that no longer fit the new expert count are never changed silently: when
        `n_group` stops dividing `num_experts`, `topk_group` exceeds `n_group` or `top_k` exceeds
        the experts routing can still choose, ValueError names each field and the value that fits
        (`n_group`: the largest divisor of `num_experts` not above it; `topk_group` / `top_k`:
        clipped). Pass those values explicitly, or `fit_routing=True` to apply them."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields.update(overrides)
        fitted = _fit_routing(fields, overrides)
        if fitted and not fit_routing:
            changes = ", ".join(f"{k}={fields[k]} -> {v}" for k, v in fitted.items())
            raise ValueError(
                f"MoEConfig.scaled: routing does not fit num_experts={fields['num_experts']}: {changes}; "
                f"pass {', '.join(f'{k}={v}' for k, v in fitted.items())} or fit_routing=True")
        fields.update(fitted)
        return MoEConfig(**fields)

    # -- presets ---------------------------------------------------------------------------------
    @classmethod
    def deepseek_v3(cls, **overrides) -> "MoEConfig":
        """DeepSeek-V3: 256 experts, top-8 of 8 groups / top-4 groups, sigmoid + correction bias,
        scaling 2.5, H 7168, I 2048, one shared expert, block-FP8 weights."""
        base = dict(
            num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048, n_shared_experts=1,
            scoring="sigmoid", use_correction_bias=True, use_grouped_topk=True, n_group=8,
            topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5,
            recipe="fp8_block",
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def deepseek_v4(cls, **overrides) -> "MoEConfig":
        """DeepSeek-V4: 256 experts, top-6, sqrtsoftplus + correction bias without grouping,
        weights renormalized, scaling 1.5, swiglu_limit 10 on routed and shared experts, one shared
        expert, MXFP4 experts (W4A8), H 4096, I 2048. Pass `hash_routing=True` for the first,
        hash-routed layers (vocab 129280; routed by tid2eid, no correction bias)."""
        hashed = overrides.get("hash_routing", False)
        base = dict(
            num_experts=256, top_k=6, hidden_size=4096, intermediate_size=2048, n_shared_experts=1,
            scoring="sqrtsoftplus", use_correction_bias=not hashed, use_grouped_topk=False,
            norm_topk_prob=True, routed_scaling_factor=1.5,
            activation=ActivationSpec(kind="silu", swiglu_limit=10.0), recipe="mxfp4", vocab_size=129280,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_pretrained(cls, path_or_config_json, *, layer: int, **overrides) -> "MoEConfig":
        """Layer `layer`'s config from a checkpoint's `config.json` (moe_jax/hf_config.py):
        path_or_config_json is the checkpoint directory, the config.json file, or its parsed dict.
        overrides set the fields config.json does not decide (arch, layout, ...) or replace any,
        e.g. `recipe="mxfp8"` for bf16 experts. A dense layer is a ValueError listing the kinds."""
        from moe_jax.hf_config import moe_config_kwargs

        kwargs = moe_config_kwargs(path_or_config_json, layer)
        kwargs.update(overrides)
        return cls(**kwargs)


def _fit_routing(fields: dict, overrides: dict) -> dict[str, int]:
    """The routing fields of `fields` not given in `overrides` that must change to fit
    `num_experts`, with their fitting values (n_group: the largest divisor not above it;
    topk_group / top_k: clipped)."""
    e, grouped = fields["num_experts"], fields["use_grouped_topk"]
    n_group, topk_group = fields["n_group"], fields["topk_group"]
    if grouped and "n_group" not in overrides:
        n_group = min(n_group, e)
        while e % n_group:
            n_group -= 1
    if grouped and "topk_group" not in overrides:
        topk_group = min(topk_group, n_group)
    top_k = fields["top_k"]
    if "top_k" not in overrides:
        top_k = min(top_k, topk_group * (e // n_group) if grouped else e)
    fitted = dict(n_group=n_group, topk_group=topk_group, top_k=top_k)
    return {k: v for k, v in fitted.items() if v != fields[k]}


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _validate(c: MoEConfig) -> None:
    for name in ("num_experts", "top_k", "hidden_size", "intermediate_size", "alignment"):
        v = getattr(c, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"MoEConfig.{name} must be a positive int, got {v!r}")
    _check(c.n_shared_experts >= 0, f"MoEConfig.n_shared_experts must be >= 0, got {c.n_shared_experts}")
    _check(isinstance(c.fuse_shared_experts, bool),
           f"MoEConfig.fuse_shared_experts must be a bool, got {c.fuse_shared_experts!r}")
    _check(not c.fuse_shared_experts or c.n_shared_experts >= 1,
           f"MoEConfig.fuse_shared_experts needs n_shared_experts >= 1, got {c.n_shared_experts}")
    _check(c.recipe in RECIPES, f"MoEConfig.recipe must be one of {RECIPES}, got {c.recipe!r}")
    _check(c.scoring in SCORINGS, f"MoEConfig.scoring must be one of {SCORINGS}, got {c.scoring!r}")
    _check(isinstance(c.activation, ActivationSpec),
           f"MoEConfig.activation must be an ActivationSpec or a kind name, got {c.activation!r}")
    _check(c.layout in LAYOUTS, f"MoEConfig.layout must be one of {LAYOUTS}, got {c.layout!r}")
    _check(c.top_k <= c.num_experts,
           f"MoEConfig.top_k={c.top_k} exceeds num_experts={c.num_experts}")
    if c.use_grouped_topk:
        _check(c.n_group >= 1 and c.num_experts % c.n_group == 0,
               f"MoEConfig.n_group={c.n_group} must divide num_experts={c.num_experts}")
        _check(1 <= c.topk_group <= c.n_group,
               f"MoEConfig.topk_group={c.topk_group} must be in [1, n_group={c.n_group}]")
        kept = c.topk_group * (c.num_experts // c.n_group)
        _check(c.top_k <= kept, f"MoEConfig.top_k={c.top_k} exceeds the {kept} experts left by "
               f"topk_group={c.topk_group} of n_group={c.n_group} groups")
    if c.hash_routing:
        _check(c.vocab_size is not None and c.vocab_size >= 1,
               f"MoEConfig.hash_routing needs a positive vocab_size, got {c.vocab_size!r}")
    rec = get_recipe(c.recipe)
    _check(c.mxfp4_sm90_form in MXFP4_SM90_FORMS,
           f"MoEConfig.mxfp4_sm90_form must be one of {MXFP4_SM90_FORMS}, got {c.mxfp4_sm90_form!r}")
    if c.mxfp4_sm90_form == "w4a8":
        _check(c.gemm_arch in rec.kept_4bit_on,
               f"MoEConfig.mxfp4_sm90_form='w4a8' keeps MXFP4 experts 4-bit on arch 90: it needs recipe 'mxfp4' "
               f"on arch 90, got recipe {c.recipe!r} on arch {c.gemm_arch}")
    if c.arch is not None:
        _check(c.arch in ARCHS, f"MoEConfig.arch must be one of {ARCHS} or None, got {c.arch!r}")
        _check(c.arch in rec.supported_archs,
               f"MoEConfig.recipe={c.recipe!r} does not run on arch {c.arch} "
               f"(supported: {tuple(sorted(rec.supported_archs))})")
    if rec.is_quantized:
        for name in ("hidden_size", "intermediate_size"):
            v = getattr(c, name)
            _check(v % QUANT_SIZE_MULTIPLE == 0, f"MoEConfig.{name}={v} must be a multiple of "
                   f"{QUANT_SIZE_MULTIPLE} for recipe {c.recipe!r}")
        _check(c.alignment % QUANT_ALIGNMENT_MULTIPLE == 0,
               f"MoEConfig.alignment={c.alignment} must be a multiple of "
               f"{QUANT_ALIGNMENT_MULTIPLE} for recipe {c.recipe!r}")
    if c.activation.keep_fp32:
        _check(rec.is_quantized and rec.weight_k_pack == 1,
               "MoEConfig.activation.keep_fp32 needs FP8 expert weights (fp8_block or mxfp8), got "
               f"recipe={c.recipe!r}")
    if c.layout == "fused":
        # what the fused op computes (custom_calls/fused_moe.py): FP8 block-scaled weights, SiLU
        # with an optional clamp, the shared experts added outside it. The recipe the GEMMs run
        # decides: mxfp4 experts become fp8_block at load on arch 90 (DeepSeek-V4 on Hopper).
        # The op reads arch 90's fp32 block scales (arch 100's are packed UE8M0). MXFP4 experts kept
        # 4-bit (W4A8) are widened to those FP8 weights at each call (moe_jax/layer.py).
        _check(c.gemm_arch == 90 and (c.gemm_recipe == "fp8_block" or c.keeps_4bit),
               f"MoEConfig.layout='fused' needs weights that run as recipe 'fp8_block' on arch 90 "
               f"(fp8_block, or mxfp4, which becomes fp8_block at load there or, kept 4-bit, at each call), "
               f"got recipe {c.recipe!r}, which runs as {c.gemm_recipe!r} on arch {c.gemm_arch}")
        _check(c.activation.kind == "silu" and not c.activation.keep_fp32,
               f"MoEConfig.layout='fused' needs activation kind 'silu' (optional swiglu_limit), got {c.activation!r}")
        _check(not c.fuse_shared_experts,
               "MoEConfig.layout='fused' runs the shared experts beside the fused op; fuse_shared_experts must be False")
    if c.masked_m_pad is not None:
        _check(c.masked_m_pad >= 1 and c.masked_m_pad % 128 == 0,
               f"MoEConfig.masked_m_pad must be a positive multiple of 128, got {c.masked_m_pad}")
