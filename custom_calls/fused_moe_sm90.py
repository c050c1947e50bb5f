"""The fused MoE ops' SM90 path of backend 'deep_gemm': the Triton router and input kernels
composed with the DeepGEMM fused kernel (`custom_calls.deep_gemm.fused_moe`).

The fused kernel reads its device buffer (`layouts.FusedMoEBuffer`) with the workspace zeroed and
the input regions filled:

* op `fused_moe` runs two custom calls: the input stage, one Triton kernel
  (`custom_calls.triton.fused_input_kernel`), zeroes the workspace (the kernel's counters and flags
  start from zero every call, so no state outlives a call) and writes the tokens (per-128 FP8
  quantization), the canonical top-k ids (as int64) and the top-k weights times
  `routed_scaling_factor`; then the fused kernel takes the buffer in and out (aliased) and writes y;
* op `fused_moe_routed` runs the router kernel, the input stage with the routing epilogue and the
  fused kernel as one custom call of the native launcher (`routed_plans`), the router and the input
  stage launched programmatically (the input stage beside the router).

Importing this module imports `custom_calls.deep_gemm` (the GEMMs and the environment check of the
backend) and registers both ops for the backend; `custom_calls.backends` names it as the module
that loads backend 'deep_gemm'. Triton itself is imported only when a kernel is built.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from custom_calls.backends import register
from custom_calls.deep_gemm import BACKEND
from custom_calls.deep_gemm import fused_moe as fused_kernel
from custom_calls.deep_gemm.fused_moe_config import Sm90FusedMoEConfig
from custom_calls.fused_moe import OP, OP_ROUTED
from custom_calls.native.launch import launch
from custom_calls.native.launch_plan import LaunchPlan
from custom_calls.native.toolchain import detected_device
from custom_calls.settings import KernelSettings, resolve_settings
from custom_calls.triton.launch import missing_dependencies
from layouts import FUSED_GATE_UP_GRAN


def _input_stage(cfg: Sm90FusedMoEConfig, x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, *,
                 routed_scaling_factor: float) -> tuple[str, jax.Array]:
    """(the kernel's cubin, the buffer filled for x's tokens) for a config given explicitly."""
    m = x.shape[0]
    if not 0 < m <= cfg.max_tokens:
        raise ValueError(f"x: expected 1 to {cfg.max_tokens} tokens (the config's capacity), got {m}")
    cubin = fused_kernel.kernel_cubin(cfg)
    from custom_calls.triton.fused_input_kernel import fused_input  # imports triton

    return cubin, fused_input(x, topk_ids, topk_weights, buffer=cfg.buffer,
                              routed_scaling_factor=routed_scaling_factor)


def fused_moe_impl(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, w13: jax.Array,
                   w13_scale: jax.Array, w2: jax.Array, w2_scale: jax.Array, *, routed_scaling_factor: float,
                   activation_clamp: float | None, w13_interleave: int, settings: KernelSettings) -> jax.Array:
    """x (M, H) bf16, topk_ids (M, k) int32, topk_weights (M, k) f32, w13 (E, 2I, H) e4m3 with its
    gate/up rows interleaved in groups of 8, w2 (E, H, I) e4m3, 128x128 block scales f32
    -> (M, H) bf16. Operands already checked by the op, w13_interleave == 8 by `static_supports_fused`."""
    m, h = x.shape
    e, two_i, _ = w13.shape
    if m == 0:
        return jnp.zeros((0, h), jnp.bfloat16)
    cfg = fused_kernel.layer_config(m=m, hidden=h, intermediate=two_i // 2, num_experts=e,
                                    top_k=topk_ids.shape[1], activation_clamp=activation_clamp,
                                    num_sms=settings.num_sms)
    return fused_moe_with_config(cfg, x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale,
                                 routed_scaling_factor=routed_scaling_factor, command_buffer=settings.command_buffer)


def fused_moe_with_config(cfg: Sm90FusedMoEConfig, x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array,
                          w13: jax.Array, w13_scale: jax.Array, w2: jax.Array, w2_scale: jax.Array, *,
                          routed_scaling_factor: float, command_buffer: bool = False) -> jax.Array:
    """`fused_moe_impl` with the kernel configuration given (e.g. a `moe_jax.bench.fused.sm90_fused_moe_candidates`
    entry, as `python -m moe_jax.bench fused` runs them): operands as there, already checked, 1 to
    ``cfg.max_tokens`` tokens of ``cfg``'s shapes. A config whose clusters the GPU cannot hold is
    refused with the reason; a traced config (``trace=True``) goes to `fused_moe_traced`."""
    if cfg.trace:
        raise ValueError("cfg.trace: expected False (fused_moe_traced runs the traced build), got True")
    cubin, buf = _input_stage(cfg, x, topk_ids, topk_weights, routed_scaling_factor=routed_scaling_factor)
    return fused_kernel.run_kernel(cfg, cubin, buf, x.shape[0], w13, w13_scale, w2, w2_scale,
                                   command_buffer=command_buffer)[0]


def fused_moe_traced(cfg: Sm90FusedMoEConfig, x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array,
                     w13: jax.Array, w13_scale: jax.Array, w2: jax.Array, w2_scale: jax.Array, *,
                     routed_scaling_factor: float) -> tuple[jax.Array, jax.Array]:
    """`fused_moe_with_config` with the kernel's event trace (``cfg`` with ``trace=True``: a
    diagnostic build, same output bits) -> (y (M, H) bf16, trace (num_sms, 4, 2048, 4) uint32:
    per CTA and role (0 dispatch warp, 1 the activation loader, 2 / 3 math warpgroups 0 / 1) the
    (event << 56 | aux, %globaltimer ns) uint64 pairs as little-endian words; unused slots 0)."""
    if not cfg.trace:
        raise ValueError(f"cfg.trace: expected True for a traced launch, got {cfg.trace!r}")
    cubin, buf = _input_stage(cfg, x, topk_ids, topk_weights, routed_scaling_factor=routed_scaling_factor)
    y, trace = fused_kernel.run_kernel(cfg, cubin, buf, x.shape[0], w13, w13_scale, w2, w2_scale)
    return y, trace.reshape(cfg.num_sms, fused_kernel.TRACE_ROLES, fused_kernel.TRACE_SLOTS, 4)


def fused_moe_routed_impl(x: jax.Array, gate_weight: jax.Array, bias: jax.Array | None, expert_offset: jax.Array,
                          w13: jax.Array, w13_scale: jax.Array, w2: jax.Array, w2_scale: jax.Array, *, top_k: int,
                          scoring: str, n_group: int, topk_group: int, norm_topk_prob: bool,
                          routed_scaling_factor: float, activation_clamp: float | None,
                          w13_interleave: int, settings: KernelSettings) -> jax.Array:
    """Op `fused_moe_routed` as one custom call of three kernels (`routed_sequence`): the router
    GEMM as split-K partials (Triton), the input stage with the routing epilogue (Triton), the
    fused kernel. Operands checked by the op."""
    m, h = x.shape
    e, two_i, _ = w13.shape
    if m == 0:
        return jnp.zeros((0, h), jnp.bfloat16)
    cfg = fused_kernel.layer_config(m=m, hidden=h, intermediate=two_i // 2, num_experts=e, top_k=top_k,
                                    activation_clamp=activation_clamp, num_sms=settings.num_sms)
    return routed_sequence(cfg, x, gate_weight, bias, expert_offset, w13, w13_scale, w2, w2_scale, top_k=top_k,
                           scoring=scoring, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                           routed_scaling_factor=routed_scaling_factor, command_buffer=settings.command_buffer)


def routed_sequence(cfg: Sm90FusedMoEConfig, x: jax.Array, gate_weight: jax.Array, bias: jax.Array | None,
                    expert_offset: jax.Array, w13: jax.Array, w13_scale: jax.Array, w2: jax.Array,
                    w2_scale: jax.Array, *, command_buffer: bool = False, **routing) -> jax.Array:
    """The routed branch for ``cfg`` (1 to cfg.max_tokens tokens) in one custom call of three
    kernels (`routed_plans`; ``routing``: its keyword arguments) -> y (M, H) bf16."""
    plans, inputs, outputs = routed_plans(cfg, fused_kernel.kernel_cubin(cfg), detected_device()[1], x,
                                          gate_weight, bias, expert_offset, w13, w13_scale, w2, w2_scale,
                                          **routing)
    return launch(plans, inputs, outputs, command_buffer=command_buffer)[2]


def routed_plans(cfg: Sm90FusedMoEConfig, fused_cubin: str, arch: int, x: jax.Array, gate_weight: jax.Array,
                 bias: jax.Array | None, expert_offset: jax.Array, w13: jax.Array, w13_scale: jax.Array,
                 w2: jax.Array, w2_scale: jax.Array, *, top_k: int, scoring: str, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float
                 ) -> tuple[tuple[LaunchPlan, ...], list[jax.Array], list[jax.ShapeDtypeStruct]]:
    """(plans, inputs, outputs) of the routed branch's one custom call on the native launcher:
    the router kernel, launched programmatically (it waits for the kernel before it to complete
    before it touches memory, then lets the next kernel start), the input kernel launched
    programmatically (its quantizing and zeroing programs run beside the router; its routing
    programs wait for the router's completion before they read the partials), and the fused
    kernel, launched programmatically when ``cfg.pdl`` (then compiled to wait for the input
    kernel). Nothing XLA schedules can run between them, and the partials and the buffer are
    outputs of the call, so the overlap touches no buffer another op could be given. Operands:
    inputs 0 x, 1 gate_weight, 2 a float32 placeholder, 3 the bias operand, 4 expert_offset (1,),
    5-8 w13, w13_scale, w2, w2_scale; outputs 9 the router partials, 10 the buffer, 11 y."""
    from custom_calls.triton.fused_input_kernel import fused_input_routed_call  # imports triton
    from custom_calls.triton.native import kernel_plan_for
    from custom_calls.triton.router_kernel import router_call

    m, h = x.shape
    router = router_call(x, gate_weight, trigger=True, wait=True)
    (partials,) = router.out_shape
    stage = fused_input_routed_call(x, partials, bias, expert_offset, buffer=cfg.buffer,
                                    routed_scaling_factor=routed_scaling_factor, top_k=top_k, scoring=scoring,
                                    n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob, wait=True)
    _, _, placeholder, bias_op, offset = stage.operands
    inputs = [x, gate_weight, placeholder, bias_op, offset, w13, w13_scale, w2, w2_scale]
    outputs = [partials, *stage.out_shape, jax.ShapeDtypeStruct((m, h), jnp.bfloat16)]
    plans = (kernel_plan_for(router, arch=arch, operands=(0, 1, 9), programmatic=True),
             kernel_plan_for(stage, arch=arch, operands=(0, 9, 2, 3, 4, 10), programmatic=True),
             fused_kernel.fused_plan(cfg, fused_cubin, num_tokens=m).remap((10, 5, 6, 7, 8, 11, 10)))
    return plans, inputs, outputs


def static_supports_fused(*, m: int, hidden: int, intermediate: int, num_experts: int, top_k: int, x_dtype,
                          weight_dtype, routed_scaling_factor: float, activation_clamp: float | None, arch: int,
                          w13_interleave: int, settings: KernelSettings | None = None,
                          num_sms: int | None = None) -> tuple[bool, str]:
    """(ok, reason) of backend 'deep_gemm' for op `fused_moe`, from the static arguments (num_sms:
    the settings', else the device's, else the H200's 132 for a shape-only answer on a machine
    without one)."""
    if arch != fused_kernel.ARCH:
        return False, f"arch: the fused MoE kernel runs on SM90 (arch {fused_kernel.ARCH}), got {arch}"
    if w13_interleave != FUSED_GATE_UP_GRAN:
        return False, (f"w13_interleave: the fused kernel reads w13 with gate/up rows interleaved in groups of "
                       f"{FUSED_GATE_UP_GRAN} (layouts.interleave_gate_up), got {w13_interleave}")
    if jnp.dtype(x_dtype) != jnp.bfloat16 or jnp.dtype(weight_dtype) != jnp.float8_e4m3fn:
        return False, f"dtypes: expected x bf16 and weights float8_e4m3fn, got {x_dtype} and {weight_dtype}"
    missing = missing_dependencies()
    if missing:
        return False, (f"dependencies: the fused kernel's input stage is a Triton kernel; not importable here: "
                       f"{', '.join(missing)} (pip install 'moe-jax[gpu]')")
    if num_sms is None:
        num_sms = resolve_settings(settings).num_sms or detected_device()[2] or 132
    reason = fused_kernel.fused_reason(num_tokens=max(m, 1), hidden=hidden, intermediate=intermediate,
                                       num_experts=num_experts, top_k=top_k, num_sms=num_sms)
    return (False, reason) if reason else (True, "")


def static_supports_fused_routed(*, num_route_experts: int, top_k: int, scoring: str, n_group: int,
                                 topk_group: int, gate_dtype, num_sms: int | None = None, **fused) -> tuple[bool, str]:
    """(ok, reason) of backend 'deep_gemm' for op `fused_moe_routed`: the fused kernel's (as
    `static_supports_fused`), the routing epilogue's (`route_topk_reason`) and a bf16 gate."""
    ok, reason = static_supports_fused(top_k=top_k, num_sms=num_sms, **fused)
    if not ok:
        return ok, reason
    if jnp.dtype(gate_dtype) != jnp.bfloat16:
        return False, f"gate_dtype: the router GEMM runs bf16 x bf16 -> f32, expected bfloat16, got {gate_dtype}"
    from custom_calls.triton.support import route_topk_reason

    reason = route_topk_reason(num_route_experts, top_k, scoring, n_group if n_group > 1 else 1, topk_group)
    return (False, f"routing: {reason}") if reason else (True, "")


register(OP, BACKEND, fused_moe_impl, static_supports_fused)
register(OP_ROUTED, BACKEND, fused_moe_routed_impl, static_supports_fused_routed)
