"""UE8M0: the 8-bit exponent-only scale format (value 2**(byte - 127), no sign, no mantissa).

All rounding here works on the fp32 bit pattern, never on log2/exp2, so power-of-two boundaries
are exact.

Packing convention (DeepGEMM's): four exponent bytes along the last axis form one int32, the
first element in the lowest byte (little-endian); the last axis is zero-padded to a multiple of 4.
Exponent byte 0 is used only for padding; it unpacks to +0.0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from layouts.checks import ceil_div, check_dtype, check_float, check_min_ndim, host_value

UE8M0_MIN = 2.0**-126  # smallest normal fp32: exponent byte 1
UE8M0_MAX = 2.0**127  # exponent byte 254 (255 is inf/NaN in fp32)

_MANT_MASK = 0x7FFFFF


def _bits_u32(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _from_exponent(exp: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(exp.astype(jnp.uint32) << 23, jnp.float32)


def ceil_to_ue8m0(x: jax.Array) -> jax.Array:
    """Smallest power of two >= |x|, clamped to the normal range [2^-126, 2^127].

    x: (...) float (f32/bf16/f16) -> (...) f32.
    Exact: a zero mantissa means |x| is already a power of two; otherwise the exponent is bumped.
    Zero and subnormals give 2^-126; |x| > 2^127 (inf included) gives 2^127; NaN gives 2^127.
    """
    check_float("x", x)
    bits = _bits_u32(jnp.abs(x.astype(jnp.float32)))
    exp = ((bits >> 23) & 0xFF).astype(jnp.int32)
    exp = exp + ((bits & _MANT_MASK) != 0).astype(jnp.int32)
    return _from_exponent(jnp.clip(exp, 1, 254))


def is_ue8m0(x: jax.Array) -> jax.Array:
    """Elementwise: x is a positive normal fp32 power of two in [2^-126, 2^127] (bool, same shape)."""
    check_float("x", x)
    bits = _bits_u32(x)
    exp = (bits >> 23) & 0x1FF  # sign bit included: negatives land above 254
    return ((bits & _MANT_MASK) == 0) & (exp >= 1) & (exp <= 254)


def e8m0_round_up_bytes(x: jax.Array) -> jax.Array:
    """The SPEC §2 ``_cast_to_e8m0_with_rounding_up`` bit rule, as uint8 exponent bytes.

    x: (...) float -> (...) uint8. On the int32 view of the fp32 bits (arithmetic shift):
    exp = bits >> 23, mant = bits & 0x7FFFFF; exp += 1 when mant > 0 and exp != 0xFE, except when
    exp == 0 and mant <= 0x400000; the low 8 bits are kept. For positive finite inputs this is the
    exponent of the power of two at or above x (a subnormal at most 2^-127 keeps byte 0); negative
    inputs keep the rule's own (sign-extended) arithmetic, as in the seed.
    """
    check_float("x", x)
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    exp = bits >> 23
    mant = bits & _MANT_MASK
    round_up = (mant > 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= 0x400000))
    exp = jnp.where(round_up, exp + 1, exp)
    return (exp & 0xFF).astype(jnp.uint8)


def ue8m0_bytes_to_fp32(b: jax.Array) -> jax.Array:
    """Exponent bytes -> fp32 powers of two (byte << 23). b: (...) uint8 -> (...) f32.

    Byte 0 gives +0.0 (not 2^-127) and byte 255 gives inf: neither is a valid scale.
    """
    check_dtype("b", b, (jnp.uint8,))
    return _from_exponent(b)


def _check_pow2_concrete(name: str, sf: jax.Array) -> None:
    host = host_value(sf)
    if host is None:
        return
    # on the host: an eager check should not compile a program per shape
    bits = host.astype(np.float32).view(np.uint32)
    exp = bits >> 23  # sign bit included: negatives land above 254
    ok = ((bits & _MANT_MASK) == 0) & (exp >= 1) & (exp <= 254)
    if not ok.all():
        bad_index = tuple(int(i[0]) for i in np.nonzero(~ok))
        bad = float(host[bad_index])
        raise ValueError(
            f"{name}: expected positive powers of two in [2^-126, 2^127] (UE8M0-representable), "
            f"got {bad!r} at index {bad_index}; round with ceil_to_ue8m0 first"
        )


def pack_ue8m0(sf: jax.Array, *, check: bool = True) -> jax.Array:
    """Pack fp32 powers of two into int32 words of four UE8M0 bytes along the last axis.

    sf: (..., G) f32 -> (..., ceil(G/4)) int32; element 4j+i of sf is byte i (bits 8i..8i+7) of
    word j; missing bytes of the last word are 0.
    check=True raises ValueError on a value that is not a positive normal power of two, but only
    when sf is concrete (eager call): under jit/vmap the values are unknown at trace time and the
    check is skipped; the byte is then the truncated exponent (bits >> 23) & 0xFF.
    """
    check_dtype("sf", sf, (jnp.float32,))
    check_min_ndim("sf", sf, 1, "(..., G)")
    if check:
        _check_pow2_concrete("sf", sf)
    g = sf.shape[-1]
    words = ceil_div(g, 4)
    exp = (_bits_u32(sf) >> 23) & 0xFF
    exp = jnp.pad(exp, [(0, 0)] * (sf.ndim - 1) + [(0, words * 4 - g)])
    exp = exp.reshape(*sf.shape[:-1], words, 4)
    shifts = jnp.array([0, 8, 16, 24], jnp.uint32)
    word = jnp.sum(exp << shifts, axis=-1, dtype=jnp.uint32)  # disjoint bytes: sum == or
    return jax.lax.bitcast_convert_type(word, jnp.int32)


def unpack_ue8m0(packed: jax.Array, num_groups: int | None = None) -> jax.Array:
    """Inverse of ``pack_ue8m0``. packed: (..., W) int32 -> (..., num_groups or 4W) f32.

    Padding bytes (0) unpack to 0.0.
    """
    check_dtype("packed", packed, (jnp.int32,))
    check_min_ndim("packed", packed, 1, "(..., W)")
    w = packed.shape[-1]
    if num_groups is None:
        num_groups = 4 * w
    if not (isinstance(num_groups, int) and 4 * (w - 1) < num_groups <= 4 * w):
        raise ValueError(
            f"num_groups: expected an int in ({4 * (w - 1)}, {4 * w}] for packed width {w}, "
            f"got {num_groups!r}"
        )
    word = jax.lax.bitcast_convert_type(packed, jnp.uint32)
    shifts = jnp.array([0, 8, 16, 24], jnp.uint32)
    exp = (word[..., None] >> shifts) & 0xFF
    exp = exp.reshape(*packed.shape[:-1], 4 * w)[..., :num_groups]
    return _from_exponent(exp)


def ue8m0_scale_from_amax(amax: jax.Array, max_value: float) -> jax.Array:
    """Exact ``ceil_to_ue8m0(amax / max_value)``: the smallest power of two p with p * max_value >= amax.

    amax: (...) f32 >= 0 -> (...) f32 power of two in [2^-126, 2^127].
    XLA may compile ``amax / c`` as ``amax * (1/c)`` (1 ulp off), which moves results that sit on a
    power of two across the boundary. The estimate is therefore corrected with products p * c,
    which are exact for the constants used here (448 = 7*2^6, 6 = 3*2).
    """
    amax = amax.astype(jnp.float32)
    c = jnp.float32(max_value)
    p = ceil_to_ue8m0(amax * (jnp.float32(1.0) / c))
    half = p * jnp.float32(0.5)
    p = jnp.where((half >= UE8M0_MIN) & (half * c >= amax), half, p)
    p = jnp.where((p * c < amax) & (p < UE8M0_MAX), p * jnp.float32(2.0), p)
    return p
