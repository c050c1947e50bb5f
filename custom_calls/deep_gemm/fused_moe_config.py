"""The fused MoE kernel's configuration (sm90_fp8_mega_moe_impl of the sgl-deep-gemm 0.2.5
templates): its template values per problem and the rules they obey (the variants the benchmark
times are built in `moe_jax.bench.fused`). Shared-memory sizes restate the kernel's own SMEM_*
layout and must stay consistent with it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from layouts import FusedMoEBuffer
from layouts.checks import align, ceil_div

from .family import SM90_SMEM_CAPACITY

# One persistent kernel runs dispatch, GEMM1, SwiGLU + FP8 quantization, GEMM2 and the top-k
# combine (sm90_fp8_mega_moe.cuh of the 0.2.5 templates, single rank). The instantiation we use
# and why (the kernel's static asserts and DeepGEMM's own host rules):
# * BLOCK_K 128 (one scale per 128 channels) and BLOCK_N 256: BLOCK_N 128 fails the L2 act-SF group
#   asserts at both BLOCK_Ms, 512 the "two weight-SF blocks per warpgroup tile" assert;
# * threads: 64 dispatch + 64 TMA loaders + 256 math (the epilogue is fixed at two warpgroups, the
#   dispatch needs >= 2 warps, and 64/64 is the kernel's 104/200 register split at BLOCK_M 128);
# * BLOCK_M 64, the kernel's decode topology (the two math warpgroups split N and share one act-SF
#   group), when an expert expects fewer than 64 routes, else 128 (they split M). BLOCK_M 128 needs
#   kReuseAccumAsFinal (two weight-SF blocks per warpgroup tile, which the promotion path refuses)
#   and kHalfL2CD (the one-pass L2 staging fails the scatter-width assert);
# * one expert wave (kNumExpertsPerWave = E: L1 of every expert, then L2; DeepGEMM's host asserts
#   it at BLOCK_M 128) and a ring covering the whole pool (kNumRingTokens = pool tokens);
# * kL2ArrivalCounter: with the full-pool ring each math warpgroup publishes its L1 tile with one
#   atomic add, without the CTA-wide barrier per tile that the bit-mask form takes;
# * kL2EpilogueRequiresFullSync false: the L1 and L2 output staging of the two warpgroups alias one
#   shared buffer, but a stage is refilled only after all 8 math warps released it, so one warpgroup
#   runs at most kNumStages k-blocks ahead of the other. With more k-blocks than stages in both
#   GEMMs, it cannot reach its next epilogue while the other still reads the staging; the stage
#   count is capped below both k-block counts so that this always holds;
# * grid = num_sms exactly (software grid barriers, a scheduler striding by kNumSMs), even (the
#   scheduler pairs CTAs) and >= 2; one CTA per SM, all co-resident.
# Schedule options (the template parameters after kHalfL2CD), from `python -m moe_jax.bench fused` on
# one H200 (32 experts, top-8, H 7168, I 2048; every option bit-identical in output; two runs):
# * BLOCK_M 128: the L2 output staged in four row passes through stmatrix (kL2CDPasses 4,
#   kL2StageMode 4; plain shared stores, mode 2, where a warpgroup's weight-scale slot is under the
#   256 bytes stmatrix parks its unused rows in) instead of two column passes; the smaller staging
#   buffer makes room for a 4th stage. Faster by 1.8-4.0 % at 512 tokens, 0.7-9.8 % at 4096 (the
#   spread of the traces: prefill runs under the power cap);
# * BLOCK_M 64: 2-CTA clusters with the weight tile multicast to the pair (kClusterSize 2,
#   kMulticastOnB) once an expert expects half a block of routes or more: the two m-blocks of an
#   expert with more than 64 routes then read its weights once. -4 % at 128 tokens (32 expected,
#   up to 79 routes per expert); at 32 tokens (8 expected) it costs 0.9 %, so not there;
# * BLOCK_M 128: the same clusters once an expert expects a whole block of routes, while the
#   pipeline keeps 4 stages. Measured in a steady stream (back-to-back layers, the GPU at its power
#   limit), not in short traces, where they lose 0.4-1.5 %: faster by 1.5-3.8 % at 512 tokens,
#   2.2-4.7 % at 1024, 2.2-5.9 % at 4096 and 1.1-3.9 % at 8192 (2048: three of four passes);
#   at 256 tokens (64 expected) within +-1.8 %, and at 16384, whose token pool leaves room for 3
#   stages only, 0.3-3.4 % slower;
# * not config fields (the template's defaults, written as literals by `codegen`): the L2-lag
#   schedule (9-38 % slower at every size), early combine and batched pull publish (within +-2 %,
#   not both runs), and the eager pull publish (neutral).
FUSED_MOE_BLOCK_N = 256
FUSED_MOE_BLOCK_K = 128
_FUSED_MOE_MIN_STAGES = 2
_FUSED_MOE_MAX_STAGES = 32  # only bounds the search; shared memory caps far below
_FUSED_MOE_MAX_TOP_K = 32  # a token's routes are read by one warp
_FUSED_MOE_DECODE_ROUTES = 64  # below this many expected routes per expert: BLOCK_M 64
_FUSED_MOE_CLUSTER_ROUTES = 32  # from this many expected routes per expert, BLOCK_M 64 runs 2-CTA clusters
_FUSED_MOE_CLUSTER_ROUTES_M128 = 128  # and BLOCK_M 128 from this many,
_FUSED_MOE_CLUSTER_MIN_STAGES = 4  # where its clusters keep at least this many stages
_FUSED_MOE_COMBINE_WARPS = 8  # the combine runs on the 8 math warps


def _fused_moe_weight_sf_floats(hidden: int, intermediate: int, block_m: int, block_n: int) -> int:
    """kNumWeightSFFloatsPerWG: a math warpgroup's weight-scale slot (GEMM1's or GEMM2's, the larger)."""
    split_n = block_m == 64 and block_n // 2 in (64, 128)  # kSplitNWarpgroups
    wg_block_n = block_n // 2 if split_n else block_n
    sf_groups_per_wg = wg_block_n // 128 if wg_block_n >= 128 else 1
    return max(2 * (hidden // 128), sf_groups_per_wg * (intermediate // 128))


def _fused_moe_shared_layout(*, max_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int,
                             block_m: int, num_stages: int, num_sms: int, half_l2_cd: bool,
                             block_n: int = FUSED_MOE_BLOCK_N, num_dispatch_threads: int = 64,
                             l2_cd_passes: int = 0) -> tuple[int, int]:
    """(dynamic shared memory, SMEM_BEFORE_BARRIER_SIZE) of sm90_fp8_mega_moe_impl, its SMEM_*
    constants restated (2 math warpgroups; the cluster size does not change the layout)."""
    pool = FusedMoEBuffer(max_tokens, hidden, intermediate, num_experts, top_k, block_m).pool_tokens
    dispatch_warps = num_dispatch_threads // 32
    send = align(hidden * dispatch_warps, 1024)  # one FP8 token per dispatch warp
    weight_sf = align(2 * _fused_moe_weight_sf_floats(hidden, intermediate, block_m, block_n) * 4, 128)
    cd_l1 = block_m * (block_n // 2)  # FP8 SwiGLU output
    passes = l2_cd_passes or (2 if half_l2_cd else 1)  # kNumL2CDPasses: the BF16 tile staged in N passes
    cd_l2 = block_m * (block_n // passes) * 2
    cd = align(max(cd_l1, cd_l2), 1024)
    a_stage, b_stage = block_m * FUSED_MOE_BLOCK_K, block_n * FUSED_MOE_BLOCK_K
    sfa_stage = align(block_m * 4, 128)
    barriers = dispatch_warps + 2 * num_stages + 2 * _FUSED_MOE_COMBINE_WARPS
    before_barrier = send + cd + num_stages * (a_stage + b_stage)
    tile_table_offset = align(send + cd + num_stages * (a_stage + b_stage + sfa_stage) + weight_sf + 8 * barriers, 16)
    # get_sm90_tile_table_entries_compact: the round-robin share of the tiles plus end marker and spare
    tiles = (pool // block_m) * (2 * intermediate // block_n + hidden // block_n)
    entries = ceil_div(tiles, num_sms) + 2
    # the per-expert routing counts (u32) live in the table's region before the table is built
    tile_region = max(8 * entries, 4 * num_experts)
    ec_offset = align(tile_table_offset + tile_region, 8)
    # SMEM_PULL_PENDING_OFFSET + _SIZE: the early-combine block and the pull-pending list are empty
    # at the template's defaults (no early combine, per-row pull publish), which the library uses
    return align(ec_offset, 16), before_barrier


def sm90_fused_moe_smem_bytes(*, max_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int,
                              block_m: int, num_stages: int, num_sms: int, half_l2_cd: bool,
                              block_n: int = FUSED_MOE_BLOCK_N, num_dispatch_threads: int = 64,
                              l2_cd_passes: int = 0) -> int:
    """Dynamic shared memory of the fused MoE kernel (its SMEM_PULL_PENDING_OFFSET +
    SMEM_PULL_PENDING_SIZE): dispatch send buffers, the output staging (1 KiB aligned), the A/B
    stages, the activation-scale stages, the weight-scale slots, the barriers and the tile table
    (the early-combine block and the pull-publish list are empty at the template's defaults)."""
    return _fused_moe_shared_layout(
        max_tokens=max_tokens, hidden=hidden, intermediate=intermediate, num_experts=num_experts, top_k=top_k,
        block_m=block_m, num_stages=num_stages, num_sms=num_sms, half_l2_cd=half_l2_cd, block_n=block_n,
        num_dispatch_threads=num_dispatch_threads, l2_cd_passes=l2_cd_passes)[0]


@dataclasses.dataclass(frozen=True)
class Sm90FusedMoEConfig:
    """The template values of one sm90_fp8_mega_moe_impl instantiation, with the launch they imply.
    The rest are fixed (`codegen.sm90_fused_moe_source` writes them): one rank,
    kNumMaxPoolTokens = kNumRingTokens = pool_tokens, kNumPaddedSFPoolTokens = padded_sf_tokens,
    kEpilogueRegisterBudget 0 (the kernel's own register split), kFastMath, kReuseAccumAsFinal and
    kL2ArrivalCounter on, kL2EpilogueRequiresFullSync off (the stages stay below the k-blocks), and
    the L2-lag schedule, early combine and pull publish at the template's defaults (wave schedule,
    off, per-row publish one pull later)."""

    max_tokens: int  # kNumMaxTokensPerRank
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    experts_per_wave: int
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_dispatch_threads: int
    num_non_epilogue_threads: int
    num_epilogue_threads: int
    num_sms: int
    activation_clamp: float | None  # a float32 value; None: infinity, which compiles the clamp out
    half_l2_cd: bool
    # schedule and staging options (template parameters after kHalfL2CD; the defaults are the
    # template's own; `sm90_fused_moe_config` sets some by its rule, the benchmark's candidates
    # (`moe_jax.bench.fused`) vary them all)
    cluster_size: int = 1  # kClusterSize; 2 multicasts the weight tile to the CTA pair (kMulticastOnB)
    l2_cd_passes: int = 0  # kL2CDPasses: 0 the kernel's choice (2 with kHalfL2CD, else 1), or 1, 2, 4
    l2_stage_mode: int = 0  # kL2StageMode: 0 column passes, 2 / 4 row passes (shared stores / stmatrix)
    # kPDL: launched with programmatic dependent launch, so the CTA-local prologue (barrier init,
    # shared-memory setup) overlaps the input kernel (which signals its dependents as it starts)
    # before griddepcontrol.wait
    pdl: bool = False
    # kTrace: a diagnostic build that records the kernel's events (`fused_moe.fused_moe_traced`);
    # never chosen by the rule
    trace: bool = False

    @property
    def buffer(self) -> FusedMoEBuffer:
        return FusedMoEBuffer(self.max_tokens, self.hidden, self.intermediate, self.num_experts, self.top_k,
                              self.block_m)

    @property
    def pool_tokens(self) -> int:
        """kNumMaxPoolTokens (and kNumRingTokens: the ring covers the pool)."""
        return self.buffer.pool_tokens

    @property
    def padded_sf_tokens(self) -> int:
        """kNumPaddedSFPoolTokens."""
        return self.buffer.padded_sf_tokens

    @property
    def smem_bytes(self) -> int:
        return sm90_fused_moe_smem_bytes(
            max_tokens=self.max_tokens, hidden=self.hidden, intermediate=self.intermediate,
            num_experts=self.num_experts, top_k=self.top_k, block_m=self.block_m, num_stages=self.num_stages,
            num_sms=self.num_sms, half_l2_cd=self.half_l2_cd, block_n=self.block_n,
            num_dispatch_threads=self.num_dispatch_threads, l2_cd_passes=self.l2_cd_passes)

    @property
    def num_threads(self) -> int:
        return self.num_dispatch_threads + self.num_non_epilogue_threads + self.num_epilogue_threads

    @property
    def grid(self) -> int:
        return self.num_sms


def _bits_for(value: int) -> int:
    """SM90MegaMoEScheduler::bits_for: bits of ``value`` (at least 1, at most 32)."""
    return min(max(value.bit_length(), 1), 32)


def _fused_moe_block_m(max_tokens: int, top_k: int, num_experts: int) -> int:
    return 64 if max_tokens * top_k < _FUSED_MOE_DECODE_ROUTES * num_experts else 128


def _fused_moe_combine_reason(hidden: int, before_barrier: int) -> str | None:
    """The combine stages 3 rows per math warp in the shared memory before the barriers, in 1, 2 or
    4 chunks (its static asserts)."""
    row_bytes = 2 * hidden
    slots = 3 * _FUSED_MOE_COMBINE_WARPS
    if slots * row_bytes <= before_barrier and hidden <= 32 * 128:
        chunks = 1
    else:
        chunks = 2 if slots * row_bytes // 2 <= before_barrier else 4
    if slots * row_bytes // chunks > before_barrier:
        return (f"hidden: expected the combine staging ({slots} rows of {row_bytes} bytes in {chunks} chunks) "
                f"within the {before_barrier} bytes before the barriers, got hidden={hidden}")
    if (row_bytes // chunks) % (32 * 16):
        return (f"hidden: expected a combine chunk ({chunks} per row) of a multiple of 512 bytes, got "
                f"hidden={hidden} ({row_bytes // chunks} bytes)")
    return None


def _fused_moe_plan(*, hidden, intermediate, num_experts, top_k, max_tokens, num_sms, block_m=None
                    ) -> tuple[str | None, int, int]:
    """(why the kernel cannot serve this problem or None, BLOCK_M, stages); block_m None: the rule."""
    args = dict(hidden=hidden, intermediate=intermediate, num_experts=num_experts, top_k=top_k,
                max_tokens=max_tokens, num_sms=num_sms)
    for name, value in args.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            return f"{name}: expected a positive int, got {value!r}", 0, 0
    hidden, intermediate, num_experts, top_k, max_tokens, num_sms = map(int, args.values())
    if num_sms % 2 or num_sms < 2:
        return (f"num_sms: expected an even number >= 2 (the scheduler pairs CTAs, the grid barriers need "
                f"two), got {num_sms}"), 0, 0
    if hidden % 512:
        return (f"hidden: expected a multiple of 512 (GEMM2 needs an even number of {FUSED_MOE_BLOCK_N}-wide "
                f"N blocks; H/128 fp32 scales per token fill 16-byte rows), got {hidden}"), 0, 0
    if intermediate % 256:
        return (f"intermediate: expected a multiple of 256 (GEMM1 needs an even number of "
                f"{FUSED_MOE_BLOCK_N}-wide N blocks over 2I), got {intermediate}"), 0, 0
    if top_k > _FUSED_MOE_MAX_TOP_K:
        return f"top_k: expected at most {_FUSED_MOE_MAX_TOP_K} (one warp reads a token's routes), got {top_k}", 0, 0
    if top_k > num_experts:
        return (f"top_k: expected at most num_experts = {num_experts} (the pool is sized for distinct experts "
                f"per token), got {top_k}"), 0, 0
    if (max_tokens * top_k) % 4:
        return (f"max_tokens: expected max_tokens * top_k to be a multiple of 4 (the buffer regions after the "
                f"top-k inputs are TMA operands and must start on 16-byte boundaries), got "
                f"{max_tokens} * {top_k} = {max_tokens * top_k}"), 0, 0
    if block_m is None:
        block_m = _fused_moe_block_m(max_tokens, top_k, num_experts)
    elif block_m not in (64, 128):
        return f"block_m: expected 64 or 128 (one or two 64-row WGMMA tiles), got {block_m!r}", 0, 0
    try:
        buffer = FusedMoEBuffer(max_tokens, hidden, intermediate, num_experts, top_k, block_m)
    except ValueError as e:
        return str(e), 0, 0

    # the scheduler's bit-packed tile-table entry (SM90MegaMoEScheduler)
    pool_blocks = buffer.pool_tokens // block_m
    e_bits, m_bits = _bits_for(num_experts), _bits_for(pool_blocks)
    n_bits = _bits_for(max(2 * intermediate, hidden) // FUSED_MOE_BLOCK_N)
    if e_bits + m_bits + n_bits > 29:
        return (f"max_tokens, num_experts: expected the tile-table tag to fit 29 bits, got {e_bits} (experts) + "
                f"{m_bits} ({pool_blocks} pool blocks) + {n_bits} (N blocks) for max_tokens={max_tokens}, "
                f"num_experts={num_experts}"), 0, 0
    if _bits_for(max_tokens) + m_bits > 32 and _bits_for(block_m) + 1 + m_bits > 32:
        return (f"max_tokens: expected the tile-table payload to fit 32 bits, got {pool_blocks} pool blocks "
                f"for max_tokens={max_tokens}"), 0, 0

    k_blocks = min((hidden // FUSED_MOE_BLOCK_K, "hidden", hidden),
                   (intermediate // FUSED_MOE_BLOCK_K, "intermediate", intermediate))
    if k_blocks[0] <= _FUSED_MOE_MIN_STAGES:
        return (f"{k_blocks[1]}: expected more than {_FUSED_MOE_MIN_STAGES} k-blocks of {FUSED_MOE_BLOCK_K} "
                f"(more k-blocks than pipeline stages spares the L2 epilogue a CTA-wide sync), got "
                f"{k_blocks[1]}={k_blocks[2]} ({k_blocks[0]} k-blocks)"), 0, 0

    def layout(stages: int) -> tuple[int, int]:
        return _fused_moe_shared_layout(max_tokens=max_tokens, hidden=hidden, intermediate=intermediate,
                                        num_experts=num_experts, top_k=top_k, block_m=block_m, num_stages=stages,
                                        num_sms=num_sms, half_l2_cd=block_m == 128)

    fits = 0  # shared memory grows with the stages: the first that overflows ends the search
    while fits < _FUSED_MOE_MAX_STAGES and layout(fits + 1)[0] <= SM90_SMEM_CAPACITY:
        fits += 1
    if fits < _FUSED_MOE_MIN_STAGES:
        return (f"max_tokens, hidden, intermediate, num_experts, num_sms: expected shared memory <= "
                f"{SM90_SMEM_CAPACITY} bytes at {_FUSED_MOE_MIN_STAGES} stages, got "
                f"{layout(_FUSED_MOE_MIN_STAGES)[0]} bytes (block_m={block_m}, max_tokens={max_tokens}, "
                f"hidden={hidden}, intermediate={intermediate}, num_experts={num_experts}, num_sms={num_sms})"), 0, 0
    stages = min(fits, k_blocks[0] - 1)

    reason = _fused_moe_combine_reason(hidden, layout(stages)[1])
    return (reason, 0, 0) if reason else (None, block_m, stages)


def sm90_fused_moe_reason(*, hidden: int, intermediate: int, num_experts: int, top_k: int, max_tokens: int,
                          num_sms: int) -> str | None:
    """Why the SM90 fused MoE kernel cannot serve this problem (each reason names the argument, the
    expected and the actual value); None if it can. Checks the kernel's static asserts for the
    config ``sm90_fused_moe_config`` would choose, and what the host must hold besides."""
    return _fused_moe_plan(hidden=hidden, intermediate=intermediate, num_experts=num_experts, top_k=top_k,
                           max_tokens=max_tokens, num_sms=num_sms)[0]


def sm90_fused_moe_config(*, max_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int,
                          num_sms: int, activation_clamp: float | None = None,
                          block_m: int | None = None, schedule_options: bool = True) -> Sm90FusedMoEConfig:
    """The fused MoE instantiation for this problem (see the rules above): BLOCK_M 64 when an expert
    expects fewer than 64 routes (max_tokens * top_k / num_experts), else 128 (``block_m`` forces
    one); the schedule options of the rules above (``schedule_options=False``: the template's
    defaults); the most pipeline stages that fit the shared memory and stay below both GEMMs'
    k-block counts.

    activation_clamp: None (no clamp) or a positive float: SwiGLU clamps the gate to at most it and
    the up projection to [-clamp, clamp]; stored as the float32 value the kernel uses, infinity as
    None (one config per kernel). ValueError with ``sm90_fused_moe_reason`` when refused.
    """
    reason, block_m, stages = _fused_moe_plan(hidden=hidden, intermediate=intermediate, num_experts=num_experts,
                                              top_k=top_k, max_tokens=max_tokens, num_sms=num_sms,
                                              block_m=block_m)
    if reason:
        raise ValueError(reason)
    if activation_clamp is not None and (
            isinstance(activation_clamp, bool) or not isinstance(activation_clamp, (int, float, np.floating))
            or not activation_clamp > 0):
        raise ValueError(f"activation_clamp: expected None or a positive float, got {activation_clamp!r}")
    clamp = None
    if activation_clamp is not None and not math.isinf(activation_clamp):
        with np.errstate(over="ignore"):
            clamp = float(np.float32(activation_clamp))  # the value the kernel compiles in
        clamp = None if math.isinf(clamp) else clamp  # above float32's range: no clamp either
    cfg = Sm90FusedMoEConfig(
        max_tokens=int(max_tokens), hidden=int(hidden), intermediate=int(intermediate),
        num_experts=int(num_experts), top_k=int(top_k), experts_per_wave=int(num_experts), block_m=block_m,
        block_n=FUSED_MOE_BLOCK_N, block_k=FUSED_MOE_BLOCK_K, num_stages=stages, num_dispatch_threads=64,
        num_non_epilogue_threads=64, num_epilogue_threads=256, num_sms=int(num_sms), activation_clamp=clamp,
        half_l2_cd=block_m == 128)
    if not schedule_options:
        return cfg
    routes = int(max_tokens) * int(top_k)
    if block_m == 128:  # stmatrix row passes where the weight-scale slot can take its unused rows
        tuned = dataclasses.replace(cfg, l2_cd_passes=4, l2_stage_mode=4)
        if sm90_fused_moe_options_reason(dataclasses.replace(tuned, num_stages=2)) is not None:
            tuned = dataclasses.replace(tuned, l2_stage_mode=2)
        if routes >= _FUSED_MOE_CLUSTER_ROUTES_M128 * int(num_experts):
            clustered = dataclasses.replace(tuned, cluster_size=2)
            if sm90_fused_moe_max_stages(clustered) >= _FUSED_MOE_CLUSTER_MIN_STAGES:
                tuned = clustered
    elif routes >= _FUSED_MOE_CLUSTER_ROUTES * int(num_experts):
        tuned = dataclasses.replace(cfg, cluster_size=2)
    else:
        return cfg
    stages = sm90_fused_moe_max_stages(tuned)
    return dataclasses.replace(tuned, num_stages=stages) if stages else cfg


_FUSED_MOE_CD_PASSES = (0, 1, 2, 4)


def sm90_fused_moe_options_reason(cfg: Sm90FusedMoEConfig) -> str | None:
    """Why ``cfg`` (a ``sm90_fused_moe_config`` result with its stages or schedule options changed)
    is not a legal instantiation, or None: the option ranges and the kernel's static asserts on
    them, the stage bound and the shared memory. The template alone decides the rest; a candidate
    that still fails to compile is dropped by the tuner with nvcc's message."""
    def bad(name, expected, got):
        return f"{name}: expected {expected}, got {got!r}"

    def is_int(v):
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

    k_blocks = min(cfg.hidden, cfg.intermediate) // cfg.block_k
    if not is_int(cfg.num_stages) or not _FUSED_MOE_MIN_STAGES <= cfg.num_stages < k_blocks:
        return bad("num_stages", f"an int in [{_FUSED_MOE_MIN_STAGES}, {k_blocks - 1}] (fewer than the "
                   f"{k_blocks} k-blocks of the smaller GEMM K)", cfg.num_stages)
    if cfg.cluster_size not in (1, 2) or isinstance(cfg.cluster_size, bool):
        return bad("cluster_size", "1 or 2", cfg.cluster_size)
    if cfg.cluster_size == 2 and cfg.num_sms % 2:
        return bad("num_sms", "an even grid for 2-CTA clusters", cfg.num_sms)
    if cfg.num_non_epilogue_threads not in (64, 128) or isinstance(cfg.num_non_epilogue_threads, bool):
        return bad("num_non_epilogue_threads", "64 or 128 (two or four TMA loader warps)",
                   cfg.num_non_epilogue_threads)
    d = cfg.num_dispatch_threads
    if not is_int(d) or d < 64 or d % 64 or (d + cfg.num_non_epilogue_threads) % 128:
        return bad("num_dispatch_threads", f"a multiple of 64 with num_non_epilogue_threads "
                   f"({cfg.num_non_epilogue_threads}) a multiple of 128 (the math warpgroups start aligned)", d)
    if cfg.block_m == 128 and cfg.num_threads > 384:
        # ptxas: BLOCK_M 128's math warpgroups need ~154 registers a thread, a 512-thread CTA leaves 128
        return bad("num_dispatch_threads, num_non_epilogue_threads", "128 threads together at block_m 128 (more "
                   "threads leave the math warpgroups too few registers)",
                   f"{d} + {cfg.num_non_epilogue_threads}")
    if cfg.l2_cd_passes not in _FUSED_MOE_CD_PASSES or isinstance(cfg.l2_cd_passes, bool):
        return bad("l2_cd_passes", f"one of {_FUSED_MOE_CD_PASSES}", cfg.l2_cd_passes)
    if cfg.l2_stage_mode not in (0, 2, 4) or isinstance(cfg.l2_stage_mode, bool):
        return bad("l2_stage_mode", "0, 2 or 4", cfg.l2_stage_mode)
    if not isinstance(cfg.pdl, bool):
        return bad("pdl", "a bool", cfg.pdl)
    if not isinstance(cfg.trace, bool):
        return bad("trace", "a bool", cfg.trace)
    # a math warpgroup's tile: BLOCK_M 64 splits N over the two warpgroups, 128 splits M
    wg_block_n = cfg.block_n // 2 if cfg.block_m == 64 else cfg.block_n
    passes = cfg.l2_cd_passes or (2 if cfg.half_l2_cd else 1)
    if cfg.l2_stage_mode and (passes != 4 or wg_block_n != 256):
        return bad("l2_stage_mode", "0 unless l2_cd_passes is 4 and each math warpgroup's tile is 64x256 "
                   "(block_m 128, block_n 256)",
                   f"{cfg.l2_stage_mode} with l2_cd_passes={cfg.l2_cd_passes}, tile {cfg.block_m}x{cfg.block_n}")
    sf_slot = 4 * _fused_moe_weight_sf_floats(cfg.hidden, cfg.intermediate, cfg.block_m, cfg.block_n)
    if cfg.l2_stage_mode == 4 and sf_slot < 256:
        return bad("l2_stage_mode", "2, not 4, when a math warpgroup's weight-scale slot is below 256 bytes "
                   "(stmatrix parks its unused rows there)", f"4 with a {sf_slot}-byte slot (hidden={cfg.hidden}, "
                   f"intermediate={cfg.intermediate})")
    if not cfg.l2_stage_mode and wg_block_n // passes not in (64, 128):
        return bad("l2_cd_passes", f"column passes of 64 or 128 of a math warpgroup's {wg_block_n} columns "
                   "(the scatter vector width)", f"{cfg.l2_cd_passes} ({wg_block_n // passes} columns per pass)")
    if cfg.smem_bytes > SM90_SMEM_CAPACITY:
        return bad("num_stages", f"a shared-memory layout <= {SM90_SMEM_CAPACITY} bytes",
                   f"{cfg.num_stages} stages ({cfg.smem_bytes} bytes)")
    before_barrier = _fused_moe_shared_layout(
        max_tokens=cfg.max_tokens, hidden=cfg.hidden, intermediate=cfg.intermediate, num_experts=cfg.num_experts,
        top_k=cfg.top_k, block_m=cfg.block_m, num_stages=cfg.num_stages, num_sms=cfg.num_sms,
        half_l2_cd=cfg.half_l2_cd, block_n=cfg.block_n, num_dispatch_threads=cfg.num_dispatch_threads,
        l2_cd_passes=cfg.l2_cd_passes)[1]
    return _fused_moe_combine_reason(cfg.hidden, before_barrier)


def sm90_fused_moe_max_stages(cfg: Sm90FusedMoEConfig) -> int:
    """The most stages ``cfg``'s options leave room for (below the k-block bound), 0 if none fit."""
    k_blocks = min(cfg.hidden, cfg.intermediate) // cfg.block_k
    best = 0
    for stages in range(_FUSED_MOE_MIN_STAGES, k_blocks):
        if sm90_fused_moe_options_reason(dataclasses.replace(cfg, num_stages=stages)) is None:
            best = stages
    return best
