"""Family "sm100_1d1d": the SM100 m-grouped FP8×FP8 / FP8×FP4 GEMM with 1D1D UE8M0 scales
(sm100_fp8_fp4_gemm_1d1d of the sgl-deep-gemm 0.2.5 templates), swap-AB, 2-CTA multicast of A when
legal. Recipes fp8_block, mxfp8 and mxfp4 on SM100; grouped (contig, masked) only. Generated and
compiled for sm_100a; this project has not run it on SM100 hardware.
"""

from __future__ import annotations

import dataclasses
import struct

from custom_calls.native.launch_plan import (ARG_BYTES, TMA_16U4_ALIGN16B, TMA_BFLOAT16, TMA_INT32, TMA_UINT8,
                                             KernelArg, LaunchPlan, TensorMap, _ptr, _tmap, _u32)
from layouts import gemm_format
from layouts.checks import align, ceil_div

from .codegen import GEMM_TYPE, K_MAJOR, cpp_bool, translation_unit
from .family import CONTIG_ALIGNMENT, SM100_SMEM_CAPACITY, GemmKind, GemmProblem, KernelFamily, PersistentLaunch

SYMBOL = "sm100_fp8_fp4_gemm_1d1d"
_SM100_MAX_STAGES = 32
_B_DTYPE = {"e4m3": "cutlass::float_e4m3_t", "e2m1_unpacked": "cutlass::detail::float_e2m1_unpacksmem_t"}


def sm100_operands(recipe: str) -> tuple[int, int, str]:
    """(gran_k of A's scales, gran_k of B's scales, B's element type) of the kernel for ``recipe``,
    from its GEMM format on arch 100; FP4 weights are unpacked to 8 bit in shared memory."""
    fmt = gemm_format(recipe, 100)
    if not fmt.is_quantized:
        raise ValueError(f"recipe: the SM100 1D1D kernel serves quantized recipes, got {recipe!r}")
    return fmt.act_group, fmt.weight_block[1], "e2m1_unpacked" if fmt.rhs_k_pack == 2 else "e4m3"


@dataclasses.dataclass(frozen=True)
class Sm100GemmConfig(PersistentLaunch):
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
    def num_threads(self) -> int:
        return self.num_non_epilogue_threads + self.num_epilogue_threads


def sm100_mgrouped_config(recipe: str, gemm_kind: GemmKind, n: int, k: int, num_groups: int,
                          num_sms: int) -> Sm100GemmConfig:
    """The instantiation for (G, N, K) weights of ``recipe``: 128x128x128 tiles, clusters of two
    when the N blocks pair up, the most pipeline stages that fit."""
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


def config(problem: GemmProblem, num_sms: int, tuning: object = None) -> Sm100GemmConfig:
    """The family's config function: the one instantiation per shape (nothing is tuned on SM100)."""
    del tuning
    p = problem
    return sm100_mgrouped_config(p.fmt.recipe, p.gemm_kind, p.n, p.k, p.num_groups, num_sms)


def source(cfg: Sm100GemmConfig, n: int, k: int) -> str:
    """m-grouped FP8×FP8 / FP8×FP4 1D1D instantiation with UE8M0 scales (31 template arguments)."""
    params = [K_MAJOR, K_MAJOR, str(cfg.gran_k_a), str(cfg.gran_k_b), str(cfg.gran_k_a),
              "0", str(n), str(k), str(cfg.block_m), str(cfg.block_n), str(cfg.block_k),
              str(cfg.num_groups), str(cfg.swizzle_a), str(cfg.swizzle_b), str(cfg.swizzle_cd),
              str(cfg.num_stages), str(cfg.num_tma_store_stages),
              str(cfg.num_non_epilogue_threads), str(cfg.num_epilogue_threads),
              str(cfg.cluster), cpp_bool(cfg.multicast_on_a), str(cfg.num_sms),
              "true", "true",  # kSwapAB (m-grouped), kEnsureZeroPadding
              GEMM_TYPE[cfg.gemm_kind], "false",
              "cutlass::float_e4m3_t", _B_DTYPE[cfg.b_dtype], "cutlass::bfloat16_t",
              "epilogue::operators::Identity", "true"]
    return translation_unit("sm100_fp8_fp4_gemm_1d1d.cuh", "sm100_fp8_fp4_gemm_1d1d_impl", params)


# EpilogueOperatorArgs of the 0.2.5 headers, Identity defaults: {sfd=null, sfd_stride=0, shape_m=0,
# shape_n=0, alpha=1, clamp_value=0, clamped_count=null, clamp_count_ready=null}, 48 bytes.
SM100_EPILOGUE_ARGS = struct.pack("<QIIIff4xQQ", 0, 0, 0, 0, 1.0, 0.0, 0, 0)
assert len(SM100_EPILOGUE_ARGS) == 48


def plan(cfg: Sm100GemmConfig, cubin: str, *, m: int, n: int, k: int) -> LaunchPlan:
    """Operands: 0 lhs e4m3, 1 rhs (e4m3 (G,N,K) | int8 e2m1 pairs (G,N,K/2)),
    2 lhs_scale packed UE8M0 int32 image, 3 rhs_scale packed UE8M0 int32 image, 4 m_indices | masked_m,
    then D bf16. m: M_cap (contig) or m_pad (masked)."""
    g = cfg.num_groups
    masked = cfg.gemm_kind == "masked"
    rows_a = g * m if masked else m
    if cfg.b_dtype == "e2m1_unpacked":
        if k % 128:
            raise ValueError(f"FP8xFP4 needs K % 128 == 0, got K={k}")
        b_map = TensorMap(1, TMA_16U4_ALIGN16B, (k, g * n), (k // 2,), (128, cfg.load_block_n), cfg.swizzle_b)
    else:
        b_map = TensorMap(1, TMA_UINT8, (k, g * n), (k,), (128, cfg.load_block_n), cfg.swizzle_b)
    tmaps = (
        TensorMap(0, TMA_UINT8, (k, rows_a), (k,), (128, cfg.load_block_m), cfg.swizzle_a),
        b_map,
        TensorMap(2, TMA_INT32, (align(m, 4), ceil_div(k, 4 * cfg.gran_k_a) * (g if masked else 1)),
                  (align(m, 4) * 4,), (align(cfg.block_m, 128), cfg.block_k // 128), 0),
        TensorMap(3, TMA_INT32, (align(n, 4), ceil_div(k, 4 * cfg.gran_k_b) * g), (align(n, 4) * 4,),
                  (cfg.block_n, cfg.block_k // 128), 0),
        TensorMap(5, TMA_BFLOAT16, (n, rows_a), (n * 2,), (cfg.swizzle_cd // 2, cfg.store_block_m), cfg.swizzle_cd),
    )
    args = (_ptr(4), _u32(m), _u32(n), _u32(k), KernelArg(ARG_BYTES, data=SM100_EPILOGUE_ARGS),
            _tmap(0), _tmap(1), _tmap(2), _tmap(3), _tmap(4))
    return LaunchPlan(SYMBOL, cubin, cfg.grid, cfg.num_threads, cfg.cluster, cfg.smem_bytes, args, tmaps)


def kernel_name(cfg: Sm100GemmConfig, problem: GemmProblem) -> str:
    """Cache name: the recipe picks the operand types, the rest of the instantiation is the shape's."""
    p = problem
    return f"sm100_{cfg.recipe}_{p.gemm_kind}_n{p.n}_k{p.k}_g{p.num_groups}"


FAMILY = KernelFamily(
    name="sm100_1d1d", symbol=SYMBOL, archs=(100,), recipes=("fp8_block", "mxfp8", "mxfp4"), block_k=128,
    cd_dtypes=("bf16",), dense=False, config=config, source=source, plan=plan, kernel_name=kernel_name)
