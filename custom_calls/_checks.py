"""Trace-time argument checks shared by the op modules (ValueError/TypeError naming the argument,
the expected and the actual value)."""

from __future__ import annotations

import jax.numpy as jnp

RECIPES = ("bf16", "fp8_block", "mxfp8", "mxfp4")
ARCHS = (90, 100)
# recipe -> activation (lhs) group along K, weight (rhs) group along K
ACT_GROUP = {"fp8_block": 128, "mxfp8": 32, "mxfp4": 128}
WEIGHT_GROUP = {"fp8_block": 128, "mxfp8": 32, "mxfp4": 32}
RECIPE_ARCHS = {"bf16": (90, 100), "fp8_block": (90, 100), "mxfp8": (100,), "mxfp4": (100,)}


from layouts._checks import align as round_up, ceil_div  # noqa: F401  (one definition of each)


def check_recipe_arch(recipe: str, arch: int, *, gemm: bool = True) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"recipe: expected one of {RECIPES}, got {recipe!r}")
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")
    archs = RECIPE_ARCHS[recipe] if gemm else (90, 100)
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
