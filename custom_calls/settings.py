"""Kernel settings: what the accelerated backends do that the operands do not say.

`KernelSettings` is frozen and hashable. The ops that launch native kernels take it as a static
keyword (`settings=`), `moe_forward` and `nn.MoE` pass theirs down, so a changed setting is a
different static argument and jit compiles a new program. `settings=None` means
`KernelSettings.from_environment()`, read when the call is traced: a function already compiled
keeps the settings it was traced with, so pass a `KernelSettings` to change one for it.

The environment only gives defaults, and this module is where the library reads it (`ENVIRONMENT`
is the one table of variables; the README prints the same rows). The toolchain's locations
(`ToolchainLocations`) are read here too; they say where compilers and caches are, not what a
compiled program does, so they are not part of `KernelSettings`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal, Mapping

GEMM_TUNING_MODES = ("off", "cached")
W4A8_PREFILL_MODES = ("auto", "kernel", "expand")


@dataclasses.dataclass(frozen=True)
class EnvironmentVariable:
    name: str
    setting: str  # the field it defaults (KernelSettings.* or ToolchainLocations.*)
    effect: str


ENVIRONMENT = (
    EnvironmentVariable("MOE_JAX_GEMM_TUNING", "KernelSettings.gemm_tuning",
                        "`off` (default): DeepGEMM's heuristic picks the grouped SM90 GEMM configs; `cached`: "
                        "configs tuned on the device (`python -m moe_jax.bench.tune`) where the cache holds one"),
    EnvironmentVariable("MOE_JAX_DEEP_GEMM_COMMAND_BUFFER", "KernelSettings.command_buffer",
                        "`1` lets XLA capture the native launcher's custom calls in its command buffers (CUDA "
                        "graphs); default `0`"),
    EnvironmentVariable("MOE_JAX_DEEP_GEMM_SM100", "KernelSettings.allow_unverified_sm100",
                        "`1` allows the SM100 DeepGEMM kernels, compiled but never run by this project, on an "
                        "SM100 device; default `0`"),
    EnvironmentVariable("MOE_JAX_W4A8_PREFILL", "KernelSettings.w4a8_prefill",
                        "how the W4A8 (mxfp4 on SM90) contig GEMMs run: `kernel`, the 4-bit weights widened inside "
                        "the GEMM; `expand`, widened to a temporary FP8 copy, then DeepGEMM's FP8 GEMM; `auto` "
                        "(default): `expand` where the contig capacity holds enough rows per expert "
                        "(`custom_calls.w4a8_backend.EXPAND_MIN_ROWS_PER_EXPERT`)"),
    EnvironmentVariable("MOE_JAX_NUM_SMS", "KernelSettings.num_sms",
                        "SM count the DeepGEMM kernels are planned for (default: the device's)"),
    EnvironmentVariable("MOE_JAX_CACHE_DIR", "ToolchainLocations.cache_dir",
                        "on-disk cache of compiled kernels, tuned configs and the FFI launcher (default "
                        "`~/.cache/moe_jax/deep_gemm`); each entry is checked against its recorded size and sha256 "
                        "before use and rebuilt if it does not match; needs room for nvcc's temporary files"),
    EnvironmentVariable("MOE_JAX_NVCC", "ToolchainLocations.nvcc",
                        "the nvcc to use, >= 12.9 (an error if it is not an executable or older; default: the first "
                        "new enough one in `$CUDA_HOME/bin`, `$CUDA_PATH/bin`, `/usr/local/cuda/bin`, then `PATH`)"),
    EnvironmentVariable("MOE_JAX_CXX", "ToolchainLocations.cxx",
                        "the C++ compiler for the FFI launcher (default `/usr/bin/g++`, then `g++` on `PATH`)"),
)
_BOOL = {"0": False, "1": True}


def _variable(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    return value if value else None  # set but empty = unset


def _bool_variable(environ: Mapping[str, str], name: str) -> bool:
    value = _variable(environ, name) or "0"
    if value not in _BOOL:
        raise ValueError(f"${name}: expected '0' or '1', got {value!r}")
    return _BOOL[value]


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    """How the native kernels are chosen and launched (static; part of what jit compiles).

    gemm_tuning: "off" -> DeepGEMM's heuristic config for every GEMM; "cached" -> the grouped SM90
      GEMMs use a config tuned on the device where the tuned-config cache holds one for the shape
      (`custom_calls/deep_gemm/autotune.py`), else the heuristic.
    command_buffer: let XLA record the native launcher's calls into command buffers (CUDA graphs).
    allow_unverified_sm100: run the SM100 DeepGEMM kernels on an SM100 device (compiled and
      unit-tested here, never run by this project).
    num_sms: the SM count the kernels are planned for (persistent grids); None -> the device's.
    w4a8_prefill: the W4A8 contig GEMMs (`custom_calls.w4a8_backend`): "kernel" widens the 4-bit
      weights inside the GEMM; "expand" widens them to a temporary FP8 copy (G x N x K bytes) and runs
      DeepGEMM's FP8 GEMM on it; "auto" expands where the contig capacity has at least
      `EXPAND_MIN_ROWS_PER_EXPERT` rows per expert (the tensor core, not the weights, bounds the GEMM).
    """

    gemm_tuning: Literal["off", "cached"] = "off"
    command_buffer: bool = False
    allow_unverified_sm100: bool = False
    num_sms: int | None = None
    w4a8_prefill: Literal["auto", "kernel", "expand"] = "auto"

    def __post_init__(self) -> None:
        if self.gemm_tuning not in GEMM_TUNING_MODES:
            raise ValueError(f"KernelSettings.gemm_tuning: expected one of {GEMM_TUNING_MODES}, "
                             f"got {self.gemm_tuning!r}")
        for name in ("command_buffer", "allow_unverified_sm100"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"KernelSettings.{name}: expected a bool, got {getattr(self, name)!r}")
        if self.num_sms is not None and (isinstance(self.num_sms, bool) or not isinstance(self.num_sms, int)
                                         or self.num_sms < 1):
            raise ValueError(f"KernelSettings.num_sms: expected None or an int >= 1, got {self.num_sms!r}")
        if self.w4a8_prefill not in W4A8_PREFILL_MODES:
            raise ValueError(f"KernelSettings.w4a8_prefill: expected one of {W4A8_PREFILL_MODES}, "
                             f"got {self.w4a8_prefill!r}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> "KernelSettings":
        """The defaults `ENVIRONMENT` documents; ValueError naming the variable for a bad value."""
        environ = os.environ if environ is None else environ
        tuning = _variable(environ, "MOE_JAX_GEMM_TUNING") or "off"
        if tuning not in GEMM_TUNING_MODES:
            raise ValueError(f"$MOE_JAX_GEMM_TUNING: expected one of {GEMM_TUNING_MODES}, got {tuning!r}"
                             + (" (searching is `python -m moe_jax.bench.tune`)" if tuning == "search" else ""))
        sms = _variable(environ, "MOE_JAX_NUM_SMS")
        if sms is not None and not (sms.isdigit() and int(sms) >= 1):
            raise ValueError(f"$MOE_JAX_NUM_SMS: expected a positive integer, got {sms!r}")
        prefill = _variable(environ, "MOE_JAX_W4A8_PREFILL") or "auto"
        if prefill not in W4A8_PREFILL_MODES:
            raise ValueError(f"$MOE_JAX_W4A8_PREFILL: expected one of {W4A8_PREFILL_MODES}, got {prefill!r}")
        return cls(gemm_tuning=tuning, command_buffer=_bool_variable(environ, "MOE_JAX_DEEP_GEMM_COMMAND_BUFFER"),
                   allow_unverified_sm100=_bool_variable(environ, "MOE_JAX_DEEP_GEMM_SM100"),
                   num_sms=int(sms) if sms is not None else None, w4a8_prefill=prefill)


def resolve_settings(settings: KernelSettings | None) -> KernelSettings:
    """`settings`, or the environment's defaults for None; TypeError for anything else."""
    if settings is None:
        return KernelSettings.from_environment()
    if not isinstance(settings, KernelSettings):
        raise TypeError(f"settings: expected a custom_calls.KernelSettings or None, got {type(settings).__name__}")
    return settings


@dataclasses.dataclass(frozen=True)
class ToolchainLocations:
    """Where the compilers and the kernel cache are (read when a kernel is built).

    nvcc: an explicit nvcc (used exclusively), else None and `cuda_homes` are searched first.
    cuda_homes: $CUDA_HOME, $CUDA_PATH where set. cxx: the launcher's C++ compiler, or None.
    cache_dir: the kernel cache's root, or None for the default.
    """

    nvcc: str | None = None
    cuda_homes: tuple[Path, ...] = ()
    cxx: str | None = None
    cache_dir: str | None = None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> "ToolchainLocations":
        environ = os.environ if environ is None else environ
        homes = tuple(Path(v) for v in (_variable(environ, "CUDA_HOME"), _variable(environ, "CUDA_PATH")) if v)
        return cls(nvcc=_variable(environ, "MOE_JAX_NVCC"), cuda_homes=homes, cxx=_variable(environ, "MOE_JAX_CXX"),
                   cache_dir=_variable(environ, "MOE_JAX_CACHE_DIR"))
