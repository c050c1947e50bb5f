"""FP8 quantizers/dequantizers against the numpy model (bit-exact) and their error bounds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import layouts as L
from run_mode import property_examples
from test_layouts_np_model import np_block_amax, np_fp8_scale, np_group_amax, np_quant_e4m3


SETTINGS = settings(max_examples=property_examples(15), deadline=None)  # one compilation per drawn shape

qtg_j = jax.jit(L.quantize_fp8_per_token_group, static_argnums=(1, 2))
qblk_j = jax.jit(L.quantize_fp8_per_block, static_argnums=(1, 2))
dqtg_j = jax.jit(L.dequantize_fp8_per_token_group, static_argnums=2)
dqblk_j = jax.jit(L.dequantize_fp8_per_block, static_argnums=2)


def _rand(rng, shape, dtype=np.float32):
    # spread magnitudes over several binades per row so groups differ
    x = rng.normal(size=shape) * np.exp2(rng.integers(-6, 7, size=shape[:-1] + (1,)))
    return x.astype(dtype)


def _check_scales(sf, want64, ue8m0):
    sf = np.asarray(sf)
    assert sf.dtype == np.float32 and sf.shape == want64.shape
    if ue8m0:
        np.testing.assert_array_equal(sf, want64.astype(np.float32))
    else:  # XLA may multiply by the rounded reciprocal of 448: two roundings, |rel err| <= 2^-23
        assert np.all(np.abs(sf - want64) <= 2.0**-23 * want64)


def _same_bits(a, b):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.lists(st.integers(1, 4), max_size=2), st.integers(1, 300),
       st.sampled_from([128, 32, 7]), st.booleans())
def test_per_token_group_bit_exact(seed, lead, k, gs, ue8m0):
    rng = np.random.default_rng(seed)
    x = _rand(rng, (*lead, k))
    q, sf = qtg_j(jnp.asarray(x), gs, ue8m0)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == x.shape
    _check_scales(sf, np_fp8_scale(np_group_amax(x, gs), ue8m0), ue8m0)
    sfr = np.repeat(np.asarray(sf), gs, axis=-1)[..., :k]
    _same_bits(q, np_quant_e4m3(x, sfr))
    # error bound: e4m3 rounds to 3 mantissa bits; subnormals have step 2^-9 * sf
    deq = np.asarray(dqtg_j(q, sf, gs)).astype(np.float64)
    bound = 2.0**-4 * np.abs(x) + 2.0**-10 * sfr + 1e-30
    assert np.all(np.abs(deq - x) <= bound)


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.lists(st.integers(1, 3), max_size=1), st.integers(1, 140),
       st.integers(1, 260), st.sampled_from([128, 64, 5]), st.booleans())
def test_per_block_bit_exact(seed, lead, n, k, bs, ue8m0):
    rng = np.random.default_rng(seed)
    w = _rand(rng, (*lead, n, k))
    q, sf = qblk_j(jnp.asarray(w), bs, ue8m0)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == w.shape
    _check_scales(sf, np_fp8_scale(np_block_amax(w, bs), ue8m0), ue8m0)
    sfr = np.repeat(np.repeat(np.asarray(sf), bs, -2), bs, -1)[..., :n, :k]
    _same_bits(q, np_quant_e4m3(w, sfr))
    deq = np.asarray(dqblk_j(q, sf, bs)).astype(np.float64)
    assert np.all(np.abs(deq - w) <= 2.0**-4 * np.abs(w) + 2.0**-10 * sfr + 1e-30)


def test_mxfp8_is_group32_ue8m0():
    x = _rand(np.random.default_rng(5), (3, 100))
    q, sf = jax.jit(L.quantize_mxfp8)(jnp.asarray(x))
    assert sf.shape == (3, 4)
    want = np_fp8_scale(np_group_amax(x, 32), True)
    np.testing.assert_array_equal(np.asarray(sf), want.astype(np.float32))
    _same_bits(q, np_quant_e4m3(x, np.repeat(want, 32, -1)[:, :100].astype(np.float32)))


def test_bf16_input_matches_model():
    x = jnp.asarray(_rand(np.random.default_rng(6), (4, 256)), jnp.bfloat16)
    x64 = np.asarray(x, np.float32)
    q, sf = qtg_j(x, 128, True)
    np.testing.assert_array_equal(np.asarray(sf), np_fp8_scale(np_group_amax(x64, 128), True).astype(np.float32))
    _same_bits(q, np_quant_e4m3(x64, np.repeat(np.asarray(sf), 128, -1)))


def test_ue8m0_boundary_amax_exact_power_of_two():
    # amax = 448 * 2^k: the scale must be exactly 2^k and the max element must quantize to 448
    ks = np.arange(-10, 11)
    x = np.zeros((len(ks), 128), np.float32)
    rng = np.random.default_rng(7)
    x[:, :] = rng.uniform(-1, 1, size=x.shape) * 448.0 * np.exp2(ks)[:, None] * 0.5
    x[:, 3] = 448.0 * np.exp2(ks)
    q, sf = qtg_j(jnp.asarray(x), 128, True)
    np.testing.assert_array_equal(np.asarray(sf)[:, 0], np.exp2(ks).astype(np.float32))
    assert np.all(np.asarray(q)[:, 3].astype(np.float32) == 448.0)
    # one ulp above: the scale doubles
    x[:, 3] = np.nextafter(x[:, 3], np.float32(np.inf))
    _, sf = qtg_j(jnp.asarray(x), 128, True)
    np.testing.assert_array_equal(np.asarray(sf)[:, 0], np.exp2(ks + 1).astype(np.float32))


@pytest.mark.parametrize("ue8m0", [True, False])
def test_never_exceeds_448_and_no_nan(ue8m0):
    rng = np.random.default_rng(8)
    # many amax values on and next to the 448 * 2^k boundaries, plus huge values
    x = rng.uniform(-1, 1, size=(64, 128)).astype(np.float32)
    x[:, 0] = np.nextafter((448.0 * np.exp2(rng.integers(-20, 20, 64))).astype(np.float32), np.float32(np.inf))
    x[:8, 1] = 3e38
    q, sf = qtg_j(jnp.asarray(x), 128, ue8m0)
    qf = np.asarray(q).astype(np.float32)
    assert not np.any(np.isnan(qf)) and np.max(np.abs(qf)) <= 448.0
    # with UE8M0 the real quotient already fits: x / sf <= 448 before any clipping
    if ue8m0:
        ratio = np.abs(x.astype(np.float64)) / np.repeat(np.asarray(sf, np.float64), 128, -1)
        assert np.max(ratio) <= 448.0


def test_amax_floor_for_tiny_groups():
    x = np.full((2, 40), 1e-9, np.float32)
    x[1] = -3e-7
    _, sf = qtg_j(jnp.asarray(x), 32, False)
    np.testing.assert_allclose(np.asarray(sf), np.float32(1e-4) / 448.0, rtol=1e-6)


# ---- bad input ----

def test_bad_dtype():
    with pytest.raises(TypeError, match=r"x: expected dtype float32 or bfloat16 or float16, got int32"):
        L.quantize_fp8_per_token_group(jnp.ones((2, 128), jnp.int32))
    with pytest.raises(TypeError, match=r"w: expected dtype .*got float8_e4m3fn"):
        L.quantize_fp8_per_block(jnp.ones((2, 128), jnp.float8_e4m3fn))
    with pytest.raises(TypeError, match=r"q: expected dtype float8_e4m3fn, got float32"):
        L.dequantize_fp8_per_token_group(jnp.ones((2, 128)), jnp.ones((2, 1)))
    with pytest.raises(TypeError, match=r"sf: expected dtype float32, got int32"):
        L.dequantize_fp8_per_block(jnp.ones((2, 128), jnp.float8_e4m3fn), jnp.ones((1, 1), jnp.int32))


def test_bad_group_size_and_shapes():
    with pytest.raises(ValueError, match=r"group_size: expected a positive int, got 0"):
        L.quantize_fp8_per_token_group(jnp.ones((2, 128)), group_size=0)
    with pytest.raises(ValueError, match=r"block_size: expected a positive int, got 1.5"):
        L.quantize_fp8_per_block(jnp.ones((2, 128)), block_size=1.5)
    with pytest.raises(ValueError, match=r"w: expected at least 2 dims \(\.\.\., N, K\), got shape \(128,\)"):
        L.quantize_fp8_per_block(jnp.ones((128,)))
    with pytest.raises(ValueError, match=r"sf: expected shape \(2, 2\) .* got \(2, 1\)"):
        L.dequantize_fp8_per_token_group(jnp.ones((2, 130), jnp.float8_e4m3fn), jnp.ones((2, 1)))
    with pytest.raises(ValueError, match=r"sf: expected shape \(1, 2\) .* got \(2, 2\)"):
        L.dequantize_fp8_per_block(jnp.ones((100, 200), jnp.float8_e4m3fn), jnp.ones((2, 2)))
