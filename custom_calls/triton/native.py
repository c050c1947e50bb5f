"""Triton kernels as launch plans of the native launcher (`custom_calls.native.launch`).

jax_triton runs one Triton kernel per custom call and never launches programmatically, so a short
chain of kernels pays a launch gap before each. Here a kernel is compiled to a cubin for the
device's arch (`triton.compile`, the options jax_triton uses) and described as a `LaunchPlan`, so
that it can run in one custom call with the kernels beside it, launched with programmatic dependent
launch where it waits (griddepcontrol.wait) before it reads what the kernel before it wrote.

Every kernel of this package takes its sizes as `tl.constexpr`, so a compiled kernel's parameters
are its array pointers in order, then Triton's global and profile scratch pointers, which must be
unused (null). Cubins (with their PTX beside them) are cached on disk beside the DeepGEMM kernels
(`custom_calls.native.toolchain.cached_artifact`), keyed by the kernel's source hash, the
signature, the constexprs, the options, the arch and the Triton version.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import tempfile
from typing import Any, Sequence

import jax.numpy as jnp

from custom_calls.native import launch_plan as LP
from custom_calls.native import toolchain
from custom_calls.triton.launch import KernelCall

# jax dtype -> Triton pointer type (the ones this package's kernels take)
POINTER_TYPES = {jnp.dtype(jnp.bfloat16): "*bf16", jnp.dtype(jnp.float16): "*fp16",
                 jnp.dtype(jnp.float32): "*fp32", jnp.dtype(jnp.int32): "*i32", jnp.dtype(jnp.int64): "*i64",
                 jnp.dtype(jnp.uint8): "*u8", jnp.dtype(jnp.uint32): "*u32",
                 jnp.dtype(jnp.float8_e4m3fn): "*fp8e4nv"}
CUBIN, PTX = "kernel.cubin", "kernel.ptx"


@dataclasses.dataclass(frozen=True)
class TritonCubin:
    """A compiled kernel: its cubin, the kernel symbol, warps and dynamic shared memory (bytes)."""

    path: str
    name: str
    num_warps: int
    shared: int


def pointer_types(dtypes: Sequence[Any]) -> tuple[str, ...]:
    """Triton's pointer type for each operand dtype; ValueError naming the unsupported one."""
    out = []
    for i, dt in enumerate(dtypes):
        t = POINTER_TYPES.get(jnp.dtype(dt))
        if t is None:
            raise ValueError(f"operand {i}: expected a dtype in {sorted(str(d) for d in POINTER_TYPES)}, "
                             f"got {jnp.dtype(dt).name}")
        out.append(t)
    return tuple(out)


def _key(kernel, pointers: tuple[str, ...], constexprs: tuple, options: tuple, arch: int) -> str:
    import triton

    h = hashlib.sha256(repr((kernel.cache_key, pointers, constexprs, options, arch, triton.__version__)).encode())
    return h.hexdigest()[:32]


def _options(num_warps: int, num_stages: int) -> tuple:
    """triton.compile's options, as jax_triton passes them."""
    return (("num_warps", num_warps), ("num_stages", num_stages), ("num_ctas", 1), ("enable_fp_fusion", True))


def compile_triton(kernel, pointers: dict[str, str], constexprs: dict, *, num_warps: int, num_stages: int,
                   arch: int):
    """``kernel`` compiled by `triton.compile` for SM ``arch`` (Triton's CompiledKernel: asm["ptx"],
    asm["cubin"], metadata): ``pointers`` {parameter name: Triton pointer type}, each 16-byte
    aligned (XLA's buffers are; jax_triton tells Triton the same), ``constexprs`` {name: value}."""
    import triton
    from triton.backends.compiler import GPUTarget

    signature = dict(pointers)
    signature.update({k: "constexpr" for k in constexprs})
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in pointers}
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    # triton.compile needs a cache directory, and importing jax_triton empties $TRITON_CACHE_DIR
    with tempfile.TemporaryDirectory() as triton_cache, triton.knobs.cache.scope():
        triton.knobs.cache.dir = triton_cache
        return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options=dict(_options(num_warps, num_stages)))


@functools.cache
def _compile(kernel, pointers: tuple[str, ...], constexprs: tuple, num_warps: int, num_stages: int,
             arch: int) -> TritonCubin:
    names = kernel.arg_names
    consts = dict(constexprs)
    if len(pointers) > len(names):
        raise ValueError(f"{kernel.__name__}: expected at most {len(names)} array operands, got {len(pointers)}")
    rest = names[len(pointers):]  # every parameter after the array operands is a constexpr
    if set(rest) != set(consts):
        raise ValueError(f"{kernel.__name__}: expected a value for each parameter after its {len(pointers)} array "
                         f"operands, {list(rest)}; missing {sorted(set(rest) - set(consts))}, not parameters there "
                         f"{sorted(set(consts) - set(rest))}")

    def build(out_dir) -> dict:
        compiled = compile_triton(kernel, dict(zip(names, pointers)), consts, num_warps=num_warps,
                                  num_stages=num_stages, arch=arch)
        md = compiled.metadata
        unused = {"global_scratch_size": md.global_scratch_size, "profile_scratch_size": md.profile_scratch_size}
        if any(unused.values()) or md.num_ctas != 1:
            raise ValueError(f"{kernel.__name__}: expected no scratch memory and one CTA per cluster for a "
                             f"native launch, got {unused}, num_ctas={md.num_ctas}")
        (out_dir / CUBIN).write_bytes(compiled.asm["cubin"])
        (out_dir / PTX).write_text(compiled.asm["ptx"])  # beside it, for inspection
        return {"name": md.name, "num_warps": md.num_warps, "shared": md.shared, "arch": arch}

    key = _key(kernel, pointers, constexprs, _options(num_warps, num_stages), arch)
    path, _ = toolchain.cached_artifact("triton", kernel.__name__, key, CUBIN, build)
    meta = json.loads((path.parent / toolchain.MANIFEST).read_text())
    return TritonCubin(str(path), meta["name"], int(meta["num_warps"]), int(meta["shared"]))


def compile_kernel(kernel, *, dtypes: Sequence[Any], num_warps: int, num_stages: int = 1, arch: int,
                   **constexprs: Any) -> TritonCubin:
    """The cubin of ``kernel`` (a `triton.jit` function whose parameters are array pointers, then
    constexprs) for operands of ``dtypes`` (inputs then outputs, as `triton_call` passes them), for
    SM ``arch`` (90: sm_90a)."""
    return _compile(kernel, pointer_types(dtypes), tuple(sorted(constexprs.items())), int(num_warps),
                    int(num_stages), int(arch))


def kernel_plan_for(call: KernelCall, *, arch: int, operands: tuple[int, ...],
                    programmatic: bool = False) -> LP.LaunchPlan:
    """``call`` compiled for SM ``arch`` as a plan whose pointers are the custom call's operands
    ``operands`` (one per array operand of ``call``, then one per output)."""
    dtypes = [a.dtype for a in call.operands] + [o.dtype for o in call.out_shape]
    if len(operands) != len(dtypes):
        raise ValueError(f"{call.name}: expected {len(dtypes)} operand places, got {len(operands)}")
    cubin = compile_kernel(call.kernel, dtypes=dtypes, num_warps=call.num_warps, num_stages=call.num_stages,
                           arch=arch, **call.constexprs)
    return kernel_plan(cubin, grid=call.grid, num_operands=len(dtypes), programmatic=programmatic).remap(operands)


def kernel_plan(cubin: TritonCubin, *, grid: tuple[int, ...], num_operands: int,
                programmatic: bool = False) -> LP.LaunchPlan:
    """The launch of a compiled kernel on ``grid`` (1 to 3 extents) with operands 0..num_operands-1
    as its pointers (`LaunchPlan.remap` places them in a call). ``programmatic``: the kernel may
    start while the kernel before it runs; only for kernels that wait before they read its output."""
    if not 1 <= len(grid) <= 3 or any(g <= 0 for g in grid):
        raise ValueError(f"grid: expected 1 to 3 positive extents, got {grid}")
    gx, gy, gz = (*grid, 1, 1)[:3]
    args = tuple(LP.KernelArg(LP.ARG_PTR, i) for i in range(num_operands)) + (LP.NULL, LP.NULL)
    return LP.LaunchPlan(cubin.name, cubin.path, gx, 32 * cubin.num_warps, 1, cubin.shared, args, (),
                         programmatic=programmatic, grid_yz=(gy, gz))
