"""DeepSeek-V4 and V3 checkpoints as they ship: the three tensor namings (detected), sharded files
with an index (only the needed shards' headers read), F32/BF16/F8_E8M0 scales for routed and shared
experts, hash layers without a bias, config.json for each family (`hf_config`,
`MoEConfig.from_pretrained`, `load_moe_params` / `MoE.from_pretrained` without a config), EP slices,
the fused layout through the Flax module (on a GPU: the fused kernel), and every bad input with its
message. Fixtures are written here (own writer for FP8 / E8M0, the
safetensors library for the rest); expected values come from the written numpy arrays."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import layouts
from moe_jax import MoEConfig, MoEParams, layer_kinds, moe_forward, prepare_params
from moe_jax.checkpoint import (MAX_LISTED, CheckpointError, SafetensorsCheckpoint, load_moe_layer,
                                load_moe_params, read_safetensors_header)
from moe_jax.hf_config import moe_config_kwargs
from test_checkpoint import write_st  # the suites' one safetensors writer

E, H, I, K_TOP, M, VOCAB = 6, 256, 128, 2, 19, 40
F8 = ml_dtypes.float8_e4m3fn
LEAVES = {"v3": ("model.layers.{L}.mlp.", "gate.e_score_correction_bias", ("gate_proj", "up_proj", "down_proj")),
          "v4": ("layers.{L}.ffn.", "gate.bias", ("w1", "w3", "w2")),
          "v4_hf": ("model.layers.{L}.ffn.", "gate.bias", ("w1", "w3", "w2"))}


def e8m0_to_f32(b):
    return np.ldexp(np.float32(1), b.astype(np.int32) - 127).astype(np.float32)


def block_scales(r, n, k, kind):
    """Random 128x128 block scales in `kind` -> (stored value, exact f32)."""
    shape = (-(-n // 128), -(-k // 128))
    if kind == "F8_E8M0":
        b = r.integers(118, 124, shape).astype(np.uint8)
        return (b, "F8_E8M0"), e8m0_to_f32(b)
    s = r.uniform(1e-3, 4e-3, shape).astype(np.float32)
    if kind == "BF16":
        s = s.astype(ml_dtypes.bfloat16)
    return s, s.astype(np.float32)


def mx_scales(r, n, k, kind):
    b = r.integers(120, 127, (n, k // 32)).astype(np.uint8)
    s = e8m0_to_f32(b)
    stored = {"F8_E8M0": (b, "F8_E8M0"), "U8": b, "F32": s, "BF16": s.astype(ml_dtypes.bfloat16)}[kind]
    return stored, s


def fp8_values(r, n, k):
    return r.normal(0, 30, (n, k)).clip(-448, 448).astype(F8)


def build_layer(naming="v4", layer=5, fmt="mxfp4", scale_kind="F8_E8M0", shared_scale="F8_E8M0",
                hashed=False, seed=0, scale_suffix=None, experts=E, hidden=H, inter=I):
    """Tensors of one layer in `naming` of `experts` experts, hidden size `hidden` and intermediate size
    `inter`, and the checkpoint-form arrays the loader must return (a dict of the MoEParams fields, from
    the written arrays)."""
    r = np.random.default_rng(seed)
    pre, bias_leaf, projs = LEAVES[naming]
    pre = pre.format(L=layer)
    suffix = scale_suffix or (".scale" if naming != "v3" else ".weight_scale_inv")
    t = {pre + "gate.weight": r.normal(0, hidden ** -0.5, (experts, hidden)).astype(ml_dtypes.bfloat16)}
    want = {"gate_weight": t[pre + "gate.weight"].astype(np.float32)}
    if hashed:
        t[pre + "gate.tid2eid"] = r.integers(0, experts, (VOCAB, K_TOP)).astype(np.int64)
        want["tid2eid"] = t[pre + "gate.tid2eid"].astype(np.int32)
    else:
        t[pre + bias_leaf] = r.normal(0, 0.1, experts).astype(np.float32)
        want["bias"] = t[pre + bias_leaf]
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    vals = {p: [] for p in projs}
    scs = {p: [] for p in projs}
    for e in range(experts):
        for p, (n, k) in zip(projs, shapes):
            base = f"{pre}experts.{e}.{p}"
            if fmt == "mxfp4":
                q = r.integers(-128, 128, (n, k // 2)).astype(np.int8)
                stored, s = mx_scales(r, n, k, scale_kind)
            else:
                q = fp8_values(r, n, k)
                stored, s = block_scales(r, n, k, scale_kind)
            t[base + ".weight"], t[base + suffix] = q, stored
            vals[p].append(q)
            scs[p].append(s)
    g, u, d = projs
    want["w13"] = np.concatenate([np.stack(vals[g]), np.stack(vals[u])], axis=1)
    want["w2"] = np.stack(vals[d])
    want["w13_scale"] = np.concatenate([np.stack(scs[g]), np.stack(scs[u])], axis=1)
    want["w2_scale"] = np.stack(scs[d])
    deq, sq, ss = {}, {}, {}
    for p, (n, k) in zip(projs, shapes):  # shared expert: FP8 with block scales
        sq[p] = fp8_values(r, n, k)
        stored, ss[p] = block_scales(r, n, k, shared_scale)
        t[f"{pre}shared_experts.{p}.weight"], t[f"{pre}shared_experts.{p}{suffix}"] = sq[p], stored
        full = np.repeat(np.repeat(ss[p], 128, 0), 128, 1)[:n, :k]
        deq[p] = (sq[p].astype(np.float32) * full).astype(ml_dtypes.bfloat16)  # one f32 product, then bf16
    # kept FP8 as it ships (the loader's default), and its bf16 dequantization (shared_fp8=False)
    want["shared_w13"], want["shared_w2"] = np.concatenate([sq[g], sq[u]], axis=0), sq[d]
    want["shared_w13_scale"], want["shared_w2_scale"] = np.concatenate([ss[g], ss[u]], axis=0), ss[d]
    want["shared_w13_bf16"], want["shared_w2_bf16"] = np.concatenate([deq[g], deq[u]], axis=0), deq[d]
    return t, want


def v4_config(recipe="mxfp4", hashed=False, **kw) -> MoEConfig:
    return MoEConfig.deepseek_v4(hash_routing=hashed).scaled(
        num_experts=E, top_k=K_TOP, hidden_size=H, intermediate_size=I, recipe=recipe,
        vocab_size=VOCAB, **kw)


def direct_params(want, config) -> MoEParams:
    j = jnp.asarray
    return MoEParams(gate_weight=j(want["gate_weight"]), w13=j(want["w13"]), w2=j(want["w2"]),
                     w13_scale=j(want["w13_scale"]), w2_scale=j(want["w2_scale"]),
                     e_score_correction_bias=j(want["bias"]) if "bias" in want else None,
                     shared_w13=j(want["shared_w13"]), shared_w2=j(want["shared_w2"]),
                     shared_w13_scale=j(want["shared_w13_scale"]), shared_w2_scale=j(want["shared_w2_scale"]),
                     tid2eid=j(want["tid2eid"]) if "tid2eid" in want else None)


def assert_bits(got, want):
    got = np.asarray(got)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(want).view(np.uint8))


def assert_checkpoint_form(p: MoEParams, want):
    assert_bits(p.w13, want["w13"])
    assert_bits(p.w2, want["w2"])
    assert_bits(p.w13_scale, want["w13_scale"])
    assert_bits(p.w2_scale, want["w2_scale"])
    assert_bits(p.gate_weight, want["gate_weight"])
    assert_bits(p.shared_w13, want["shared_w13"])
    assert_bits(p.shared_w2, want["shared_w2"])
    assert_bits(p.shared_w13_scale, want["shared_w13_scale"])
    assert_bits(p.shared_w2_scale, want["shared_w2_scale"])
    if "bias" in want:
        assert_bits(p.e_score_correction_bias, want["bias"])
    else:
        assert p.e_score_correction_bias is None
    if "tid2eid" in want:
        assert_bits(p.tid2eid, want["tid2eid"])


def forward(params, config, token_ids=None):
    x = jnp.asarray(np.random.default_rng(7).normal(0, 1, (M, H)), jnp.bfloat16)
    f = jax.jit(moe_forward, static_argnames=("config",))
    return np.asarray(f(x, params, config=config, token_ids=token_ids).astype(jnp.float32))


def err(fn) -> str:
    with pytest.raises(CheckpointError) as ei:
        fn()
    return str(ei.value)


# -- namings, formats, scale dtypes --------------------------------------------------------------

@pytest.mark.parametrize("naming", ["v3", "v4", "v4_hf"])
def test_each_naming_is_detected_and_loads_bit_exactly(tmp_path, naming):
    t, want = build_layer(naming, fmt="mxfp4")
    write_st(tmp_path / "m.safetensors", t)
    cfg = v4_config()
    p = load_moe_params(tmp_path, cfg, layer=5, prepare=False)
    assert_checkpoint_form(p, want)
    y = forward(p, cfg)
    assert np.isfinite(y).all() and np.abs(y).max() > 0
    np.testing.assert_array_equal(y, forward(direct_params(want, cfg), cfg))  # same weights: exact


@pytest.mark.parametrize("suffix", [".scale", ".weight_scale_inv", ".weight_scale"])
@pytest.mark.parametrize("kind", ["F32", "BF16", "F8_E8M0"])
def test_fp8_block_scale_dtypes_and_names(tmp_path, kind, suffix):
    t, want = build_layer("v4", fmt="fp8_block", scale_kind=kind, shared_scale=kind, scale_suffix=suffix)
    write_st(tmp_path / "m.safetensors", t)
    cfg = v4_config("fp8_block")
    p = load_moe_params(tmp_path, cfg, layer=5, prepare=False)
    assert_checkpoint_form(p, want)


@pytest.mark.parametrize("kind", ["F8_E8M0", "U8", "F32", "BF16"])
def test_mx_scale_dtypes(tmp_path, kind):
    t, want = build_layer("v4_hf", fmt="mxfp4", scale_kind=kind, shared_scale="BF16")
    write_st(tmp_path / "m.safetensors", t)
    assert_checkpoint_form(load_moe_params(tmp_path, v4_config(), layer=5, prepare=False), want)


def test_power_of_two_block_scales_feed_the_arch100_image_unchanged(tmp_path):
    """E8M0 block scales, every block holding a +-448 value: the arch-100 requantization (path C)
    keeps every FP8 byte and every scale byte (the packed UE8M0 image holds the written bytes)."""
    t, want = build_layer("v4", fmt="fp8_block", scale_kind="F8_E8M0")
    pre = "layers.5.ffn."
    for name in [k for k in t if ".experts." in k and k.endswith(".weight")]:
        q = t[name].astype(np.float32)
        q[::128, ::128] = 448.0  # the first element of every 128x128 block
        t[name] = q.astype(F8)
    write_st(tmp_path / "m.safetensors", t)
    cfg = v4_config("fp8_block", arch=100)
    p = load_moe_params(tmp_path, cfg, layer=5, arch=100)
    g = [np.stack([t[f"{pre}experts.{e}.{leaf}.weight"] for e in range(E)]) for leaf in ("w1", "w3", "w2")]
    assert_bits(p.w13, np.concatenate(g[:2], axis=1))
    assert_bits(p.w2, g[2])
    for img, s, n, k in ((p.w13_scale, want["w13_scale"], 2 * I, H), (p.w2_scale, want["w2_scale"], H, I)):
        rows = np.asarray(layouts.unpack_ue8m0_mn_major_tma_aligned(img, n, k // 128))  # (E, N, K/128)
        assert_bits(rows, np.repeat(s, 128, axis=1))


# -- sharded files, index ------------------------------------------------------------------------

def test_sharded_index_reads_only_the_needed_headers(tmp_path):
    t, want = build_layer("v4_hf", fmt="mxfp4")
    names = sorted(t)
    shards = [names[0::2], names[1::2]]
    weight_map = {}
    for si, part in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-00003.safetensors"
        write_st(tmp_path / fname, {k: t[k] for k in part})
        weight_map.update({k: fname for k in part})
    (tmp_path / "model-00003-of-00003.safetensors").write_bytes(b"garbage, never opened")
    weight_map["model.layers.9.ffn.gate.weight"] = "model-00003-of-00003.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert ckpt.headers_read == 0
    p = load_moe_params(ckpt, v4_config(), layer=5, prepare=False)
    assert ckpt.headers_read == 2  # the third shard holds only another layer
    assert_checkpoint_form(p, want)


def test_library_writer_bf16_v4_names(tmp_path):
    from safetensors.numpy import save_file

    r = np.random.default_rng(3)
    pre = "layers.5.ffn."
    t = {pre + "gate.weight": r.normal(0, 0.05, (E, H)).astype(np.float32),
         pre + "gate.bias": r.normal(0, 0.1, E).astype(np.float32)}
    for e in range(E):
        for leaf, shp in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            t[f"{pre}experts.{e}.{leaf}.weight"] = r.normal(0, 0.05, shp).astype(np.float32)
    for leaf, shp in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
        t[f"{pre}shared_experts.{leaf}.weight"] = r.normal(0, 0.05, shp).astype(np.float32)
    save_file(t, str(tmp_path / "model.safetensors"))
    p = load_moe_params(tmp_path, v4_config("bf16"), layer=5, prepare=False)
    want = np.stack([t[f"{pre}experts.{e}.w2.weight"] for e in range(E)]).astype(ml_dtypes.bfloat16)
    assert_bits(p.w2, want)
    w1 = t[f"{pre}experts.4.w1.weight"].astype(ml_dtypes.bfloat16)
    assert_bits(np.asarray(p.w13)[4, :I], w1)


def test_expert_range_reads_an_ep_slice(tmp_path):
    t, want = build_layer("v4", fmt="mxfp4")
    write_st(tmp_path / "m.safetensors", t)
    p = load_moe_params(tmp_path, v4_config(), layer=5, expert_range=(2, 5), prepare=False)
    assert_bits(p.w13, want["w13"][2:5])
    assert_bits(p.w2_scale, want["w2_scale"][2:5])
    assert_bits(p.gate_weight, want["gate_weight"])  # the router stays whole


# -- hash layers ---------------------------------------------------------------------------------

def test_v4_hash_preset_has_no_bias():
    cfg = MoEConfig.deepseek_v4(hash_routing=True)
    assert cfg.hash_routing and not cfg.use_correction_bias and cfg.vocab_size == 129280
    assert MoEConfig.deepseek_v4().use_correction_bias


def test_hash_layer_without_bias_loads_and_routes_by_token(tmp_path):
    t, want = build_layer("v4", layer=1, fmt="mxfp4", hashed=True)
    assert not any(k.endswith("gate.bias") for k in t)
    write_st(tmp_path / "m.safetensors", t)
    cfg = v4_config(hashed=True)
    p = load_moe_params(tmp_path, cfg, layer=1, prepare=False)
    assert_checkpoint_form(p, want)
    tok = jnp.asarray(np.random.default_rng(2).integers(0, VOCAB, M), jnp.int32)
    np.testing.assert_array_equal(forward(p, cfg, tok), forward(direct_params(want, cfg), cfg, tok))
    msg = err(lambda: load_moe_params(tmp_path, cfg.scaled(use_correction_bias=True), layer=1))
    assert "config.use_correction_bias=True on a hash-routed layer" in msg


# -- config.json ---------------------------------------------------------------------------------

def v3_json(**kw):
    """DeepSeek-V3's config.json MoE fields (the released values)."""
    base = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168,
                intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
                num_experts_per_tok=8, n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid",
                norm_topk_prob=True, routed_scaling_factor=2.5, num_hidden_layers=61,
                num_nextn_predict_layers=1, first_k_dense_replace=3, moe_layer_freq=1, hidden_act="silu",
                vocab_size=129280, quantization_config=dict(activation_scheme="dynamic", fmt="e4m3",
                                                            quant_method="fp8", weight_block_size=[128, 128]))
    base.update(kw)
    return base


def v4_json(**kw):
    """DeepSeek-V4's config.json MoE fields (release form: num_hash_layers, expert_dtype)."""
    base = dict(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", hidden_size=4096,
                moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=6,
                topk_method="noaux_tc", scoring_func="sqrtsoftplus", norm_topk_prob=True,
                routed_scaling_factor=1.5, swiglu_limit=10.0, num_hidden_layers=43, num_hash_layers=3,
                hidden_act="silu", vocab_size=129280, expert_dtype="fp4",
                quantization_config=dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8",
                                         weight_block_size=[128, 128], scale_fmt="ue8m0"))
    base.update(kw)
    return base


def test_released_configs_match_the_presets(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(v3_json()))
    assert MoEConfig.from_pretrained(tmp_path, layer=3) == MoEConfig.deepseek_v3()
    assert MoEConfig.from_pretrained(v4_json(), layer=0) == MoEConfig.deepseek_v4(hash_routing=True)
    assert MoEConfig.from_pretrained(v4_json(), layer=3) == MoEConfig.deepseek_v4()
    assert MoEConfig.from_pretrained(v4_json(), layer=3, arch=100).arch == 100
    base = MoEConfig.from_pretrained(v4_json(expert_dtype=None), layer=3)  # Flash-Base: FP8 experts
    assert base.recipe == "fp8_block"
    nested = v4_json(expert_dtype=None)
    nested["quantization_config"]["expert_dtype"] = "fp4"
    assert MoEConfig.from_pretrained(nested, layer=3).recipe == "mxfp4"
    assert MoEConfig.from_pretrained(v3_json(quantization_config=None), layer=3).recipe == "bf16"


def test_layer_kinds():
    assert layer_kinds(v3_json()) == ("dense",) * 3 + ("moe",) * 59  # 61 layers + the MTP layer
    assert layer_kinds(v3_json(moe_layer_freq=2, first_k_dense_replace=1, num_hidden_layers=5,
                               num_nextn_predict_layers=0)) == ("dense", "dense", "moe", "dense", "moe")
    assert layer_kinds(v4_json()) == ("hash_moe",) * 3 + ("moe",) * 40
    hf = v4_json(mlp_layer_types=["hash_moe", "moe", "moe"])  # transformers' form wins
    assert layer_kinds(hf) == ("hash_moe", "moe", "moe")


@pytest.mark.parametrize("bad, msg", [
    (dict(topk_method="magic"), "topk_method must be one of"),
    (dict(mlp_layer_types=["moe", "sparse"]), "mlp_layer_types holds ['sparse']"),
    (dict(expert_dtype="int4"), "expert_dtype must be one of"),
    (dict(hidden_act="gelu"), "hidden_act must be 'silu'"),
    (dict(expert_dtype=None, quantization_config=dict(fmt="e4m3", weight_block_size=[1, 128])),
     "quantization_config.weight_block_size must be [128, 128]"),
    (dict(n_routed_experts=None), "missing 'n_routed_experts'"),
])
def test_bad_config_json(bad, msg):
    with pytest.raises(ValueError) as ei:
        moe_config_kwargs(v4_json(**bad), 4)
    assert msg in str(ei.value)


def test_dense_layer_or_past_the_end_names_the_kinds():
    with pytest.raises(ValueError, match=r"layer: 1 is a dense layer, not MoE \(config.json's layers: "
                                         r"moe: 3-61; dense: 0-2\)"):
        MoEConfig.from_pretrained(v3_json(), layer=1)
    with pytest.raises(ValueError, match=r"layer: expected an int in \[0, 43\)"):
        MoEConfig.from_pretrained(v4_json(), layer=43)


def small_json(family: str, experts=E, hidden=H, inter=I) -> dict:
    size = dict(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                num_experts_per_tok=K_TOP, vocab_size=VOCAB)
    if family == "v3":
        return v3_json(n_group=2, topk_group=1, num_hidden_layers=8, **size)
    return v4_json(num_hidden_layers=8, **size)


def test_load_without_a_config(tmp_path):
    from moe_jax.nn import MoE

    t, want = build_layer("v4", layer=5, fmt="mxfp4")
    t1, want1 = build_layer("v4", layer=1, fmt="mxfp4", hashed=True, seed=1)
    write_st(tmp_path / "model.safetensors", {**t, **t1})
    (tmp_path / "config.json").write_text(json.dumps(small_json("v4")))
    config, p = load_moe_layer(tmp_path, layer=5, prepare=False)
    assert config == MoEConfig.from_pretrained(tmp_path, layer=5)
    assert config.scoring == "sqrtsoftplus" and config.activation.swiglu_limit == 10.0
    assert_checkpoint_form(p, want)
    p1 = load_moe_params(tmp_path, layer=1, prepare=False)  # the hash layer: no bias asked for
    assert_checkpoint_form(p1, want1)
    moe = MoE.from_pretrained(tmp_path, layer=5, arch=90, backend="reference")
    assert moe.config == config.scaled(arch=90)
    x = jnp.asarray(np.random.default_rng(7).normal(0, 1, (M, H)), jnp.bfloat16)
    y = np.asarray(moe(x).astype(jnp.float32))
    ref = forward(direct_params(want, config), moe.config)  # the same weights given directly
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(y, ref)  # both convert with the same load-time path


def test_v4_checkpoint_runs_the_fused_layout_through_the_flax_module(tmp_path):
    """A V4 checkpoint (MXFP4 experts) loads into `MoE` with a fused-layout config on arch 90: the
    module keeps the interleaved w13 (w13_interleave) and runs the fused op, the routed layer and
    the hash-routed one, as moe_forward does on the same prepared params."""
    from moe_jax.nn import MoE

    t, want = build_layer("v4", layer=5, fmt="mxfp4")
    t1, want1 = build_layer("v4", layer=1, fmt="mxfp4", hashed=True, seed=1)
    write_st(tmp_path / "model.safetensors", {**t, **t1})
    (tmp_path / "config.json").write_text(json.dumps(small_json("v4")))
    tok = jnp.asarray(np.random.default_rng(3).integers(0, VOCAB, (M,)), jnp.int32)
    for layer, w in ((5, want), (1, want1)):
        cfg = MoEConfig.from_pretrained(tmp_path, layer=layer, arch=90, layout="fused")
        moe = MoE.from_pretrained(tmp_path, layer=layer, config=cfg, backend="reference")
        assert moe.config == cfg and moe.w13_interleave == 8 and moe.moe_params().w13_interleave == 8
        token_ids = tok if cfg.hash_routing else None
        x = jnp.asarray(np.random.default_rng(7).normal(0, 1, (M, H)), jnp.bfloat16)
        y = np.asarray(moe(x, token_ids=token_ids).astype(jnp.float32))
        np.testing.assert_array_equal(y, forward(prepare_params(direct_params(w, cfg), cfg), cfg, token_ids))
        staged = forward(direct_params(w, cfg.scaled(layout="contig")), cfg.scaled(layout="contig"), token_ids)
        assert np.linalg.norm(y - staged) / np.linalg.norm(staged) < 5e-2


@pytest.mark.gpu
def test_v4_checkpoint_runs_the_fused_kernel_through_the_flax_module_on_gpu(tmp_path, fused_op_choices):
    """On an SM90 GPU: a V4 checkpoint (MXFP4 experts, FP8 after loading) at sizes the fused kernel
    takes, through `MoE.from_pretrained` with a fused-layout config on backend "auto": the registry
    picks the fused kernel for the routed layer and the hash-routed one, and each agrees with the same
    module on the reference backend."""
    from moe_jax.nn import MoE

    sizes = dict(experts=16, hidden=1024, inter=512)  # the kernel: hidden % 512, intermediate % 256
    t, _ = build_layer("v4", layer=5, fmt="mxfp4", **sizes)
    t1, _ = build_layer("v4", layer=1, fmt="mxfp4", hashed=True, seed=1, **sizes)
    write_st(tmp_path / "model.safetensors", {**t, **t1})
    (tmp_path / "config.json").write_text(json.dumps(small_json("v4", **sizes)))
    chosen = fused_op_choices
    tok = jnp.asarray(np.random.default_rng(3).integers(0, VOCAB, (M,)), jnp.int32)
    x = jnp.asarray(np.random.default_rng(7).normal(0, 1, (M, sizes["hidden"])), jnp.bfloat16)
    for layer in (5, 1):
        cfg = MoEConfig.from_pretrained(tmp_path, layer=layer, arch=90, layout="fused")
        token_ids = tok if cfg.hash_routing else None
        y = {}
        for backend in ("auto", "reference"):
            moe = MoE.from_pretrained(tmp_path, layer=layer, config=cfg, backend=backend)
            assert moe.w13_interleave == 8
            chosen.clear()
            y[backend] = np.asarray(moe(x, token_ids=token_ids).astype(jnp.float32))
            # the loaded gate is fp32: the layer routes first, then calls the fused op
            assert chosen == ([] if backend == "reference" else [("fused_moe", "deep_gemm")]), chosen
        assert np.isfinite(y["auto"]).all() and (np.abs(y["auto"]).max(1) > 0).all()
        assert np.linalg.norm(y["auto"] - y["reference"]) / np.linalg.norm(y["reference"]) < 2e-2, layer


def test_v3_family_without_a_config(tmp_path):
    t, want = build_layer("v3", layer=3, fmt="fp8_block", scale_kind="F32", shared_scale="F32")
    write_st(tmp_path / "model.safetensors", t)
    (tmp_path / "config.json").write_text(json.dumps(small_json("v3")))
    config, p = load_moe_layer(tmp_path, layer=3, prepare=False)
    assert config.recipe == "fp8_block" and config.use_grouped_topk and config.n_group == 2
    assert_checkpoint_form(p, want)
    np.testing.assert_array_equal(forward(p, config), forward(direct_params(want, config), config))


def test_explicit_config_that_disagrees_names_the_field(tmp_path):
    t, _ = build_layer("v4", layer=5, fmt="mxfp4")
    write_st(tmp_path / "model.safetensors", t)
    (tmp_path / "config.json").write_text(json.dumps(small_json("v4")))
    msg = err(lambda: load_moe_params(tmp_path, v4_config(routed_scaling_factor=2.5), layer=5))
    assert "config.routed_scaling_factor=2.5 disagrees with the checkpoint's config.json (1.5)" in msg
    msg = err(lambda: load_moe_params(tmp_path, v4_config().scaled(top_k=3), layer=5))
    assert "config.top_k=3 disagrees with the checkpoint's config.json (2)" in msg
    load_moe_params(tmp_path, v4_config(), layer=5, prepare=False)  # the agreeing one loads


# -- errors a user can act on --------------------------------------------------------------------

def test_dense_layer_and_missing_layer_say_what_the_files_hold(tmp_path):
    t, _ = build_layer("v3", layer=3, fmt="fp8_block", scale_kind="F32", shared_scale="F32")
    t["model.layers.1.mlp.gate_proj.weight"] = np.zeros((8, H), np.float32)  # a dense layer's MLP
    write_st(tmp_path / "model.safetensors", t)
    (tmp_path / "config.json").write_text(json.dumps(small_json("v3")))
    msg = err(lambda: load_moe_params(tmp_path, layer=1))
    assert ("layer 1 is a dense layer; config.json's layers: moe: 3-8; dense: 0-2; the files hold "
            "layers 1, 3, MoE routers in 3") in msg
    msg = err(lambda: load_moe_params(tmp_path, layer=12))
    assert "layer 12 is not a layer of this model (9 layers)" in msg
    msg = err(lambda: load_moe_params(tmp_path, layer=4))  # MoE by config.json, absent from the files
    assert ("no tensor of layer 4 under any known naming (model.layers.4.mlp., layers.4.ffn., "
            "model.layers.4.ffn.); the files hold layers 1, 3, with a MoE router (gate.weight) in layers 3; "
            "config.json's layers: moe: 3-8; dense: 0-2") in msg
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="config: the checkpoint has no config.json beside its files"):
        load_moe_params(tmp_path, layer=3)
    msg = err(lambda: load_moe_params(tmp_path, v4_config("fp8_block"), layer=1))  # no config.json to ask
    assert ("missing model.layers.1.mlp.gate.weight: layer 1 has no MoE router in the files (a dense "
            "layer?); MoE routers are in layers 3") in msg


def test_missing_tensor_list_is_capped(tmp_path):
    t, _ = build_layer("v4", fmt="mxfp4")
    t = {k: v for k, v in t.items() if ".experts." not in k}  # 6 experts x 3 projections missing
    write_st(tmp_path / "m.safetensors", t)
    cfg = v4_config()
    msg = err(lambda: load_moe_params(tmp_path, cfg, layer=5))
    assert "18 problem(s)" in msg and "... and" not in msg
    msg = err(lambda: load_moe_params(tmp_path, cfg.scaled(num_experts=12, top_k=2), layer=5))
    assert "38 problem(s)" in msg  # 36 projections + the router's and the bias's shapes
    assert msg.count("\n  ") == MAX_LISTED + 1
    assert msg.endswith(f"... and {38 - MAX_LISTED} more")


@pytest.mark.parametrize("where", ["experts.2.w3", "shared_experts.w2"])
def test_e8m0_nan_byte_names_the_tensor(tmp_path, where):
    t, _ = build_layer("v4", fmt="fp8_block", scale_kind="F8_E8M0")
    name = f"layers.5.ffn.{where}.scale"
    b = t[name][0].copy()
    b[0, 0] = 255
    t[name] = (b, "F8_E8M0")
    write_st(tmp_path / "m.safetensors", t)
    msg = err(lambda: load_moe_params(tmp_path, v4_config("fp8_block"), layer=5))
    assert "1 problem(s)" in msg
    assert f"{name}: 1 scale byte(s) are 0 or 255 (E8M0 2^-127 / NaN are not usable scales" in msg


def test_truncated_file(tmp_path):
    t, _ = build_layer("v4", fmt="mxfp4")
    write_st(tmp_path / "m.safetensors", t)
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[:-1000])
    with pytest.raises(ValueError, match="truncated: tensor .* ends at byte"):
        read_safetensors_header(tmp_path / "m.safetensors")
    (tmp_path / "m.safetensors").write_bytes(data[:100])
    with pytest.raises(ValueError, match="truncated or not a safetensors file: header length"):
        load_moe_params(tmp_path, v4_config(), layer=5)


def test_explicit_prefix_detects_v4_leaves(tmp_path):
    t, want = build_layer("v4", fmt="mxfp4")
    t = {"backbone." + k: v for k, v in t.items()}
    write_st(tmp_path / "m.safetensors", t)
    p = load_moe_params(tmp_path, v4_config(), prefix="backbone.layers.5.ffn.", prepare=False)
    assert_checkpoint_form(p, want)


def test_index_and_header_that_disagree(tmp_path):
    t, _ = build_layer("v4", fmt="mxfp4")
    write_st(tmp_path / "a.safetensors", t)
    weight_map = {k: "a.safetensors" for k in t}
    weight_map["layers.5.ffn.experts.0.w1.weight"] = "b.safetensors"
    write_st(tmp_path / "b.safetensors", {"other": np.zeros(3, np.float32)})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match="model.safetensors.index.json places tensor "
                                         "'layers.5.ffn.experts.0.w1.weight' in .*b.safetensors, whose "
                                         "header does not have it"):
        load_moe_params(tmp_path, v4_config(), layer=5)


def test_two_namings_for_one_layer_and_prefix_without_config(tmp_path):
    t, _ = build_layer("v4", fmt="mxfp4")
    t3, _ = build_layer("v3", fmt="mxfp4")
    write_st(tmp_path / "m.safetensors", {**t, **t3})
    msg = err(lambda: load_moe_params(tmp_path, v4_config(), layer=5))
    assert ("tensors of layer 5 under more than one naming (model.layers.5.mlp., layers.5.ffn.); "
            "pass prefix= to pick one") in msg
    load_moe_params(tmp_path, v4_config(), prefix="layers.5.ffn.", prepare=False)
    (tmp_path / "config.json").write_text(json.dumps(small_json("v4")))
    with pytest.raises(ValueError, match="config: required with prefix="):
        load_moe_params(tmp_path, prefix="layers.5.ffn.")
