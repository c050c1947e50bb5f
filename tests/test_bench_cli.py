"""The benchmark CLI (`python -m moe_jax.bench`): help; `layer` without flags on a CPU (scaled
shapes in under a minute, JSON and PNG output, "auto" labelled as fallen back and given no
speed-up or roofline figure); exit status 1 when a requested row failed; the clear refusal of
`gemm` and `triton` without a GPU; what the backend registry says each op resolved to; and the
float32 model of the layer benchmark against a float64 per-token numpy loop."""

import dataclasses
import json
import math
import subprocess
import sys
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from custom_calls import ActivationSpec
from moe_jax.bench import _timing, layer as bench_layer
from moe_jax.bench.__main__ import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STAGES = ["route (gate GEMM + top-k)", "dispatch", "permute+quant", "GEMM1", "activation+quant", "GEMM2",
          "unpermute"]


def _strict_json(path):
    def no_constant(name):
        raise ValueError(f"non-standard JSON constant {name}")

    with open(path) as f:
        return json.load(f, parse_constant=no_constant)


def _positive(v):
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def _no_gpu():
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a CUDA device is present: the benchmark would run the GPU sizes and backends")


def test_layer_without_flags_on_cpu_runs_scaled_shapes_quickly_and_honestly(tmp_path):
    """`python -m moe_jax.bench layer` as a new user runs it on a CPU: scaled shapes, a progress line
    per step, exit 0, well within a minute on an idle 2-core machine (the bound leaves room for a
    loaded CI runner); "auto" resolves every op to the reference here, so it is labelled as fallen
    back, not measured a second time, and no speed-up or roofline figure compares the reference's
    code with itself."""
    _no_gpu()
    j, p = tmp_path / "layer.json", tmp_path / "layer.png"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "moe_jax.bench", "layer", "--json", str(j), "--plot", str(p)],
                          capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert elapsed < 120, elapsed
    # said on stderr: why the shapes are scaled and how to get the full ones; a progress line per step
    assert "no GPU" in proc.stderr and "--full" in proc.stderr and "[layer 1/" in proc.stderr
    # the table on stdout, progress on stderr
    assert "== prefill" in proc.stdout and "== decode" in proc.stdout and "GEMM1" in proc.stdout
    assert "rows per expert" in proc.stdout
    assert "shapes scaled down" in proc.stdout
    assert "float32 model" in proc.stderr and "float32 model" not in proc.stdout
    assert proc.stdout.count("auto (every op fell back to the reference: no accelerated implementation on 'cpu')"
                             ": the reference row's code, not measured again") == 2, proc.stdout
    assert "auto vs reference" not in proc.stdout and "roofline" not in proc.stdout
    data = _strict_json(j)
    assert data["backends"] == ["auto", "reference"] and data["scaled"] is True and _positive(data["copy_GBps"])
    by_shape = {r["shape"]: r for r in data["results"]}
    assert set(by_shape) == {"prefill", "decode"}
    for shape, layout, other in (("prefill", "contig", "masked"), ("decode", "masked", "contig")):
        res = by_shape[shape]
        assert res["layout"] == layout and res["tokens"] in (64, 16) and _positive(res["weights_GB"])
        rows = res["rows_per_expert"]  # every route lands on one expert: each set's counts sum to M x top_k
        assert len({sum(c) for c in rows["sets"]}) == 1 and rows["min"] <= rows["mean"] <= rows["max"]
        auto = res["auto"]
        assert auto["fell_back"] is True and auto["same_as"] == "reference" and "end_to_end_us" not in auto
        assert set(auto["implementations"]) == {"route_topk", f"dispatch_map_{layout}", f"permute_{layout}",
                                                f"m_grouped_gemm_{layout}", f"activation_quant_{layout}", "unpermute"}
        assert set(auto["implementations"].values()) == {"reference"}
        row = res["reference"]
        assert "error" not in row, row
        for key in ("end_to_end_us", "with_routing_us", "gemms_us", "e2e_over_gemms", "temp_MB", "temp_bound_MB"):
            assert _positive(row[key]), (shape, key, row[key])
        assert list(row["stages_us"]) == STAGES and all(_positive(v) for v in row["stages_us"].values())
        assert math.isclose(row["gemms_us"], row["stages_us"]["GEMM1"] + row["stages_us"]["GEMM2"], rel_tol=1e-9)
        # fp8 activations and weights against the float32 model: a few percent, not zero, not garbage
        assert 1e-4 < row["rel_err"] < 0.1 and row["rel_err"] <= row["worst_row"] < 0.2
        assert 0 <= row[f"vs_{other}_rel"] < 1e-2
    assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000


@pytest.mark.parametrize("sub, options", [("layer", ["--json", "--plot", "--no-error", "--small", "--full",
                                                     "--backends"]),
                                          ("gemm", ["--json", "--plot", "--markdown", "--quick"]),
                                          ("triton", ["--json", "--no-sweep", "--reps", "--routing-only"]),
                                          ("parallel", ["--json", "--backend", "--model", "--tokens"]),
                                          ("load", ["--json", "--small", "--dir", "--keep", "--ep"]),
                                          ("fused", ["--json", "--tokens", "--all", "--grids", "--steady", "--iters",
                                                     "--only", "--top", "--trace"]),
                                          ("timeline", ["--json", "--tokens", "--layout", "--reps", "--chain"]),
                                          ("w4a8", ["--json", "--configs", "--rows", "--tokens", "--passes",
                                                    "--iters"])])
def test_subcommand_help(capsys, sub, options):
    with pytest.raises(SystemExit) as e:
        main([sub, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and f"python -m moe_jax.bench {sub}" in out
    assert all(o in out for o in options), out


def test_top_level_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(sub in out for sub in ("gemm", "layer", "triton", "parallel", "load", "fused",
                                                                  "timeline", "w4a8"))


@pytest.mark.parametrize("sub", ["gemm", "triton", "fused", "timeline", "w4a8"])
def test_gpu_subcommand_without_gpu_exits_with_a_message_not_a_traceback(tmp_path, sub):
    _no_gpu()
    j = tmp_path / f"{sub}.json"
    proc = subprocess.run([sys.executable, "-m", "moe_jax.bench", sub, "--json", str(j)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"python -m moe_jax.bench {sub}: needs a CUDA GPU" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == "" and not j.exists()


def test_timeline_summary_of_a_known_stream():
    """Two layers of three kernels with known starts and durations (ns): per-kernel medians, the
    idle gap before each kernel, busy and span per layer, the start-up before the first long kernel."""
    from moe_jax.bench.timeline import _summary, short_names

    events = [("route", 0, 2000), ("big", 50000, 300000), ("combine", 351000, 1000),
              ("route", 354000, 4000), ("big", 359000, 300000), ("combine", 661000, 3000)]
    res = _summary(list(reversed(events)), layers=2)  # any order: sorted by start
    rows = {r["kernel"]: r for r in res["rows"]}
    assert rows["big"]["median_us"] == 300 and rows["big"]["per_layer"] == 1
    assert rows["big"]["gap_mean_us"] == (48 + 1) / 2 and rows["route"]["gap_median_us"] == 2
    assert rows["combine"]["median_us"] == 2 and rows["combine"]["gap_median_us"] == 1.5
    assert res["busy_us"] == 610 / 2 and res["span_us"] == 664 / 2 and res["startup_us"] == 50
    names = short_names(["void deep_gemm::gemm_impl<1u, 2u>(int)", "route_kernel", "void deep_gemm::gemm_impl<3u>(int)"])
    assert list(names.values()) == ["deep_gemm::gemm_impl", "route_kernel", "deep_gemm::gemm_impl #2"]


def _fused_trace(events_by_cta):
    """A fused-kernel event trace (CTAs, 4 roles, 16 slots, 4 uint32 words) from {cta: [(role, event,
    aux, ns)]}: each role's events in its slots in order, as the kernel writes them."""
    import numpy as np

    words = np.zeros((len(events_by_cta), 4, 16, 2), np.uint64)
    for c, evs in events_by_cta.items():
        slot = [0] * 4
        for role, ev, aux, ns in evs:
            words[c, role, slot[role]] = ((ev << 56) | aux, ns)
            slot[role] += 1
    return words.view(np.uint32).reshape(len(events_by_cta), 4, 16, 4)


def test_fused_trace_phases_of_a_known_trace():
    """Two CTAs with known event times (ns): event medians and last CTA from the first CTA's start,
    per GEMM phase the span, tiles, mainloop and epilogue sums and the loader's wait for its inputs,
    the bandwidth over the span; a trace without a start is refused."""
    from moe_jax.bench.fused import trace_phases

    def tile(ph, n_block, t0, main_end, epi_end):
        return [(2, 40, ph | (n_block << 32), t0), (2, 43, 0, main_end), (2, 44, 0, epi_end)]

    cta0 = [(0, 1, 0, 1000), (0, 23, 0, 3000), (0, 22, 0, 50000),
            (1, 30, 0 | (1 << 32), 4000), (1, 31, 0 | (1 << 32), 5000),
            (1, 30, 1 | (2 << 32), 20000), (1, 31, 1 | (2 << 32), 24000),
            *tile(1, 0, 5000, 15000, 16000), *tile(2, 0, 24000, 40000, 42000), (2, 19, 2, 43000)]
    cta1 = [(0, 1, 0, 2000), (0, 23, 0, 5000), (0, 22, 0, 52000),
            *tile(1, 1, 6000, 14000, 15000), *tile(1, 2, 15000, 21000, 23000), (2, 19, 2, 24000)]
    res = trace_phases(_fused_trace({0: cta0, 1: cta1}), phase_bytes=(44e6, 36e6))
    assert res["ctas"] == 2
    assert res["events"]["prologue done"] == {"median": 3.0, "last": 4.0}
    assert res["events"]["kernel end"] == {"median": 50.0, "last": 51.0}
    assert res["events"]["tiles done"] == {"median": 32.5, "last": 42.0}
    g1, g2 = res["phases"][1], res["phases"][2]
    assert (g1["first_start"], g1["last_end"], g1["span"]) == (4.0, 22.0, 18.0)
    assert g1["tiles_total"] == 3 and g1["mainloop_median"] == (10 + 14) / 2 and g1["epilogue_median"] == (1 + 3) / 2
    assert g1["wait_median"] == (1 + 0) / 2 and abs(g1["TBps"] - 44e6 / 18e-6 / 1e12) < 1e-9
    assert (g2["span"], g2["tiles_total"], g2["wait_median"]) == (18.0, 1, 2.0)
    with pytest.raises(ValueError, match="no KERNEL_START"):
        trace_phases(_fused_trace({0: [(0, 23, 0, 3000)]}))


def test_triton_routing_only_parses_and_needs_a_gpu(tmp_path, monkeypatch):
    """`triton --routing-only` reaches the routing run (not the bandwidth table) and, without a
    GPU, exits 2 naming the reason, writing nothing."""
    from moe_jax.bench import triton_kernels

    called = []
    monkeypatch.setattr(triton_kernels, "gpu_reason", lambda: None)
    monkeypatch.setattr(triton_kernels, "run_routing",
                        lambda reps, sweep: called.append(("routing", reps, sweep)) or [])
    monkeypatch.setattr(triton_kernels, "run", lambda *a, **k: called.append(("run",)) or [])
    assert main(["triton", "--routing-only", "--reps", "3"]) == 0 and called == [("routing", 3, True)]
    assert main(["triton", "--routing-only", "--no-sweep"]) == 0 and called[-1] == ("routing", 6, False)
    monkeypatch.undo()
    _no_gpu()
    j = tmp_path / "routing.json"
    proc = subprocess.run([sys.executable, "-m", "moe_jax.bench", "triton", "--routing-only", "--json", str(j)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "python -m moe_jax.bench triton: needs a CUDA GPU" in proc.stderr, proc.stderr
    assert not j.exists()


def test_routing_rows_report_what_cannot_run():
    """On the CPU the XLA rows are timed and the Triton rows are FAILED rows naming the reason,
    old and new paths side by side for each stage."""
    from moe_jax.bench.triton_kernels import ROUTING_SWEEP, routing_cases, run_routing

    _no_gpu()
    swept = routing_cases(8, "masked", sweep=True)
    assert len(swept) == 9 + len(ROUTING_SWEEP) and "epilogue: Triton, block_t=1 num_warps=1" in swept
    rows = run_routing(reps=1, shapes=(("decode", 8, "masked"),), sweep=False)
    labels = [r["kernel"] for r in rows]
    for stage in ("epilogue: Triton, former tiling", "epilogue: Triton, heuristic tiling",
                  "dispatch masked: former", "dispatch masked: fused", "route + dispatch: former",
                  "route + dispatch: new"):
        row = next(r for r in rows if stage in r["kernel"])
        assert "triton" in row["error"], row
    for r in rows:
        if "reference" in r["kernel"] or "gate GEMM" in r["kernel"]:
            assert "error" not in r and r["us"] > 0, r
    assert len(labels) == 9 and all(lb.startswith("decode M=8 ") for lb in labels)


def test_layer_exits_1_when_a_requested_row_failed(tmp_path):
    """An explicit backend that cannot run here: each row says FAILED and why, the run exits 1."""
    _no_gpu()
    j = tmp_path / "layer.json"
    proc = subprocess.run([sys.executable, "-m", "moe_jax.bench", "layer", "--small", "--backends", "deep_gemm",
                           "--no-error", "--json", str(j)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stdout.count("deep_gemm: FAILED ValueError: backend 'deep_gemm'") == 2, proc.stdout
    assert "2 requested row(s) failed: prefill deep_gemm; decode deep_gemm" in proc.stderr
    rows = [r["deep_gemm"] for r in _strict_json(j)["results"]]
    assert all("platform" in r["error"] and "end_to_end_us" not in r for r in rows)


def test_parallel_exits_1_when_a_requested_row_failed():
    _no_gpu()
    proc = subprocess.run([sys.executable, "-m", "moe_jax.bench", "parallel", "--backend", "deep_gemm", "--tokens", "8",
                           "--iters", "1", "--warmup", "0"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    failed = [ln for ln in proc.stdout.splitlines() if "FAILED: ValueError: backend 'deep_gemm'" in ln]
    assert len(failed) == 7 and "7 requested row(s) failed" in proc.stderr, proc.stdout


def test_record_resolutions_logs_what_resolve_returned(monkeypatch):
    import importlib

    registry = importlib.import_module("custom_calls.backends")
    registry.backends("unpermute")  # load the lazy backends now: their registrations must outlive the copies
    # a throwaway op and backend, in copies of the registry's tables (restored after the test)
    monkeypatch.setattr(registry, "_OPS", dict(registry._OPS))
    monkeypatch.setattr(registry, "_IMPLS", {op: dict(impls) for op, impls in registry._IMPLS.items()})
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    op = "test_bench_cli_op"
    registry.declare_op(op, static_args=("n",), reference=lambda: None)
    registry.register(op, "test_fast", lambda: None, supports=lambda *, n: (n >= 8, f"n: expected >= 8, got {n}"))
    with registry.record_resolutions() as outer:
        registry.resolve(op, "auto", n=16)
        with registry.record_resolutions() as inner:
            registry.resolve(op, "auto", n=2)  # "test_fast" cannot run it: auto falls back
        with pytest.raises(ValueError, match="n: expected >= 8, got 2"):
            registry.resolve(op, "test_fast", n=2)  # an explicit backend never falls back, and logs nothing
    registry.resolve(op, "reference", n=2)  # outside every block: not logged
    assert outer == [(op, "test_fast"), (op, "reference")] and inner == [(op, "reference")]


def _small_layer():
    from moe_jax.params import init_params, prepare_params

    cfg = bench_layer._config(small=True)
    params = prepare_params(init_params(jax.random.PRNGKey(0), cfg), cfg)
    return cfg, params, jax.random.normal(jax.random.PRNGKey(1), (24, cfg.hidden_size), jnp.bfloat16)


def test_resolved_backends_asks_the_registry_even_after_jax_cached_the_trace():
    _no_gpu()
    from moe_jax.bench._cli import resolved_backends
    from moe_jax.layer import moe_forward

    cfg, params, x = _small_layer()

    def forward(p, x, backend="auto"):
        return moe_forward(x, p, cfg, layout="masked", backend=backend)

    jax.block_until_ready(jax.jit(forward)(params, x))  # jax now holds traces of the jitted stages (dispatch)
    ops = ("route_topk", "dispatch_map_masked", "permute_masked", "m_grouped_gemm_masked", "activation_quant_masked",
           "unpermute")
    assert resolved_backends(forward, params, x) == {op: "reference" for op in ops}
    with pytest.raises(ValueError, match="backend 'triton'.*'route_topk'.*platform is 'cpu'"):
        resolved_backends(lambda p, x: forward(p, x, "triton"), params, x)


def _table_result(auto: dict) -> dict:
    stages = {s: 1.0 for s in STAGES}
    measured = dict(with_routing_us=110.0, gemms_us=80.0, e2e_over_gemms=1.25, temp_MB=1.0, temp_bound_MB=2.0,
                    stages_us=stages, rel_err=0.04, worst_row=0.05)
    return dict(shape="decode", tokens=16, layout="masked", weights_GB=1.0, platform="gpu",
                auto=dict(measured, backend="auto", end_to_end_us=100.0, **auto),
                reference=dict(measured, backend="reference", end_to_end_us=1000.0))


def test_table_gives_speedup_and_roofline_only_to_a_backend_that_ran_accelerated_code(capsys):
    partly = dict(implementations={"permute_masked": "triton", "m_grouped_gemm_masked": "deep_gemm",
                                   "activation_quant_masked": "reference"})
    bench_layer.print_table([_table_result(partly)], ["auto", "reference"], "test device", 1000.0)
    out = capsys.readouterr().out
    assert "auto vs reference: 10.0x" in out and "% of roofline" in out
    assert "  auto (reference implementation for: activation_quant_masked): end to end 100.0 us" in out
    assert ("implementations: permute_masked triton, m_grouped_gemm_masked deep_gemm, activation_quant_masked "
            "reference") in out
    fell_back = dict(implementations={"permute_masked": "reference", "m_grouped_gemm_masked": "reference"},
                     fell_back=True)
    bench_layer.print_table([_table_result(fell_back)], ["auto", "reference"], "test device", 1000.0)
    out = capsys.readouterr().out
    assert "  auto (every op fell back to the reference: no accelerated implementation on 'gpu'): end to end" in out
    assert "vs reference" not in out and "roofline" not in out and "implementations:" not in out


def test_exit_status_names_the_failed_rows(capsys):
    from moe_jax.bench._cli import exit_status

    assert exit_status([]) == 0 and capsys.readouterr().err == ""
    assert exit_status(["decode auto", "prefill auto"]) == 1
    assert "2 requested row(s) failed: decode auto; prefill auto" in capsys.readouterr().err


def test_layer_rejects_unknown_shape():
    with pytest.raises(SystemExit, match="--shapes"):
        main(["layer", "--small", "--shapes", "prefil"])


def test_gemm_plot_writes_png_from_rows(tmp_path):
    from moe_jax.bench import gemm

    def r(impl, kind, shape, tf, tfs, tb=None, tbs=None):
        return dict(impl=impl, kind=kind, shape=shape, tflops_burst=tf, tflops_sustained=tfs, tbps_burst=tb,
                    tbps_sustained=tbs)

    rows = [r("deep_gemm fp8", "contig", "contig 32x1024, N=4096, K=7168", 700.0, 650.0),
            r("ragged_dot bf16", "contig", "contig 32x1024, N=4096, K=7168", 300.0, None),
            r("deep_gemm fp8", "contig", "contig 8x4096, N=4096, K=7168", 720.0, 660.0),
            r("deep_gemm fp8", "masked", "masked G=32, m_pad=256, expected_m=32, N=4096, K=7168", 90.0, 85.0,
              3.1, 2.9)]
    p = tmp_path / "gemm.png"
    gemm.plot(str(p), rows, "test device")
    assert p.read_bytes()[:8] == PNG_MAGIC


def _np_fp32_layer(x, ids, wts, params, cfg):
    """float64 per-token loop: dequantized fp8_block weights, silu(gate) * up, weighted sum."""
    def deq(w, s):
        w = np.asarray(jnp.asarray(w, jnp.float32), np.float64)
        s = np.asarray(s, np.float64)
        _, n, k = w.shape
        return w * np.repeat(np.repeat(s, 128, axis=1), 128, axis=2)[:, :n, :k]

    w13, w2 = deq(params.w13, params.w13_scale), deq(params.w2, params.w2_scale)
    xf = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    i = cfg.intermediate_size
    out = np.zeros(xf.shape, np.float64)
    for t in range(xf.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            gu = w13[e] @ xf[t]
            gate, up = gu[:i], gu[i:]
            out[t] += wts[t, j] * (w2[e] @ (gate / (1.0 + np.exp(-gate)) * up))
    return out * cfg.routed_scaling_factor


@pytest.mark.parametrize("block, blocks_per_step", [(128, 4), (8, 1), (8, 3)])
def test_fp32_model_matches_float64_per_token_loop(block, blocks_per_step):
    from moe_jax.params import init_params, prepare_params

    cfg = bench_layer._config(small=True)
    assert cfg.activation == ActivationSpec() and cfg.recipe == "fp8_block"  # plain SiLU
    params = prepare_params(init_params(jax.random.PRNGKey(5), cfg), cfg)
    rng = np.random.default_rng(block)
    m, k, e = 37, cfg.top_k, cfg.num_experts
    x = jnp.asarray(rng.standard_normal((m, cfg.hidden_size)), jnp.bfloat16)
    # random routes, repeated experts within a token included (each route counts once)
    ids = rng.integers(0, e, (m, k)).astype(np.int32)
    ids[0] = ids[0, 0]
    wts = rng.uniform(0.05, 1.0, (m, k)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, i, w: bench_layer._fp32_model(x, i, w, params, cfg, block=block,
                                                                    blocks_per_step=blocks_per_step))(
        x, jnp.asarray(ids), jnp.asarray(wts)))
    want = _np_fp32_layer(x, ids, wts, params, cfg)
    assert got.shape == (m, cfg.hidden_size) and got.dtype == np.float32
    assert np.all(np.isfinite(got)) and np.all(np.abs(want).max(axis=1) > 0)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    row_err = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    assert row_err.max() < 1e-5


def test_goal_ratios_come_first_and_follow_their_definitions(capsys):
    stages = {s: 1.0 for s in STAGES}
    common = dict(backend="auto", end_to_end_us=1.0, e2e_over_gemms=1.0, temp_MB=1.0, temp_bound_MB=2.0,
                  stages_us=stages, implementations={"m_grouped_gemm_contig": "deep_gemm"})
    prefill = dict(shape="prefill", tokens=4096, layout="contig", weights_GB=1.0, platform="gpu",
                   auto=dict(common, with_routing_us=1100.0, gemms_us=1000.0, with_routing_marginal_us=1030.0,
                             gemms_marginal_us=1000.0,
                             with_routing_kernel_us=dict(total=1050.0, gemms=1000.0, triton=40.0, other=10.0),
                             fused_end_to_end_us=1060.0, fused_vs_staged_rel=1e-2,
                             fused_with_routing_us=1080.0, fused_with_routing_marginal_us=1070.0,
                             fused_with_routing_stream_fixed_us=320.0,
                             fused_with_routing_kernel_us=dict(total=1020.0)))
    # no marginal measured (e.g. a row written before it existed): no marginal figure, not met
    decode = dict(shape="decode", tokens=128, layout="masked", weights_GB=0.5, platform="gpu",
                  auto=dict(common, with_routing_us=520.0, gemms_us=400.0,
                            with_routing_kernel_us=dict(error="no profiler")))
    fell_back = dict(prefill, shape="prefill16k", auto=dict(prefill["auto"], fell_back=True))
    rows = bench_layer.goals([prefill, decode, fell_back], copy_gbps=1000.0)
    assert [r["shape"] for r in rows] == ["prefill", "prefill", "decode"]  # a fallback row gets no goal figure
    staged, fused, dec = rows
    assert staged["wall"] == pytest.approx(1.1) and staged["kernel"] == pytest.approx(1.05)
    assert staged["marginal"] == pytest.approx(1.03) and staged["met_marginal"]
    assert not staged["met"]  # 1.1 > 1.06
    # the fused layout against the staged GEMMs: steady, marginal and kernel time alike
    assert fused["metric"].startswith("fused layout") and fused["wall"] == pytest.approx(1.08)
    assert fused["marginal"] == pytest.approx(1.07) and not fused["met_marginal"]
    assert fused["kernel"] == pytest.approx(1.02)
    assert dec["roofline_us"] == pytest.approx(500.0)  # 0.5 GB at 1000 GB/s
    assert dec["wall"] == pytest.approx(500 / 520) and dec["kernel"] is None and dec["met"]
    assert dec["marginal"] is None and not dec["met_marginal"]
    bench_layer.print_table([prefill, decode], ["auto"], "test device", 1000.0)
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("  goal prefill") and "1.100 steady wall, 1.030 marginal, 1.050 GPU kernel time" in out[2]
    assert "(goal <= 1.06: not met; marginal met)" in out[2]
    assert out[3].startswith("  goal prefill") and "fused layout" in out[3] and "1.070 marginal" in out[3]
    assert out[4].startswith("  goal decode") and \
        "96.2 % steady wall, – marginal, – GPU kernel time (goal >= 90 %: met; marginal not met)" in out[4]
    fused_line = next(line for line in out if "fused layout: end to end" in line)
    assert "with routing 1080.0 us steady, 1070.0 us marginal (320 us once per stream)" in fused_line



def test_layer_models_are_the_presets_routed_layers():
    """`--model`: v3 the 32-expert V3 layer; v4 / v4-256 V4-Flash's routed layer (32 / 256 experts) with
    its routing and clamp, MXFP4 experts that arch 90 runs as fp8_block; an unknown name is refused."""
    from moe_jax.bench.layer_model import MODELS, _config
    from moe_jax.config import MoEConfig

    assert MODELS == ("v3", "v4", "v4-256", "v4-w4a8", "v4-256-w4a8")
    v3, v4, v4_all, v4_w4a8, v4_all_w4a8 = (_config(model=m) for m in MODELS)
    assert (v3.num_experts, v3.top_k, v3.hidden_size, v3.scoring) == (32, 8, 7168, "sigmoid")
    full = MoEConfig.deepseek_v4()
    for cfg, experts in ((v4, 32), (v4_all, 256)):
        assert cfg.num_experts == experts and cfg.n_shared_experts == 0 and cfg.arch == 90
        for field in ("top_k", "hidden_size", "intermediate_size", "scoring", "use_correction_bias",
                      "routed_scaling_factor", "activation", "recipe"):
            assert getattr(cfg, field) == getattr(full, field), field
        assert cfg.gemm_recipe == "fp8_block"  # the FP4 -> FP8 expansion on Hopper
    assert v4_w4a8 == dataclasses.replace(v4, mxfp4_sm90_form="w4a8") and v4_w4a8.gemm_recipe == "mxfp4"
    assert v4_all_w4a8 == dataclasses.replace(v4_all, mxfp4_sm90_form="w4a8")
    small = _config(small=True, model="v4")
    assert (small.num_experts, small.hidden_size, small.scoring) == (16, 256, "sqrtsoftplus")
    with pytest.raises(ValueError, match="model: expected one of v3, v4, v4-256, v4-w4a8, v4-256-w4a8, got 'v5'"):
        _config(model="v5")


def test_v4_decode_goal_is_85_percent():
    """The decode goal is the model's: 90 % for V3, 85 % for V4 (its smaller experts), from the same
    row; a row without a model (written before --model) is V3's."""
    stages = {s: 1.0 for s in STAGES}
    row = dict(backend="auto", end_to_end_us=1.0, e2e_over_gemms=1.0, temp_MB=1.0, temp_bound_MB=2.0,
               stages_us=stages, implementations={"m_grouped_gemm_masked": "deep_gemm"},
               with_routing_us=570.0, gemms_us=400.0)
    decode = dict(shape="decode", tokens=128, layout="masked", weights_GB=0.5, platform="gpu", auto=row)
    for model, goal in ((None, 0.90), ("v3", 0.90), ("v4", 0.85), ("v4-256", 0.85)):
        res = decode if model is None else dict(decode, model=model)
        (g,) = bench_layer.goals([res], copy_gbps=1000.0)
        assert g["goal"] == goal and g["wall"] == pytest.approx(500 / 570)
        assert g["met"] == (500 / 570 >= goal)  # 87.7 %: V4's goal met, V3's not

@pytest.mark.slow
def test_layer_shared_variants_side_by_side_on_cpu(tmp_path):
    """`layer --shared bf16,fp8,fused` at the scaled CPU size: one row per variant, the FP8 variants
    within FP8 rounding of the bf16 one, fused equal to dense FP8 up to bf16 rounding, the shared MLP
    timed for the dense variants only; a variant name it does not know is refused."""
    _no_gpu()
    j = tmp_path / "shared.json"
    proc = subprocess.run([sys.executable, "-m", "moe_jax.bench", "layer", "--shared", "bf16,fp8,fused",
                           "--shapes", "decode", "--backends", "reference", "--reps", "1", "--json", str(j)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== shared experts, decode: 16 tokens, masked" in proc.stdout
    for label in ("bf16 dense", "fp8 dense", "fp8 fused"):
        assert label in proc.stdout
    data = _strict_json(j)
    assert data["shared"] == ["bf16", "fp8", "fused"] and data["scaled"] is True
    (res,) = data["results"]
    rows = res["reference"]
    for v in ("bf16", "fp8", "fused"):
        assert "error" not in rows[v] and _positive(rows[v]["layer_us"]), rows[v]
    assert _positive(rows["bf16"]["shared_us"]) and _positive(rows["fp8"]["shared_us"])
    assert "shared_us" not in rows["fused"]
    assert 1e-3 < rows["fp8"]["rel_vs_bf16"] < 0.1 and 1e-3 < rows["fused"]["rel_vs_bf16"] < 0.1
    assert rows["fused"]["rel_vs_fp8"] < 1e-2
    bad = subprocess.run([sys.executable, "-m", "moe_jax.bench", "layer", "--shared", "fp4"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--shared: expected a comma list of bf16, fp8, fused, got 'fp4'" in bad.stderr


def test_stream_fit_recovers_fixed_and_marginal_costs():
    fit = _timing.stream_fit(0.3 + 32 * 0.01, 32, 0.3 + 96 * 0.01, 96)
    assert fit.marginal == pytest.approx(0.01) and fit.fixed == pytest.approx(0.3)
    assert fit.per_call == pytest.approx(0.62 / 32)
    for short, long in ((0, 8), (8, 8), (9, 8)):
        with pytest.raises(ValueError, match="calls"):
            _timing.stream_fit(1.0, short, 2.0, long)


def test_time_stream_times_two_stream_lengths_and_fits_them(monkeypatch):
    """Against a fake clock: each dispatch of the jitted function over the argument sets costs
    `per_set` per set, each sync a fixed `sync`; time_stream must recover both exactly (the short
    stream is `chain` dispatches, the long one `long_factor` times that) and keep only one result
    of a stream alive at a time."""
    clock = {"t": 0.0}
    per_set, sync, live = 1e-3, 0.25, weakref.WeakSet()

    class Out:
        pass

    def many(sets):
        clock["t"] += per_set * len(sets)
        assert len(live) <= 1, "a stream kept more than its last result alive"
        out = Out()
        live.add(out)
        return out

    def block(x):
        clock["t"] += sync
        return x

    monkeypatch.setattr(_timing, "_over_sets", lambda fn: many)
    monkeypatch.setattr(_timing.jax, "block_until_ready", block)
    monkeypatch.setattr(_timing.time, "perf_counter", lambda: clock["t"])
    sets = [(None,)] * 4
    st = _timing.time_stream(lambda x: x, sets, rounds=3, chain=5, long_factor=4)
    assert st.marginal == pytest.approx(per_set) and st.fixed == pytest.approx(sync)
    assert st.per_call == pytest.approx(per_set + sync / 20)
    with pytest.raises(ValueError, match="long_factor"):
        _timing.time_stream(lambda x: x, sets, long_factor=1)


@pytest.mark.parametrize("reverse", [False, True])
def test_fused_steady_timer_times_every_candidate_once_in_the_pass_order(monkeypatch, reverse):
    """`bench fused --steady`: each candidate is timed as one steady stream (`time_op`, 8 dispatches,
    --iters rounds) over the routed inputs, in the given order or its reverse, in µs."""
    from moe_jax.bench import fused as bench_fused

    calls = []

    def fake_time_op(fn, arg_sets, rounds, chain):
        calls.append((fn, len(arg_sets), rounds, chain))
        return {"a": 1e-3, "b": 2e-3, "c": 3e-3}[fn]

    monkeypatch.setattr(_timing, "time_op", fake_time_op)
    fns = {"x": "a", "y": "b", "z": "c"}
    got = bench_fused._steady_medians(fns, [(1,), (2,)], iters=3, reverse=reverse)
    assert got == pytest.approx({"x": 1e3, "y": 2e3, "z": 3e3})
    order = ["c", "b", "a"] if reverse else ["a", "b", "c"]
    assert calls == [(f, 2, 3, 8) for f in order]


def test_temp_memory_line_says_whose_goal_it_is(capsys):
    """The 1.25x-activations goal is the accelerated path's: the reference row says why it is above
    it; an accelerated row says ok or OVER."""
    ran = {"m_grouped_gemm_masked": "deep_gemm"}
    bench_layer.print_table([_table_result(dict(temp_MB=3.0, implementations=ran))], ["auto", "reference"],
                            "test device", 1000.0)
    out = capsys.readouterr().out
    assert "temp 3 MB (goal <= 2 MB OVER)" in out
    assert "temp 1 MB (reference: dequantized fp32 operands; the 2 MB goal is for accelerated backends)" in out
    bench_layer.print_table([_table_result(dict(temp_MB=1.5, implementations=ran))], ["auto", "reference"],
                            "test device", 1000.0)
    assert "temp 2 MB (goal <= 2 MB ok)" in capsys.readouterr().out
    expanded = {"m_grouped_gemm_contig": "deep_gemm,w4a8"}  # the W4A8 contig op by expansion
    bench_layer.print_table([_table_result(dict(temp_MB=3.0, implementations=expanded))], ["auto", "reference"],
                            "test device", 1000.0)
    assert ("temp 3 MB (goal <= 2 MB OVER; includes the FP8 copy of the W4A8 weights that w4a8_prefill='expand' "
            "writes)") in capsys.readouterr().out


def test_progress_says_why_its_total_shrinks(capsys):
    from moe_jax.bench._cli import Progress

    progress = Progress("layer", total=10)
    progress.step("a")
    progress.drop(4, "triton: the reference row's code")
    progress.step("b")
    progress.close()
    err = capsys.readouterr().err
    assert "4 steps fewer (triton: the reference row's code): 6 in all" in err
    assert "[layer 2/6" in err


def test_layer_kernel_time_counts_every_gemm_kernel_as_a_gemm():
    """The layer's GPU-time split: DeepGEMM's kernels and both W4A8 GEMMs (the CUDA masked kernel, the
    Triton kernels, whose names also end in "_kernel") are GEMMs; other Triton kernels are Triton; the
    rest (XLA fusions) other; the parts sum to the total."""
    from moe_jax.bench.layer_measure import kernel_families

    per = {"void deep_gemm::sm90_fp8_gemm_1d2d_impl<0u, 4096u>(...)": 100e-6, "moe_jax_w4a8_gemm_sm90": 50e-6,
           "w4a8_contig_kernel": 20e-6, "permute_masked_kernel": 7e-6, "loop_convert_fusion_3": 2e-6}
    fam = kernel_families(per)
    assert fam["gemms"] == pytest.approx(170.0) and fam["triton"] == pytest.approx(7.0)
    assert fam["other"] == pytest.approx(2.0) and fam["total"] == pytest.approx(179.0)


def test_w4a8_configs_and_rows():
    """`bench w4a8`: --configs parses into the kernel's configs and names the flag when it cannot (exit 2,
    before any GPU check); the uniform rows are one draw of tokens x top-k routes over the 32 experts."""
    from custom_calls.cuda.w4a8_gemm import W4A8CudaConfig
    from moe_jax.bench.w4a8 import NUM_EXPERTS, contig_indices, parse_configs, uniform_rows

    assert parse_configs(" 4,1,4,3 ; 2,2,2,4;") == [W4A8CudaConfig(4, 1, 4, 3), W4A8CudaConfig(2, 2, 2, 4)]
    for bad, match in (("4,1,4", "token_tiles,warpgroups,stages,min_blocks"), (";", "at least one config"),
                       ("4,1,9,3", "W4A8CudaConfig.stages")):
        with pytest.raises(ValueError, match=match):
            parse_configs(bad)
    assert main(["w4a8", "--configs", "4,x,4,3"]) == 2
    rows = uniform_rows(128, 6)
    assert rows.shape == (NUM_EXPERTS,) and rows.sum() == 768 and rows.min() >= 0
    assert (uniform_rows(128, 6) == rows).all() and (uniform_rows(128, 6, seed=1) != rows).any()
    # --layout contig: the prefill draw uncapped, each expert's rows aligned to 128 (the layer's contig layout)
    assert main(["w4a8", "--layout", "contig", "--contig-configs", "16,2,4"]) == 2
    # the persistent contig kernel's configs: parsed, checked, named when refused
    from custom_calls.cuda.w4a8_contig_rs import W4A8RsConfig
    from moe_jax.bench.w4a8 import parse_rs_configs

    assert parse_rs_configs("6; 4,inline;") == (W4A8RsConfig(6), W4A8RsConfig(4, ahead=False))
    assert parse_rs_configs("") == ()
    with pytest.raises(ValueError, match=r"--rs-configs: .* got '9': W4A8RsConfig.stages: expected an int "
                                         r"in \[2, 7\], got 9"):
        parse_rs_configs("9")
    with pytest.raises(ValueError, match=r"--rs-configs: .* got '6,behind': the second field is 'inline' or absent"):
        parse_rs_configs("6,behind")
    assert main(["w4a8", "--layout", "contig", "--rs-configs", "x"]) == 2
    assert uniform_rows(4096, 6, cap=4096).sum() == 4096 * 6
    mi = contig_indices(np.array([3, 0, 130]), 128)
    assert mi.shape == (384,) and (mi[:3] == 0).all() and (mi[3:128] == -1).all()
    assert (mi[128:258] == 2).all() and (mi[258:] == -1).all()


def test_w4a8_layer_rows_route_without_the_experts():
    """`bench w4a8 --rows layer` routes with the router fields alone (`layer_routes`: one expert drawn,
    not prepared): the same ids and weights, bit for bit, as `layer_inputs` with every expert built."""
    from moe_jax.bench.layer_measure import layer_inputs, layer_routes

    light = layer_routes(16, 2, True, "v4-w4a8")
    full = layer_inputs(16, "masked", 2, True, "v4-w4a8").routed
    assert len(light) == len(full) == 2
    for (ids, weights), (ids_full, weights_full) in zip(light, full):
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_full))
        np.testing.assert_array_equal(np.asarray(weights).view(np.uint32), np.asarray(weights_full).view(np.uint32))
    assert len(np.unique(np.concatenate([np.asarray(i).ravel() for i, _ in light]))) > 4  # real routes


def test_w4a8_sweep_rows_on_the_reference(monkeypatch):
    """`bench w4a8`'s sweep end to end on the CPU with the reference GEMMs standing in for the kernels and a
    fixed kernel time per weight form: every kernel gets a row per GEMM, its TB/s is its weight bytes over
    its time, "x FP8" DeepGEMM's time over its own, and the two weight forms it builds are the same weights
    (the reference computes both on the same e4m3 values and block scales: equal over the rows below masked_m)."""
    import moe_jax.bench._timing as timing
    from custom_calls.grouped_gemm import m_grouped_gemm_masked
    from layouts import gemm_format
    from moe_jax.bench import w4a8 as bench

    def ref(recipe):
        return lambda a, sa, w, s, mm: m_grouped_gemm_masked(a, w, mm, expected_m=4, lhs_scale=sa, rhs_scale=s,
                                                             recipe=recipe, arch=90,
                                                             lhs_order=gemm_format(recipe, 90).lhs_order,
                                                             backend="reference")

    monkeypatch.setattr(bench, "_kernels", lambda configs, em, contig, rs_configs: {
        "deep_gemm fp8 (FP4->FP8)": (ref("fp8_block"), "fp8"), "w4a8 a": (ref("mxfp4"), "w4a8")})
    monkeypatch.setattr(timing, "device_time", lambda fn, sets, rounds: {"total": 2e-6 if sets[0][2].dtype == "int8"
                                                                         else 3e-6})
    rows = bench.uniform_rows(8, 2)
    out = bench.sweep("GEMM1", 64, 256, [rows], [], 4, passes=2, iters=1, log=lambda *a: None)
    assert [r["kernel"] for r in out] == ["deep_gemm fp8 (FP4->FP8)", "w4a8 a"]
    fp8, w4 = out
    assert fp8["us"] == [3.0, 3.0] and w4["us"] == [2.0, 2.0] and w4["x_fp8"] == [1.5, 1.5]
    w4_bytes = 32 * 64 * 128 + 32 * 64 * 2 * 4  # values (K/2 bytes per row) + one int32 per row and 128 columns
    assert w4["tb_s"][0] == pytest.approx(w4_bytes / 2e-6 / 1e12)
    assert fp8["max_diff"] == 0.0 and w4["max_diff"] == 0.0  # the reference: both forms' sums bit for bit
    # contig: one m_indices of the rows aligned to 128; TFLOPS on the real rows
    from custom_calls.grouped_gemm import m_grouped_gemm_contig

    def cref(recipe):
        return lambda a, sa, w, s, mi: m_grouped_gemm_contig(a, w, mi, lhs_scale=sa, rhs_scale=s, recipe=recipe,
                                                             arch=90, alignment=128,
                                                             lhs_order=gemm_format(recipe, 90).lhs_order,
                                                             backend="reference")

    monkeypatch.setattr(bench, "_kernels", lambda configs, em, contig, rs_configs: {
        "deep_gemm fp8 (FP4->FP8)": (cref("fp8_block"), "fp8"), "w4a8 a": (cref("mxfp4"), "w4a8")})
    mi = bench.contig_indices(rows)
    fp8, w4 = bench.sweep("GEMM1", 64, 256, [mi], [], 0, passes=1, iters=1, log=lambda *a: None, contig=True)
    assert w4["tflops"][0] == pytest.approx(2.0 * rows.sum() * 64 * 256 / 2e-6 / 1e12)
    assert fp8["max_diff"] == 0.0 and w4["max_diff"] == 0.0


def test_layer_rows_per_expert():
    """The layer row's rows per expert: counts per set over every expert (unrouted ones 0), and the min,
    mean and max over all sets."""
    import numpy as np

    from moe_jax.bench.layer_measure import rows_per_expert

    sets = [np.array([[0, 1], [1, 2]]), np.array([[3, 1], [1, 0]])]
    assert rows_per_expert(sets, 5) == {"min": 0, "mean": 0.8, "max": 2, "sets": [[1, 2, 1, 0, 0], [1, 2, 0, 1, 0]]}
