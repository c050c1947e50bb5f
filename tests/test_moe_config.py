"""MoEConfig presets, scaling and validation; MoEParams / init_params / prepare_params shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import moe_jax as mj
from custom_calls import ActivationSpec
from moe_jax import MoEConfig


def test_presets():
    v3 = MoEConfig.deepseek_v3()
    assert (v3.num_experts, v3.top_k, v3.n_group, v3.topk_group) == (256, 8, 8, 4)
    assert (v3.hidden_size, v3.intermediate_size, v3.n_shared_experts) == (7168, 2048, 1)
    assert v3.scoring == "sigmoid" and v3.use_correction_bias and v3.use_grouped_topk
    assert v3.routed_scaling_factor == 2.5 and v3.recipe == "fp8_block" and v3.gemm_arch == 90
    v4 = MoEConfig.deepseek_v4()
    assert (v4.num_experts, v4.top_k, v4.hidden_size, v4.intermediate_size) == (256, 6, 4096, 2048)
    assert v4.scoring == "sqrtsoftplus" and v4.use_correction_bias and not v4.use_grouped_topk
    assert v4.norm_topk_prob and v4.routed_scaling_factor == 1.5 and v4.activation.swiglu_limit == 10.0
    assert v4.recipe == "mxfp4" and v4.gemm_recipe == "fp8_block"  # SM90: FP4 -> FP8 at load
    assert v4.scaled(arch=100).gemm_recipe == "mxfp4"
    assert MoEConfig.deepseek_v4(hash_routing=True).vocab_size == 129280
    assert MoEConfig(4, 2, 128, 128, recipe="mxfp8").gemm_arch == 100
    hash(v3), hash(v4)  # static jit arguments


def test_scaled_keeps_structure():
    s = MoEConfig.deepseek_v3().scaled(num_experts=12, hidden_size=256, intermediate_size=128)
    assert s.num_experts == 12 and s.n_group == 6 and s.topk_group == 4 and s.top_k == 8
    assert s.scoring == "sigmoid" and s.recipe == "fp8_block" and s.routed_scaling_factor == 2.5
    t = MoEConfig.deepseek_v3().scaled(num_experts=8, hidden_size=128, intermediate_size=128)
    assert (t.n_group, t.topk_group, t.top_k) == (8, 4, 4)


@pytest.mark.parametrize("kw,msg", [
    (dict(top_k=9), "top_k=9 exceeds num_experts=8"),
    (dict(use_grouped_topk=True, n_group=3), "n_group=3 must divide num_experts=8"),
    (dict(use_grouped_topk=True, n_group=4, topk_group=5), "topk_group=5 must be in"),
    (dict(use_grouped_topk=True, n_group=4, topk_group=1, top_k=3), "exceeds the 2 experts left"),
    (dict(recipe="fp8_block", hidden_size=200), "hidden_size=200 must be a multiple of 128"),
    (dict(recipe="mxfp4", intermediate_size=96), "intermediate_size=96 must be a multiple of 128"),
    (dict(recipe="fp8_block", alignment=64), "alignment=64 must be a multiple of 128"),
    (dict(recipe="mxfp8", arch=90), "does not run on arch 90"),
    (dict(arch=80), "arch must be one of"),
    (dict(recipe="fp4"), "recipe must be one of"),
    (dict(scoring="relu"), "scoring must be one of"),
    (dict(activation="gelu"), r"kind: expected one of \('silu', 'swiglu_oai', 'situ'\), got 'gelu'"),
    (dict(activation="swiglu_oai"), "gemm1_alpha: required by"),
    (dict(activation=7), "activation must be an ActivationSpec or a kind name, got 7"),
    (dict(activation=ActivationSpec(keep_fp32=True)), "activation.keep_fp32 needs FP8 expert weights"),
    (dict(hash_routing=True), "needs a positive vocab_size"),
    (dict(masked_m_pad=100), "masked_m_pad must be a positive multiple of 128"),
    (dict(num_experts=0), "num_experts must be a positive int"),
])
def test_config_validation(kw, msg):
    base = dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128)
    base.update(kw)
    with pytest.raises(ValueError, match=msg):
        MoEConfig(**base)


@pytest.mark.parametrize("recipe,arch", [("bf16", 90), ("fp8_block", 90), ("fp8_block", 100),
                                         ("mxfp8", 100), ("mxfp4", 100), ("mxfp4", 90)])
def test_params_shapes_and_prepare(recipe, arch):
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128, recipe=recipe,
                    arch=arch, n_shared_experts=1, use_correction_bias=True)
    p = jax.jit(mj.init_params, static_argnames="config")(jax.random.key(0), config=cfg)
    assert mj.check_params(p, cfg) == (4, 128)
    packed = recipe == "mxfp4"
    assert p.w13.shape == (4, 256, 128 if packed else 256) and p.w2.shape == (4, 256, 64 if packed else 128)
    assert p.shared_w13.shape == (256, 256) and p.shared_w2.shape == (256, 128)
    assert p.gemm_recipe is None
    pp = mj.prepare_params(p, cfg)
    assert pp.gemm_arch == arch and pp.gemm_recipe == cfg.gemm_recipe
    assert mj.check_params(pp, cfg) == (4, 128)
    assert mj.prepare_params(pp, cfg) is pp  # prepared once, not again
    if arch == 100 and recipe != "bf16":
        assert pp.w13_scale.dtype == jnp.int32  # packed UE8M0 MN-major image
    if arch == 100 and recipe in ("fp8_block", "mxfp4"):
        with pytest.raises(ValueError, match="already prepared for arch 100"):
            mj.prepare_params(pp, cfg, arch=90)
    # a params pytree: jit-able and tree-mappable, metadata survives
    leaves, tree = jax.tree_util.tree_flatten(pp)
    assert jax.tree_util.tree_unflatten(tree, leaves).gemm_arch == arch


def test_init_shards():
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=256, intermediate_size=256, n_shared_experts=1)
    p = mj.init_params(jax.random.key(1), cfg, num_local_experts=2, tp_size=2)
    assert p.w13.shape == (2, 256, 256) and p.w2.shape == (2, 256, 128)
    assert p.gate_weight.shape == (8, 256) and p.shared_w2.shape == (256, 128)
    assert mj.check_params(p, cfg) == (2, 128)
    # a replicated (whole) shared expert beside sharded routed experts is consistent too
    full = mj.init_params(jax.random.key(1), cfg)
    assert mj.check_params(p.replace(shared_w13=full.shared_w13, shared_w2=full.shared_w2), cfg) == (2, 128)
    with pytest.raises(ValueError, match="params.shared_w2: expected shape \\(256, I_s\\) with I_s dividing 256"):
        mj.check_params(p.replace(shared_w2=full.shared_w2[:, :96]), cfg)
    with pytest.raises(ValueError, match="must divide config.intermediate_size=256"):
        mj.check_params(p.replace(w2=p.w2[..., :96], w13=p.w13[:, :192]), cfg)


def test_hash_table_distinct_experts():
    cfg = MoEConfig(num_experts=8, top_k=3, hidden_size=128, intermediate_size=128,
                    hash_routing=True, vocab_size=50)
    p = mj.init_params(jax.random.key(2), cfg)
    t = jnp.sort(p.tid2eid, axis=1)
    assert p.tid2eid.dtype == jnp.int32 and p.tid2eid.shape == (50, 3)
    assert bool(jnp.all(t[:, 1:] != t[:, :-1])) and bool(jnp.all((t >= 0) & (t < 8)))
