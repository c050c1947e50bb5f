"""`ParallelConfig`: how one MoE layer is spread over a `Mesh` (docs/ARCHITECTURE.md). Frozen and hashable:
pass it as a static argument.

Patterns (how attention and the MoE layer share the mesh):

    pattern  tokens enter                        before MoE            experts       after MoE
    "tp"     replicated over moe_axes            -                     I sharded     one psum (all-reduce)
    "dp_tp"  sharded over every axis (DP attn)   all-gather (replicate) I sharded    one psum_scatter
    "cp"     sharded over every axis (CP segs)   all-gather            I sharded     one psum_scatter
    "tp_ep"  replicated over attn_tp_axes        keep 1/attn_tp        EP (whole)    one all-gather
    "dp_ep"  sharded over every axis             -                     EP (whole)    -

Axes not named in moe_axes (nor attn_tp_axes) are pure data parallelism: tokens are sharded over
them and the experts replicated. "dp_tp" and "cp" differ in one point only: DP rows past each
rank's `num_tokens` are padding and are excluded from routing; in "cp" every gathered row is real.

EP modes (patterns "tp_ep" / "dp_ep"), the user's trade-off:
  * "normal"       exact, variable size (DeepEP normal): each token goes once to each rank holding
                   one of its experts; `a2a_impl` "ragged" (jax.lax.ragged_all_to_all, GPU/TPU)
                   sends only real rows, "dense" (all_to_all of worst-case slots) runs everywhere,
                   "auto" picks ragged on GPU/TPU.
  * "low_latency"  fixed buffers (DeepEP LL): `num_max_dispatch_tokens_per_rank` rows per peer
                   whatever the batch, masked layout on arrival; tokens beyond it are not sent and
                   their routes counted (stats["dropped"]). A capacity below the static worst case
                   (the rank's token buffer) needs `return_stats=True` (else a trace-time error:
                   drops are never silent); `strict_capacity` makes it a trace-time error always.
  * "ring"         all-gather the tokens over the EP group, every rank runs its experts on all of
                   them, psum_scatter back: n x the bytes of an exact all-to-all, but two dense
                   collectives with no data-dependent sizes. Public reports measured
                   ragged_all_to_all at 1-3% MFU on 8xB200 (~12 us per empty peer slice) and this
                   scheme near 13% (marin#7012, openxla/xla#46982).

Wire formats: `quantize_dispatch` sends FP8 + scales where the recipe quantizes activations anyway
(fp8_block, mxfp8, mxfp4): half the bytes of bf16. Return trips of EP rows travel in
`combine_dtype` (each row is one rank's sum over its experts); sums done by a collective
(psum, psum_scatter) run in `reduce_dtype`.
"""

from __future__ import annotations

from dataclasses import dataclass

PATTERNS = ("tp", "dp_tp", "cp", "tp_ep", "dp_ep")
EP_PATTERNS = ("tp_ep", "dp_ep")
TP_PATTERNS = ("tp", "dp_tp", "cp")
EP_MODES = ("normal", "low_latency", "ring")
A2A_IMPLS = ("auto", "ragged", "dense", "ragged_emulated")
DTYPES = ("float32", "bfloat16")
DEFAULT_NUM_MAX_DISPATCH_TOKENS_PER_RANK = 128


def _axes(name: str, v) -> tuple[str, ...]:
    if isinstance(v, str):
        v = (v,)
    if not isinstance(v, (tuple, list)) or not all(isinstance(a, str) for a in v):
        raise TypeError(f"ParallelConfig.{name}: expected axis names (str), got {v!r}")
    v = tuple(v)
    if len(set(v)) != len(v):
        raise ValueError(f"ParallelConfig.{name}: repeated axis in {v!r}")
    return v


@dataclass(frozen=True)
class ParallelConfig:
    """Static description of the parallel layout (module docstring for the meaning of each field).

    pattern: one of PATTERNS; moe_axes: mesh axes the experts are sharded over (intermediate dim
    for TP patterns, whole experts for EP patterns); attn_tp_axes ("tp_ep" only; default moe_axes):
    axes whose ranks hold the same tokens; ep_mode / a2a_impl / num_max_dispatch_tokens_per_rank /
    strict_capacity: EP only; shared_on_local_tokens ("dp_tp" only): run the replicated shared
    expert on the rank's own rows before the gather instead of on the gathered rows."""

    pattern: str
    moe_axes: tuple[str, ...]
    attn_tp_axes: tuple[str, ...] = ()
    ep_mode: str = "normal"
    a2a_impl: str = "auto"
    num_max_dispatch_tokens_per_rank: int = DEFAULT_NUM_MAX_DISPATCH_TOKENS_PER_RANK
    strict_capacity: bool = False
    quantize_dispatch: bool = True
    combine_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    shared_on_local_tokens: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_axes", _axes("moe_axes", self.moe_axes))
        object.__setattr__(self, "attn_tp_axes", _axes("attn_tp_axes", self.attn_tp_axes))
        if self.pattern not in PATTERNS:
            raise ValueError(f"ParallelConfig.pattern: expected one of {PATTERNS}, got {self.pattern!r}")
        if not self.moe_axes:
            raise ValueError("ParallelConfig.moe_axes: expected at least one mesh axis, got ()")
        if self.attn_tp_axes and self.pattern != "tp_ep":
            raise ValueError(f"ParallelConfig.attn_tp_axes: only pattern 'tp_ep' splits tokens over "
                             f"attention-TP ranks, got pattern {self.pattern!r} with {self.attn_tp_axes!r}")
        if self.pattern == "tp_ep" and not self.attn_tp_axes:
            object.__setattr__(self, "attn_tp_axes", self.moe_axes)
        if self.ep_mode not in EP_MODES:
            raise ValueError(f"ParallelConfig.ep_mode: expected one of {EP_MODES}, got {self.ep_mode!r}")
        if self.a2a_impl not in A2A_IMPLS:
            raise ValueError(f"ParallelConfig.a2a_impl: expected one of {A2A_IMPLS}, got {self.a2a_impl!r}")
        c = self.num_max_dispatch_tokens_per_rank
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise ValueError(f"ParallelConfig.num_max_dispatch_tokens_per_rank: expected a positive "
                             f"int, got {c!r}")
        for name in ("combine_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"ParallelConfig.{name}: expected one of {DTYPES}, "
                                 f"got {getattr(self, name)!r}")
        for name in ("strict_capacity", "quantize_dispatch", "shared_on_local_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ParallelConfig.{name}: expected a bool, got {getattr(self, name)!r}")
        if self.shared_on_local_tokens and self.pattern != "dp_tp":
            raise ValueError(f"ParallelConfig.shared_on_local_tokens: only meaningful for pattern "
                             f"'dp_tp', got {self.pattern!r}")

    @property
    def is_ep(self) -> bool:
        return self.pattern in EP_PATTERNS

    def token_axes(self, mesh_axes: tuple[str, ...]) -> tuple[str, ...]:
        """Mesh axes the token rows of x are sharded over, in mesh order."""
        if self.pattern == "tp":
            return tuple(a for a in mesh_axes if a not in self.moe_axes)
        if self.pattern == "tp_ep":
            return tuple(a for a in mesh_axes if a not in self.attn_tp_axes)
        return tuple(mesh_axes)
