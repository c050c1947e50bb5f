"""Quantization recipes and the GEMM format each (recipe, arch) pair implies.

Recipes are frozen, hashable dataclasses, usable as static jit arguments. Scale granularities are
(along N or rows, along K) tuples: (128, 128) weight blocks, (1, 32) MX groups.

  recipe     weights (checkpoint form)                    scales                      runs on
  bf16       bf16 (E, N, K)                               -                           90, 100
  fp8_block  e4m3 (E, N, K)                               128x128 blocks, f32         90, 100
  mxfp8      e4m3 (E, N, K)                               1x32 groups, powers of two  100
  mxfp4      int8 holding two e2m1 codes (E, N, K/2)      1x32 groups, powers of two  100; 90 after
                                                                                      the load-time
                                                                                      FP4 -> FP8 cast,
                                                                                      or 4-bit (W4A8)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from layouts.checks import ceil_div
from layouts.archs import SUPPORTED_ARCHS, check_arch
from layouts.gemm_format import GemmFormat, format_for, value_dtypes

RECIPE_NAMES = ("bf16", "fp8_block", "mxfp8", "mxfp4")


@dataclasses.dataclass(frozen=True)
class QuantRecipe:
    """What a recipe stores and which GPUs run it.

    name: one of RECIPE_NAMES.
    act_group_size: activation scale group along K (None for bf16; 128 fp8_block/mxfp4; 32 mxfp8).
    weight_block: weight scale granularity (N, K): None, (128, 128), (1, 32), (1, 32).
    requires_ue8m0: scales must be powers of two (mxfp8, mxfp4).
    is_fp4_experts: weights are int8 holding two e2m1 codes, (E, N, K/2).
    supported_archs: SM versions that run it (mxfp4 on 90 through the load-time FP4->FP8 path).
    converted_on: (arch, recipe) pairs: on that arch the weights are converted at load time to the
      other recipe, which the GEMMs then consume.
    kept_4bit_on: archs where the weights may instead stay 4-bit for GEMMs that widen them in
      registers (mxfp4 on 90: W4A8, `layouts.w4a8`); `gemm_format(name, arch)` is that form.
    """

    name: str
    act_group_size: Optional[int]
    weight_block: Optional[tuple[int, int]]
    requires_ue8m0: bool
    is_fp4_experts: bool
    supported_archs: frozenset
    converted_on: tuple[tuple[int, str], ...] = ()
    kept_4bit_on: tuple[int, ...] = ()

    @property
    def is_quantized(self) -> bool:
        return self.name != "bf16"

    @property
    def use_mxfp8(self) -> bool:
        return self.name == "mxfp8"

    @property
    def weight_k_pack(self) -> int:
        """Weight values per stored element along K (2 for int8-packed e2m1)."""
        return 2 if self.is_fp4_experts else 1

    def supports_arch(self, arch: int) -> bool:
        return arch in self.supported_archs

    def check_arch(self, arch: int) -> None:
        check_arch(arch)
        if arch not in self.supported_archs:
            raise ValueError(
                f"arch: recipe {self.name!r} runs on {sorted(self.supported_archs)}, got {arch}"
            )

    def gemm_recipe(self, arch: int) -> "QuantRecipe":
        """The recipe the GEMM sees on ``arch``: mxfp4 on SM90 is fp8_block after the load-time cast."""
        self.check_arch(arch)
        return get_recipe(dict(self.converted_on).get(arch, self.name))

    def gemm_format(self, arch: int) -> GemmFormat:
        """The operand format of the GEMMs that run this recipe's weights on ``arch`` (after any
        load-time conversion)."""
        return format_for(self.gemm_recipe(arch), arch)

    def scales_ue8m0(self, arch: int) -> bool:
        """True when GEMM scales on ``arch`` are packed UE8M0 int32 images (every quantized recipe on SM100)."""
        return self.gemm_format(arch).ue8m0

    def checkpoint_scale_shape(self, num_experts: int, n: int, k: int) -> tuple[int, int, int] | None:
        """Scale shape of (E, N, K) weights in checkpoint form: (E, ceil(N/bn), ceil(K/bk)) for the
        weight block (bn, bk); None for bf16."""
        if self.weight_block is None:
            return None
        bn, bk = self.weight_block
        return num_experts, ceil_div(n, bn), ceil_div(k, bk)

    @property
    def value_dtypes(self) -> tuple:
        """dtypes of the weight values in checkpoint form."""
        return value_dtypes(self.is_quantized, self.weight_k_pack)


_RECIPES = {
    "bf16": QuantRecipe("bf16", None, None, False, False, frozenset({90, 100})),
    "fp8_block": QuantRecipe("fp8_block", 128, (128, 128), False, False, frozenset({90, 100})),
    "mxfp8": QuantRecipe("mxfp8", 32, (1, 32), True, False, frozenset({100})),
    "mxfp4": QuantRecipe("mxfp4", 128, (1, 32), True, True, frozenset({90, 100}), converted_on=((90, "fp8_block"),),
                         kept_4bit_on=(90,)),
}


def gemm_format(recipe: str, arch: int) -> GemmFormat:
    """The format of GEMMs that consume ``recipe`` directly on ``arch``: as stored, or 4-bit where the
    recipe keeps its weights 4-bit (mxfp4 on 90: W4A8). A recipe the arch only runs after a load-time
    conversion is an error naming the converted recipe."""
    rec = get_recipe(recipe)
    arch = check_arch(arch)
    consumed = tuple(a for a in SUPPORTED_ARCHS
                     if a in rec.supported_archs and (rec.gemm_recipe(a) is rec or a in rec.kept_4bit_on))
    if arch not in consumed:
        hint = ""
        if arch in rec.supported_archs:
            hint = f" ({rec.name} on arch {arch} is converted to {rec.gemm_recipe(arch).name} at load time)"
        raise ValueError(f"recipe {rec.name!r}: GEMM formats exist for arch {consumed}, got arch {arch}{hint}")
    return format_for(rec, arch)


def get_recipe(name: str) -> QuantRecipe:
    """The recipe called ``name`` (one of RECIPE_NAMES); a QuantRecipe is returned as is."""
    if isinstance(name, QuantRecipe):
        return name
    if name not in _RECIPES:
        raise ValueError(f"recipe: expected one of {RECIPE_NAMES}, got {name!r}")
    return _RECIPES[name]


__all__ = ["RECIPE_NAMES", "QuantRecipe", "get_recipe", "gemm_format", "SUPPORTED_ARCHS"]
