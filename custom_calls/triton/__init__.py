"""The "triton" backend: the non-GEMM stages of the MoE layer as Triton kernels launched as XLA
custom calls through jax_triton, behind the reference ops' names and signatures. (`native` compiles
a kernel to a cubin for the native launcher, `custom_calls.native`, instead, where it runs in one
custom call beside other kernels, launched programmatically: the fused routed branch.)

  op (registry name)           kernel module                          moves
  permute_contig / _masked     custom_calls.triton.permute_kernel     x read once, top_k rows written
  activation_quant_contig/_m.  custom_calls.triton.activation_kernel  2I bf16 read, I e4m3 written
  unpermute                    custom_calls.triton.unpermute_kernel   top_k rows read, 1 row written
  rank_within_expert           custom_calls.triton.dispatch_kernel    dispatch slot ranks, no sort
  dispatch_map_contig/_masked  custom_calls.triton.dispatch_map_kernel  the whole dispatch map, 1-2 launches
  route_topk                   custom_calls.triton.routing_kernel     scores + grouped top-k + weights
  (quantize_activation)        custom_calls.triton.quant_kernel       x read, e4m3 + image written
  (fused_input)                custom_calls.triton.fused_input_kernel x read, the fused kernel's inputs written
  (router_partials)            custom_calls.triton.router_kernel      the router GEMM as split-K partial sums
The Triton W4A8 grouped GEMMs (custom_calls.triton.w4a8_gemm_kernel, mxfp4 kept 4-bit on arch 90)
serve a backend of their own, "w4a8" (custom_calls.w4a8_backend, beside the CUDA masked kernel):
"triton" keeps meaning the layer's non-GEMM stages. The last three are plain functions (the layer quantizes inside permute and activation; the fused
MoE ops' SM90 path calls `fused_input` before its kernel, `fused_moe_routed`'s runs the router
and the routing input kernel (`router_call`, `fused_input_routed_call`) in one call with its kernel).

Scales are written directly in the grouped GEMM's memory image (fp32 MN-major TMA-aligned for
arch 90, packed UE8M0 for arch 100). Importing this package imports neither triton nor jax_triton
and probes no device: the registry imports it when the backend is resolved on a GPU, the
implementations import their kernel modules (triton) and jax_triton when first called.
"""

from __future__ import annotations

import importlib

import jax

from custom_calls.backends import register, set_environment
from custom_calls.triton.support import (
    activation_masked_constraints,
    dispatch_map_reason,
    environment,
    route_topk_reason,
    supports_activation_contig,
    supports_activation_masked,
    supports_dispatch_map_contig,
    supports_dispatch_map_masked,
    supports_permute_contig,
    supports_permute_masked,
    supports_rank_within_expert,
    supports_route_topk,
    supports_unpermute,
)

BACKEND = "triton"


def permute_contig(x: jax.Array, src2dst: jax.Array, *, num_rows: int, recipe: str,
                   arch: int) -> tuple[jax.Array, jax.Array | None]:
    """As `custom_calls.permute.permute_contig`: x (M, H), src2dst (M, k) -> (lhs (num_rows, H), image | None)."""
    from custom_calls.triton import permute_kernel

    return permute_kernel.permute_contig(x, src2dst, num_rows=num_rows, recipe=recipe, arch=arch)


def permute_masked(x: jax.Array, src2dst: jax.Array, *, num_groups: int, m_pad: int, recipe: str,
                   arch: int) -> tuple[jax.Array, jax.Array | None]:
    """As `custom_calls.permute.permute_masked`: x (M, H), src2dst (M, k) -> (lhs (G, m_pad, H), image | None)."""
    from custom_calls.triton import permute_kernel

    return permute_kernel.permute_masked(x, src2dst, num_groups=num_groups, m_pad=m_pad, recipe=recipe,
                                         arch=arch)


def activation_quant_contig(gateup: jax.Array, *, act, recipe: str,
                            arch: int) -> tuple[jax.Array, jax.Array | None]:
    """As `custom_calls.activation.activation_quant_contig`: gateup (rows, 2I) -> (a (rows, I), image | None)."""
    from custom_calls.triton import activation_kernel

    return activation_kernel.activation_quant_contig(gateup, act=act, recipe=recipe, arch=arch)


def activation_quant_masked(gateup: jax.Array, masked_m: jax.Array, *, act, recipe: str,
                            arch: int) -> tuple[jax.Array, jax.Array | None]:
    """As `custom_calls.activation.activation_quant_masked`: gateup (G, m_pad, 2I), masked_m (G,)
    -> (a (G, m_pad, I), image | None); rows >= masked_m[g] left unspecified."""
    from custom_calls.triton import activation_kernel

    return activation_kernel.activation_quant_masked(gateup, masked_m, act=act, recipe=recipe, arch=arch)


def unpermute(d: jax.Array, src2dst: jax.Array, topk_weights: jax.Array, addend: jax.Array | None = None, *,
              routed_scaling_factor: float, out_dtype) -> jax.Array:
    """As `custom_calls.unpermute.unpermute`: d (R, H), src2dst (M, k), topk_weights (M, k),
    addend (M, H) | None -> (M, H)."""
    from custom_calls.triton import unpermute_kernel

    return unpermute_kernel.unpermute(d, src2dst, topk_weights, addend, routed_scaling_factor=routed_scaling_factor,
                                      out_dtype=out_dtype)


def rank_within_expert(e_flat: jax.Array, *, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """As `custom_calls.expert_rank.rank_within_expert`: e_flat (R,) int32 in [0, E] ->
    (counts (E,) int32, rank (R,) int32), rank = routes of the same value before it."""
    from custom_calls.triton import dispatch_kernel

    return dispatch_kernel.rank_within_expert(e_flat, num_experts=num_experts)


def dispatch_map_contig(topk_ids: jax.Array, expert_offset: jax.Array, *, num_local_experts: int,
                        alignment: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """As `custom_calls.dispatch_map.dispatch_map_contig`: topk_ids (M, k) int32, expert_offset () int32 ->
    (src2dst (M, k), m_indices (M_cap,), num_rows (), counts (E_local,)) int32."""
    from custom_calls.triton import dispatch_map_kernel

    return dispatch_map_kernel.dispatch_map_contig(topk_ids, expert_offset, num_local_experts=num_local_experts,
                                                   alignment=alignment)


def dispatch_map_masked(topk_ids: jax.Array, expert_offset: jax.Array, *, num_local_experts: int,
                        m_pad: int, mark_dropped: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """As `custom_calls.dispatch_map.dispatch_map_masked`: topk_ids (M, k) int32, expert_offset () int32 ->
    (src2dst (M, k), masked_m (E_local,), num_dropped ()) int32."""
    from custom_calls.triton import dispatch_map_kernel

    return dispatch_map_kernel.dispatch_map_masked(topk_ids, expert_offset, num_local_experts=num_local_experts,
                                                   m_pad=m_pad, mark_dropped=mark_dropped)


def route_topk(logits: jax.Array, bias: jax.Array | None, *, top_k: int, scoring: str, n_group: int = 1,
               topk_group: int = 1, norm_topk_prob: bool = True) -> tuple[jax.Array, jax.Array]:
    """As `custom_calls.route_topk.route_topk`: logits (M, E) f32 ->
    (topk_ids (M, top_k) int32, topk_weights (M, top_k) f32)."""
    from custom_calls.triton import routing_kernel

    return routing_kernel.route_topk(logits, bias, top_k=top_k, scoring=scoring, n_group=n_group,
                                     topk_group=topk_group, norm_topk_prob=norm_topk_prob)


def _register() -> None:
    # op names as the reference modules define them (package attributes may shadow the modules)
    _permute_ref = importlib.import_module("custom_calls.permute")
    _activation_ref = importlib.import_module("custom_calls.activation")
    _unpermute_ref = importlib.import_module("custom_calls.unpermute")
    _rank_ref = importlib.import_module("custom_calls.expert_rank")
    _route_ref = importlib.import_module("custom_calls.route_topk")
    _map_ref = importlib.import_module("custom_calls.dispatch_map")
    register(_permute_ref.OP_CONTIG, BACKEND, permute_contig, supports_permute_contig)
    register(_permute_ref.OP_MASKED, BACKEND, permute_masked, supports_permute_masked)
    register(_activation_ref.OP_CONTIG, BACKEND, activation_quant_contig, supports_activation_contig)
    register(_activation_ref.OP_MASKED, BACKEND, activation_quant_masked, supports_activation_masked)
    register(_unpermute_ref.OP, BACKEND, unpermute, supports_unpermute)
    register(_rank_ref.OP, BACKEND, rank_within_expert, supports_rank_within_expert)
    register(_route_ref.OP, BACKEND, route_topk, supports_route_topk)
    register(_map_ref.OP_CONTIG, BACKEND, dispatch_map_contig, supports_dispatch_map_contig)
    register(_map_ref.OP_MASKED, BACKEND, dispatch_map_masked, supports_dispatch_map_masked)
    set_environment(BACKEND, environment)


_register()

__all__ = [
    "BACKEND",
    "activation_masked_constraints",
    "activation_quant_contig",
    "activation_quant_masked",
    "dispatch_map_contig",
    "dispatch_map_masked",
    "dispatch_map_reason",
    "environment",
    "permute_contig",
    "permute_masked",
    "rank_within_expert",
    "route_topk",
    "route_topk_reason",
    "supports_activation_contig",
    "supports_activation_masked",
    "supports_dispatch_map_contig",
    "supports_dispatch_map_masked",
    "supports_permute_contig",
    "supports_permute_masked",
    "supports_rank_within_expert",
    "supports_route_topk",
    "supports_unpermute",
    "unpermute",
]
