"""Independent numpy/float64 models of the layouts formats, used by the other test_layouts_* files,
and checks of the models themselves against hand-computed values."""

import math

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
E2M1_TABLE = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def np_ceil_pow2(v) -> np.ndarray:
    """Smallest power of two >= |v| in float64, clamped to [2^-126, 2^127]; NaN -> 2^127."""
    with np.errstate(invalid="ignore"):
        v = np.abs(np.asarray(v, np.float64))
    out = np.empty(v.shape, np.float64)
    for i, a in np.ndenumerate(v):
        if math.isnan(a) or a > 2.0**127:
            out[i] = 2.0**127
        elif a <= 2.0**-126:
            out[i] = 2.0**-126
        else:
            m, e = math.frexp(a)  # a = m * 2^e, m in [0.5, 1)
            out[i] = a if m == 0.5 else math.ldexp(1.0, e)
    return out


def np_exponent_byte(p) -> np.ndarray:
    """Biased exponent of positive normal powers of two (float64 input) as uint8."""
    p = np.asarray(p, np.float64)
    out = np.zeros(p.shape, np.uint8)
    for i, a in np.ndenumerate(p):
        m, e = math.frexp(a)
        assert m == 0.5, a
        out[i] = e - 1 + 127
    return out


def np_pack_bytes(b: np.ndarray) -> np.ndarray:
    """uint8 (..., G) -> int32 (..., ceil(G/4)) little-endian words, zero padded."""
    g = b.shape[-1]
    w = -(-g // 4)
    pad = np.zeros(b.shape[:-1] + (4 * w,), np.uint8)
    pad[..., :g] = b
    out = np.zeros(b.shape[:-1] + (w,), np.int64)
    for i in range(4):
        out += pad[..., i::4].astype(np.int64) << (8 * i)
    return out.astype(np.uint32).view(np.int32)


def np_fp8_scale(amax: np.ndarray, ue8m0: bool) -> np.ndarray:
    amax = np.maximum(np.asarray(amax, np.float64), float(np.float32(1e-4)))
    s = amax / 448.0
    return np_ceil_pow2(s) if ue8m0 else s


def np_quant_e4m3(x32: np.ndarray, sf32: np.ndarray) -> np.ndarray:
    """x (..., n) f32, sf broadcastable f32 -> e4m3 of clip(x * (1/sf)) computed in f32."""
    inv = (np.float32(1.0) / sf32.astype(np.float32)).astype(np.float32)
    y = (x32.astype(np.float32) * inv).astype(np.float32)
    return np.clip(y, -448, 448).astype(E4M3)


def np_group_amax(x: np.ndarray, gs: int) -> np.ndarray:
    k = x.shape[-1]
    g = -(-k // gs)
    pad = np.zeros(x.shape[:-1] + (g * gs,), np.float64)
    pad[..., :k] = np.abs(x.astype(np.float64))
    return pad.reshape(x.shape[:-1] + (g, gs)).max(-1)


def np_block_amax(w: np.ndarray, bs: int) -> np.ndarray:
    n, k = w.shape[-2:]
    nb, kb = -(-n // bs), -(-k // bs)
    pad = np.zeros(w.shape[:-2] + (nb * bs, kb * bs), np.float64)
    pad[..., :n, :k] = np.abs(w.astype(np.float64))
    return pad.reshape(w.shape[:-2] + (nb, bs, kb, bs)).max(axis=(-3, -1))


def np_e2m1_code(y: float) -> int:
    """Nearest e2m1 magnitude, ties to the even code; sign bit only for nonzero codes."""
    a = min(abs(float(y)), 6.0)
    d = np.abs(E2M1_TABLE - a)
    best = np.flatnonzero(d == d.min())
    code = int(best[0]) if len(best) == 1 else int([c for c in best if c % 2 == 0][0])
    return code | (8 if (y < 0 and code != 0) else 0)


def np_e2m1_codes(y: np.ndarray) -> np.ndarray:
    """Array form of ``np_e2m1_code`` (same rule, vectorized): (...) float -> (...) uint8."""
    y = np.asarray(y, np.float64)
    a = np.minimum(np.abs(y), 6.0)[..., None]
    d = np.abs(E2M1_TABLE - a)
    nearest = d == d.min(-1, keepdims=True)
    tie = nearest.sum(-1) > 1
    even = nearest & (np.arange(8) % 2 == 0)
    code = np.where(tie, even.argmax(-1), nearest.argmax(-1)).astype(np.uint8)
    return code | np.where((y < 0) & (code != 0), 8, 0).astype(np.uint8)


def np_e2m1_value(code: int) -> float:
    v = E2M1_TABLE[code & 7]
    return -v if code & 8 else v


def np_pack_nibbles(codes: np.ndarray) -> np.ndarray:
    c = codes.astype(np.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8).view(np.int8)


def np_mn_major_image(sf: np.ndarray, fill_dtype) -> np.ndarray:
    """(..., MN, G) -> (..., G, align(MN, 4)) with image[..., g, m] = sf[..., m, g], zero padding."""
    mn, g = sf.shape[-2:]
    out = np.zeros(sf.shape[:-2] + (g, -(-mn // 4) * 4), fill_dtype)
    for m in range(mn):
        for j in range(g):
            out[..., j, m] = sf[..., m, j]
    return out


# ---- the models against hand-computed values ----

def test_np_ceil_pow2_known_values():
    got = np_ceil_pow2([0.0, 1.0, 1.5, 3.0, 2.0**-130, 0.75, 2.0**127, 2.0**128, -5.0])
    want = [2.0**-126, 1.0, 2.0, 4.0, 2.0**-126, 1.0, 2.0**127, 2.0**127, 8.0]
    assert got.tolist() == want


def test_np_e2m1_code_known_values():
    cases = {0.25: 0, 0.26: 1, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6, 5.01: 7, 9.0: 7,
             -0.1: 0, -0.5: 9, -6.0: 15, 0.0: 0}
    for y, code in cases.items():
        assert np_e2m1_code(y) == code, y


def test_np_e2m1_codes_matches_scalar_model():
    ys = np.linspace(-7, 7, 2801)
    assert np_e2m1_codes(ys).tolist() == [np_e2m1_code(y) for y in ys]


def test_np_pack_bytes_known_value():
    b = np.array([[1, 2, 3, 4, 5]], np.uint8)
    assert np_pack_bytes(b).tolist() == [[0x04030201, 0x5]]
