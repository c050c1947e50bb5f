"""config.json files as transformers writes them: DeepseekV3Config states no scoring_func /
topk_method (its model always routes by sigmoid + correction bias + grouped top-k), DeepseekV2Config
no scoring_func (softmax), DeepseekV4Config no topk_method. The dicts below are written out by hand
from transformers 5.25.0 (`DeepseekV{2,3,4}Config().save_pretrained(...)`, i.e. `to_diff_dict()`,
and `FineGrainedFP8Config.to_dict()` for a quantization_config it re-saves); none comes from the
code under test."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_jax import MoEConfig
from moe_jax.checkpoint import CheckpointError, load_moe_layer
from moe_jax.hf_config import disagreements, moe_config_kwargs, resolve_layer
from test_checkpoint import E, H, I, K_TOP, P, build, check_forward, config, write_st  # the suites' writer

# transformers 5.25.0: DeepseekV3Config().save_pretrained(d) -> d/config.json
V3 = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
    "first_k_dense_replace": 3, "head_dim": 64, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 4096, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "output_router_logits": False, "pad_token_id": None, "pretraining_tp": 1,
    "q_lora_rank": 1536, "qk_head_dim": 192, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_interleave": True,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "topk_group": 4,
    "transformers_version": "5.25.0", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
# the DeepSeek-V3 release's quantization_config (kept as is by DeepseekV3Config(quantization_config=...))
RELEASE_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
               "weight_block_size": [128, 128]}
# ... and as transformers re-saves it after loading the model (FineGrainedFP8Config.to_dict())
TRANSFORMERS_FP8 = {"activation_scheme": "dynamic", "dequantize": False, "expert_dtype": "fp8",
                    "modules_to_convert": None, "modules_to_not_convert": None, "quant_method": "fp8",
                    "scale_fmt": "float", "weight_block_size": [128, 128]}

# transformers 5.25.0: DeepseekV2Config(num_experts_per_tok=6).save_pretrained(d) (its default is null)
V2 = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "first_k_dense_replace": 0, "head_dim": 64, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 11008, "kv_lora_rank": 512,
    "max_position_embeddings": 2048, "mlp_bias": False, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1407,
    "n_group": None, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 32, "num_experts_per_tok": 6, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "output_router_logits": False, "pad_token_id": None, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_head_dim": 192, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": None, "topk_method": "greedy",
    "transformers_version": "5.25.0", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}

# transformers 5.25.0: DeepseekV4Config().save_pretrained(d) (layer_types: 3 HCA, then CSA / HCA in turn)
V4 = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "compress_rope_theta": 160000.0, "eos_token_id": 1, "hc_eps": 1e-06, "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128, "index_n_heads": 64,
    "index_topk": 512, "initializer_range": 0.02,
    "layer_types": ["heavily_compressed_attention"] * 3
    + ["compressed_sparse_attention", "heavily_compressed_attention"] * 20,
    "max_position_embeddings": 1048576, "mlp_bias": False, "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * 40,
    "model_type": "deepseek_v4", "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43,
    "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024,
    "output_router_logits": False, "pad_token_id": None, "partial_rotary_factor": 0.125, "q_lora_rank": 1024,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "compress": {"partial_rotary_factor": 0.125, "rope_theta": 160000.0, "rope_type": "default"},
        "main": {"partial_rotary_factor": 0.125, "rope_theta": 10000.0, "rope_type": "default"}},
    "rope_theta": 10000.0, "routed_scaling_factor": 1.5, "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0,
    "scoring_func": "sqrtsoftplus", "sliding_window": 128, "swiglu_limit": 10.0, "tie_word_embeddings": False,
    "transformers_version": "5.25.0", "use_cache": True, "vocab_size": 129280,
}
# FineGrainedFP8Config(expert_dtype="fp4", scale_fmt="ue8m0").to_dict(): V4's FP4 experts
V4_FP8 = {**TRANSFORMERS_FP8, "expert_dtype": "fp4", "scale_fmt": "ue8m0"}

# test_checkpoint's layer (E experts, H, I, top-K_TOP, layer 3) in the V3 form transformers writes:
# DeepseekV3Config(hidden_size=H, ..., n_group=1, topk_group=1, num_hidden_layers=4) has the same keys
SMALL_V3 = {**V3, "hidden_size": H, "moe_intermediate_size": I, "n_routed_experts": E,
            "num_experts_per_tok": K_TOP, "n_group": 1, "topk_group": 1, "num_hidden_layers": 4,
            "quantization_config": RELEASE_FP8}


def test_fixtures_state_no_routing_method():
    assert "scoring_func" not in V3 and "topk_method" not in V3
    assert "scoring_func" not in V2 and V2["topk_method"] == "greedy"
    assert "topk_method" not in V4 and len(V4["layer_types"]) == len(V4["mlp_layer_types"]) == 43


@pytest.mark.parametrize("quant, recipe", [(None, "bf16"), (RELEASE_FP8, "fp8_block"),
                                           (TRANSFORMERS_FP8, "fp8_block")])
def test_transformers_v3_routes_by_sigmoid_bias_and_groups(tmp_path, quant, recipe):
    d = V3 if quant is None else {**V3, "quantization_config": quant}
    (tmp_path / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True))
    c = MoEConfig.from_pretrained(tmp_path, layer=3)
    assert (c.scoring, c.use_correction_bias, c.use_grouped_topk, c.n_group, c.topk_group) == \
        ("sigmoid", True, True, 8, 4)
    assert c == MoEConfig.deepseek_v3(recipe=recipe)
    grouped = MoEConfig.from_pretrained({**d, "n_group": 4, "topk_group": 2}, layer=3)  # the file's groups
    assert (grouped.use_grouped_topk, grouped.n_group, grouped.topk_group) == (True, 4, 2)


def test_transformers_v3_keys_absent_take_its_defaults():
    d = {k: v for k, v in V3.items() if k not in ("n_group", "topk_group", "norm_topk_prob",
                                                  "routed_scaling_factor", "n_shared_experts")}
    assert MoEConfig.from_pretrained(d, layer=3) == MoEConfig.deepseek_v3(recipe="bf16")
    _, sources = resolve_layer(d, 3)
    assert sources["scoring_func"] == ("sigmoid", "transformers' deepseek_v3")
    assert sources["n_group"] == (8, "transformers' deepseek_v3")
    assert sources["routed_scaling_factor"] == (2.5, "transformers' deepseek_v3")
    v32 = MoEConfig.from_pretrained({**V3, "model_type": "deepseek_v32"}, layer=3)  # the same router
    assert v32 == MoEConfig.deepseek_v3(recipe="bf16")


def test_stated_scoring_and_method_win():
    c = MoEConfig.from_pretrained({**V3, "scoring_func": "softmax", "topk_method": "greedy"}, layer=3)
    assert (c.scoring, c.use_correction_bias, c.use_grouped_topk) == ("softmax", False, False)
    c = MoEConfig.from_pretrained({**V3, "scoring_func": "softmax"}, layer=3)  # method still V3's
    assert (c.scoring, c.use_correction_bias, c.use_grouped_topk) == ("softmax", True, True)
    release = {**V3, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
    assert MoEConfig.from_pretrained(release, layer=3) == MoEConfig.deepseek_v3(recipe="bf16")
    _, sources = resolve_layer(release, 3)
    assert sources["scoring_func"] == ("sigmoid", None) and sources["topk_method"] == ("noaux_tc", None)


def test_transformers_v2_routes_by_softmax_greedy():
    kw = moe_config_kwargs(V2, 1)
    assert (kw["scoring"], kw["use_correction_bias"], kw["use_grouped_topk"]) == ("softmax", False, False)
    assert (kw["norm_topk_prob"], kw["routed_scaling_factor"], kw["n_shared_experts"]) == (False, 1.0, 2)
    no_method = {k: v for k, v in V2.items() if k != "topk_method"}
    assert moe_config_kwargs(no_method, 1) == kw
    _, sources = resolve_layer(no_method, 1)
    assert sources["topk_method"] == ("greedy", "transformers' deepseek_v2")
    grouped = moe_config_kwargs({**V2, "topk_method": "group_limited_greedy", "n_group": 8,
                                 "topk_group": 3}, 1)
    assert (grouped["scoring"], grouped["use_grouped_topk"], grouped["n_group"]) == ("softmax", True, 8)
    # no model_type at all: DeepSeek-V2 routing, as before
    bare = {k: v for k, v in no_method.items() if k not in ("model_type", "n_shared_experts")}
    kw0 = moe_config_kwargs(bare, 1)
    assert (kw0["scoring"], kw0["use_correction_bias"], kw0["n_shared_experts"]) == ("softmax", False, 0)
    fallback = "DeepSeek-V2 (the fallback for model_type None)"
    assert resolve_layer(bare, 1)[1]["scoring_func"] == ("softmax", fallback)


@pytest.mark.parametrize("quant, recipe", [(None, "bf16"), (V4_FP8, "mxfp4")])
def test_transformers_v4(quant, recipe):
    d = V4 if quant is None else {**V4, "quantization_config": quant}
    assert MoEConfig.from_pretrained(d, layer=3) == MoEConfig.deepseek_v4(recipe=recipe)
    assert MoEConfig.from_pretrained(d, layer=0) == MoEConfig.deepseek_v4(hash_routing=True, recipe=recipe)
    _, sources = resolve_layer(d, 3)
    assert sources["scoring_func"] == ("sqrtsoftplus", None)
    assert sources["topk_method"] == ("noaux_tc", "moe_jax's DeepSeek-V4 defaults")


def test_disagreement_names_the_absent_key_and_the_assumption():
    kwargs, sources = resolve_layer(V3, 3)
    mine = MoEConfig.deepseek_v3(recipe="bf16", scoring="softmax", use_correction_bias=False)
    bad = disagreements(mine, kwargs, sources)
    assert bad == [
        ("config.scoring='softmax' disagrees with the checkpoint's config.json (no 'scoring_func' key; "
         "assumed 'sigmoid' as in transformers' deepseek_v3)"),
        ("config.use_correction_bias=False disagrees with the checkpoint's config.json "
         "(True; no 'topk_method' key; assumed 'noaux_tc' as in transformers' deepseek_v3)")]
    # a stated key is quoted as the file says it; without sources, the value alone (as before)
    stated = {**V3, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    kwargs, sources = resolve_layer(stated, 3)
    assert disagreements(mine, kwargs, sources) == [
        "config.scoring='softmax' disagrees with the checkpoint's config.json (scoring_func='sigmoid')",
        ("config.use_correction_bias=False disagrees with the checkpoint's config.json "
         "(True; topk_method='noaux_tc')")]
    assert disagreements(mine, kwargs)[0] == ("config.scoring='softmax' disagrees with the checkpoint's "
                                              "config.json ('sigmoid')")
    assert disagreements(MoEConfig.deepseek_v3(recipe="bf16"), kwargs, sources) == []


@pytest.fixture(scope="module")
def fp8_layer():
    return build("fp8_block", seed=21)


def write_ckpt(tmp_path, tensors, cfg_json):
    write_st(tmp_path / "model.safetensors", tensors)
    (tmp_path / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True))


def test_load_a_transformers_v3_checkpoint(tmp_path, fp8_layer):
    from moe_jax.nn import MoE

    t, deq = fp8_layer
    write_ckpt(tmp_path, t, SMALL_V3)
    cfg, params = load_moe_layer(tmp_path, layer=3, arch=90)
    assert cfg == config("fp8_block", arch=90)  # sigmoid, correction bias, n_group 1: no grouping
    np.testing.assert_array_equal(np.asarray(params.e_score_correction_bias),
                                  t[P + "gate.e_score_correction_bias"])
    check_forward(params, cfg, t, deq, tol=0.1)
    assert MoE.from_pretrained(tmp_path, layer=3, arch=90, backend="reference").config == cfg
    load_moe_layer(tmp_path, layer=3, config=config("fp8_block"), prepare=False)  # the right config agrees
    write_ckpt(tmp_path, t, {**SMALL_V3, "quantization_config": TRANSFORMERS_FP8})  # as transformers re-saves
    assert load_moe_layer(tmp_path, layer=3, prepare=False)[0] == config("fp8_block")


def test_load_with_a_disagreeing_config_names_the_assumption(tmp_path, fp8_layer):
    write_ckpt(tmp_path, fp8_layer[0], SMALL_V3)
    with pytest.raises(CheckpointError) as ei:
        load_moe_layer(tmp_path, layer=3, config=config("fp8_block", scoring="softmax"), prepare=False)
    assert ("config.scoring='softmax' disagrees with the checkpoint's config.json (no 'scoring_func' key; "
            "assumed 'sigmoid' as in transformers' deepseek_v3)") in str(ei.value)
    assert "('softmax')" not in str(ei.value)


def test_bias_present_but_config_json_routes_without_one(tmp_path, fp8_layer):
    """A config built from config.json is blamed on config.json (how it decided), not on a user config."""
    small_v2 = {**V2, "hidden_size": H, "moe_intermediate_size": I, "n_routed_experts": E,
                "num_experts_per_tok": K_TOP, "n_shared_experts": 1, "first_k_dense_replace": 1,
                "num_hidden_layers": 4, "quantization_config": RELEASE_FP8}
    write_ckpt(tmp_path, fp8_layer[0], small_v2)
    with pytest.raises(CheckpointError) as ei:
        load_moe_layer(tmp_path, layer=3, prepare=False)
    msg = str(ei.value)
    assert (f"{P}gate.e_score_correction_bias: present, but config.json routes layer 3 without a "
            "correction bias (use_correction_bias: False; topk_method='greedy')") in msg
    assert "config.use_correction_bias is False" not in msg
    write_ckpt(tmp_path, fp8_layer[0], {k: v for k, v in small_v2.items() if k != "topk_method"})
    with pytest.raises(CheckpointError) as ei:
        load_moe_layer(tmp_path, layer=3, prepare=False)
    assert ("(use_correction_bias: False; no 'topk_method' key; assumed 'greedy' as in transformers' "
            "deepseek_v2)") in str(ei.value)
