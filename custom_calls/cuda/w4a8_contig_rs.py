"""The W4A8 contig GEMM as a persistent, warp-specialized CUDA kernel with the weights as the wgmma's
register operand (``w4a8_contig_rs_sm90.cuh``): one warp group issues the TMA copies and scales the token
scales by the tile's block scale (one number per K block), two widen their fragments of each K block's
128 x 128 weight tile in registers and run RS wgmmas over the tile's 128 tokens, with DeepGEMM's one-FFMA
promotion.

Operands as `w4a8_gemm.w4a8_contig_cuda`'s: lhs (M_cap, K) e4m3 in the W4A8 column order, lhs_scale
(K/128, align(M_cap, 4)) f32, rhs (G, N, K/2) int8 words, rhs_scale (G, N, K/128) int32, m_indices
(M_cap,) int32 -> (M_cap, N) bf16, padding rows 0; the alignment a multiple of 128 (a tile's 128 rows in
one expert's segment).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from custom_calls.cuda.w4a8_gemm import COMMON_SOURCE, KERNEL_ARGS, MAX_SMEM, tensor_maps, wgmma_function
from custom_calls.native.launch_plan import ARG_U32, KernelArg, LaunchPlan
from layouts.checks import align, ceil_div

KERNEL_SOURCE = Path(__file__).parent / "w4a8_contig_rs_sm90.cuh"  # package data of the wheel
SYMBOL = "moe_jax_w4a8_contig_rs_sm90"
BLOCK = 128  # tokens and weight rows of a tile
THREADS = 384  # a producer warp group and two consumers
OUT_LD = BLOCK + 8  # the output staging's row stride in bf16 (the kernel's)
SCALED_LD = 36  # floats per row of the scaled token scales (the kernel's)


@dataclasses.dataclass(frozen=True)
class W4A8RsConfig:
    """stages: ring slots in shared memory, each one K block of the tile's tokens, its 4-bit weight rows and
    the token scales (`smem_bytes`); 2 to 7 fit an SM90 block. num_sms: blocks of the persistent grid (at
    most one per tile); None: the device's SM count at trace time (132 without a device). ahead: each thread
    widens K block kb + 1 while K block kb's MMA runs (a second fragment set in registers; measured 1.06-1.10x
    faster than widening each K block just before its MMA)."""

    stages: int = 6
    num_sms: int | None = None
    ahead: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or not 2 <= self.stages <= 7:
            raise ValueError(f"W4A8RsConfig.stages: expected an int in [2, 7], got {self.stages!r}")
        if self.num_sms is not None and (isinstance(self.num_sms, bool) or not isinstance(self.num_sms, int)
                                         or self.num_sms <= 0):
            raise ValueError(f"W4A8RsConfig.num_sms: expected a positive int or None, got {self.num_sms!r}")


def smem_bytes(cfg: W4A8RsConfig) -> int:
    """Dynamic shared memory of a block: `stages` slots of (tokens 128 x 128 B, the 4-bit tile 128 x 64 B,
    128 token scales), each rounded up to 1024 B, 1024 B to align the first, the output staging (128
    token rows of OUT_LD bf16), and per slot the token scales times the block scale (4 rows of SCALED_LD f32,
    one per consumer lane's c = lane % 4)."""
    return (cfg.stages * (align(BLOCK * 128 + BLOCK * 64 + BLOCK * 4, 1024) + 4 * SCALED_LD * 4) + 1024
            + BLOCK * OUT_LD * 2)


def source(cfg: W4A8RsConfig, *, n: int, k: int) -> str:
    """The translation unit: shapes and stages as macros, the W4A8 device helpers, the MMA (weights from
    registers, tokens from shared memory: `wgmma_m64n128k32_rs`), the kernel."""
    if k % 128:
        raise ValueError(f"k: the W4A8 kernel needs a multiple of 128, got {k}")
    head = (f"#include <cstdint>\n#define W4A8_RS_N {n}\n#define W4A8_RS_K {k}\n#define W4A8_RS_STAGES {cfg.stages}\n"
            f"#define W4A8_RS_AHEAD {int(cfg.ahead)}\n")
    return (head + COMMON_SOURCE.read_text() + wgmma_function("wgmma_m64n128k32_rs", BLOCK)
            + KERNEL_SOURCE.read_text())


def kernel_name(cfg: W4A8RsConfig, *, n: int, k: int) -> str:
    return f"w4a8_contig_rs_sm90_n{n}_k{k}_s{cfg.stages}{'_ahead' if cfg.ahead else ''}"


def grid_size(cfg: W4A8RsConfig, *, m_cap: int, n: int) -> int:
    """Blocks of the persistent grid: one per SM (`cfg.num_sms`, else the device's), at most one per tile."""
    num_sms = cfg.num_sms
    if num_sms is None:
        from custom_calls.native.toolchain import detected_device

        num_sms = detected_device()[2] or 132
    return max(1, min(num_sms, (m_cap // BLOCK) * ceil_div(n, BLOCK)))


def plan(cfg: W4A8RsConfig, cubin: str, *, g: int, m_cap: int, n: int, k: int) -> LaunchPlan:
    """Operands 0 lhs, 1 lhs_scale, 2 rhs, 3 rhs_scale, 4 m_indices, 5 D; a persistent grid
    (`grid_size`), the token blocks as an argument; `w4a8_gemm.tensor_maps` with boxes of 128 tokens and
    128 weight rows."""
    smem = smem_bytes(cfg)
    if smem > MAX_SMEM:
        raise ValueError(f"W4A8RsConfig(stages={cfg.stages}): {smem} bytes of shared memory per block, at most "
                         f"{MAX_SMEM}; fewer stages")
    if m_cap % BLOCK:
        raise ValueError(f"M_cap: the W4A8 RS kernel takes tiles of {BLOCK} token rows, got {m_cap}")
    tmaps = tensor_maps(g=g, slabs=1, m_pad=m_cap, n=n, k=k, block_tokens=BLOCK, block_rows=BLOCK)
    return LaunchPlan(SYMBOL, cubin, grid_size(cfg, m_cap=m_cap, n=n), THREADS, 1, smem,
                      KERNEL_ARGS + (KernelArg(ARG_U32, m_cap // BLOCK),), tmaps)


def w4a8_contig_rs(lhs: jax.Array, lhs_scale: jax.Array, rhs: jax.Array, rhs_scale: jax.Array,
                   m_indices: jax.Array, *, alignment: int, config: W4A8RsConfig | None = None) -> jax.Array:
    """As `w4a8_gemm.w4a8_contig_cuda` (module docstring), the alignment a multiple of 128. Operands already
    checked (`m_grouped_gemm_contig`). Compiles on first use for sm_90a."""
    from custom_calls.native.compiler import compile_cubin
    from custom_calls.native.launch import launch

    if alignment % BLOCK:
        raise ValueError(f"alignment: the W4A8 RS kernel's tiles of {BLOCK} token rows must lie in one expert's "
                         f"segment, so the alignment must be a multiple of {BLOCK}, got {alignment}")
    cfg = config or W4A8RsConfig()
    m_cap, k = lhs.shape
    g, n = rhs.shape[:2]
    cubin = compile_cubin(kernel_name(cfg, n=n, k=k), source(cfg, n=n, k=k), 90)
    (d,) = launch(plan(cfg, str(cubin.path), g=g, m_cap=m_cap, n=n, k=k), [lhs, lhs_scale, rhs, rhs_scale, m_indices],
                  [jax.ShapeDtypeStruct((m_cap, n), jnp.bfloat16)])
    return d
