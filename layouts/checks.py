"""Argument checks shared by every package (``layouts``, ``custom_calls``, ``moe_jax``).

Every check runs at trace time on static information (shapes, dtypes, Python ints) and raises
ValueError/TypeError in one format: ``"<argument>: expected <what>, got <actual>"``.
"""

from __future__ import annotations

from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

# Activations and bf16-recipe operands may be any of these.
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


def check_rank(name: str, x, rank: int, what: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name}: expected rank {rank} {what}, got shape {tuple(x.shape)}")


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def check_static_int(name: str, value, minimum: int = 0) -> int:
    """A static (Python) int >= minimum; bools are refused (True is not a size)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}: expected a static int >= {minimum}, got {value!r}")
    return int(value)


def check_multiple(name: str, value: int, of: int, what: str) -> None:
    if value % of != 0:
        raise ValueError(f"{name}: expected {what} to be a multiple of {of}, got {value}")


def check_shape(name: str, x, expected: tuple, what: str = "") -> None:
    suffix = f" ({what})" if what else ""
    if x is None:
        raise ValueError(f"{name}: expected an array of shape {tuple(expected)}{suffix}, got None")
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}{suffix}, got {tuple(x.shape)}")


def check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


def host_value(x) -> np.ndarray | None:
    """The values of ``x`` as a numpy array, or None while tracing (jit/vmap/grad: values unknown)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
