"""A DeepSeek-V3/V4 `config.json` (Hugging Face form, as shipped beside the safetensors files) ->
the `MoEConfig` keyword arguments of one layer, and which layers are MoE, hash-MoE or dense.

    kinds = layer_kinds("/ckpt/DeepSeek-V3")          # ("dense", "dense", "dense", "moe", ...)
    config = MoEConfig.from_pretrained("/ckpt/DeepSeek-V3", layer=3)

Fields read (anything else in the file is ignored; a read field with a value this package cannot run
is a ValueError naming it):

    both       hidden_size, n_routed_experts, num_experts_per_tok, moe_intermediate_size,
               n_shared_experts, scoring_func (softmax | sigmoid | sqrtsoftplus), topk_method
               (noaux_tc: correction bias; group_limited_greedy; greedy), n_group, topk_group,
               norm_topk_prob, routed_scaling_factor, hidden_act (silu), swiglu_limit, vocab_size,
               quantization_config {quant_method fp8, fmt e4m3, weight_block_size [128, 128], scale_fmt}
    V3         num_hidden_layers, num_nextn_predict_layers (the MTP layers follow the rule below),
               first_k_dense_replace, moe_layer_freq: layer L is MoE iff L >= first_k_dense_replace
               and L % moe_layer_freq == 0, else dense
    V4         mlp_layer_types ("hash_moe" | "moe" per layer; transformers' form) or, in the
               release's form, num_hidden_layers + num_hash_layers (the first ones are hash_moe);
               expert_dtype (fp4 -> mxfp4, fp8 -> fp8_block, bf16; top level or in
               quantization_config) for the routed experts; without it, quantization_config decides

A hash-MoE layer routes by `tid2eid[token]` and has no correction bias. A V4 file is one with
`model_type` "deepseek_v4", `mlp_layer_types`, `num_hash_layers` or `expert_dtype`.

A routing key the file leaves out takes the value the model_type's reference implementation uses
(`DEFAULTS`): transformers' DeepseekV3Config writes no scoring_func / topk_method, because its model
always routes by sigmoid + e_score_correction_bias + grouped top-k, so reading such a file as
DeepSeek-V2 (softmax, greedy) would misroute it. Absent key ->

    model_type        scoring_func  topk_method  n_group  topk_group  norm_topk_prob  scaling  n_shared
    deepseek_v3, _v32 sigmoid       noaux_tc     8        4           True            2.5      1
    deepseek_v2       softmax       greedy       -        -           False           1.0      2
    V4 (see above)    sqrtsoftplus  noaux_tc     -        -           True            1.0      0
    none / other      softmax       greedy       -        -           False           1.0      0

(v2/v3/v32: transformers 5.25 DeepseekV*Config; "-": no grouping). `resolve_layer` also says which
values were assumed, so an explicit config that disagrees is told "no 'scoring_func' key; assumed
'sigmoid' as in transformers' deepseek_v3" rather than a value the file never states.
This module reads JSON only; it imports no other module of the package.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from custom_calls.activation import ActivationSpec

CONFIG_FILE = "config.json"
LAYER_KINDS = ("dense", "moe", "hash_moe")
_TOPK_METHODS = ("noaux_tc", "group_limited_greedy", "greedy")
_EXPERT_DTYPES = {"fp4": "mxfp4", "fp8": "fp8_block", "bf16": "bf16", "dense": "bf16"}

# The routing keys a config.json may leave out -> (who decides, the values used then), per model_type
# (module docstring); a V4 file uses "deepseek_v4", any other model_type _FALLBACK.
_V2 = dict(scoring_func="softmax", topk_method="greedy", n_group=None, topk_group=None, norm_topk_prob=False,
           routed_scaling_factor=1.0, n_shared_experts=2)
_V3 = dict(scoring_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True,
           routed_scaling_factor=2.5, n_shared_experts=1)
_FALLBACK = {**_V2, "n_shared_experts": 0}
DEFAULTS = {
    "deepseek_v3": ("transformers' deepseek_v3", _V3),
    "deepseek_v32": ("transformers' deepseek_v32", _V3),
    "deepseek_v2": ("transformers' deepseek_v2", _V2),
    "deepseek_v4": ("moe_jax's DeepSeek-V4 defaults", {**_FALLBACK, "scoring_func": "sqrtsoftplus",
                                                        "topk_method": "noaux_tc", "norm_topk_prob": True}),
}
# MoEConfig field -> the defaulted keys it is derived from (for saying where a value came from)
_FIELD_KEYS = {"scoring": ("scoring_func",), "use_correction_bias": ("topk_method",),
               "use_grouped_topk": ("topk_method", "n_group"), "n_group": ("n_group",),
               "topk_group": ("topk_group",), "norm_topk_prob": ("norm_topk_prob",),
               "routed_scaling_factor": ("routed_scaling_factor",), "n_shared_experts": ("n_shared_experts",)}


def read_config_json(path: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """`config.json` as a dict. path: the file, the directory holding it, or an already parsed dict."""
    if isinstance(path, Mapping):
        return dict(path)
    p = Path(path)
    if p.is_dir():
        p = p / CONFIG_FILE
    if not p.is_file():
        raise ValueError(f"path: no {CONFIG_FILE} at {p}")
    try:
        cfg = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{p}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def is_v4(cfg: Mapping[str, Any]) -> bool:
    """A DeepSeek-V4 config.json (module docstring)."""
    return (cfg.get("model_type") == "deepseek_v4" or "mlp_layer_types" in cfg
            or "num_hash_layers" in cfg or "expert_dtype" in cfg)


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None, minimum: int = 0) -> int:
    v = cfg.get(key, default)
    if v is None and default is None:
        raise ValueError(f"config.json: missing {key!r}")
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"config.json: {key} must be an int >= {minimum}, got {v!r}")
    return v


def layer_kinds(config_json: str | os.PathLike | Mapping[str, Any]) -> tuple[str, ...]:
    """The kind of every decoder layer, "dense" | "moe" | "hash_moe", indexed by layer number
    (V3: num_hidden_layers + num_nextn_predict_layers entries; V4: one per mlp_layer_types entry)."""
    cfg = read_config_json(config_json)
    if is_v4(cfg):
        types = cfg.get("mlp_layer_types")
        if types is None:
            n = _int(cfg, "num_hidden_layers", minimum=1)
            n_hash = _int(cfg, "num_hash_layers", 0)
            return tuple("hash_moe" if i < n_hash else "moe" for i in range(n))
        if not isinstance(types, list) or not types:
            raise ValueError(f"config.json: mlp_layer_types must be a non-empty list, got {types!r}")
        bad = sorted({t for t in types if t not in LAYER_KINDS}, key=str)
        if bad:
            raise ValueError(f"config.json: mlp_layer_types holds {bad}; expected values in {LAYER_KINDS}")
        return tuple(types)
    n = _int(cfg, "num_hidden_layers", minimum=1) + _int(cfg, "num_nextn_predict_layers", 0)
    if cfg.get("n_routed_experts") is None:
        return ("dense",) * n
    first = _int(cfg, "first_k_dense_replace", 0)
    freq = _int(cfg, "moe_layer_freq", 1, minimum=1)
    return tuple("moe" if i >= first and i % freq == 0 else "dense" for i in range(n))


def format_ranges(ids) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    ids = sorted(ids)
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ", ".join(out) or "none"


def describe_kinds(kinds: tuple[str, ...]) -> str:
    """ "moe: 3-60; dense: 0-2" for an error message."""
    return "; ".join(f"{k}: {format_ranges(i for i, x in enumerate(kinds) if x == k)}"
                     for k in ("moe", "hash_moe", "dense") if k in kinds)


def _recipe(cfg: Mapping[str, Any]) -> str:
    """The routed experts' checkpoint recipe: V4's expert_dtype (top level, or inside
    quantization_config), else the FP8 quantization_config, else bf16."""
    q = cfg.get("quantization_config")
    dt = cfg.get("expert_dtype")
    if dt is None and isinstance(q, dict):
        dt = q.get("expert_dtype")
    if is_v4(cfg) and dt is not None:
        if dt not in _EXPERT_DTYPES:
            raise ValueError(f"config.json: expert_dtype must be one of {sorted(_EXPERT_DTYPES)}, got {dt!r}")
        return _EXPERT_DTYPES[dt]
    if q is None:
        return "bf16"
    if not isinstance(q, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {q!r}")
    # scale_fmt "float": transformers' FineGrainedFP8Config's name for f32 block scales (the V3 form)
    checks = {"quant_method": ("fp8",), "fmt": ("e4m3",), "scale_fmt": (None, "ue8m0", "float")}
    for key, allowed in checks.items():
        if q.get(key, allowed[0]) not in allowed:
            raise ValueError(f"config.json: quantization_config.{key} must be one of {allowed}, got {q[key]!r}")
    block = q.get("weight_block_size", [128, 128])
    if list(block) != [128, 128]:
        raise ValueError(f"config.json: quantization_config.weight_block_size must be [128, 128], got {block!r}")
    return "fp8_block"


def _defaults(cfg: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(who decides, the values of absent routing keys) for this file's model_type (module docstring)."""
    mt = cfg.get("model_type")
    if is_v4(cfg):
        mt = "deepseek_v4"
    return DEFAULTS.get(mt, (f"DeepSeek-V2 (the fallback for model_type {mt!r})", _FALLBACK))


def moe_config_kwargs(config_json: str | os.PathLike | Mapping[str, Any], layer: int) -> dict[str, Any]:
    """`MoEConfig` keyword arguments of MoE layer `layer` (routing, sizes, activation, recipe).
    A dense layer or one past the last is a ValueError saying which layers are which."""
    return resolve_layer(config_json, layer)[0]


def resolve_layer(config_json: str | os.PathLike | Mapping[str, Any],
                  layer: int) -> tuple[dict[str, Any], dict[str, tuple[Any, str | None]]]:
    """(`moe_config_kwargs`, sources): sources maps each routing key with a default (`DEFAULTS`) to
    (value used, None) when config.json states it, or (value used, who decides) when it is absent,
    so a disagreement can quote the file or name the assumption (`describe`)."""
    cfg = read_config_json(config_json)
    kinds = layer_kinds(cfg)
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < len(kinds):
        raise ValueError(f"layer: expected an int in [0, {len(kinds)}) (config.json's layers: "
                         f"{describe_kinds(kinds)}), got {layer!r}")
    kind = kinds[layer]
    if kind == "dense":
        raise ValueError(f"layer: {layer} is a dense layer, not MoE (config.json's layers: {describe_kinds(kinds)})")
    v4 = is_v4(cfg)
    who, defaults = _defaults(cfg)
    sources = {k: (cfg[k], None) if k in cfg else (d, who) for k, d in defaults.items()}
    got = {k: v for k, (v, _) in sources.items()}
    method = got["topk_method"]
    if method not in _TOPK_METHODS:
        raise ValueError(f"config.json: topk_method must be one of {_TOPK_METHODS}, got {method!r}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act must be 'silu' (the gated SiLU experts), got {act!r}")
    n_group = got["n_group"] or 1
    grouped = method in ("noaux_tc", "group_limited_greedy") and n_group > 1
    hashed = kind == "hash_moe"
    limit = cfg.get("swiglu_limit")
    kw = dict(
        num_experts=_int(cfg, "n_routed_experts", minimum=1),
        top_k=_int(cfg, "num_experts_per_tok", minimum=1),
        hidden_size=_int(cfg, "hidden_size", minimum=1),
        intermediate_size=_int(cfg, "moe_intermediate_size", minimum=1),
        n_shared_experts=_int(got, "n_shared_experts") if got["n_shared_experts"] is not None else 0,
        scoring=got["scoring_func"],
        use_correction_bias=method == "noaux_tc" and not hashed,
        use_grouped_topk=grouped,
        n_group=n_group if grouped else 1,
        topk_group=(got["topk_group"] or 1) if grouped else 1,
        norm_topk_prob=bool(got["norm_topk_prob"]),
        routed_scaling_factor=float(got["routed_scaling_factor"]),
        hash_routing=hashed,
        vocab_size=_int(cfg, "vocab_size", minimum=1) if hashed or v4 else None,  # as the presets
        activation=ActivationSpec(kind="silu", swiglu_limit=None if limit is None else float(limit)),
        recipe=_recipe(cfg),
    )
    return kw, sources


def describe(name: str, value: Any, sources: Mapping[str, tuple[Any, str | None]] | None,
             hash_routing: bool = False) -> str:
    """How config.json decided MoEConfig field `name` (= `value`): the value, the keys it comes from
    as the file states them, and for an absent key the value assumed and who decides it, e.g.
    "no 'scoring_func' key; assumed 'sigmoid' as in transformers' deepseek_v3"."""
    src = sources or {}
    keys = () if name == "use_correction_bias" and hash_routing else _FIELD_KEYS.get(name, ())
    keys = [k for k in keys if k in src]
    parts = []
    for key in keys:
        v, who = src[key]
        if who is not None:
            parts.append(f"no {key!r} key; assumed {v!r} as in {who}")
        elif key != name:
            parts.append(f"{key}={v!r}")
    if len(keys) == 1 and parts and src[keys[0]][0] == value:
        return parts[0]  # the one key's value is the field's: no need to repeat it
    return "; ".join([repr(value)] + parts)


# MoEConfig fields a checkpoint's config.json decides (the rest — arch, layout, ... — are the user's)
COMPARED_FIELDS = ("num_experts", "top_k", "hidden_size", "intermediate_size", "n_shared_experts",
                   "scoring", "use_correction_bias", "use_grouped_topk", "n_group", "topk_group",
                   "norm_topk_prob", "routed_scaling_factor", "hash_routing", "vocab_size", "activation")


def disagreements(config: Any, kwargs: Mapping[str, Any],
                  sources: Mapping[str, tuple[Any, str | None]] | None = None) -> list[str]:
    """The fields of `config` (a MoEConfig) that differ from what config.json says (`kwargs` of
    `moe_config_kwargs`); n_group/topk_group only for grouped routing, vocab_size only for hash layers.
    With `sources` (of `resolve_layer`) each line quotes the file's keys or names the assumed default."""
    out = []
    for name in COMPARED_FIELDS:
        if name in ("n_group", "topk_group") and not kwargs["use_grouped_topk"]:
            continue
        if name == "vocab_size" and not kwargs["hash_routing"]:
            continue
        mine, theirs = getattr(config, name), kwargs[name]
        if name == "activation":
            mine, theirs = (mine.kind, mine.swiglu_limit), (theirs.kind, theirs.swiglu_limit)
        if mine != theirs:
            said = describe(name, theirs, sources, kwargs["hash_routing"])
            out.append(f"config.{name}={mine!r} disagrees with the checkpoint's config.json ({said})")
    return out
