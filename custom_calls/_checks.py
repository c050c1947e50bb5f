"""Trace-time argument checks shared by the op modules (ValueError/TypeError naming the argument,
the expected and the actual value)."""

from __future__ import annotations

import jax.numpy as jnp

from layouts._checks import SUPPORTED_ARCHS as ARCHS
from layouts._checks import align as round_up, ceil_div  # noqa: F401  (one definition of each)
from layouts.recipes import RECIPE_NAMES as RECIPES
from layouts.recipes import get_recipe

FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32)  # activations / bf16-recipe operands

_QUANTIZED = [get_recipe(r) for r in RECIPES if get_recipe(r).is_quantized]
# recipe -> activation (lhs) group along K, weight (rhs) group along K
ACT_GROUP = {r.name: r.act_group_size for r in _QUANTIZED}
WEIGHT_GROUP = {r.name: r.weight_recipe[1] for r in _QUANTIZED}
# archs whose GEMMs consume the recipe as is (mxfp4 on 90 becomes fp8_block at load time)
RECIPE_ARCHS = {r: tuple(a for a in sorted(get_recipe(r).supported_archs)
                         if get_recipe(r).gemm_recipe(a) is get_recipe(r)) for r in RECIPES}


def check_recipe_arch(recipe: str, arch: int) -> None:
    """recipe in RECIPES, arch in ARCHS, and the GEMMs of arch consume recipe directly."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe: expected one of {RECIPES}, got {recipe!r}")
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")
    archs = RECIPE_ARCHS[recipe]
    if arch not in archs:
        hint = " (mxfp4 on arch 90 is converted to fp8_block at load time)" if recipe == "mxfp4" else ""
        raise ValueError(f"recipe {recipe!r}: GEMM formats exist for arch {archs}, got arch {arch}{hint}")


def check_shape(name: str, a, expected: tuple) -> None:
    if a is None:
        raise ValueError(f"{name}: expected an array of shape {tuple(expected)}, got None")
    if tuple(a.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(a.shape)}")


def check_dtype(name: str, a, allowed) -> None:
    if not any(a.dtype == jnp.dtype(d) for d in allowed):
        names = ", ".join(jnp.dtype(d).name for d in allowed)
        raise TypeError(f"{name}: expected dtype in ({names}), got {a.dtype}")


def check_rank(name: str, a, rank: int, what: str) -> None:
    if a.ndim != rank:
        raise ValueError(f"{name}: expected rank {rank} {what}, got shape {tuple(a.shape)}")


def act_scale_image_shape(recipe: str, arch: int, rows: int, k: int) -> tuple[tuple[int, ...], object]:
    """Shape and dtype of the lhs scale image for `rows` rows of width k (no batch axis)."""
    g = ceil_div(k, ACT_GROUP[recipe])
    if arch == 90:
        return (g, round_up(rows, 4)), jnp.float32
    return (ceil_div(g, 4), round_up(rows, 4)), jnp.int32
