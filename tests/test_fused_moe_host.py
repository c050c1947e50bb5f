"""The fused MoE kernel's launch plan (custom_calls/deep_gemm/fused_moe.py) and its composition with
the Triton kernels (custom_calls/fused_moe_sm90.py) on the CPU: every tensor map and pointer lands
inside the buffer region the kernel's layout gives it, the attributes encode the new argument
kinds, and the handler source builds. (The input stage that fills the buffer is a
Triton kernel: tests/test_triton_interpret.py.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from custom_calls import fused_moe_sm90 as S
from custom_calls.deep_gemm import fused_moe as F
from custom_calls.deep_gemm import fused_moe_config as H
from custom_calls.native import launch_plan as LP
from custom_calls.settings import KernelSettings

SHAPES = [  # (tokens, hidden, intermediate, experts, top_k)
    (128, 7168, 2048, 32, 8),
    (4096, 7168, 2048, 32, 8),
    (7, 1024, 512, 8, 4),
    (300, 2048, 512, 16, 6),
]


def _cfg(m, h, i, e, k):
    return F.fused_config(num_tokens=m, hidden=h, intermediate=i, num_experts=e, top_k=k,
                          activation_clamp=None, num_sms=132)


def _operand_bytes(cfg, m):
    h, i, e = cfg.hidden, cfg.intermediate, cfg.num_experts
    buf = cfg.buffer.total_bytes
    return (buf, e * 2 * i * h, e * (2 * i // 128) * (h // 128) * 4, e * h * i, e * (h // 128) * (i // 128) * 4,
            m * h * 2, buf)


@pytest.mark.parametrize("shape", SHAPES)
def test_token_capacity_and_block_m(shape):
    m, h, i, e, k = shape
    cfg = _cfg(*shape)
    assert cfg.max_tokens >= m and cfg.max_tokens & (cfg.max_tokens - 1) == 0
    assert cfg.max_tokens < 2 * max(m, 8)
    assert cfg.block_m == (64 if cfg.max_tokens * k < 64 * e else 128)


@pytest.mark.parametrize("shape", SHAPES)
def test_plans_stay_inside_their_regions(shape):
    m = shape[0]
    cfg = _cfg(*shape)
    regions = cfg.buffer.regions
    fused_bytes = _operand_bytes(cfg, m)
    plan = F.fused_plan(cfg, "/fused.cubin", num_tokens=m)
    plan.check_operands(fused_bytes)

    # m tokens of each input region fit before the next region starts
    h, k = cfg.hidden, cfg.top_k
    for name, per_token in (("input_tokens", h), ("input_scales", h // 32), ("input_topk_ids", 8 * k),
                            ("input_topk_weights", 4 * k)):
        assert m * per_token <= regions[name][1]

    # every buffer map lies inside the region it is named for
    region_of = {0: "l1_tokens", 1: "l1_scales", 3: "l2_tokens", 4: "l2_tokens", 5: "l2_scales"}
    for idx, name in region_of.items():
        t = plan.tmaps[idx]
        off, size = regions[name]
        assert t.operand == 0 and t.offset == off and t.offset % 16 == 0
        assert t.extent_bytes() <= size, (name, t.extent_bytes(), size)
    for idx, operand in ((2, 1), (6, 3)):  # the weights, experts folded into the rows
        assert plan.tmaps[idx].operand == operand and plan.tmaps[idx].offset == 0
        assert plan.tmaps[idx].extent_bytes() == fused_bytes[operand]
    assert plan.cooperative and plan.grid == 132 and plan.block == 384
    assert plan.smem == cfg.smem_bytes <= 232448
    sym = [a for a in plan.args if a.kind == LP.ARG_SYM_BUFFER]
    assert len(sym) == 1 and sym[0].value == 0


def test_attributes_encode_offsets_clusters_and_cooperative():
    cfg = _cfg(128, 7168, 2048, 32, 8)
    plan = LP.sequence_attributes((F.fused_plan(cfg, "/f.cubin", num_tokens=128),))
    # 128 tokens: 32 expected routes per expert, the rule's 2-CTA clusters (cooperative as well)
    assert cfg.cluster_size == 2 and plan["launch"].tolist()[:5] == [132, 384, 2, cfg.smem_bytes, 1]
    # programmatic dependent launch exactly when the kernel is compiled to wait for the input kernel
    assert plan["launch"].tolist()[5] == int(cfg.pdl)
    flipped = dataclasses.replace(cfg, pdl=not cfg.pdl)
    flipped_plan = F.fused_plan(flipped, "/f.cubin", num_tokens=128)
    assert LP.sequence_attributes((flipped_plan,))["launch"].tolist()[5] == int(flipped.pdl)
    assert ("_pdl_" in F.kernel_name(flipped)) != ("_pdl_" in F.kernel_name(cfg))
    tm = plan["tmaps"].reshape(-1, LP.TMAP_WORDS)
    assert tm[0, :2].tolist() == [0, cfg.buffer.regions["l1_tokens"][0]]
    assert plan["args"].reshape(-1, 3)[3].tolist() == [LP.ARG_SYM_BUFFER, 0, 0]
    assert all(a.dtype == np.int64 for key, a in plan.items() if key != "cubin")


def test_traced_plan_writes_the_trace_operand():
    """The diagnostic build with the kernel's event trace: the trace is input 5 (aliased to the last
    output), y moves to operand 6, the label says it; an untraced plan passes no trace pointer."""
    cfg = _cfg(128, 7168, 2048, 32, 8)
    traced = dataclasses.replace(cfg, trace=True)
    plain, plan = F.fused_plan(cfg, "/f.cubin", num_tokens=128), F.fused_plan(traced, "/f.cubin", num_tokens=128)
    assert (plain.args[0].value, plain.args[-1].kind) == (5, LP.NULL.kind)
    assert (plan.args[0].kind, plan.args[0].value) == (LP.ARG_PTR, 6)
    assert (plan.args[-1].kind, plan.args[-1].value) == (LP.ARG_PTR, 5)
    sizes = _operand_bytes(cfg, 128)
    plan.check_operands((*sizes[:5], 4 * F.trace_words(132), *sizes[5:], 4 * F.trace_words(132)))
    assert F.trace_words(132) == 132 * 4 * 2048 * 4 and "trace" in F.config_label(traced)
    assert H.sm90_fused_moe_options_reason(dataclasses.replace(cfg, trace=1)) == "trace: expected a bool, got 1"
    # the untraced entry point refuses a traced config before it compiles or launches anything
    with pytest.raises(ValueError, match=r"cfg\.trace: expected False \(fused_moe_traced runs the traced build\)"):
        S.fused_moe_with_config(traced, *(None,) * 7, routed_scaling_factor=1.0)
    with pytest.raises(ValueError, match="cfg.trace: expected True for a traced launch, got False"):
        S.fused_moe_traced(cfg, *(None,) * 7, routed_scaling_factor=1.0)


@pytest.mark.parametrize("trace", [False, True])
def test_kernel_launch_operands_match_the_plan(monkeypatch, trace):
    """The launch's operand lists agree with the plan: y is the first output (operand len(inputs)),
    the buffer is aliased to the second, and a traced build appends the zeroed trace as input 5,
    aliased to the third output; only then is a trace returned."""
    import jax
    import jax.numpy as jnp

    cfg = dataclasses.replace(_cfg(128, 1024, 512, 32, 8), trace=trace)
    seen = {}

    def fake_launch(plan, inputs, outputs, input_output_aliases, command_buffer):
        seen.update(plan=plan, inputs=inputs, outputs=outputs, aliases=input_output_aliases)
        return [f"out{i}" for i in range(len(outputs))]

    monkeypatch.setattr(F, "launch", fake_launch)
    buf = jax.ShapeDtypeStruct((cfg.buffer.total_bytes,), jnp.uint8)
    y, got_trace = F.run_kernel(cfg, "/c", buf, 100, *(None,) * 4)
    n_in = len(seen["inputs"])
    assert n_in == (6 if trace else 5) and seen["plan"].args[0].value == n_in  # y pointer
    assert seen["outputs"][0].shape == (100, 1024) and seen["outputs"][1].shape == buf.shape
    assert seen["aliases"] == ({0: 1, 5: 2} if trace else {0: 1})
    assert (y, got_trace) == ("out0", "out2" if trace else None)
    if trace:
        assert seen["inputs"][5].shape == (F.trace_words(132),) and not seen["inputs"][5].any()
        assert seen["plan"].args[-1].value == 5


def test_bad_offsets_and_ranges_are_refused():
    with pytest.raises(ValueError, match="offset 8 must be a non-negative multiple of 16"):
        LP.TensorMap(0, LP.TMA_UINT8, (128, 4), (128,), (128, 4), 128, offset=8).check()
    plan = LP.LaunchPlan("k", "/x", 1, 32, 1, 0, (LP._ptr(0, 64),), ())
    with pytest.raises(ValueError, match="pointer offset 64 outside operand 0 of 64 bytes"):
        plan.check_operands((64,))
    plan.check_operands((65,))


def test_refused_shapes_name_the_argument():
    assert "hidden" in F.fused_reason(num_tokens=8, hidden=1152, intermediate=512, num_experts=8, top_k=4,
                                      num_sms=132)
    # H 9216 takes more than the 1024 threads of one block per token: the input stage tiles the row
    assert F.fused_reason(num_tokens=8, hidden=9216, intermediate=512, num_experts=8, top_k=4, num_sms=132) is None
    assert F.fused_reason(num_tokens=128, hidden=7168, intermediate=2048, num_experts=32, top_k=8,
                          num_sms=132) is None
    with pytest.raises(ValueError, match="num_sms"):
        F.fused_config(num_tokens=8, hidden=1024, intermediate=512, num_experts=8, top_k=4,
                       activation_clamp=None, num_sms=131)


@pytest.mark.parametrize("held,fits", [(66, True), (67, True), (65, False), (0, False)])
def test_clusters_that_do_not_fit_are_left_out_by_the_layer_and_refused_when_asked_for(monkeypatch, held, fits):
    """The rule's 2-CTA clusters need grid / 2 resident pairs: fused_moe_impl then runs the same
    kernel without clusters; fused_moe_with_config refuses a config whose clusters do not fit."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    cfg = _cfg(128, 1024, 512, 32, 8)  # 32 expected routes per expert: clusters
    assert cfg.cluster_size == 2 and cfg.grid == 132
    monkeypatch.setattr(F, "detected_device", lambda: ("gpu", 90, 132))
    monkeypatch.setattr(F, "resident_clusters", lambda cubin, grid, threads, smem, cluster: held)
    monkeypatch.setattr(F.compiler, "compile_cubin", lambda name, src, arch: type("C", (), {"path": "/c"})())
    reason = F.clusters_reason(cfg, "/c")
    assert (reason is None) == fits
    if not fits:
        assert reason.startswith(f"cluster_size: the GPU holds {held} clusters of 2 CTAs") and "expected 66" in reason
    assert F.clusters_reason(dataclasses.replace(cfg, cluster_size=1), "/c") is None
    if not fits:  # asked for explicitly: refused before anything is launched
        with pytest.raises(ValueError, match=r"fused MoE config 64x256 s3 c2: cluster_size: the GPU holds"):
            S.fused_moe_with_config(cfg, jnp.zeros((128, 1024), jnp.bfloat16), *(None,) * 6,
                                    routed_scaling_factor=1.0)
    used = []
    monkeypatch.setattr(S, "fused_moe_with_config", lambda c, *a, **kw: used.append(c))
    x = jax.ShapeDtypeStruct((128, 1024), jnp.bfloat16)
    S.fused_moe_impl(x, jnp.zeros((128, 8), jnp.int32), None, jnp.zeros((32, 1024, 1024), jnp.float8_e4m3fn),
                     None, None, None, routed_scaling_factor=1.0, activation_clamp=None, w13_interleave=8,
                     settings=KernelSettings())
    assert used == [cfg if fits else dataclasses.replace(cfg, cluster_size=1)]


@pytest.mark.parametrize("tokens", [128, 5])
def test_routed_branch_is_one_call_of_three_plans(tokens, tmp_path, monkeypatch):
    """The routed branch's one custom call: the router and input kernels compiled for sm_90a and
    placed on the call's operands (router: x, gate -> partials; input: x, partials, placeholder,
    bias, offset -> buffer; the fused kernel on the buffer, the weights and y), the router and
    the input kernel launched programmatically (the fused kernel when its config says pdl), the
    router waiting for the kernel before it and then letting the next kernel start, the input
    kernel's routing waiting for the router (their PTX), and every map and pointer inside its
    operand."""
    pytest.importorskip("triton")
    import jax
    import jax.numpy as jnp

    monkeypatch.setenv("MOE_JAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRITON_CACHE_DIR", "")  # as importing jax_triton leaves it
    h, i, e, k = 1024, 512, 16, 4
    cfg = _cfg(tokens, h, i, e, k)
    x = jax.ShapeDtypeStruct((tokens, h), jnp.bfloat16)
    gate = jax.ShapeDtypeStruct((24, h), jnp.bfloat16)  # 24 routed experts, 16 held here
    w13 = jax.ShapeDtypeStruct((e, 2 * i, h), jnp.float8_e4m3fn)
    w13s = jax.ShapeDtypeStruct((e, 2 * i // 128, h // 128), jnp.float32)
    w2 = jax.ShapeDtypeStruct((e, h, i), jnp.float8_e4m3fn)
    w2s = jax.ShapeDtypeStruct((e, h // 128, i // 128), jnp.float32)
    routing = dict(top_k=k, scoring="sigmoid", n_group=4, topk_group=2, norm_topk_prob=True,
                   routed_scaling_factor=2.5)

    def plans_for(c):
        def build(x, gate, bias, offset, w13, w13s, w2, w2s):
            plans, inputs, outputs = S.routed_plans(c, "/fused.cubin", 90, x, gate, bias, offset, w13, w13s, w2,
                                                    w2s, **routing)
            build.result = plans, [(a.shape, a.dtype) for a in inputs], outputs
            return jnp.zeros(())
        jax.eval_shape(build, x, gate, jax.ShapeDtypeStruct((24,), jnp.float32),
                       jax.ShapeDtypeStruct((), jnp.int32), w13, w13s, w2, w2s)
        return build.result

    plans, inputs, outputs = plans_for(cfg)
    router, stage, fused = plans
    nbytes = tuple(int(np.prod(s)) * jnp.dtype(d).itemsize for s, d in inputs) + tuple(
        int(np.prod(o.shape)) * jnp.dtype(o.dtype).itemsize for o in outputs)
    assert [o.shape for o in outputs[1:]] == [(cfg.buffer.total_bytes,), (tokens, h)]
    assert outputs[0].shape[1:] == (tokens, 24) and outputs[0].dtype == jnp.float32
    for p in plans:
        p.check_operands(nbytes)
    ptrs = lambda p: [a.value for a in p.args if a.kind == LP.ARG_PTR]  # noqa: E731
    assert ptrs(router) == [0, 1, 9] and router.args[3:] == (LP.NULL, LP.NULL)
    assert ptrs(stage) == [0, 9, 2, 3, 4, 10] and stage.args[6:] == (LP.NULL, LP.NULL)
    assert {t.operand for t in fused.tmaps} == {10, 5, 7} and ptrs(fused) == [11, 6, 8]
    assert [a.value for a in fused.args if a.kind == LP.ARG_SYM_BUFFER] == [10]
    assert [p.programmatic for p in plans] == [True, True, cfg.pdl]
    assert router.grid_yz[0] == outputs[0].shape[0]  # one program column per split
    assert stage.block == 32 and router.smem > 0  # the routed decode stage: one warp per program
    assert LP.sequence_attributes(plans)["launch"].reshape(3, 8)[:, 5].tolist() == [1, 1, int(cfg.pdl)]
    pdl = plans_for(dataclasses.replace(cfg, pdl=True))[0]
    assert [p.programmatic for p in pdl] == [True, True, True]

    # the PTX of the two Triton kernels, kept beside their cubins
    for plan, want in ((router, ("griddepcontrol.wait", "griddepcontrol.launch_dependents")),
                       (stage, ("griddepcontrol.launch_dependents", "griddepcontrol.wait"))):
        assert plan.cubin.startswith(str(tmp_path / "cache"))
        ptx = (Path(plan.cubin).parent / "kernel.ptx").read_text()
        assert all(w in ptx for w in want) and f".entry {plan.kernel}(" in ptx, (plan.kernel, want)
