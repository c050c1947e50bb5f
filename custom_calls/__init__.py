"""MoE ops behind one name each: pure-JAX references (run everywhere) and accelerated
implementations (DeepGEMM, Triton) selected through the backend registry.

Importing this package imports no GPU dependency and probes no device.
"""

from custom_calls.act_quant import quantize_activation
from custom_calls.activation import (ActivationSpec, activation_quant_contig,
                                     activation_quant_masked, gated_activation)
from custom_calls.backends import (AUTO, REFERENCE, Implementation, NoGradientError, OpSpec, auto_order,
                                   backend_stages, backends, declare_op, get_default_backend, known_backends, op_spec,
                                   register, register_lazy, resolve, set_environment, static_supports,
                                   unavailable_reason, use_backend)
from custom_calls.contracts import (canonical_m_indices, canonical_masked_m, canonical_src2dst,
                                    canonical_topk_ids, checked)
from custom_calls.dense_gemm import gemm_nt
from custom_calls.dispatch_map import dispatch_map_contig, dispatch_map_masked
from custom_calls.expert_rank import rank_within_expert
from custom_calls.fused_moe import fused_moe, fused_moe_routed
from custom_calls.grouped_gemm import (dequantize_lhs, dequantize_rhs, m_grouped_gemm_contig,
                                       m_grouped_gemm_masked)
from custom_calls.permute import permute_contig, permute_masked, scatter_rows
from custom_calls.route_topk import route_topk
from custom_calls.settings import ENVIRONMENT, KernelSettings
from custom_calls.unpermute import unpermute
from custom_calls.w4a8_widen import widen_w4a8_weights

__all__ = [
    "AUTO", "ENVIRONMENT", "REFERENCE", "ActivationSpec", "Implementation", "KernelSettings", "NoGradientError",
    "OpSpec", "activation_quant_contig",
    "activation_quant_masked", "auto_order", "backend_stages", "backends", "canonical_m_indices",
    "canonical_masked_m", "canonical_src2dst", "canonical_topk_ids", "checked", "declare_op",
    "dequantize_lhs", "dequantize_rhs", "dispatch_map_contig", "dispatch_map_masked", "fused_moe",
    "fused_moe_routed", "gated_activation",
    "gemm_nt", "get_default_backend", "known_backends",
    "m_grouped_gemm_contig", "m_grouped_gemm_masked", "op_spec", "permute_contig", "permute_masked",
    "quantize_activation", "rank_within_expert", "register", "register_lazy", "resolve",
    "route_topk", "scatter_rows", "set_environment", "static_supports", "unavailable_reason", "unpermute",
    "use_backend", "widen_w4a8_weights",
]
