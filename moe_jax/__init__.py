"""moe_jax: DeepSeek-style MoE layers as pure, jit-able JAX functions.

    config = MoEConfig.deepseek_v3().scaled(num_experts=16, hidden_size=256, intermediate_size=128)
    params = prepare_params(init_params(jax.random.key(0), config), config)
    y = jax.jit(moe_forward, static_argnames=("config",))(x, params, config=config)

Stages, one file each: config, params, routing, dispatch, experts (the expert MLP), shared (the
shared experts' dense MLP, bf16 or FP8), layer (routed/shared experts and moe_forward); the ops
themselves live in `custom_calls`.
"""

__version__ = "0.1.0"  # the package version (pyproject.toml reads it from here)

from moe_jax.config import MoEConfig
from moe_jax.dispatch import (LAYOUTS, ContigDispatch, MaskedDispatch, choose_layout, contig_capacity,
                              default_masked_m_pad, dispatch_contig, dispatch_masked, expected_m,
                              masked_peak_bytes)
from moe_jax.experts import expert_core_contig, expert_core_masked
from moe_jax.hf_config import layer_kinds
from moe_jax.layer import STAGES, moe_forward, resolve_layout, routed_experts, shared_experts, stage_backends
from moe_jax.params import MoEParams, check_params, check_shared, init_params, prepare_params
from moe_jax.routing import route, router_logits, score, select_experts
from moe_jax.validate import check_x

__all__ = [
    "LAYOUTS", "STAGES", "ContigDispatch", "MaskedDispatch", "MoEConfig", "MoEParams", "check_params",
    "check_shared", "check_x", "choose_layout", "contig_capacity", "default_masked_m_pad", "dispatch_contig",
    "dispatch_masked", "expected_m", "expert_core_contig", "expert_core_masked", "init_params", "layer_kinds",
    "masked_peak_bytes", "moe_forward", "prepare_params", "resolve_layout", "route", "routed_experts",
    "router_logits", "score", "select_experts", "shared_experts", "stage_backends",
]
