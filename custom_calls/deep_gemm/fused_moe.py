"""The fused MoE kernel on SM90: the whole routed branch (dispatch, GEMM1, SwiGLU + FP8
quantization, GEMM2, top-k combine) in one persistent kernel of the sgl-deep-gemm 0.2.5 templates,
driven for one GPU.

Two custom calls share one device buffer (`layouts.FusedMoEBuffer`, the kernel's "symmetric
buffer" for a single rank):

1. the input stage, one Triton kernel (`custom_calls.triton.fused_input_kernel`), zeroes the
   buffer's workspace (the kernel's counters and flags start from zero every call, so no state
   outlives a call) and writes the tokens (per-128 FP8 quantization), the canonical top-k ids (as
   int64) and the top-k weights times `routed_scaling_factor` into the buffer's input regions;
2. the fused kernel (cooperative launch: its grid barriers need every block resident) takes the
   buffer in and out (aliased) and writes y (M, H) bf16.

With the routing inside (`fused_moe_routed_impl`) the router kernel, the input stage and the fused
kernel run as one custom call of the native launcher (`routed_plans`), the router and the input
stage launched programmatically (the input stage beside the router).

The kernel reads w13 with its gate and up rows interleaved in groups of 8
(`layouts.interleave_gate_up`); that copy is made once, when the weights are prepared. Its
capacity (the template's max tokens) is the token count rounded up to a power of two (at least 8):
one compiled kernel serves every token count of that bucket, the real count travels as an argument.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from custom_calls.triton.launch import missing_dependencies
from layouts import FUSED_GATE_UP_GRAN

from . import compiler, launch_plan as LP
from .codegen import sm90_fused_moe_source
from .heuristics import Sm90FusedMoEConfig, sm90_fused_moe_config, sm90_fused_moe_reason
from .launch import launch
from .toolchain import detected_device


def token_capacity(num_tokens: int) -> int:
    """The compiled max-token bound for `num_tokens`: the next power of two, at least 8."""
    cap = 8
    while cap < num_tokens:
        cap *= 2
    return cap


def fused_config(*, num_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 activation_clamp: float | None, num_sms: int | None = None) -> Sm90FusedMoEConfig:
    """The kernel configuration for a call of `num_tokens` tokens (its capacity bucket)."""
    num_sms = detected_device()[2] if num_sms is None else num_sms
    return sm90_fused_moe_config(max_tokens=token_capacity(num_tokens), hidden=hidden, intermediate=intermediate,
                                 num_experts=num_experts, top_k=top_k, num_sms=num_sms,
                                 activation_clamp=activation_clamp)


@functools.cache
def resident_clusters(cubin: str, grid: int, threads: int, smem: int, cluster: int) -> int:
    """How many clusters of ``cluster`` CTAs of the cubin's one kernel the first GPU holds at once
    (cuOccupancyMaxActiveClusters) in a launch of ``grid`` CTAs of ``threads`` threads and ``smem``
    bytes of dynamic shared memory."""
    from cuda.bindings import driver as cu

    def ok(res):
        err, *rest = res if isinstance(res, tuple) else (res,)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver: {cu.cuGetErrorString(err)[1]!r} while sizing {cubin}")
        return rest[0] if len(rest) == 1 else rest

    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxPushCurrent(ctx))
    try:
        with open(cubin, "rb") as f:
            module = ok(cu.cuModuleLoadData(f.read()))
        try:
            (func,) = ok(cu.cuModuleEnumerateFunctions(1, module))
            ok(cu.cuFuncSetAttribute(func, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                     smem))
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
            config = cu.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
            config.sharedMemBytes = smem
            config.attrs, config.numAttrs = [attr], 1
            return int(ok(cu.cuOccupancyMaxActiveClusters(func, config)))
        finally:
            ok(cu.cuModuleUnload(module))
    finally:
        ok(cu.cuCtxPopCurrent())
        ok(cu.cuDevicePrimaryCtxRelease(dev))


def clusters_reason(cfg: Sm90FusedMoEConfig, cubin: str) -> str | None:
    """Why the GPU cannot hold ``cfg``'s whole grid at once in clusters (the cooperative launch
    needs every CTA resident), or None."""
    if cfg.cluster_size == 1:
        return None
    held = resident_clusters(cubin, cfg.grid, cfg.num_threads, cfg.smem_bytes, cfg.cluster_size)
    if held * cfg.cluster_size < cfg.grid:
        return (f"cluster_size: the GPU holds {held} clusters of {cfg.cluster_size} CTAs of this kernel at once, "
                f"expected {cfg.grid // cfg.cluster_size} (grid {cfg.grid}, every CTA resident)")
    return None


def fused_reason(*, num_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 num_sms: int) -> str | None:
    """Why the fused kernel cannot run this shape (None when it can)."""
    return sm90_fused_moe_reason(hidden=hidden, intermediate=intermediate, num_experts=num_experts, top_k=top_k,
                                 max_tokens=token_capacity(num_tokens), num_sms=num_sms)


def fused_plan(cfg: Sm90FusedMoEConfig, cubin: str, *, num_tokens: int) -> LP.LaunchPlan:
    """Operands: 0 the buffer (aliased to output 6), 1 w13 e4m3 (E, 2I, H) gate/up interleaved,
    2 w13_scale f32 (E, 2I/128, H/128), 3 w2 e4m3 (E, H, I), 4 w2_scale f32 (E, H/128, I/128);
    outputs 5 y bf16 (M, H), 6 the buffer. With ``cfg.trace`` input 5 is the zeroed event trace
    (`TRACE_WORDS` uint32, aliased to output 8) and the outputs move up by one (6 y, 7 the buffer).
    Every map is (k, row), the expert folded into the rows of the weights; the activation scales
    are stored [k-group][pool token]."""
    r, buf = cfg.buffer.regions, cfg.buffer
    h, i, e, bm = cfg.hidden, cfg.intermediate, cfg.num_experts, cfg.block_m
    pool, pad = buf.pool_tokens, buf.padded_sf_tokens
    # the L1 output tile is staged 128B-swizzled when each math warpgroup owns 128 output columns
    # (BLOCK_M 128, the warpgroups split M), row-major when the two share the tile (BLOCK_M 64)
    l1_out_swizzle = 128 if bm == 128 else 0
    tmaps = (
        LP.TensorMap(0, LP.TMA_UINT8, (h, pool), (h,), (128, bm), 128, offset=r["l1_tokens"][0]),
        LP.TensorMap(0, LP.TMA_FLOAT32, (pad, h // 128), (pad * 4,), (bm, 1), 0, offset=r["l1_scales"][0]),
        LP.TensorMap(1, LP.TMA_UINT8, (h, e * 2 * i), (h,), (128, cfg.block_n), 128),
        LP.TensorMap(0, LP.TMA_UINT8, (i, pool), (i,), (128, 64), l1_out_swizzle, offset=r["l2_tokens"][0]),
        LP.TensorMap(0, LP.TMA_UINT8, (i, pool), (i,), (128, bm), 128, offset=r["l2_tokens"][0]),
        LP.TensorMap(0, LP.TMA_FLOAT32, (pad, i // 128), (pad * 4,), (bm, 1), 0, offset=r["l2_scales"][0]),
        LP.TensorMap(3, LP.TMA_UINT8, (i, e * h), (i,), (128, cfg.block_n), 128),
    )
    t = LP._tmap
    y, trace = (LP._ptr(6), LP._ptr(5)) if cfg.trace else (LP._ptr(5), LP.NULL)
    args = (y, LP.NULL, LP._u32(num_tokens), LP.KernelArg(LP.ARG_SYM_BUFFER, 0),
            t(0), t(1), t(2), LP._ptr(2), t(3), t(4), t(5), t(6), LP._ptr(4), trace)
    return LP.LaunchPlan("sm90_fp8_mega_moe", cubin, cfg.grid, cfg.num_threads, cfg.cluster_size, cfg.smem_bytes,
                         args, tmaps, cooperative=True, programmatic=cfg.pdl)


TRACE_ROLES, TRACE_SLOTS = 4, 2048  # the kernel's trace: [kNumSMs][4 roles][kTraceSlots] (event, time) pairs


def trace_words(num_sms: int) -> int:
    """uint32 words of the kernel's event trace for a grid of num_sms CTAs."""
    return num_sms * TRACE_ROLES * TRACE_SLOTS * 4


def kernel_name(cfg: Sm90FusedMoEConfig) -> str:
    """Cache name of the kernel."""
    clamp = "none" if cfg.activation_clamp is None else f"{cfg.activation_clamp:g}"
    return (f"sm90_fused_moe_t{cfg.max_tokens}_h{cfg.hidden}_i{cfg.intermediate}_e{cfg.num_experts}_k{cfg.top_k}"
            f"_{config_label(cfg).replace(' ', '_')}_sms{cfg.num_sms}_clamp{clamp}")


def config_label(cfg: Sm90FusedMoEConfig) -> str:
    """Tile, stages and the schedule options that differ from the template's defaults, e.g.
    ``128x256 s3 c2 lag2 ec``."""
    opts = [f"c{cfg.cluster_size}" if cfg.cluster_size != 1 else "",
            f"lag{cfg.l2_lag_units}" if cfg.l2_lag_units else "", "ec" if cfg.early_combine else "",
            f"pb{cfg.pull_publish_batch}" if cfg.pull_publish_batch != 1 else "",
            "eager" if cfg.pull_eager_publish else "",
            f"dw{cfg.num_dispatch_threads // 32}" if cfg.num_dispatch_threads != 64 else "",
            f"lw{cfg.num_non_epilogue_threads // 32}" if cfg.num_non_epilogue_threads != 64 else "",
            f"cd{cfg.l2_cd_passes}" if cfg.l2_cd_passes else "", f"sm{cfg.l2_stage_mode}" if cfg.l2_stage_mode else "",
            "pdl" if cfg.pdl else "", "trace" if cfg.trace else ""]
    return " ".join([f"{cfg.block_m}x{cfg.block_n} s{cfg.num_stages}", *filter(None, opts)])


def _layer_config(*, m: int, hidden: int, intermediate: int, num_experts: int, top_k: int,
                  activation_clamp: float | None) -> Sm90FusedMoEConfig:
    """The rule's config for a call of m tokens, without its clusters where the GPU cannot hold them."""
    cfg = fused_config(num_tokens=m, hidden=hidden, intermediate=intermediate, num_experts=num_experts, top_k=top_k,
                       activation_clamp=activation_clamp)
    if cfg.cluster_size > 1:
        # the rule's clusters need num_sms / 2 resident CTA pairs; a GPU whose SM groups cannot pair
        # every SM runs the same kernel without clusters (same output, weights read per CTA)
        cubin = compiler.compile_cubin(kernel_name(cfg), sm90_fused_moe_source(cfg), 90)
        if clusters_reason(cfg, str(cubin.path)):
            cfg = dataclasses.replace(cfg, cluster_size=1)
    return cfg


def _kernel_cubin(cfg: Sm90FusedMoEConfig) -> str:
    """The compiled kernel of ``cfg`` (its path), refused before anything is launched when the GPU
    cannot hold its clusters."""
    cubin = compiler.compile_cubin(kernel_name(cfg), sm90_fused_moe_source(cfg), 90)
    reason = clusters_reason(cfg, str(cubin.path))
    if reason:
        raise ValueError(f"fused MoE config {config_label(cfg)}: {reason}")
    return str(cubin.path)


def _run_kernel(cfg: Sm90FusedMoEConfig, cubin: str, buf: jax.Array, m: int, w13: jax.Array, w13_scale: jax.Array,
                w2: jax.Array, w2_scale: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """The fused kernel on a buffer the input stage filled for m tokens -> (y (m, H) bf16, the
    event trace (`trace_words` uint32) with ``cfg.trace``, else None)."""
    inputs = [buf, w13, w13_scale, w2, w2_scale]
    outputs = [jax.ShapeDtypeStruct((m, cfg.hidden), jnp.bfloat16),
               jax.ShapeDtypeStruct((cfg.buffer.total_bytes,), jnp.uint8)]
    aliases = {0: 1}
    if cfg.trace:  # the zeroed trace, written in place (fused_plan's operand 5)
        words = trace_words(cfg.num_sms)
        inputs.append(jnp.zeros((words,), jnp.uint32))
        outputs.append(jax.ShapeDtypeStruct((words,), jnp.uint32))
        aliases[5] = 2
    out = launch(fused_plan(cfg, cubin, num_tokens=m), inputs, outputs, input_output_aliases=aliases)
    return out[0], out[2] if cfg.trace else None


def _input_stage(cfg: Sm90FusedMoEConfig, x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, *,
                 routed_scaling_factor: float) -> tuple[str, jax.Array]:
    """(the kernel's cubin, the buffer filled for x's tokens) for a config given explicitly."""
    m = x.shape[0]
    if not 0 < m <= cfg.max_tokens:
        raise ValueError(f"x: expected 1 to {cfg.max_tokens} tokens (the config's capacity), got {m}")
    cubin = _kernel_cubin(cfg)
    from custom_calls.triton.fused_input_kernel import fused_input  # imports triton

    return cubin, fused_input(x, topk_ids, topk_weights, buffer=cfg.buffer,
                              routed_scaling_factor=routed_scaling_factor)


def fused_moe_impl(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, w13: jax.Array,
                   w13_scale: jax.Array, w2: jax.Array, w2_scale: jax.Array, *, routed_scaling_factor: float,
                   activation_clamp: float | None, w13_interleave: int) -> jax.Array:
    """x (M, H) bf16, topk_ids (M, k) int32, topk_weights (M, k) f32, w13 (E, 2I, H) e4m3 with its
    gate/up rows interleaved in groups of 8, w2 (E, H, I) e4m3, 128x128 block scales f32
    -> (M, H) bf16. Operands already checked by the op, w13_interleave == 8 by `static_supports_fused`."""
    m, h = x.shape
    e, two_i, _ = w13.shape
    if m == 0:
        return jnp.zeros((0, h), jnp.bfloat16)
    cfg = _layer_config(m=m, hidden=h, intermediate=two_i // 2, num_experts=e, top_k=topk_ids.shape[1],
                        activation_clamp=activation_clamp)
    return fused_moe_with_config(cfg, x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale,
                                 routed_scaling_factor=routed_scaling_factor)


def fused_moe_with_config(cfg: Sm90FusedMoEConfig, x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array,
                          w13: jax.Array, w13_scale: jax.Array, w2: jax.Array, w2_scale: jax.Array, *,
                          routed_scaling_factor: float) -> jax.Array:
    """`fused_moe_impl` with the kernel configuration given (e.g. a `sm90_fused_moe_candidates`
    entry, as `python -m moe_jax.bench fused` runs them): operands as there, already checked, 1 to
    ``cfg.max_tokens`` tokens of ``cfg``'s shapes. A config whose clusters the GPU cannot hold is
    refused with the reason; a traced config (``trace=True``) goes to `fused_moe_traced`."""
    if cfg.trace:
        raise ValueError("cfg.trace: expected False (fused_moe_traced runs the traced build), got True")
    cubin, buf = _input_stage(cfg, x, topk_ids, topk_weights, routed_scaling_factor=routed_scaling_factor)
    return _run_kernel(cfg, cubin, buf, x.shape[0], w13, w13_scale, w2, w2_scale)[0]


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
    y, trace = _run_kernel(cfg, cubin, buf, x.shape[0], w13, w13_scale, w2, w2_scale)
    return y, trace.reshape(cfg.num_sms, TRACE_ROLES, TRACE_SLOTS, 4)


def fused_moe_routed_impl(x: jax.Array, gate_weight: jax.Array, bias: jax.Array | None, expert_offset: jax.Array,
                          w13: jax.Array, w13_scale: jax.Array, w2: jax.Array, w2_scale: jax.Array, *, top_k: int,
                          scoring: str, n_group: int, topk_group: int, norm_topk_prob: bool,
                          routed_scaling_factor: float, activation_clamp: float | None,
                          w13_interleave: int) -> jax.Array:
    """Op `fused_moe_routed` as one custom call of three kernels (`routed_sequence`): the router
    GEMM as split-K partials (Triton), the input stage with the routing epilogue (Triton), the
    fused kernel. Operands checked by the op."""
    m, h = x.shape
    e, two_i, _ = w13.shape
    if m == 0:
        return jnp.zeros((0, h), jnp.bfloat16)
    cfg = _layer_config(m=m, hidden=h, intermediate=two_i // 2, num_experts=e, top_k=top_k,
                        activation_clamp=activation_clamp)
    return routed_sequence(cfg, x, gate_weight, bias, expert_offset, w13, w13_scale, w2, w2_scale, top_k=top_k,
                           scoring=scoring, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                           routed_scaling_factor=routed_scaling_factor)


def routed_sequence(cfg: Sm90FusedMoEConfig, x: jax.Array, gate_weight: jax.Array, bias: jax.Array | None,
                    expert_offset: jax.Array, w13: jax.Array, w13_scale: jax.Array, w2: jax.Array,
                    w2_scale: jax.Array, **routing) -> jax.Array:
    """The routed branch for ``cfg`` (1 to cfg.max_tokens tokens) in one custom call of three
    kernels (`routed_plans`; ``routing``: its keyword arguments) -> y (M, H) bf16."""
    plans, inputs, outputs = routed_plans(cfg, _kernel_cubin(cfg), detected_device()[1], x, gate_weight, bias,
                                          expert_offset, w13, w13_scale, w2, w2_scale, **routing)
    return launch(plans, inputs, outputs)[2]


def routed_plans(cfg: Sm90FusedMoEConfig, fused_cubin: str, arch: int, x: jax.Array, gate_weight: jax.Array,
                 bias: jax.Array | None, expert_offset: jax.Array, w13: jax.Array, w13_scale: jax.Array,
                 w2: jax.Array, w2_scale: jax.Array, *, top_k: int, scoring: str, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float
                 ) -> tuple[tuple[LP.LaunchPlan, ...], list[jax.Array], list[jax.ShapeDtypeStruct]]:
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
             fused_plan(cfg, fused_cubin, num_tokens=m).remap((10, 5, 6, 7, 8, 11, 10)))
    return plans, inputs, outputs


def static_supports_fused(*, m: int, hidden: int, intermediate: int, num_experts: int, top_k: int, x_dtype,
                          weight_dtype, routed_scaling_factor: float, activation_clamp: float | None, arch: int,
                          w13_interleave: int, num_sms: int | None = None) -> tuple[bool, str]:
    """(ok, reason) of backend 'deep_gemm' for op `fused_moe`, from the static arguments (num_sms:
    the device's, else the H200's 132 for a shape-only answer on a machine without one)."""
    if arch != 90:
        return False, f"arch: the fused MoE kernel runs on SM90 (arch 90), got {arch}"
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
        num_sms = detected_device()[2] or 132
    reason = fused_reason(num_tokens=max(m, 1), hidden=hidden, intermediate=intermediate, num_experts=num_experts,
                          top_k=top_k, num_sms=num_sms)
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
