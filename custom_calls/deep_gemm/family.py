"""What a DeepGEMM kernel family is: one kernel template and what the host does for it.

A `KernelFamily` names its template (the ``__global__`` function its launch plans launch), the GEMM
formats it serves (recipes on archs of `layouts.archs`), its options (BLOCK_K, the output dtypes,
dense support, the SM90 tile rules' parameters) and its four host functions: config (which
instantiation for a problem), source (the instantiation's code), plan (its launch) and kernel name
(its cache name). The families are rows of one table, `families.FAMILIES`; everything else asks a
family instead of branching on its name.

A `GemmProblem` is one GEMM call's static shape with the family decided for its format
(`families.gemm_problem`); `instantiate` turns it into (name, source, plan_fn).

Also here: the hardware facts the families share (shared-memory capacities, the contiguous
layout's segment alignment, TMA swizzles, persistent launches).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Literal

from custom_calls.native.launch_plan import LaunchPlan
from layouts import GemmFormat
from layouts.archs import check_arch

GemmKind = Literal["normal", "contig", "masked"]
GEMM_KINDS = ("normal", "contig", "masked")
CdDtype = Literal["bf16", "f32"]

SM90_SMEM_CAPACITY = 232448
SM100_SMEM_CAPACITY = 232448
# The contiguous layout pads every expert segment to this many rows; it is BLOCK_M of the kernels.
CONTIG_ALIGNMENT = 128


def swizzle_mode(num_bytes: int) -> int:
    """Largest TMA swizzle (128/64/32/16 B) dividing a row of ``num_bytes``; 16 means none."""
    for mode in (128, 64, 32, 16):
        if num_bytes % mode == 0:
            return mode
    raise ValueError(f"row of {num_bytes} bytes is not a multiple of 16 (TMA needs 16-byte rows)")


class PersistentLaunch:
    """What the SM90 and SM100 GEMM configs share: persistent kernels (the scheduler strides over
    tiles by kNumSMs, so grid == num_sms exactly) whose CTAs along N share one A tile."""

    num_sms: int
    cluster_n: int

    @property
    def multicast_on_a(self) -> bool:
        return self.cluster_n > 1

    @property
    def grid(self) -> int:
        return self.num_sms


@dataclasses.dataclass(frozen=True)
class Sm90Tiling:
    """The parameters of the SM90 tile rules (sm90_gemm.py) for one template.

    ab_bytes: bytes of an A/B element in shared memory (a stage holds 128 bytes of K per row).
    max_block_n: the widest tile the accumulator registers hold.
    block_scales: FP8 1D2D scales: a BLOCK_M row of A scales per stage, the tile's 128-wide B scale
      blocks for every k block resident, and a BLOCK_N tile straddling at most two of them.
    unswizzled_cd: the D store also has an unswizzled path (swizzle 0 for bf16 D).
    """

    ab_bytes: int
    max_block_n: int
    block_scales: bool
    unswizzled_cd: bool


@dataclasses.dataclass(frozen=True, eq=False)
class KernelFamily:
    """One DeepGEMM kernel template (see the module docstring). One object per family, compared by
    identity. The host functions take the family's config type:

    config(problem, num_sms, tuning) -> config; source(config, n, k) -> str;
    plan(config, cubin, *, m, n, k) -> LaunchPlan; kernel_name(config, problem) -> str.
    """

    name: str  # in kernel names and tuned-config cache keys
    symbol: str  # the template's __global__ function (LaunchPlan.kernel)
    archs: tuple[int, ...]  # keys of layouts.ARCHS
    recipes: tuple[str, ...]  # the recipes whose GEMM format on those archs it reads
    block_k: int  # K of one pipeline stage; K must be a multiple of it
    cd_dtypes: tuple[CdDtype, ...]  # the output dtypes it writes
    dense: bool  # also serves dense D = A·Bᵀ (GEMM kind "normal")
    config: Callable[..., Any]
    source: Callable[..., str]
    plan: Callable[..., LaunchPlan]
    kernel_name: Callable[..., str]
    sm90: Sm90Tiling | None = None  # None: not tiled by the SM90 rules

    def __post_init__(self) -> None:
        for arch in self.archs:
            check_arch(arch)
        if self.sm90 is not None and self.sm90.ab_bytes * self.block_k != 128:
            raise ValueError(f"family {self.name!r}: an SM90 stage holds 128 bytes of K per row, got "
                             f"block_k {self.block_k} x {self.sm90.ab_bytes} bytes")

    def __repr__(self) -> str:
        return f"KernelFamily({self.name!r})"

    def serves(self, fmt: GemmFormat) -> bool:
        """Whether this family reads the operands of GEMM format ``fmt``."""
        return fmt.arch in self.archs and fmt.recipe in self.recipes


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """One GEMM call's static problem, D = A·Bᵀ, on ``family`` (which serves ``fmt``).

    gemm_kind: "normal" (dense A (m, K)), "contig" (A (M_cap, K), rows grouped by expert) or
    "masked" (A (G, m_pad, K)); m: M, M_cap or m_pad; B: (G, N, K) (dense: (N, K), G = 1);
    expected_m: masked only, the rows per group the tile is chosen for, in [1, m_pad];
    cd_dtype: D's dtype.
    """

    family: KernelFamily
    fmt: GemmFormat
    gemm_kind: GemmKind
    m: int
    n: int
    k: int
    num_groups: int = 1
    expected_m: int | None = None
    cd_dtype: CdDtype = "bf16"

    def __post_init__(self) -> None:
        if not self.family.serves(self.fmt):
            raise ValueError(f"family {self.family.name!r} does not serve {self.fmt.describe()}")
        if self.gemm_kind not in GEMM_KINDS:
            raise ValueError(f"gemm_kind: expected one of {GEMM_KINDS}, got {self.gemm_kind!r}")
        if self.gemm_kind == "normal" and not self.family.dense:
            raise ValueError(f"gemm_kind: family {self.family.name!r} has no dense kernel, got 'normal'")
        if min(self.m, self.n, self.k, self.num_groups) <= 0:
            raise ValueError(f"m, n, k, num_groups must be > 0, got {self.m}, {self.n}, {self.k}, {self.num_groups}")
        if self.gemm_kind == "masked" and not (isinstance(self.expected_m, int) and 1 <= self.expected_m <= self.m):
            raise ValueError(f"expected_m: masked needs an int in [1, m_pad={self.m}], got {self.expected_m!r}")
        if self.gemm_kind != "masked" and self.expected_m is not None:
            raise ValueError(f"expected_m: only masked GEMMs take it, got {self.expected_m!r}")
        if self.cd_dtype not in self.family.cd_dtypes:
            raise ValueError(f"cd_dtype: family {self.family.name!r} writes {self.family.cd_dtypes}, "
                             f"got {self.cd_dtype!r}")


Kernel = tuple[str, str, Callable[[str], LaunchPlan]]


def instantiate(problem: GemmProblem, num_sms: int, tuning: Any = None) -> Kernel:
    """(name, source, plan_fn) of the instantiation ``problem``'s family picks for ``num_sms`` SMs
    under ``tuning`` (an `autotune.TuningPolicy`, None: the heuristic); plan_fn(cubin) -> LaunchPlan."""
    fam = problem.family
    cfg = fam.config(problem, num_sms, tuning)
    plan_fn = functools.partial(fam.plan, cfg, m=problem.m, n=problem.n, k=problem.k)
    return fam.kernel_name(cfg, problem), fam.source(cfg, problem.n, problem.k), plan_fn
