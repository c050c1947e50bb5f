"""Source text of kernel instantiations for the sgl-deep-gemm 0.2.5 templates: the translation
unit every family's code generator fills in, and the fused MoE kernel's.

Each translation unit includes one kernel header and takes the address of exactly one template
instantiation, which forces that single ``__global__`` function into the cubin (the loader relies on
the cubin holding one kernel). Parameter lists follow the 0.2.5 headers, which differ from both
upstream DeepGEMM and older sgl releases (e.g. the 1D2D kernel's trailing ``SF_GRAN``).
"""

from __future__ import annotations

import numpy as np

from .fused_moe_config import Sm90FusedMoEConfig

GEMM_TYPE = {"normal": "GemmType::Normal", "contig": "GemmType::MGroupedContiguous",
             "masked": "GemmType::MGroupedMasked"}
CD_DTYPE = {"bf16": "cutlass::bfloat16_t", "f32": "float"}
K_MAJOR = "cute::UMMA::Major::K"


def cpp_bool(v: bool) -> str:
    return "true" if v else "false"


def translation_unit(header: str, kernel: str, params: list[str]) -> str:
    """A unit including ``deep_gemm/impls/<header>`` that instantiates ``kernel<params...>``."""
    args = ",\n        ".join(params)
    return (f"\n#include <deep_gemm/impls/{header}>\n\nusing namespace deep_gemm;\n\n"
            f"static void __instantiate_kernel() {{\n"
            f"    auto ptr = reinterpret_cast<void*>(&{kernel}<\n        {args}\n    >);\n}};\n")


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
              # kActivationClamp; then kFastMath on, kEpilogueRegisterBudget 0 (the kernel's own register split),
              # kReuseAccumAsFinal and kL2ArrivalCounter on, kL2EpilogueRequiresFullSync off: the values the
              # library always uses
              _float_literal(cfg.activation_clamp), "true", "0", "true", "true", "false",
              cpp_bool(cfg.half_l2_cd),
              str(cfg.cluster_size), cpp_bool(cfg.cluster_size == 2),  # kClusterSize, kMulticastOnB (the weights)
              "0",  # kL2LagUnits 0 (the wave schedule): the template's default, which the library always uses
              str(cfg.l2_cd_passes), cpp_bool(cfg.trace), "false",  # kL2CDPasses, kTrace, kTraceEpi
              str(cfg.l2_stage_mode), cpp_bool(cfg.pdl),  # kPDL
              # kEarlyCombineMode 0, kPullPublishBatch 1, kPullEagerPublish off: the template's defaults,
              # which the library always uses
              "0", "1", "false"]
    return translation_unit("sm90_fp8_mega_moe.cuh", "sm90_fp8_mega_moe_impl", params)

