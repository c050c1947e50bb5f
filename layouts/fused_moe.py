"""Device buffer and weight order of the SM90 fused MoE kernel (sgl-deep-gemm 0.2.5's
``sm90_fp8_mega_moe_impl``: dispatch, GEMM1, SwiGLU, FP8 quantization, GEMM2 and combine in one
persistent kernel).

The kernel works in one device buffer (DeepGEMM's "symmetric buffer", here on a single rank, so
no peer ever maps it). It slices that buffer itself from its template values: a workspace of
counters, routing tables and flags, then data regions laid back to back, each ``tokens x bytes per
token`` (``layout::Buffer``) starting where the previous one ends. The host allocates the buffer
and writes the input regions, so it must compute the very same offsets. ``FusedMoEBuffer``
restates the arithmetic of the kernel's own layout code: ``layout::get_num_max_pool_tokens_sm90``
and ``layout::SM90Workspace::get_num_bytes`` (``deep_gemm/layout/sm90_mega_moe.cuh``),
``layout::Data`` / ``layout::Buffer`` (``deep_gemm/layout/mega_moe.cuh``), in the order
``sm90_fp8_mega_moe_impl`` builds them. tests/test_layouts_fused_moe.py compiles that code on the
host and checks every offset against this module.

Regions, in buffer order (T = max_tokens, H = hidden, I = intermediate, k = top_k,
P = pool_tokens, S = padded_sf_tokens):

  workspace           bytes                    counters, routing tables, flags
  input_tokens        float8_e4m3fn (T, H)     the tokens, quantized per 1 x 128 group
  input_scales        float32 (T, H/128)       their scales, token-major
  input_topk_ids      int64 (T, k)             expert of each route; negative = no route
  input_topk_weights  float32 (T, k)
  l1_tokens           float8_e4m3fn (P, H)     GEMM1's input, rows grouped by expert (dispatch)
  l1_scales           float32 (H/128, S)       scale-major: [group][pool slot]
  l1_topk_weights     float32 (P,)
  l2_tokens           float8_e4m3fn (P, I)     GEMM2's input (SwiGLU output, quantized)
  l2_scales           float32 (I/128, S)       scale-major: [group][pool slot]
  combine             bfloat16 (k, T, H)       GEMM2's output per top-k slot, summed into y

The pool (P rows) holds every route plus each expert's padding to a whole BLOCK_M block; every
BLOCK_M-row pool block owns align(BLOCK_M, 128) scale slots, hence S.

GEMM1's weights go in gate/up interleaved row order (``interleave_gate_up``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from layouts.checks import align, check_positive_int

# BLOCK_M values the SM90 kernel instantiates (layout::kSM90CandidateBlockM); the pool is padded
# for the largest of them and aligned to their LCM.
FUSED_MOE_BLOCK_MS = (64, 128)
_SM90_MAX_CANDIDATE_BLOCK_M = 128
_SM90_LCM_BLOCK_M = 128
# SM90Workspace sizes its per-block arrays at layout::kMinCandidateBlockM granularity.
_MIN_CANDIDATE_BLOCK_M = 8
# One fp32 scale per 128 channels of a token (activations) or 128 x 128 block (weights).
SCALE_GROUP = 128
_U32_LIMIT = 2**32

# GEMM1's weight rows: gate and up alternate in groups of this many (the kernel's SwiGLU pairs the
# 8-column accumulator chunks 2p and 2p + 1)
FUSED_GATE_UP_GRAN = 8

REGION_NAMES = (
    "workspace", "input_tokens", "input_scales", "input_topk_ids", "input_topk_weights",
    "l1_tokens", "l1_scales", "l1_topk_weights", "l2_tokens", "l2_scales", "combine",
)


def _array_module(w):
    """numpy for numpy arrays (the result stays on the host), jax.numpy for anything else."""
    return np if isinstance(w, np.ndarray) else jnp


def _check_gate_up(name: str, w, gran) -> None:
    check_positive_int("gran", gran)
    if not hasattr(w, "shape") or len(w.shape) < 2:
        got = tuple(w.shape) if hasattr(w, "shape") else type(w).__name__
        raise ValueError(f"{name}: expected an array of shape (..., 2I, K), got {got}")
    rows = w.shape[-2]
    if rows % (2 * gran):
        raise ValueError(f"{name}: expected axis -2 (2I rows) to be a multiple of 2 * gran = {2 * gran}, "
                         f"got shape {tuple(w.shape)}")


def interleave_gate_up(w, gran: int = FUSED_GATE_UP_GRAN):
    """GEMM1 weight rows [gate (I); up (I)] -> gate/up interleaved in chunks of ``gran`` rows.

    w: (..., 2I, K), any dtype (float8_e4m3fn included), numpy or jax -> same shape, dtype and
    array kind. Output rows: gate 0..gran-1, up 0..gran-1, gate gran..2gran-1, up gran..2gran-1, ...
    i.e. out[2 j gran + r] = gate[j gran + r] and out[(2 j + 1) gran + r] = up[j gran + r].

    The kernel's GEMM1 epilogue pairs accumulator column chunks 2p (gate) and 2p + 1 (up) of 8
    columns each, so its weights must be in this order with gran = 8. The weight scales
    (..., 2I/128, K/128) stay in [gate; up] order: the kernel looks up the gate and up blocks there.
    """
    _check_gate_up("w", w, gran)
    xp = _array_module(w)
    *lead, rows, k = w.shape
    halves = xp.reshape(w, (*lead, 2, rows // (2 * gran), gran, k))  # [gate|up][chunk][row][k]
    return xp.reshape(xp.swapaxes(halves, -4, -3), (*lead, rows, k))


def deinterleave_gate_up(w, gran: int = FUSED_GATE_UP_GRAN):
    """Inverse of ``interleave_gate_up``: (..., 2I, K) interleaved -> rows [gate (I); up (I)]."""
    _check_gate_up("w", w, gran)
    xp = _array_module(w)
    *lead, rows, k = w.shape
    chunks = xp.reshape(w, (*lead, rows // (2 * gran), 2, gran, k))  # [chunk][gate|up][row][k]
    return xp.reshape(xp.swapaxes(chunks, -4, -3), (*lead, rows, k))


@dataclasses.dataclass(frozen=True)
class FusedMoEBuffer:
    """The fused MoE kernel's device buffer for one static problem size (single rank).

    max_tokens: tokens per call at most (the kernel's kNumMaxTokensPerRank); hidden: H;
    intermediate: I (per expert); num_experts: E; top_k: k; block_m: the kernel's BLOCK_M (64 or 128).
    See the module docstring for the regions; all sizes are bytes.
    """

    max_tokens: int
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    block_m: int

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_positive_int(f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, int(getattr(self, f.name)))
        if self.block_m not in FUSED_MOE_BLOCK_MS:
            raise ValueError(f"block_m: expected one of {FUSED_MOE_BLOCK_MS} (the SM90 kernel's BLOCK_M), "
                             f"got {self.block_m}")
        # The token's scale row (H/128 fp32 = H/32 bytes) is a TMA-aligned layout::Data: a
        # multiple of 16 bytes, so H is a multiple of 512.
        if self.hidden % 512:
            raise ValueError(f"hidden: expected a multiple of 512 (H/128 fp32 scales per token must fill "
                             f"16-byte rows), got {self.hidden}")
        if self.intermediate % SCALE_GROUP:
            raise ValueError(f"intermediate: expected a multiple of {SCALE_GROUP} (one fp32 scale per 128 "
                             f"channels), got {self.intermediate}")
        # The headers compute these counts in 32-bit integers.
        e, t = self.num_experts, self.max_tokens
        for what, value in (("pool_tokens + 128", self.pool_tokens + _SM90_LCM_BLOCK_M),
                            ("num_experts * max_tokens", e * t),
                            ("padded_sf_tokens", self.padded_sf_tokens)):
            if value >= _U32_LIMIT:
                raise ValueError(f"max_tokens, num_experts, top_k: expected {what} < 2**32 (the kernel counts "
                                 f"in 32 bits), got {value} for max_tokens={t}, num_experts={e}, top_k={self.top_k}")

    @property
    def pool_tokens(self) -> int:
        """Pool rows (layout::get_num_max_pool_tokens_sm90 for one rank): every route (at most
        min(k, E) per token) plus up to BLOCK_M - 1 padding rows per expert for the largest BLOCK_M."""
        routes = self.max_tokens * min(self.top_k, self.num_experts)
        return align(routes + self.num_experts * (_SM90_MAX_CANDIDATE_BLOCK_M - 1), _SM90_LCM_BLOCK_M)

    @property
    def padded_sf_tokens(self) -> int:
        """Scale slots per scale group of l1_scales / l2_scales (the kernel's kNumPaddedSFPoolTokens,
        its minimum): each BLOCK_M-row pool block owns align(BLOCK_M, 128) slots."""
        return (self.pool_tokens // self.block_m) * align(self.block_m, 128)

    @property
    def workspace_bytes(self) -> int:
        """layout::SM90Workspace(base, 1, E, T, k, 0).get_num_bytes(): the ring covers the whole
        pool (num_ring_tokens 0), so its per-block semaphores are sized by the pool too."""
        e, t = self.num_experts, self.max_tokens
        pool_blocks = self.pool_tokens // _MIN_CANDIDATE_BLOCK_M
        ring_blocks = pool_blocks
        flag_words = e + e + 1 + 1  # get_t2_bank_flag_words: done flags, tile counts, epoch, count flag per rank
        bank1_offset = align(flag_words * 4, 8)  # get_t2_bank1_offset_in_flags
        bank1_bytes = (e + e) * 8 + flag_words * 4  # get_t2_bank1_bytes
        n = 32  # kNumBarrierSignalBytes
        n += e * 8 * 2  # expert send counts, bank-0 receive counts
        n += e * 8  # per local expert (unused u64 of bank 0)
        n += align(pool_blocks, 2) * 4  # L1 arrival counts
        n += pool_blocks * 8  # L2 arrival masks
        n += ring_blocks * 4 * 2  # ring empty semaphores (L1, L2)
        n += e * 1 * t * 4  # source (token, k) of each received route, per expert
        n += self.pool_tokens * 12  # TokenSrcMetadata per pool row
        n += align(bank1_bytes + bank1_offset, 1024)
        return align(n, 1024)

    @property
    def regions(self) -> dict[str, tuple[int, int]]:
        """name -> (offset, nbytes), in buffer order (``REGION_NAMES``): each region starts where
        the previous one ends, as layout::Buffer chains them."""
        t, h, i, k = self.max_tokens, self.hidden, self.intermediate, self.top_k
        p, s = self.pool_tokens, self.padded_sf_tokens
        sizes = (
            ("workspace", self.workspace_bytes),
            ("input_tokens", t * h),
            ("input_scales", t * (h // 32)),  # layout::Data(H / 32): H/128 fp32 per token
            ("input_topk_ids", t * k * 8),
            ("input_topk_weights", t * k * 4),
            ("l1_tokens", p * h),
            ("l1_scales", s * (h // 32)),
            ("l1_topk_weights", p * 4),
            ("l2_tokens", p * i),
            ("l2_scales", s * (i * 4 // 128)),  # layout::Data(I * 4 / 128, false)
            ("combine", k * t * h * 2),
        )
        out, offset = {}, 0
        for name, nbytes in sizes:
            out[name] = (offset, nbytes)
            offset += nbytes
        return out

    @property
    def total_bytes(self) -> int:
        """Size of the whole buffer: the end of the combine region."""
        offset, nbytes = self.regions["combine"]
        return offset + nbytes
