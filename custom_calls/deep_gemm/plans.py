"""Launch plans of the DeepGEMM kernels (SM90 FP8 1D2D, BF16, TF32 prenorm; SM100 1D1D): their
tensor maps and argument lists for the native launcher (`custom_calls.native.launch_plan`)."""

from __future__ import annotations

import struct

from custom_calls.native.launch_plan import (ARG_BYTES, NULL, TMA_16U4_ALIGN16B, TMA_BFLOAT16, TMA_FLOAT32,
                                             TMA_INT32, TMA_TFLOAT32, TMA_UINT8, KernelArg, LaunchPlan,
                                             TensorMap, _ptr, _tmap, _u32)

from .heuristics import Sm90GemmConfig, Sm90PrenormConfig, Sm100GemmConfig, align, ceil_div


def _cd_box(swizzle_cd: int, esize: int, block_n: int) -> int:
    return swizzle_cd // esize if swizzle_cd >= 32 else block_n


def sm90_fp8_plan(cfg: Sm90GemmConfig, cubin: str, *, m: int, n: int, k: int, num_groups: int) -> LaunchPlan:
    """FP8 1D2D. Operands: 0 lhs e4m3, 1 rhs e4m3, 2 lhs_scale image f32, 3 rhs_scale f32,
    [4 m_indices | masked_m int32 for grouped], then the output D bf16.

    m: rows of lhs (normal/contig) or m_pad (masked: lhs is (G, m_pad, K)).
    """
    grouped = cfg.gemm_kind != "normal"
    masked = cfg.gemm_kind == "masked"
    out = 5 if grouped else 4
    rows_a = num_groups * m if masked else m
    rows_b = num_groups * n if grouped else n
    sf_k = ceil_div(k, 128)
    tmaps = (
        TensorMap(0, TMA_UINT8, (k, rows_a), (k,), (cfg.swizzle_a, cfg.block_m), cfg.swizzle_a),
        TensorMap(1, TMA_UINT8, (k, rows_b), (k,), (cfg.swizzle_b, cfg.block_n), cfg.swizzle_b),
        TensorMap(out, TMA_BFLOAT16, (n, rows_a), (n * 2,), (_cd_box(cfg.swizzle_cd, 2, cfg.block_n), cfg.block_m),
                  cfg.swizzle_cd if cfg.swizzle_cd >= 32 else 0),
        # The kernel expects exactly BLOCK_M scales per stage: the box is BM wide, not the padded M.
        TensorMap(2, TMA_FLOAT32, (align(m, 4), sf_k * (num_groups if masked else 1)), (align(m, 4) * 4,),
                  (cfg.block_m, 1), 0),
    )
    args = (_ptr(3), _ptr(4) if grouped else NULL, _u32(m), _u32(n), _u32(k), _tmap(0), _tmap(1), _tmap(2), _tmap(3))
    return LaunchPlan("sm90_fp8_gemm_1d2d", cubin, cfg.grid, cfg.num_threads, cfg.cluster, cfg.smem_bytes, args, tmaps)


def sm90_bf16_plan(cfg: Sm90GemmConfig, cubin: str, *, m: int, n: int, k: int, num_groups: int) -> LaunchPlan:
    """BF16. Operands: 0 lhs bf16, 1 rhs bf16, [2 m_indices | masked_m], then D (bf16 or f32)."""
    grouped = cfg.gemm_kind != "normal"
    masked = cfg.gemm_kind == "masked"
    out = 3 if grouped else 2
    rows_a = num_groups * m if masked else m
    rows_b = num_groups * n if grouped else n
    cd_esize = 2 if cfg.cd_dtype == "bf16" else 4
    cd_type = TMA_BFLOAT16 if cfg.cd_dtype == "bf16" else TMA_FLOAT32
    tmaps = (
        TensorMap(0, TMA_BFLOAT16, (k, rows_a), (k * 2,), (cfg.swizzle_a // 2, cfg.block_m), cfg.swizzle_a),
        TensorMap(1, TMA_BFLOAT16, (k, rows_b), (k * 2,), (cfg.swizzle_b // 2, cfg.block_n), cfg.swizzle_b),
        TensorMap(out, cd_type, (n, rows_a), (n * cd_esize,),
                  (_cd_box(cfg.swizzle_cd, cd_esize, cfg.block_n), cfg.block_m),
                  cfg.swizzle_cd if cfg.swizzle_cd >= 32 else 0),
    )
    args = (_ptr(2) if grouped else NULL, _u32(m), _u32(n), _u32(k), _tmap(0), _tmap(1), _tmap(2))
    return LaunchPlan("sm90_bf16_gemm", cubin, cfg.grid, cfg.num_threads, cfg.cluster, cfg.smem_bytes, args, tmaps)


def sm90_prenorm_plan(cfg: Sm90PrenormConfig, cubin: str, *, m: int) -> LaunchPlan:
    """TF32 prenorm. Operands: 0 x bf16 (M,K), 1 fn f32 (N,K); outputs 2 D f32 (S,M,N), 3 sqr_sum f32 (S,M)."""
    n, k, s = cfg.n, cfg.k, cfg.num_splits
    if s == 1:
        d = TensorMap(2, TMA_FLOAT32, (n, m), (n * 4,), (cfg.block_n, cfg.block_m), cfg.swizzle_cd)
    else:
        d = TensorMap(2, TMA_FLOAT32, (n, m, s), (n * 4, m * n * 4), (cfg.block_n, cfg.block_m, 1), cfg.swizzle_cd)
    tmaps = (
        TensorMap(0, TMA_BFLOAT16, (k, m), (k * 2,), (cfg.block_k, cfg.block_m), 128),
        TensorMap(1, TMA_TFLOAT32, (k, n), (k * 4,), (32, cfg.block_n), 128),
        d,
    )
    args = (_u32(m), _tmap(0), _tmap(1), _tmap(2), _ptr(3))
    return LaunchPlan("sm90_tf32_hc_prenorm_gemm", cubin, cfg.grid(m), cfg.num_threads, 1, cfg.smem_bytes, args, tmaps)


# EpilogueOperatorArgs of the 0.2.5 headers, Identity defaults: {sfd=null, sfd_stride=0, shape_m=0,
# shape_n=0, alpha=1, clamp_value=0, clamped_count=null, clamp_count_ready=null}, 48 bytes.
SM100_EPILOGUE_ARGS = struct.pack("<QIIIff4xQQ", 0, 0, 0, 0, 1.0, 0.0, 0, 0)
assert len(SM100_EPILOGUE_ARGS) == 48


def sm100_plan(cfg: Sm100GemmConfig, cubin: str, *, m: int, n: int, k: int) -> LaunchPlan:
    """m-grouped 1D1D. Operands: 0 lhs e4m3, 1 rhs (e4m3 (G,N,K) | int8 e2m1 pairs (G,N,K/2)),
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
    return LaunchPlan("sm100_fp8_fp4_gemm_1d1d", cubin, cfg.grid, cfg.num_threads, cfg.cluster, cfg.smem_bytes,
                      args, tmaps)
