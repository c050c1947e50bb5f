"""Pack several per-row arrays into one byte row, so one collective carries a token's whole message.

A token sent between ranks carries its hidden vector (bf16, or FP8 + scales), its top-k expert ids
and weights. Sending them as one uint8 buffer costs one collective instead of four: on GPUs each
collective has a fixed latency per peer, and DeepEP sends one message per token for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class RowField:
    """One field of a packed row: `width` elements of `dtype` (a numpy dtype name)."""

    name: str
    dtype: str
    width: int

    @property
    def nbytes(self) -> int:
        return self.width * np.dtype(jnp.dtype(self.dtype)).itemsize


@dataclass(frozen=True)
class RowFormat:
    """The byte layout of a packed row: fields in order, no padding."""

    fields: tuple[RowField, ...]

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.fields)

    def offsets(self) -> dict[str, tuple[int, int]]:
        out, at = {}, 0
        for f in self.fields:
            out[f.name] = (at, at + f.nbytes)
            at += f.nbytes
        return out


def row_format(**arrays: jax.Array) -> RowFormat:
    """Format for rows of `arrays` (each (M, W) or (M,)), in keyword order."""
    fields = []
    for name, a in arrays.items():
        if a.ndim not in (1, 2):
            raise ValueError(f"{name}: expected shape (M,) or (M, W) to pack, got {tuple(a.shape)}")
        fields.append(RowField(name, jnp.dtype(a.dtype).name, 1 if a.ndim == 1 else int(a.shape[1])))
    return RowFormat(tuple(fields))


def _to_bytes(a: jax.Array) -> jax.Array:
    """(M, W) any dtype -> (M, W * itemsize) uint8 (host byte order, as XLA bitcasts)."""
    if a.ndim == 1:
        a = a[:, None]
    if jnp.dtype(a.dtype).itemsize == 1:
        return jax.lax.bitcast_convert_type(a, jnp.uint8)
    b = jax.lax.bitcast_convert_type(a, jnp.uint8)  # (M, W, itemsize)
    return b.reshape(a.shape[0], -1)


def _from_bytes(b: jax.Array, f: RowField) -> jax.Array:
    dt = jnp.dtype(f.dtype)
    if dt.itemsize == 1:
        return jax.lax.bitcast_convert_type(b, dt)
    return jax.lax.bitcast_convert_type(b.reshape(b.shape[:-1] + (f.width, dt.itemsize)), dt)


def pack_rows(fmt: RowFormat, **arrays: jax.Array) -> jax.Array:
    """Arrays with leading dim M, in `fmt`'s order -> (M, fmt.nbytes) uint8."""
    names = tuple(f.name for f in fmt.fields)
    if tuple(arrays) != names:
        raise ValueError(f"pack_rows: expected fields {names}, got {tuple(arrays)}")
    return jnp.concatenate([_to_bytes(arrays[n]) for n in names], axis=-1)


def unpack_rows(buf: jax.Array, fmt: RowFormat) -> dict[str, jax.Array]:
    """(..., fmt.nbytes) uint8 -> {name: (..., width) array} (width-1 fields keep a trailing 1)."""
    if buf.dtype != jnp.uint8 or buf.shape[-1] != fmt.nbytes:
        raise ValueError(f"buf: expected (..., {fmt.nbytes}) uint8, got {tuple(buf.shape)} {buf.dtype}")
    out = {}
    for f in fmt.fields:
        lo, hi = fmt.offsets()[f.name]
        out[f.name] = _from_bytes(buf[..., lo:hi], f)
    return out
