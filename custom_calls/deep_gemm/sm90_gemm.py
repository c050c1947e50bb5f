"""The SM90 tile rules shared by the FP8 1D2D and BF16 templates (families with `Sm90Tiling`).

A config is a frozen dataclass: it fully determines the template instantiation (hence the cubin)
and the launch (grid, block, cluster, dynamic shared memory). The heuristic minimises a simple
L1/L2 traffic model over the legal tiles; any legal tile is correct, the model only ranks speed.
Shared-memory sizes mirror the kernels' own shared-storage layout and must stay consistent with it.
What differs between the templates (element size, the widest tile, the 1D2D scale blocks, the
unswizzled D store, the output dtypes) is read from the family (`family.Sm90Tiling`).
"""

from __future__ import annotations

import dataclasses

from layouts.checks import align, ceil_div

from .family import (CONTIG_ALIGNMENT, GEMM_KINDS, SM90_SMEM_CAPACITY, CdDtype, GemmKind, GemmProblem, KernelFamily,
                     PersistentLaunch, Sm90Tiling, swizzle_mode)

_SM90_MAX_STAGES = 16


@dataclasses.dataclass(frozen=True)
class Sm90GemmConfig(PersistentLaunch):
    """Tile, pipeline and launch of one SM90 GEMM instantiation of ``family``."""

    family: KernelFamily
    gemm_kind: GemmKind
    cd_dtype: CdDtype
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
    def num_threads(self) -> int:
        return self.num_tma_threads + self.num_math_threads


# Legal SM90 tiles. The rules below restate the kernels' static asserts and assumptions
# (sm90_fp8_gemm_1d2d.cuh, sm90_bf16_gemm.cuh, scheduler/gemm.cuh of the 0.2.5 templates):
# * BLOCK_M a multiple of the 64-row WGMMA or smaller (16, 32); BLOCK_M <= 64 runs one math warp
#   group, larger tiles two (each owns 64 rows of a 128-row wave), so math threads follow BLOCK_M;
# * contig: a block must not straddle two experts' segments (they start at multiples of 128);
#   masked: a block must not leave its group's m_pad slab (the TMA clips only at G·m_pad);
# * FP8 1D2D: BLOCK_K = 128 and a BLOCK_N tile may straddle at most two 128-wide scale blocks
#   (ceil(BN/128) == 1 or gcd(BN, 128) == BN - 128);
# * registers: BLOCK_N <= 192 (FP8; its second accumulator bank spills beyond) or 256 (BF16), and
#   no tile with both BLOCK_M > 128 and BLOCK_N > 128;
# * cluster 1 or 2 (the scheduler pairs at most two CTAs), with the grid (num_sms) divisible by it;
#   masked also needs an even number of N blocks per group when clustered: the two CTAs of a
#   cluster release each other's pipeline stages, so both must always work on the same group;
# * D store: TMA atoms of swizzle/2 columns, BLOCK_N a multiple of the atom, at most 32 atoms; the
#   BF16 kernel's bf16 path requires a swizzle, the FP8 kernel also has an unswizzled path;
# * shared memory: the kernels' own layout (below) within 232448 B, and the WGMMA reads of a
#   64-row A tile must stay inside the stage buffers when BLOCK_M < 64.
SM90_CLUSTERS = ((1, 1), (1, 2), (2, 1))  # (cluster_m: multicast of B, cluster_n: multicast of A)
_SM90_BLOCK_MS = (16, 32, 64, 128, 256)
_SM90_WGMMA_M = 64
_SM90_MIN_STAGES = 2  # the candidates are at least double-buffered


def _tiling(family: KernelFamily) -> Sm90Tiling:
    if family.sm90 is None:
        raise ValueError(f"family {family.name!r} is not tiled by the SM90 rules")
    return family.sm90


def _sm90_sizes(family: KernelFamily, cd_dtype: str) -> tuple[int, int, int]:
    """(A/B element bytes, C/D element bytes, BLOCK_K) of an SM90 instantiation."""
    return _tiling(family).ab_bytes, 2 if cd_dtype == "bf16" else 4, family.block_k


def sm90_smem_bytes(family: KernelFamily, cd_dtype: str, k: int, bm: int, bn: int, stages: int) -> int:
    """Dynamic shared memory of an SM90 instantiation, laid out as the kernel does: D tile (1 KiB
    aligned), ``stages`` × (A, B[, 1D2D A scales]), 1D2D B scales for every k block (two rows when a
    BLOCK_N tile straddles two 128-wide scale blocks), barriers (reserved for the maximum of 16 stages)."""
    ab_esize, cd_esize, bk = _sm90_sizes(family, cd_dtype)
    per_stage = bm * bk * ab_esize + bn * bk * ab_esize
    extra = align(bm * bn * cd_esize, 1024) + _SM90_MAX_STAGES * 8 * 2
    if _tiling(family).block_scales:
        per_stage += align(bm * 4, 128)
        extra += align(ceil_div(k, bk) * 4 * (1 if bk % bn == 0 else 2), 8)
    return extra + stages * per_stage


def sm90_max_stages(family: KernelFamily, cd_dtype: str, k: int, bm: int, bn: int) -> int:
    """Most pipeline stages (<= 16) whose shared memory fits the SM90 capacity."""
    one = sm90_smem_bytes(family, cd_dtype, k, bm, bn, 1)
    zero = sm90_smem_bytes(family, cd_dtype, k, bm, bn, 0)
    return min((SM90_SMEM_CAPACITY - zero) // (one - zero), _SM90_MAX_STAGES)


def sm90_swizzle_cd_choices(family: KernelFamily, cd_dtype: str, bn: int) -> tuple[int, ...]:
    """D-store swizzles the kernel accepts for BLOCK_N ``bn``, largest first (the heuristic's is first)."""
    if cd_dtype == "f32":
        return (0,)
    modes = [s for s in (128, 64, 32) if (bn * 2) % s == 0 and bn // (s // 2) <= 32]
    return tuple(modes + ([0] if _tiling(family).unswizzled_cd else []))


def sm90_tile_reason(family: KernelFamily, gemm_kind: GemmKind, m: int, n: int, bm: int, bn: int, cluster_m: int,
                     cluster_n: int, num_sms: int) -> str | None:
    """Why (bm, bn, cluster) is not a legal SM90 tile for this GEMM (see the rules above); None if legal.
    m: M_cap (contig), m_pad (masked) or M (normal)."""
    tiling = _tiling(family)
    if bm not in _SM90_BLOCK_MS:
        return f"BLOCK_M {bm} not in {_SM90_BLOCK_MS}"
    if gemm_kind == "contig" and CONTIG_ALIGNMENT % bm:
        return f"contig BLOCK_M {bm} would straddle the {CONTIG_ALIGNMENT}-row expert segments"
    if gemm_kind == "masked" and m % bm:
        return f"masked BLOCK_M {bm} does not divide m_pad {m}"
    bn_max = tiling.max_block_n
    if not (16 <= bn <= bn_max and bn % 16 == 0):
        return f"BLOCK_N {bn} must be a multiple of 16 in [16, {bn_max}]"
    if tiling.block_scales and bn > 128 and 128 % (bn - 128):
        return f"BLOCK_N {bn} spans more than two 128-wide B scale blocks"
    if bm > 128 and bn > 128:
        return f"BLOCK_M {bm} with BLOCK_N {bn} exceeds the register budget"
    if (cluster_m, cluster_n) not in SM90_CLUSTERS:
        return f"cluster ({cluster_m}, {cluster_n}) not in {SM90_CLUSTERS}"
    cluster = cluster_m * cluster_n
    if num_sms % cluster:
        return f"num_sms {num_sms} not divisible by the cluster size {cluster}"
    if gemm_kind == "masked" and ceil_div(n, bn) % cluster:
        return f"masked with cluster {cluster} needs the N blocks ({ceil_div(n, bn)}) divisible by it"
    return None


def sm90_build_config(family: KernelFamily, gemm_kind: GemmKind, cd_dtype: CdDtype, num_groups: int, num_sms: int,
                      k: int, bm: int, bn: int, cluster_m: int, cluster_n: int, num_stages: int | None = None,
                      swizzle_cd: int | None = None) -> Sm90GemmConfig:
    """The SM90 config of one tile; ``num_stages`` (default: as many as fit) and ``swizzle_cd``
    (default: the largest legal) are the pipeline choices."""
    ab_esize, _, bk = _sm90_sizes(family, cd_dtype)
    stages = sm90_max_stages(family, cd_dtype, k, bm, bn) if num_stages is None else num_stages
    swz = sm90_swizzle_cd_choices(family, cd_dtype, bn)[0] if swizzle_cd is None else swizzle_cd
    return Sm90GemmConfig(
        family=family, gemm_kind=gemm_kind, cd_dtype=cd_dtype,
        num_groups=1 if gemm_kind == "normal" else num_groups,
        block_m=bm, block_n=bn, block_k=bk, cluster_m=cluster_m, cluster_n=cluster_n, num_stages=stages,
        swizzle_a=swizzle_mode(bk * ab_esize), swizzle_b=swizzle_mode(bk * ab_esize), swizzle_cd=swz,
        smem_bytes=sm90_smem_bytes(family, cd_dtype, k, bm, bn, stages), num_tma_threads=128,
        num_math_threads=128 if bm <= _SM90_WGMMA_M else 256, num_sms=num_sms)


def sm90_config_reason(cfg: Sm90GemmConfig, m: int, n: int, k: int) -> str | None:
    """Why ``cfg`` cannot run D = A·Bᵀ of this shape (m as in sm90_tile_reason); None if it can.
    Checks every field against the tile rules and the kernel's shared-memory layout, so a config
    read from disk is as safe as one built here."""
    if cfg.family.sm90 is None or cfg.gemm_kind not in GEMM_KINDS:
        return f"family {cfg.family.name!r} is not tiled by the SM90 rules, or unknown GEMM kind {cfg.gemm_kind!r}"
    if cfg.cd_dtype not in cfg.family.cd_dtypes:
        return f"cd_dtype {cfg.cd_dtype!r} not supported by the {cfg.family.name} kernel"
    reason = sm90_tile_reason(cfg.family, cfg.gemm_kind, m, n, cfg.block_m, cfg.block_n, cfg.cluster_m,
                              cfg.cluster_n, cfg.num_sms)
    if reason:
        return reason
    ab_esize, _, bk = _sm90_sizes(cfg.family, cfg.cd_dtype)
    stages = cfg.num_stages
    if not _SM90_MIN_STAGES <= stages <= sm90_max_stages(cfg.family, cfg.cd_dtype, k, cfg.block_m, cfg.block_n):
        return f"num_stages {stages} outside [{_SM90_MIN_STAGES}, the most that fit in shared memory]"
    if _SM90_WGMMA_M * bk > (cfg.block_m * bk + cfg.block_n * bk * stages) * ab_esize:
        return "the 64-row WGMMA reads of A would run past the stage buffers"
    expect = sm90_build_config(cfg.family, cfg.gemm_kind, cfg.cd_dtype, cfg.num_groups, cfg.num_sms, k,
                               cfg.block_m, cfg.block_n, cfg.cluster_m, cfg.cluster_n, stages, cfg.swizzle_cd)
    if cfg.swizzle_cd not in sm90_swizzle_cd_choices(cfg.family, cfg.cd_dtype, cfg.block_n):
        return f"swizzle_cd {cfg.swizzle_cd} not legal for BLOCK_N {cfg.block_n}"
    if cfg != expect:
        diff = {f.name: (getattr(cfg, f.name), getattr(expect, f.name)) for f in dataclasses.fields(cfg)
                if getattr(cfg, f.name) != getattr(expect, f.name)}
        return f"fields inconsistent with the tile (got, expected): {diff}"
    return None


def sm90_tile_configs(problem: GemmProblem, num_sms: int) -> list[Sm90GemmConfig]:
    """One config per legal tile (BLOCK_M, BLOCK_N, cluster) of ``problem``: the most stages that
    fit, the largest D swizzle."""
    p = problem
    out = []
    for cm, cn in SM90_CLUSTERS:
        for bm in _SM90_BLOCK_MS:
            for bn in range(16, 257, 16):
                if sm90_tile_reason(p.family, p.gemm_kind, p.m, p.n, bm, bn, cm, cn, num_sms):
                    continue
                cfg = sm90_build_config(p.family, p.gemm_kind, p.cd_dtype, p.num_groups, num_sms, p.k, bm, bn, cm, cn)
                if sm90_config_reason(cfg, p.m, p.n, p.k) is None:
                    out.append(cfg)
    return out


def sm90_candidates(problem: GemmProblem, num_sms: int) -> list[Sm90GemmConfig]:
    """Every legal SM90 config for ``problem``: tiles × clusters × stages (2 .. the most that fit)
    × D swizzles. Any of them computes the same products (same k order, other tiling)."""
    p = problem
    out = []
    for tile in sm90_tile_configs(p, num_sms):
        for swz in sm90_swizzle_cd_choices(p.family, p.cd_dtype, tile.block_n):
            for stages in range(_SM90_MIN_STAGES, tile.num_stages + 1):
                cfg = dataclasses.replace(tile, num_stages=stages, swizzle_cd=swz,
                                          smem_bytes=sm90_smem_bytes(p.family, p.cd_dtype, p.k, tile.block_m,
                                                                     tile.block_n, stages))
                if sm90_config_reason(cfg, p.m, p.n, p.k) is None:
                    out.append(cfg)
    return out


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


def sm90_model_cost(cfg: Sm90GemmConfig, problem: GemmProblem) -> int:
    """The heuristic's traffic model for ``cfg`` on ``problem`` (lower is faster); masked prices
    expected_m rows per group."""
    p = problem
    ab_esize, cd_esize, _ = _sm90_sizes(cfg.family, cfg.cd_dtype)
    masked = cfg.gemm_kind == "masked"
    return _sm90_cycles(cfg.gemm_kind, p.expected_m if (masked and p.expected_m) else p.m, p.n, p.k,
                        cfg.num_groups if masked else 1, cfg.block_m, cfg.block_n, cfg.cluster_m, cfg.cluster_n,
                        ab_esize, cd_esize, cfg.num_sms)


def _heuristic_block_ms(gemm_kind: GemmKind, m: int, cd_dtype: str) -> list[int]:
    """The BLOCK_Ms DeepGEMM's heuristic considers."""
    if gemm_kind == "contig":
        return [CONTIG_ALIGNMENT]
    if gemm_kind == "masked":
        return [64, 128]
    return [64, 128] + ([16] if m <= 16 else []) + ([32] if m <= 32 else []) + ([256] if cd_dtype == "bf16" else [])


def sm90_gemm_config(problem: GemmProblem, num_sms: int) -> Sm90GemmConfig:
    """Pick the SM90 tile for ``problem`` (DeepGEMM's heuristic: the legal tile of least modelled
    traffic, with the most stages that fit and the largest D swizzle; one of ``sm90_candidates``).

    m (problem.m): rows of A (dense, contiguous M_cap) or per-group slab rows (masked, m_pad). For
    masked, ``expected_m`` (rows per group expected at run time) replaces m in the cost model.
    """
    p = problem
    tiling = _tiling(p.family)
    if num_sms <= 0 or num_sms % 2:
        raise ValueError(f"num_sms must be a positive even number, got {num_sms}")
    ab_esize, cd_esize, _ = _sm90_sizes(p.family, p.cd_dtype)
    cost_m = p.expected_m if (p.gemm_kind == "masked" and p.expected_m) else p.m
    cost_groups = p.num_groups if p.gemm_kind == "masked" else 1

    best = None
    for cm, cn in SM90_CLUSTERS:
        for bm in _heuristic_block_ms(p.gemm_kind, p.m, p.cd_dtype):
            for bn in range(16, tiling.max_block_n + 1, 16):
                if sm90_tile_reason(p.family, p.gemm_kind, p.m, p.n, bm, bn, cm, cn, num_sms):
                    continue
                stages = sm90_max_stages(p.family, p.cd_dtype, p.k, bm, bn)
                if stages < 3 or (bm * bn < 128 * 192 and stages < 4):
                    continue
                cycles = _sm90_cycles(p.gemm_kind, cost_m, p.n, p.k, cost_groups, bm, bn, cm, cn,
                                      ab_esize, cd_esize, num_sms)
                if best is None or cycles < best[0]:
                    best = (cycles, bm, bn, cm, cn)
    if best is None:
        raise ValueError(f"no legal SM90 {p.family.name} tile for m={p.m} n={p.n} k={p.k} groups={p.num_groups}")
    _, bm, bn, cm, cn = best
    return sm90_build_config(p.family, p.gemm_kind, p.cd_dtype, p.num_groups, num_sms, p.k, bm, bn, cm, cn)


# --- what the SM90 families share beyond the tile ------------------------------------------------

def sm90_kernel_name(cfg: Sm90GemmConfig, problem: GemmProblem) -> str:
    """Cache name of an SM90 GEMM instantiation (the tile in it; stages, cluster and swizzle are
    in the source, which the cache key hashes)."""
    p = problem
    tile = f"{cfg.block_m}x{cfg.block_n}"
    if p.gemm_kind == "normal":
        return f"sm90_{p.family.name}_dense_{p.cd_dtype}_n{p.n}_k{p.k}_{tile}"
    return f"sm90_{p.family.name}_{p.gemm_kind}_n{p.n}_k{p.k}_g{p.num_groups}_{tile}"


def sm90_cd_box(cfg: Sm90GemmConfig, esize: int) -> int:
    """Columns of the D store's TMA box: one swizzle atom, or the whole tile unswizzled."""
    return cfg.swizzle_cd // esize if cfg.swizzle_cd >= 32 else cfg.block_n


def sm90_operand_rows(cfg: Sm90GemmConfig, m: int, n: int) -> tuple[int, int]:
    """Rows the tensor maps of A and B span: a masked A is (G, m_pad, K), a grouped B (G, N, K);
    m: rows of A (normal/contig) or m_pad (masked)."""
    g = cfg.num_groups
    return (g * m if cfg.gemm_kind == "masked" else m), (g * n if cfg.gemm_kind != "normal" else n)
