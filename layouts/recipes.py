"""Quantization recipes (SPEC §2) and the MoE quantization descriptor ``MoEQuantInfo``.

Both are frozen, hashable dataclasses, usable as static jit arguments.
DeepGEMM scale recipes are (gran_mn, gran_k) tuples: (1, 128) per-row 128-groups, (128, 128)
weight blocks, (1, 32) MX groups.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from layouts._checks import SUPPORTED_ARCHS, ceil_div, check_arch

RECIPE_NAMES = ("bf16", "fp8_block", "mxfp8", "mxfp4")

ScaleRecipe = Optional[tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class QuantRecipe:
    """What a recipe stores and which GPUs run it.

    name: one of RECIPE_NAMES.
    act_group_size: activation scale group along K (None for bf16; 128 fp8_block/mxfp4; 32 mxfp8).
    weight_block: weight scale granularity (N, K): None, (128, 128), (1, 32), (1, 32).
    requires_ue8m0: scales must be powers of two (mxfp8, mxfp4).
    is_fp4_experts: weights are int8 holding two e2m1 codes, (E, N, K/2).
    supported_archs: SM versions that run it (mxfp4 on 90 through the load-time FP4->FP8 path).
    act_recipe / weight_recipe: DeepGEMM (gran_mn, gran_k) of the activation / weight scales.
    """

    name: str
    act_group_size: Optional[int]
    weight_block: ScaleRecipe
    requires_ue8m0: bool
    is_fp4_experts: bool
    supported_archs: frozenset
    act_recipe: ScaleRecipe
    weight_recipe: ScaleRecipe

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
        if self.name == "mxfp4" and arch == 90:
            return get_recipe("fp8_block")
        return self

    def scales_ue8m0(self, arch: int) -> bool:
        """True when GEMM scales on ``arch`` are packed UE8M0 int32 images (every quantized recipe on SM100)."""
        self.check_arch(arch)
        return self.is_quantized and arch == 100


_RECIPES = {
    "bf16": QuantRecipe("bf16", None, None, False, False, frozenset({90, 100}), None, None),
    "fp8_block": QuantRecipe(
        "fp8_block", 128, (128, 128), False, False, frozenset({90, 100}), (1, 128), (128, 128)
    ),
    "mxfp8": QuantRecipe("mxfp8", 32, (1, 32), True, False, frozenset({100}), (1, 32), (1, 32)),
    "mxfp4": QuantRecipe("mxfp4", 128, (1, 32), True, True, frozenset({90, 100}), (1, 128), (1, 32)),
}


def get_recipe(name: str) -> QuantRecipe:
    """The recipe called ``name`` (one of RECIPE_NAMES); a QuantRecipe is returned as is."""
    if isinstance(name, QuantRecipe):
        return name
    if name not in _RECIPES:
        raise ValueError(f"recipe: expected one of {RECIPE_NAMES}, got {name!r}")
    return _RECIPES[name]


@dataclasses.dataclass(frozen=True)
class MoEQuantInfo:
    """Quantization descriptor of the expert weights (SPEC §2; metadata only, no arrays).

    recipe: one of RECIPE_NAMES, consistent with the flags below.
    use_fp8: weights quantized (False only for bf16).
    block_shape: declared weight block: None (bf16), (128, 128) (fp8_block, incl. expanded
      per-tensor, and mxfp4 experts), (1, 32) (mxfp8).
    is_fp4_experts: int8-packed e2m1 expert weights.
    use_mxfp8: MXFP8 weights; requires block_shape (1, 32) and scale_ue8m0.
    scale_ue8m0: GEMM scales are packed UE8M0 (SM100); required by mxfp8 and mxfp4 experts.
    Build one with ``MoEQuantInfo.for_recipe(name, arch)``.
    """

    recipe: str
    use_fp8: bool
    block_shape: Optional[tuple[int, int]]
    is_fp4_experts: bool = False
    use_mxfp8: bool = False
    scale_ue8m0: bool = False

    def __post_init__(self):
        get_recipe(self.recipe)
        if self.block_shape is not None:
            bs = tuple(self.block_shape)
            if len(bs) != 2 or not all(isinstance(v, int) and v > 0 for v in bs):
                raise ValueError(f"block_shape: expected None or a pair of positive ints, got {self.block_shape!r}")
            object.__setattr__(self, "block_shape", bs)

        def bad(field, expected, got):
            raise ValueError(f"{field}: expected {expected} for recipe {self.recipe!r}, got {got!r}")

        if self.use_mxfp8 and self.block_shape != (1, 32):
            raise ValueError(f"block_shape: use_mxfp8 requires (1, 32), got {self.block_shape!r}")
        if self.use_mxfp8 and not self.scale_ue8m0:
            raise ValueError("scale_ue8m0: use_mxfp8 requires UE8M0 scales (True), got False")
        if self.is_fp4_experts and not self.scale_ue8m0:
            raise ValueError("scale_ue8m0: is_fp4_experts requires UE8M0 scales (True), got False")
        if self.is_fp4_experts and self.use_mxfp8:
            raise ValueError("is_fp4_experts/use_mxfp8: expected at most one of them True, got both")
        want = {
            "bf16": dict(use_fp8=False, block_shape=None, is_fp4_experts=False, use_mxfp8=False, scale_ue8m0=False),
            "fp8_block": dict(use_fp8=True, block_shape=(128, 128), is_fp4_experts=False, use_mxfp8=False),
            "mxfp8": dict(use_fp8=True, block_shape=(1, 32), is_fp4_experts=False, use_mxfp8=True),
            "mxfp4": dict(use_fp8=True, block_shape=(128, 128), is_fp4_experts=True, use_mxfp8=False),
        }[self.recipe]
        for field, expected in want.items():
            got = getattr(self, field)
            if got != expected:
                bad(field, expected, got)

    @classmethod
    def for_recipe(cls, recipe: str, arch: int) -> "MoEQuantInfo":
        """The descriptor of ``recipe`` as the GEMMs of ``arch`` see it (mxfp4 on SM90 -> fp8_block)."""
        rec = get_recipe(recipe).gemm_recipe(arch)
        return cls(
            recipe=rec.name,
            use_fp8=rec.is_quantized,
            block_shape=None if not rec.is_quantized else ((1, 32) if rec.use_mxfp8 else (128, 128)),
            is_fp4_experts=rec.is_fp4_experts,
            use_mxfp8=rec.use_mxfp8,
            scale_ue8m0=rec.scales_ue8m0(arch),
        )

    @property
    def quant_recipe(self) -> QuantRecipe:
        return get_recipe(self.recipe)

    def scale_recipes(
        self,
        activation_block_size: Optional[int],
        hidden_size: int,
        activation_scale_width: int,
    ) -> tuple[ScaleRecipe, ScaleRecipe]:
        """DeepGEMM (A, B) scale recipes for a GEMM whose K is ``hidden_size``.

        mxfp8 -> ((1, activation_block_size or 32), (1, 32)), and requires
        ceil(hidden_size / (activation_block_size * 4)) == activation_scale_width (the packed
        int32 width of the activation scale); fp4 experts -> ((1, 128), (1, 32));
        otherwise (None, None) (DeepGEMM's default 1x128 / 128x128).
        GEMM2 must call this again with hidden_size = I (its K).
        """
        if self.use_mxfp8:
            ab = activation_block_size or self.block_shape[1]
            if not isinstance(ab, int) or ab <= 0:
                raise ValueError(f"activation_block_size: expected a positive int or None, got {ab!r}")
            width = ceil_div(hidden_size, ab * 4)
            if width != activation_scale_width:
                raise ValueError(
                    f"activation_scale_width: expected ceil({hidden_size} / ({ab} * 4)) = {width} "
                    f"packed int32 columns for hidden_size {hidden_size}, got {activation_scale_width}"
                )
            return (self.block_shape[0], ab), (self.block_shape[0], self.block_shape[1])
        if self.is_fp4_experts:
            return (1, 128), (1, 32)
        return None, None


__all__ = ["RECIPE_NAMES", "QuantRecipe", "get_recipe", "MoEQuantInfo", "SUPPORTED_ARCHS"]
