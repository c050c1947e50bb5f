"""Autotuning of the SM90 grouped GEMMs and the command-buffer launcher.

Without a GPU: the legal configs (against the templates' shared-memory layout and static asserts,
restated here from the 0.2.5 headers), the pruned search lists, launch plans of candidates, the cache
(key, round trip, corrupt files), the policy hook in the ops and warmup, the launcher's two FFI
targets and their traits, and nvcc compiles of non-default candidates for sm_90a.
On an SM90 GPU (``gpu`` marker): a small search end to end, and launches captured in XLA command
buffers against plain launches while buffer addresses change.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from custom_calls.deep_gemm import autotune as A, codegen, heuristics as H, ops, plans as P
from custom_calls.native import launch, toolchain
from custom_calls.settings import KernelSettings
from test_deep_gemm_host import needs_nvcc

CAP = 232448
DEVICE = "NVIDIA H200"


PROBLEMS = [
    A.Sm90Problem("fp8_1d2d", "contig", 32 * 1024, 4096, 7168, 32),
    A.Sm90Problem("fp8_1d2d", "contig", 8 * 4096, 7168, 2048, 8),
    A.Sm90Problem("fp8_1d2d", "masked", 256, 4096, 7168, 32, 32),
    A.Sm90Problem("fp8_1d2d", "masked", 512, 7168, 2048, 32, 128),
    A.Sm90Problem("bf16", "contig", 32 * 1024, 4096, 7168, 32),
    A.Sm90Problem("bf16", "masked", 256, 1536, 512, 6, 7),
]


# --- the templates' own rules, restated independently -------------------------------------------

def kernel_smem(c: H.Sm90GemmConfig, k: int) -> int:
    """Shared memory the kernel itself lays out (sm90_fp8_gemm_1d2d.cuh / sm90_bf16_gemm.cuh)."""
    barriers = 2 * c.num_stages * 8
    if c.kernel == "fp8_1d2d":
        d = -(-c.block_m * c.block_n * 2 // 1024) * 1024
        sfa = -(-c.block_m * 4 // 128) * 128
        sfb = -(-(-(-k // 128)) * (1 if 128 % c.block_n == 0 else 2) * 4 // 8) * 8
        return d + c.num_stages * (c.block_m * 128 + c.block_n * 128 + sfa) + sfb + barriers
    d = -(-c.block_m * c.block_n * 2 // 1024) * 1024
    return d + c.num_stages * (c.block_m * 64 * 2 + c.block_n * 64 * 2) + barriers


def static_asserts_hold(c: H.Sm90GemmConfig, m: int, n: int) -> None:
    bk = 128 if c.kernel == "fp8_1d2d" else 64
    assert c.block_k == bk
    assert c.block_m % 64 == 0 or c.block_m < 64
    assert c.block_m >= 64 or c.num_math_threads == 128
    assert c.num_math_threads == (128 if c.block_m <= 64 else 256) and c.num_tma_threads == 128
    if c.kernel == "fp8_1d2d":
        assert -(-c.block_n // 128) == 1 or math.gcd(c.block_n, 128) == c.block_n - 128
    atom = c.block_n if c.swizzle_cd == 0 else c.swizzle_cd // 2
    assert c.block_n % atom == 0 and c.block_n // atom <= 32 and atom % 8 == 0
    if c.kernel == "bf16":
        assert c.swizzle_cd > 0  # the bf16 store path asserts a swizzle
    assert c.cluster in (1, 2) and c.num_sms % c.cluster == 0
    wgmma_a = 64 * bk  # the kernels' WGMMA padding check counts fp8 bytes for both kernels
    assert wgmma_a <= c.block_m * bk * (1 if c.kernel == "fp8_1d2d" else 2) + \
        c.block_n * bk * (1 if c.kernel == "fp8_1d2d" else 2) * c.num_stages
    if c.gemm_kind == "contig":
        assert 128 % c.block_m == 0
    if c.gemm_kind == "masked":
        assert m % c.block_m == 0 and (-(-n // c.block_n)) % c.cluster == 0


@pytest.mark.parametrize("p", PROBLEMS, ids=lambda p: p.label)
def test_every_candidate_is_legal_and_the_heuristic_is_one(p):
    cands = p.candidates(132)
    assert len(cands) == len(set(cands)) > 100
    for c in cands:
        assert H.sm90_config_reason(c, p.m, p.n, p.k) is None
        static_asserts_hold(c, p.m, p.n)
        assert kernel_smem(c, p.k) <= c.smem_bytes <= CAP
        assert c.smem_bytes == H.sm90_smem_bytes(c.kernel, c.cd_dtype, p.k, c.block_m, c.block_n, c.num_stages)
    assert p.heuristic(132) in cands


def test_candidates_span_tiles_multicast_stages_and_swizzles():
    p = PROBLEMS[0]
    cands = p.candidates(132)
    assert {(c.cluster_m, c.cluster_n) for c in cands} == {(1, 1), (1, 2), (2, 1)}
    assert {c.block_m for c in cands} == {16, 32, 64, 128}  # contig blocks never straddle 128-row segments
    assert {c.swizzle_cd for c in cands} == {0, 32, 64, 128}
    tile = [c for c in cands if (c.block_m, c.block_n, c.cluster_m, c.cluster_n, c.swizzle_cd) == (128, 128, 1, 1, 128)]
    most = H.sm90_max_stages("fp8_1d2d", "bf16", p.k, 128, 128)
    assert sorted(c.num_stages for c in tile) == list(range(2, most + 1))
    assert all(c.block_n <= 192 for c in cands)  # larger FP8 tiles spill
    # masked with an odd number of N blocks: no cluster (the paired CTAs must stay in one group)
    odd = A.Sm90Problem("fp8_1d2d", "masked", 256, 3 * 128, 512, 4, 16)
    assert all(c.cluster == 1 or (-(-odd.n // c.block_n)) % 2 == 0 for c in odd.candidates(132))
    assert any(c.cluster == 2 for c in odd.candidates(132))


def test_config_reason_names_each_illegal_field():
    p = PROBLEMS[2]
    good = p.heuristic(132)
    assert H.sm90_config_reason(good, p.m, p.n, p.k) is None
    bad = {
        "BLOCK_N 176": dataclasses.replace(good, block_n=176),
        "num_stages": dataclasses.replace(good, num_stages=good.num_stages + 1),
        "fields inconsistent": dataclasses.replace(good, smem_bytes=good.smem_bytes + 1024),
        "swizzle_cd": dataclasses.replace(good, swizzle_cd=16),
        "N blocks": dataclasses.replace(good, block_n=112, cluster_n=2),  # ceil(4096/112) = 37 blocks
        "cluster": dataclasses.replace(good, cluster_m=2, cluster_n=2),
    }
    for words, cfg in bad.items():
        reason = H.sm90_config_reason(cfg, p.m, p.n, p.k)
        assert reason and words in reason, (words, reason)
    tall = H.sm90_build_config("fp8_1d2d", "masked", "bf16", 32, 132, 7168, 256, 128, 1, 1)
    assert H.sm90_config_reason(tall, 512, 4096, 7168) is None
    assert "does not divide m_pad" in H.sm90_config_reason(tall, 384, 4096, 7168)
    tiny = H.sm90_build_config("fp8_1d2d", "masked", "bf16", 32, 132, 7168, 16, 16, 1, 1, 2, 32)
    assert "WGMMA" in H.sm90_config_reason(tiny, 256, 4096, 7168)
    contig = dataclasses.replace(PROBLEMS[0].heuristic(132), block_m=256, block_n=128, num_math_threads=256)
    assert "straddle" in H.sm90_config_reason(contig, 32768, 4096, 7168)


@pytest.mark.parametrize("p", PROBLEMS, ids=lambda p: p.label)
def test_search_lists_start_from_the_heuristic_and_stay_legal(p):
    heur = p.heuristic(132)
    first = A.phase1_candidates(p, 132, 14)
    assert first[0] == heur and len(first) == len(set(first)) <= 14
    for c in first:
        assert H.sm90_config_reason(c, p.m, p.n, p.k) is None
        assert c.num_stages == H.sm90_max_stages(c.kernel, c.cd_dtype, p.k, c.block_m, c.block_n)
    # every multicast choice legal at the heuristic's BLOCK_M is tried
    legal = {(c.cluster_m, c.cluster_n) for c in H.sm90_tile_configs(p.kernel, p.gemm_kind, p.m, p.n, p.k,
                                                                      p.num_groups, 132) if c.block_m == heur.block_m}
    assert {(c.cluster_m, c.cluster_n) for c in first if c.block_m == heur.block_m} == legal
    refined = A.refine_candidates(p, 132, first[:2])
    for c in refined:
        assert H.sm90_config_reason(c, p.m, p.n, p.k) is None and c not in first[:2]
        parent = next(q for q in first[:2] if (q.block_m, q.block_n, q.cluster_m, q.cluster_n) ==
                      (c.block_m, c.block_n, c.cluster_m, c.cluster_n))
        assert (c.num_stages < parent.num_stages) != (c.swizzle_cd != parent.swizzle_cd)
        assert c.num_stages >= 3
    assert A.phase1_candidates(p, 132, 1) == [heur]


def _operand_bytes(p: A.Sm90Problem) -> tuple[int, ...]:
    g, m, n, k = p.num_groups, p.m, p.n, p.k
    rows = g * m if p.gemm_kind == "masked" else m
    layout = 4 * (g if p.gemm_kind == "masked" else m)
    out = rows * n * 2
    if p.kernel == "bf16":
        return rows * k * 2, g * n * k * 2, layout, out
    sfa = 4 * (g if p.gemm_kind == "masked" else 1) * -(-k // 128) * (-(-m // 4) * 4)
    return rows * k, g * n * k, sfa, 4 * g * -(-n // 128) * -(-k // 128), layout, out


@pytest.mark.parametrize("p", PROBLEMS, ids=lambda p: p.label)
def test_candidate_launch_plans_fit_their_operands(p):
    first = A.phase1_candidates(p, 132, 14)
    builder = P.sm90_fp8_plan if p.kernel == "fp8_1d2d" else P.sm90_bf16_plan
    for c in first + A.refine_candidates(p, 132, first[:3]):
        plan = builder(c, "/x.cubin", m=p.m, n=p.n, k=p.k, num_groups=p.num_groups)
        plan.check()
        plan.check_operands(_operand_bytes(p))
        assert (plan.grid, plan.block, plan.cluster, plan.smem) == (132, c.num_threads, c.cluster, c.smem_bytes)
        d = plan.tmaps[2]
        assert d.box[0] == (c.swizzle_cd // 2 if c.swizzle_cd else c.block_n) and d.swizzle == c.swizzle_cd


def test_problem_and_policy_validation(monkeypatch):
    with pytest.raises(ValueError, match="expected_m"):
        A.Sm90Problem("fp8_1d2d", "masked", 256, 512, 512, 4, 0)
    with pytest.raises(ValueError, match="expected_m"):
        A.Sm90Problem("fp8_1d2d", "contig", 256, 512, 512, 4, 16)
    with pytest.raises(ValueError, match="mode"):
        A.TuningPolicy(mode="fast")
    assert A.grouped_problem("masked", 256, 512, 512, 4, "fp8_1d2d", 1000).expected_m == 256
    assert A.grouped_problem("masked", 256, 512, 512, 4, "bf16", 0).expected_m == 1


# --- the cache ----------------------------------------------------------------------------------

@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_JAX_CACHE_DIR", str(tmp_path))
    A.clear_memory_cache()
    yield tmp_path
    A.clear_memory_cache()


def _entry(p: A.Sm90Problem, cfg: H.Sm90GemmConfig) -> A.TunedEntry:
    return A.TunedEntry(config=cfg, heuristic=p.heuristic(132), tuned=cfg != p.heuristic(132),
                        heuristic_us=(100.0, 101.0), config_us=(90.0, 91.0), num_candidates=20, created="now")


def _other(p: A.Sm90Problem) -> H.Sm90GemmConfig:
    """A legal config other than the heuristic's."""
    return next(c for c in A.phase1_candidates(p, 132, 5)[1:])


@needs_nvcc
def test_key_covers_every_field_and_round_trips(cache):
    p = PROBLEMS[2]
    key = A.tuning_key(p, 132, DEVICE)
    variants = [A.tuning_key(dataclasses.replace(p, expected_m=31), 132, DEVICE),
                A.tuning_key(dataclasses.replace(p, m=512), 132, DEVICE),
                A.tuning_key(dataclasses.replace(p, n=2048), 132, DEVICE),
                A.tuning_key(dataclasses.replace(p, num_groups=16), 132, DEVICE),
                A.tuning_key(dataclasses.replace(p, kernel="bf16"), 132, DEVICE),
                A.tuning_key(p, 114, DEVICE), A.tuning_key(p, 132, "NVIDIA H100 80GB HBM3"),
                dataclasses.replace(key, template="0.2.6+0"), dataclasses.replace(key, nvcc="V12.9"),
                dataclasses.replace(key, schema=A.SCHEMA + 1)]
    assert len({v.path() for v in variants + [key]}) == len(variants) + 1
    assert key.path().parent == cache / "tuned"
    assert A.load_entry(key) is None
    entry = _entry(p, _other(p))
    path = A.store_entry(key, entry)
    A.clear_memory_cache()
    assert A.load_entry(key) == entry and json.loads(path.read_text())["key"]["device_kind"] == DEVICE
    assert not list((cache / "tuned").glob("*.json.*"))  # no temporary file left behind
    with pytest.raises(ValueError, match="device_kind"):
        A.tuning_key(p, 132, None)


@needs_nvcc
@pytest.mark.parametrize("corruption", ["not json", "truncated", "other key", "illegal config", "missing field",
                                        "a list"])
def test_corrupt_cache_file_is_ignored_with_a_warning(cache, corruption):
    p = PROBLEMS[2]
    key = A.tuning_key(p, 132, DEVICE)
    path = A.store_entry(key, _entry(p, _other(p)))
    d = json.loads(path.read_text())
    if corruption == "not json":
        path.write_text("{{{")
    elif corruption == "truncated":
        path.write_text(path.read_text()[:100])
    elif corruption == "other key":
        d["key"]["problem"]["n"] = 1024
        path.write_text(json.dumps(d))
    elif corruption == "illegal config":
        d["config"]["num_stages"] = 40
        path.write_text(json.dumps(d))
    elif corruption == "missing field":
        del d["config"]["block_n"]
        path.write_text(json.dumps(d))
    else:
        path.write_text("[1, 2]")
    A.clear_memory_cache()
    with pytest.warns(RuntimeWarning, match="ignoring the tuned-config cache file"):
        assert A.load_entry(key) is None
    # the op path falls back to the heuristic (and says so, once)
    A.clear_memory_cache()
    with pytest.warns(RuntimeWarning, match="ignoring"):
        cfg = A.sm90_config(p, 132, A.TuningPolicy(mode="cached", device_kind=DEVICE))
    assert cfg == p.heuristic(132)


@needs_nvcc
def test_policy_modes_pick_the_config(cache):
    p = PROBLEMS[3]
    heur, other = p.heuristic(132), _other(p)
    cached = A.TuningPolicy(mode="cached", device_kind=DEVICE)
    assert A.sm90_config(p, 132, cached) == heur  # nothing cached yet
    with pytest.warns(RuntimeWarning, match="do not search while tracing"):
        assert A.sm90_config(p, 132, A.TuningPolicy(mode="search", device_kind=DEVICE)) == heur
    A.store_entry(A.tuning_key(p, 132, DEVICE), _entry(p, other))
    assert A.sm90_config(p, 132, cached) == other
    assert A.sm90_config(p, 132, A.TuningPolicy(mode="off")) == heur
    assert A.sm90_config(p, 132, A.TuningPolicy(mode="cached", device_kind="NVIDIA H100")) == heur
    # an entry that kept the heuristic yields today's heuristic
    A.store_entry(A.tuning_key(p, 132, DEVICE), _entry(p, heur))
    assert A.sm90_config(p, 132, cached) == heur


@pytest.fixture
def captured_launch(monkeypatch):
    """The ops up to the launch on any machine (132 SMs, an H200), _run recording the kernel."""
    calls = []

    def fake_run(kern, arch, inputs, outputs, settings):
        calls.append(kern)
        return [jnp.zeros(o.shape, o.dtype) for o in outputs]

    monkeypatch.setattr(ops, "_environment_reason", lambda arch, settings: None)
    monkeypatch.setattr(ops, "_num_sms", lambda settings: settings.num_sms or 132)
    monkeypatch.setattr(ops, "_run", fake_run)
    monkeypatch.setattr(A, "detected_device_kind", lambda: DEVICE)
    return calls


@needs_nvcc
def test_ops_and_warmup_use_the_tuned_config_when_enabled(cache, captured_launch, monkeypatch):
    from custom_calls.deep_gemm.warmup import GemmShape, kernel_for

    g, m_pad, n, k, em = 6, 256, 1536, 512, 7
    p = A.grouped_problem("masked", m_pad, n, k, g, "bf16", em)
    assert p == PROBLEMS[5]
    other = _other(p)
    A.store_entry(A.tuning_key(p, 132, DEVICE), _entry(p, other))

    def op(mode):
        ops.m_grouped_gemm_masked(jnp.ones((g, m_pad, k), jnp.bfloat16), jnp.ones((g, n, k), jnp.bfloat16),
                                  jnp.full((g,), 3, jnp.int32), expected_m=em, recipe="bf16", arch=90,
                                  settings=KernelSettings(gemm_tuning=mode))
        return captured_launch.pop()

    shape = GemmShape("masked", m_pad, n, k, g, "bf16", expected_m=em)
    for mode, want in (("off", p.heuristic(132)), ("cached", other)):
        name, src, plan_fn = op(mode)
        assert src == codegen.sm90_gemm_source(want, n, k)
        assert plan_fn("/x.cubin").smem == want.smem_bytes
        assert kernel_for(shape, 90, 132, A.TuningPolicy(mode=mode)) == (name, src)  # warmup compiles it too
    assert kernel_for(shape, 90, 132, A.TuningPolicy(mode="off"))[1] == codegen.sm90_gemm_source(p.heuristic(132), n, k)


@pytest.mark.parametrize("p", [A.Sm90Problem("fp8_1d2d", "masked", 128, 256, 384, 3, 40),
                               A.Sm90Problem("fp8_1d2d", "contig", 3 * 256 + 128, 256, 384, 3),
                               A.Sm90Problem("bf16", "masked", 256, 128, 192, 2, 200),
                               A.Sm90Problem("bf16", "contig", 512, 128, 192, 2)], ids=lambda p: p.label)
def test_search_inputs_match_the_launch_plans(p):
    """The timing inputs (built with jax, here on the CPU) have the operand layout the plans address,
    and the output check flags exactly the elements more than one bf16 ulp off, on valid rows only."""
    case = A._Case(p, seed=3, weights={})
    cfg = p.heuristic(132)
    builder = P.sm90_fp8_plan if p.kernel == "fp8_1d2d" else P.sm90_bf16_plan
    plan = builder(cfg, "/x.cubin", m=p.m, n=p.n, k=p.k, num_groups=p.num_groups)
    for pat, layout in case.layouts.items():
        ops_ = [*case.inputs, layout]
        assert [tuple(x.shape) for x in ops_] == [tuple(x.shape) for x in _ops_like(p)]
        assert [x.dtype for x in ops_] == [x.dtype for x in _ops_like(p)]
        plan.check_operands(tuple(x.size * x.dtype.itemsize for x in ops_) + (math.prod(case.out.shape) * 2,))
        valid = np.broadcast_to(np.asarray(case.valid[pat]), case.out.shape)
        if p.gemm_kind == "masked":
            counts = np.asarray(layout)
            assert sum(case.patterns[pat]) == counts.sum() and (counts <= p.m).all()
            assert valid.sum() == counts.sum() * p.n
        else:
            ids = np.asarray(layout)
            assert set(ids.tolist()) - {-1} == set(range(p.num_groups)) and valid.sum() == (ids >= 0).sum() * p.n
    if p.gemm_kind == "masked":
        assert case.patterns["uniform"] == [p.expected_m] * p.num_groups
        routed = case.patterns["routed"]  # a multinomial draw of the same total, clipped to m_pad
        assert sum(routed) == p.expected_m * p.num_groups or max(routed) == p.m
    ref = jax.random.normal(jax.random.key(0), case.out.shape, jnp.float32).astype(jnp.bfloat16)
    pat = next(iter(case.layouts))
    valid = np.broadcast_to(np.asarray(case.valid[pat]), case.out.shape)
    agree = A._agreement_fn()
    assert [int(x) for x in agree(ref, ref, case.valid[pat])] == [0, int(valid.sum()), int(valid.sum())]
    one_ulp = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(ref, jnp.uint16) + 1, jnp.bfloat16)
    assert int(agree(one_ulp, ref, case.valid[pat])[0]) == 0  # the last bit may differ
    bumped = jnp.where(jnp.asarray(valid), ref * 1.03, ref)
    assert int(agree(bumped, ref, case.valid[pat])[0]) == int((np.asarray(ref, np.float32)[valid] != 0).sum())
    assert int(agree(jnp.where(jnp.asarray(valid), ref, jnp.nan), ref, case.valid[pat])[0]) == 0  # invalid rows


def _ops_like(p: A.Sm90Problem) -> list[jax.ShapeDtypeStruct]:
    """The operands the ops hand to the launch (see ops.m_grouped_gemm_*), as shapes."""
    g, m, n, k = p.num_groups, p.m, p.n, p.k
    masked = p.gemm_kind == "masked"
    a = (g, m, k) if masked else (m, k)
    lay = jax.ShapeDtypeStruct((g,) if masked else (m,), jnp.int32)
    if p.kernel == "bf16":
        return [jax.ShapeDtypeStruct(a, jnp.bfloat16), jax.ShapeDtypeStruct((g, n, k), jnp.bfloat16), lay]
    sa = ((g,) if masked else ()) + (-(-k // 128), -(-m // 4) * 4)
    return [jax.ShapeDtypeStruct(a, jnp.float8_e4m3fn), jax.ShapeDtypeStruct((g, n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct(sa, jnp.float32), jax.ShapeDtypeStruct((g, -(-n // 128), -(-k // 128)), jnp.float32),
            lay]


def test_trace_durations_follow_launch_order(monkeypatch):
    """Kernel events of a (fake) profiler trace: GEMM kernels only, duplicates across stream lines
    counted once, returned in start order; a count that does not match the launches is an error."""
    from types import SimpleNamespace as NS

    gemm = "void deep_gemm::sm90_fp8_gemm_1d2d_impl<(cute::UMMA::Major)0, 0u, 4096u>(float*, int*)"
    ev = lambda start, dur, name=gemm: NS(start_ns=start, duration_ns=dur, name=name)  # noqa: E731
    planes = [NS(name="/host:CPU", lines=[NS(name="Stream #1", events=[ev(1, 999)])]),
              NS(name="/device:GPU:0", lines=[
                  NS(name="Stream #7", events=[ev(300, 30), ev(100, 10), ev(150, 5, "loop_add_fusion"), ev(200, 20)]),
                  NS(name="Stream #7(compute)", events=[ev(100, 10)]),
                  NS(name="XLA Ops", events=[ev(100, 10)])])]

    def start(d):
        Path(d, "t.xplane.pb").write_bytes(b"")

    monkeypatch.setattr(jax.profiler, "start_trace", start)
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: None)
    monkeypatch.setattr(jax.profiler, "ProfileData", NS(from_file=lambda f: NS(planes=planes)))
    ran = []
    calls = [lambda i=i: ran.append(i) for i in range(3)]
    assert A.trace_kernel_durations(calls, ("sm90_fp8_gemm_1d2d",)) == [10e-9, 20e-9, 30e-9] and ran == [0, 1, 2]
    with pytest.raises(A.TraceMismatch, match="3 kernels"):
        A.trace_kernel_durations(calls[:2], ("sm90_fp8_gemm_1d2d",))
    with pytest.raises(A.TraceMismatch):
        A.trace_kernel_durations(calls, ("sm90_fp8_gemm_1d2d",), per_call=2)


# --- the search's bookkeeping, with the device replaced by a model of kernel times -------------------

class _FakeCase:
    """Stands in for autotune._Case: 'outputs' are the configs themselves, times come from a table."""

    def __init__(self, problem, seed, weights):
        self.problem = problem
        self.layouts = {"uniform": None, "routed": None} if problem.gemm_kind == "masked" else {"segments": None}
        self.patterns = {k: [1] for k in self.layouts}
        self.valid = dict.fromkeys(self.layouts)
        self.ref = {}

    def lower(self, cfg, cubin):
        return type("Lowered", (), {"compile": lambda _: cfg})()

    def launcher(self, cfg, cubin):
        return cfg

    def call(self, fn, pattern):
        return fn


def _fake_search(monkeypatch, problem, speed, broken=(), uncompilable=()):
    """Run autotune.tune with kernel time = speed(cfg) µs per pattern; returns (report, measured labels
    per trace)."""
    traces = []
    monkeypatch.setattr(toolchain, "detected_device", lambda: ("gpu", 90, 132))
    monkeypatch.setattr(A, "detected_device_kind", lambda: DEVICE)
    monkeypatch.setattr(A, "_Case", _FakeCase)
    monkeypatch.setattr(A, "compile_all", lambda jobs, workers=None: {
        src: (RuntimeError("ptxas error") if any(codegen.sm90_gemm_source(c, problem.n, problem.k) == src
                                                  for c in uncompilable) else Path("/x.cubin"))
        for _, src in jobs})
    monkeypatch.setattr(A, "_agreement_fn", lambda: lambda out, ref, valid: (int(out in broken), 0, 1))

    def measure(blocks, iters):
        traces.append([sorted(fns) for _, fns in blocks])
        return [{lab: {pat: speed(fn) for pat in case.layouts} for lab, fn in fns.items()} for case, fns in blocks]

    monkeypatch.setattr(A, "_measure", measure)
    (rep,) = A.tune([problem], policy=A.TuningPolicy(mode="search", max_tiles=6, refine_tiles=2, confirm_rounds=2))
    return rep, traces


@needs_nvcc
def test_search_picks_the_fastest_verified_config_and_confirms_it(cache, monkeypatch):
    p = PROBLEMS[2]
    heur = p.heuristic(132)
    first = A.phase1_candidates(p, 132, 6)
    fastest, broken, uncompilable = first[3], first[1], first[2]
    speeds = {fastest: 80.0, broken: 10.0}  # the broken one would win if its output were not checked
    rep, traces = _fake_search(monkeypatch, p, lambda c: speeds.get(c, 100.0 + c.block_n / 100), broken=[broken],
                               uncompilable=[uncompilable])
    assert rep.entry.tuned and rep.entry.config == fastest and rep.entry.heuristic == heur
    assert set(rep.rejected) == {A.config_label(broken), A.config_label(uncompilable)}
    assert "beyond bf16 rounding" in rep.rejected[A.config_label(broken)]
    assert "compile" in rep.rejected[A.config_label(uncompilable)]
    # phase 1, phase 2 (the heuristic and the phase-1 best beside the refinements), two confirmation rounds
    assert len(traces) == 4
    assert A.config_label(heur) in traces[1][0] and A.config_label(fastest) in traces[1][0]
    assert traces[2] == traces[3] == [sorted([A.config_label(heur), A.config_label(fastest)])]
    assert rep.confirm_us == [(2 * (100 + heur.block_n / 100), 160.0)] * 2  # masked: two patterns summed
    A.clear_memory_cache()
    assert A.load_entry(rep.key) == rep.entry
    from moe_jax.bench import tune

    (row,) = tune.tuning_table([rep])
    assert row["gain_pct"] == pytest.approx(100 * (2 * (100 + heur.block_n / 100) / 160.0 - 1))
    assert row["best_other"] == A.config_label(fastest) and row["tuned"]


@needs_nvcc
@pytest.mark.parametrize("gain", [0.0, 0.005])
def test_search_keeps_the_heuristic_unless_it_loses_by_more_than_min_gain(cache, monkeypatch, gain):
    p = PROBLEMS[0]
    heur = p.heuristic(132)

    def speed(c):  # BLOCK_N 160 tiles beat the heuristic by ``gain`` (0: they tie and lose the tie), others lag
        if c == heur:
            return 100.0
        return 100.0 / (1 + gain) + (1e-9 if gain == 0 else 0.0) if c.block_n == 160 else 150.0

    rep, traces = _fake_search(monkeypatch, p, speed)
    assert not rep.entry.tuned and rep.entry.config == heur
    assert len(traces) == (2 if gain == 0 else 4)  # a challenger within 1 % is confirmed, then rejected
    from moe_jax.bench import tune

    (row,) = tune.tuning_table([rep])
    assert row["gain_pct"] == pytest.approx(100 * gain, abs=1e-6) and not row["tuned"]


@needs_nvcc
def test_compare_cached_times_tuned_entries_only(cache, monkeypatch):
    tuned_p, kept_p, none_p = PROBLEMS[2], PROBLEMS[3], PROBLEMS[5]
    other = _other(tuned_p)
    A.store_entry(A.tuning_key(tuned_p, 132, DEVICE), _entry(tuned_p, other))
    A.store_entry(A.tuning_key(kept_p, 132, DEVICE), _entry(kept_p, kept_p.heuristic(132)))
    monkeypatch.setattr(toolchain, "detected_device", lambda: ("gpu", 90, 132))
    monkeypatch.setattr(A, "detected_device_kind", lambda: DEVICE)
    monkeypatch.setattr(A, "_Case", _FakeCase)
    monkeypatch.setattr(A, "compile_all", lambda jobs, workers=None: {src: Path("/x.cubin") for _, src in jobs})
    monkeypatch.setattr(A, "_measure", lambda blocks, iters: [
        {lab: {pat: (80.0 if fn == other else 100.0) for pat in case.layouts} for lab, fn in fns.items()}
        for case, fns in blocks])
    (row,) = A.compare_cached([tuned_p, kept_p, none_p])
    assert row["problem"] == tuned_p.label and row["tuned"] == A.config_label(other)
    assert row["heuristic_us"] == {"uniform": 100.0, "routed": 100.0} and row["gain"] == pytest.approx(0.25)


def test_bench_shapes_map_to_tuning_problems():
    from moe_jax.bench import gemm, tune

    probs = tune.problems(quick=False)
    assert len(probs) == len(set(probs)) == 11
    assert A.grouped_problem("contig", 32 * 1024, 4096, 7168, 32, "bf16") in probs
    layer = {(p.m, p.expected_m, p.n, p.k) for p in probs if p.gemm_kind == "masked"}
    # decode at 32 / 128 / 512 tokens, top-8 of 32 experts: GEMM1 (N 2I, K H) and GEMM2 (N H, K I)
    assert layer == {(256, 8, 4096, 7168), (256, 8, 7168, 2048), (256, 32, 4096, 7168), (256, 32, 7168, 2048),
                     (512, 128, 4096, 7168), (512, 128, 7168, 2048)}
    assert gemm.tuning_problems([("masked", gemm.MASKED[0])]) == [A.Sm90Problem("fp8_1d2d", "masked", 256, 4096,
                                                                                7168, 32, 32)]
    assert len(tune.problems(quick=True)) == 3


@pytest.mark.slow
def test_decode_layer_measurement_runs_at_smoke_size(capsys):
    from moe_jax.bench import tune

    res = tune.decode_layer(tokens=8, reps=2, iters=2, small=True)
    assert len(res["variants"]) == 4 and all(v["us_per_call"] > 0 for v in res["variants"].values())
    assert res["command_buffer_outputs_identical"] and res["tuned_vs_heuristic_rel_diff"] == 0.0
    assert "decode layer, 8 tokens" in capsys.readouterr().out


# --- the command-buffer launcher ------------------------------------------------------------------

def test_command_buffer_option_selects_the_target(monkeypatch):
    p = PROBLEMS[5]
    cfg = p.heuristic(132)

    def plan():
        return P.sm90_bf16_plan(cfg, "/x.cubin", m=p.m, n=p.n, k=p.k, num_groups=p.num_groups)

    targets = []

    def fake_ffi_call(target, outs, **kw):
        targets.append(target)
        return lambda *a, **attrs: [jnp.zeros(o.shape, o.dtype) for o in outs]

    monkeypatch.setattr(launch, "register", lambda: None)
    monkeypatch.setattr(jax.ffi, "ffi_call", fake_ffi_call)
    ins = [jnp.zeros((p.num_groups, p.m, p.k), jnp.bfloat16), jnp.zeros((p.num_groups, p.n, p.k), jnp.bfloat16),
           jnp.zeros((p.num_groups,), jnp.int32)]
    outs = [jax.ShapeDtypeStruct((p.num_groups, p.m, p.n), jnp.bfloat16)]
    for flag in (False, True):
        launch.launch(plan(), ins, outs, command_buffer=flag)
    launch.launch(plan(), ins, outs)
    assert targets == [launch.FFI_TARGET, launch.FFI_TARGET_CMD_BUFFER, launch.FFI_TARGET]


_TRAITS = textwrap.dedent("""
    #include <dlfcn.h>
    #include <cstdio>
    #include "xla/ffi/api/c_api.h"
    // Asks a handler for its metadata, as XLA does when it registers one.
    int main(int argc, char** argv) {
      void* lib = dlopen(argv[1], RTLD_NOW);
      if (!lib) { std::printf("dlopen failed\\n"); return 1; }
      for (int i = 2; i < argc; ++i) {
        auto fn = reinterpret_cast<XLA_FFI_Handler*>(dlsym(lib, argv[i]));
        if (!fn) { std::printf("%s missing\\n", argv[i]); return 1; }
        XLA_FFI_Metadata metadata = {XLA_FFI_Metadata_STRUCT_SIZE};
        XLA_FFI_Metadata_Extension ext = {{XLA_FFI_Metadata_Extension_STRUCT_SIZE, XLA_FFI_Extension_Metadata,
                                           nullptr}, &metadata};
        XLA_FFI_CallFrame frame = {};
        frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
        frame.extension_start = &ext.extension_base;
        if (fn(&frame) != nullptr) { std::printf("%s: metadata call failed\\n", argv[i]); return 1; }
        std::printf("%s %u\\n", argv[i], metadata.traits);
      }
      return 0;
    }
""")


@pytest.mark.slow
@needs_nvcc
def test_launcher_exports_a_plain_and_a_command_buffer_handler(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_JAX_CACHE_DIR", str(tmp_path))
    lib = launch.build_handler()
    src = tmp_path / "traits.cc"
    src.write_text(_TRAITS)
    exe = tmp_path / "traits"
    subprocess.run([launch.find_cxx(), "-std=c++17", f"-I{jax.ffi.include_dir()}", str(src), "-o", str(exe), "-ldl"],
                   check=True, capture_output=True)
    out = subprocess.run([str(exe), str(lib), "MoeJaxDeepGemmLaunch", "MoeJaxDeepGemmLaunchCmdBuffer"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    traits = dict(line.split() for line in out.stdout.splitlines())
    assert traits == {"MoeJaxDeepGemmLaunch": "0", "MoeJaxDeepGemmLaunchCmdBuffer": "1"}  # kCmdBufferCompatible


# --- nvcc: non-default candidates compile for sm_90a ----------------------------------------------

@pytest.mark.slow
@needs_nvcc
def test_non_default_candidates_compile_for_sm90a(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_JAX_CACHE_DIR", str(tmp_path))
    picks = [  # multicast of A with a 64-wide tile, fewer stages, 32 B D swizzle; the unswizzled D store;
               # a BF16 64-row tile at BLOCK_N 256
        (PROBLEMS[2], H.sm90_build_config("fp8_1d2d", "masked", "bf16", 32, 132, 7168, 64, 64, 1, 2, 6, 32)),
        (PROBLEMS[0], H.sm90_build_config("fp8_1d2d", "contig", "bf16", 32, 132, 7168, 128, 192, 1, 1, None, 0)),
        (PROBLEMS[4], H.sm90_build_config("bf16", "contig", "bf16", 32, 132, 7168, 64, 256, 1, 1)),
    ]
    jobs = []
    for p, c in picks:
        assert H.sm90_config_reason(c, p.m, p.n, p.k) is None and c != p.heuristic(132)
        jobs.append(A._kernel_source(p, c))
    res = A.compile_all(jobs + jobs[:1], workers=2)  # a repeated source compiles once
    assert len(res) == 3
    for path in res.values():
        assert not isinstance(path, Exception), path
        data = Path(path).read_bytes()
        assert data[:4] == b"\x7fELF" and len(data) > 10_000
    assert len(list((tmp_path / "cubin").iterdir())) == 3


# --- on the GPU -----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_small_search_on_gpu_writes_a_config_the_ops_then_use(cache, monkeypatch):
    p = A.Sm90Problem("fp8_1d2d", "masked", 128, 1024, 1024, 8, 40)
    policy = A.TuningPolicy(mode="search", max_tiles=4, refine_tiles=1, iters=3, confirm_rounds=1, retune=True)
    (rep,) = A.tune([p], policy=policy)
    assert rep.path is not None and rep.path.is_file()
    assert set(rep.patterns) == {"uniform", "routed"} and sum(rep.patterns["routed"]) == 8 * 40
    assert rep.times_us and all(t > 0 for d in rep.times_us.values() for t in d.values())
    assert not any("differs" in why for why in rep.rejected.values()), rep.rejected  # same products, other tiling
    A.clear_memory_cache()
    entry = A.load_entry(rep.key)
    assert entry == rep.entry
    if entry.tuned:
        assert min(entry.heuristic_us) > max(entry.config_us)
    assert A.sm90_config(p, rep.key.num_sms, A.TuningPolicy(mode="cached")) == (entry.config if entry.tuned else p.heuristic(rep.key.num_sms))


def _custom_calls_in_command_buffers(thunk_sequence: str) -> int:
    """Custom-call thunks nested under a kCommandBuffer thunk in XLA's thunk-sequence dump (a
    command buffer's thunks are the indented lines after its own)."""
    count, inside = 0, False
    for line in thunk_sequence.splitlines():
        entry = line.strip()
        if not entry:
            continue
        nested = line[:1].isspace()
        if not nested:
            inside = "kCommandBuffer" in entry
        elif inside and "kCustomCall" in entry:
            count += 1
    return count


def test_thunk_dump_reader_counts_only_captured_custom_calls():
    """The reader of XLA's thunk-sequence dump, on the dump's layout as XLA 0.11 writes it (one H200
    run): thunks nested under a kCommandBuffer line are indented; top-level ones are not captured."""
    captured = ("000: kCommandBuffer [source | sink] \n"
                "    001: kCustomKernel [source       | next=003 (2)] loop_clamp_fusion grid: [1, 1, 1]\n"
                "    003: kCustomCall   [prev=002 (1) | sink        ] kCustomCall\n"
                "    004: kCustomCall   [prev=002 (2) | sink        ] kCustomCall\n")
    plain = ("001: kCustomKernel [source       | next=003 (2)] loop_clamp_fusion grid: [1, 1, 1]\n"
             "003: kCustomCall   [prev=002 (1) | sink        ] kCustomCall\n")
    assert _custom_calls_in_command_buffers(captured) == 2
    assert _custom_calls_in_command_buffers(plain) == 0
    assert _custom_calls_in_command_buffers(captured + plain) == 2


@pytest.mark.gpu
def test_command_buffer_launches_match_plain_ones_as_addresses_change(monkeypatch, tmp_path):
    """Six grouped GEMMs in one program, recorded in an XLA command buffer (CUDA graph), called with
    changing inputs (new buffer addresses each call) and repeated ones: bit-identical to the plain
    launches every time. XLA forms command buffers on its thunk sequence, after the HLO: the
    capture is read from the thunk sequence XLA dumps."""
    import custom_calls.deep_gemm as dg

    g, m_pad, n, k = 4, 128, 256, 512
    rng = np.random.default_rng(0)

    def f(a, w, mm, settings):
        outs = []
        for i in range(6):
            outs.append(dg.m_grouped_gemm_masked(a * (i + 1), w, mm, expected_m=64, recipe="bf16", arch=90,
                                                 settings=settings))
        return outs

    compiled, captured = {}, {}
    for flag in ("0", "1"):
        settings = KernelSettings(command_buffer=flag == "1")
        sample = (jnp.zeros((g, m_pad, k), jnp.bfloat16), jnp.zeros((g, n, k), jnp.bfloat16),
                  jnp.zeros((g,), jnp.int32))
        dump = tmp_path / f"dump{flag}"
        opts = {"xla_gpu_graph_min_graph_size": 1, "xla_dump_to": str(dump)}
        # the settings are a static argument: each is its own trace and program
        compiled[flag] = jax.jit(f, static_argnames="settings", compiler_options=opts).lower(
            *sample, settings=settings).compile()
        (thunks,) = dump.glob("*thunk_sequence_after_thunk_passes.txt")
        captured[flag] = _custom_calls_in_command_buffers(thunks.read_text())
    text = compiled["1"].as_text()
    assert launch.FFI_TARGET_CMD_BUFFER in text and launch.FFI_TARGET_CMD_BUFFER not in compiled["0"].as_text()
    assert captured == {"0": 0, "1": 6}, captured
    w = jnp.asarray(rng.standard_normal((g, n, k)), jnp.bfloat16)
    mm = jnp.asarray([5, 128, 0, 77], jnp.int32)
    inputs = [jnp.asarray(rng.standard_normal((g, m_pad, k)), jnp.bfloat16) for _ in range(3)]
    for a in inputs + inputs[:1] * 3 + inputs[::-1]:
        plain = compiled["0"](a, w, mm)
        graph = compiled["1"](a, w, mm)
        for x, y in zip(plain, graph):
            xv, yv = np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32))
            for gi, rows in enumerate(np.asarray(mm)):
                np.testing.assert_array_equal(xv[gi, :rows], yv[gi, :rows])
