"""DeepGEMM scale-layout memory images and transform_sf_into_required_layout, bit-exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import layouts as L
from run_mode import property_examples
from test_layouts_np_model import np_exponent_byte, np_mn_major_image, np_pack_bytes


SETTINGS = settings(max_examples=property_examples(25), deadline=None)

to_img_j = jax.jit(L.to_mn_major_tma_aligned)
from_img_j = jax.jit(L.from_mn_major_tma_aligned, static_argnums=1)
pack_img_j = jax.jit(L.pack_ue8m0_mn_major_tma_aligned)
unpack_img_j = jax.jit(L.unpack_ue8m0_mn_major_tma_aligned, static_argnums=(1, 2))


def _pow2(rng, shape):
    return np.ldexp(1.0, rng.integers(-40, 40, size=shape)).astype(np.float32)


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.lists(st.integers(1, 3), max_size=2), st.integers(1, 23), st.integers(1, 9))
def test_fp32_image_bit_exact_and_inverse(seed, lead, mn, g):
    sf = np.random.default_rng(seed).normal(size=(*lead, mn, g)).astype(np.float32)
    img = np.asarray(to_img_j(jnp.asarray(sf)))
    assert img.dtype == np.float32 and img.shape == (*lead, g, -(-mn // 4) * 4)
    np.testing.assert_array_equal(img, np_mn_major_image(sf, np.float32))
    np.testing.assert_array_equal(np.asarray(from_img_j(jnp.asarray(img), mn)), sf)


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.lists(st.integers(1, 3), max_size=2), st.integers(1, 23), st.integers(1, 11))
def test_packed_image_bit_exact_and_inverse(seed, lead, mn, g):
    sf = _pow2(np.random.default_rng(seed), (*lead, mn, g))
    img = np.asarray(pack_img_j(jnp.asarray(sf)))
    assert img.dtype == np.int32 and img.shape == (*lead, -(-g // 4), -(-mn // 4) * 4)
    # model: pack bytes along G per row, then MN-major with zero padding
    words = np_pack_bytes(np_exponent_byte(sf))  # (..., mn, ceil(g/4))
    np.testing.assert_array_equal(img, np_mn_major_image(words, np.int32))
    np.testing.assert_array_equal(np.asarray(unpack_img_j(jnp.asarray(img), mn, g)), sf)


def test_packed_image_byte_positions():
    # sf[m, g] = 2^(m + 10 g): check exact byte placement in the raw little-endian buffer
    mn, g = 5, 6
    e = np.arange(mn)[:, None] + 10 * np.arange(g)[None, :]
    img = np.asarray(L.pack_ue8m0_mn_major_tma_aligned(jnp.asarray(np.ldexp(1.0, e).astype(np.float32))))
    raw = img.astype("<i4").tobytes()
    am = 8  # align(5, 4)
    for m in range(mn):
        for j in range(g):
            assert raw[(j // 4) * am * 4 + m * 4 + j % 4] == e[m, j] + 127
    for j in range(2):  # padding columns and the missing groups 6, 7 are zero
        for m in range(mn, am):
            assert raw[j * am * 4 + m * 4: j * am * 4 + m * 4 + 4] == b"\0\0\0\0"
    assert all(raw[am * 4 + m * 4 + b] == 0 for m in range(mn) for b in (2, 3))


def test_packed_image_rejects_non_pow2_eagerly():
    with pytest.raises(ValueError, match=r"sf: expected positive powers of two"):
        L.pack_ue8m0_mn_major_tma_aligned(jnp.array([[1.0, 3.0]], jnp.float32))


# ---- transform_sf_into_required_layout ----

def test_transform_sm90_activation_and_weight():
    rng = np.random.default_rng(5)
    mn, k = 37, 300
    sf = rng.uniform(0.1, 2, size=(mn, 3)).astype(np.float32)
    out = np.asarray(L.transform_sf_into_required_layout(jnp.asarray(sf), mn, k, (1, 128), arch=90))
    np.testing.assert_array_equal(out, np_mn_major_image(sf, np.float32))
    # grouped (masked) activation scales: (G, ceil(K/128), align(m_pad, 4))
    sfg = rng.uniform(0.1, 2, size=(4, mn, 3)).astype(np.float32)
    out = np.asarray(L.transform_sf_into_required_layout(jnp.asarray(sfg), mn, k, (1, 128), num_groups=4, arch=90))
    assert out.shape == (4, 3, 40)
    np.testing.assert_array_equal(out, np_mn_major_image(sfg, np.float32))
    w = rng.uniform(0.1, 2, size=(4, 2, 3)).astype(np.float32)  # (G, ceil(200/128), ceil(300/128))
    out = np.asarray(L.transform_sf_into_required_layout(jnp.asarray(w), 200, k, (128, 128), num_groups=4, arch=90))
    np.testing.assert_array_equal(out, w)


@pytest.mark.parametrize("recipe,k", [((1, 128), 300), ((1, 32), 200), ((128, 128), 300)])
def test_transform_sm100_packed(recipe, k):
    rng = np.random.default_rng(6)
    groups, mn = 3, 130
    gmn, gk = recipe
    sf = _pow2(rng, (groups, -(-mn // gmn), -(-k // gk)))
    out = np.asarray(jax.jit(lambda s: L.transform_sf_into_required_layout(
        s, mn, k, recipe, num_groups=groups, arch=100))(jnp.asarray(sf)))
    rows = np.repeat(sf, gmn, axis=1)[:, :mn] if gmn > 1 else sf  # per-row broadcast of block scales
    want = np_mn_major_image(np_pack_bytes(np_exponent_byte(rows)), np.int32)
    assert out.shape == (groups, -(-(-(-k // gk)) // 4), 132)
    np.testing.assert_array_equal(out, want)
    # an image that is already packed passes through unchanged
    same = L.transform_sf_into_required_layout(jnp.asarray(out), mn, k, recipe, num_groups=groups, arch=100)
    np.testing.assert_array_equal(np.asarray(same), out)


def test_transform_sm100_ue8m0_cast_is_opt_in():
    sf = jnp.array([[0.3, 1.0, 5.0]], jnp.float32)
    with pytest.raises(ValueError, match=r"sf: expected positive powers of two"):
        L.transform_sf_into_required_layout(sf, 1, 96, (1, 32), arch=100)
    out = L.transform_sf_into_required_layout(sf, 1, 96, (1, 32), arch=100, ue8m0_cast=True)
    got = L.unpack_ue8m0_mn_major_tma_aligned(out, 1, 3)
    assert np.asarray(got).tolist() == [[0.5, 1.0, 8.0]]


def test_transform_bad_input():
    sf = jnp.ones((10, 3), jnp.float32)
    with pytest.raises(ValueError, match=r"arch: expected one of \(90, 100\), got 80"):
        L.transform_sf_into_required_layout(sf, 10, 300, (1, 128), arch=80)
    with pytest.raises(ValueError, match=r"recipe: expected one of .* for arch 90, got \(1, 32\)"):
        L.transform_sf_into_required_layout(jnp.ones((10, 10), jnp.float32), 10, 300, (1, 32), arch=90)
    with pytest.raises(ValueError, match=r"recipe: expected one of .* for arch 100, got \(1, 96\)"):
        L.transform_sf_into_required_layout(jnp.ones((10, 4), jnp.float32), 10, 300, (1, 96), arch=100)
    with pytest.raises(ValueError, match=r"recipe: expected a \(gran_mn, gran_k\) tuple of ints, got \[1, 128\]"):
        L.transform_sf_into_required_layout(sf, 10, 300, [1, 128], arch=90)
    with pytest.raises(ValueError, match=r"sf: expected shape \(10, 4\) .* got \(10, 3\)"):
        L.transform_sf_into_required_layout(sf, 10, 400, (1, 128), arch=90)
    with pytest.raises(ValueError, match=r"sf: expected shape \(2, 10, 3\) .* got \(10, 3\)"):
        L.transform_sf_into_required_layout(sf, 10, 300, (1, 128), num_groups=2, arch=100)
    with pytest.raises(TypeError, match=r"sf: expected dtype float32, got int32"):
        L.transform_sf_into_required_layout(jnp.ones((10, 3), jnp.int32), 10, 300, (1, 128), arch=90)
    with pytest.raises(ValueError, match=r"sf: expected a packed UE8M0 image of shape \(1, 12\) .* got \(1, 10\)"):
        L.transform_sf_into_required_layout(jnp.ones((1, 10), jnp.int32), 10, 300, (1, 128), arch=100)


def test_image_bad_input():
    with pytest.raises(TypeError, match=r"sf: expected dtype float32, got bfloat16"):
        L.to_mn_major_tma_aligned(jnp.ones((4, 2), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"sf: expected at least 2 dims"):
        L.pack_ue8m0_mn_major_tma_aligned(jnp.ones((4,), jnp.float32))
    with pytest.raises(ValueError, match=r"image: expected last axis align\(mn, 4\) = 8 for mn = 5, got shape \(2, 4\)"):
        L.from_mn_major_tma_aligned(jnp.ones((2, 4), jnp.float32), 5)
    with pytest.raises(ValueError, match=r"image: expected 2 rows \(axis -2\), got shape \(1, 8\)"):
        L.unpack_ue8m0_mn_major_tma_aligned(jnp.ones((1, 8), jnp.int32), 5, 6)
    with pytest.raises(TypeError, match=r"image: expected dtype int32, got float32"):
        L.unpack_ue8m0_mn_major_tma_aligned(jnp.ones((2, 8), jnp.float32), 5, 6)
