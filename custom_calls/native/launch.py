"""The XLA custom call that runs a launch plan, or a few in order (C++ FFI handler, built on first use).

The handler (``csrc/launch_handler.cc``) is compiled with the system g++ (``/usr/bin/g++`` first: a
compiler that links libstdc++ statically produced a library that crashed beside the system one) into
the same on-disk cache as the kernels (``toolchain.cached_artifact``: built once across processes,
verified against its recorded size and sha256 before it is loaded), keyed by its source, the jax
version, the FFI headers and the compiler, and registered with XLA for the CUDA platform once per
process.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp

from custom_calls.settings import ToolchainLocations

from . import toolchain
from .launch_plan import LaunchPlan, sequence_attributes

FFI_TARGET = "moe_jax_deep_gemm_launch"
FFI_TARGET_CMD_BUFFER = "moe_jax_deep_gemm_launch_cmd_buffer"  # same launch, XLA may capture it in a CUDA graph
HANDLER_SOURCE = Path(__file__).parent / "csrc" / "launch_handler.cc"  # package data of the wheel
LIBRARY_NAME = "libmoe_jax_deep_gemm.so"
_lock = threading.Lock()
_registered = False
_cmd_buffer_error: str | None = None  # why FFI_TARGET_CMD_BUFFER could not be registered


def find_cxx() -> str:
    """$MOE_JAX_CXX, else /usr/bin/g++, else g++ on PATH."""
    for c in (ToolchainLocations.from_environment().cxx, "/usr/bin/g++", shutil.which("g++")):
        if c and Path(c).is_file():
            return c
    raise toolchain.ToolchainError("no C++ compiler for the FFI launcher (set MOE_JAX_CXX or install g++)")


def _handler_key(cxx: str, cuda_inc: Path) -> str:
    h = hashlib.sha256()
    ffi_dir = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api"
    parts = [HANDLER_SOURCE.read_bytes(), jax.__version__.encode(),
             subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.encode(),
             (cuda_inc / "cuda.h").read_bytes()[:4096]]
    parts += [p.read_bytes() for p in sorted(ffi_dir.glob("*.h"))]
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()[:32]


def build_handler() -> Path:
    """Compile (or find in the cache) the launcher shared library; returns its path."""
    if not HANDLER_SOURCE.is_file():
        raise toolchain.ToolchainError(f"the FFI launcher source {HANDLER_SOURCE} is missing from the "
                                       f"installed package: reinstall moe-jax")
    cxx = find_cxx()
    cuda_inc = toolchain.cuda_include_dir(toolchain.find_nvcc())
    key = _handler_key(cxx, cuda_inc)

    def build(out_dir: Path) -> dict:
        cmd = [cxx, "-shared", "-fPIC", "-O2", "-std=c++17", "-w", f"-I{jax.ffi.include_dir()}",
               f"-I{cuda_inc}", str(HANDLER_SOURCE), "-o", str(out_dir / LIBRARY_NAME), "-ldl"]
        toolchain.run_compiler(cmd, "building the FFI launcher", out_dir)
        return {"cxx": cxx, "jax": jax.__version__}

    return toolchain.cached_artifact("ffi", "launch_handler", key, LIBRARY_NAME, build)[0]


def register() -> None:
    """Build and register the launcher with XLA (CUDA platform), once per process."""
    global _registered, _cmd_buffer_error
    with _lock:
        if _registered:
            return
        lib = ctypes.cdll.LoadLibrary(str(build_handler()))
        jax.ffi.register_ffi_target(FFI_TARGET, jax.ffi.pycapsule(lib.MoeJaxDeepGemmLaunch), platform="CUDA")
        try:  # XLA takes a Python-registered target's traits from this argument
            from jaxlib.xla_client import CustomCallTargetTraits
            jax.ffi.register_ffi_target(FFI_TARGET_CMD_BUFFER, jax.ffi.pycapsule(lib.MoeJaxDeepGemmLaunchCmdBuffer),
                                        platform="CUDA", traits=CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE)
        except (ImportError, AttributeError, TypeError) as e:
            _cmd_buffer_error = f"this jaxlib cannot register command-buffer-compatible FFI targets: {e}"
        _registered = True


def launch(plan: LaunchPlan | Sequence[LaunchPlan], inputs: Sequence[jax.Array],
           outputs: Sequence[jax.ShapeDtypeStruct], input_output_aliases: dict[int, int] | None = None,
           *, command_buffer: bool = False) -> list[jax.Array]:
    """Run ``plan`` as a custom call; operands are ``inputs`` then ``outputs`` (fresh XLA buffers,
    or an input's buffer where ``input_output_aliases`` {input index: output index} says so: the
    kernel then updates that input in place). A sequence of plans runs in order in the one call,
    all on its operands (`LaunchPlan.remap` places each plan's operands): nothing XLA schedules can
    run between them, and a plan launched programmatically overlaps only the plan before it.

    Raises ValueError at trace time when a tensor map of a plan spans more than its operand.

    Without ``command_buffer`` (`KernelSettings.command_buffer`) the target has no command-buffer
    trait, so XLA calls the handler on every execution (measured cost: ~3-5 µs per launch); with it
    XLA may record the launch into a CUDA graph and re-record it when a buffer address changes
    (csrc/launch_handler.cc says why that is safe). Either way the TMA descriptors hold the
    buffers' current addresses.
    """
    plans = (plan,) if isinstance(plan, LaunchPlan) else tuple(plan)
    nbytes = tuple(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in (*inputs, *outputs))
    for p in plans:
        p.check_operands(nbytes)
    attributes = sequence_attributes(plans)
    register()
    if command_buffer and _cmd_buffer_error:
        raise RuntimeError(f"{_cmd_buffer_error} (pass KernelSettings(command_buffer=False); the default comes "
                           "from $MOE_JAX_DEEP_GEMM_COMMAND_BUFFER)")
    call = jax.ffi.ffi_call(FFI_TARGET_CMD_BUFFER if command_buffer else FFI_TARGET, list(outputs),
                            has_side_effect=False, input_output_aliases=input_output_aliases)
    return list(call(*inputs, **attributes))
