"""The fused MoE kernel on SM90: the whole routed branch (dispatch, GEMM1, SwiGLU + FP8
quantization, GEMM2, top-k combine) in one persistent kernel of the sgl-deep-gemm 0.2.5 templates,
driven for one GPU: its configuration per call, its code, its launch plan and its launch.

The kernel (cooperative launch: its grid barriers need every block resident) takes its device
buffer (`layouts.FusedMoEBuffer`, the kernel's "symmetric buffer" for a single rank) in and out
(aliased) and writes y (M, H) bf16. The buffer's workspace must be zero and its input regions
filled (tokens, top-k ids and weights) before it runs: the Triton input stage does that, composed
with this kernel into the ops `fused_moe` / `fused_moe_routed` in `custom_calls.fused_moe_sm90`.

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

from custom_calls.native import launch_plan as LP
from custom_calls.native.launch import launch
from custom_calls.native.toolchain import detected_device

from custom_calls.native import compiler
from .codegen import sm90_fused_moe_source
from .fused_moe_config import Sm90FusedMoEConfig, sm90_fused_moe_config, sm90_fused_moe_reason

ARCH = 90  # an SM90 kernel by nature (no other template runs the whole routed branch)


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
    ``128x256 s4 c2 cd4 sm4``."""
    opts = [f"c{cfg.cluster_size}" if cfg.cluster_size != 1 else "",
            f"dw{cfg.num_dispatch_threads // 32}" if cfg.num_dispatch_threads != 64 else "",
            f"lw{cfg.num_non_epilogue_threads // 32}" if cfg.num_non_epilogue_threads != 64 else "",
            f"cd{cfg.l2_cd_passes}" if cfg.l2_cd_passes else "", f"sm{cfg.l2_stage_mode}" if cfg.l2_stage_mode else "",
            "pdl" if cfg.pdl else "", "trace" if cfg.trace else ""]
    return " ".join([f"{cfg.block_m}x{cfg.block_n} s{cfg.num_stages}", *filter(None, opts)])


def layer_config(*, m: int, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 activation_clamp: float | None, num_sms: int | None = None) -> Sm90FusedMoEConfig:
    """The rule's config for a call of m tokens, without its clusters where the GPU cannot hold them
    (num_sms: None -> the device's)."""
    cfg = fused_config(num_tokens=m, hidden=hidden, intermediate=intermediate, num_experts=num_experts, top_k=top_k,
                       activation_clamp=activation_clamp, num_sms=num_sms)
    if cfg.cluster_size > 1:
        # the rule's clusters need num_sms / 2 resident CTA pairs; a GPU whose SM groups cannot pair
        # every SM runs the same kernel without clusters (same output, weights read per CTA)
        cubin = compiler.compile_cubin(kernel_name(cfg), sm90_fused_moe_source(cfg), ARCH)
        if clusters_reason(cfg, str(cubin.path)):
            cfg = dataclasses.replace(cfg, cluster_size=1)
    return cfg


def kernel_cubin(cfg: Sm90FusedMoEConfig) -> str:
    """The compiled kernel of ``cfg`` (its path), refused before anything is launched when the GPU
    cannot hold its clusters."""
    cubin = compiler.compile_cubin(kernel_name(cfg), sm90_fused_moe_source(cfg), ARCH)
    reason = clusters_reason(cfg, str(cubin.path))
    if reason:
        raise ValueError(f"fused MoE config {config_label(cfg)}: {reason}")
    return str(cubin.path)


def run_kernel(cfg: Sm90FusedMoEConfig, cubin: str, buf: jax.Array, m: int, w13: jax.Array, w13_scale: jax.Array,
               w2: jax.Array, w2_scale: jax.Array, *, command_buffer: bool = False
               ) -> tuple[jax.Array, jax.Array | None]:
    """The fused kernel on a buffer the input stage filled for m tokens -> (y (m, H) bf16, the
    event trace (`trace_words` uint32) with ``cfg.trace``, else None). command_buffer: as
    `custom_calls.native.launch` takes it."""
    inputs = [buf, w13, w13_scale, w2, w2_scale]
    outputs = [jax.ShapeDtypeStruct((m, cfg.hidden), jnp.bfloat16),
               jax.ShapeDtypeStruct((cfg.buffer.total_bytes,), jnp.uint8)]
    aliases = {0: 1}
    if cfg.trace:  # the zeroed trace, written in place (fused_plan's operand 5)
        words = trace_words(cfg.num_sms)
        inputs.append(jnp.zeros((words,), jnp.uint32))
        outputs.append(jax.ShapeDtypeStruct((words,), jnp.uint32))
        aliases[5] = 2
    out = launch(fused_plan(cfg, cubin, num_tokens=m), inputs, outputs, input_output_aliases=aliases,
                 command_buffer=command_buffer)
    return out[0], out[2] if cfg.trace else None
