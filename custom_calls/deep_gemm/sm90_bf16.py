"""Family "bf16": the SM90 BF16 GEMM (sm90_bf16_gemm of the sgl-deep-gemm 0.2.5 templates): bf16
operands, no scales, bf16 or (dense) f32 output; grouped (contig, masked) and dense. Recipe bf16
on SM90. Tiles: the SM90 rules (sm90_gemm.py); configs: the heuristic or a tuned one (autotune.py).
"""

from __future__ import annotations

from custom_calls.native.launch_plan import NULL, TMA_BFLOAT16, TMA_FLOAT32, LaunchPlan, TensorMap, _ptr, _tmap, _u32

from . import autotune
from .codegen import CD_DTYPE, GEMM_TYPE, K_MAJOR, cpp_bool, translation_unit
from .family import KernelFamily, Sm90Tiling
from .sm90_gemm import Sm90GemmConfig, sm90_cd_box, sm90_kernel_name, sm90_operand_rows

SYMBOL = "sm90_bf16_gemm"


def source(cfg: Sm90GemmConfig, n: int, k: int) -> str:
    """The instantiation of ``cfg`` with N and K compiled in (no split-K accumulation)."""
    params = [K_MAJOR, K_MAJOR, "0", str(n), str(k), str(cfg.num_groups), str(cfg.block_m), str(cfg.block_n),
              str(cfg.block_k), str(cfg.swizzle_a), str(cfg.swizzle_b), str(cfg.swizzle_cd), str(cfg.num_stages),
              str(cfg.num_tma_threads), str(cfg.num_math_threads), str(cfg.cluster), cpp_bool(cfg.multicast_on_a),
              str(cfg.num_sms), GEMM_TYPE[cfg.gemm_kind], "false", CD_DTYPE[cfg.cd_dtype]]
    return translation_unit("sm90_bf16_gemm.cuh", "sm90_bf16_gemm_impl", params)


def plan(cfg: Sm90GemmConfig, cubin: str, *, m: int, n: int, k: int) -> LaunchPlan:
    """Operands: 0 lhs bf16, 1 rhs bf16, [2 m_indices | masked_m], then D (bf16 or f32).
    m: rows of lhs (normal/contig) or m_pad (masked); G: cfg.num_groups."""
    grouped = cfg.gemm_kind != "normal"
    out = 3 if grouped else 2
    rows_a, rows_b = sm90_operand_rows(cfg, m, n)
    cd_esize = 2 if cfg.cd_dtype == "bf16" else 4
    cd_type = TMA_BFLOAT16 if cfg.cd_dtype == "bf16" else TMA_FLOAT32
    tmaps = (
        TensorMap(0, TMA_BFLOAT16, (k, rows_a), (k * 2,), (cfg.swizzle_a // 2, cfg.block_m), cfg.swizzle_a),
        TensorMap(1, TMA_BFLOAT16, (k, rows_b), (k * 2,), (cfg.swizzle_b // 2, cfg.block_n), cfg.swizzle_b),
        TensorMap(out, cd_type, (n, rows_a), (n * cd_esize,), (sm90_cd_box(cfg, cd_esize), cfg.block_m),
                  cfg.swizzle_cd if cfg.swizzle_cd >= 32 else 0),
    )
    args = (_ptr(2) if grouped else NULL, _u32(m), _u32(n), _u32(k), _tmap(0), _tmap(1), _tmap(2))
    return LaunchPlan(SYMBOL, cubin, cfg.grid, cfg.num_threads, cfg.cluster, cfg.smem_bytes, args, tmaps)


FAMILY = KernelFamily(
    name="bf16", symbol=SYMBOL, archs=(90,), recipes=("bf16",), block_k=64, cd_dtypes=("bf16", "f32"),
    dense=True, config=autotune.sm90_config, source=source, plan=plan, kernel_name=sm90_kernel_name,
    sm90=Sm90Tiling(ab_bytes=2, max_block_n=256, block_scales=False, unswizzled_cd=False))
