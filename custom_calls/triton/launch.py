"""Calling a Triton kernel from JAX: `jax_triton.triton_call`, imported only here, at call time.

`import jax_triton` raises ImportError on a CPU-only jax, so nothing imports it at module load.
Under Triton's interpreter (TRITON_INTERPRET=1) the kernels run on the host instead
(`custom_calls.triton.interpret`), without jax_triton.
Every kernel of this package takes its sizes as `tl.constexpr` (shapes are static under jit),
so each distinct shape compiles once and is cached by jax_triton.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Sequence

import jax


def missing_dependencies() -> list[str]:
    """Python packages the Triton backend needs that are not importable (no import is done)."""
    return [name for name in ("triton", "jax_triton") if importlib.util.find_spec(name) is None]


def triton_call(*args: jax.Array, kernel: Any, out_shape: Sequence[jax.ShapeDtypeStruct],
                grid: tuple[int, ...], num_warps: int = 4, num_stages: int = 1, name: str = "",
                zeroed_outputs: Sequence[int] = (), **constexprs: Any) -> list[jax.Array]:
    """Launch `kernel` on `grid` with array inputs `args` then outputs `out_shape` as pointers,
    followed by `constexprs` (all compile-time constants). The outputs listed in `zeroed_outputs`
    (indices into `out_shape`) are zero-filled before the launch. num_stages: Triton's software
    pipelining depth of the kernel's loops (1: none; the interpreter ignores it). Returns the outputs
    as a list."""
    if any(g == 0 for g in grid):
        raise ValueError(f"grid: expected every dimension > 0, got {grid}")
    from custom_calls.triton.interpret import interpreting, triton_call_interpreted

    if interpreting():
        return triton_call_interpreted(*args, kernel=kernel, out_shape=out_shape, grid=grid,
                                       zeroed_outputs=zeroed_outputs, **constexprs)
    try:
        import jax_triton
    except ImportError as exc:
        raise ValueError(f"backend 'triton': jax_triton cannot be imported here ({exc}); it needs a "
                         f"CUDA build of jax and `pip install jax-triton==0.3.1`") from exc
    outs = jax_triton.triton_call(*args, kernel=kernel, out_shape=list(out_shape), grid=grid,
                                  num_warps=num_warps, num_stages=num_stages, name=name,
                                  zeroed_outputs=tuple(zeroed_outputs), **constexprs)
    return list(outs)


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One launch of a Triton kernel, described before it runs: ``operands`` (arrays) then the
    outputs ``out_shape`` are its pointers, ``constexprs`` the rest of its parameters. `run` goes
    through `triton_call`; `custom_calls.triton.native.kernel_plan_for` makes it a launch plan of
    the native launcher instead (there an operand may be a `jax.ShapeDtypeStruct`: another
    kernel's output in the same call)."""

    kernel: Any
    operands: tuple[jax.Array, ...]
    out_shape: tuple[jax.ShapeDtypeStruct, ...]
    grid: tuple[int, ...]
    num_warps: int
    num_stages: int
    name: str
    constexprs: dict

    def run(self) -> list[jax.Array]:
        return triton_call(*self.operands, kernel=self.kernel, out_shape=self.out_shape, grid=self.grid,
                           num_warps=self.num_warps, num_stages=self.num_stages, name=self.name, **self.constexprs)
