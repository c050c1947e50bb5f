"""Where the kernel sources, the CUDA compiler and the on-disk cache live.

Nothing here imports the ``deep_gemm`` package (its torch extension cannot load beside our jax/torch
versions): the wheel is only a folder of CUDA templates, found through its import spec.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

# The kernels' template parameter lists differ between DeepGEMM releases; the code generator is
# written against this one.
SGL_DEEP_GEMM_VERSION = "0.2.5"


class ToolchainError(RuntimeError):
    """A required build tool or source package is missing."""


@functools.cache
def deep_gemm_include_dir() -> Path:
    """The ``include/`` folder of the installed sgl-deep-gemm wheel (holds deep_gemm/, cute/, cutlass/)."""
    spec = importlib.util.find_spec("deep_gemm")
    if spec is None or not spec.submodule_search_locations:
        raise ToolchainError(
            "sgl-deep-gemm is not installed: the DeepGEMM kernels need its CUDA templates "
            f"(pip install sgl-deep-gemm=={SGL_DEEP_GEMM_VERSION}, the 'gpu' extra)")
    pkg = Path(list(spec.submodule_search_locations)[0])
    inc = pkg / "include"
    if not (inc / "deep_gemm").is_dir():
        raise ToolchainError(f"sgl-deep-gemm at {pkg} has no include/deep_gemm folder")
    version_file = pkg / "VERSION"
    if version_file.is_file():
        found = version_file.read_text().strip()
        if not found.startswith(SGL_DEEP_GEMM_VERSION):
            raise ToolchainError(
                f"sgl-deep-gemm {found} found at {pkg}; the code generator targets {SGL_DEEP_GEMM_VERSION}")
    return inc


def find_nvcc() -> Path:
    """nvcc from $MOE_JAX_NVCC (exclusively, when set), else $CUDA_HOME/bin, /usr/local/cuda/bin or PATH."""
    explicit = os.environ.get("MOE_JAX_NVCC")
    if explicit:
        # An explicit choice is never silently replaced by another compiler.
        if Path(explicit).is_file() and os.access(explicit, os.X_OK):
            return Path(explicit)
        raise ToolchainError(f"no CUDA compiler: MOE_JAX_NVCC={explicit} is not an executable file")
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "bin" / "nvcc")
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    which = shutil.which("nvcc")
    if which:
        candidates.append(Path(which))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise ToolchainError(
        "no CUDA compiler: nvcc not found in $MOE_JAX_NVCC, $CUDA_HOME/bin, /usr/local/cuda/bin or PATH "
        "(the DeepGEMM kernels are compiled on first use)")


@functools.cache
def nvcc_version(nvcc: str) -> str:
    """Full ``nvcc --version`` text (part of every cache key)."""
    return subprocess.run([nvcc, "--version"], check=True, capture_output=True, text=True).stdout


def cuda_include_dir(nvcc: Path) -> Path:
    """The toolkit's include folder (holds cuda.h), next to nvcc."""
    inc = nvcc.resolve().parent.parent / "include"
    if not (inc / "cuda.h").is_file():
        for alt in (Path("/usr/local/cuda/include"),):
            if (alt / "cuda.h").is_file():
                return alt
        raise ToolchainError(f"cuda.h not found next to {nvcc} ({inc})")
    return inc


def cache_root() -> Path:
    """$MOE_JAX_CACHE_DIR, else ~/.cache/moe_jax/deep_gemm."""
    env = os.environ.get("MOE_JAX_CACHE_DIR")
    root = Path(env) if env else Path.home() / ".cache" / "moe_jax" / "deep_gemm"
    return root
