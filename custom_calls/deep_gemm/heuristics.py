"""Per-shape kernel configuration for DeepGEMM's SM90 and SM100 templates.

A config is a frozen dataclass: it fully determines the template instantiation (hence the cubin)
and the launch (grid, block, cluster, dynamic shared memory). The SM90 choice minimises a simple
L1/L2 traffic model over the legal tiles; any legal tile is correct, the model only ranks speed.
Shared-memory sizes mirror the kernels' own shared-storage layout and must stay consistent with it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from layouts import gemm_format
from layouts.checks import align, ceil_div  # noqa: F401  (re-exported to the host modules)

GemmKind = Literal["normal", "contig", "masked"]

SM90_SMEM_CAPACITY = 232448
SM100_SMEM_CAPACITY = 232448
# The contiguous layout pads every expert segment to this many rows; it is BLOCK_M of the kernels.
CONTIG_ALIGNMENT = 128
_SM90_MAX_STAGES = 16
_SM100_MAX_STAGES = 32


def swizzle_mode(num_bytes: int) -> int:
    """Largest TMA swizzle (128/64/32/16 B) dividing a row of ``num_bytes``; 16 means none."""
    for mode in (128, 64, 32, 16):
        if num_bytes % mode == 0:
            return mode
    raise ValueError(f"row of {num_bytes} bytes is not a multiple of 16 (TMA needs 16-byte rows)")


@dataclasses.dataclass(frozen=True)
class Sm90GemmConfig:
    """Tile, pipeline and launch of one SM90 FP8 1D2D or BF16 GEMM instantiation."""

    kernel: Literal["fp8_1d2d", "bf16"]
    gemm_kind: GemmKind
    cd_dtype: Literal["bf16", "f32"]
    num_groups: int  # template kNumGroups: 1 for dense
    block_m: int
    block_n: int
    block_k: int
    cluster_m: int  # CTAs sharing one B tile (multicast of B)
    cluster_n: int  # CTAs sharing one A tile (multicast of A)
    num_stages: int
    swizzle_a: int
    swizzle_b: int
    swizzle_cd: int
    smem_bytes: int
    num_tma_threads: int
    num_math_threads: int
    num_sms: int

    @property
    def cluster(self) -> int:
        return self.cluster_m * self.cluster_n

    @property
    def multicast_on_a(self) -> bool:
        return self.cluster_n > 1

    @property
    def num_threads(self) -> int:
        return self.num_tma_threads + self.num_math_threads

    @property
    def grid(self) -> int:
        # Persistent kernels: the scheduler strides over tiles by kNumSMs, so grid == num_sms exactly.
        return self.num_sms


def _sm90_pipeline(kernel: str, cd_esize: int, k: int, bm: int, bn: int, bk: int, ab_esize: int) -> tuple[int, int]:
    """(num_stages, smem_bytes) filling the SM90 shared memory the way the kernels lay it out."""
    smem_cd = align(bm * bn * cd_esize, 1024)
    smem_barriers = _SM90_MAX_STAGES * 8 * 2
    per_stage = bm * bk * ab_esize + bn * bk * ab_esize
    extra_sfb = 0
    if kernel == "fp8_1d2d":
        per_stage += align(bm * 4, 128)  # SFA
        # SFB for every k block, twice when a BLOCK_N tile straddles two 128-row scale blocks.
        extra_sfb = align(ceil_div(k, bk) * 4 * (1 if bk % bn == 0 else 2), 8)
    extra = smem_cd + smem_barriers + extra_sfb
    stages = min((SM90_SMEM_CAPACITY - extra) // per_stage, _SM90_MAX_STAGES)
    return stages, extra + stages * per_stage


def _sm90_cycles(kind: GemmKind, m: int, n: int, k: int, groups: int, bm: int, bn: int, cm: int, cn: int,
                 ab_esize: int, cd_esize: int, num_sms: int) -> int:
    """Relative cost: L1/L2 bytes moved over bandwidth, divided by wave efficiency."""
    blocks = ceil_div(m, bm) * ceil_div(n, bn) * groups
    waves = ceil_div(blocks, num_sms)
    if cm * cn > 1 and waves <= 1:
        return 1 << 62  # cluster sync costs more than multicast saves on a single wave
    if cm * cn > 1 and kind == "masked" and m <= bm:
        return 1 << 62
    l2_bw = int(min(64 * num_sms, 8e6 / 1.3e3))
    l1_bw = 128 * num_sms
    cd = bm * bn * cd_esize
    l2 = k * (bm // cn * ab_esize + bn // cm * ab_esize) + cd
    l1 = k * (bm + bn) * ab_esize + k * (max(64, bm) + bn) * ab_esize + cd + cd
    eff = blocks / (waves * num_sms)
    return int(max(l1 * blocks // l1_bw, l2 * blocks // l2_bw) / eff)


def sm90_gemm_config(kernel: Literal["fp8_1d2d", "bf16"], gemm_kind: GemmKind, m: int, n: int, k: int,
                     num_groups: int, num_sms: int, *, cd_dtype: Literal["bf16", "f32"] = "bf16",
                     expected_m: int | None = None) -> Sm90GemmConfig:
    """Pick the SM90 tile for D = A·Bᵀ.

    m: rows of A (dense, contiguous M_cap) or per-group slab rows (masked, m_pad). For masked,
    ``expected_m`` (rows per group expected at run time) replaces m in the cost model.
    """
    if kernel not in ("fp8_1d2d", "bf16"):
        raise ValueError(f"kernel must be 'fp8_1d2d' or 'bf16', got {kernel!r}")
    if num_sms <= 0 or num_sms % 2:
        raise ValueError(f"num_sms must be a positive even number, got {num_sms}")
    if kernel == "fp8_1d2d" and cd_dtype != "bf16":
        raise ValueError(f"the FP8 1D2D kernel writes bf16 only, got cd_dtype={cd_dtype!r}")
    ab_esize = 1 if kernel == "fp8_1d2d" else 2
    cd_esize = 2 if cd_dtype == "bf16" else 4
    bk = 128 // ab_esize
    if gemm_kind == "contig":
        bms = [CONTIG_ALIGNMENT]
    elif gemm_kind == "masked":
        bms = [64, 128]
    else:
        bms = [64, 128] + ([16] if m <= 16 else []) + ([32] if m <= 32 else []) + ([256] if cd_dtype == "bf16" else [])
    bn_max = 192 if kernel == "fp8_1d2d" else 256  # larger 1D2D tiles spill registers
    bns = list(range(16, bn_max + 1, 16))
    cost_m = expected_m if (gemm_kind == "masked" and expected_m) else m
    cost_groups = num_groups if gemm_kind == "masked" else 1

    best = None
    for cm, cn in ((1, 1), (1, 2), (2, 1)):
        if num_sms % (cm * cn):
            continue
        for bm in bms:
            for bn in bns:
                # The 1D2D math loop unrolls over the 128-column scale boundary inside a BLOCK_N tile.
                if kernel == "fp8_1d2d" and bn > bk and bn % (bn - bk) and bk % (bn - bk):
                    continue
                if gemm_kind == "masked" and ceil_div(n, bn) % (cm * cn):
                    continue
                if bm > 128 and bn > 128:
                    continue
                stages, smem = _sm90_pipeline(kernel, cd_esize, k, bm, bn, bk, ab_esize)
                if stages < 3 or (bm * bn < 128 * 192 and stages < 4):
                    continue
                cycles = _sm90_cycles(gemm_kind, cost_m, n, k, cost_groups, bm, bn, cm, cn,
                                      ab_esize, cd_esize, num_sms)
                if best is None or cycles < best[0]:
                    best = (cycles, bm, bn, cm, cn, stages, smem)
    if best is None:
        raise ValueError(f"no legal SM90 {kernel} tile for m={m} n={n} k={k} groups={num_groups}")
    _, bm, bn, cm, cn, stages, smem = best
    return Sm90GemmConfig(
        kernel=kernel, gemm_kind=gemm_kind, cd_dtype=cd_dtype,
        num_groups=1 if gemm_kind == "normal" else num_groups,
        block_m=bm, block_n=bn, block_k=bk, cluster_m=cm, cluster_n=cn, num_stages=stages,
        swizzle_a=swizzle_mode(bk * ab_esize), swizzle_b=swizzle_mode(bk * ab_esize),
        swizzle_cd=swizzle_mode(bn * cd_esize) if cd_dtype == "bf16" else 0,
        smem_bytes=smem, num_tma_threads=128, num_math_threads=128 if bm <= 64 else 256, num_sms=num_sms)


@dataclasses.dataclass(frozen=True)
class Sm90PrenormConfig:
    """TF32 GEMM x·fnᵀ with per-row sum of squares (sm90_tf32_hc_prenorm_gemm)."""

    n: int
    k: int
    block_m: int
    block_n: int
    block_k: int
    num_splits: int
    swizzle_cd: int
    num_stages: int
    smem_bytes: int  # the launch asks for the whole capacity; the kernel's storage fits in it
    num_math_threads: int = 128
    num_tma_threads: int = 128

    @property
    def num_threads(self) -> int:
        return self.num_math_threads + self.num_tma_threads

    def grid(self, m: int) -> int:
        return self.num_splits * ceil_div(m, self.block_m)


def sm90_prenorm_config(n: int, k: int, num_splits: int = 1) -> Sm90PrenormConfig:
    if not (0 < n <= 32 and n % 8 == 0):
        raise ValueError(f"prenorm GEMM needs 0 < n <= 32 and n % 8 == 0, got n={n}")
    if k <= 0 or k % 64:
        raise ValueError(f"prenorm GEMM needs k a positive multiple of 64, got k={k}")
    if num_splits < 1 or ceil_div(k, 64) < num_splits:
        raise ValueError(f"num_splits must be in [1, k/64], got {num_splits}")
    bm, bk = 64, 64
    bn = align(n, 16)
    swz = swizzle_mode(bn * 4)
    stages = 0
    for s in range(12, 0, -1):
        if s * (bm * bk * 2 + bn * bk * 4) + bm * swz + 16 * s <= SM90_SMEM_CAPACITY:
            stages = s
            break
    return Sm90PrenormConfig(n=n, k=k, block_m=bm, block_n=bn, block_k=bk, num_splits=num_splits,
                             swizzle_cd=swz, num_stages=stages, smem_bytes=SM90_SMEM_CAPACITY)


# --- SM100 -------------------------------------------------------------------------------------

Sm100Recipe = Literal["fp8_block", "mxfp8", "mxfp4"]
# (gran_k of A's scales, gran_k of B's scales, B element type)
def sm100_operands(recipe: str) -> tuple[int, int, str]:
    """(gran_k of A, gran_k of B, B's element type) of the SM100 1D1D kernel for `recipe`, from its
    GEMM format on arch 100; FP4 weights are unpacked to 8 bit in shared memory."""
    fmt = gemm_format(recipe, 100)
    if not fmt.is_quantized:
        raise ValueError(f"recipe: the SM100 1D1D kernel serves quantized recipes, got {recipe!r}")
    return fmt.act_group, fmt.weight_block[1], "e2m1_unpacked" if fmt.rhs_k_pack == 2 else "e4m3"


@dataclasses.dataclass(frozen=True)
class Sm100GemmConfig:
    """m-grouped sm100_fp8_fp4_gemm_1d1d instantiation (swap-AB, 2-CTA multicast of A when legal)."""

    recipe: str
    gemm_kind: GemmKind
    num_groups: int
    gran_k_a: int
    gran_k_b: int
    b_dtype: str
    block_m: int
    block_n: int
    block_k: int
    cluster_n: int
    num_stages: int
    num_tma_store_stages: int
    swizzle_a: int
    swizzle_b: int
    swizzle_cd: int
    load_block_m: int
    load_block_n: int
    store_block_m: int
    store_block_n: int
    smem_bytes: int
    num_sms: int
    num_non_epilogue_threads: int = 128
    num_epilogue_threads: int = 128

    @property
    def cluster(self) -> int:
        return self.cluster_n

    @property
    def multicast_on_a(self) -> bool:
        return self.cluster_n > 1

    @property
    def num_threads(self) -> int:
        return self.num_non_epilogue_threads + self.num_epilogue_threads

    @property
    def grid(self) -> int:
        return self.num_sms


def sm100_mgrouped_config(recipe: str, gemm_kind: GemmKind, n: int, k: int, num_groups: int,
                          num_sms: int) -> Sm100GemmConfig:
    gka, gkb, b_dtype = sm100_operands(recipe)
    if gemm_kind not in ("contig", "masked"):
        raise ValueError(f"SM100 config covers m-grouped GEMMs only, got {gemm_kind!r}")
    if num_sms <= 0 or num_sms % 2:
        raise ValueError(f"num_sms must be a positive even number, got {num_sms}")
    bm, bn, bk = CONTIG_ALIGNMENT, 128, 128  # 128·8/element_bits for FP8 and FP8×FP4
    cluster_n = 2 if ceil_div(n, 128) % 2 == 0 else 1
    load_bm, load_bn = bm // cluster_n, 128
    store_bm, store_bn = 16, 128
    cd = store_bm * store_bn * 2 * 2  # two TMA-store stages of bf16
    extra = cd + (32 * 8 * 3 + 2 * 8 * 3 + 8) + 4  # barriers + tensor-memory pointer
    per_stage = load_bm * bk + load_bn * bk + align(bm, 128) * bk // 32 + 128 * bk // 32
    stages = min((SM100_SMEM_CAPACITY - extra) // per_stage, _SM100_MAX_STAGES)
    return Sm100GemmConfig(
        recipe=recipe, gemm_kind=gemm_kind, num_groups=num_groups, gran_k_a=gka, gran_k_b=gkb,
        b_dtype=b_dtype, block_m=bm, block_n=bn, block_k=bk, cluster_n=cluster_n, num_stages=stages,
        num_tma_store_stages=2, swizzle_a=128, swizzle_b=128, swizzle_cd=128,
        load_block_m=load_bm, load_block_n=load_bn, store_block_m=store_bm, store_block_n=store_bn,
        smem_bytes=extra + stages * per_stage, num_sms=num_sms)
