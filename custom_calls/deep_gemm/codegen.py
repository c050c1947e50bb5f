"""Source text of one kernel instantiation for the sgl-deep-gemm 0.2.5 templates.

Each translation unit includes one kernel header and takes the address of exactly one template
instantiation, which forces that single ``__global__`` function into the cubin (the loader relies on
the cubin holding one kernel). Parameter lists follow the 0.2.5 headers, which differ from both
upstream DeepGEMM and older sgl releases (e.g. the 1D2D kernel's trailing ``SF_GRAN``).
"""

from __future__ import annotations

import numpy as np

from .heuristics import Sm90FusedMoEConfig, Sm90GemmConfig, Sm90PrenormConfig, Sm100GemmConfig

_GEMM_TYPE = {"normal": "GemmType::Normal", "contig": "GemmType::MGroupedContiguous",
              "masked": "GemmType::MGroupedMasked"}
_CD_DTYPE = {"bf16": "cutlass::bfloat16_t", "f32": "float"}
_SM100_B_DTYPE = {"e4m3": "cutlass::float_e4m3_t", "e2m1_unpacked": "cutlass::detail::float_e2m1_unpacksmem_t"}
_K_MAJOR = "cute::UMMA::Major::K"


def _b(v: bool) -> str:
    return "true" if v else "false"


def _unit(header: str, kernel: str, params: list[str]) -> str:
    args = ",\n        ".join(params)
    return (f"\n#include <deep_gemm/impls/{header}>\n\nusing namespace deep_gemm;\n\n"
            f"static void __instantiate_kernel() {{\n"
            f"    auto ptr = reinterpret_cast<void*>(&{kernel}<\n        {args}\n    >);\n}};\n")


def sm90_gemm_source(cfg: Sm90GemmConfig, n: int, k: int) -> str:
    """FP8 1D2D (fp32 1x128 A scales, 128x128 B scales) or BF16 instantiation, N and K compiled in."""
    common_tail = [str(cfg.swizzle_a), str(cfg.swizzle_b), str(cfg.swizzle_cd), str(cfg.num_stages),
                   str(cfg.num_tma_threads), str(cfg.num_math_threads), str(cfg.cluster),
                   _b(cfg.multicast_on_a), str(cfg.num_sms), _GEMM_TYPE[cfg.gemm_kind]]
    shape = ["0", str(n), str(k), str(cfg.num_groups), str(cfg.block_m), str(cfg.block_n), str(cfg.block_k)]
    if cfg.kernel == "fp8_1d2d":
        # kMajorSFB = K: B's scales are (G, N/128, K/128) row-major.
        params = [_K_MAJOR, *shape, *common_tail, _CD_DTYPE[cfg.cd_dtype], "128"]
        return _unit("sm90_fp8_gemm_1d2d.cuh", "sm90_fp8_gemm_1d2d_impl", params)
    params = [_K_MAJOR, _K_MAJOR, *shape, *common_tail, "false", _CD_DTYPE[cfg.cd_dtype]]
    return _unit("sm90_bf16_gemm.cuh", "sm90_bf16_gemm_impl", params)


def sm90_prenorm_source(cfg: Sm90PrenormConfig) -> str:
    params = [str(cfg.n), str(cfg.k), str(cfg.block_m), str(cfg.block_n), str(cfg.block_k),
              str(cfg.num_splits), str(cfg.swizzle_cd), str(cfg.num_stages),
              str(cfg.num_math_threads), str(cfg.num_tma_threads)]
    return _unit("sm90_tf32_hc_prenorm_gemm.cuh", "sm90_tf32_hc_prenorm_gemm_impl", params)


def sm100_gemm_source(cfg: Sm100GemmConfig, n: int, k: int) -> str:
    """m-grouped FP8×FP8 / FP8×FP4 1D1D instantiation with UE8M0 scales (31 template arguments)."""
    params = [_K_MAJOR, _K_MAJOR, str(cfg.gran_k_a), str(cfg.gran_k_b), str(cfg.gran_k_a),
              "0", str(n), str(k), str(cfg.block_m), str(cfg.block_n), str(cfg.block_k),
              str(cfg.num_groups), str(cfg.swizzle_a), str(cfg.swizzle_b), str(cfg.swizzle_cd),
              str(cfg.num_stages), str(cfg.num_tma_store_stages),
              str(cfg.num_non_epilogue_threads), str(cfg.num_epilogue_threads),
              str(cfg.cluster), _b(cfg.multicast_on_a), str(cfg.num_sms),
              "true", "true",  # kSwapAB (m-grouped), kEnsureZeroPadding
              _GEMM_TYPE[cfg.gemm_kind], "false",
              "cutlass::float_e4m3_t", _SM100_B_DTYPE[cfg.b_dtype], "cutlass::bfloat16_t",
              "epilogue::operators::Identity", "true"]
    return _unit("sm100_fp8_fp4_gemm_1d1d.cuh", "sm100_fp8_fp4_gemm_1d1d_impl", params)


def _float_literal(x: float | None) -> str:
    """A C++ float literal for a float template argument: hex (exact), or infinity for None."""
    if x is None:
        return "cute::numeric_limits<float>::infinity()"
    return float(np.float32(x)).hex() + "f"


def sm90_fused_moe_source(cfg: Sm90FusedMoEConfig) -> str:
    """The fused MoE kernel (dispatch, GEMM1, SwiGLU + FP8 quantization, GEMM2, combine) for one
    rank, every shape, tile and schedule option compiled in (the event trace with ``cfg.trace``,
    without its epilogue sub-events)."""
    buf = cfg.buffer
    params = [str(cfg.max_tokens), str(cfg.hidden), str(cfg.intermediate), str(cfg.num_experts), str(cfg.top_k),
              str(cfg.experts_per_wave), str(cfg.block_m), str(cfg.block_n), str(cfg.block_k),
              str(buf.pool_tokens), str(buf.padded_sf_tokens), str(buf.pool_tokens),  # ring = the whole pool
              str(cfg.num_stages), str(cfg.num_dispatch_threads), str(cfg.num_non_epilogue_threads),
              str(cfg.num_epilogue_threads), str(cfg.num_sms), "1",  # kNumRanks
              _float_literal(cfg.activation_clamp), _b(cfg.fast_math), "0",  # register split: the kernel's own
              _b(cfg.reuse_accum_as_final), _b(cfg.l2_arrival_counter), _b(cfg.l2_epilogue_full_sync),
              _b(cfg.half_l2_cd),
              str(cfg.cluster_size), _b(cfg.cluster_size == 2),  # kClusterSize, kMulticastOnB (the weights)
              str(cfg.l2_lag_units), str(cfg.l2_cd_passes), _b(cfg.trace), "false",  # kTrace, kTraceEpi
              str(cfg.l2_stage_mode), _b(cfg.pdl),  # kPDL
              str(int(cfg.early_combine)), str(cfg.pull_publish_batch), _b(cfg.pull_eager_publish)]
    return _unit("sm90_fp8_mega_moe.cuh", "sm90_fp8_mega_moe_impl", params)

