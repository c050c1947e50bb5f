"""Dispatch: where each (token, k) route goes in the grouped layout (contig or masked), with static
capacities, plus the auto layout choice. The data movement + activation quantization is the
permute op (custom_calls.permute).

Contig capacity (rows of the (M_cap, H) buffer). R = M*k routes, E_local experts, alignment a.
Expert e's segment holds c_e rows padded up to a multiple of a, so the buffer needs
a * sum_e ceil(c_e / a) rows with sum_e c_e <= R. With n non-empty experts,
sum_e ceil(c_e / a) = sum_e floor((c_e + a - 1) / a) <= floor((R + n(a-1)) / a) = n + floor((R - n) / a),
which is attained (n-1 experts with one row, one with the rest) and grows with n, so
    M_cap = a * (n + floor((R - n) / a)),  n = min(E_local, R)
is the smallest bound that can never overflow (the seed's "block x (non-empty experts + blocks of
the remaining rows)"). It holds for any ids, duplicates included. With shared-expert fusion the
route list is (M, k + n_s) over E_local + n_s experts, and the same formula with those sizes is the
bound (every token sends one route to each shared expert: each shared segment holds exactly M rows).

Masked capacity: m_pad rows per expert slab, a multiple of 128, default round_up(M, 256) (the
seed's rule). Routes of one token go to distinct experts (route() guarantees it), so no slab gets
more than M rows: m_pad >= M can never overflow, and a smaller static m_pad is rejected at trace
time. A fused shared expert's slab holds exactly M rows (one route per token), within the same bound. Should a caller pass ids with duplicates in a token's row, routes past m_pad are dropped and
COUNTED in `MaskedDispatch.num_dropped`, and `routed_experts` returns NaN rows for the tokens that
lost a route: reported, never silent.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from custom_calls.activation import OP_MASKED as OP_ACTIVATION_MASKED
from custom_calls.activation import ActivationSpec
from custom_calls.backends import get_default_backend, static_supports
from custom_calls.dispatch_map import contig_capacity, dispatch_map_contig, dispatch_map_masked
from layouts import get_recipe
from layouts.checks import align, ceil_div

# "auto": `choose_layout` decides between contig and masked; "fused": the whole routed branch in
# one op (`custom_calls.fused_moe`), chosen only explicitly (its weights are prepared for it)
LAYOUTS = ("auto", "contig", "masked", "fused")
MASKED_M_PAD_MULTIPLE = 256
DEFAULT_MASKED_BUDGET_FRACTION = 0.25


def default_masked_m_pad(num_tokens: int) -> int:
    return align(max(num_tokens, 1), MASKED_M_PAD_MULTIPLE)


def expected_m(num_tokens: int, top_k: int, num_experts_global: int) -> int:
    """Masked GEMM tuning hint: ceil(M * top_k / E_global)."""
    return ceil_div(num_tokens * top_k, num_experts_global)


@dataclass(frozen=True)
class ContigDispatch:
    """src2dst (M, k) int32 row of each route or -1; m_indices (M_cap,) int32 expert per row, -1 =
    padding; num_rows () int32 rows in use (sum of padded segments); num_rows_cap: static M_cap;
    counts (E_local,) int32 routes per expert."""

    src2dst: jax.Array
    m_indices: jax.Array
    num_rows: jax.Array
    counts: jax.Array
    num_rows_cap: int
    alignment: int


jax.tree_util.register_dataclass(ContigDispatch, data_fields=["src2dst", "m_indices", "num_rows", "counts"],
                                 meta_fields=["num_rows_cap", "alignment"])


@dataclass(frozen=True)
class MaskedDispatch:
    """src2dst (M, k) int32 flat slab row g*m_pad + r or -1 (E_local * m_pad for a dropped route
    when built with mark_dropped); masked_m (E_local,) int32 real rows per slab; num_dropped ()
    int32 routes beyond m_pad (0 unless a token repeats an expert); m_pad and expected_m static."""

    src2dst: jax.Array
    masked_m: jax.Array
    num_dropped: jax.Array
    m_pad: int
    expected_m: int


jax.tree_util.register_dataclass(MaskedDispatch, data_fields=["src2dst", "masked_m", "num_dropped"],
                                 meta_fields=["m_pad", "expected_m"])


@functools.partial(jax.jit, static_argnames=("num_local_experts", "alignment", "backend"))
def dispatch_contig(topk_ids: jax.Array, *, num_local_experts: int, alignment: int,
                    expert_offset=0, backend: str | None = None) -> ContigDispatch:
    """topk_ids (M, k) global int ids -> ContigDispatch. Segments in expert order, each starting at
    a multiple of `alignment`; within a segment routes keep (token, k) order. `backend` builds the
    map (`custom_calls.dispatch_map_contig`: one or two sort-free Triton launches, or the
    reference's argsort); the result does not depend on it."""
    # the dispatch-map op checks topk_ids, num_local_experts and alignment (trace time, once)
    src2dst, m_indices, num_rows, counts = dispatch_map_contig(
        topk_ids, expert_offset, num_local_experts=num_local_experts, alignment=alignment, backend=backend)
    m, k = topk_ids.shape
    cap = contig_capacity(m, k, num_local_experts, alignment)
    return ContigDispatch(src2dst=src2dst, m_indices=m_indices, num_rows=num_rows, counts=counts,
                          num_rows_cap=cap, alignment=alignment)


@functools.partial(jax.jit, static_argnames=("num_local_experts", "m_pad", "num_experts_global", "mark_dropped",
                                             "backend"))
def dispatch_masked(topk_ids: jax.Array, *, num_local_experts: int, m_pad: int,
                    num_experts_global: int, expert_offset=0, mark_dropped: bool = False,
                    backend: str | None = None) -> MaskedDispatch:
    """topk_ids (M, k) global int ids -> MaskedDispatch with (E_local, m_pad) slabs; `backend` as
    in `dispatch_contig`; mark_dropped: a dropped route's src2dst is the row one past the last slab
    instead of -1 (`custom_calls.dispatch_map_masked`), which the un-permute turns into NaN."""
    if not isinstance(m_pad, int) or m_pad < 1 or m_pad % 128:
        raise ValueError(f"m_pad: expected a positive multiple of 128, got {m_pad!r}")
    # the dispatch-map op checks topk_ids and num_local_experts (trace time, once)
    src2dst, masked_m, num_dropped = dispatch_map_masked(topk_ids, expert_offset, num_local_experts=num_local_experts,
                                                         m_pad=m_pad, mark_dropped=mark_dropped, backend=backend)
    m, k = topk_ids.shape
    if m_pad < m:
        raise ValueError(f"m_pad={m_pad} is too small for the static worst case: one expert can "
                         f"receive every one of the M={m} tokens (need m_pad >= {m}, e.g. "
                         f"{default_masked_m_pad(m)})")
    return MaskedDispatch(src2dst=src2dst, masked_m=masked_m, num_dropped=num_dropped,
                          m_pad=m_pad, expected_m=expected_m(m, k, num_experts_global))


# -- layout choice (the seed's App. B rule) ---------------------------------------------------------

def grouped_row_bytes(*, hidden_size: int, intermediate_size: int, quantized: bool) -> int:
    """Bytes per row of the grouped layout at the expert MLP's peak: the largest footprint among
    GEMM1 (input + 2I bf16 output), activation (2I bf16 + I input of GEMM2) and GEMM2 (I input +
    H bf16 output); quantized inputs count 1 byte per value plus 4 bytes per 32 values of scales."""
    def act_bytes(k: int) -> int:
        return k + 4 * ceil_div(k, 32) if quantized else 2 * k

    h, i = hidden_size, intermediate_size
    return max(act_bytes(h) + 4 * i, 4 * i + act_bytes(i), act_bytes(i) + 2 * h)


def masked_peak_bytes(*, num_local_experts: int, m_pad: int, hidden_size: int,
                      intermediate_size: int, quantized: bool) -> int:
    """Estimated peak of the masked path: E_local * m_pad * `grouped_row_bytes`."""
    per_row = grouped_row_bytes(hidden_size=hidden_size, intermediate_size=intermediate_size,
                                quantized=quantized)
    return num_local_experts * m_pad * per_row


def choose_layout(*, num_tokens: int, num_local_experts: int, hidden_size: int,
                  intermediate_size: int, recipe: str, arch: int, act: ActivationSpec,
                  backend: str | None = "auto", m_pad: int | None = None,
                  memory_budget_bytes: int | None = None,
                  budget_fraction: float = DEFAULT_MASKED_BUDGET_FRACTION) -> str:
    """"contig" or "masked" from static sizes (recipe/arch: the GEMM recipe and arch). Contig when
    the masked activation of `backend` cannot serve the masked layout (its `supports_*` answer,
    device aside: e.g. the Triton clamp/SiTU kernel's D//8 >= E_local, group and width
    constraints); else masked only if `masked_peak_bytes` fits budget_fraction *
    memory_budget_bytes (free device memory, queried by the caller outside jit); with no budget
    given, contig (like the seed's graph-capture case, which cannot query memory)."""
    m_pad = default_masked_m_pad(num_tokens) if m_pad is None else m_pad
    ok, _ = static_supports(OP_ACTIVATION_MASKED, get_default_backend() if backend is None else backend,
                            num_groups=num_local_experts, m_pad=m_pad, two_i=2 * intermediate_size, act=act,
                            recipe=recipe, arch=arch, dtype=jnp.dtype(jnp.bfloat16))
    if not ok or memory_budget_bytes is None:
        return "contig"
    peak = masked_peak_bytes(num_local_experts=num_local_experts, m_pad=m_pad,
                             hidden_size=hidden_size, intermediate_size=intermediate_size,
                             quantized=get_recipe(recipe).is_quantized)
    return "masked" if peak <= budget_fraction * memory_budget_bytes else "contig"
