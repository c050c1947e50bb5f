"""Argument checks shared by the ``layouts`` modules.

Every check runs at trace time on static information (shapes, dtypes, Python ints) and raises
ValueError/TypeError naming the argument, what was expected and what was given.
"""

from __future__ import annotations

from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_ARCHS = (90, 100)

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def align(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def dtype_name(x) -> str:
    return str(jnp.asarray(x).dtype) if not hasattr(x, "dtype") else str(x.dtype)


def check_dtype(name: str, x, allowed: Iterable) -> None:
    allowed = tuple(jnp.dtype(d) for d in allowed)
    if not hasattr(x, "dtype") or jnp.dtype(x.dtype) not in allowed:
        got = x.dtype if hasattr(x, "dtype") else type(x).__name__
        raise TypeError(
            f"{name}: expected dtype {' or '.join(str(d) for d in allowed)}, got {got}"
        )


def check_float(name: str, x) -> None:
    check_dtype(name, x, FLOAT_DTYPES)


def check_min_ndim(name: str, x, ndim: int, what: str) -> None:
    if x.ndim < ndim:
        raise ValueError(f"{name}: expected at least {ndim} dims {what}, got shape {tuple(x.shape)}")


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def check_multiple(name: str, value: int, of: int, what: str) -> None:
    if value % of != 0:
        raise ValueError(f"{name}: expected {what} to be a multiple of {of}, got {value}")


def check_arch(arch) -> int:
    if isinstance(arch, bool) or arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch: expected one of {SUPPORTED_ARCHS}, got {arch!r}")
    return int(arch)


def check_shape(name: str, x, expected: tuple, what: str = "") -> None:
    if tuple(x.shape) != tuple(expected):
        suffix = f" ({what})" if what else ""
        raise ValueError(f"{name}: expected shape {tuple(expected)}{suffix}, got {tuple(x.shape)}")


def host_value(x) -> np.ndarray | None:
    """The values of ``x`` as a numpy array, or None while tracing (jit/vmap/grad: values unknown)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
