"""DeepGEMM's CUDA kernels (sgl-deep-gemm 0.2.5 templates) as XLA custom calls, with our own host:
per-shape configs, code generation, nvcc JIT with an on-disk cache, and launch plans for the
native launcher (`custom_calls.native`: a C++ FFI handler that encodes TMA descriptors for the
current buffers and launches on XLA's stream).

The GEMM templates are kernel families, one module and one row of `families.FAMILIES` each
(family.py says what a family provides); the GEMM format of a call decides its family:
  sm90_fp8_1d2d.py  grouped contig/masked and dense FP8 1D2D on SM90 (recipe fp8_block)
  sm90_bf16.py      grouped contig/masked and dense BF16 on SM90 (recipe bf16)
  sm100_1d1d.py     grouped FP8/FP4 1D1D on SM100 (fp8_block, mxfp8, mxfp4): generated and
                    compiled for sm_100a, not run on SM100 hardware
The two SM90 families share the tile rules and heuristic of sm90_gemm.py; their grouped configs can
be tuned on the device and cached (opt-in: ``TuningPolicy``, $MOE_JAX_GEMM_TUNING; autotune.py
reads the cache, the search is ``python -m moe_jax.bench.tune``). Beside the families: the TF32
prenorm GEMM (sm90_prenorm.py) and the fused MoE kernel (the routed branch in one kernel,
fused_moe_config.py, fused_moe.py; composed with the Triton input stage into ops ``fused_moe`` and
``fused_moe_routed`` by `custom_calls.fused_moe_sm90`).

Importing this package probes no device and imports no CUDA Python binding; it registers the
grouped GEMMs and the dense GEMM (op ``gemm_nt``) as backend 'deep_gemm' of the registry (shape
rules, environment check, implementations). The registry loads the backend through
`custom_calls.fused_moe_sm90`, which imports this package and adds the fused MoE ops.
"""

from custom_calls.backends import register as _register, set_environment as _set_environment
from custom_calls.dense_gemm import OP as _OP_DENSE
from custom_calls.grouped_gemm import OP_CONTIG as _OP_CONTIG, OP_MASKED as _OP_MASKED

from .autotune import TuningPolicy
from custom_calls.native.compiler import Cubin, compile_cubin
from .families import FAMILIES, family_for, gemm_problem
from .family import GemmProblem, KernelFamily
from .sm90_gemm import Sm90GemmConfig, sm90_gemm_config
from .sm90_prenorm import Sm90PrenormConfig, sm90_prenorm_config
from .sm100_1d1d import Sm100GemmConfig, sm100_mgrouped_config
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
    "BACKEND", "Cubin", "FAMILIES", "GemmProblem", "GemmShape", "KernelFamily", "Sm90GemmConfig",
    "Sm90PrenormConfig", "Sm100GemmConfig", "compile_cubin", "detected_device", "family_for", "gemm_nt_bf16",
    "gemm_nt_fp8", "gemm_problem", "m_grouped_gemm_contig", "m_grouped_gemm_masked", "sm90_gemm_config",
    "sm90_prenorm_config", "sm100_mgrouped_config", "supports_gemm_nt", "supports_m_grouped_gemm_contig",
    "supports_m_grouped_gemm_masked", "supports_tf32_prenorm_gemm", "tf32_prenorm_gemm", "TuningPolicy", "warmup",
]
