"""Triton kernel: the router (gate) GEMM as split-K partial sums, bf16 x bf16 -> fp32.

  router_partials(x (M, H) bf16, gate_weight (E, H) bf16, *, split_k) -> partials (S, M, E) f32
  with S = ceil(H / split_k) and partials[s] = x[:, s*split_k:(s+1)*split_k] @ gate_weight[:, same]^T

The consumer (the routing epilogue of the fused MoE input stage) adds the S partials in order
s = 0, 1, ..., so the logits are the same bits wherever they are read, and no separate reduction
kernel runs between the GEMM and the top-k. A bf16 x bf16 product is exact in fp32: only the order
of the fp32 sums differs from XLA's `einsum(..., preferred_element_type=f32)`. Reference:
`custom_calls.route_topk.router_partials_reference`.

One program computes a [block_m, block_e] tile of one split with `tl.dot` (fp32 accumulation),
its loads software-pipelined over the split's `block_k` steps. At decode sizes the splits are what
fills the GPU (a 128-token batch is 8 row blocks); at prefill sizes the row blocks do, and a split
stays at least two `block_k` steps deep.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from layouts import ceil_div
from custom_calls.triton.interpret import interpreting
from custom_calls.triton.launch import KernelCall
from custom_calls.triton.tuning import check_launch, check_powers_of_two, config_or_default

TARGET_PROGRAMS = 128  # about one program per SM of an H200 (132 SMs), when the rows allow
MIN_SPLIT_STEPS = 2  # block_k steps per split, so that the pipelined loads overlap something
MIN_BLOCK_E = 16  # tl.dot's smallest N
MAX_SPLITS = 32  # the reader adds the partials in an unrolled loop


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Tiling of `router_partials_kernel` (see `custom_calls.triton.tuning`): [block_m, block_e]
    output tiles, block_k columns per `tl.dot`, split_k columns per split (a multiple of block_k),
    num_stages: Triton's pipelining depth of the loop over a split's block_k steps (1: none)."""

    block_m: int
    block_e: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int = 1

    def __post_init__(self) -> None:
        check_powers_of_two(self, "block_m", "block_e", "block_k")
        check_launch(self)
        if isinstance(self.num_stages, bool) or self.num_stages not in (1, 2, 3, 4):
            raise ValueError(f"RouterConfig.num_stages: expected 1, 2, 3 or 4, got {self.num_stages!r}")
        if self.block_m < 16 or self.block_e < MIN_BLOCK_E or self.block_k < 16:
            raise ValueError(f"RouterConfig: block_m, block_e and block_k must be >= 16 (tl.dot), got "
                             f"{self.block_m}, {self.block_e}, {self.block_k}")
        if isinstance(self.split_k, bool) or not isinstance(self.split_k, int) or self.split_k <= 0 \
                or self.split_k % self.block_k:
            raise ValueError(f"RouterConfig.split_k: expected a positive multiple of block_k={self.block_k}, "
                             f"got {self.split_k!r}")


def heuristic_config(num_tokens: int, hidden: int, num_experts: int) -> RouterConfig:
    """The default tiling: 16-row blocks up to 256 tokens, 64 up to 1024, 128 (eight warps) above;
    all experts of a row block in one tile up to 128 (E tiles of 128 above); 128-column steps,
    pipelined 3 deep; splits of whole steps, as many as it takes for `TARGET_PROGRAMS` programs (a
    split at least `MIN_SPLIT_STEPS` deep, at most `MAX_SPLITS`). On one H200 (H 7168), against
    the earlier 16 / 64-row blocks, ~264 programs and unpipelined loads, router partials + the
    routed input kernel that reads them, kernel time: 32 experts 5.3 -> 5.0 µs at 32 tokens, 6.4 ->
    6.0 at 128, 13.0 -> 8.2 at 512, 22.4 -> 12.1 at 1024, 45.1 -> 41.1 at 4096, 147.8 -> 146.2 at
    16384; 256 experts 12.8 -> 11.7 at 128, 34.0 -> 14.6 at 512, 89.0 -> 62.8 at 4096."""
    block_m = 16 if num_tokens <= 256 else 64 if num_tokens <= 1024 else 128
    block_e = min(max(MIN_BLOCK_E, triton.next_power_of_2(num_experts)), 128)
    block_k = 128
    tiles = ceil_div(num_tokens, block_m) * ceil_div(num_experts, block_e)
    steps = ceil_div(hidden, block_k)
    splits = max(1, min(steps // MIN_SPLIT_STEPS, MAX_SPLITS, ceil_div(TARGET_PROGRAMS, tiles)))
    return RouterConfig(block_m=block_m, block_e=block_e, block_k=block_k,
                        split_k=ceil_div(steps, splits) * block_k, num_warps=8 if block_m == 128 else 4,
                        num_stages=3)


@triton.jit
def router_partials_kernel(
    x_ptr, w_ptr, out_ptr,
    M: tl.constexpr, H: tl.constexpr, E: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr,
    TRIGGER: tl.constexpr = False, WAIT: tl.constexpr = False,
):
    """Grid (cdiv(M, BLOCK_M), S, cdiv(E, BLOCK_E)): out[s, m, e] = sum over the split's columns.
    TRIGGER: let the kernel launched after this one with programmatic dependent launch start now
    (it waits for this grid's completion before it reads the partials); only where this kernel
    was itself launched after everything it reads was complete, or WAIT.
    WAIT: this kernel was launched programmatically: before anything else (a memory access, the
    trigger) wait for the kernel before it to complete (griddepcontrol.wait)."""
    if WAIT:
        tl.extra.cuda.gdc_wait()
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    s = tl.program_id(1)
    pid_e = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    m_ok = m < M
    e_ok = e < E
    acc = tl.zeros((BLOCK_M, BLOCK_E), tl.float32)
    for step in range(SPLIT_K // BLOCK_K):  # the last split's steps past H load nothing
        k = s * SPLIT_K + step * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < H
        a = tl.load(x_ptr + tl.expand_dims(m.to(tl.int64) * H, 1) + tl.expand_dims(k, 0),
                    mask=tl.expand_dims(m_ok, 1) & tl.expand_dims(k_ok, 0), other=0.0)
        b = tl.load(w_ptr + tl.expand_dims(k, 1) + tl.expand_dims(e.to(tl.int64) * H, 0),
                    mask=tl.expand_dims(k_ok, 1) & tl.expand_dims(e_ok, 0), other=0.0)
        if FP32_DOT:  # Triton's interpreter: its bf16 dot is not the exact-product one the GPU runs
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee", out_dtype=tl.float32)
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.float32)
    out = out_ptr + s.to(tl.int64) * M * E + tl.expand_dims(m.to(tl.int64) * E, 1) + tl.expand_dims(e, 0)
    tl.store(out, acc, mask=tl.expand_dims(m_ok, 1) & tl.expand_dims(e_ok, 0))


def router_call(x: jax.Array, gate_weight: jax.Array, *, config: RouterConfig | None = None,
                trigger: bool = False, wait: bool = False) -> KernelCall:
    """The launch of `router_partials` (``trigger`` / ``wait``: the kernel's TRIGGER / WAIT, for a
    native launch sequence: the next kernel launched programmatically / this one)."""
    m, h = x.shape
    e = gate_weight.shape[0]
    config = config_or_default(config, RouterConfig, lambda: heuristic_config(m, h, e))
    splits = ceil_div(h, config.split_k)
    return KernelCall(
        router_partials_kernel, (x, gate_weight), (jax.ShapeDtypeStruct((splits, m, e), jnp.float32),),
        grid=(ceil_div(m, config.block_m), splits, ceil_div(e, config.block_e)), num_warps=config.num_warps,
        num_stages=config.num_stages, name="moe_router_partials",
        constexprs=dict(M=m, H=h, E=e, SPLIT_K=config.split_k, BLOCK_M=config.block_m, BLOCK_E=config.block_e,
                        BLOCK_K=config.block_k, FP32_DOT=interpreting(), TRIGGER=trigger,
                        WAIT=wait))


def router_partials(x: jax.Array, gate_weight: jax.Array, *, config: RouterConfig | None = None) -> jax.Array:
    """Same signature and result (up to the order of the fp32 sums within a split) as
    `custom_calls.route_topk.router_partials_reference` with split_k = config.split_k:
    x (M, H) bf16, gate_weight (E, H) bf16 -> (ceil(H / split_k), M, E) f32.
    config: the tiling (None: `heuristic_config(M, H, E)`)."""
    return router_call(x, gate_weight, config=config).run()[0]
