"""The TF32 prenorm GEMM on SM90 (sm90_tf32_hc_prenorm_gemm of the sgl-deep-gemm 0.2.5 templates):
x·fnᵀ in TF32 plus the per-row sum of squares of x, the hyper-connection pre-norm. An SM90 kernel
by nature (no other template computes it), with its own op rather than a GEMM format, so it is not
a row of the family table: its config, source and launch plan are here.
"""

from __future__ import annotations

import dataclasses
import functools

from custom_calls.native.launch_plan import (TMA_BFLOAT16, TMA_FLOAT32, TMA_TFLOAT32, LaunchPlan, TensorMap, _ptr,
                                             _tmap, _u32)
from layouts.checks import align, ceil_div

from .codegen import translation_unit
from .family import SM90_SMEM_CAPACITY, Kernel, swizzle_mode

ARCH = 90
SYMBOL = "sm90_tf32_hc_prenorm_gemm"


@dataclasses.dataclass(frozen=True)
class Sm90PrenormConfig:
    """TF32 GEMM x·fnᵀ with per-row sum of squares (sm90_tf32_hc_prenorm_gemm)."""

    n: int
    k: int
    block_m: int
    block_n: int
    block_k: int
    num_splits: int
    swizzle_cd: int
    num_stages: int
    smem_bytes: int  # the launch asks for the whole capacity; the kernel's storage fits in it
    num_math_threads: int = 128
    num_tma_threads: int = 128

    @property
    def num_threads(self) -> int:
        return self.num_math_threads + self.num_tma_threads

    def grid(self, m: int) -> int:
        return self.num_splits * ceil_div(m, self.block_m)


def sm90_prenorm_config(n: int, k: int, num_splits: int = 1) -> Sm90PrenormConfig:
    """The instantiation for fn (n, k) split ``num_splits`` ways along K (ValueError naming the
    argument when the kernel cannot serve it)."""
    if not (0 < n <= 32 and n % 8 == 0):
        raise ValueError(f"prenorm GEMM needs 0 < n <= 32 and n % 8 == 0, got n={n}")
    if k <= 0 or k % 64:
        raise ValueError(f"prenorm GEMM needs k a positive multiple of 64, got k={k}")
    if num_splits < 1 or ceil_div(k, 64) < num_splits:
        raise ValueError(f"num_splits must be in [1, k/64], got {num_splits}")
    bm, bk = 64, 64
    bn = align(n, 16)
    swz = swizzle_mode(bn * 4)
    stages = 0
    for s in range(12, 0, -1):
        if s * (bm * bk * 2 + bn * bk * 4) + bm * swz + 16 * s <= SM90_SMEM_CAPACITY:
            stages = s
            break
    return Sm90PrenormConfig(n=n, k=k, block_m=bm, block_n=bn, block_k=bk, num_splits=num_splits,
                             swizzle_cd=swz, num_stages=stages, smem_bytes=SM90_SMEM_CAPACITY)


def sm90_prenorm_source(cfg: Sm90PrenormConfig) -> str:
    params = [str(cfg.n), str(cfg.k), str(cfg.block_m), str(cfg.block_n), str(cfg.block_k),
              str(cfg.num_splits), str(cfg.swizzle_cd), str(cfg.num_stages),
              str(cfg.num_math_threads), str(cfg.num_tma_threads)]
    return translation_unit("sm90_tf32_hc_prenorm_gemm.cuh", "sm90_tf32_hc_prenorm_gemm_impl", params)


def sm90_prenorm_plan(cfg: Sm90PrenormConfig, cubin: str, *, m: int) -> LaunchPlan:
    """TF32 prenorm. Operands: 0 x bf16 (M,K), 1 fn f32 (N,K); outputs 2 D f32 (S,M,N), 3 sqr_sum f32 (S,M)."""
    n, k, s = cfg.n, cfg.k, cfg.num_splits
    if s == 1:
        d = TensorMap(2, TMA_FLOAT32, (n, m), (n * 4,), (cfg.block_n, cfg.block_m), cfg.swizzle_cd)
    else:
        d = TensorMap(2, TMA_FLOAT32, (n, m, s), (n * 4, m * n * 4), (cfg.block_n, cfg.block_m, 1), cfg.swizzle_cd)
    tmaps = (
        TensorMap(0, TMA_BFLOAT16, (k, m), (k * 2,), (cfg.block_k, cfg.block_m), 128),
        TensorMap(1, TMA_TFLOAT32, (k, n), (k * 4,), (32, cfg.block_n), 128),
        d,
    )
    args = (_u32(m), _tmap(0), _tmap(1), _tmap(2), _ptr(3))
    return LaunchPlan(SYMBOL, cubin, cfg.grid(m), cfg.num_threads, 1, cfg.smem_bytes, args, tmaps)


def prenorm_kernel(m: int, n: int, k: int, num_splits: int) -> Kernel:
    """(name, source, plan_fn) for x: (m, k) bf16, fn: (n, k) f32, K split ``num_splits`` ways."""
    cfg = sm90_prenorm_config(n, k, num_splits)
    plan_fn = functools.partial(sm90_prenorm_plan, cfg, m=m)
    return f"sm90_tf32_prenorm_n{n}_k{k}_s{num_splits}", sm90_prenorm_source(cfg), plan_fn
