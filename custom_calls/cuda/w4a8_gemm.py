"""The W4A8 grouped GEMMs as a CUDA kernel of this package (``w4a8_gemm_sm90.cuh``, one text for the
masked and the contig layout), compiled by nvcc into the kernel cache and run by the native launcher:
MXFP4 weights kept 4-bit (`layouts.w4a8`), copied 4-bit into shared memory by TMA, widened to e4m3 in
registers and fed to the tensor core as the MMA's register operand (the widened tile never goes
through shared memory: what bounds the Triton kernels of the same ops). The tokens, in the W4A8
column order, are the MMA's shared-memory operand as TMA copies them.

Operands as `custom_calls.triton.w4a8_gemm_kernel`'s: masked, lhs (G, m_pad, K) e4m3 (W4A8 column
order), lhs_scale (G, K/128, align(m_pad, 4)) f32, rhs (G, N, K/2) int8 words, rhs_scale (G, N, K/128)
int32, masked_m (G,) int32 -> (G, m_pad, N) bf16, rows >= masked_m[g] unwritten; contig, lhs (M_cap, K),
lhs_scale (K/128, align(M_cap, 4)), m_indices (M_cap,) -> (M_cap, N), padding rows 0.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from custom_calls.native.launch_plan import (ARG_PTR, ARG_TMAP, TMA_FLOAT32, TMA_UINT8, KernelArg, LaunchPlan,
                                             TensorMap)
from layouts.checks import align, ceil_div

KERNEL_SOURCE = Path(__file__).parent / "w4a8_gemm_sm90.cuh"  # package data of the wheel
COMMON_SOURCE = Path(__file__).parent / "w4a8_sm90_common.cuh"  # the kernels' device helpers
SYMBOL = "moe_jax_w4a8_gemm_sm90"
MAX_GRID_YZ = (1 << 16) - 1
MAX_SMEM = 227 * 1024  # an SM90 block's shared memory (dynamic, opted in by the launcher)


@dataclasses.dataclass(frozen=True)
class W4A8CudaConfig:
    """Tiling of the CUDA W4A8 kernel (masked and contig).

    token_tiles: 8-token tiles per block, the wgmma's N / 8 (a block covers 8 * token_tiles rows of
    one group; more rows take more blocks, each reading the weights again; contig: a divisor of the
    alignment / 8); warpgroups: per block, 64 weight rows each; stages: ring slots in shared memory,
    each one K block of the tokens, the weight rows and the token scales (TMA copies stages - 1 K
    blocks ahead); min_blocks: blocks per SM the register allocation is bounded for (shared memory
    may allow fewer: `smem_bytes`).
    """

    token_tiles: int = 4
    warpgroups: int = 1
    stages: int = 4
    min_blocks: int = 4

    def __post_init__(self) -> None:
        for name, lo, hi in (("token_tiles", 1, 16), ("warpgroups", 1, 4), ("stages", 2, 8), ("min_blocks", 1, 16)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"W4A8CudaConfig.{name}: expected an int in [{lo}, {hi}], got {v!r}")

    @property
    def block_rows(self) -> int:
        return 64 * self.warpgroups

    @property
    def block_tokens(self) -> int:
        return 8 * self.token_tiles


def smem_bytes(cfg: W4A8CudaConfig) -> int:
    """Dynamic shared memory of a block: `stages` slots of (tokens 128 B each, weight rows 64 B each,
    the token scales padded to 128 B), each rounded up to 1024 B (the 128-byte swizzle's period), and
    1024 B to align the first (the kernel's SLOT_STRIDE)."""
    slot = 128 * cfg.block_tokens + 64 * cfg.block_rows + align(4 * cfg.block_tokens, 128)
    return cfg.stages * align(slot, 1024) + 1024


def heuristic_config(expected_m: int) -> W4A8CudaConfig:
    """The token tile: 1, 2 or 4 tiles of 8, the fewest covering 1.5 x ``expected_m`` (real counts
    scatter around the mean; a group past the tile makes a second block read its weights again), at most
    4: wider tiles cost registers and shared memory, fewer blocks per SM."""
    want = ceil_div(3 * max(expected_m, 1), 2)
    tiles = 1
    while tiles < 4 and 8 * tiles < want:
        tiles *= 2
    return W4A8CudaConfig(token_tiles=tiles)


# Prefill: 64 tokens a block, one warp group, two blocks per SM: the fastest of this kernel's tilings
# measured (BENCHMARKS.md, W4A8 prefill), 1.8x the Triton contig kernel and 0.47x DeepGEMM's FP8 kernel.
# The registry's contig op where the alignment is not a multiple of 128; otherwise the persistent kernel
# (`w4a8_contig_rs`, 1.2x this one) runs.
CONTIG_CONFIG = W4A8CudaConfig(token_tiles=8, warpgroups=1, stages=4, min_blocks=2)


def contig_config(alignment: int) -> W4A8CudaConfig:
    """`CONTIG_CONFIG`, its token tile halved until it divides the alignment (a block must lie in one
    expert's segment)."""
    tiles = CONTIG_CONFIG.token_tiles
    while alignment % (8 * tiles):
        tiles //= 2
    return dataclasses.replace(CONTIG_CONFIG, token_tiles=tiles)


def source(cfg: W4A8CudaConfig, *, n: int, k: int, m_pad: int = 0, contig: bool = False) -> str:
    """The translation unit: the layout, shapes and tiling as macros, then the kernel text. m_pad: the
    rows of a masked group (contig takes its rows from the grid: one kernel for every M_cap)."""
    if k % 128:
        raise ValueError(f"k: the W4A8 kernel needs a multiple of 128, got {k}")
    m_pad = 0 if contig else m_pad
    defines = dict(W4A8_CONTIG=int(contig), W4A8_N=n, W4A8_K=k, W4A8_M_PAD=m_pad, W4A8_SA_LD=align(m_pad, 4),
                   W4A8_TOKEN_TILES=cfg.token_tiles, W4A8_WARPGROUPS=cfg.warpgroups,
                   W4A8_STAGES=cfg.stages, W4A8_MIN_BLOCKS=cfg.min_blocks)
    head = "".join(f"#define {name} {value}\n" for name, value in defines.items())
    return ("#include <cstdint>\n" + head + COMMON_SOURCE.read_text()
            + wgmma_function("wgmma_m64k32", 8 * cfg.token_tiles)
            + KERNEL_SOURCE.read_text())


def wgmma_function(name: str, n: int) -> str:
    """`name`(d, a, desc, accumulate): one m64nNk32 e4m3 MMA into fp32 d[N / 2] (D += / = A . B), A from four
    registers (the W4A8 kernels' widened weights), B from shared memory through its descriptor."""
    d = ", ".join(f"%{i}" for i in range(n // 2))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))
    a_operand, b_index = "{" + ", ".join(f"%{n // 2 + i}" for i in range(4)) + "}", n // 2 + 4
    inputs = '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc)'
    return (f"__device__ __forceinline__ void {name}(float (&d)[{n // 2}], const uint32_t (&a)[4], uint64_t desc, "
            f"bool accumulate) {{\n"
            f"  asm volatile(\"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{b_index + 1}, 0;\\n"
            f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{d}}}, {a_operand}, %{b_index}, p, 1, 1;"
            f"\\n}}\\n\"\n"
            f"      : {outs}\n"
            f"      : {inputs}, \"r\"(int(accumulate)));\n}}\n")


def kernel_name(cfg: W4A8CudaConfig, *, n: int, k: int, m_pad: int = 0, contig: bool = False) -> str:
    layout = "contig" if contig else f"masked_m{m_pad}"
    return (f"w4a8_{layout}_sm90_n{n}_k{k}_t{cfg.token_tiles}wg{cfg.warpgroups}"
            f"s{cfg.stages}b{cfg.min_blocks}")


def grid(cfg: W4A8CudaConfig, *, g: int, m_pad: int, n: int, contig: bool = False) -> tuple[int, int, int]:
    """(weight-row blocks, token blocks, groups; contig: one, the block finds its expert)."""
    gy, gz = ceil_div(m_pad, cfg.block_tokens), 1 if contig else g
    if gy > MAX_GRID_YZ or gz > MAX_GRID_YZ:
        raise ValueError(f"m_pad {m_pad} / {cfg.block_tokens} rows per block = {gy} token blocks and {gz} groups: "
                         f"each must be at most {MAX_GRID_YZ}")
    return ceil_div(n, cfg.block_rows), gy, gz


def plan(cfg: W4A8CudaConfig, cubin: str, *, g: int, m_pad: int, n: int, k: int, contig: bool = False) -> LaunchPlan:
    """Operands 0 lhs, 1 lhs_scale, 2 rhs, 3 rhs_scale, 4 masked_m (contig: m_indices), 5 the output D;
    `tensor_maps` with G slabs of A (contig: one of M_cap = m_pad rows) and a block's tokens and rows."""
    smem = smem_bytes(cfg)
    if smem > MAX_SMEM:
        raise ValueError(f"W4A8CudaConfig(token_tiles={cfg.token_tiles}, warpgroups={cfg.warpgroups}, "
                         f"stages={cfg.stages}): {smem} bytes of shared memory per block, at most {MAX_SMEM}; "
                         f"fewer stages, warp groups or token tiles")
    gx, gy, gz = grid(cfg, g=g, m_pad=m_pad, n=n, contig=contig)
    tmaps = tensor_maps(g=g, slabs=1 if contig else g, m_pad=m_pad, n=n, k=k, block_tokens=cfg.block_tokens,
                        block_rows=cfg.block_rows)
    return LaunchPlan(SYMBOL, cubin, gx, 128 * cfg.warpgroups, 1, smem, KERNEL_ARGS, tmaps, grid_yz=(gy, gz))


# the kernels' arguments: the three tensor maps, then rhs_scale, masked_m / m_indices and D
KERNEL_ARGS = (KernelArg(ARG_TMAP, 0), KernelArg(ARG_TMAP, 1), KernelArg(ARG_TMAP, 2),
               KernelArg(ARG_PTR, 3), KernelArg(ARG_PTR, 4), KernelArg(ARG_PTR, 5))


def tensor_maps(*, g: int, slabs: int, m_pad: int, n: int, k: int, block_tokens: int,
                block_rows: int) -> tuple[TensorMap, ...]:
    """The W4A8 kernels' TMA maps over the whole of each operand (a box past a group's last row reads the
    next group's, one past the tensor zeros): lhs as (slabs * m_pad) rows of K bytes, boxes of
    `block_tokens` x 128 bytes at the 128-byte swizzle; lhs_scale as (slabs * K/128) rows of
    align(m_pad, 4) floats, boxes of `block_tokens`; rhs as (G * N) rows of K/2 bytes, boxes of
    `block_rows` x 64 bytes."""
    sa_ld, kb = align(m_pad, 4), k // 128
    return (TensorMap(0, TMA_UINT8, (k, slabs * m_pad), (k,), (128, block_tokens), 128),
            TensorMap(1, TMA_FLOAT32, (sa_ld, slabs * kb), (4 * sa_ld,), (block_tokens, 1), 0),
            TensorMap(2, TMA_UINT8, (k // 2, g * n), (k // 2,), (64, block_rows), 0))


def w4a8_masked_cuda(lhs: jax.Array, lhs_scale: jax.Array, rhs: jax.Array, rhs_scale: jax.Array,
                     masked_m: jax.Array, *, expected_m: int, config: W4A8CudaConfig | None = None) -> jax.Array:
    """lhs (G, m_pad, K) e4m3, lhs_scale (G, K/128, align(m_pad, 4)) f32, rhs (G, N, K/2) int8,
    rhs_scale (G, N, K/128) int32, masked_m (G,) int32 in [0, m_pad] -> (G, m_pad, N) bf16 (rows >=
    masked_m[g] unwritten). Operands already checked (`m_grouped_gemm_masked`); K a multiple of 128.
    Compiles on first use for sm_90a."""
    from custom_calls.native.compiler import compile_cubin
    from custom_calls.native.launch import launch

    g, m_pad, k = lhs.shape
    n = rhs.shape[1]
    cfg = config or heuristic_config(expected_m)
    cubin = compile_cubin(kernel_name(cfg, n=n, k=k, m_pad=m_pad), source(cfg, n=n, k=k, m_pad=m_pad), 90)
    (d,) = launch(plan(cfg, str(cubin.path), g=g, m_pad=m_pad, n=n, k=k), [lhs, lhs_scale, rhs, rhs_scale, masked_m],
                  [jax.ShapeDtypeStruct((g, m_pad, n), jnp.bfloat16)])
    return d


def w4a8_contig_cuda(lhs: jax.Array, lhs_scale: jax.Array, rhs: jax.Array, rhs_scale: jax.Array,
                     m_indices: jax.Array, *, alignment: int, config: W4A8CudaConfig | None = None) -> jax.Array:
    """lhs (M_cap, K) e4m3, lhs_scale (K/128, align(M_cap, 4)) f32, rhs (G, N, K/2) int8, rhs_scale
    (G, N, K/128) int32, m_indices (M_cap,) int32 in the contig contract (each `alignment` rows one
    expert's rows, then -1) -> (M_cap, N) bf16, padding rows 0. Operands already checked
    (`m_grouped_gemm_contig`); K a multiple of 128. config: `contig_config(alignment)` if None; its
    token tile must divide the alignment. Compiles on first use for sm_90a."""
    from custom_calls.native.compiler import compile_cubin
    from custom_calls.native.launch import launch

    m_cap, k = lhs.shape
    g, n = rhs.shape[:2]
    cfg = config or contig_config(alignment)
    if alignment % cfg.block_tokens:
        raise ValueError(f"config.token_tiles: a contig block's {cfg.block_tokens} rows must divide the alignment "
                         f"{alignment} (one expert per block), got token_tiles={cfg.token_tiles}")
    cubin = compile_cubin(kernel_name(cfg, n=n, k=k, contig=True), source(cfg, n=n, k=k, contig=True), 90)
    (d,) = launch(plan(cfg, str(cubin.path), g=g, m_pad=m_cap, n=n, k=k, contig=True),
                  [lhs, lhs_scale, rhs, rhs_scale, m_indices], [jax.ShapeDtypeStruct((m_cap, n), jnp.bfloat16)])
    return d
