"""QuantRecipe / get_recipe invariants (SPEC §2)."""

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
