"""The W4A8 contig GEMM as a warp-specialized CUDA kernel (``w4a8_contig_ws_sm90.cuh``): two warp groups
widen each K block's 128 x 128 weight tile into shared memory, two run SS wgmmas over it, with
DeepGEMM's one-FFMA promotion (the tile's block scale is one number per K block). The registry's contig
op on an SM90 GPU where the alignment is a multiple of 128 (`custom_calls.w4a8_backend`): measured
1.09-1.13x the register-operand kernel (`w4a8_gemm.w4a8_contig_cuda`) at V4's GEMM1 and 1.03-1.04x at GEMM2
on one H100, with bit-identical outputs (BENCHMARKS.md).

Operands as `w4a8_gemm.w4a8_contig_cuda`'s: lhs (M_cap, K) e4m3 in the W4A8 column order, lhs_scale
(K/128, align(M_cap, 4)) f32, rhs (G, N, K/2) int8 words, rhs_scale (G, N, K/128) int32, m_indices
(M_cap,) int32 -> (M_cap, N) bf16, padding rows 0; the alignment a multiple of 128 (a block's 128 rows in
one expert's segment).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from custom_calls.cuda.w4a8_gemm import (COMMON_SOURCE, KERNEL_ARGS, MAX_GRID_YZ, MAX_SMEM, tensor_maps,
                                         wgmma_function)
from custom_calls.native.launch_plan import LaunchPlan
from layouts.checks import align, ceil_div

KERNEL_SOURCE = Path(__file__).parent / "w4a8_contig_ws_sm90.cuh"  # package data of the wheel
SYMBOL = "moe_jax_w4a8_contig_ws_sm90"
BLOCK = 128  # tokens and weight rows of a block
THREADS = 512  # two producer warp groups and two consumers


SCALE_WORDS = ("prefetch", "shared")


@dataclasses.dataclass(frozen=True)
class W4A8WsConfig:
    """stages: ring slots in shared memory, each one K block of the tokens, the widened and the 4-bit
    weight tile and the token scales (`smem_bytes`); 2 to 5 fit an SM90 block.
    scale_words: where the producers find their rows' scale words: "prefetch", loaded from global memory
    one K block ahead; "shared", the tile's words copied into shared memory before the first K block
    (128 x (K/128 | 1) words more shared memory)."""

    stages: int = 4
    scale_words: str = "prefetch"

    def __post_init__(self) -> None:
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or not 2 <= self.stages <= 5:
            raise ValueError(f"W4A8WsConfig.stages: expected an int in [2, 5], got {self.stages!r}")
        if self.scale_words not in SCALE_WORDS:
            raise ValueError(f"W4A8WsConfig.scale_words: expected one of {SCALE_WORDS}, got {self.scale_words!r}")


def smem_bytes(cfg: W4A8WsConfig, k: int) -> int:
    """Dynamic shared memory of a block: `stages` slots of (tokens 128 x 128 B, the widened tile 128 x 128 B,
    the 4-bit tile 128 x 64 B, 128 token scales), each rounded up to 1024 B, and 1024 B to align the first
    (the kernel's SLOT); scale_words "shared": the tile's scale words after them, 128 rows of K/128 | 1
    words."""
    ring = cfg.stages * align(BLOCK * 128 + BLOCK * 128 + BLOCK * 64 + BLOCK * 4, 1024) + 1024
    return ring + (BLOCK * ((k // 128) | 1) * 4 if cfg.scale_words == "shared" else 0)


def source(cfg: W4A8WsConfig, *, n: int, k: int) -> str:
    """The translation unit: shapes and stages as macros, the W4A8 device helpers, the MMA (both operands
    from shared memory: `wgmma_m64n128k32_ss`), the kernel."""
    if k % 128:
        raise ValueError(f"k: the W4A8 kernel needs a multiple of 128, got {k}")
    head = (f"#include <cstdint>\n#define W4A8_WS_N {n}\n#define W4A8_WS_K {k}\n#define W4A8_WS_STAGES {cfg.stages}\n"
            f"#define W4A8_WS_SHARED_SCALES {int(cfg.scale_words == 'shared')}\n")
    return (head + COMMON_SOURCE.read_text() + wgmma_function("wgmma_m64n128k32_ss", BLOCK, a_in_registers=False)
            + KERNEL_SOURCE.read_text())


def kernel_name(cfg: W4A8WsConfig, *, n: int, k: int) -> str:
    return f"w4a8_contig_ws_sm90_n{n}_k{k}_s{cfg.stages}_{cfg.scale_words}"


def plan(cfg: W4A8WsConfig, cubin: str, *, g: int, m_cap: int, n: int, k: int) -> LaunchPlan:
    """Operands 0 lhs, 1 lhs_scale, 2 rhs, 3 rhs_scale, 4 m_indices, 5 D; grid (weight tiles, token blocks);
    `w4a8_gemm.tensor_maps` with boxes of 128 tokens and 128 weight rows."""
    smem = smem_bytes(cfg, k)
    if smem > MAX_SMEM:
        raise ValueError(f"W4A8WsConfig(stages={cfg.stages}, scale_words={cfg.scale_words!r}) at K {k}: {smem} bytes "
                         f"of shared memory per block, at most {MAX_SMEM}; fewer stages, or scale_words='prefetch'")
    if m_cap % BLOCK:
        raise ValueError(f"M_cap: the warp-specialized W4A8 kernel takes blocks of {BLOCK} rows, got {m_cap}")
    if m_cap // BLOCK > MAX_GRID_YZ:
        raise ValueError(f"M_cap {m_cap} / {BLOCK} rows per block: at most {MAX_GRID_YZ} token blocks")
    tmaps = tensor_maps(g=g, slabs=1, m_pad=m_cap, n=n, k=k, block_tokens=BLOCK, block_rows=BLOCK)
    return LaunchPlan(SYMBOL, cubin, ceil_div(n, BLOCK), THREADS, 1, smem, KERNEL_ARGS, tmaps,
                      grid_yz=(m_cap // BLOCK, 1))


def w4a8_contig_ws(lhs: jax.Array, lhs_scale: jax.Array, rhs: jax.Array, rhs_scale: jax.Array,
                   m_indices: jax.Array, *, alignment: int, config: W4A8WsConfig | None = None) -> jax.Array:
    """As `w4a8_gemm.w4a8_contig_cuda` (module docstring), the alignment a multiple of 128. Operands already
    checked (`m_grouped_gemm_contig`). Compiles on first use for sm_90a."""
    from custom_calls.native.compiler import compile_cubin
    from custom_calls.native.launch import launch

    if alignment % BLOCK:
        raise ValueError(f"alignment: the warp-specialized W4A8 kernel's blocks of {BLOCK} rows must lie in one "
                         f"expert's segment, so the alignment must be a multiple of {BLOCK}, got {alignment}")
    cfg = config or W4A8WsConfig()
    m_cap, k = lhs.shape
    g, n = rhs.shape[:2]
    cubin = compile_cubin(kernel_name(cfg, n=n, k=k), source(cfg, n=n, k=k), 90)
    (d,) = launch(plan(cfg, str(cubin.path), g=g, m_cap=m_cap, n=n, k=k), [lhs, lhs_scale, rhs, rhs_scale, m_indices],
                  [jax.ShapeDtypeStruct((m_cap, n), jnp.bfloat16)])
    return d
