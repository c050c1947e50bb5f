"""UE8M0 rounding, the seed's byte rule, and packing, against numpy models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import layouts as L
from run_mode import property_examples
from test_layouts_np_model import np_ceil_pow2, np_exponent_byte, np_pack_bytes


def jv(f):
    """vmap under one jit (eager vmap dispatches, and compiles, op by op)."""
    return jax.jit(jax.vmap(f))

SETTINGS = settings(max_examples=property_examples(25), deadline=None)

# one compilation per shape (eager dispatch of every primitive is far slower on CPU)
pack_j = jax.jit(L.pack_ue8m0, static_argnames="check")
unpack_j = jax.jit(L.unpack_ue8m0, static_argnums=1)
ceil_j = jax.jit(L.ceil_to_ue8m0)


def _f32_bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _boundary_values():
    """Powers of two across the whole range and their fp32 neighbours, plus specials."""
    vals = [0.0, -0.0, 1e-45, 2.0**-127, 2.0**-126, np.inf, -np.inf, 2.0**127, 3.0e38]
    for e in range(-126, 128, 7):
        p = np.float32(2.0**e)
        vals += [p, np.nextafter(p, np.float32(np.inf)), np.nextafter(p, np.float32(0)), -p]
    return np.array(vals, np.float32)


def test_ceil_to_ue8m0_boundaries_bit_exact():
    x = _boundary_values()
    got = np.asarray(L.ceil_to_ue8m0(jnp.asarray(x)))
    np.testing.assert_array_equal(_f32_bits(got), _f32_bits(np_ceil_pow2(x).astype(np.float32)))


def test_ceil_to_ue8m0_nan_and_subnormal_clamp():
    got = np.asarray(L.ceil_to_ue8m0(jnp.array([np.nan, 1e-42, 0.0], jnp.float32)))
    assert got.tolist() == [2.0**127, 2.0**-126, 2.0**-126]


@SETTINGS
@given(st.integers(0, 2**31 - 1))
def test_ceil_to_ue8m0_random_bits(seed):
    bits = np.random.default_rng(seed).integers(0, 2**32, size=64, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    got = np.asarray(ceil_j(jnp.asarray(x)))
    np.testing.assert_array_equal(_f32_bits(got), _f32_bits(np_ceil_pow2(x).astype(np.float32)))


def test_ceil_to_ue8m0_bf16_input_and_jit_vmap():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 5)) * 100, jnp.bfloat16)
    want = np_ceil_pow2(np.asarray(x, np.float64)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(L.ceil_to_ue8m0)(x)), want)
    np.testing.assert_array_equal(np.asarray(jv(L.ceil_to_ue8m0)(x)), want)


def _np_seed_rule(x):
    """The seed's _cast_to_e8m0_with_rounding_up on python ints (int32 view, arithmetic shift)."""
    out = []
    for b in np.asarray(x, np.float32).view(np.int32).tolist():
        exp, mant = b >> 23, b & 0x7FFFFF
        ru = (mant > 0 and exp != 0xFE) and not (exp == 0 and mant <= 0x400000)
        out.append(((exp + 1) if ru else exp) & 0xFF)
    return np.array(out, np.uint8)


def test_e8m0_round_up_bytes_seed_rule():
    x = np.concatenate([_boundary_values(), np.random.default_rng(1).normal(size=200).astype(np.float32) * 1e3,
                        np.array([2.0**-127, 2.0**-127 * 1.5, 1e-45, np.nan], np.float32)])
    got = np.asarray(L.e8m0_round_up_bytes(jnp.asarray(x)))
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, _np_seed_rule(x))


def test_e8m0_round_up_bytes_is_ceil_exponent_for_positive_normals():
    x = np.abs(np.random.default_rng(2).normal(size=300)).astype(np.float32) * 1e-3 + 1e-30
    got = np.asarray(jax.jit(L.e8m0_round_up_bytes)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np_exponent_byte(np_ceil_pow2(x)))


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.lists(st.integers(1, 5), min_size=0, max_size=2), st.integers(1, 13))
def test_pack_unpack_ue8m0_bit_exact(seed, lead, g):
    rng = np.random.default_rng(seed)
    e = rng.integers(-126, 128, size=(*lead, g))
    sf = np.ldexp(1.0, e).astype(np.float32)
    packed = np.asarray(pack_j(jnp.asarray(sf)))
    assert packed.dtype == np.int32 and packed.shape == (*lead, -(-g // 4))
    np.testing.assert_array_equal(packed, np_pack_bytes(np_exponent_byte(sf)))
    back = np.asarray(unpack_j(jnp.asarray(packed), g))
    np.testing.assert_array_equal(back, sf)
    full = np.asarray(unpack_j(jnp.asarray(packed), None))
    assert full.shape[-1] == 4 * packed.shape[-1]
    assert np.all(full[..., g:] == 0)


def test_pack_ue8m0_jit_vmap():
    sf = np.ldexp(1.0, np.random.default_rng(3).integers(-20, 20, size=(4, 6, 7))).astype(np.float32)
    want = np_pack_bytes(np_exponent_byte(sf))
    np.testing.assert_array_equal(np.asarray(jax.jit(L.pack_ue8m0)(jnp.asarray(sf))), want)
    np.testing.assert_array_equal(np.asarray(jv(L.pack_ue8m0)(jnp.asarray(sf))), want)
    back = jv(jax.jit(lambda p: L.unpack_ue8m0(p, 7)))(jnp.asarray(want))
    np.testing.assert_array_equal(np.asarray(back), sf)


@pytest.mark.parametrize("bad", [3.0, 0.0, -2.0, np.inf, np.nan, 2.0**-127])
def test_pack_ue8m0_rejects_non_powers_of_two(bad):
    sf = jnp.array([[1.0, 2.0, bad]], jnp.float32)
    with pytest.raises(ValueError, match=r"sf: expected positive powers of two"):
        L.pack_ue8m0(sf)


def test_pack_ue8m0_check_off_and_under_jit_truncates():
    sf = jnp.array([3.0, 1.0], jnp.float32)  # 3.0 has exponent byte 128
    want = np.array([128 | (127 << 8)], np.int32)
    np.testing.assert_array_equal(np.asarray(L.pack_ue8m0(sf, check=False)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(L.pack_ue8m0)(sf)), want)


def test_ue8m0_scale_from_amax_exact_at_boundaries():
    # amax = c * 2^k lands exactly on a power of two; its neighbours just above must go up
    k = np.arange(-40, 40)
    for c in (448.0, 6.0):
        on = (c * np.ldexp(1.0, k)).astype(np.float32)
        above = np.nextafter(on, np.float32(np.inf))
        below = np.nextafter(on, np.float32(0))
        for amax in (on, above, below):
            got = np.asarray(jax.jit(lambda a: L.ue8m0_scale_from_amax(a, c))(jnp.asarray(amax)))
            np.testing.assert_array_equal(got, np_ceil_pow2(amax.astype(np.float64) / c).astype(np.float32))


def test_is_ue8m0_and_bytes_to_fp32():
    x = jnp.array([1.0, 3.0, -2.0, 0.0, 2.0**-126, 2.0**127, np.inf], jnp.float32)
    assert np.asarray(L.is_ue8m0(x)).tolist() == [True, False, False, False, True, True, False]
    b = jnp.array([127, 1, 254, 130], jnp.uint8)
    assert np.asarray(L.ue8m0_bytes_to_fp32(b)).tolist() == [1.0, 2.0**-126, 2.0**127, 8.0]


def test_bad_dtypes():
    with pytest.raises(TypeError, match=r"x: expected dtype .*float32.*got int32"):
        L.ceil_to_ue8m0(jnp.array([1, 2], jnp.int32))
    with pytest.raises(TypeError, match=r"sf: expected dtype float32, got bfloat16"):
        L.pack_ue8m0(jnp.ones((4,), jnp.bfloat16))
    with pytest.raises(TypeError, match=r"packed: expected dtype int32, got float32"):
        L.unpack_ue8m0(jnp.ones((4,), jnp.float32))
    with pytest.raises(TypeError, match=r"b: expected dtype uint8"):
        L.ue8m0_bytes_to_fp32(jnp.ones((4,), jnp.int32))


def test_unpack_bad_num_groups():
    with pytest.raises(ValueError, match=r"num_groups: expected an int in \(4, 8\] for packed width 2, got 3"):
        L.unpack_ue8m0(jnp.zeros((2,), jnp.int32), 3)
