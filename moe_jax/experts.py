"""The expert MLP of the routed experts: GEMM1 (w13) -> gated activation + quantization -> GEMM2
(w2), on the contig or masked layout, for weights in GEMM form (`prepare_params`).

The dispatcher's m_indices / masked_m keep the ops' index contracts by construction, so the ops
are called with assume_canonical=True: no canonicalization pass runs before each GEMM. The layer's
producers write each GEMM's lhs in the order its format reads (`GemmFormat.lhs_order`)."""

from __future__ import annotations

import jax

from custom_calls import (ActivationSpec, KernelSettings, activation_quant_contig, activation_quant_masked,
                          m_grouped_gemm_contig, m_grouped_gemm_masked)
from layouts import gemm_format
from moe_jax.dispatch import ContigDispatch, MaskedDispatch
from moe_jax.params import MoEParams


def expert_core_contig(lhs: jax.Array, lhs_scale: jax.Array | None, disp: ContigDispatch,
                       params: MoEParams, act: ActivationSpec, *, gemm_backend=None,
                       act_backend=None, debug_checks: bool = False,
                       settings: KernelSettings | None = None) -> jax.Array:
    """lhs: (M_cap, H) bf16 | e4m3 (+ scale image) -> (M_cap, H) bf16, padding rows 0.
    debug_checks: the GEMMs' checked mode (`custom_calls.contracts`); settings: the GEMMs'
    `custom_calls.KernelSettings` (None: the environment's)."""
    recipe, arch = params.gemm_recipe, params.gemm_arch
    order = gemm_format(recipe, arch).lhs_order
    gateup = m_grouped_gemm_contig(lhs, params.w13, disp.m_indices, lhs_scale=lhs_scale,
                                   rhs_scale=params.w13_scale, recipe=recipe, arch=arch,
                                   alignment=disp.alignment, lhs_order=order, backend=gemm_backend,
                                   debug_checks=debug_checks, assume_canonical=True, settings=settings)
    a, a_scale = activation_quant_contig(gateup, act=act, recipe=recipe, arch=arch, backend=act_backend)
    return m_grouped_gemm_contig(a, params.w2, disp.m_indices, lhs_scale=a_scale,
                                 rhs_scale=params.w2_scale, recipe=recipe, arch=arch,
                                 alignment=disp.alignment, lhs_order=order, backend=gemm_backend,
                                 debug_checks=debug_checks, assume_canonical=True, settings=settings)


def expert_core_masked(lhs: jax.Array, lhs_scale: jax.Array | None, disp: MaskedDispatch,
                       params: MoEParams, act: ActivationSpec, *, gemm_backend=None,
                       act_backend=None, debug_checks: bool = False,
                       settings: KernelSettings | None = None) -> jax.Array:
    """lhs: (E_local, m_pad, H) bf16 | e4m3 (+ scale image) -> (E_local, m_pad, H) bf16; rows
    >= masked_m[e] unspecified. debug_checks, settings: as `expert_core_contig`."""
    recipe, arch = params.gemm_recipe, params.gemm_arch
    order = gemm_format(recipe, arch).lhs_order
    gateup = m_grouped_gemm_masked(lhs, params.w13, disp.masked_m, expected_m=disp.expected_m,
                                   lhs_scale=lhs_scale, rhs_scale=params.w13_scale, recipe=recipe,
                                   arch=arch, lhs_order=order, backend=gemm_backend, debug_checks=debug_checks,
                                   assume_canonical=True, settings=settings)
    a, a_scale = activation_quant_masked(gateup, disp.masked_m, act=act, recipe=recipe, arch=arch,
                                         backend=act_backend, debug_checks=debug_checks,
                                         assume_canonical=True)
    return m_grouped_gemm_masked(a, params.w2, disp.masked_m, expected_m=disp.expected_m,
                                 lhs_scale=a_scale, rhs_scale=params.w2_scale, recipe=recipe,
                                 arch=arch, lhs_order=order, backend=gemm_backend, debug_checks=debug_checks,
                                 assume_canonical=True, settings=settings)
