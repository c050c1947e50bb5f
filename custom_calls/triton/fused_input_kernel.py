"""Triton kernel: the fused MoE kernel's input stage, in one launch.

x (M, H) bf16, topk_ids (M, k) int32, topk_weights (M, k) f32 -> the kernel's buffer
(`layouts.FusedMoEBuffer`, bytes) with
  workspace           zeroed (the kernel's counters and flags start from zero every call)
  input_tokens        [token][H] e4m3, per-128 quantization with the amax floored at 1e-10
  input_scales        [token][H/128] fp32 scales (amax / 448, IEEE division)
  input_topk_ids      [token][k] int64, canonical (`contracts.canonical_topk_ids`: an id outside
                      [0, E) or a repeat of an earlier slot's expert becomes -1)
  input_topk_weights  [token][k] fp32, topk_weights * routed_scaling_factor
for the M tokens; the other regions (the kernel's scratch) are left as they are. Model:
`custom_calls.fused_moe.fused_input_reference`.

One grid covers the three jobs, so the layer pays one launch where a memset, the id
canonicalization and a quantization kernel stood: programs [0, row_blocks * chunks) quantize one
[block_m, tile] block of x each, the next row_blocks programs write one row block's routes each
(`FusedInputConfig.route_programs`; else the programs of chunk 0 write their rows' routes too),
the rest zero `zero_block` words of the workspace each.

`fused_input_routed` also routes, in the same launch: from the router GEMM's split-K partial sums
(`router_kernel.router_partials`) the programs that write the routes compute their rows' logits,
scores and (grouped) top-k (`routing_kernel.route_rows`, the routing epilogue's own code) and
write the routes of the experts held here; so the fused layer's routed branch is three kernels
(router GEMM, this kernel, the fused kernel) where the router GEMM, its split-K reduction, the
routing epilogue and this kernel were four. On SM90 the three run in one custom call
(`custom_calls.fused_moe_sm90.routed_plans`), this kernel launched programmatically (WAIT):
its quantizing programs run beside the router. Model: `custom_calls.fused_moe.fused_input_routed_reference`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from layouts import FusedMoEBuffer, ceil_div
from custom_calls.fused_moe import AMAX_FLOOR
from custom_calls.triton.interpret import interpreting
from custom_calls.triton.launch import KernelCall
from custom_calls.triton.routing_kernel import (bias_operand, epilogue_constexprs, load_logits, route_columns,
                                                 route_rows)
from custom_calls.triton.tile_quant import quantize_tile, tile_ids
from custom_calls.triton.tuning import BlockTiling, check_powers_of_two, config_or_default, tile_groups

GROUP = 128  # the input stage's scale group (the kernel's per-128 token scales)
SMALL_M = 1024  # below: one row per program, so that a decode batch still fills the GPU
MAX_ROUTE_PROGRAMS = 256  # row blocks up to which the routes get programs of their own


@dataclasses.dataclass(frozen=True)
class FusedInputConfig(BlockTiling):
    """Tiling of `fused_input_kernel` (see `custom_calls.triton.tuning`): one [block_m, tile] block
    of x per program (tile: whole groups of 128), zero_block int32 words of the workspace per
    zeroing program (a power of two), and route_programs: the routes of each row block written by a
    program of their own (True) or by the row block's first quantizing program (False)."""

    zero_block: int = 2048
    route_programs: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_powers_of_two(self, "zero_block")
        if not isinstance(self.route_programs, bool):
            raise ValueError(f"FusedInputConfig.route_programs: expected a bool, got {self.route_programs!r}")


def heuristic_config(num_tokens: int, routed: bool = False) -> FusedInputConfig:
    """The default tiling: 1024 columns (8 groups) per program, 1 row below `SMALL_M` tokens and
    4 rows from there, 4 warps; with the routing epilogue (`routed`) one warp for one row, so that
    the epilogue's reductions over a token's experts stay inside the warp (on one H200 at 128
    tokens, DeepSeek-V3's grouped top-k: 3.7 µs with one warp, 9.1 with two, 13.2 with four).
    The routes get programs of their own up to `MAX_ROUTE_PROGRAMS` row blocks (they then run
    beside the quantization; more of them would queue behind it): on one H200, routed, 3.14 -> 2.65
    µs at 32 tokens, 3.58 -> 3.07 at 128, 7.26 -> 6.59 at 1024; at 512 and 16384 tokens (512 and
    4096 row blocks) 5.18 -> 5.79 and 87.5 -> 93.3."""
    block_m = 1 if num_tokens < SMALL_M else 4
    return FusedInputConfig(tile=1024, block_m=block_m, num_warps=1 if routed and block_m == 1 else 4,
                            chunks_fastest=True,
                            route_programs=ceil_div(num_tokens, block_m) <= MAX_ROUTE_PROGRAMS)


@triton.jit
def _write_routes(row_block, ids_ptr, w_ptr, bias_ptr, offset_ptr, buf_ptr,
                  M: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, E: tl.constexpr, RSF: tl.constexpr,
                  IDS_OFF: tl.constexpr, WEIGHTS_OFF: tl.constexpr, BLOCK_M: tl.constexpr,
                  ROUTE: tl.constexpr, SPLITS: tl.constexpr, E_ROUTE: tl.constexpr, SCORING: tl.constexpr,
                  HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, NG_PAD: tl.constexpr, GS_PAD: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, RENORM: tl.constexpr, WAIT: tl.constexpr):
    """The canonical ids and scaled weights of the rows of `row_block` (see `fused_input_kernel`)."""
    m = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m < M
    row = m.to(tl.int64)
    j = tl.arange(0, TOPK_P2)
    r_ok = tl.expand_dims(row_ok, 1) & tl.expand_dims(j < TOPK, 0)
    r_offs = tl.expand_dims(row * TOPK, 1) + tl.expand_dims(j, 0)
    if ROUTE:
        if WAIT:  # the partials come from the kernel launched before this one
            tl.extra.cuda.gdc_wait()
        e_r, e_ok1 = route_columns(E_ROUTE, N_GROUP, NG_PAD, GS_PAD)
        lg = load_logits(ids_ptr, m, row_ok, e_r, e_ok1, M, E_ROUTE, SPLITS)
        ids, w = route_rows(lg, e_r, e_ok1, bias_ptr, BLOCK_M, E_ROUTE, TOPK, TOPK_P2, SCORING, HAS_BIAS,
                            N_GROUP, NG_PAD, GS_PAD, TOPK_GROUP, RENORM)
        # top-k never repeats an expert: only the experts held here stay
        ids = ids - tl.load(offset_ptr)
        ids = tl.where((ids >= 0) & (ids < E), ids, -1)
    else:
        ids = tl.load(ids_ptr + r_offs, mask=r_ok, other=-1)
        ids = tl.where((ids >= 0) & (ids < E), ids, -1)
        # slot j repeats an expert that an earlier slot i < j of the same token names
        same = (tl.expand_dims(ids, 2) == tl.expand_dims(ids, 1)) & \
            (tl.expand_dims(tl.expand_dims(j, 0), 0) < tl.expand_dims(tl.expand_dims(j, 0), 2))
        repeat = tl.max(same.to(tl.int32), axis=2) > 0
        ids = tl.where(repeat, -1, ids)
        w = tl.load(w_ptr + r_offs, mask=r_ok, other=0.0)
    tl.store((buf_ptr + IDS_OFF).to(tl.pointer_type(tl.int64)) + r_offs, ids.to(tl.int64), mask=r_ok)
    tl.store((buf_ptr + WEIGHTS_OFF).to(tl.pointer_type(tl.float32)) + r_offs, w * RSF, mask=r_ok)


@triton.jit
def fused_input_kernel(
    x_ptr, ids_ptr, w_ptr, bias_ptr, offset_ptr, buf_ptr,
    M: tl.constexpr, H: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, E: tl.constexpr,
    RSF: tl.constexpr, FLOOR: tl.constexpr,
    WORKSPACE_OFF: tl.constexpr, WORKSPACE_WORDS: tl.constexpr, TOKENS_OFF: tl.constexpr,
    SCALES_OFF: tl.constexpr, IDS_OFF: tl.constexpr, WEIGHTS_OFF: tl.constexpr,
    BLOCK_M: tl.constexpr, GROUPS: tl.constexpr, ROW_BLOCKS: tl.constexpr, CHUNKS_FASTEST: tl.constexpr,
    ZERO_BLOCK: tl.constexpr, ROUTE_PROGRAMS: tl.constexpr,
    ROUTE: tl.constexpr, SPLITS: tl.constexpr, E_ROUTE: tl.constexpr, SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, NG_PAD: tl.constexpr, GS_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr, RENORM: tl.constexpr, TRIGGER: tl.constexpr, WAIT: tl.constexpr = False,
):
    """Grid (ROW_BLOCKS * cdiv(H / 128, GROUPS) [+ ROW_BLOCKS] + cdiv(WORKSPACE_WORDS, ZERO_BLOCK),).
    ROUTE_PROGRAMS: the routes of each row block are written by a program of their own, after the
    quantizing programs (so that a row's routing runs beside its quantization), else by the row
    block's chunk-0 quantizing program.
    ROUTE: ids_ptr holds the router logits as SPLITS partial sums (SPLITS, M, E_ROUTE) f32, routed
    here (`routing_kernel.route_rows`); the ids minus offset_ptr[0] are the local experts, and
    w_ptr is unused. Otherwise ids_ptr / w_ptr hold the routes and bias_ptr / offset_ptr are unused.
    TRIGGER: let a kernel launched after this one with programmatic dependent launch (the fused
    kernel's `pdl` option) start now; it still waits for this grid's completion before it reads
    (griddepcontrol.wait), so only its prologue and launch overlap this kernel.
    WAIT: this kernel was launched programmatically after the router kernel, in the same native
    launch sequence (`custom_calls.fused_moe_sm90`): the programs that route wait for the
    router grid's completion (griddepcontrol.wait) before they read the partials; the quantizing and
    zeroing programs read only x and write only this call's buffer, so they run beside the router."""
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    G: tl.constexpr = H // 128
    CHUNKS: tl.constexpr = (G + GROUPS - 1) // GROUPS
    QUANT_PROGRAMS: tl.constexpr = ROW_BLOCKS * CHUNKS
    pid = tl.program_id(0)
    if pid < QUANT_PROGRAMS:
        row_block, chunk = tile_ids(ROW_BLOCKS, CHUNKS, CHUNKS_FASTEST)
        m = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = m < M
        row = m.to(tl.int64)
        group0 = chunk * GROUPS
        k = group0 * 128 + tl.arange(0, GROUPS * 128)
        ok = tl.expand_dims(row_ok, 1) & tl.expand_dims(k < H, 0)
        offs = tl.expand_dims(row * H, 1) + tl.expand_dims(k, 0)
        x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        q, sf, _ = quantize_tile(x, BLOCK_M, GROUPS, 128, False, FLOOR)
        tl.store((buf_ptr + TOKENS_OFF).to(tl.pointer_type(tl.float8e4nv)) + offs, q, mask=ok)
        g = group0 + tl.arange(0, GROUPS)
        sf_offs = tl.expand_dims(row * G, 1) + tl.expand_dims(g, 0)
        sf_ok = tl.expand_dims(row_ok, 1) & tl.expand_dims(g < G, 0)
        tl.store((buf_ptr + SCALES_OFF).to(tl.pointer_type(tl.float32)) + sf_offs, sf, mask=sf_ok)
        if not ROUTE_PROGRAMS and chunk == 0:
            _write_routes(row_block, ids_ptr, w_ptr, bias_ptr, offset_ptr, buf_ptr, M, TOPK, TOPK_P2, E, RSF,
                          IDS_OFF, WEIGHTS_OFF, BLOCK_M, ROUTE, SPLITS, E_ROUTE, SCORING, HAS_BIAS, N_GROUP, NG_PAD,
                          GS_PAD, TOPK_GROUP, RENORM, WAIT)
    elif ROUTE_PROGRAMS and pid < QUANT_PROGRAMS + ROW_BLOCKS:
        _write_routes(pid - QUANT_PROGRAMS, ids_ptr, w_ptr, bias_ptr, offset_ptr, buf_ptr, M, TOPK, TOPK_P2,
                      E, RSF, IDS_OFF, WEIGHTS_OFF, BLOCK_M, ROUTE, SPLITS, E_ROUTE, SCORING, HAS_BIAS, N_GROUP,
                      NG_PAD, GS_PAD, TOPK_GROUP, RENORM, WAIT)
    else:
        word = (pid - QUANT_PROGRAMS - ROW_BLOCKS * ROUTE_PROGRAMS) * ZERO_BLOCK + tl.arange(0, ZERO_BLOCK)
        tl.store((buf_ptr + WORKSPACE_OFF).to(tl.pointer_type(tl.int32)) + word,
                 tl.zeros([ZERO_BLOCK], tl.int32), mask=word < WORKSPACE_WORDS)


def _input_call(x, a, b, bias, offset, *, buffer: FusedMoEBuffer, routed_scaling_factor: float, top_k: int,
                config: FusedInputConfig | None, route: dict, wait: bool = False) -> KernelCall:
    m, h = x.shape
    config = config_or_default(config, FusedInputConfig, lambda: heuristic_config(m, routed=route["ROUTE"]))
    groups = tile_groups(config, "tile", group=GROUP, packed=False)
    regions = buffer.regions
    ws_off, ws_bytes = regions["workspace"]
    row_blocks = ceil_div(m, config.block_m)
    grid = row_blocks * (ceil_div(h // GROUP, groups) + config.route_programs) + ceil_div(ws_bytes // 4,
                                                                                          config.zero_block)
    return KernelCall(
        fused_input_kernel, (x, a, b, bias, offset), (jax.ShapeDtypeStruct((buffer.total_bytes,), jnp.uint8),),
        grid=(grid,), num_warps=config.num_warps, num_stages=1, name="moe_fused_input",
        constexprs=dict(
            M=m, H=h, TOPK=top_k, TOPK_P2=1 << (top_k - 1).bit_length(), E=buffer.num_experts,
            RSF=float(np.float32(routed_scaling_factor)), FLOOR=AMAX_FLOOR,
            WORKSPACE_OFF=ws_off, WORKSPACE_WORDS=ws_bytes // 4, TOKENS_OFF=regions["input_tokens"][0],
            SCALES_OFF=regions["input_scales"][0], IDS_OFF=regions["input_topk_ids"][0],
            WEIGHTS_OFF=regions["input_topk_weights"][0],
            BLOCK_M=config.block_m, GROUPS=groups, ROW_BLOCKS=row_blocks, CHUNKS_FASTEST=config.chunks_fastest,
            ZERO_BLOCK=config.zero_block, ROUTE_PROGRAMS=config.route_programs, TRIGGER=not interpreting(),
            WAIT=wait, **route))


_NO_ROUTE = dict(ROUTE=False, SPLITS=1, E_ROUTE=1, SCORING=0, HAS_BIAS=False, N_GROUP=1, NG_PAD=1, GS_PAD=1,
                 TOPK_GROUP=1, RENORM=False)


def fused_input(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, *, buffer: FusedMoEBuffer,
                routed_scaling_factor: float, config: FusedInputConfig | None = None) -> jax.Array:
    """Same signature and result (on the regions it writes, module docstring) as
    `custom_calls.fused_moe.fused_input_reference`: x (M, H) bf16, topk_ids (M, k) int32,
    topk_weights (M, k) f32, 1 <= M <= buffer.max_tokens -> (buffer.total_bytes,) uint8.
    config: the tiling (None: `heuristic_config(M)`)."""
    unused = jnp.zeros((1,), jnp.int32)
    return _input_call(x, topk_ids, topk_weights, unused, unused, buffer=buffer,
                       routed_scaling_factor=routed_scaling_factor, top_k=topk_ids.shape[1], config=config,
                       route=_NO_ROUTE).run()[0]


def fused_input_routed_call(x: jax.Array, partials: jax.Array, bias: jax.Array | None, expert_offset: jax.Array, *,
                            buffer: FusedMoEBuffer, routed_scaling_factor: float, top_k: int, scoring: str,
                            n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                            config: FusedInputConfig | None = None, wait: bool = False) -> KernelCall:
    """The launch of `fused_input_routed` (``partials`` may be a `jax.ShapeDtypeStruct` when the
    call only describes it; ``wait``: the kernel's WAIT, for a native launch sequence that starts
    it programmatically after the router kernel)."""
    splits, _, e_route = partials.shape
    route = dict(ROUTE=True, SPLITS=splits, E_ROUTE=e_route,
                 **epilogue_constexprs(e_route, scoring=scoring, n_group=n_group, topk_group=topk_group,
                                       has_bias=bias is not None, norm_topk_prob=norm_topk_prob))
    offset = jnp.reshape(jnp.asarray(expert_offset, jnp.int32), (1,))
    return _input_call(x, partials, jnp.zeros((1,), jnp.float32), bias_operand(bias), offset, buffer=buffer,
                       routed_scaling_factor=routed_scaling_factor, top_k=top_k, config=config, route=route,
                       wait=wait)


def fused_input_routed(x: jax.Array, partials: jax.Array, bias: jax.Array | None, expert_offset: jax.Array, *,
                       buffer: FusedMoEBuffer, routed_scaling_factor: float, top_k: int, scoring: str,
                       n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                       config: FusedInputConfig | None = None) -> jax.Array:
    """Same signature and result (module docstring; the route weights up to the epilogue's float
    rounding) as `custom_calls.fused_moe.fused_input_routed_reference`: the input stage with the
    routing epilogue of `custom_calls.route_topk` in the same launch. x (M, H) bf16; partials
    (S, M, E_route) f32, the router logits as S partial sums (`router_kernel.router_partials`),
    added in order; bias (E_route,) f32 or None; expert_offset () int32, the first expert held
    here (the buffer's E experts) -> (buffer.total_bytes,) uint8. Checked by the caller
    (`custom_calls.fused_moe.fused_moe_routed`). config: the tiling (None: `heuristic_config(M, routed=True)`)."""
    return fused_input_routed_call(x, partials, bias, expert_offset, buffer=buffer,
                                   routed_scaling_factor=routed_scaling_factor, top_k=top_k, scoring=scoring,
                                   n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                                   config=config).run()[0]
