"""The GPU families the GEMM formats exist for, defined once.

An arch is 10 * major + minor of the CUDA compute capability: 90 = SM90 (H100/H200), 100 = SM100
(B200/B300). Everything else about a (recipe, arch) pair lives in `layouts.gemm_format`.
"""

from __future__ import annotations

import dataclasses

SCALE_FP32 = "fp32"
SCALE_UE8M0 = "ue8m0"


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    """A GPU family the GEMM formats exist for: `arch` = 10 * major + minor compute capability."""

    arch: int
    name: str
    scale_kind: str  # how quantized recipes store their GEMM scales: SCALE_FP32 | SCALE_UE8M0
    scale_recipes: tuple[tuple[int, int], ...]  # DeepGEMM (gran_mn, gran_k) scale recipes it reads


ARCHS = {
    90: ArchSpec(90, "SM90 (H100/H200)", SCALE_FP32, ((1, 128), (128, 128))),
    100: ArchSpec(100, "SM100 (B200/B300)", SCALE_UE8M0, ((1, 128), (128, 128), (1, 32))),
}
SUPPORTED_ARCHS = tuple(ARCHS)


def check_arch(arch) -> int:
    """`arch` as an int when it names a supported GPU family, else ValueError (never a default)."""
    if isinstance(arch, bool) or arch not in ARCHS:
        raise ValueError(f"arch: expected one of {SUPPORTED_ARCHS}, got {arch!r}")
    return int(arch)


__all__ = ["ARCHS", "ArchSpec", "SCALE_FP32", "SCALE_UE8M0", "SUPPORTED_ARCHS", "check_arch"]
