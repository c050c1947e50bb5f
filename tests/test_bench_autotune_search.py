"""The autotuner's search (moe_jax/bench/autotune_search.py) without a GPU: the pruned search lists,
launch plans of candidates, the timing inputs and the output check, the profiler-trace reader, the
search's bookkeeping with the device replaced by a model of kernel times, the benchmark shapes it
tunes, and nvcc compiles of non-default candidates for sm_90a. On an SM90 GPU (``gpu`` marker): a
small search end to end."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from custom_calls.deep_gemm import autotune as A, sm90_gemm as G
from custom_calls.deep_gemm.warmup import GemmShape
from custom_calls.deep_gemm.family import GemmProblem
from custom_calls.deep_gemm.sm90_bf16 import FAMILY as BF16
from custom_calls.deep_gemm.sm90_fp8_1d2d import FAMILY as FP8
from custom_calls.native import toolchain
from moe_jax.bench import autotune_search as S
from test_deep_gemm_autotune import DEVICE, PROBLEMS, _entry, _id, _other, _p
from test_deep_gemm_host import needs_nvcc


@pytest.mark.parametrize("p", PROBLEMS, ids=_id)
def test_search_lists_start_from_the_heuristic_and_stay_legal(p):
    heur = G.sm90_gemm_config(p, 132)
    first = S.phase1_candidates(p, 132, 14)
    assert first[0] == heur and len(first) == len(set(first)) <= 14
    for c in first:
        assert G.sm90_config_reason(c, p.m, p.n, p.k) is None
        assert c.num_stages == G.sm90_max_stages(c.family, c.cd_dtype, p.k, c.block_m, c.block_n)
    # every multicast choice legal at the heuristic's BLOCK_M is tried
    legal = {(c.cluster_m, c.cluster_n) for c in G.sm90_tile_configs(p, 132) if c.block_m == heur.block_m}
    assert {(c.cluster_m, c.cluster_n) for c in first if c.block_m == heur.block_m} == legal
    refined = S.refine_candidates(p, 132, first[:2])
    for c in refined:
        assert G.sm90_config_reason(c, p.m, p.n, p.k) is None and c not in first[:2]
        parent = next(q for q in first[:2] if (q.block_m, q.block_n, q.cluster_m, q.cluster_n) ==
                      (c.block_m, c.block_n, c.cluster_m, c.cluster_n))
        assert (c.num_stages < parent.num_stages) != (c.swizzle_cd != parent.swizzle_cd)
        assert c.num_stages >= 3
    assert S.phase1_candidates(p, 132, 1) == [heur]


def _operand_bytes(p: GemmProblem) -> tuple[int, ...]:
    g, m, n, k = p.num_groups, p.m, p.n, p.k
    rows = g * m if p.gemm_kind == "masked" else m
    layout = 4 * (g if p.gemm_kind == "masked" else m)
    out = rows * n * 2
    if p.family is BF16:
        return rows * k * 2, g * n * k * 2, layout, out
    sfa = 4 * (g if p.gemm_kind == "masked" else 1) * -(-k // 128) * (-(-m // 4) * 4)
    return rows * k, g * n * k, sfa, 4 * g * -(-n // 128) * -(-k // 128), layout, out


@pytest.mark.parametrize("p", PROBLEMS, ids=_id)
def test_candidate_launch_plans_fit_their_operands(p):
    first = S.phase1_candidates(p, 132, 14)
    for c in first + S.refine_candidates(p, 132, first[:3]):
        plan = p.family.plan(c, "/x.cubin", m=p.m, n=p.n, k=p.k)
        plan.check()
        plan.check_operands(_operand_bytes(p))
        assert (plan.grid, plan.block, plan.cluster, plan.smem) == (132, c.num_threads, c.cluster, c.smem_bytes)
        d = plan.tmaps[2]
        assert d.box[0] == (c.swizzle_cd // 2 if c.swizzle_cd else c.block_n) and d.swizzle == c.swizzle_cd


@pytest.mark.parametrize("p", [_p("fp8_block", "masked", 128, 256, 384, 3, 40),
                               _p("fp8_block", "contig", 3 * 256 + 128, 256, 384, 3),
                               _p("bf16", "masked", 256, 128, 192, 2, 200),
                               _p("bf16", "contig", 512, 128, 192, 2)], ids=_id)
def test_search_inputs_match_the_launch_plans(p):
    """The timing inputs (built with jax, here on the CPU) have the operand layout the plans address,
    and the output check flags exactly the elements more than one bf16 ulp off, on valid rows only."""
    case = S._Case(p, seed=3, weights={})
    cfg = G.sm90_gemm_config(p, 132)
    plan = p.family.plan(cfg, "/x.cubin", m=p.m, n=p.n, k=p.k)
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
    agree = S._agreement_fn()
    assert [int(x) for x in agree(ref, ref, case.valid[pat])] == [0, int(valid.sum()), int(valid.sum())]
    one_ulp = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(ref, jnp.uint16) + 1, jnp.bfloat16)
    assert int(agree(one_ulp, ref, case.valid[pat])[0]) == 0  # the last bit may differ
    bumped = jnp.where(jnp.asarray(valid), ref * 1.03, ref)
    assert int(agree(bumped, ref, case.valid[pat])[0]) == int((np.asarray(ref, np.float32)[valid] != 0).sum())
    assert int(agree(jnp.where(jnp.asarray(valid), ref, jnp.nan), ref, case.valid[pat])[0]) == 0  # invalid rows


def _ops_like(p: GemmProblem) -> list[jax.ShapeDtypeStruct]:
    """The operands the ops hand to the launch (see ops.m_grouped_gemm_*), as shapes."""
    g, m, n, k = p.num_groups, p.m, p.n, p.k
    masked = p.gemm_kind == "masked"
    a = (g, m, k) if masked else (m, k)
    lay = jax.ShapeDtypeStruct((g,) if masked else (m,), jnp.int32)
    if p.family is BF16:
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
    assert S.trace_kernel_durations(calls, ("sm90_fp8_gemm_1d2d",)) == [10e-9, 20e-9, 30e-9] and ran == [0, 1, 2]
    with pytest.raises(S.TraceMismatch, match="3 kernels"):
        S.trace_kernel_durations(calls[:2], ("sm90_fp8_gemm_1d2d",))
    with pytest.raises(S.TraceMismatch):
        S.trace_kernel_durations(calls, ("sm90_fp8_gemm_1d2d",), per_call=2)


# --- the search's bookkeeping, with the device replaced by a model of kernel times -------------------

class _FakeCase:
    """Stands in for autotune_search._Case: 'outputs' are the configs themselves, times come from a table."""

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
    """Run autotune_search.tune with kernel time = speed(cfg) µs per pattern; returns (report, measured labels
    per trace)."""
    traces = []
    monkeypatch.setattr(toolchain, "detected_device", lambda: ("gpu", 90, 132))
    monkeypatch.setattr(A, "detected_device_kind", lambda: DEVICE)
    monkeypatch.setattr(S, "_Case", _FakeCase)
    monkeypatch.setattr(S, "compile_all", lambda jobs, arch, workers=None: {
        src: (RuntimeError("ptxas error") if any(c.family.source(c, problem.n, problem.k) == src
                                                  for c in uncompilable) else Path("/x.cubin"))
        for _, src in jobs})
    monkeypatch.setattr(S, "_agreement_fn", lambda: lambda out, ref, valid: (int(out in broken), 0, 1))

    def measure(blocks, iters):
        traces.append([sorted(fns) for _, fns in blocks])
        return [{lab: {pat: speed(fn) for pat in case.layouts} for lab, fn in fns.items()} for case, fns in blocks]

    monkeypatch.setattr(S, "_measure", measure)
    (rep,) = S.tune([problem], policy=S.SearchPolicy(max_tiles=6, refine_tiles=2, confirm_rounds=2))
    return rep, traces


@needs_nvcc
def test_search_picks_the_fastest_verified_config_and_confirms_it(cache, monkeypatch):
    p = PROBLEMS[2]
    heur = G.sm90_gemm_config(p, 132)
    first = S.phase1_candidates(p, 132, 6)
    fastest, broken, uncompilable = first[3], first[1], first[2]
    speeds = {fastest: 80.0, broken: 10.0}  # the broken one would win if its output were not checked
    rep, traces = _fake_search(monkeypatch, p, lambda c: speeds.get(c, 100.0 + c.block_n / 100), broken=[broken],
                               uncompilable=[uncompilable])
    assert rep.entry.tuned and rep.entry.config == fastest and rep.entry.heuristic == heur
    assert set(rep.rejected) == {S.config_label(broken), S.config_label(uncompilable)}
    assert "beyond bf16 rounding" in rep.rejected[S.config_label(broken)]
    assert "compile" in rep.rejected[S.config_label(uncompilable)]
    # phase 1, phase 2 (the heuristic and the phase-1 best beside the refinements), two confirmation rounds
    assert len(traces) == 4
    assert S.config_label(heur) in traces[1][0] and S.config_label(fastest) in traces[1][0]
    assert traces[2] == traces[3] == [sorted([S.config_label(heur), S.config_label(fastest)])]
    assert rep.confirm_us == [(2 * (100 + heur.block_n / 100), 160.0)] * 2  # masked: two patterns summed
    A.clear_memory_cache()
    assert A.load_entry(rep.key) == rep.entry
    from moe_jax.bench import tune

    (row,) = tune.tuning_table([rep])
    assert row["gain_pct"] == pytest.approx(100 * (2 * (100 + heur.block_n / 100) / 160.0 - 1))
    assert row["best_other"] == S.config_label(fastest) and row["tuned"]


@needs_nvcc
@pytest.mark.parametrize("gain", [0.0, 0.005])
def test_search_keeps_the_heuristic_unless_it_loses_by_more_than_min_gain(cache, monkeypatch, gain):
    p = PROBLEMS[0]
    heur = G.sm90_gemm_config(p, 132)

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
    A.store_entry(A.tuning_key(kept_p, 132, DEVICE), _entry(kept_p, G.sm90_gemm_config(kept_p, 132)))
    monkeypatch.setattr(toolchain, "detected_device", lambda: ("gpu", 90, 132))
    monkeypatch.setattr(A, "detected_device_kind", lambda: DEVICE)
    monkeypatch.setattr(S, "_Case", _FakeCase)
    monkeypatch.setattr(S, "compile_all", lambda jobs, arch, workers=None: {src: Path("/x.cubin") for _, src in jobs})
    monkeypatch.setattr(S, "_measure", lambda blocks, iters: [
        {lab: {pat: (80.0 if fn == other else 100.0) for pat in case.layouts} for lab, fn in fns.items()}
        for case, fns in blocks])
    (row,) = S.compare_cached([tuned_p, kept_p, none_p])
    assert row["problem"] == S.problem_label(tuned_p) and row["tuned"] == S.config_label(other)
    assert row["heuristic_us"] == {"uniform": 100.0, "routed": 100.0} and row["gain"] == pytest.approx(0.25)


def test_bench_shapes_map_to_tuning_problems():
    from moe_jax.bench import gemm, tune

    probs = tune.problems(quick=False)
    assert len(probs) == len(set(probs)) == 11
    assert _p("bf16", "contig", 32 * 1024, 4096, 7168, 32) in probs
    layer = {(p.m, p.expected_m, p.n, p.k) for p in probs if p.gemm_kind == "masked"}
    # decode at 32 / 128 / 512 tokens, top-8 of 32 experts: GEMM1 (N 2I, K H) and GEMM2 (N H, K I)
    assert layer == {(256, 8, 4096, 7168), (256, 8, 7168, 2048), (256, 32, 4096, 7168), (256, 32, 7168, 2048),
                     (512, 128, 4096, 7168), (512, 128, 7168, 2048)}
    assert S.bench_problems([("masked", gemm.MASKED[0])]) == [_p("fp8_block", "masked", 256, 4096, 7168, 32, 32)]
    assert len(tune.problems(quick=True)) == 3


def test_search_policy_validation_and_the_shapes_it_tunes():
    with pytest.raises(ValueError, match="min_gain"):
        S.SearchPolicy(min_gain=1.0)
    with pytest.raises(ValueError, match="max_tiles"):
        S.SearchPolicy(max_tiles=0)
    shapes = [GemmShape("masked", 256, 512, 512, 4, "bf16", expected_m=1000), GemmShape("contig", 512, 256, 256, 2),
              GemmShape("contig", 512, 256, 256, 2), GemmShape("dense", 64, 256, 256),
              GemmShape("prenorm", 64, 24, 256)]
    assert S.tuning_problems(shapes) == [_p("bf16", "masked", 256, 512, 512, 4, 256),
                                         _p("fp8_block", "contig", 512, 256, 256, 2)]


def test_warmup_tuned_tunes_first_then_compiles_the_cached_configs(monkeypatch):
    calls = []
    monkeypatch.setattr(S, "tune", lambda problems, **kw: calls.append(("tune", problems, kw)) or [])
    monkeypatch.setattr(S, "warmup", lambda shapes, **kw: calls.append(("warmup", shapes, kw)) or [])
    shapes = [GemmShape("contig", 512, 256, 256, 2), GemmShape("dense", 64, 256, 256)]
    S.warmup_tuned(shapes, num_sms=132, policy=S.SearchPolicy(device_kind=DEVICE), progress=False)
    (_, probs, kw), (_, compiled, wkw) = calls
    assert probs == [_p("fp8_block", "contig", 512, 256, 256, 2)] and kw["num_sms"] == 132
    assert compiled == shapes and wkw["arch"] == 90 and wkw["num_sms"] == 132 and wkw["progress"] is False
    assert wkw["tuning"] == A.TuningPolicy(mode="cached", device_kind=DEVICE)


@pytest.mark.slow
def test_decode_layer_measurement_runs_at_smoke_size(capsys):
    from moe_jax.bench import tune

    res = tune.decode_layer(tokens=8, reps=2, iters=2, small=True)
    assert len(res["variants"]) == 4 and all(v["us_per_call"] > 0 for v in res["variants"].values())
    assert res["command_buffer_outputs_identical"] and res["tuned_vs_heuristic_rel_diff"] == 0.0
    assert "decode layer, 8 tokens" in capsys.readouterr().out


# --- nvcc: non-default candidates compile for sm_90a ----------------------------------------------

@pytest.mark.slow
@needs_nvcc
def test_non_default_candidates_compile_for_sm90a(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_JAX_CACHE_DIR", str(tmp_path))
    picks = [  # multicast of A with a 64-wide tile, fewer stages, 32 B D swizzle; the unswizzled D store;
               # a BF16 64-row tile at BLOCK_N 256
        (PROBLEMS[2], G.sm90_build_config(FP8, "masked", "bf16", 32, 132, 7168, 64, 64, 1, 2, 6, 32)),
        (PROBLEMS[0], G.sm90_build_config(FP8, "contig", "bf16", 32, 132, 7168, 128, 192, 1, 1, None, 0)),
        (PROBLEMS[4], G.sm90_build_config(BF16, "contig", "bf16", 32, 132, 7168, 64, 256, 1, 1)),
    ]
    jobs = []
    for p, c in picks:
        assert G.sm90_config_reason(c, p.m, p.n, p.k) is None and c != G.sm90_gemm_config(p, 132)
        jobs.append(S.kernel_source(p, c))
    res = S.compile_all(jobs + jobs[:1], 90, workers=2)  # a repeated source compiles once
    assert len(res) == 3
    for path in res.values():
        assert not isinstance(path, Exception), path
        data = Path(path).read_bytes()
        assert data[:4] == b"\x7fELF" and len(data) > 10_000
    assert len(list((tmp_path / "cubin").iterdir())) == 3


# --- on the GPU -----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_small_search_on_gpu_writes_a_config_the_ops_then_use(cache, monkeypatch):
    p = _p("fp8_block", "masked", 128, 1024, 1024, 8, 40)
    policy = S.SearchPolicy(max_tiles=4, refine_tiles=1, iters=3, confirm_rounds=1, retune=True)
    (rep,) = S.tune([p], policy=policy)
    assert rep.path is not None and rep.path.is_file()
    assert set(rep.patterns) == {"uniform", "routed"} and sum(rep.patterns["routed"]) == 8 * 40
    assert rep.times_us and all(t > 0 for d in rep.times_us.values() for t in d.values())
    assert not any("differs" in why for why in rep.rejected.values()), rep.rejected  # same products, other tiling
    A.clear_memory_cache()
    entry = A.load_entry(rep.key)
    assert entry == rep.entry
    if entry.tuned:
        assert min(entry.heuristic_us) > max(entry.config_us)
    want = entry.config if entry.tuned else G.sm90_gemm_config(p, rep.key.num_sms)
    assert A.sm90_config(p, rep.key.num_sms, A.TuningPolicy(mode="cached")) == want


