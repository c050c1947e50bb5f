"""DeepGEMM's CUDA kernels (sgl-deep-gemm 0.2.5 templates) as XLA custom calls, with our own host:
per-shape heuristics, code generation, nvcc JIT with an on-disk cache, and launch plans for the
native launcher (`custom_calls.native`: a C++ FFI handler that encodes TMA descriptors for the
current buffers and launches on XLA's stream).

Run on SM90: grouped contig/masked FP8 1D2D and BF16, dense FP8/BF16 ``gemm_nt``, TF32 prenorm, and
the fused MoE kernel (the routed branch in one kernel, fused_moe.py; composed with the Triton input
stage into ops ``fused_moe`` and ``fused_moe_routed`` by `custom_calls.fused_moe_sm90`).
SM100 (fp8_block, mxfp8, mxfp4 1D1D): generated and compiled for sm_100a, not run on SM100 hardware.
Grouped SM90 configs can be autotuned on the device and cached (opt-in: ``TuningPolicy``,
$MOE_JAX_GEMM_TUNING; autotune.py). Importing this package probes no device and imports no CUDA
Python binding; it registers the grouped GEMMs and the dense GEMM (op ``gemm_nt``) as backend
'deep_gemm' of the registry (shape rules, environment check, implementations). The registry loads
the backend through `custom_calls.fused_moe_sm90`, which imports this package and adds the fused
MoE ops.
"""

from custom_calls.backends import register as _register, set_environment as _set_environment
from custom_calls.dense_gemm import OP as _OP_DENSE
from custom_calls.grouped_gemm import OP_CONTIG as _OP_CONTIG, OP_MASKED as _OP_MASKED

from .autotune import TuningPolicy
from .compiler import Cubin, compile_cubin
from .heuristics import (Sm90GemmConfig, Sm90PrenormConfig, Sm100GemmConfig, sm90_gemm_config,
                         sm90_prenorm_config, sm100_mgrouped_config)
from . import ops as _ops
from .ops import (BACKEND, detected_device, gemm_nt_bf16, gemm_nt_fp8, m_grouped_gemm_contig,
                  m_grouped_gemm_masked, supports_gemm_nt, supports_m_grouped_gemm_contig,
                  supports_m_grouped_gemm_masked, supports_tf32_prenorm_gemm, tf32_prenorm_gemm)
from .warmup import GemmShape, warmup

_register(_OP_CONTIG, BACKEND, _ops.contig_impl, _ops.static_supports_contig)
_register(_OP_MASKED, BACKEND, _ops.masked_impl, _ops.static_supports_masked)
_register(_OP_DENSE, BACKEND, _ops.dense_impl, _ops.static_supports_gemm_nt)
# looked up at call time, so the environment can be replaced (tests, other devices)
_set_environment(BACKEND, lambda platform, **static: _ops.environment(platform, **static))

__all__ = [
    "BACKEND", "Cubin", "GemmShape", "Sm90GemmConfig", "Sm90PrenormConfig", "Sm100GemmConfig",
    "compile_cubin", "detected_device", "gemm_nt_bf16", "gemm_nt_fp8", "m_grouped_gemm_contig",
    "m_grouped_gemm_masked", "sm90_gemm_config", "sm90_prenorm_config", "sm100_mgrouped_config",
    "supports_gemm_nt", "supports_m_grouped_gemm_contig", "supports_m_grouped_gemm_masked",
    "supports_tf32_prenorm_gemm", "tf32_prenorm_gemm", "TuningPolicy", "warmup",
]
