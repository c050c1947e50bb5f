"""Gradients (README "Gradients"): the reference backend's gradients against an independent float32
model of the layer, the correction bias's zero gradient, what FP8 / bf16 quantization does to a
cotangent, and the error of a derivative that reaches an accelerated implementation (a throwaway
backend here; the Triton backend under Triton's interpreter, in a subprocess).

Routing's expert choice is piecewise constant: the model takes the layer's expert ids as given and
differentiates everything else (the routing weights included)."""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import custom_calls as cc
import moe_jax as mj
from layouts import gemm_format, quantize_fp8_per_token_group
from interpreter_script import run_under_interpreter

registry = importlib.import_module("custom_calls.backends")  # the package attribute is a function

CFG = mj.MoEConfig.deepseek_v3().scaled(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128)
M = 8
HI = jax.lax.Precision.HIGHEST
E4M3 = ml_dtypes.float8_e4m3fn


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ------------------------------------------------------------------------------------------------
# parameters drawn in NumPy (cheaper than init_params' jax draws here), GEMM form via prepare_params
# ------------------------------------------------------------------------------------------------

def _fp8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(E, N, K) f32, N and K multiples of 128 -> (e4m3 values, (E, N/128, K/128) f32 block scales)."""
    e, n, k = w.shape
    amax = np.abs(w.reshape(e, n // 128, 128, k // 128, 128)).max(axis=(2, 4))
    sf = (np.maximum(amax, 1e-4) / 448.0).astype(np.float32)
    full = np.repeat(np.repeat(sf, 128, axis=1), 128, axis=2)
    return np.clip(w / full, -448, 448).astype(E4M3), sf


def make_params(cfg: mj.MoEConfig, seed: int = 0) -> mj.MoEParams:
    """GEMM-form params of `cfg` (bf16 or fp8_block experts, bf16 shared expert, f32 router)."""
    rng = np.random.default_rng(seed)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size

    def normal(shape, fan_in):
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    w13, w2 = normal((e, 2 * i, h), h), normal((e, h, i), i)
    if cfg.recipe == "bf16":
        (w13, s13), (w2, s2) = (w13.astype(ml_dtypes.bfloat16), None), (w2.astype(ml_dtypes.bfloat16), None)
    else:
        (w13, s13), (w2, s2) = _fp8_blocks(w13), _fp8_blocks(w2)

    def arr(a):
        return None if a is None else jnp.asarray(a)

    bias = (0.1 * rng.standard_normal(e)).astype(np.float32)
    p = mj.MoEParams(gate_weight=arr(normal((e, h), h)), w13=arr(w13), w2=arr(w2), w13_scale=arr(s13),
                     w2_scale=arr(s2), e_score_correction_bias=arr(bias),
                     shared_w13=arr(normal((2 * i, h), h).astype(ml_dtypes.bfloat16)),
                     shared_w2=arr(normal((h, i), i).astype(ml_dtypes.bfloat16)))
    return mj.prepare_params(p, cfg)


def make_inputs(seed: int = 1) -> tuple[jax.Array, jax.Array]:
    """x (M, H) bf16 tokens and r (M, H) f32, the probe of the loss sum(y * r)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, CFG.hidden_size)), jnp.bfloat16)
    return x, jnp.asarray(rng.standard_normal((M, CFG.hidden_size)), jnp.float32)


# ------------------------------------------------------------------------------------------------
# the independent float32 model: dense over experts, ids fixed
# ------------------------------------------------------------------------------------------------

def _mlp(x, w13, w2):
    h = jnp.dot(x, w13.T, precision=HI)
    i = h.shape[-1] // 2
    return jnp.dot(jax.nn.silu(h[:, :i]) * h[:, i:], w2.T, precision=HI)


def model_loss(x, gate, w13, w2, shared_w13, shared_w2, ids, r, *, rsf: float):
    """sum(y * r), y = rsf * sum over each token's experts (ids, fixed) of weight * expert(x) +
    shared(x); sigmoid scores, weights renormalized over the chosen experts. All float32."""
    x = x.astype(jnp.float32)
    scores = jax.nn.sigmoid(jnp.dot(x, gate.T, precision=HI))
    w = jnp.take_along_axis(scores, ids, axis=1)
    w = w / jnp.sum(w, axis=1, keepdims=True)
    combine = jnp.zeros(scores.shape, jnp.float32).at[jnp.arange(x.shape[0])[:, None], ids].set(w)  # (M, E)
    every = jax.vmap(lambda a, b: _mlp(x, a, b))(w13, w2)  # (E, M, H): every expert on every token
    y = rsf * jnp.einsum("me,emh->mh", combine, every, precision=HI) + _mlp(x, shared_w13, shared_w2)
    return jnp.sum(y * r)


def _block_dequant(q, sf):
    return q.astype(jnp.float32) * jnp.repeat(jnp.repeat(sf, 128, axis=-2), 128, axis=-1)


@functools.cache
def gradients(recipe: str) -> tuple[mj.MoEParams, dict]:
    """(params, results) of the layer with `recipe`, from one compiled function (compiling is the
    cost): the layer's gradients of sum(y * r) w.r.t. x ("gx") and the params ("gp"); "model", the
    float32 model's gradients w.r.t. x, gate_weight, the expert weights (fp8_block: their scales)
    and the shared expert, on the layer's expert ids ("ids"); "pushed_ids", the ids with expert 0's
    correction bias raised by 10."""
    cfg = CFG.scaled(recipe=recipe)
    params = make_params(cfg)
    x, r = make_inputs()

    def layer_loss(x, p, r):
        return jnp.sum(mj.moe_forward(x, p, cfg).astype(jnp.float32) * r)

    def run(x, p, r):
        gx, gp = jax.grad(layer_loss, argnums=(0, 1))(x, p, r)
        ids = mj.route(x, p, cfg)[0]
        pushed = p.replace(e_score_correction_bias=p.e_score_correction_bias.at[0].add(10.0))
        loss = functools.partial(model_loss, ids=ids, r=r, rsf=cfg.routed_scaling_factor)
        if recipe == "fp8_block":  # the model's expert weights: the e4m3 values times their scales

            def model(x, gate, s13, s2, sh13, sh2):
                return loss(x, gate, _block_dequant(p.w13, s13), _block_dequant(p.w2, s2), sh13, sh2)

            experts = (p.w13_scale, p.w2_scale)
        else:
            model, experts = loss, (p.w13.astype(jnp.float32), p.w2.astype(jnp.float32))
        want = jax.grad(model, argnums=tuple(range(6)))(
            x.astype(jnp.float32), p.gate_weight, *experts, p.shared_w13.astype(jnp.float32),
            p.shared_w2.astype(jnp.float32))
        return {"gx": gx, "gp": gp, "model": want, "ids": ids, "pushed_ids": mj.route(x, pushed, cfg)[0]}

    return params, jax.device_get(jax.jit(run)(x, params, r))


# Tolerances (relative Frobenius error against the float32 model):
#  bf16: the layer rounds GEMM outputs and activations to bf16 in the forward pass, and JAX casts the
#    cotangents of those bf16 values to bf16 too (2^-9 relative each): measured 2.8e-3..4.7e-3 -> 1e-2.
#  fp8_block: the activations are quantized to e4m3 in the forward pass (the model keeps them in
#    float32), and the cotangent crossing each quantization is rounded to e4m3 (3 mantissa bits; at
#    its magnitude cotangent x scale, mostly e4m3's subnormal range): measured x 0.084, gate_weight
#    0.031, weight scales 0.035-0.037 -> 0.2 / 0.1. The bf16 shared expert stays at the bf16 level.
@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
def test_reference_gradients_match_the_float32_model(recipe):
    p, res = gradients(recipe)
    gx, gp = res["gx"], res["gp"]
    if recipe == "bf16":
        got = (gx, gp.gate_weight, gp.w13, gp.w2, gp.shared_w13, gp.shared_w2)
        tols = (1e-2,) * 6
    else:  # w.r.t. the FP8 weights' scales (the e4m3 values' own gradient: below)
        got = (gx, gp.gate_weight, gp.w13_scale, gp.w2_scale, gp.shared_w13, gp.shared_w2)
        tols = (0.2, 0.1, 0.1, 0.1, 1e-2, 1e-2)
    names = ("x", "gate_weight", "w13", "w2", "shared_w13", "shared_w2")
    for name, a, b, tol in zip(names, got, res["model"], tols):
        assert np.all(np.isfinite(np.asarray(a, np.float32))), name
        assert rel_err(a, b) < tol, (name, rel_err(a, b))
    # each gradient comes back in its leaf's dtype: bf16 for bf16 tokens and weights, e4m3 for the
    # FP8 weight values (their cotangent rounded to e4m3, mostly to 0: not an update to apply)
    assert gx.dtype == jnp.bfloat16 and gp.shared_w13.dtype == jnp.bfloat16
    assert gp.w13.dtype == p.w13.dtype and gp.gate_weight.dtype == jnp.float32
    if recipe == "fp8_block":
        assert np.mean(np.asarray(gp.w13, np.float32) == 0) > 0.5


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
def test_correction_bias_gets_exactly_zero_gradient(recipe):
    """The bias shifts the selection only (ids are integers); the weights come from the unbiased
    scores. It does change which experts are chosen."""
    _, res = gradients(recipe)
    bias = res["gp"].e_score_correction_bias
    assert bias.dtype == jnp.float32 and np.all(bias == 0)
    assert (res["pushed_ids"] == 0).any(axis=1).all() and not (res["ids"] == 0).any(axis=1).all()


_quantize_per_group = jax.jit(quantize_fp8_per_token_group, static_argnums=(1, 2))


def _quant_dequant_grad(recipe: str, arch: int, x, c):
    fmt = gemm_format(recipe, arch)

    def f(x, c):
        q, s = fmt.quantize_lhs(x)
        return jnp.sum(c * fmt.dequantize_lhs(q, s))

    return np.asarray(jax.jit(jax.grad(f))(x, c))


def test_quantization_passes_the_cotangent_rounded_to_the_stored_dtype():
    """What the reference's activation quantization (`GemmFormat.quantize_lhs` then
    `dequantize_lhs`, as the permute, activation and GEMM references run it) does to a gradient:
    JAX differentiates the casts as the identity, so the value passes straight through, but the
    cotangent is cast like the value: to bf16 (bf16 recipe), or to e4m3 at the magnitude
    cotangent x scale, then divided by the scale (FP8): e4m3's precision, and zero below half its
    smallest subnormal (2^-10). With fp32 scales (arch 90) the group's largest element also gets a
    gradient through its scale (amax / 448); UE8M0 scales (arch 100) are packed into int32 images
    and pass none."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    c = rng.standard_normal((4, 256)).astype(np.float32)
    g = _quant_dequant_grad("bf16", 90, x, c)
    np.testing.assert_array_equal(g, c.astype(ml_dtypes.bfloat16).astype(np.float32))
    amax = np.abs(x.reshape(4, 2, 128)) == np.abs(x.reshape(4, 2, 128)).max(-1, keepdims=True)
    for arch in (90, 100):
        sf = np.repeat(np.asarray(_quantize_per_group(jnp.asarray(x), 128, arch == 100)[1]), 128, axis=-1)
        want = (c * sf).astype(E4M3).astype(np.float32) * (np.float32(1) / sf)
        g = _quant_dequant_grad("fp8_block", arch, x, c)
        rest = ~amax.reshape(4, 256) if arch == 90 else np.ones((4, 256), bool)
        np.testing.assert_allclose(g[rest], want[rest], rtol=1e-6, atol=0)
        assert rel_err(g[rest], c[rest]) > 1e-2  # not the exact cotangent: e4m3's 3 mantissa bits
        small = _quant_dequant_grad("fp8_block", arch, x, c * 2.0**-10)  # |c| * scale < 2^-10 here
        assert np.all(small[rest] == 0)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
def test_fp8_gradients_depend_on_the_loss_scale_bf16_ones_do_not(recipe):
    """Consequence at the layer: scaling the loss by 2^-10 scales a bf16-recipe gradient exactly
    (bf16 keeps fp32's exponent range) but wipes out most of the FP8 path's gradient w.r.t. x (its
    e4m3-rounded cotangents underflow; measured: 93 % relative change)."""
    cfg = CFG.scaled(recipe=recipe)
    p = make_params(cfg)
    x, r = make_inputs()
    grad = jax.jit(jax.grad(lambda x, r: jnp.sum(mj.moe_forward(x, p, cfg).astype(jnp.float32) * r)))
    g, g_scaled = (np.asarray(grad(x, s * r), np.float64) / s for s in (1.0, 2.0**-10))
    err = rel_err(g_scaled, g)
    assert err == 0 if recipe == "bf16" else err > 0.5, err


# ------------------------------------------------------------------------------------------------
# a derivative reaching an accelerated implementation (registry level)
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def throwaway_backend(monkeypatch):
    """Backend 'test_nograd' (any platform) implementing `unpermute` and `dispatch_map_contig` with
    the reference functions, in copies of the registry's tables (restored after the test)."""
    registry.backends("unpermute")  # load the lazy backends now: their registrations must outlive the copies
    monkeypatch.setattr(registry, "_IMPLS", {op: dict(impls) for op, impls in registry._IMPLS.items()})
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    seen = {}
    unpermute_ref = registry.op_spec("unpermute").reference

    def unpermute_impl(d, src2dst, topk_weights, addend=None, *, routed_scaling_factor, out_dtype):
        seen["kwargs"] = (routed_scaling_factor, out_dtype)
        return unpermute_ref(d, src2dst, topk_weights, addend, routed_scaling_factor=routed_scaling_factor,
                             out_dtype=out_dtype)

    registry.register("unpermute", "test_nograd", unpermute_impl)
    registry.register("dispatch_map_contig", "test_nograd", registry.op_spec("dispatch_map_contig").reference)
    return seen


def _unpermute_case():
    rng = np.random.default_rng(4)
    d = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16)
    s = jnp.asarray(rng.permutation(16)[:12].reshape(6, 2), jnp.int32)
    w = jnp.asarray(rng.random((6, 2)), jnp.float32)
    return d, s, w


def test_derivative_reaching_an_accelerated_implementation_names_op_stage_and_backend(throwaway_backend):
    d, s, w = _unpermute_case()

    def f(d, w, backend):
        return cc.unpermute(d, s, w, routed_scaling_factor=2.5, out_dtype=jnp.float32, backend=backend)

    with pytest.raises(registry.NoGradientError) as info:
        jax.grad(lambda w: jnp.sum(f(d, w, "test_nograd")))(w)
    msg = str(info.value)
    for part in ("op 'unpermute' (stage 'unpermute') ran on backend 'test_nograd', which has no derivative",
                 "reached its input(s) topk_weights.", "backend='reference'", "'unpermute': 'reference'",
                 "jax.lax.stop_gradient"):
        assert part in msg, msg
    with pytest.raises(NotImplementedError, match=r"reached its input\(s\) d\."):  # forward mode too
        jax.jvp(lambda d: f(d, w, "test_nograd"), (d,), (d,))
    with pytest.raises(registry.NoGradientError, match=r"input\(s\) d, topk_weights\."):
        jax.jit(jax.grad(lambda d, w: jnp.sum(f(d, w, "test_nograd")), argnums=(0, 1)))(d, w)
    # the reference differentiates; stop_gradient keeps the derivative away from the implementation
    g_ref = jax.grad(lambda w: jnp.sum(f(d, w, "reference")))(w)
    g_cut = jax.grad(lambda w: jnp.sum(f(d, jax.lax.stop_gradient(w), "test_nograd")) + jnp.sum(w))(w)
    assert np.abs(np.asarray(g_ref)).sum() > 0 and np.all(np.asarray(g_cut) == 1)


def test_wrapped_implementation_keeps_values_statics_jit_and_vmap(throwaway_backend):
    d, s, w = _unpermute_case()

    def f(d, w, backend):
        return cc.unpermute(d, s, w, routed_scaling_factor=2.5, out_dtype=jnp.float32, backend=backend)

    impl = registry.resolve("unpermute", "test_nograd", num_rows=16, hidden=32, num_tokens=6, top_k=2,
                            out_dtype=jnp.dtype(jnp.float32)).impl
    raw = impl.__wrapped__  # the function as registered
    kw = dict(routed_scaling_factor=2.5, out_dtype=jnp.dtype(jnp.float32))
    want = np.asarray(raw(d, s, w, None, **kw))
    np.testing.assert_array_equal(np.asarray(impl(d, s, w, None, **kw)), want)  # eager
    np.testing.assert_array_equal(np.asarray(jax.jit(f, static_argnums=2)(d, w, "test_nograd")), want)
    assert throwaway_backend["kwargs"] == (2.5, jnp.dtype(jnp.float32))  # statics reach it as given
    assert type(throwaway_backend["kwargs"][0]) is float
    batched = jax.vmap(lambda d: f(d, w, "test_nograd"))(jnp.stack([d, 2 * d]))
    np.testing.assert_array_equal(np.asarray(batched[0]), want)
    # only integer inputs (no derivative can reach them): differentiating around the op is fine
    ids = jnp.asarray([[0, 1], [1, 2], [2, 0]], jnp.int32)

    def uses_map(t):
        moved = ids + (jnp.asarray(t) > 0).astype(jnp.int32)
        src2dst = cc.dispatch_map_contig(moved, num_local_experts=4, alignment=8, backend="test_nograd")[0]
        return t * jnp.sum(src2dst).astype(jnp.float32)

    assert float(jax.grad(uses_map)(1.0)) == float(uses_map(1.0))
    # an explicit (float0) tangent on the integer ids: no error, float0 tangents out
    def maps(ids):
        return cc.dispatch_map_contig(ids, num_local_experts=4, alignment=8, backend="test_nograd")

    out, tangents = jax.jvp(maps, (ids,), (np.zeros(ids.shape, jax.dtypes.float0),))
    for a, b, t in zip(out, maps(ids), tangents):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert t.dtype == jax.dtypes.float0


def test_deep_gemm_gradient_error_is_raised_before_any_kernel_runs():
    """The DeepGEMM implementations cannot run here, but the guard answers at trace time, before
    the implementation is called: a gradient reaching GEMM1's lhs or the fused op's router names
    them."""
    registry.backends("unpermute")
    if "deep_gemm" not in registry._IMPLS["m_grouped_gemm_contig"]:
        pytest.skip(f"custom_calls.deep_gemm cannot be imported here: {registry._load('deep_gemm')}")
    gemm = registry._IMPLS["m_grouped_gemm_contig"]["deep_gemm"].impl
    rhs, ids = jnp.ones((2, 256, 256), jnp.bfloat16), jnp.zeros((128,), jnp.int32)

    def f(lhs):
        out = gemm(lhs, rhs, ids, lhs_scale=None, rhs_scale=None, recipe="bf16", arch=90, alignment=128)
        return jnp.sum(out.astype(jnp.float32))

    with pytest.raises(registry.NoGradientError, match=r"^op 'm_grouped_gemm_contig' \(stage 'gemm'\) ran on "
                       r"backend 'deep_gemm', .* reached its input\(s\) lhs\. .*'gemm': 'reference'"):
        jax.jit(jax.grad(f))(jnp.ones((128, 256), jnp.bfloat16))


def test_every_accelerated_implementation_is_wrapped():
    registry.backends("unpermute")  # load the lazy backends that can be imported here
    for op, impls in registry._IMPLS.items():
        for backend, impl in impls.items():
            marked = getattr(impl.impl, "without_derivative", None)
            assert marked == (None if backend == registry.REFERENCE else (op, backend)), (op, backend)


# ------------------------------------------------------------------------------------------------
# the Triton backend under Triton's interpreter
# ------------------------------------------------------------------------------------------------

TRITON_SCRIPT = r"""
import dataclasses, importlib, json, sys
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, "tests")
import moe_jax as mj
from test_gradients import CFG, make_inputs, make_params
registry = importlib.import_module("custom_calls.backends")
cfg = CFG.scaled(recipe="bf16", alignment=8)  # a small contig buffer: the interpreter's time
p = make_params(cfg)
x, r = (a[:4] for a in make_inputs())
forward = jax.jit(mj.moe_forward, static_argnames=("config", "backend"))
out = {}
y = forward(x, p, config=cfg, backend="triton")
wrapped = {op: impls["triton"] for op, impls in registry._IMPLS.items() if "triton" in impls}
for op, impl in wrapped.items():  # the implementations as registered, without the wrapper
    registry._IMPLS[op]["triton"] = dataclasses.replace(impl, impl=impl.impl.__wrapped__)
jax.clear_caches()
y_raw = forward(x, p, config=cfg, backend="triton")
y32 = np.asarray(y, np.float32)
out["finite"] = bool(np.isfinite(y32).all() and np.abs(y32).max() > 0)
out["same_bits"] = bool(np.array_equal(np.asarray(y, np.float32), np.asarray(y_raw, np.float32)))
for op, impl in wrapped.items():
    registry._IMPLS[op]["triton"] = impl

def error(f, *args):
    try:
        jax.jit(jax.grad(f))(*args)
    except registry.NoGradientError as e:
        return str(e)
    return "no error"

loss = lambda x, p: jnp.sum(mj.moe_forward(x, p, cfg, backend="triton").astype(jnp.float32) * r)
out["x"] = error(loss, x, p)
out["w2"] = error(lambda w: loss(x, p.replace(w2=w)), p.w2)
out["shared_w13"] = error(lambda w: loss(x, p.replace(shared_w13=w)), p.shared_w13)
# the dispatch maps take integer ids only: no derivative reaches them, the kernel stage may stay
stages = {"dispatch": "triton"}
dispatch_loss = lambda x: jnp.sum(mj.moe_forward(x, p, cfg, backend=stages).astype(jnp.float32) * r)
out["dispatch_only"] = error(dispatch_loss, x)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_triton_backend_forward_unchanged_and_gradient_error_under_interpreter():
    """The wrapper on the Triton backend's own implementations: the layer's output has the same
    bits with and without it, and a gradient names the first Triton op it reaches: the routing
    epilogue for x, the un-permute for GEMM2's weights and for the shared expert (its addend)."""
    got = run_under_interpreter(TRITON_SCRIPT)
    assert got["same_bits"] and got["finite"], got
    head = "ran on backend 'triton', which has no derivative for it (its kernel is an XLA custom call)"
    assert got["x"].startswith(f"op 'route_topk' (stage 'route') {head}"), got["x"]
    assert "reached its input(s) logits." in got["x"] and "backend='reference'" in got["x"]
    assert got["w2"].startswith(f"op 'unpermute' (stage 'unpermute') {head}"), got["w2"]
    assert "reached its input(s) d." in got["w2"]
    assert "reached its input(s) addend." in got["shared_w13"], got["shared_w13"]
    assert got["dispatch_only"] == "no error", got["dispatch_only"]
