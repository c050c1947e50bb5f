"""The fused MoE op (`custom_calls.fused_moe`): its reference against a float64 NumPy model of the
kernel's numerics written here (loops over tokens and slots; e4m3 and bf16 rounding through
ml_dtypes), the amax floor, the route canonicalization, the output, the argument checks and the
registry wiring.

How the model is compared. The reference rounds where the model rounds (e4m3 of the tokens and
of the activation, bf16 of each slot's GEMM2 row and of the sum), but computes its GEMMs and
activation in fp32 where the model uses float64. So the model carries, next to each value, a bound
on that fp32 noise and propagates it through every rounding: a rounding whose input interval holds
no rounding boundary gives one value, so most outputs have a one-value interval [lo, hi] and must
match exactly; the others may take any value of their (short) interval. The fp32 noise bound of
an n-term dot is 8 u sqrt(n) ||terms||_2 (u = 2^-24): the typical error of n roundings is about
u sqrt(n / 6) ||terms||_2, so this leaves a wide margin, while the worst case n u sum|terms| would
widen nearly every interval past a rounding boundary and hide a wrong order of operations
(`test_the_check_catches_the_weight_applied_after_quantization`).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import custom_calls as cc
from custom_calls.contracts import canonical_topk_ids

E4M3, BF16, F32 = ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16, np.float32
U = 2.0 ** -24  # fp32 unit roundoff


# ------------------------------------------------------------------------------ the NumPy model

def _e4m3(v) -> np.ndarray:
    """Saturating round-to-nearest-even to e4m3 (from fp32, as the kernel converts), as float64."""
    return np.clip(np.asarray(v, F32), -448, 448).astype(E4M3).astype(np.float64)


def _bf16(v) -> np.ndarray:
    return np.asarray(np.asarray(v, np.float64).astype(F32).astype(BF16), np.float64)


def _blocks(w, s) -> np.ndarray:
    """e4m3 (..., N, K) with 128x128 block scales -> float64 values."""
    s = np.repeat(np.repeat(np.asarray(s, np.float64), 128, -2), 128, -1)
    return np.asarray(w).astype(np.float64) * s


def _quantize_token(x32: np.ndarray, floor: float) -> np.ndarray:
    """The kernel's input stage: per 128 values sf = max(amax, floor) / 448 and q = e4m3(x * (1 / sf)),
    every step in fp32 (bit for bit what the reference must compute) -> dequantized, float64."""
    g = x32.reshape(-1, 128)
    sf = np.maximum(np.abs(g).max(1), F32(floor)) / F32(448)
    q = _e4m3(g * (F32(1) / sf)[:, None])
    return (q * sf[:, None]).reshape(-1)


def _dot_noise(w: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Bound on the fp32 error of w @ v (module docstring); +2 terms for the fp32 dequantizations."""
    return 8 * U * np.sqrt(w.shape[1] + 2) * np.sqrt((w * w) @ (v * v))


def model(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, *, routed_scaling_factor,
          activation_clamp, floor=1e-10):
    """-> (y, lo, hi, clamped): y the model's own (M, H) output, [lo, hi] what an fp32 evaluation
    may give, clamped the fraction of gate/up values the clamp changed."""
    x = np.asarray(x).astype(F32)
    ids, tw = np.asarray(topk_ids), np.asarray(topk_weights)
    m, h = x.shape
    e, two_i, _ = w13.shape
    i = two_i // 2
    c = np.inf if activation_clamp is None else activation_clamp
    w13d, w2d = _blocks(w13, w13_scale), _blocks(w2, w2_scale)
    y, lo, hi = (np.zeros((m, h)) for _ in range(3))
    n_clamped = n_act = 0
    for t in range(m):
        xd = _quantize_token(x[t], floor)
        seen = set()
        acc, acc_lo, acc_hi = (np.zeros(h, F32) for _ in range(3))  # the combine sums in fp32
        for j in range(ids.shape[1]):
            ex = int(ids[t, j])
            if not 0 <= ex < e or ex in seen:  # not a route, or the token named this expert already
                continue
            seen.add(ex)
            gu, dgu = w13d[ex] @ xd, _dot_noise(w13d[ex], xd)
            g_raw, u_raw = gu[:i], gu[i:]
            g, u = np.minimum(g_raw, c), np.clip(u_raw, -c, c)
            n_clamped += int((g != g_raw).sum() + (u != u_raw).sum())
            n_act += 2 * i
            # half-widths of g and u after the clamps (which are monotone)
            dg = (np.minimum(g_raw + dgu[:i], c) - np.minimum(g_raw - dgu[:i], c)) / 2
            du = (np.clip(u_raw + dgu[i:], -c, c) - np.clip(u_raw - dgu[i:], -c, c)) / 2
            weight = float(F32(tw[t, j]) * F32(routed_scaling_factor))  # formed in fp32 by the kernel
            silu = g / (1 + np.exp(-g))
            a = silu * u * weight
            # |silu'| <= 1.1; ~10 fp32 roundings in exp, 1 + e, 1 / ., and the three products
            da = abs(weight) * (1.1 * dg * (np.abs(u) + du) + np.abs(silu) * du) + 10 * U * np.abs(a)
            a32, da = a.astype(F32).reshape(-1, 128), da.reshape(-1, 128)
            amax = np.maximum(np.abs(a32).max(1), F32(floor))
            sf = amax * F32(1 / 448)  # the epilogue multiplies by fl(1/448)
            inv = F32(1) / sf
            v = (a32 * inv[:, None]).astype(np.float64)
            q = _e4m3(v)
            # the fp32 group maximum lies in [max(|a| - da), max(|a| + da)]: relative width of sf
            amax_lo = np.maximum((np.abs(a32) - da).max(1), floor)
            amax_hi = np.maximum((np.abs(a32) + da).max(1), floor)
            rel = (np.maximum(amax_hi - amax, amax - amax_lo) / amax + 4 * U)[:, None]
            dv = inv[:, None] * da + np.abs(v) * rel
            dq = np.maximum(_e4m3(v + dv) - q, q - _e4m3(v - dv))  # rounding is monotone
            ad = (q * sf[:, None]).reshape(-1)
            dad = (dq * sf[:, None] + np.abs(q * sf[:, None]) * (rel + U)).reshape(-1)
            o = w2d[ex] @ ad
            do = np.abs(w2d[ex]) @ dad + _dot_noise(w2d[ex], ad) + U * np.abs(o)
            acc = (acc + _bf16(o).astype(F32)).astype(F32)
            acc_lo = (acc_lo + _bf16(o - do).astype(F32)).astype(F32)
            acc_hi = (acc_hi + _bf16(o + do).astype(F32)).astype(F32)
        y[t], lo[t], hi[t] = _bf16(acc), _bf16(acc_lo), _bf16(acc_hi)
    return y, lo, hi, n_clamped / max(n_act, 1)


def assert_within(got, lo, hi, what="reference"):
    got = np.asarray(got, np.float64)
    out = ~((lo <= got) & (got <= hi))
    if out.any():
        t, col = np.argwhere(out)[0]
        raise AssertionError(f"{what}: {out.sum()} of {out.size} values outside the model's interval, first "
                             f"y[{t}, {col}] = {got[t, col]!r} not in [{lo[t, col]!r}, {hi[t, col]!r}]")


# ------------------------------------------------------------------------------ inputs

def make_inputs(rng, m, h, i, e, k, *, drop=0.2):
    """Fresh random operands: tokens of varied scale, routes with some -1 slots (with M > 1 the last
    token has none, token 0 at least one),
    weights as e4m3 values with 128x128 block scales that are not powers of two."""
    x = rng.standard_normal((m, h)) * rng.uniform(0.1, 10.0, (m, 1))
    ids = np.argsort(rng.random((m, e)), axis=1)[:, :k].astype(np.int32)
    first = ids[0, 0]
    ids[rng.random((m, k)) < drop] = -1
    ids[0, 0] = first
    if m > 1:
        ids[-1] = -1
    tw = rng.uniform(0.05, 1.0, (m, k)).astype(F32)

    def weight(shape, std):
        q = np.clip(rng.standard_normal(shape) * 64, -448, 448).astype(E4M3)
        s = (rng.uniform(0.5, 2.0, (*shape[:-2], shape[-2] // 128, shape[-1] // 128)) * std / 64).astype(F32)
        return jnp.asarray(q), jnp.asarray(s)

    w13, w13_scale = weight((e, 2 * i, h), 0.05)
    w2, w2_scale = weight((e, h, i), 0.05)
    return [jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids), jnp.asarray(tw), w13, w13_scale, w2, w2_scale]


def _np_args(args):
    return [np.asarray(a) for a in args]


SHAPES = [  # (M, H, I, E, k)
    (1, 256, 128, 3, 1),
    (5, 384, 256, 8, 2),
    (33, 256, 128, 3, 2),
    (33, 384, 256, 8, 4),
    (33, 384, 128, 8, 4),
    (5, 256, 256, 8, 1),
]


# ------------------------------------------------------------------------------ numerics

@pytest.mark.parametrize("clamp", [None, 0.75])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "m{}_h{}_i{}_e{}_k{}".format(*s))
def test_reference_matches_the_numpy_model(shape, clamp):
    m, h, i, e, k = shape
    rng = np.random.default_rng(list(shape) + [clamp is None])
    args = make_inputs(rng, m, h, i, e, k)
    got = cc.fused_moe(*args, routed_scaling_factor=2.5, activation_clamp=clamp)
    assert got.shape == (m, h) and got.dtype == jnp.bfloat16
    y, lo, hi, clamped = model(*_np_args(args), routed_scaling_factor=2.5, activation_clamp=clamp)
    assert_within(got, lo, hi)
    # not vacuous: a value differs from the model's own rounding only where fp32 noise straddles a
    # rounding boundary, which is rare (measured: under 0.1% of the values)
    assert np.mean(np.asarray(got, np.float64) == y) >= 0.99
    if clamp is not None:  # the clamp is active on these inputs
        assert clamped > 0.1


def _weight_in_the_combine(args, routed_scaling_factor):
    """The staged path's order of operations (the un-permute weights the bf16 GEMM2 rows): each slot
    run alone with weight 1, then y = bf16(sum_j w_j * scaling * o_j)."""
    x, ids, tw, *weights = args
    k = ids.shape[1]
    acc = np.zeros(x.shape, F32)
    for j in range(k):
        alone = jnp.where(jnp.arange(k)[None, :] == j, ids, -1)
        o = np.asarray(cc.fused_moe(x, alone, jnp.ones_like(tw), *weights), F32)
        w = np.asarray(tw)[:, j:j + 1] * F32(routed_scaling_factor)
        acc = acc + np.where(np.asarray(ids)[:, j:j + 1] >= 0, o * w, F32(0))
    return _bf16(acc)


@pytest.mark.parametrize("shape", [(33, 256, 128, 3, 2), (5, 384, 256, 8, 1)], ids=["k2", "k1"])
def test_the_check_catches_the_weight_applied_after_quantization(shape):
    m, h, i, e, k = shape
    args = make_inputs(np.random.default_rng(7), m, h, i, e, k)
    _, lo, hi, _ = model(*_np_args(args), routed_scaling_factor=2.5, activation_clamp=None)
    assert_within(cc.fused_moe(*args, routed_scaling_factor=2.5), lo, hi)
    with pytest.raises(AssertionError, match="outside the model's interval"):
        assert_within(_weight_in_the_combine(args, 2.5), lo, hi, "weight in the combine")


def test_amax_floor_is_the_kernels_1e_10():
    """Token 1 is scaled by 1e-6: its groups' amax lies between 1e-10 and the 1e-4 floor of
    `layouts.fp8`, its activations' about 1e-10. Token 2's only route has weight 1e-14: its
    activations' amax lies below 1e-10, where the floor sets their scale. Both tokens
    also tell the weight applied after the activation's quantization (its scale not floored) apart."""
    rng = np.random.default_rng(3)
    args = make_inputs(rng, 5, 256, 128, 3, 2, drop=0.0)
    x, ids, tw = np.array(args[0], F32), np.array(args[1]), np.array(args[2])
    x[1] *= 1e-6
    ids[2, 1], tw[2, 0] = -1, 1e-14
    assert np.all((np.abs(x[1]).reshape(-1, 128).max(1) > 1e-10) & (np.abs(x[1]).reshape(-1, 128).max(1) < 1e-4))
    args[:3] = [jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids), jnp.asarray(tw)]
    got = np.asarray(cc.fused_moe(*args, routed_scaling_factor=1.5), np.float64)
    _, lo, hi, _ = model(*_np_args(args), routed_scaling_factor=1.5, activation_clamp=None)
    assert_within(got, lo, hi)
    assert np.all(np.abs(got[1:3]).max(1) > 0)
    other, _, _, _ = model(*_np_args(args), routed_scaling_factor=1.5, activation_clamp=None, floor=1e-4)
    for t in (1, 2):  # the other floor gives values the check refuses
        with pytest.raises(AssertionError):
            assert_within(other[t:t + 1], lo[t:t + 1], hi[t:t + 1])


def test_out_of_range_and_repeated_ids_are_dropped():
    args = make_inputs(np.random.default_rng(5), 6, 256, 128, 4, 3, drop=0.0)
    ids = np.array([[0, 4, 1], [2, 2, 3], [-7, 1, 1], [3, 99, -1], [1, 0, 1], [-1, -1, 2]], np.int32)
    args[1] = jnp.asarray(ids)
    want = np.array([[0, -1, 1], [2, -1, 3], [-1, 1, -1], [3, -1, -1], [1, 0, -1], [-1, -1, 2]], np.int32)
    np.testing.assert_array_equal(np.asarray(canonical_topk_ids(args[1], 4)), want)
    got = cc.fused_moe(*args, routed_scaling_factor=0.5)
    _, lo, hi, _ = model(*_np_args(args), routed_scaling_factor=0.5, activation_clamp=None)
    assert_within(got, lo, hi)  # the model skips such slots on its own
    dropped = cc.fused_moe(args[0], jnp.asarray(want), *args[2:], routed_scaling_factor=0.5)
    np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(dropped, F32))


# ------------------------------------------------------------------------------ the output

def test_every_output_written_and_jit_matches_eager():
    m, h = 17, 384
    args = make_inputs(np.random.default_rng(11), m, h, 128, 8, 4, drop=0.4)
    ids = np.asarray(args[1])
    eager = np.asarray(cc.fused_moe(*args, routed_scaling_factor=2.0, activation_clamp=3.0), np.float64)
    fn = jax.jit(lambda *a: cc.fused_moe(*a, routed_scaling_factor=2.0, activation_clamp=3.0))
    jitted = np.asarray(fn(*args), np.float64)
    np.testing.assert_array_equal(jitted, eager)
    assert np.isfinite(eager).all()
    routed = (ids >= 0).any(1)
    assert routed.sum() >= m - 3 and not routed.all()  # both kinds of rows are present
    assert np.all(eager[~routed] == 0)
    # a routed row is a sum of GEMM rows: a zero would be a row or column left unwritten
    assert np.all(np.count_nonzero(eager[routed], axis=1) >= 0.99 * h)
    empty = cc.fused_moe(args[0][:0], args[1][:0], args[2][:0], *args[3:])
    assert empty.shape == (0, h) and empty.dtype == jnp.bfloat16


# ------------------------------------------------------------------------------ the checks

def _good():
    return dict(zip(("x", "topk_ids", "topk_weights", "w13", "w13_scale", "w2", "w2_scale"),
                    make_inputs(np.random.default_rng(0), 4, 256, 128, 3, 2)))


def test_interleaved_w13_gives_the_same_output():
    """w13 stored gate/up interleaved (the kernel's form) with w13_interleave set: bit-identical."""
    from layouts import interleave_gate_up
    kw = _good()
    base = np.asarray(cc.fused_moe(**kw, routed_scaling_factor=1.5).astype(jnp.float32))
    for g in (8, 16):
        inter = dict(kw, w13=interleave_gate_up(kw["w13"], g))
        got = np.asarray(cc.fused_moe(**inter, routed_scaling_factor=1.5, w13_interleave=g).astype(jnp.float32))
        np.testing.assert_array_equal(got, base)
        wrong = np.asarray(cc.fused_moe(**inter, routed_scaling_factor=1.5).astype(jnp.float32))
        assert not np.array_equal(wrong, base)  # the row order matters: the flag is not a no-op


def _with(**changes):
    def build():
        kw = _good()
        kw.update({name: (f(kw) if callable(f) else f) for name, f in changes.items()})
        return kw
    return build


def _f32(shape):
    return jnp.ones(shape, jnp.float32)


def _bf(shape):
    return jnp.ones(shape, jnp.bfloat16)


def _e4(shape):
    return jnp.ones(shape, jnp.float8_e4m3fn)


def _cast(name, dtype):
    return lambda kw: kw[name].astype(dtype)


BAD = [  # good operands: M 4, H 256, I 128, E 3, top_k 2
    (_with(x=_bf((1, 4, 256))), ValueError, r"x: expected rank 2 \(M, H\), got shape \(1, 4, 256\)"),
    (_with(x=_f32((4, 256))), TypeError, "x: expected dtype bfloat16, got float32"),
    (_with(x=_bf((4, 200))), ValueError, r"x: expected H \(x.shape\[1\]\) to be a multiple of 128, got 200"),
    (_with(x=_bf((4, 0))), ValueError, r"x: expected H > 0, got shape \(4, 0\)"),
    (_with(topk_ids=jnp.zeros((4,), jnp.int32)), ValueError,
     r"topk_ids: expected rank 2 \(M, top_k\), got shape \(4,\)"),
    (_with(topk_ids=jnp.zeros((4, 2), jnp.uint32)), TypeError, "topk_ids: expected dtype int32, got uint32"),
    (_with(topk_ids=jnp.zeros((5, 2), jnp.int32)), ValueError,
     r"topk_ids: expected shape \(M, top_k\) with M = 4 \(tokens of x\) and top_k >= 1, got \(5, 2\)"),
    (_with(topk_ids=jnp.zeros((4, 0), jnp.int32), topk_weights=_f32((4, 0))), ValueError,
     r"topk_ids: expected .* top_k >= 1, got \(4, 0\)"),
    (_with(topk_weights=_f32((4, 3))), ValueError,
     r"topk_weights: expected shape \(4, 2\) \(as topk_ids\), got \(4, 3\)"),
    (_with(topk_weights=_cast("topk_weights", jnp.bfloat16)), TypeError,
     "topk_weights: expected dtype float32, got bfloat16"),
    (_with(w13=_e4((256, 256))), ValueError, r"w13: expected rank 3 \(E, 2I, H\), got shape \(256, 256\)"),
    (_with(w13=_cast("w13", jnp.bfloat16)), TypeError, "w13: expected dtype float8_e4m3fn, got bfloat16"),
    (_with(w13=_e4((3, 256, 384))), ValueError,
     r"w13: expected shape \(E, 2I, H\) with .* H = 256 \(as x\), got \(3, 256, 384\)"),
    (_with(w13=_e4((3, 255, 256))), ValueError, r"w13: expected .* 2I > 0 even .* got \(3, 255, 256\)"),
    (_with(w13=_e4((3, 192, 256))), ValueError,
     r"w13: expected I \(w13.shape\[1\] / 2\) to be a multiple of 128, got 96"),
    (_with(w13_scale=_f32((3, 2, 1))), ValueError,
     r"w13_scale: expected shape \(3, 2, 2\) \(\(E, 2I/128, H/128\) of w13\), got \(3, 2, 1\)"),
    (_with(w13_scale=_cast("w13_scale", jnp.bfloat16)), TypeError, "w13_scale: expected dtype float32, got bfloat16"),
    (_with(w2=_e4((3, 128, 256))), ValueError,
     r"w2: expected shape \(3, 256, 128\) \(\(E, H, I\) of w13 and x\), got \(3, 128, 256\)"),
    (_with(w2=_cast("w2", jnp.float8_e5m2)), TypeError, "w2: expected dtype float8_e4m3fn, got float8_e5m2"),
    (_with(w2_scale=_f32((2, 2, 1))), ValueError,
     r"w2_scale: expected shape \(3, 2, 1\) \(\(E, H/128, I/128\) of w2\), got \(2, 2, 1\)"),
    (_with(w2_scale=_cast("w2_scale", jnp.float16)), TypeError, "w2_scale: expected dtype float32, got float16"),
]
BAD_STATIC = [
    ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor: expected a finite float, got nan"),
    ({"routed_scaling_factor": "2"}, "routed_scaling_factor: expected a finite float, got '2'"),
    ({"activation_clamp": 0.0}, "activation_clamp: expected a finite float > 0 or None, got 0.0"),
    ({"activation_clamp": float("inf")}, "activation_clamp: expected a finite float > 0 or None, got inf"),
    ({"backend": "no_such_backend"}, "backend 'no_such_backend': no implementation of op 'fused_moe'"),
    ({"w13_interleave": 3}, "w13_interleave: expected 0 or a positive int dividing I = 128, got 3"),
    ({"w13_interleave": True}, "w13_interleave: expected 0 or a positive int dividing I = 128, got True"),
    ({"arch": "90"}, "arch: expected an int"),
]


@pytest.mark.parametrize("build,exc,match", BAD, ids=[m.split(":")[0] + f"_{n}" for n, (_, _, m) in enumerate(BAD)])
def test_bad_arrays_name_the_argument(build, exc, match):
    with pytest.raises(exc, match=match):
        cc.fused_moe(**build())


@pytest.mark.parametrize("kwargs,match", BAD_STATIC, ids=lambda v: next(iter(v)) if isinstance(v, dict) else "")
def test_bad_static_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cc.fused_moe(**_good(), **kwargs)


# ------------------------------------------------------------------------------ the registry

def test_registry_sees_the_static_arguments_and_the_routes_as_given(monkeypatch):
    """Implementations get the ids as the caller gave them and canonicalize themselves (the SM90
    path inside its input kernel: tests/test_triton_interpret.py; the reference:
    test_out_of_range_and_repeated_ids_are_dropped), so the op adds no pass over them."""
    registry = importlib.import_module("custom_calls.backends")
    spec = registry.op_spec("fused_moe")
    assert spec.stage == "gemm"
    assert spec.static_args == {"m", "hidden", "intermediate", "num_experts", "top_k", "x_dtype", "weight_dtype",
                                "routed_scaling_factor", "activation_clamp", "w13_interleave", "arch", "settings"}
    # a throwaway backend, in copies of the registry's tables (restored after the test)
    monkeypatch.setattr(registry, "_IMPLS", {op: dict(impls) for op, impls in registry._IMPLS.items()})
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    seen = {}

    def supports(**static):
        seen["static"] = static
        return static["intermediate"] >= 256, f"intermediate: expected >= 256, got {static['intermediate']}"

    def impl(*arrays, **kwargs):
        seen["ids"], seen["kwargs"] = np.asarray(arrays[1]), kwargs
        return jnp.zeros(arrays[0].shape, jnp.bfloat16)

    registry.register("fused_moe", "test_fused", impl, supports=supports)
    kw = _good()
    kw["topk_ids"] = jnp.asarray([[0, 0], [5, 1], [-1, 2], [2, -3]], jnp.int32)
    with pytest.raises(ValueError, match="intermediate: expected >= 256, got 128"):
        cc.fused_moe(**kw, backend="test_fused")
    assert seen["static"] == {"m": 4, "hidden": 256, "intermediate": 128, "num_experts": 3, "top_k": 2,
                              "x_dtype": jnp.dtype(jnp.bfloat16), "weight_dtype": jnp.dtype(jnp.float8_e4m3fn),
                              "routed_scaling_factor": 1.0, "activation_clamp": None, "w13_interleave": 0,
                              "arch": 90, "settings": cc.KernelSettings.from_environment()}
    registry.register("fused_moe", "test_fused", impl)  # supports everything
    settings = cc.KernelSettings(command_buffer=True, num_sms=66)
    cc.fused_moe(**kw, routed_scaling_factor=2, activation_clamp=7, backend="test_fused", settings=settings)
    np.testing.assert_array_equal(seen["ids"], [[0, 0], [5, 1], [-1, 2], [2, -3]])
    assert seen["kwargs"] == {"routed_scaling_factor": 2.0, "activation_clamp": 7.0, "w13_interleave": 0,
                              "settings": settings}
    assert isinstance(seen["kwargs"]["routed_scaling_factor"], float)


# ------------------------------------------------------------------------------ with its routing

def _routed_case(seed, m=21, h=256, i=128, e=4, e_route=16, bias=True):
    rng = np.random.default_rng(seed)
    args = make_inputs(rng, m, h, i, e, 2)
    x = args[0]
    gate = jnp.asarray(rng.standard_normal((e_route, h)) * 0.1, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(e_route) * 0.1, jnp.float32) if bias else None
    return x, gate, b, args[3:]


@pytest.mark.parametrize("offset", [0, 4, 12])
def test_routed_reference_is_the_router_then_route_topk_then_fused_moe(offset):
    """The reference of `fused_moe_routed`: the bf16 router GEMM with fp32 sums, `route_topk`, the
    ids moved by expert_offset (traced under jit as the EP wrappers pass it), then `fused_moe`:
    the same bits as the three ops called one after the other."""
    x, gate, bias, weights = _routed_case(offset)
    kw = dict(top_k=3, scoring="sigmoid", n_group=4, topk_group=2)
    rw = dict(routed_scaling_factor=2.5, activation_clamp=0.5)
    got = jax.jit(lambda off: cc.fused_moe_routed(x, gate, bias, *weights, expert_offset=off, **kw, **rw,
                                                  backend="reference"))(jnp.int32(offset))
    logits = jnp.einsum("mh,eh->me", x.astype(jnp.float32), gate.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    ids, w = cc.route_topk(logits, bias, **kw, backend="reference")
    want = cc.fused_moe(x, ids - offset, w, *weights, **rw, backend="reference")
    assert (np.asarray(ids) - offset >= 0).any() and ((np.asarray(ids) - offset < 0) | (np.asarray(ids) - offset >= 4)).any()
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_routed_op_checks_and_registry_statics(monkeypatch):
    """Bad routing arguments are refused as `route_topk` refuses them, bad branch arguments as
    `fused_moe` does; a backend's `supports` sees the routing statics beside the branch's."""
    x, gate, bias, weights = _routed_case(1)
    with pytest.raises(ValueError, match=r"top_k: expected an int in \[1, 16\]"):
        cc.fused_moe_routed(x, gate, bias, *weights, top_k=17, scoring="sigmoid")
    with pytest.raises(ValueError, match="e_score_correction_bias: expected shape"):
        cc.fused_moe_routed(x, gate, bias[:3], *weights, top_k=2, scoring="sigmoid")
    with pytest.raises(ValueError, match="w2: expected shape"):
        cc.fused_moe_routed(x, gate, bias, *weights[:2], weights[2][:, :, :64], weights[3], top_k=2, scoring="sigmoid")
    with pytest.raises(ValueError, match="gate_weight: expected shape"):
        cc.fused_moe_routed(x, gate[:, :128], bias, *weights, top_k=2, scoring="sigmoid")
    registry = importlib.import_module("custom_calls.backends")
    monkeypatch.setattr(registry, "_IMPLS", {op: dict(impls) for op, impls in registry._IMPLS.items()})
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    seen = {}

    def supports(**static):
        seen.update(static)
        return False, "test_routed: refuses everything"

    registry.register("fused_moe_routed", "test_routed", lambda *a, **k: None, supports=supports)
    with pytest.raises(ValueError, match="refuses everything"):
        cc.fused_moe_routed(x, gate, bias, *weights, top_k=2, scoring="softmax", n_group=4, topk_group=3,
                            backend="test_routed")
    assert {k: seen[k] for k in ("num_experts", "num_route_experts", "top_k", "scoring", "n_group", "topk_group")} \
        == dict(num_experts=4, num_route_experts=16, top_k=2, scoring="softmax", n_group=4, topk_group=3)
    assert seen["gate_dtype"] == jnp.dtype(jnp.bfloat16)


def test_layer_routes_inside_the_fused_op_only_where_that_is_the_same_computation(monkeypatch):
    """moe_forward with the fused layout calls `fused_moe_routed` for a bf16 router with the route
    and gemm stages on one backend, with the same output bits as routing first; an fp32 gate, hash
    routing's ids, checked mode or a route stage on another backend route first."""
    import dataclasses

    from moe_jax import MoEConfig, init_params, moe_forward, prepare_params
    from moe_jax import layer as layer_mod

    cfg = MoEConfig.deepseek_v3(num_experts=16, n_shared_experts=1, n_group=4, topk_group=2, recipe="fp8_block",
                                arch=90, layout="fused").scaled(hidden_size=256, intermediate_size=128, top_k=4)
    params = prepare_params(init_params(jax.random.PRNGKey(3), cfg), cfg)
    bf16_gate = dataclasses.replace(params, gate_weight=params.gate_weight.astype(jnp.bfloat16))
    x = jax.random.normal(jax.random.PRNGKey(4), (11, cfg.hidden_size), jnp.bfloat16)
    calls = []
    real = layer_mod.fused_moe_routed
    monkeypatch.setattr(layer_mod, "fused_moe_routed", lambda *a, **k: calls.append(k["backend"]) or real(*a, **k))
    inside = moe_forward(x, bf16_gate, cfg)
    assert calls == ["reference"]
    calls.clear()
    monkeypatch.setattr(layer_mod, "fused_moe_routed", lambda *a, **k: pytest.fail("routed inside the op"))
    sizes = (cfg.num_experts, cfg.intermediate_size)
    plan = layer_mod.plan_routed(x.shape[0], cfg, bf16_gate, sizes, layout="fused", backend="reference", settings=None,
                                 routes_per_token=cfg.top_k, shared_intermediate_size=cfg.intermediate_size)
    assert plan.layout == "fused" and set(plan.backends.values()) == {"reference"}
    first = layer_mod._routed(x, *layer_mod.route_tokens(x, bf16_gate, cfg, None, "reference"), bf16_gate, cfg, plan,
                              expert_offset=0, out_dtype=x.dtype,
                              addend=layer_mod.shared_mlp(x, bf16_gate, cfg, out_dtype=None))
    np.testing.assert_array_equal(np.asarray(inside.astype(jnp.float32)), np.asarray(first.astype(jnp.float32)))
    moe_forward(x, params, cfg)  # fp32 gate: the fp32 router GEMM runs first
    moe_forward(x, bf16_gate, cfg, debug_checks=True)
    moe_forward(x, bf16_gate, cfg, backend={"route": "reference", "gemm": None})
