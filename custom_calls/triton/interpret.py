"""The Triton backend on the CPU, through Triton's interpreter: for tests and debugging, not speed.

Triton's interpreter replaces compiled kernels when the environment variable TRITON_INTERPRET=1
is set before `triton` is imported (Triton's own switch). `custom_calls.triton.launch.triton_call`
then runs each kernel here, inside `jax.pure_callback`, on numpy copies of its inputs, so the
backend's implementations run unchanged on a machine without a GPU (tens to thousands of times
slower than on one).

Two details make the results those of the GPU kernels:
* the interpreter hands kernels objects with a small part of torch.Tensor's interface; `_Buffer`
  provides that part over a numpy array (no torch needed);
* the interpreter's own float down-casts truncate; `_install_exact_casts` replaces them with
  ml_dtypes' round-to-nearest-even casts, as the GPU's cvt.rn instructions do.
Outputs not listed as zero-filled start as 0xFF bytes (NaN for floats), so an element a kernel
fails to write is visible, as uninitialized device memory would be.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Sequence

import jax
import ml_dtypes
import numpy as np

_TRITON_DTYPE_NAMES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16", "int32": "int32",
                       "int8": "int8", "uint8": "uint8", "float8_e4m3fn": "float8_e4m3fn"}
_lock = threading.Lock()
_casts_installed = False


def interpreting() -> bool:
    """True when Triton's interpreter replaces compiled kernels (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


class _Buffer:
    """The part of torch.Tensor that Triton's interpreter touches, over a numpy array."""

    def __init__(self, arr: np.ndarray):
        self.arr = arr
        self.dtype = _TRITON_DTYPE_NAMES[arr.dtype.name]

    def data_ptr(self) -> int:
        return self.arr.ctypes.data

    def untyped_storage(self) -> "_Buffer":
        return self

    def cpu(self) -> "_Buffer":
        return self

    def new_empty(self, *args, **kwargs) -> "_Buffer":
        return _Buffer(self.arr)

    def set_(self, storage: "_Buffer", *args) -> "_Buffer":
        self.arr = storage.arr
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.arr.shape

    def stride(self) -> tuple[int, ...]:
        return self.arr.strides

    def copy_(self, other) -> None:  # the interpreter copies back into the same memory
        pass


def _install_exact_casts() -> None:
    global _casts_installed
    with _lock:
        if _casts_installed:
            return
        import triton.language as tl
        from triton.runtime import interpreter

        types = {tl.bfloat16: ml_dtypes.bfloat16, tl.float8e4nv: ml_dtypes.float8_e4m3fn,
                 tl.float16: np.float16, tl.float32: np.float32, tl.float64: np.float64}

        def convert(data, src, dst, rounding_mode):
            return np.asarray(data.view(types[src]).astype(types[dst]))

        interpreter._convert_float = convert
        _casts_installed = True


def _run(kernel: Any, grid: tuple[int, ...], out_shape: Sequence[jax.ShapeDtypeStruct],
         zeroed_outputs: Sequence[int], constexprs: dict, *inputs: np.ndarray) -> list[np.ndarray]:
    _install_exact_casts()
    outs = []
    for i, o in enumerate(out_shape):
        a = np.empty(o.shape, o.dtype)
        a.view(np.uint8)[...] = 0 if i in zeroed_outputs else 0xFF
        outs.append(a)
    args = [_Buffer(np.ascontiguousarray(x)) for x in inputs] + [_Buffer(o) for o in outs]
    kernel[grid](*args, **constexprs)
    return outs


def triton_call_interpreted(*args: jax.Array, kernel: Any, out_shape: Sequence[jax.ShapeDtypeStruct],
                            grid: tuple[int, ...], zeroed_outputs: Sequence[int] = (),
                            **constexprs: Any) -> list[jax.Array]:
    """`launch.triton_call` under Triton's interpreter: the kernel runs on the host, in a callback."""
    out_shape = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in out_shape]

    def host(*inputs):
        return _run(kernel, grid, out_shape, tuple(zeroed_outputs), constexprs, *(np.asarray(x) for x in inputs))

    return list(jax.pure_callback(host, out_shape, *args))
