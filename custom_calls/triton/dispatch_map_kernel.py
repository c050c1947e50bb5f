"""Dispatch maps without a sort: `custom_calls.dispatch_map` (contig: src2dst, m_indices, num_rows,
counts; masked: src2dst, masked_m, num_dropped) from the top-k ids in one or two launches.

The routes (R = M * k, in (token, k) order) are cut into chunks of SUB * SUBS routes, one chunk per
program; a program walks its chunk in sub-blocks of SUB routes. In a sub-block the one-hot matrix
[SUB, E_PAD] (route == expert) gives, by a cumulative sum down its columns, each route's rank
among the sub-block's routes of its expert; a running per-expert count carries it across
sub-blocks. Deterministic, no atomics, no sort.

* One launch (`DispatchMapConfig.one_launch`, decode sizes): every program counts all routes
  itself, those before its chunk and in total (the one-hot matrices summed elementwise, reduced
  once), then places its chunk. The counting is repeated per program, but it is cheap next to a
  second launch and the chunks are placed in parallel.
* Two launches (prefill): `map_hist_kernel` writes each chunk's per-expert count (NC, E_PAD); the
  placement kernel of chunk c sums the rows of chunks < c (its per-expert offsets) and all rows
  (the totals), then places its routes.
Program 0 writes counts / num_rows (contig) or masked_m / num_dropped (masked); every program
writes a slice of m_indices.

m_indices[row] = the expert e with seg_start[e] <= row < seg_start[e] + counts[e] (segments of
non-empty experts are disjoint), else -1: one [ROW_BLOCK, E_PAD] comparison per block of rows.
Tiling: `DispatchMapConfig` (`config=`; None: `heuristic_config(R, E)`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from layouts import ceil_div
from custom_calls.dispatch_map import contig_capacity
from custom_calls.triton.launch import triton_call
from custom_calls.triton.support import dispatch_map_reason
from custom_calls.triton.tuning import check_launch, check_powers_of_two, config_or_default

ONE_HOT_ELEMENTS = 4096  # the [SUB, E_PAD] one-hot matrix of a sub-block: 16 per thread on 8 warps, no spills
SINGLE_LAUNCH_ROUTES = 4096  # up to this many routes the heuristic uses one launch
PREFILL_PROGRAMS = 128  # above it: about one wave of chunks on an H200 (132 SMs)


@dataclasses.dataclass(frozen=True)
class DispatchMapConfig:
    """Tiling of the dispatch-map kernels: sub routes per sub-block (a power of two), subs sub-blocks
    per program (a chunk of sub * subs routes, one program each); num_warps of every launch;
    one_launch: every program counts the routes before its chunk itself instead of reading the
    chunk counts of a first launch (a single chunk is always one launch)."""

    sub: int
    subs: int
    num_warps: int
    one_launch: bool = False

    def __post_init__(self) -> None:
        check_powers_of_two(self, "sub")
        if isinstance(self.subs, bool) or not isinstance(self.subs, int) or self.subs < 1:
            raise ValueError(f"DispatchMapConfig.subs: expected a positive int, got {self.subs!r}")
        if not isinstance(self.one_launch, bool):
            raise ValueError(f"DispatchMapConfig.one_launch: expected a bool, got {self.one_launch!r}")
        check_launch(self)


def heuristic_config(num_routes: int, num_experts: int) -> DispatchMapConfig:
    """The default tiling: sub = ONE_HOT_ELEMENTS / next_pow2(E) routes (16 to 1024); up to
    SINGLE_LAUNCH_ROUTES routes one launch of one sub-block per program on 4 warps, else chunks of
    whole sub-blocks making about PREFILL_PROGRAMS programs (two launches, 8 warps)."""
    sub = max(16, min(1024, ONE_HOT_ELEMENTS // triton.next_power_of_2(num_experts)))
    if num_routes <= SINGLE_LAUNCH_ROUTES:
        return DispatchMapConfig(sub=sub, subs=1, num_warps=4, one_launch=True)
    return DispatchMapConfig(sub=sub, subs=max(1, ceil_div(num_routes, sub * PREFILL_PROGRAMS)), num_warps=8)


@triton.jit
def _local_expert(ids_ptr, i, R: tl.constexpr, E: tl.constexpr, offset):
    """Local expert of routes i [N]: id - offset in [0, E), else -1 (not held here, or i >= R)."""
    g = tl.load(ids_ptr + i, mask=i < R, other=-1)
    loc = g - offset
    return tl.where((g >= 0) & (loc >= 0) & (loc < E), loc, -1)


@triton.jit
def _count(ids_ptr, offset, first, split, STEPS: tl.constexpr, R: tl.constexpr, E: tl.constexpr,
           E_PAD: tl.constexpr, SUB: tl.constexpr):
    """Routes per local expert [E_PAD] among the STEPS sub-blocks from route `first`: (those
    before route `split`, all). The one-hot matrices are summed elementwise and reduced once (no
    cross-thread work per step)."""
    cols = tl.expand_dims(tl.arange(0, E_PAD), 0)
    before = tl.zeros((SUB, E_PAD), tl.int32)
    every = tl.zeros((SUB, E_PAD), tl.int32)
    for s in tl.range(0, STEPS):
        i = first + s * SUB + tl.arange(0, SUB)
        hot = (tl.expand_dims(_local_expert(ids_ptr, i, R, E, offset), 1) == cols).to(tl.int32)
        every += hot
        before += tl.where(tl.expand_dims(i < split, 1), hot, 0)
    return tl.sum(before, axis=0), tl.sum(every, axis=0)


@triton.jit
def _chunk_offsets(hist_ptr, c, NC: tl.constexpr, E_PAD: tl.constexpr, HB: tl.constexpr):
    """From the chunk counts hist (NC, E_PAD): (routes per expert in chunks < c, in all chunks)."""
    cols = tl.expand_dims(tl.arange(0, E_PAD), 0)
    before = tl.zeros((E_PAD,), tl.int32)
    total = tl.zeros((E_PAD,), tl.int32)
    for b in tl.range(0, NC, HB):
        rows = tl.expand_dims(b + tl.arange(0, HB), 1)
        h = tl.load(hist_ptr + rows * E_PAD + cols, mask=rows < NC, other=0)
        total += tl.sum(h, axis=0)
        before += tl.sum(tl.where(rows < c, h, 0), axis=0)
    return before, total


@triton.jit
def _place(ids_ptr, dst_ptr, offset, base, first_sub, NSUB, R: tl.constexpr, E: tl.constexpr,
           E_PAD: tl.constexpr, SUB: tl.constexpr, MASKED: tl.constexpr, M_PAD: tl.constexpr,
           DROPPED_ROW: tl.constexpr):
    """src2dst of the routes in sub-blocks [first_sub, first_sub + NSUB). base [E_PAD]: the position
    of each expert's next route (contig: its row; masked: its rank, DROPPED_ROW for a rank past
    M_PAD). Returns base advanced past these routes."""
    cols = tl.expand_dims(tl.arange(0, E_PAD), 0)
    running = base
    for s in tl.range(0, NSUB):
        i = (first_sub + s) * SUB + tl.arange(0, SUB)
        e = _local_expert(ids_ptr, i, R, E, offset)
        hot = tl.expand_dims(e, 1) == cols
        seen = tl.cumsum(hot.to(tl.int32), axis=0)  # inclusive: routes of each expert so far in the sub-block
        pos = tl.sum(tl.where(hot, tl.expand_dims(running, 0) + seen - 1, 0), axis=1)
        if MASKED:
            dst = tl.where(e >= 0, tl.where(pos < M_PAD, e * M_PAD + pos, DROPPED_ROW), -1)
        else:
            dst = tl.where(e >= 0, pos, -1)
        tl.store(dst_ptr + i, dst, mask=i < R)
        running += tl.sum(hot.to(tl.int32), axis=0)
    return running


@triton.jit
def map_hist_kernel(ids_ptr, off_ptr, hist_ptr, R: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr,
                    SUB: tl.constexpr, SUBS: tl.constexpr):
    c = tl.program_id(0)
    _, h = _count(ids_ptr, tl.load(off_ptr), c * SUBS * SUB, 0, SUBS, R, E, E_PAD, SUB)
    tl.store(hist_ptr + c * E_PAD + tl.arange(0, E_PAD), h)


@triton.jit
def map_contig_kernel(ids_ptr, off_ptr, hist_ptr, dst_ptr, mind_ptr, nrows_ptr, counts_ptr,
                      R: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, SUB: tl.constexpr,
                      SUBS: tl.constexpr, NC: tl.constexpr, HB: tl.constexpr, ONE_LAUNCH: tl.constexpr,
                      ALIGN: tl.constexpr,
                      CAP: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, ROW_BLOCK: tl.constexpr):
    c = tl.program_id(0)
    offset = tl.load(off_ptr)
    cols = tl.arange(0, E_PAD)
    if ONE_LAUNCH:
        before, total = _count(ids_ptr, offset, 0, c * SUBS * SUB, (R + SUB - 1) // SUB, R, E, E_PAD, SUB)
    else:
        before, total = _chunk_offsets(hist_ptr, c, NC, E_PAD, HB)
    padded = (total + ALIGN - 1) // ALIGN * ALIGN
    seg_start = tl.cumsum(padded, axis=0) - padded
    first = c == 0
    tl.store(counts_ptr + cols, total, mask=(cols < E) & first)
    tl.store(nrows_ptr + cols, tl.broadcast_to(tl.sum(padded, axis=0), (E_PAD,)), mask=(cols == 0) & first)
    _place(ids_ptr, dst_ptr, offset, seg_start + before, c * SUBS, SUBS, R, E, E_PAD, SUB, False, 0, -1)
    lo = tl.expand_dims(seg_start, 0)
    hi = tl.expand_dims(seg_start + total, 0)
    for b in tl.range(0, ROWS_PER_PROGRAM, ROW_BLOCK):
        row = c * ROWS_PER_PROGRAM + b + tl.arange(0, ROW_BLOCK)
        r2 = tl.expand_dims(row, 1)
        owner = tl.max(tl.where((r2 >= lo) & (r2 < hi), tl.expand_dims(cols, 0), -1), axis=1)
        tl.store(mind_ptr + row, owner, mask=row < CAP)


@triton.jit
def map_masked_kernel(ids_ptr, off_ptr, hist_ptr, dst_ptr, masked_m_ptr, dropped_ptr,
                      R: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, SUB: tl.constexpr,
                      SUBS: tl.constexpr, NC: tl.constexpr, HB: tl.constexpr, ONE_LAUNCH: tl.constexpr,
                      M_PAD: tl.constexpr, DROPPED_ROW: tl.constexpr):
    c = tl.program_id(0)
    offset = tl.load(off_ptr)
    cols = tl.arange(0, E_PAD)
    if NC == 1:  # one program, one walk: the running counts end as the totals
        total = _place(ids_ptr, dst_ptr, offset, tl.zeros((E_PAD,), tl.int32), 0, SUBS, R, E, E_PAD, SUB,
                       True, M_PAD, DROPPED_ROW)
    else:
        if ONE_LAUNCH:
            before, total = _count(ids_ptr, offset, 0, c * SUBS * SUB, (R + SUB - 1) // SUB, R, E, E_PAD, SUB)
        else:
            before, total = _chunk_offsets(hist_ptr, c, NC, E_PAD, HB)
        _place(ids_ptr, dst_ptr, offset, before, c * SUBS, SUBS, R, E, E_PAD, SUB, True, M_PAD, DROPPED_ROW)
    first = c == 0
    tl.store(masked_m_ptr + cols, tl.minimum(total, M_PAD), mask=(cols < E) & first)
    dropped = tl.sum(tl.maximum(total - M_PAD, 0), axis=0)
    tl.store(dropped_ptr + cols, tl.broadcast_to(dropped, (E_PAD,)), mask=(cols == 0) & first)


def _plan(r: int, e: int, config: DispatchMapConfig) -> dict:
    e_pad = triton.next_power_of_2(e)
    nc = max(1, ceil_div(r, config.sub * config.subs))
    return dict(R=r, E=e, E_PAD=e_pad, SUB=config.sub, SUBS=config.subs, NC=nc,
                HB=max(1, min(triton.next_power_of_2(nc), ONE_HOT_ELEMENTS // e_pad)),
                ONE_LAUNCH=nc == 1 or config.one_launch)


def _hist(ids, offset, plan: dict, warps: int) -> jax.Array:
    """The chunk counts (NC, E_PAD) of the two-launch path; a 1-element placeholder for one launch."""
    if plan["ONE_LAUNCH"]:
        return jnp.zeros((1,), jnp.int32)
    (hist,) = triton_call(ids, offset, kernel=map_hist_kernel,
                          out_shape=[jax.ShapeDtypeStruct((plan["NC"], plan["E_PAD"]), jnp.int32)],
                          grid=(plan["NC"],), num_warps=warps, name="moe_dispatch_map_hist",
                          **{k: plan[k] for k in ("R", "E", "E_PAD", "SUB", "SUBS")})
    return hist


def _check(topk_ids: jax.Array, num_local_experts: int, config, default) -> DispatchMapConfig:
    reason = dispatch_map_reason(topk_ids.size, num_local_experts)
    if reason:
        raise ValueError(f"dispatch_map: {reason}")
    return config_or_default(config, DispatchMapConfig, default)


def dispatch_map_contig(topk_ids: jax.Array, expert_offset: jax.Array, *, num_local_experts: int, alignment: int,
                        config: DispatchMapConfig | None = None
                        ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """topk_ids (M, k) int32, expert_offset () int32 -> (src2dst (M, k) int32, m_indices (M_cap,) int32,
    num_rows () int32, counts (E_local,) int32) as `custom_calls.dispatch_map.dispatch_map_contig`.
    config: the tiling (None: `heuristic_config(M * k, E_local)`)."""
    m, k = topk_ids.shape
    r, e = m * k, num_local_experts
    config = _check(topk_ids, e, config, lambda: heuristic_config(r, e))
    cap = contig_capacity(m, k, e, alignment)
    if r == 0:  # nothing to launch over
        return (jnp.zeros((m, k), jnp.int32), jnp.full((cap,), -1, jnp.int32), jnp.zeros((), jnp.int32),
                jnp.zeros((e,), jnp.int32))
    ids = topk_ids.astype(jnp.int32)
    offset = jnp.reshape(expert_offset, (1,)).astype(jnp.int32)
    plan = _plan(r, e, config)
    row_block = config.sub
    rows_per_program = ceil_div(ceil_div(cap, plan["NC"]), row_block) * row_block
    src2dst, m_indices, num_rows, counts = triton_call(
        ids, offset, _hist(ids, offset, plan, config.num_warps), kernel=map_contig_kernel,
        out_shape=[jax.ShapeDtypeStruct((m, k), jnp.int32), jax.ShapeDtypeStruct((cap,), jnp.int32),
                   jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((e,), jnp.int32)],
        grid=(plan["NC"],), num_warps=config.num_warps, name="moe_dispatch_map_contig",
        ALIGN=alignment, CAP=cap, ROWS_PER_PROGRAM=rows_per_program, ROW_BLOCK=row_block, **plan)
    return src2dst, m_indices, num_rows[0], counts


def dispatch_map_masked(topk_ids: jax.Array, expert_offset: jax.Array, *, num_local_experts: int, m_pad: int,
                        mark_dropped: bool = False, config: DispatchMapConfig | None = None
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """topk_ids (M, k) int32, expert_offset () int32 -> (src2dst (M, k) int32, masked_m (E_local,) int32,
    num_dropped () int32) as `custom_calls.dispatch_map.dispatch_map_masked` (mark_dropped as there).
    config: the tiling (None: `heuristic_config(M * k, E_local)`)."""
    m, k = topk_ids.shape
    r, e = m * k, num_local_experts
    config = _check(topk_ids, e, config, lambda: heuristic_config(r, e))
    if r == 0:
        return jnp.zeros((m, k), jnp.int32), jnp.zeros((e,), jnp.int32), jnp.zeros((), jnp.int32)
    ids = topk_ids.astype(jnp.int32)
    offset = jnp.reshape(expert_offset, (1,)).astype(jnp.int32)
    plan = _plan(r, e, config)
    src2dst, masked_m, dropped = triton_call(
        ids, offset, _hist(ids, offset, plan, config.num_warps), kernel=map_masked_kernel,
        out_shape=[jax.ShapeDtypeStruct((m, k), jnp.int32), jax.ShapeDtypeStruct((e,), jnp.int32),
                   jax.ShapeDtypeStruct((1,), jnp.int32)],
        grid=(plan["NC"],), num_warps=config.num_warps, name="moe_dispatch_map_masked", M_PAD=m_pad,
        DROPPED_ROW=e * m_pad if mark_dropped else -1, **plan)
    return src2dst, masked_m, dropped[0]
