"""Load-time weight paths (SPEC §2.1) against numpy models."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import layouts as L
from test_layouts_np_model import (
    E4M3,
    np_block_amax,
    np_ceil_pow2,
    np_e2m1_value,
    np_exponent_byte,
    np_group_amax,
    np_mn_major_image,
    np_pack_bytes,
    np_pack_nibbles,
    np_quant_e4m3,
)


def jv(f):
    """vmap under one jit (eager vmap dispatches, and compiles, op by op)."""
    return jax.jit(jax.vmap(f))

mx2fp8_j = jax.jit(L.mxfp4_to_fp8_block)
prepare_j = jax.jit(L.prepare_expert_weights, static_argnames=("recipe", "arch"))
requant_j = jax.jit(L.requant_fp8_block_ue8m0)
_decode = np.vectorize(np_e2m1_value, otypes=[np.float64])


def _mxfp4_inputs(rng, lead, n, k, span):
    codes = rng.integers(0, 16, size=(*lead, n, k)).astype(np.uint8)
    base = rng.integers(-20, 20, size=lead + (1, 1))
    e = base + rng.integers(0, span + 1, size=(*lead, n, -(-k // 32)))
    return codes, np_pack_nibbles(codes), np.ldexp(1.0, e).astype(np.float32)


def _np_mxfp4_to_fp8(codes, sf32):
    """Model: per 128x128 tile, sf128 = max scale / 64; e4m3(value * scale / sf128)."""
    n, k = codes.shape[-2:]
    lead = codes.shape[:-2]
    nb, kb = -(-n // 128), -(-k // 128)
    sf128 = np.zeros((*lead, nb, kb))
    for i in range(nb):
        for j in range(kb):
            sf128[..., i, j] = sf32[..., i * 128:(i + 1) * 128, j * 4:(j + 1) * 4].max(axis=(-2, -1)) / 64.0
    rows = np.repeat(np.repeat(sf128, 128, -2), 128, -1)[..., :n, :k]
    vals = _decode(codes) * np.repeat(sf32.astype(np.float64), 32, -1)[..., :k] / rows
    return vals.astype(np.float32).astype(E4M3), sf128.astype(np.float32), rows


@pytest.mark.parametrize("lead,n,k", [((), 128, 128), ((2,), 130, 96), ((2,), 256, 320)])
def test_mxfp4_to_fp8_block_bit_exact_and_lossless(lead, n, k):
    rng = np.random.default_rng(n + k)
    codes, packed, sf32 = _mxfp4_inputs(rng, lead, n, k, span=6)
    w, sf128 = mx2fp8_j(jnp.asarray(packed), jnp.asarray(sf32))
    want_w, want_sf, rows = _np_mxfp4_to_fp8(codes, sf32)
    assert w.dtype == jnp.float8_e4m3fn and w.shape == (*lead, n, k)
    assert sf128.shape == (*lead, -(-n // 128), -(-k // 128))
    np.testing.assert_array_equal(np.asarray(sf128), want_sf)
    np.testing.assert_array_equal(np.asarray(w).view(np.uint8), want_w.view(np.uint8))
    # lossless: the fp8 values times the block scale equal the e2m1 values times their scales
    orig = _decode(codes) * np.repeat(sf32.astype(np.float64), 32, -1)[..., :k]
    np.testing.assert_array_equal(np.asarray(w).astype(np.float64) * rows, orig)


def test_mxfp4_to_fp8_block_exact_up_to_span_14_lossy_from_15():
    rng = np.random.default_rng(11)
    codes = rng.integers(0, 16, size=(128, 128)).astype(np.uint8)
    codes[0, 32:36] = [1, 3, 9, 11]  # +-0.5, +-1.5: the first values to be lost
    packed = np_pack_nibbles(codes)
    orig_vals = _decode(codes)
    for span, exact in ((14, True), (15, False)):
        e = np.zeros((128, 4), np.int64)
        e[0, 1] = -span  # group 1 of row 0 sits `span` binades below the tile max
        sf32 = np.ldexp(1.0, e).astype(np.float32)
        w, sf128 = mx2fp8_j(jnp.asarray(packed), jnp.asarray(sf32))
        deq = np.asarray(w).astype(np.float64) * float(np.asarray(sf128)[0, 0])
        orig = orig_vals * np.repeat(sf32.astype(np.float64), 32, -1)
        assert np.array_equal(deq, orig) == exact
        if not exact:  # only the far group changes: 0.5 -> 0 and 1.5 -> 2 (nearest even)
            diff = np.argwhere(deq != orig)
            assert set(map(tuple, diff)) <= {(0, c) for c in range(32, 64)}
            assert deq[0, 32:36].tolist() == [x * 2.0**-15 for x in (0.0, 2.0, -0.0, -2.0)]


def _np_requant(q, sf):
    n, k = q.shape[-2:]
    rows = np.repeat(np.repeat(sf, 128, -2), 128, -1)[..., :n, :k]
    w = (q.astype(np.float32) * rows).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    new_sf = np_ceil_pow2(np.maximum(np_block_amax(w, 128), float(np.float32(1e-4))) / 448.0).astype(np.float32)
    new_rows = np.repeat(np.repeat(new_sf, 128, -2), 128, -1)[..., :n, :k]
    return np_quant_e4m3(w, new_rows), new_sf


@pytest.mark.parametrize("lead,n,k", [((), 128, 256), ((2,), 200, 130)])
def test_requant_fp8_block_ue8m0_bit_exact(lead, n, k):
    rng = np.random.default_rng(n * k)
    w = rng.normal(size=(*lead, n, k)).astype(np.float32)
    q, sf = jax.jit(L.quantize_fp8_per_block)(jnp.asarray(w))  # non-power-of-two scales
    q2, sf2 = requant_j(q, sf)
    want_q, want_sf = _np_requant(np.asarray(q), np.asarray(sf))
    np.testing.assert_array_equal(np.asarray(sf2), want_sf)
    np.testing.assert_array_equal(np.asarray(q2).view(np.uint8), want_q.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(L.is_ue8m0(sf2)), True)


def test_requant_keeps_power_of_two_scaled_values():
    rng = np.random.default_rng(13)
    w = rng.normal(size=(2, 256, 200)).astype(np.float32)
    q, sf = jax.jit(functools.partial(L.quantize_fp8_per_block, ue8m0=True))(jnp.asarray(w))
    q2, sf2 = requant_j(q, sf)
    d1 = jax.jit(L.dequantize_fp8_per_block)(q, sf)
    d2 = jax.jit(L.dequantize_fp8_per_block)(q2, sf2)
    np.testing.assert_array_equal(np.asarray(d1), np.asarray(d2))
    q3, sf3 = jv(L.requant_fp8_block_ue8m0)(q, sf)
    np.testing.assert_array_equal(np.asarray(q3).view(np.uint8), np.asarray(q2).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(sf3), np.asarray(sf2))


def test_expand_per_tensor_scale():
    s = np.array([0.5, 1.7, 3.25], np.float32)
    out = np.asarray(jax.jit(L.expand_per_tensor_scale, static_argnums=(1, 2))(jnp.asarray(s), 300, 129))
    assert out.shape == (3, 3, 2)
    for e in range(3):
        assert np.all(out[e] == s[e])
    out_v = jv(lambda x: L.expand_per_tensor_scale(x, 300, 129))(jnp.asarray(s))
    np.testing.assert_array_equal(np.asarray(out_v), out)
    with pytest.raises(TypeError, match=r"scale: expected dtype float32, got bfloat16"):
        L.expand_per_tensor_scale(jnp.ones((3,), jnp.bfloat16), 300, 129)
    with pytest.raises(ValueError, match=r"n: expected a positive int, got 0"):
        L.expand_per_tensor_scale(jnp.ones((3,), jnp.float32), 0, 129)


# ---- prepare_expert_weights: the whole path per (recipe, arch) ----

def test_prepare_mxfp4_sm100_path_a_and_sm90_path_b():
    rng = np.random.default_rng(14)
    codes, packed, sf32 = _mxfp4_inputs(rng, (2,), 130, 256, span=6)
    w, img = prepare_j(jnp.asarray(packed), jnp.asarray(sf32), recipe="mxfp4", arch=100)
    np.testing.assert_array_equal(np.asarray(w), packed)
    np.testing.assert_array_equal(np.asarray(img), np_mn_major_image(np_pack_bytes(np_exponent_byte(sf32)), np.int32))
    # uint8 exponent-byte scales (checkpoint form) give the same image
    _, img_b = prepare_j(jnp.asarray(packed), jnp.asarray(np_exponent_byte(sf32)), recipe="mxfp4", arch=100)
    np.testing.assert_array_equal(np.asarray(img_b), np.asarray(img))
    w90, sf90 = prepare_j(jnp.asarray(packed), jnp.asarray(sf32), recipe="mxfp4", arch=90)
    want_w, want_sf, _ = _np_mxfp4_to_fp8(codes, sf32)
    np.testing.assert_array_equal(np.asarray(w90).view(np.uint8), want_w.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(sf90), want_sf)


def test_prepare_fp8_block_paths():
    rng = np.random.default_rng(15)
    w = rng.normal(size=(2, 200, 300)).astype(np.float32)
    q, sf = jax.jit(L.quantize_fp8_per_block)(jnp.asarray(w))
    q90, sf90 = L.prepare_expert_weights(q, sf, recipe="fp8_block", arch=90)
    assert q90 is q and sf90 is sf
    q100, img = prepare_j(q, sf, recipe="fp8_block", arch=100)
    want_q, want_sf = _np_requant(np.asarray(q), np.asarray(sf))
    np.testing.assert_array_equal(np.asarray(q100).view(np.uint8), want_q.view(np.uint8))
    rows = np.repeat(want_sf, 128, axis=-2)[:, :200]
    assert img.shape == (2, 1, 200)
    np.testing.assert_array_equal(np.asarray(img), np_mn_major_image(np_pack_bytes(np_exponent_byte(rows)), np.int32))


def test_prepare_mxfp8_from_high_precision_and_bf16():
    rng = np.random.default_rng(16)
    w = rng.normal(size=(2, 6, 96)).astype(np.float32)
    q, img = prepare_j(jnp.asarray(w), None, recipe="mxfp8", arch=100)
    # numpy model: 32-groups along K, sf = ceil_pow2(max(amax, 1e-4) / 448), MN-major packed image
    want_sf = np_ceil_pow2(np.maximum(np_group_amax(w, 32), float(np.float32(1e-4))) / 448.0)
    want_q = np_quant_e4m3(w, np.repeat(want_sf, 32, -1).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    assert img.shape == (2, 1, 8)
    want_img = np_mn_major_image(np_pack_bytes(np_exponent_byte(want_sf)), np.int32)
    np.testing.assert_array_equal(np.asarray(img), want_img)
    assert np.all(want_img[..., 6:] == 0) and np.all(want_img[..., :6] != 0)  # padding / written
    wb = jnp.asarray(w, jnp.bfloat16)
    assert L.prepare_expert_weights(wb, None, recipe="bf16", arch=90) == (wb, None)


def test_prepare_bad_input():
    w8 = jnp.ones((2, 4, 128), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"arch: recipe 'mxfp8' runs on \[100\], got 90"):
        L.prepare_expert_weights(w8, jnp.ones((2, 4, 4)), recipe="mxfp8", arch=90)
    with pytest.raises(ValueError, match=r"arch: expected one of \(90, 100\), got 89"):
        L.prepare_expert_weights(w8, jnp.ones((2, 1, 1)), recipe="fp8_block", arch=89)
    with pytest.raises(TypeError, match=r"w: expected dtype bfloat16, got float32"):
        L.prepare_expert_weights(jnp.ones((2, 4, 8)), None, recipe="bf16", arch=90)
    with pytest.raises(ValueError, match=r"scale: expected a scale array for recipe 'fp8_block', got None"):
        L.prepare_expert_weights(w8, None, recipe="fp8_block", arch=90)
    with pytest.raises(ValueError, match=r"w: expected at least 3 dims \(E, N, K\)"):
        L.prepare_expert_weights(jnp.ones((4, 8), jnp.bfloat16), None, recipe="bf16", arch=90)


def test_mxfp4_to_fp8_block_bad_input():
    with pytest.raises(TypeError, match=r"packed: expected dtype int8, got uint8"):
        L.mxfp4_to_fp8_block(jnp.ones((4, 64), jnp.uint8), jnp.ones((4, 4)))
    with pytest.raises(ValueError, match=r"sf32: expected shape \(4, 4\) .* got \(4, 2\)"):
        L.mxfp4_to_fp8_block(jnp.ones((4, 64), jnp.int8), jnp.ones((4, 2)))
    with pytest.raises(TypeError, match=r"q: expected dtype float8_e4m3fn, got float32"):
        L.requant_fp8_block_ue8m0(jnp.ones((4, 64)), jnp.ones((1, 1)))
