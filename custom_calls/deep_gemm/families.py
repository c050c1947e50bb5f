"""The DeepGEMM kernel families, one row each, and the one place a GEMM format picks its family.

  family       template                  archs  recipes                    dense  tiling
  fp8_1d2d     sm90_fp8_gemm_1d2d        90     fp8_block                  yes    SM90 rules, tuned
  bf16         sm90_bf16_gemm            90     bf16                       yes    SM90 rules, tuned
  sm100_1d1d   sm100_fp8_fp4_gemm_1d1d   100    fp8_block, mxfp8, mxfp4    no     one config per shape

A new family is one module (its config, source, plan and name functions and its `KernelFamily`)
and one row of `FAMILIES`. BF16 on SM100 has no family (DeepGEMM serves it with another template).
"""

from __future__ import annotations

from layouts import GemmFormat, gemm_format

from . import sm90_bf16, sm90_fp8_1d2d, sm100_1d1d
from .family import CdDtype, GemmKind, GemmProblem, KernelFamily

FAMILIES: tuple[KernelFamily, ...] = (sm90_fp8_1d2d.FAMILY, sm90_bf16.FAMILY, sm100_1d1d.FAMILY)


def family_for(fmt: GemmFormat) -> KernelFamily | None:
    """The family serving GEMMs of format ``fmt``; None when no DeepGEMM kernel is wired for it."""
    return next((f for f in FAMILIES if f.serves(fmt)), None)


def unserved_reason(fmt: GemmFormat) -> str:
    return f"{fmt.describe()} has no DeepGEMM kernel wired here (SM100 BF16 uses another template)"


def gemm_problem(gemm_kind: GemmKind, m: int, n: int, k: int, num_groups: int, recipe: str, arch: int,
                 expected_m: int | None = None, cd_dtype: CdDtype = "bf16") -> GemmProblem:
    """The problem of a GEMM call on the family of ``gemm_format(recipe, arch)`` (ValueError when
    none serves it). m: M (normal), M_cap (contig) or m_pad (masked); expected_m (masked; None = m)
    is clamped to [1, m], so the op and the warm-up pick the same tile for the same hint."""
    fmt = gemm_format(recipe, arch)
    family = family_for(fmt)
    if family is None:
        raise ValueError(unserved_reason(fmt))
    if gemm_kind == "masked":
        expected_m = m if expected_m is None else max(1, min(expected_m, m))
    return GemmProblem(family, fmt, gemm_kind, m, n, k, num_groups, expected_m, cd_dtype)
