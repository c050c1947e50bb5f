"""QuantRecipe / get_recipe and MoEQuantInfo invariants (SPEC §2)."""

import jax
import pytest

import layouts as L


def test_recipe_table():
    table = {  # name: act_group_size, weight_block, requires_ue8m0, is_fp4_experts, archs
        "bf16": (None, None, False, False, {90, 100}),
        "fp8_block": (128, (128, 128), False, False, {90, 100}),
        "mxfp8": (32, (1, 32), True, False, {100}),
        "mxfp4": (128, (1, 32), True, True, {90, 100}),
    }
    assert set(L.RECIPE_NAMES) == set(table)
    for name, (ag, wb, ue, fp4, archs) in table.items():
        r = L.get_recipe(name)
        assert (r.name, r.act_group_size, r.weight_block, r.requires_ue8m0, r.is_fp4_experts) == (name, ag, wb, ue, fp4)
        assert set(r.supported_archs) == archs
        assert hash(r) == hash(L.get_recipe(name))
    assert L.get_recipe("mxfp4").weight_k_pack == 2 and L.get_recipe("fp8_block").weight_k_pack == 1
    assert L.get_recipe("mxfp4").gemm_recipe(90).name == "fp8_block"
    assert L.get_recipe("mxfp4").gemm_recipe(100).name == "mxfp4"
    assert L.get_recipe("fp8_block").scales_ue8m0(100) and not L.get_recipe("fp8_block").scales_ue8m0(90)
    assert not L.get_recipe("bf16").scales_ue8m0(100)


def test_recipe_is_a_static_jit_argument():
    f = jax.jit(lambda r: r.act_group_size, static_argnums=0)
    assert f(L.get_recipe("mxfp8")) == 32


def test_get_recipe_and_arch_errors():
    with pytest.raises(ValueError, match=r"recipe: expected one of \('bf16', 'fp8_block', 'mxfp8', 'mxfp4'\), got 'fp16'"):
        L.get_recipe("fp16")
    with pytest.raises(ValueError, match=r"arch: recipe 'mxfp8' runs on \[100\], got 90"):
        L.get_recipe("mxfp8").check_arch(90)
    with pytest.raises(ValueError, match=r"arch: expected one of \(90, 100\), got 120"):
        L.get_recipe("bf16").check_arch(120)


# (recipe, use_fp8, block_shape, is_fp4_experts, use_mxfp8, scale_ue8m0) as SPEC §2's table states
_FOR_RECIPE = {
    ("bf16", 90): ("bf16", False, None, False, False, False),
    ("bf16", 100): ("bf16", False, None, False, False, False),
    ("fp8_block", 90): ("fp8_block", True, (128, 128), False, False, False),
    ("fp8_block", 100): ("fp8_block", True, (128, 128), False, False, True),
    ("mxfp8", 100): ("mxfp8", True, (1, 32), False, True, True),
    ("mxfp4", 100): ("mxfp4", True, (128, 128), True, False, True),
    ("mxfp4", 90): ("fp8_block", True, (128, 128), False, False, False),  # load-time FP4 -> FP8
}


@pytest.mark.parametrize("name,arch", list(_FOR_RECIPE))
def test_for_recipe_is_consistent(name, arch):
    info = L.MoEQuantInfo.for_recipe(name, arch)
    got = (info.recipe, info.use_fp8, info.block_shape, info.is_fp4_experts, info.use_mxfp8,
           info.scale_ue8m0)
    assert got == _FOR_RECIPE[(name, arch)]
    hash(info)


def test_scale_recipes():
    mx = L.MoEQuantInfo.for_recipe("mxfp8", 100)
    # GEMM1: K = H = 7168 -> ceil(7168 / 128) = 56 packed columns; GEMM2: K = I = 2048 -> 16
    assert mx.scale_recipes(activation_block_size=None, hidden_size=7168, activation_scale_width=56) == ((1, 32), (1, 32))
    assert mx.scale_recipes(activation_block_size=32, hidden_size=2048, activation_scale_width=16) == ((1, 32), (1, 32))
    assert mx.scale_recipes(activation_block_size=128, hidden_size=7168, activation_scale_width=14) == ((1, 128), (1, 32))
    fp4 = L.MoEQuantInfo.for_recipe("mxfp4", 100)
    assert fp4.scale_recipes(activation_block_size=128, hidden_size=7168, activation_scale_width=14) == ((1, 128), (1, 32))
    for name, arch in (("fp8_block", 100), ("bf16", 90), ("mxfp4", 90)):
        assert L.MoEQuantInfo.for_recipe(name, arch).scale_recipes(
            activation_block_size=128, hidden_size=7168, activation_scale_width=56) == (None, None)
    with pytest.raises(ValueError, match=r"activation_scale_width: expected ceil\(2048 / \(32 \* 4\)\) = 16 .* got 56"):
        mx.scale_recipes(activation_block_size=None, hidden_size=2048, activation_scale_width=56)


@pytest.mark.parametrize("kwargs,match", [
    (dict(recipe="mxfp8", use_fp8=True, block_shape=(128, 128), use_mxfp8=True, scale_ue8m0=True),
     r"block_shape: use_mxfp8 requires \(1, 32\), got \(128, 128\)"),
    (dict(recipe="mxfp8", use_fp8=True, block_shape=(1, 32), use_mxfp8=True, scale_ue8m0=False),
     r"scale_ue8m0: use_mxfp8 requires UE8M0 scales"),
    (dict(recipe="mxfp4", use_fp8=True, block_shape=(128, 128), is_fp4_experts=True, scale_ue8m0=False),
     r"scale_ue8m0: is_fp4_experts requires UE8M0 scales"),
    (dict(recipe="mxfp4", use_fp8=True, block_shape=(1, 32), is_fp4_experts=True, use_mxfp8=True, scale_ue8m0=True),
     r"is_fp4_experts/use_mxfp8: expected at most one of them True"),
    (dict(recipe="bf16", use_fp8=True, block_shape=None),
     r"use_fp8: expected False for recipe 'bf16', got True"),
    (dict(recipe="fp8_block", use_fp8=True, block_shape=(1, 32)),
     r"block_shape: expected \(128, 128\) for recipe 'fp8_block', got \(1, 32\)"),
    (dict(recipe="fp8_block", use_fp8=True, block_shape=(128,)),
     r"block_shape: expected None or a pair of positive ints, got \(128,\)"),
    (dict(recipe="int4", use_fp8=True, block_shape=(128, 128)),
     r"recipe: expected one of .* got 'int4'"),
])
def test_quant_info_invariants(kwargs, match):
    with pytest.raises(ValueError, match=match):
        L.MoEQuantInfo(**kwargs)


def test_quant_info_list_block_shape_is_normalized():
    info = L.MoEQuantInfo(recipe="fp8_block", use_fp8=True, block_shape=[128, 128])
    assert info.block_shape == (128, 128)
    hash(info)
