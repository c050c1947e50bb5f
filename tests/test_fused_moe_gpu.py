"""The fused MoE kernel (custom_calls/deep_gemm/fused_moe.py, composed with the Triton kernels in
custom_calls/fused_moe_sm90.py) on an SM90 GPU against the op's pure-JAX reference (itself checked
against a float64 NumPy model in tests/test_fused_moe.py): fresh random inputs, odd token counts,
routes to no expert, a clamp, every output row written, and the layer's fused layout end to end."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from custom_calls import fused_moe
from layouts import interleave_gate_up, quantize_fp8_per_block

pytestmark = pytest.mark.gpu


def _problem(seed, m, h, i, e, k, *, drop=0.0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, h), np.float32), jnp.bfloat16)
    ids = np.argsort(rng.random((m, e)), axis=1)[:, :k].astype(np.int32)  # distinct experts per token
    ids[rng.random((m, k)) < drop] = -1
    w = rng.random((m, k)).astype(np.float32) + 0.1
    w1, s1 = quantize_fp8_per_block(jnp.asarray(rng.standard_normal((e, 2 * i, h), np.float32) * 0.05), 128)
    w2, s2 = quantize_fp8_per_block(jnp.asarray(rng.standard_normal((e, h, i), np.float32) * 0.05), 128)
    return x, jnp.asarray(ids), jnp.asarray(w / w.sum(1, keepdims=True)), w1, s1, w2, s2


def _run(args, *, backend, **kw):
    x, ids, w, w1, s1, w2, s2 = args
    if backend == "deep_gemm":
        w1 = interleave_gate_up(w1)
    f = jax.jit(lambda *a: fused_moe(*a, backend=backend, w13_interleave=8 if backend == "deep_gemm" else 0,
                                     **kw))
    return np.asarray(f(x, ids, w, w1, s1, w2, s2).astype(jnp.float32))


def _compare(got, ref, ids, tol):
    assert got.shape == ref.shape
    assert np.isfinite(got).all(), "an output element was not written or is not finite"
    routed = (np.asarray(ids) >= 0).any(1)
    assert (np.abs(got[routed]).max(1) > 0).all(), "a routed token's row is zero"
    assert (got[~routed] == 0).all(), "a token without routes must be exactly 0"
    d = got - ref
    rel = np.linalg.norm(d) / np.linalg.norm(ref)
    row = (np.linalg.norm(d, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-6))[routed].max(initial=0)
    assert rel < tol and row < 4 * tol, (rel, row)
    return rel


@pytest.mark.parametrize("m,h,i,e,k,drop", [
    (1, 1024, 512, 8, 4, 0.0),
    (7, 1024, 512, 8, 4, 0.3),
    (130, 2048, 512, 16, 6, 0.1),
    (300, 1024, 512, 8, 8, 0.0),
])
def test_fused_kernel_matches_reference(m, h, i, e, k, drop):
    args = _problem(m * 31 + e, m, h, i, e, k, drop=drop)
    got = _run(args, backend="deep_gemm", routed_scaling_factor=2.5)
    ref = _run(args, backend="reference", routed_scaling_factor=2.5)
    # the kernel accumulates GEMM1 with its own order and rescaling; an e4m3 rounding of the
    # intermediate may then land one step apart: a few 1e-3 of relative error, not 1e-1
    _compare(got, ref, args[1], 2e-2)


@pytest.mark.parametrize("m", [128, 4096])
def test_fused_kernel_deepseek_shapes(m):
    """The benchmark's shapes: H 7168, I 2048, 32 experts, top-8 (BLOCK_M 64 at 128 tokens, 128 at 4096)."""
    args = _problem(m, m, 7168, 2048, 32, 8)
    got = _run(args, backend="deep_gemm")
    ref = _run(args, backend="reference")
    _compare(got, ref, args[1], 2e-2)


def test_fused_kernel_clamp_and_repeat_calls():
    args = _problem(5, 64, 1024, 512, 8, 4)
    first = _run(args, backend="deep_gemm", activation_clamp=0.05)
    ref = _run(args, backend="reference", activation_clamp=0.05)
    _compare(first, ref, args[1], 2e-2)
    # the workspace is zeroed by every call: a second and third call give the same bits
    again = _run(args, backend="deep_gemm", activation_clamp=0.05)
    np.testing.assert_array_equal(first, again)
    unclamped = _run(args, backend="deep_gemm")
    assert not np.array_equal(first, unclamped)  # the clamp reached the kernel


def test_fused_kernel_non_canonical_ids():
    """Repeated experts, ids past E and negative ids other than -1 reach the kernel path as given
    (its input kernel drops them) and the reference (which canonicalizes first): same result."""
    args = list(_problem(11, 37, 1024, 512, 8, 4, drop=0.1))
    ids = np.asarray(args[1]).copy()
    ids[0] = [3, 3, 3, 1]
    ids[5] = [8, 100, -7, 2]
    ids[9, 3] = ids[9, 0]
    args[1] = jnp.asarray(ids)
    got = _run(args, backend="deep_gemm", routed_scaling_factor=1.5)
    ref = _run(args, backend="reference", routed_scaling_factor=1.5)
    _compare(got, ref, np.where((ids >= 0) & (ids < 8), ids, -1), 2e-2)


@pytest.mark.parametrize("m,h,e,k", [(5, 1024, 8, 4), (128, 7168, 32, 8), (4096, 7168, 32, 8)])
def test_input_stage_bit_for_bit(m, h, e, k):
    """The Triton input kernel against its pure-JAX reference on the GPU: the workspace zeroed and
    the four input regions of m tokens identical byte for byte (bf16 tokens make e4m3 ties common,
    so a scale one ulp off would show)."""
    from custom_calls.deep_gemm.fused_moe import token_capacity
    from custom_calls.fused_moe import fused_input_reference
    from custom_calls.triton.fused_input_kernel import fused_input
    from layouts import FusedMoEBuffer

    rng = np.random.default_rng(m + h)
    x = jnp.asarray(rng.standard_normal((m, h), np.float32) * rng.uniform(1e-3, 40, (m, 1)), jnp.bfloat16)
    ids = rng.integers(-2, e + 2, (m, k)).astype(np.int32)
    ids[0, :2] = 1  # a repeat
    w = jnp.asarray(rng.random((m, k)), jnp.float32)
    buffer = FusedMoEBuffer(max_tokens=token_capacity(m), hidden=h, intermediate=512, num_experts=e, top_k=k,
                            block_m=64)
    args = (x, jnp.asarray(ids), w)
    got = np.asarray(jax.jit(lambda *a: fused_input(*a, buffer=buffer, routed_scaling_factor=2.5))(*args))
    ref = np.asarray(jax.jit(lambda *a: fused_input_reference(*a, buffer=buffer, routed_scaling_factor=2.5))(*args))
    regions = buffer.regions
    for name, per_token in (("workspace", None), ("input_tokens", h), ("input_scales", h // 32),
                            ("input_topk_ids", 8 * k), ("input_topk_weights", 4 * k)):
        off, size = regions[name]
        n = size if per_token is None else m * per_token
        diff = np.flatnonzero(got[off:off + n] != ref[off:off + n])
        assert diff.size == 0, f"{name}: {diff.size} bytes differ, first at {diff[:5]}"
    assert (got[regions["workspace"][0]:][:regions["workspace"][1]] == 0).all()


def _routed_problem(seed, m, h, e_route, *, bias):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, h), np.float32) * rng.uniform(0.1, 4, (m, 1)), jnp.bfloat16)
    gate = jnp.asarray(rng.standard_normal((e_route, h), np.float32) * 0.05, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(e_route) * 0.1, jnp.float32) if bias else None
    return x, gate, b


@pytest.mark.parametrize("m,h,e_route", [(5, 1024, 32), (128, 7168, 32), (4096, 7168, 32), (77, 2048, 256)])
def test_routed_input_stage(m, h, e_route):
    """The router GEMM's partials on the GPU (bf16 tensor-core dot) against the reference's
    (fp32 sums of the same exact products: only the order differs), and the input stage with the
    routing epilogue against its reference on those partials: tokens, scales and ids byte for byte,
    the weights to the epilogue's float rounding, the workspace zero."""
    from custom_calls.deep_gemm.fused_moe import token_capacity
    from custom_calls.fused_moe import fused_input_routed_reference
    from custom_calls.route_topk import router_partials_reference
    from custom_calls.triton.fused_input_kernel import fused_input_routed
    from custom_calls.triton.router_kernel import heuristic_config, router_partials
    from layouts import FusedMoEBuffer

    x, gate, bias = _routed_problem(m + e_route, m, h, e_route, bias=True)
    cfg = heuristic_config(m, h, e_route)
    parts = jax.jit(router_partials)(x, gate)
    ref_parts = jax.jit(lambda a, b: router_partials_reference(a, b, split_k=cfg.split_k))(x, gate)
    assert parts.shape == ref_parts.shape == (-(-h // cfg.split_k), m, e_route)
    np.testing.assert_allclose(np.asarray(parts), np.asarray(ref_parts), rtol=1e-5, atol=1e-5)
    e_loc, k, offset = 16, 8, 8
    buffer = FusedMoEBuffer(max_tokens=token_capacity(m), hidden=h, intermediate=512, num_experts=e_loc, top_k=k,
                            block_m=64)
    kw = dict(buffer=buffer, routed_scaling_factor=2.5, top_k=k, scoring="sigmoid", n_group=8, topk_group=4)
    args = (x, parts, bias, jnp.int32(offset))
    got = np.asarray(jax.jit(lambda *a: fused_input_routed(*a, **kw))(*args))
    ref = np.asarray(jax.jit(lambda *a: fused_input_routed_reference(*a, **kw))(*args))
    regions = buffer.regions
    for name, per_token in (("workspace", None), ("input_tokens", h), ("input_scales", h // 32),
                            ("input_topk_ids", 8 * k)):
        off, size = regions[name]
        n = size if per_token is None else m * per_token
        diff = np.flatnonzero(got[off:off + n] != ref[off:off + n])
        assert diff.size == 0, f"{name}: {diff.size} bytes differ, first at {diff[:5]}"
    ids = got[regions["input_topk_ids"][0]:][:m * k * 8].view(np.int64)
    assert (ids >= 0).any() and (ids == -1).any()  # routes held here and routes to other experts
    off = regions["input_topk_weights"][0]
    np.testing.assert_allclose(got[off:off + 4 * m * k].view(np.float32), ref[off:off + 4 * m * k].view(np.float32),
                               rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("m,h,e,e_route,k,scoring,ng,tg,bias,offset", [
    (1, 1024, 8, 32, 4, "sigmoid", 4, 2, True, 8),
    (130, 2048, 16, 16, 6, "softmax", 1, 1, False, 0),
    (300, 1024, 16, 64, 8, "sigmoid", 8, 4, True, 48),
    (77, 4096, 32, 256, 6, "sqrtsoftplus", 1, 1, True, 64),  # DeepSeek-V4's routing, a 32-expert slice
])
def test_routed_op_matches_reference(m, h, e, e_route, k, scoring, ng, tg, bias, offset):
    """Op `fused_moe_routed` (three kernels in one custom call on SM90) against its reference (the
    layer's bf16 router GEMM, `route_topk` and `fused_moe`'s reference), routes to experts held
    elsewhere included."""
    from custom_calls import fused_moe_routed

    x, gate, b = _routed_problem(m * 7 + e_route, m, h, e_route, bias=bias)
    _, _, _, w1, s1, w2, s2 = _problem(m, 1, h, 512, e, 1)
    w1 = interleave_gate_up(w1)
    kw = dict(top_k=k, scoring=scoring, n_group=ng, topk_group=tg, expert_offset=offset, routed_scaling_factor=2.5,
              w13_interleave=8)
    run = {be: np.asarray(jax.jit(lambda *a, be=be: fused_moe_routed(*a, backend=be, **kw))(x, gate, b, w1, s1, w2, s2)
                          .astype(jnp.float32)) for be in ("deep_gemm", "reference")}
    got, ref = run["deep_gemm"], run["reference"]
    assert np.isfinite(got).all()
    held = np.abs(ref).max(1) > 0
    assert held.any() and (got[~held] == 0).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2


@pytest.mark.parametrize("tokens,shared", [(96, 0), (257, 1)])
def test_layer_fused_layout(tokens, shared):
    """moe_forward with MoEConfig(layout="fused") on the kernel against the same layer on the
    reference backend (the fused op's reference): routing, the interleaved params, a dense shared
    expert added outside the kernel."""
    from moe_jax import MoEConfig, init_params, moe_forward, prepare_params

    cfg = MoEConfig.deepseek_v3(num_experts=16, n_shared_experts=shared, n_group=4, topk_group=2,
                                recipe="fp8_block", arch=90, layout="fused")
    cfg = cfg.scaled(hidden_size=1024, intermediate_size=512, top_k=4)
    params = prepare_params(init_params(jax.random.PRNGKey(tokens), cfg), cfg)
    assert params.w13_interleave == 8
    x = jax.random.normal(jax.random.PRNGKey(1), (tokens, cfg.hidden_size), jnp.bfloat16)
    fwd = jax.jit(moe_forward, static_argnames=("config", "backend"))
    # an fp32 gate routes before the op (fp32 router GEMM); a bf16 gate inside it (fused_moe_routed)
    for p in (params, dataclasses.replace(params, gate_weight=params.gate_weight.astype(jnp.bfloat16))):
        got = np.asarray(fwd(x, p, config=cfg, backend="auto").astype(jnp.float32))
        ref = np.asarray(fwd(x, p, config=cfg, backend="reference").astype(jnp.float32))
        assert np.isfinite(got).all()
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2, p.gate_weight.dtype


@pytest.mark.parametrize("tokens,hashed", [(77, False), (130, True)])
def test_layer_fused_layout_deepseek_v4(tokens, hashed, fused_op_choices):
    """DeepSeek-V4's config (MXFP4 experts, fp8_block GEMMs on arch 90) with the fused layout on the
    kernel against the reference backend: sqrtsoftplus + correction bias routed inside the op (bf16
    gate) or before it (fp32 gate), swiglu_limit in the kernel, hash-routed layers by tid2eid, the FP8
    shared expert beside the op. The registry's choice is recorded, so a fallback cannot pass."""
    from moe_jax import MoEConfig, init_params, moe_forward, prepare_params

    cfg = MoEConfig.deepseek_v4(hash_routing=hashed, arch=90, layout="fused", vocab_size=1000)
    cfg = cfg.scaled(num_experts=16, hidden_size=1024, intermediate_size=512)
    assert cfg.gemm_recipe == "fp8_block" and cfg.activation.swiglu_limit == 10.0
    params = prepare_params(init_params(jax.random.PRNGKey(tokens), cfg), cfg)
    assert params.w13_interleave == 8
    x = jax.random.normal(jax.random.PRNGKey(1), (tokens, cfg.hidden_size), jnp.bfloat16)
    token_ids = jax.random.randint(jax.random.PRNGKey(2), (tokens,), 0, cfg.vocab_size, jnp.int32) if hashed else None
    chosen = fused_op_choices
    fwd = jax.jit(moe_forward, static_argnames=("config", "backend"))
    ops = []
    for gate_dtype in (jnp.float32, jnp.bfloat16):
        p = dataclasses.replace(params, gate_weight=params.gate_weight.astype(gate_dtype))
        chosen.clear()
        got = np.asarray(fwd(x, p, config=cfg, backend="auto", token_ids=token_ids).astype(jnp.float32))
        assert len(chosen) == 1 and chosen[0][1] == "deep_gemm", chosen
        ops.append(chosen[0][0])
        ref = np.asarray(fwd(x, p, config=cfg, backend="reference", token_ids=token_ids).astype(jnp.float32))
        assert np.isfinite(got).all() and (np.abs(got).max(1) > 0).all()
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2, gate_dtype
    # an fp32 gate routes before the op; a bf16 one inside it, unless the layer is hash-routed (tid2eid)
    assert ops == ["fused_moe", "fused_moe" if hashed else "fused_moe_routed"]


@pytest.mark.parametrize("tokens,hashed", [(300, False), (130, True)])
def test_layer_fused_layout_widens_4bit_experts(tokens, hashed, fused_op_choices):
    """DeepSeek-V4's MXFP4 experts kept 4-bit (W4A8) in the fused layout: each call widens them by the
    Triton kernel into the fused op's FP8 operands, and the fused kernel runs on them, so the output equals
    the FP4 -> FP8 form's fused layer on the kernel bit for bit (bf16 gate: routing inside the op; hash
    routing before it). The registry's choices are recorded, so a fallback cannot pass."""
    from custom_calls.backends import record_resolutions
    from moe_jax import MoEConfig, init_params, moe_forward, prepare_params

    cfg4 = MoEConfig.deepseek_v4(hash_routing=hashed, arch=90, layout="fused", vocab_size=1000, mxfp4_sm90_form="w4a8")
    cfg4 = cfg4.scaled(num_experts=16, hidden_size=1024, intermediate_size=512)
    cfg8 = cfg4.scaled(mxfp4_sm90_form="fp8")
    raw = init_params(jax.random.PRNGKey(tokens), cfg4)
    raw = dataclasses.replace(raw, gate_weight=raw.gate_weight.astype(jnp.bfloat16))
    p4, p8 = prepare_params(raw, cfg4), prepare_params(raw, cfg8)
    assert p4.kept_4bit and p4.w13_interleave == 0
    x = jax.random.normal(jax.random.PRNGKey(1), (tokens, cfg4.hidden_size), jnp.bfloat16)
    token_ids = None
    if hashed:
        token_ids = jax.random.randint(jax.random.PRNGKey(2), (tokens,), 0, cfg4.vocab_size, jnp.int32)
    fwd = jax.jit(moe_forward, static_argnames=("config", "backend"))
    jax.clear_caches()  # a trace jax holds (another test's FP8 layer) would skip the ops' resolution
    with record_resolutions() as log:
        got = np.asarray(fwd(x, p4, config=cfg4, backend="auto", token_ids=token_ids)).view(np.uint16)
    assert log.count(("widen_w4a8_weights", "w4a8")) == 2, log
    assert [b for _, b in fused_op_choices] == ["deep_gemm"], fused_op_choices
    fused_op_choices.clear()
    want = np.asarray(fwd(x, p8, config=cfg8, backend="auto", token_ids=token_ids)).view(np.uint16)
    assert [b for _, b in fused_op_choices] == ["deep_gemm"], fused_op_choices
    np.testing.assert_array_equal(got, want)
    y = np.asarray(got.view(jnp.bfloat16).astype(np.float32))
    assert np.isfinite(y).all() and (np.abs(y).max(1) > 0).all()


def test_programmatic_launch_waits_for_the_input_stage():
    """With programmatic dependent launch the fused kernel may start while the input kernel still
    writes its buffer: three dependent layers in one program (each layer's tokens are the previous
    one's output, so a kernel that read its buffer early would read stale or half-written tokens)
    give the same bits with and without it, at both BLOCK_Ms."""
    from custom_calls import fused_moe_sm90 as S
    from custom_calls.deep_gemm import fused_moe as F

    x, ids, w, w1, s1, w2, s2 = _problem(5, 200, 2048, 512, 16, 6, drop=0.1)
    w1 = interleave_gate_up(w1)
    for tokens in (40, 200):  # BLOCK_M 64 and 128
        base = F.fused_config(num_tokens=tokens, hidden=2048, intermediate=512, num_experts=16, top_k=6,
                              activation_clamp=None)
        outs = []
        for cfg in (dataclasses.replace(base, pdl=False), dataclasses.replace(base, pdl=True)):
            def chain(x, *rest, c=cfg):
                for _ in range(3):
                    x = S.fused_moe_with_config(c, x, *rest, routed_scaling_factor=0.5)
                return x
            outs.append(np.asarray(jax.jit(chain)(x[:tokens], ids[:tokens], w[:tokens], w1, s1, w2, s2)
                                   .astype(jnp.float32)))
        assert np.isfinite(outs[0]).all() and np.abs(outs[0]).max() > 0
        np.testing.assert_array_equal(outs[1], outs[0], err_msg=f"{tokens} tokens")


def test_traced_build_keeps_the_bits_and_records_every_cta():
    """The diagnostic build with the kernel's event trace gives the untraced kernel's bits, and its
    trace holds every CTA's start and end and both GEMM phases' tiles."""
    from custom_calls import fused_moe_sm90 as S
    from custom_calls.deep_gemm import fused_moe as F
    from moe_jax.bench.fused import trace_phases

    x, ids, w, w1, s1, w2, s2 = _problem(9, 200, 2048, 512, 16, 6, drop=0.1)
    w1 = interleave_gate_up(w1)
    base = F.fused_config(num_tokens=200, hidden=2048, intermediate=512, num_experts=16, top_k=6,
                          activation_clamp=None)
    args = (x, ids, w, w1, s1, w2, s2)
    plain = jax.jit(lambda *a: S.fused_moe_with_config(base, *a, routed_scaling_factor=1.5))(*args)
    y, words = jax.jit(lambda *a: S.fused_moe_traced(dataclasses.replace(base, trace=True), *a,
                                                     routed_scaling_factor=1.5))(*args)
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(plain.astype(jnp.float32)))
    res = trace_phases(np.asarray(words))
    assert res["ctas"] == base.num_sms
    assert np.isfinite(res["events"]["kernel end"]["last"]) and res["events"]["kernel end"]["median"] > 0
    assert res["phases"][1]["tiles_total"] > 0 and res["phases"][2]["tiles_total"] > 0
    assert res["phases"][1]["first_start"] < res["phases"][2]["last_end"] <= res["events"]["kernel end"]["last"]


def test_schedule_options_keep_the_output_bits():
    """Every schedule option (the dispatch and loader warps included) changes only the order of
    work: the same bits as the template's defaults, at both BLOCK_Ms, and the H200 holds the rule's
    2-CTA clusters of the whole grid (at both BLOCK_Ms, the benchmark layer's sizes too)."""
    from custom_calls import fused_moe_sm90 as S
    from custom_calls.native import compiler
    from custom_calls.deep_gemm import fused_moe as F
    from custom_calls.deep_gemm.codegen import sm90_fused_moe_source

    x, ids, w, w1, s1, w2, s2 = _problem(3, 200, 2048, 512, 16, 6, drop=0.1)
    w1 = interleave_gate_up(w1)
    base = F.fused_config(num_tokens=200, hidden=2048, intermediate=512, num_experts=16, top_k=6,
                          activation_clamp=None)
    assert base.block_m == 128 and (base.l2_cd_passes, base.l2_stage_mode) == (4, 2)  # the rule, small H
    d0 = dataclasses.replace(F.fused_config(num_tokens=40, hidden=2048, intermediate=512, num_experts=16, top_k=6,
                                            activation_clamp=None), max_tokens=256)
    assert d0.block_m == 64 and d0.cluster_size == 1
    configs = [base, dataclasses.replace(base, l2_cd_passes=0, l2_stage_mode=0, num_stages=3),
               dataclasses.replace(base, cluster_size=2), dataclasses.replace(base, pdl=not base.pdl),
               d0, dataclasses.replace(d0, cluster_size=2), dataclasses.replace(d0, cluster_size=2, pdl=not d0.pdl),
               dataclasses.replace(d0, num_dispatch_threads=128, num_non_epilogue_threads=128),
               dataclasses.replace(d0, num_dispatch_threads=192)]
    outs = []
    for cfg in configs:
        f = jax.jit(lambda *a, c=cfg: S.fused_moe_with_config(c, *a, routed_scaling_factor=1.5))
        outs.append(np.asarray(f(x, ids, w, w1, s1, w2, s2).astype(jnp.float32)))
    assert np.isfinite(outs[0]).all()
    for cfg, out in zip(configs[1:], outs[1:]):
        np.testing.assert_array_equal(out, outs[0], err_msg=F.config_label(cfg))
    c2 = dataclasses.replace(d0, cluster_size=2)
    cubin = compiler.compile_cubin(F.kernel_name(c2), sm90_fused_moe_source(c2), 90)
    assert F.clusters_reason(c2, str(cubin.path)) is None
    held = F.resident_clusters(str(cubin.path), c2.grid, c2.num_threads, c2.smem_bytes, 2)
    assert held * 2 >= c2.grid
    # the rule's clusters at the benchmark layer's decode and prefill sizes (BLOCK_M 64 and 128, the
    # latter with 231 KB of shared memory per CTA): the whole grid resident as CTA pairs
    for tokens, bm in ((128, 64), (4096, 128)):
        rule = F.fused_config(num_tokens=tokens, hidden=7168, intermediate=2048, num_experts=32, top_k=8,
                              activation_clamp=None)
        assert (rule.block_m, rule.cluster_size) == (bm, 2)
        cubin = compiler.compile_cubin(F.kernel_name(rule), sm90_fused_moe_source(rule), 90)
        assert F.clusters_reason(rule, str(cubin.path)) is None, F.config_label(rule)


@pytest.mark.parametrize("m,e_route,scoring,ng,tg,offset", [(1, 16, "sigmoid", 4, 2, 0), (128, 16, "softmax", 1, 1, 0),
                                                            (300, 64, "sigmoid", 8, 4, 16),
                                                            (4096, 32, "sigmoid", 4, 2, 8)])
def test_routed_sequence_matches_separate_launches(m, e_route, scoring, ng, tg, offset):
    """The routed branch as one custom call of three kernels (the input kernel launched
    programmatically beside the router, the fused kernel too with its `pdl` option) gives the
    bits of the same three kernels in three custom calls: three dependent layers in one program
    (each layer's tokens are the previous one's output), so an input kernel that read its partials
    before the router finished, or a kernel that read the previous layer's y early, would differ.
    At 4096 tokens the router takes its prefill tile (128 rows, 3 stages: > 48 KB of shared memory)."""
    from custom_calls import fused_moe_sm90 as S
    from custom_calls.deep_gemm import fused_moe as F
    from custom_calls.triton.fused_input_kernel import fused_input_routed
    from custom_calls.triton.router_kernel import router_partials

    h, i, e, k = 2048, 512, 16, 6
    x, gate, b = _routed_problem(m + 11, m, h, e_route, bias=True)
    _, _, _, w1, s1, w2, s2 = _problem(m, 1, h, i, e, 1)
    w1 = interleave_gate_up(w1)
    kw = dict(top_k=k, scoring=scoring, n_group=ng, topk_group=tg, norm_topk_prob=True, routed_scaling_factor=2.5)
    offset = jnp.int32(offset)  # the first of the 16 experts held here
    base = F.fused_config(num_tokens=m, hidden=h, intermediate=i, num_experts=e, top_k=k, activation_clamp=None)

    def separate(x, gate, b, *w):
        for _ in range(3):
            buf = fused_input_routed(x, router_partials(x, gate), b, offset, buffer=base.buffer, **kw)
            x = F.run_kernel(base, F.kernel_cubin(base), buf, m, *w)[0]
        return x

    def one_call(x, gate, b, *w, cfg):
        for _ in range(3):
            x = S.routed_sequence(cfg, x, gate, b, offset, *w, **kw)
        return x

    want = np.asarray(jax.jit(separate)(x, gate, b, w1, s1, w2, s2).astype(jnp.float32))
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    for pdl in (False, True):
        cfg = dataclasses.replace(base, pdl=pdl)
        got = np.asarray(jax.jit(functools.partial(one_call, cfg=cfg))(x, gate, b, w1, s1, w2, s2)
                         .astype(jnp.float32))
        np.testing.assert_array_equal(got, want, err_msg=f"{m} tokens, pdl={pdl}")
