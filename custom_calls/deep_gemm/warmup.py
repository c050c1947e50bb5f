"""Compile DeepGEMM kernels ahead of time for a list of shapes.

Kernels land in the on-disk cache (compiler.py), so a later process — or another local rank running
the same warm-up concurrently — compiles nothing. ``arch`` and ``num_sms`` default to the detected
device; pass them to precompile on a machine without one (nvcc is enough).

``tuning`` (default: ``KernelSettings.gemm_tuning``, see autotune.py) picks the SM90 grouped GEMMs' configs:
with mode "cached" the tuned ones found on disk. Tuning the shapes that have none first is the
benchmarks' (``moe_jax.bench.autotune_search.warmup_tuned``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Iterable, Literal

from custom_calls.settings import KernelSettings, resolve_settings
from layouts import SUPPORTED_ARCHS

from custom_calls.native import compiler

from . import autotune
from .ops import dense_kernel, detected_device, grouped_kernel
from .sm90_prenorm import ARCH as PRENORM_ARCH, prenorm_kernel


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """One GEMM call to compile for. rows: M_cap (contig), m_pad (masked) or M (dense, prenorm)."""

    kind: Literal["contig", "masked", "dense", "prenorm"]
    rows: int
    n: int
    k: int
    num_groups: int = 1
    recipe: str = "fp8_block"  # grouped/dense: bf16 | fp8_block (| mxfp8 | mxfp4 on arch 100)
    expected_m: int | None = None  # masked only
    out_dtype: str = "bf16"  # dense bf16 only: bf16 | f32
    num_splits: int = 1  # prenorm only


def kernel_for(shape: GemmShape, arch: int, num_sms: int,
               tuning: autotune.TuningPolicy | None = None) -> tuple[str, str]:
    """(name, source) of the instantiation the op would use for ``shape`` on ``arch`` under ``tuning``
    (prenorm shapes: the SM90 kernel whatever ``arch`` says; ValueError if it is not 90)."""
    if shape.kind in ("contig", "masked"):
        name, src, _ = grouped_kernel(shape.kind, shape.rows, shape.n, shape.k, shape.num_groups,
                                      shape.recipe, arch, num_sms, expected_m=shape.expected_m, tuning=tuning)
    elif shape.kind == "dense":
        import jax.numpy as jnp
        name, src, _ = dense_kernel(shape.rows, shape.n, shape.k, shape.recipe, arch,
                                    jnp.float32 if shape.out_dtype == "f32" else jnp.bfloat16, num_sms)
    elif shape.kind == "prenorm":
        if arch != PRENORM_ARCH:
            raise ValueError(f"arch: the prenorm GEMM is an arch {PRENORM_ARCH} kernel, got {arch}")
        name, src, _ = prenorm_kernel(shape.rows, shape.n, shape.k, shape.num_splits)
    else:
        raise ValueError(f"shape.kind must be contig, masked, dense or prenorm, got {shape.kind!r}")
    return name, src


def _target(arch: int | None, num_sms: int | None) -> tuple[int, int]:
    """(arch, num_sms) to compile for: the arguments, the detected device's where None."""
    if arch is not None and num_sms is not None:
        return arch, num_sms
    _, det_arch, det_sms = detected_device()
    if arch is None:
        if det_arch is None:
            raise ValueError(f"arch: no CUDA device detected; pass one of {SUPPORTED_ARCHS} explicitly")
        # the family of the device (an SM 9.x device runs the arch 90 kernels)
        arch = next((a for a in SUPPORTED_ARCHS if a // 10 == det_arch // 10), det_arch)
    if num_sms is None:
        if det_sms is None:
            raise ValueError("num_sms: no CUDA device detected; pass the target's SM count (H200: 132)")
        num_sms = det_sms
    return arch, num_sms


def warmup(shapes: Iterable[GemmShape], *, arch: int | None = None, num_sms: int | None = None,
           workers: int | None = None, progress: bool = True,
           tuning: autotune.TuningPolicy | None = None,
           settings: KernelSettings | None = None) -> list[compiler.Cubin]:
    """Compile (or find in the cache) the kernel of every shape; returns one Cubin per distinct kernel.

    A ``Cubin.compiled`` flag says whether this call ran nvcc. Progress bar via tqdm when installed.
    tuning: see the module docstring (None: ``TuningPolicy(mode=settings.gemm_tuning)``). settings:
    as the ops take it (None: the environment's defaults); its num_sms is the default of ``num_sms``.
    """
    shapes = list(shapes)
    settings = resolve_settings(settings)
    arch, num_sms = _target(arch, num_sms or settings.num_sms)
    tuning = autotune.TuningPolicy(mode=settings.gemm_tuning) if tuning is None else tuning
    jobs: dict[str, tuple[str, str]] = {}
    for s in shapes:
        name, src = kernel_for(s, arch, num_sms, tuning)
        jobs.setdefault(compiler.cache_key(src, arch), (name, src))
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(jobs), desc="deep_gemm kernels", unit="kernel")
        except ImportError:
            bar = None
    results = []
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futs = [pool.submit(compiler.compile_cubin, name, src, arch) for name, src in jobs.values()]
        for f in concurrent.futures.as_completed(futs):
            results.append(f.result())
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return results
