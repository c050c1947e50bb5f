"""E2M1 (FP4) codes and MXFP4: e2m1 values with one UE8M0 scale per 32 elements along K.

Code: bit 3 = sign, bits 0-2 = index into {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Rounding is to nearest,
ties to the even code: ties at 0.25, 1.25, 2.5, 5.0 go down, at 0.75, 1.75, 3.5 go up; magnitudes
above 6 saturate to 6; negative zero (and NaN) encode as +0.
Packing: two codes per int8 byte along the last axis, element 2j in the low nibble, 2j+1 high.
MXFP4 scale: sf = ceil_to_ue8m0(max(amax, 1e-4) / 6), computed exactly; a trailing partial group
is quantized as if zero-padded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from layouts.checks import (
    ceil_div,
    check_dtype,
    check_float,
    check_min_ndim,
    check_positive_int,
    check_shape,
)
from layouts.ue8m0 import ue8m0_scale_from_amax

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
AMAX_FLOOR = 1e-4
MXFP4_GROUP = 32  # values per UE8M0 scale
# e2m1 max 6 * 2^6 = 384 <= 448 < 6 * 2^7: widened to e4m3, a 32-group may sit up to 6 binades
# above its 128 x 128 tile's block scale
MAX_OFFSET_BITS = 6

# (boundary, ties round up?) between consecutive magnitudes
_BOUNDARIES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def encode_e2m1(y: jax.Array) -> jax.Array:
    """Round already-scaled values to e2m1 codes. y: (...) f32 -> (...) uint8 in [0, 15]."""
    check_float("y", y)
    ay = jnp.abs(y.astype(jnp.float32))
    code = jnp.zeros(y.shape, jnp.uint8)
    for boundary, up in _BOUNDARIES:
        code = code + ((ay >= boundary) if up else (ay > boundary)).astype(jnp.uint8)
    negative = (y < 0) & (code != 0)
    return code | (negative.astype(jnp.uint8) << 3)


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """e2m1 codes -> values. codes: (...) uint8 (low 4 bits used) -> (...) f32."""
    check_dtype("codes", codes, (jnp.uint8,))
    table = jnp.array(E2M1_VALUES, jnp.float32)
    mag = table[(codes & 0x7).astype(jnp.int32)]
    return jnp.where((codes & 0x8) != 0, -mag, mag)


def pack_e2m1(codes: jax.Array) -> jax.Array:
    """codes: (..., K) uint8, K even -> (..., K/2) int8; code 2j in the low nibble."""
    check_dtype("codes", codes, (jnp.uint8,))
    check_min_ndim("codes", codes, 1, "(..., K)")
    k = codes.shape[-1]
    if k % 2:
        raise ValueError(f"codes: expected an even last axis K (two codes per byte), got K = {k}")
    pairs = (codes & 0xF).reshape(*codes.shape[:-1], k // 2, 2)
    byte = pairs[..., 0] | (pairs[..., 1] << 4)
    return jax.lax.bitcast_convert_type(byte, jnp.int8)


def unpack_e2m1(packed: jax.Array) -> jax.Array:
    """packed: (..., K/2) int8 -> codes (..., K) uint8 (inverse of ``pack_e2m1``)."""
    check_dtype("packed", packed, (jnp.int8,))
    check_min_ndim("packed", packed, 1, "(..., K/2)")
    byte = jax.lax.bitcast_convert_type(packed, jnp.uint8)
    codes = jnp.stack([byte & 0xF, byte >> 4], axis=-1)
    return codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def quantize_mxfp4(x: jax.Array, group_size: int = 32) -> tuple[jax.Array, jax.Array]:
    """MXFP4 quantization along the last axis.

    x: (..., K) f32/bf16/f16, K even -> packed: (..., K/2) int8 (two e2m1 codes per byte),
    sf: (..., ceil(K/group_size)) f32 powers of two.
    """
    check_float("x", x)
    check_min_ndim("x", x, 1, "(..., K)")
    check_positive_int("group_size", group_size)
    k = x.shape[-1]
    if k == 0 or k % 2:
        raise ValueError(f"x: expected an even K > 0 (two e2m1 codes per int8), got K = {k}")
    g = ceil_div(k, group_size)
    xf = x.astype(jnp.float32)
    xf = jnp.pad(xf, [(0, 0)] * (x.ndim - 1) + [(0, g * group_size - k)])
    xg = xf.reshape(*x.shape[:-1], g, group_size)
    amax = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), jnp.float32(AMAX_FLOOR))
    sf = ue8m0_scale_from_amax(amax, E2M1_MAX)
    codes = encode_e2m1(xg * (jnp.float32(1.0) / sf)[..., None])
    codes = codes.reshape(*x.shape[:-1], g * group_size)[..., :k]
    return pack_e2m1(codes), sf


def dequantize_mxfp4(
    packed: jax.Array, sf: jax.Array, group_size: int = 32, dtype=jnp.float32
) -> jax.Array:
    """packed: (..., K/2) int8, sf: (..., ceil(K/group_size)) f32 -> (..., K) ``dtype`` (value * sf)."""
    check_dtype("packed", packed, (jnp.int8,))
    check_dtype("sf", sf, (jnp.float32,))
    check_positive_int("group_size", group_size)
    codes = unpack_e2m1(packed)
    k = codes.shape[-1]
    check_shape("sf", sf, (*packed.shape[:-1], ceil_div(k, group_size)),
                f"packed {tuple(packed.shape)}, K = {k}, group_size {group_size}")
    scale = jnp.repeat(sf, group_size, axis=-1)[..., :k]
    return (decode_e2m1(codes) * scale).astype(dtype)
