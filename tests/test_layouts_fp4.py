"""E2M1 codes and MXFP4 against the numpy model (bit-exact), round trips and error bounds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import layouts as L
from run_mode import property_examples
from test_layouts_np_model import (
    np_ceil_pow2,
    np_e2m1_code,
    np_e2m1_codes,
    np_e2m1_value,
    np_group_amax,
    np_pack_nibbles,
)


SETTINGS = settings(max_examples=property_examples(15), deadline=None)  # one compilation per drawn shape

qmx4_j = jax.jit(L.quantize_mxfp4, static_argnums=1)
dqmx4_j = jax.jit(L.dequantize_mxfp4, static_argnums=2)


def test_encode_e2m1_all_ties_and_edges():
    ys = np.array([0.0, -0.0, 0.25, 0.2500001, 0.75, 0.7499999, 1.25, 1.75, 2.5, 3.5, 5.0, 5.000001, 6.0,
                   7.0, 1e30, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.5, -1e-3, np.inf, -np.inf],
                  np.float32)
    got = np.asarray(L.encode_e2m1(jnp.asarray(ys)))
    assert got.dtype == np.uint8
    assert got.tolist() == [np_e2m1_code(y) for y in ys]


def test_encode_e2m1_dense_grid():
    ys = np.linspace(-7, 7, 5601).astype(np.float32)  # step 0.0025: hits every tie exactly
    got = np.asarray(jax.jit(L.encode_e2m1)(jnp.asarray(ys)))
    np.testing.assert_array_equal(got, np_e2m1_codes(ys))


def test_decode_and_pack_nibbles():
    codes = np.arange(16, dtype=np.uint8)
    vals = np.asarray(L.decode_e2m1(jnp.asarray(codes)))
    assert vals.tolist() == [np_e2m1_value(c) for c in codes]
    c = np.random.default_rng(0).integers(0, 16, size=(3, 10)).astype(np.uint8)
    packed = np.asarray(L.pack_e2m1(jnp.asarray(c)))
    assert packed.dtype == np.int8
    np.testing.assert_array_equal(packed, np_pack_nibbles(c))
    np.testing.assert_array_equal(np.asarray(L.unpack_e2m1(jnp.asarray(packed))), c)


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.lists(st.integers(1, 4), max_size=2), st.integers(1, 150),
       st.sampled_from([32, 16]))
def test_quantize_mxfp4_bit_exact(seed, lead, half_k, gs):
    k = 2 * half_k
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(*lead, k)) * np.exp2(rng.integers(-8, 8, size=(*lead, 1)))).astype(np.float32)
    packed, sf = qmx4_j(jnp.asarray(x), gs)
    amax = np.maximum(np_group_amax(x, gs), float(np.float32(1e-4)))
    want_sf = np_ceil_pow2(amax / 6.0)
    np.testing.assert_array_equal(np.asarray(sf), want_sf.astype(np.float32))
    sfr = np.repeat(want_sf, gs, -1)[..., :k]
    y = x.astype(np.float64) / sfr  # exact: sf is a power of two
    codes = np_e2m1_codes(y)
    np.testing.assert_array_equal(np.asarray(packed), np_pack_nibbles(codes))
    # round trip: within half a step of the e2m1 grid (after saturation at 6)
    deq = np.asarray(dqmx4_j(packed, sf, gs)).astype(np.float64)
    ay = np.minimum(np.abs(y), 6.0)
    half_step = np.where(ay <= 2, 0.25, np.where(ay <= 4, 0.5, 1.0))
    assert np.all(np.abs(deq / sfr - np.sign(y) * ay) <= half_step)
    assert np.all(np.abs(y) <= 6.0)  # rounding the scale up never saturates


def test_mxfp4_boundary_amax():
    ks = np.arange(-10, 10)
    x = (np.random.default_rng(1).uniform(-1, 1, size=(len(ks), 32)) * np.exp2(ks)[:, None]).astype(np.float32)
    x[:, 0] = 6.0 * np.exp2(ks)
    _, sf = qmx4_j(jnp.asarray(x), 32)
    np.testing.assert_array_equal(np.asarray(sf)[:, 0], np.exp2(ks).astype(np.float32))
    x[:, 0] = np.nextafter(x[:, 0], np.float32(np.inf))
    _, sf = qmx4_j(jnp.asarray(x), 32)
    np.testing.assert_array_equal(np.asarray(sf)[:, 0], np.exp2(ks + 1).astype(np.float32))


def test_bad_input():
    with pytest.raises(ValueError, match=r"x: expected an even K > 0 \(two e2m1 codes per int8\), got K = 33"):
        L.quantize_mxfp4(jnp.ones((2, 33)))
    with pytest.raises(TypeError, match=r"x: expected dtype .*got int8"):
        L.quantize_mxfp4(jnp.ones((2, 32), jnp.int8))
    with pytest.raises(TypeError, match=r"packed: expected dtype int8, got uint8"):
        L.dequantize_mxfp4(jnp.ones((2, 16), jnp.uint8), jnp.ones((2, 1)))
    with pytest.raises(ValueError, match=r"sf: expected shape \(2, 1\) .*got \(2, 2\)"):
        L.dequantize_mxfp4(jnp.ones((2, 16), jnp.int8), jnp.ones((2, 2)))
    with pytest.raises(ValueError, match=r"codes: expected an even last axis K"):
        L.pack_e2m1(jnp.ones((3,), jnp.uint8))
    with pytest.raises(ValueError, match=r"group_size: expected a positive int, got -32"):
        L.quantize_mxfp4(jnp.ones((2, 32)), group_size=-32)
