"""Activation + quantization op (contig and masked-varlen), every variant, against numpy formulas;
and the backend registry."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from custom_calls import ActivationSpec


def np_act(g2: np.ndarray, spec: ActivationSpec) -> np.ndarray:
    i = g2.shape[-1] // 2
    gate, up = g2[..., :i], g2[..., i:]
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    if spec.kind == "situ":
        return spec.situ_beta * np.tanh(gate / spec.situ_beta) * sig(gate) * \
            spec.situ_linear_beta * np.tanh(up / spec.situ_linear_beta)
    if spec.swiglu_limit is not None:
        gate = np.minimum(gate, spec.swiglu_limit)
        up = np.clip(up, -spec.swiglu_limit, spec.swiglu_limit)
    if spec.kind == "swiglu_oai":
        return gate * sig(spec.gemm1_alpha * gate) * (up + 1)
    return gate * sig(gate) * up


SPECS = {
    "silu": ActivationSpec(),
    "silu_clamp": ActivationSpec(swiglu_limit=1.5),
    "oai": ActivationSpec(kind="swiglu_oai", gemm1_alpha=1.702, swiglu_limit=2.0),
    "oai_noclamp": ActivationSpec(kind="swiglu_oai", gemm1_alpha=0.5),
    "situ": ActivationSpec(kind="situ", situ_beta=2.0, situ_linear_beta=0.75),
}


def gateup(shape, seed=0):
    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 2.5).astype(jnp.bfloat16)


@pytest.mark.parametrize("name", list(SPECS))
def test_bf16_variants(name):
    spec = SPECS[name]
    x = gateup((37, 2 * 96))
    a, s = cc.activation_quant_contig(x, act=spec, recipe="bf16", arch=90)
    assert s is None and a.dtype == jnp.bfloat16 and a.shape == (37, 96)
    ref = np_act(np.asarray(x.astype(jnp.float32), np.float64), spec)
    np.testing.assert_allclose(np.asarray(a.astype(jnp.float32)), ref, rtol=2**-8, atol=1e-30)
    if spec.swiglu_limit is not None:  # clamps are active on these inputs
        assert np.abs(np.asarray(x.astype(jnp.float32))).max() > spec.swiglu_limit


@pytest.mark.parametrize("recipe,arch", [("fp8_block", 90), ("fp8_block", 100), ("mxfp8", 100),
                                         ("mxfp4", 100)])
@pytest.mark.parametrize("keep_fp32", [False, True])
def test_quantized_contig_and_keep_fp32(recipe, arch, keep_fp32):
    if keep_fp32 and recipe == "mxfp4":
        with pytest.raises(ValueError, match="keep_fp32: only for FP8 expert weights"):
            cc.activation_quant_contig(gateup((4, 256)), act=ActivationSpec(keep_fp32=True),
                                       recipe=recipe, arch=arch)
        return
    spec = ActivationSpec(keep_fp32=keep_fp32)
    x = gateup((21, 2 * 256), seed=1)
    q, s = cc.activation_quant_contig(x, act=spec, recipe=recipe, arch=arch)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (21, 256)
    deq = np.asarray(cc.dequantize_lhs(q, s, recipe, arch), np.float64)
    y = np_act(np.asarray(x.astype(jnp.float32), np.float64), spec)
    if not keep_fp32:  # the default path rounds SiLU*up to bf16 before quantizing
        y = np.asarray(jnp.asarray(y, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    gk = 32 if recipe == "mxfp8" else 128
    amax = np.abs(y.reshape(21, -1, gk)).max(-1, keepdims=True)
    atol = np.broadcast_to(amax / 448 * 2**-8, (21, 256 // gk, gk)).reshape(21, 256)
    assert np.all(np.abs(deq - y) <= 2**-4 * np.abs(y) + atol)
    if recipe == "mxfp4":
        return
    # what keep_fp32 changes: the quantizer's input (different q on some elements)
    other, _ = cc.activation_quant_contig(x, act=ActivationSpec(keep_fp32=not keep_fp32),
                                          recipe=recipe, arch=arch)
    assert np.any(np.asarray(other.astype(jnp.float32)) != np.asarray(q.astype(jnp.float32)))


@pytest.mark.parametrize("recipe,arch", [("bf16", 90), ("fp8_block", 90), ("mxfp8", 100)])
def test_masked_varlen_equals_contig_on_real_rows(recipe, arch):
    spec = SPECS["oai"]
    x = gateup((3, 128, 2 * 128), seed=2)
    mm = np.array([0, 77, 128], np.int32)
    a, s = cc.activation_quant_masked(x, jnp.asarray(mm), act=spec, recipe=recipe, arch=arch)
    assert a.shape == (3, 128, 128)
    # per-row quantization: the contig op on all rows gives the same real rows
    ac, sc = cc.activation_quant_contig(x.reshape(3 * 128, -1), act=spec, recipe=recipe, arch=arch)
    got = np.asarray(cc.dequantize_lhs(a, s, recipe, arch)).reshape(3 * 128, -1)
    want = np.asarray(cc.dequantize_lhs(ac, sc, recipe, arch))
    real = (np.arange(128)[None] < mm[:, None]).reshape(-1)
    np.testing.assert_array_equal(got[real], want[real])
    assert np.all(np.asarray(a.astype(jnp.float32)).reshape(3 * 128, -1)[~real] == 0)
    assert np.all(np.abs(got[real]).sum(1) > 0)


def test_bad_activation_inputs():
    with pytest.raises(ValueError, match="gemm1_alpha: required by"):
        ActivationSpec(kind="swiglu_oai")
    with pytest.raises(ValueError, match="kind: expected one of"):
        ActivationSpec(kind="gelu")
    with pytest.raises(ValueError, match="swiglu_limit: does not apply to kind='situ'"):
        ActivationSpec(kind="situ", swiglu_limit=1.0)
    with pytest.raises(ValueError, match="swiglu_limit: expected None or > 0, got -1.0"):
        ActivationSpec(swiglu_limit=-1.0)
    with pytest.raises(ValueError, match="situ_beta: expected > 0, got 0.0"):
        ActivationSpec(kind="situ", situ_beta=0.0)
    with pytest.raises(ValueError, match="situ_linear_beta: expected > 0, got -2.0"):
        ActivationSpec(kind="situ", situ_linear_beta=-2.0)
    with pytest.raises(ValueError, match="keep_fp32: only for kind='silu', got kind='situ'"):
        ActivationSpec(kind="situ", keep_fp32=True)
    with pytest.raises(ValueError, match="gateup: last axis must be even"):
        cc.activation_quant_contig(jnp.ones((4, 7), jnp.bfloat16), act=ActivationSpec(), recipe="bf16", arch=90)
    with pytest.raises(ValueError, match="masked_m: expected shape \\(2,\\)"):
        cc.activation_quant_masked(jnp.ones((2, 128, 8), jnp.bfloat16), jnp.ones((3,), jnp.int32),
                                   act=ActivationSpec(), recipe="bf16", arch=90)
    with pytest.raises(TypeError, match="act: expected ActivationSpec"):
        cc.activation_quant_contig(jnp.ones((4, 8), jnp.bfloat16), act="silu", recipe="bf16", arch=90)


# -- backend registry -----------------------------------------------------------------------------
def test_registry_resolve_explicit_auto_default_and_errors():
    op = "test_only_op"
    cc.declare_op(op, static_args=("size",), reference=lambda v: ("ref", v))
    cc.register(op, "fast", lambda v: ("fast", v),
                supports=lambda *, size: (size % 2 == 0, f"size {size} is odd"))
    with pytest.raises(ValueError, match="op: 'test_only_op' is already declared"):
        cc.declare_op(op, static_args=("size",), reference=lambda v: v)
    with pytest.raises(ValueError, match="op: expected one of .* got 'undeclared_op'"):
        cc.register("undeclared_op", "fast", lambda v: v)
    with pytest.raises(TypeError, match=r"static arguments of op 'test_only_op': expected \['size'\], got unknown \['sise'\] and missing \['size'\]"):
        cc.resolve(op, "reference", sise=3)
    assert cc.resolve(op, "reference", size=3).impl(1) == ("ref", 1)
    assert cc.resolve(op, "fast", size=4).impl(1) == ("fast", 1)
    with pytest.raises(ValueError, match="backend 'fast' cannot run op 'test_only_op': size 3 is odd"):
        cc.resolve(op, "fast", size=3)
    assert cc.resolve(op, "auto", size=4).backend == "fast"
    assert cc.resolve(op, "auto", size=3).backend == "reference"  # no accelerated one supports it
    assert cc.resolve(op, None, size=4).backend == "reference"  # the default default
    with cc.use_backend("fast"):
        assert cc.resolve(op, None, size=4).backend == "fast"
        with pytest.raises(ValueError, match="size 5 is odd"):
            cc.resolve(op, None, size=5)
    assert cc.get_default_backend() == "reference"
    with pytest.raises(ValueError, match="no implementation of op 'test_only_op'"):
        cc.resolve(op, "missing", size=2)


def test_gpu_backends_are_lazy_and_refused_off_gpu():
    import subprocess
    import sys

    # a fresh interpreter: other suites in this process may have imported GPU packages already
    code = ("import sys, custom_calls, moe_jax; "
            "bad = [m for m in ('jax_triton', 'triton', 'cuda', 'cuda.bindings', 'deep_gemm', "
            "'custom_calls.deep_gemm', 'custom_calls.triton', 'custom_calls.native', "
            "'custom_calls.fused_moe_sm90') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
    if jax.default_backend() == "gpu":
        pytest.skip("checks the CPU behaviour")
    with pytest.raises(ValueError, match="backend 'deep_gemm' for op 'm_grouped_gemm_contig': runs on platform"):
        cc.m_grouped_gemm_contig(jnp.ones((128, 128), jnp.bfloat16), jnp.ones((1, 8, 128), jnp.bfloat16),
                                 jnp.zeros((128,), jnp.int32), recipe="bf16", arch=90, backend="deep_gemm")
    # auto on CPU is the reference
    static = dict(m_cap=128, n=128, k=128, num_groups=1, recipe="bf16", arch=90, alignment=128,
                  lhs_dtype=jnp.bfloat16, rhs_dtype=jnp.bfloat16, settings=cc.KernelSettings())
    assert cc.resolve("m_grouped_gemm_contig", "auto", **static).backend == "reference"


def test_layer_stage_backends():
    from moe_jax.layer import stage_backends as _stage_backends

    stages = ("route", "dispatch", "permute", "gemm", "activation", "unpermute")
    assert _stage_backends("auto") == dict.fromkeys(stages, "auto")
    assert _stage_backends("deep_gemm") == {"route": "reference", "dispatch": "reference", "permute": "reference",
                                            "gemm": "deep_gemm", "activation": "reference", "unpermute": "reference"}
    assert _stage_backends("triton") == {"route": "triton", "dispatch": "triton", "permute": "triton",
                                         "gemm": "reference", "activation": "triton", "unpermute": "triton"}
    got = _stage_backends((("gemm", "deep_gemm"),))
    assert got["gemm"] == "deep_gemm" and got["permute"] == "reference"
    with pytest.raises(ValueError, match="unknown stage\\(s\\) \\['gemmm'\\]"):
        _stage_backends({"gemmm": "x"})
    with pytest.raises(ValueError, match=r"backend: expected one of \('reference', 'auto', .*'triton'.*got 'nonsense'"):
        _stage_backends("nonsense")
    with pytest.raises(ValueError, match=r"backend\['gemm'\]: expected one of .* got 'nonsense'"):
        _stage_backends({"gemm": "nonsense"})
    # stage coverage comes from the registry: what each backend registered
    assert cc.backend_stages("deep_gemm") == {"gemm"}
    assert cc.backend_stages("triton") == {"route", "dispatch", "permute", "activation", "unpermute"}


@pytest.mark.parametrize("backend", ["deep_gemm", "triton"])
def test_layer_with_gpu_backend_off_gpu_is_an_error(backend):
    import moe_jax as mj

    if jax.default_backend() == "gpu":
        pytest.skip("checks the CPU behaviour")
    config = mj.MoEConfig.deepseek_v3().scaled(num_experts=8, top_k=4, hidden_size=128, intermediate_size=128)
    params = mj.init_params(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (4, 128)).astype(jnp.bfloat16)
    with pytest.raises(ValueError, match=f"backend '{backend}' .*op '.*'.*platform"):
        mj.moe_forward(x, params, config, backend=backend)
