"""Quantization recipes, the GEMM format each (recipe, arch) pair implies, and the MoE
quantization descriptor ``MoEQuantInfo`` (a view of the format).

All are frozen, hashable dataclasses, usable as static jit arguments.
DeepGEMM scale recipes are (gran_mn, gran_k) tuples: (1, 128) per-row 128-groups, (128, 128)
weight blocks, (1, 32) MX groups.

  recipe     weights (checkpoint form)                    scales                      runs on
  bf16       bf16 (E, N, K)                               -                           90, 100
  fp8_block  e4m3 (E, N, K)                               128x128 blocks, f32         90, 100
  mxfp8      e4m3 (E, N, K)                               1x32 groups, powers of two  100
  mxfp4      int8 holding two e2m1 codes (E, N, K/2)      1x32 groups, powers of two  100; 90 after
                                                                                      the load-time
                                                                                      FP4 -> FP8 cast
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from layouts.checks import ceil_div
from layouts.archs import SUPPORTED_ARCHS, check_arch
from layouts.gemm_format import GemmFormat, format_for, value_dtypes

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
    converted_on: (arch, recipe) pairs: on that arch the weights are converted at load time to the
      other recipe, which the GEMMs then consume.
    """

    name: str
    act_group_size: Optional[int]
    weight_block: ScaleRecipe
    requires_ue8m0: bool
    is_fp4_experts: bool
    supported_archs: frozenset
    act_recipe: ScaleRecipe
    weight_recipe: ScaleRecipe
    converted_on: tuple[tuple[int, str], ...] = ()

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
    "bf16": QuantRecipe("bf16", None, None, False, False, frozenset({90, 100}), None, None),
    "fp8_block": QuantRecipe(
        "fp8_block", 128, (128, 128), False, False, frozenset({90, 100}), (1, 128), (128, 128)
    ),
    "mxfp8": QuantRecipe("mxfp8", 32, (1, 32), True, False, frozenset({100}), (1, 32), (1, 32)),
    "mxfp4": QuantRecipe("mxfp4", 128, (1, 32), True, True, frozenset({90, 100}), (1, 128), (1, 32),
                         converted_on=((90, "fp8_block"),)),
}


def gemm_format(recipe: str, arch: int) -> GemmFormat:
    """The format of GEMMs that consume ``recipe`` directly on ``arch``. A recipe the arch only runs
    after a load-time conversion (mxfp4 on 90) is an error naming the converted recipe."""
    rec = get_recipe(recipe)
    arch = check_arch(arch)
    consumed = tuple(a for a in SUPPORTED_ARCHS if a in rec.supported_archs and rec.gemm_recipe(a) is rec)
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


def _declared_block(rec: QuantRecipe) -> Optional[tuple[int, int]]:
    # the block the descriptor declares: MX weights (1, 32); FP4 experts declare (128, 128) like
    # block FP8, although their scales are 1x32 groups
    if not rec.is_quantized:
        return None
    return (1, 32) if rec.use_mxfp8 else (128, 128)


@dataclasses.dataclass(frozen=True)
class MoEQuantInfo:
    """Quantization descriptor of the expert weights (metadata only, no arrays), a view of the
    GemmFormat (``MoEQuantInfo.of(fmt)``).

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
        rec = get_recipe(self.recipe)
        want = dict(use_fp8=rec.is_quantized, block_shape=_declared_block(rec),
                    is_fp4_experts=rec.is_fp4_experts, use_mxfp8=rec.use_mxfp8)
        if not rec.is_quantized:
            want["scale_ue8m0"] = False
        for field, expected in want.items():
            got = getattr(self, field)
            if got != expected:
                bad(field, expected, got)

    @classmethod
    def of(cls, fmt: GemmFormat) -> "MoEQuantInfo":
        """The descriptor as a view of a GEMM format."""
        rec = get_recipe(fmt.recipe)
        return cls(recipe=rec.name, use_fp8=rec.is_quantized, block_shape=_declared_block(rec),
                   is_fp4_experts=rec.is_fp4_experts, use_mxfp8=rec.use_mxfp8, scale_ue8m0=fmt.ue8m0)

    @classmethod
    def for_recipe(cls, recipe: str, arch: int) -> "MoEQuantInfo":
        """The descriptor of ``recipe`` as the GEMMs of ``arch`` see it (mxfp4 on SM90 -> fp8_block)."""
        return cls.of(get_recipe(recipe).gemm_format(arch))

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


__all__ = ["RECIPE_NAMES", "QuantRecipe", "get_recipe", "gemm_format", "MoEQuantInfo", "SUPPORTED_ARCHS"]
