"""Row exchanges between the ranks of an axis group, inside `shard_map`.

Two implementations of one variable-size exchange (EP "normal" mode):
  * "ragged": `jax.lax.ragged_all_to_all` — sends only real rows. GPU/TPU only: XLA:CPU has no
    ragged-all-to-all ("UNIMPLEMENTED ... not supported by XLA:CPU").
  * "dense":  `jax.lax.all_to_all` of worst-case-sized slots (every rank reserves `chunk` rows for
    every peer). Same received buffer, bit for bit; moves the worst case on the wire. Runs anywhere.
and "ragged_emulated": the ragged path's offset bookkeeping, with the collective itself emulated
by dense all-to-alls — the CPU test vehicle for the ragged path's arithmetic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Axes = tuple[str, ...]

IMPLS = ("auto", "ragged", "dense", "ragged_emulated")


def axis_index(axes: Axes) -> jax.Array:
    """Linear rank of this device over `axes` (row-major in the listed order), int32 scalar."""
    return jax.lax.axis_index(axes if len(axes) > 1 else axes[0]).astype(jnp.int32)


def axis_name(axes: Axes):
    """The axis_name argument of lax collectives for `axes`."""
    return axes if len(axes) > 1 else axes[0]


def all_to_all_rows(buf: jax.Array, axes: Axes) -> jax.Array:
    """buf: (n * C, ...) — rows [d*C, (d+1)*C) go to rank d; returns (n * C, ...) with rows
    [i*C, (i+1)*C) received from rank i."""
    return jax.lax.all_to_all(buf, axis_name(axes), 0, 0, tiled=True)


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                      send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array,
                      axes: Axes, *, impl: str, chunk: int) -> jax.Array:
    """`jax.lax.ragged_all_to_all` semantics (one slice per peer).

    operand: (S, ...) rows to send; output: (R, ...) initial receive buffer; input_offsets,
    send_sizes, output_offsets, recv_sizes: (n,) int32 — slice d of operand starts at
    input_offsets[d], has send_sizes[d] rows and lands at output_offsets[d] in rank d's output;
    recv_sizes[i] rows arrive from rank i. `chunk`: static bound on any slice's rows (the emulation
    moves `chunk` rows per peer). impl: "ragged" (the XLA collective) or "ragged_emulated".
    """
    if impl == "ragged":
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                         recv_sizes, axis_name=axis_name(axes))
    if impl != "ragged_emulated":
        raise ValueError(f"impl: expected 'ragged' or 'ragged_emulated', got {impl!r}")
    n = input_offsets.shape[0]
    s, r = operand.shape[0], output.shape[0]
    rows = jnp.arange(chunk, dtype=jnp.int32)
    # slice d of the operand, padded to `chunk` rows; rows past send_sizes[d] are never written
    src = jnp.clip(input_offsets[:, None] + rows[None, :], 0, s - 1)  # (n, chunk)
    chunks = operand[src.reshape(-1)]  # (n * chunk, ...)
    meta = jnp.stack([output_offsets, send_sizes], axis=1).astype(jnp.int32)  # (n, 2)
    got = all_to_all_rows(chunks, axes).reshape(n, chunk, *operand.shape[1:])
    got_meta = all_to_all_rows(meta, axes)  # (n, 2): where my slice from rank i goes, its size
    dst = got_meta[:, 0:1] + rows[None, :]
    dst = jnp.where(rows[None, :] < got_meta[:, 1:2], dst, r)  # r: out of bounds -> dropped
    return output.at[dst.reshape(-1)].set(got.reshape(n * chunk, *operand.shape[1:]), mode="drop")


def resolve_impl(impl: str, platform: str) -> str:
    """"auto" -> "ragged" on GPU/TPU (sends only real rows), "dense" elsewhere (CPU)."""
    if impl not in IMPLS:
        raise ValueError(f"a2a_impl: expected one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "ragged" if platform in ("gpu", "cuda", "rocm", "tpu") else "dense"
    if impl == "ragged" and platform == "cpu":
        raise ValueError("a2a_impl: 'ragged' needs a GPU or TPU mesh (XLA:CPU does not implement "
                         "ragged-all-to-all); got a cpu mesh — use 'dense' or 'auto'")
    return impl
