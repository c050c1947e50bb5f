"""Family "fp8_1d2d": the SM90 FP8 GEMM with 1D2D scales (sm90_fp8_gemm_1d2d of the sgl-deep-gemm
0.2.5 templates): e4m3 operands, fp32 1x128 activation scales (MN-major image), fp32 128x128
weight block scales, bf16 output; grouped (contig, masked) and dense. Recipe fp8_block on SM90.
Tiles: the SM90 rules (sm90_gemm.py); configs: the heuristic or a tuned one (autotune.py).
"""

from __future__ import annotations

from custom_calls.native.launch_plan import (NULL, TMA_BFLOAT16, TMA_FLOAT32, TMA_UINT8, LaunchPlan, TensorMap,
                                             _ptr, _tmap, _u32)
from layouts.checks import align, ceil_div

from . import autotune
from .codegen import CD_DTYPE, GEMM_TYPE, K_MAJOR, cpp_bool, translation_unit
from .family import KernelFamily, Sm90Tiling
from .sm90_gemm import Sm90GemmConfig, sm90_cd_box, sm90_kernel_name, sm90_operand_rows

SYMBOL = "sm90_fp8_gemm_1d2d"


def source(cfg: Sm90GemmConfig, n: int, k: int) -> str:
    """The instantiation of ``cfg`` with N and K compiled in; kMajorSFB = K: B's scales are
    (G, N/128, K/128) row-major."""
    params = [K_MAJOR, "0", str(n), str(k), str(cfg.num_groups), str(cfg.block_m), str(cfg.block_n),
              str(cfg.block_k), str(cfg.swizzle_a), str(cfg.swizzle_b), str(cfg.swizzle_cd), str(cfg.num_stages),
              str(cfg.num_tma_threads), str(cfg.num_math_threads), str(cfg.cluster), cpp_bool(cfg.multicast_on_a),
              str(cfg.num_sms), GEMM_TYPE[cfg.gemm_kind], CD_DTYPE[cfg.cd_dtype], "128"]
    return translation_unit("sm90_fp8_gemm_1d2d.cuh", "sm90_fp8_gemm_1d2d_impl", params)


def plan(cfg: Sm90GemmConfig, cubin: str, *, m: int, n: int, k: int) -> LaunchPlan:
    """Operands: 0 lhs e4m3, 1 rhs e4m3, 2 lhs_scale image f32, 3 rhs_scale f32,
    [4 m_indices | masked_m int32 for grouped], then the output D bf16.

    m: rows of lhs (normal/contig) or m_pad (masked: lhs is (G, m_pad, K)); G: cfg.num_groups.
    """
    grouped = cfg.gemm_kind != "normal"
    out = 5 if grouped else 4
    rows_a, rows_b = sm90_operand_rows(cfg, m, n)
    scale_groups = cfg.num_groups if cfg.gemm_kind == "masked" else 1  # a masked A's scales per group
    sf_k = ceil_div(k, 128)
    tmaps = (
        TensorMap(0, TMA_UINT8, (k, rows_a), (k,), (cfg.swizzle_a, cfg.block_m), cfg.swizzle_a),
        TensorMap(1, TMA_UINT8, (k, rows_b), (k,), (cfg.swizzle_b, cfg.block_n), cfg.swizzle_b),
        TensorMap(out, TMA_BFLOAT16, (n, rows_a), (n * 2,), (sm90_cd_box(cfg, 2), cfg.block_m),
                  cfg.swizzle_cd if cfg.swizzle_cd >= 32 else 0),
        # The kernel expects exactly BLOCK_M scales per stage: the box is BM wide, not the padded M.
        TensorMap(2, TMA_FLOAT32, (align(m, 4), sf_k * scale_groups), (align(m, 4) * 4,),
                  (cfg.block_m, 1), 0),
    )
    args = (_ptr(3), _ptr(4) if grouped else NULL, _u32(m), _u32(n), _u32(k), _tmap(0), _tmap(1), _tmap(2), _tmap(3))
    return LaunchPlan(SYMBOL, cubin, cfg.grid, cfg.num_threads, cfg.cluster, cfg.smem_bytes, args, tmaps)


FAMILY = KernelFamily(
    name="fp8_1d2d", symbol=SYMBOL, archs=(90,), recipes=("fp8_block",), block_k=128, cd_dtypes=("bf16",),
    dense=True, config=autotune.sm90_config, source=source, plan=plan, kernel_name=sm90_kernel_name,
    sm90=Sm90Tiling(ab_bytes=1, max_block_n=192, block_scales=True, unswizzled_cd=True))
