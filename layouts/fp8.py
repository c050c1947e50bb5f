"""FP8 (float8_e4m3fn) quantizers and dequantizers: per token group (1 x g) and per block (b x b).

Numerics (DeepGEMM's convention):
  amax = max(max|x| over the group, 1e-4); sf = amax / 448, or with ue8m0 the smallest power of
  two >= amax / 448 (computed exactly); q = e4m3(clip(x * (1/sf), -448, 448)) with x * (1/sf)
  evaluated in fp32 and round-to-nearest-even. The clip matters: jnp's cast to e4m3fn does not
  saturate (it yields NaN above 480), and x * (1/sf) can exceed 448 by an ulp for fp32 scales.
  A trailing partial group/block is quantized as if zero-padded.
Non-UE8M0 fp32 scales may differ from an IEEE division by 1 ulp (XLA rewrites x / 448 as a
multiplication); q is always consistent with the sf returned.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from layouts.checks import ceil_div, check_dtype, check_float, check_min_ndim, check_positive_int, check_shape
from layouts.rounding import store_as
from layouts.ue8m0 import ue8m0_scale_from_amax

FP8_E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
FP8_BLOCK = 128  # rows and columns of a block-FP8 weight tile, columns of an activation group

FP8_DTYPE = jnp.float8_e4m3fn


def fp8_scale_from_amax(amax: jax.Array, ue8m0: bool) -> jax.Array:
    """Scale of a group with absolute maximum amax (f32, any shape): amax floored at 1e-4, / 448."""
    amax = jnp.maximum(amax.astype(jnp.float32), jnp.float32(AMAX_FLOOR))
    if ue8m0:
        return ue8m0_scale_from_amax(amax, FP8_E4M3_MAX)
    return amax / jnp.float32(FP8_E4M3_MAX)


def cast_to_e4m3(x: jax.Array) -> jax.Array:
    """Saturating round-to-nearest-even cast: f32 (...) -> float8_e4m3fn (...), |q| <= 448
    (through `store_as`: a later dequantization in the same program still sees the rounding)."""
    return store_as(jnp.clip(x, -FP8_E4M3_MAX, FP8_E4M3_MAX), FP8_DTYPE)


def _pad_last(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    n = x.shape[axis]
    pad = ceil_div(n, multiple) * multiple - n
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def quantize_fp8_per_token_group(
    x: jax.Array, group_size: int = 128, ue8m0: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Per-token-group FP8 quantization along the last axis.

    x: (..., K) f32/bf16/f16 -> q: (..., K) float8_e4m3fn, sf: (..., ceil(K/group_size)) f32.
    ue8m0=True makes every sf a power of two (rounded up, so |x / sf| <= 448 always).
    """
    check_float("x", x)
    check_min_ndim("x", x, 1, "(..., K)")
    check_positive_int("group_size", group_size)
    k = x.shape[-1]
    if k == 0:
        raise ValueError(f"x: expected K > 0, got shape {tuple(x.shape)}")
    g = ceil_div(k, group_size)
    xf = _pad_last(x.astype(jnp.float32), -1, group_size)
    xg = xf.reshape(*x.shape[:-1], g, group_size)
    sf = fp8_scale_from_amax(jnp.max(jnp.abs(xg), axis=-1), ue8m0)
    inv = jnp.float32(1.0) / sf
    q = cast_to_e4m3(xg * inv[..., None]).reshape(*x.shape[:-1], g * group_size)[..., :k]
    return q, sf


def quantize_mxfp8(x: jax.Array, group_size: int = 32) -> tuple[jax.Array, jax.Array]:
    """MXFP8: per-token-group e4m3 with UE8M0 scales, group 32 along the last axis.

    x: (..., K) float -> q: (..., K) float8_e4m3fn, sf: (..., ceil(K/group_size)) f32 powers of two.
    """
    return quantize_fp8_per_token_group(x, group_size=group_size, ue8m0=True)


def dequantize_fp8_per_token_group(
    q: jax.Array, sf: jax.Array, group_size: int = 128, dtype=jnp.float32
) -> jax.Array:
    """q: (..., K) float8_e4m3fn, sf: (..., ceil(K/group_size)) f32 -> (..., K) ``dtype`` (q * sf in f32)."""
    return _dequantize_blocked(q, sf, group_size, 1, "group_size", dtype)


def quantize_fp8_per_block(
    w: jax.Array, block_size: int = 128, ue8m0: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Per-block FP8 quantization of the last two axes (one amax per block_size x block_size block).

    w: (..., N, K) float -> q: (..., N, K) float8_e4m3fn,
    sf: (..., ceil(N/block_size), ceil(K/block_size)) f32.
    """
    check_float("w", w)
    check_min_ndim("w", w, 2, "(..., N, K)")
    check_positive_int("block_size", block_size)
    n, k = w.shape[-2:]
    if n == 0 or k == 0:
        raise ValueError(f"w: expected N > 0 and K > 0, got shape {tuple(w.shape)}")
    nb, kb = ceil_div(n, block_size), ceil_div(k, block_size)
    wf = _pad_last(_pad_last(w.astype(jnp.float32), -1, block_size), -2, block_size)
    wb = wf.reshape(*w.shape[:-2], nb, block_size, kb, block_size)
    sf = fp8_scale_from_amax(jnp.max(jnp.abs(wb), axis=(-3, -1)), ue8m0)
    inv = jnp.float32(1.0) / sf
    q = cast_to_e4m3(wb * inv[..., :, None, :, None])
    q = q.reshape(*w.shape[:-2], nb * block_size, kb * block_size)[..., :n, :k]
    return q, sf


def dequantize_fp8_per_block(
    q: jax.Array, sf: jax.Array, block_size: int = 128, dtype=jnp.float32
) -> jax.Array:
    """q: (..., N, K) float8_e4m3fn, sf: (..., ceil(N/bs), ceil(K/bs)) f32 -> (..., N, K) ``dtype``."""
    return _dequantize_blocked(q, sf, block_size, 2, "block_size", dtype)


def _dequantize_blocked(q: jax.Array, sf: jax.Array, size: int, ndims: int, size_name: str, dtype) -> jax.Array:
    """q * sf in f32, one scale per `size` values along each of the last `ndims` axes of q."""
    check_dtype("q", q, (FP8_DTYPE,))
    check_dtype("sf", sf, (jnp.float32,))
    check_min_ndim("q", q, ndims, "(..., K)" if ndims == 1 else "(..., N, K)")
    check_positive_int(size_name, size)
    dims = q.shape[-ndims:]
    check_shape("sf", sf, (*q.shape[:-ndims], *(ceil_div(d, size) for d in dims)),
                f"q {tuple(q.shape)}, {size_name} {size}")
    scale = sf
    for axis in range(-ndims, 0):
        scale = jnp.repeat(scale, size, axis=axis)
    scale = scale[(..., *(slice(0, d) for d in dims))]
    return (q.astype(jnp.float32) * scale).astype(dtype)
