"""``python -m moe_jax.bench.tune``: tune DeepGEMM's grouped SM90 GEMMs on this GPU, then measure the
decode layer with the tuned configs and with the DeepGEMM calls inside XLA's command buffers.

1. Autotuning (the search: moe_jax/bench/autotune_search.py) of the shapes of ``python -m moe_jax.bench gemm``
   (FP8 contig and masked, BF16 contig) and of the decode layer's masked GEMMs at 32, 128 and 512
   tokens. Writes the tuned-config cache that custom_calls/deep_gemm/autotune.py reads
   (``$MOE_JAX_CACHE_DIR``), prints per shape the heuristic's
   config and kernel time, the best other config and its gain (a loss is negative), and the decision.
2. Decode layer (128 tokens, masked, routing included), a steady stream of calls on rotating inputs:
   µs per call with (a) the heuristic and plain launches, (b) the tuned configs, (c) the tuned configs
   with the command-buffer launcher (XLA captures the DeepGEMM calls in its CUDA graphs), (d) as (c)
   with XLA's command buffers off; the two masked GEMMs' kernel time and TB/s inside the layer;
   whether the outputs agree ((b)-(d) run the same kernels: bit-identical; (a) other tilings:
   within the bf16 rounding).

Needs an SM90 GPU (exits with status 2 elsewhere). Expect ~3-4 minutes from a cold kernel cache on
one H200 with 16 CPU cores (nvcc runs in parallel), ~1 minute when the cubins are cached.
Table on stdout, progress on stderr; ``--json PATH`` writes everything, ``--export DIR`` copies the
tuned-config files there.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import time


def layer_problems(tokens: tuple[int, ...] = (32, 128, 512)) -> list:
    """The decode layer's masked GEMMs (GEMM1: N = 2I, K = H; GEMM2: N = H, K = I) at these token
    counts, in the layer's GEMM format."""
    from custom_calls.deep_gemm.families import gemm_problem
    from moe_jax.bench.layer import _config
    from moe_jax.dispatch import default_masked_m_pad, expected_m

    cfg = _config()
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    out = []
    for m in tokens:
        m_pad, em = default_masked_m_pad(m), expected_m(m, cfg.top_k, e)
        out += [gemm_problem("masked", m_pad, 2 * i, h, e, cfg.gemm_recipe, cfg.gemm_arch, em),
                gemm_problem("masked", m_pad, h, i, e, cfg.gemm_recipe, cfg.gemm_arch, em)]
    return out


def problems(quick: bool) -> list:
    from moe_jax.bench import gemm
    from moe_jax.bench.autotune_search import bench_problems

    plan = [("contig", s) for s in gemm.CONTIG] + [("masked", s) for s in gemm.MASKED]
    if quick:
        plan = [("contig", gemm.CONTIG[0]), ("masked", gemm.MASKED[0])]
    found = bench_problems(plan, bf16_contig=(gemm.CONTIG[0],)) + ([] if quick else layer_problems())
    return list(dict.fromkeys(found))


def _rate(p, us: float, pattern: list[int]) -> str:
    """TFLOPS (contig) or TB/s (masked: weights + real activation and output rows) at ``us``."""
    esize = p.family.sm90.ab_bytes
    rows = sum(pattern)
    if p.gemm_kind == "contig":
        return f"{2.0 * rows * p.n * p.k / us / 1e6:.0f} TFLOPS"
    return f"{(p.num_groups * p.n * p.k * esize + rows * (p.k * esize + 2 * p.n)) / us / 1e6:.2f} TB/s"


def tuning_table(reports) -> list[dict]:
    """Print one row per shape; returns the rows."""
    from moe_jax.bench.autotune_search import config_label, problem_label

    print("| shape | heuristic | heuristic us | best other | best other us | gain % | decision | heuristic rate "
          "| best rate | timed / rejected |\n|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for rep in reports:
        p, e = rep.problem, rep.entry
        label, hl = problem_label(p), config_label(e.heuristic)
        first = next(iter(rep.patterns), None)
        others = {lab: t for lab, t in rep.times_us.items() if lab != hl}
        row = {"problem": label, "heuristic": hl, "tuned": e.tuned, "config": config_label(e.config),
               "heuristic_us": e.heuristic_us, "config_us": e.config_us, "times_us": rep.times_us,
               "rejected": rep.rejected, "patterns": rep.patterns, "cache_file": str(rep.path),
               "confirm_us": rep.confirm_us}
        rows.append(row)
        if not rep.times_us:  # cached earlier, not searched in this run
            print(f"| {label} | {hl} | {e.heuristic_us[0]:.1f} | {config_label(e.config)} | {e.config_us[0]:.1f} "
                  f"| {100 * (e.heuristic_us[0] / e.config_us[0] - 1):+.1f} | cached earlier | | | |", flush=True)
            continue
        h_us = sum(rep.times_us[hl].values())
        if others:
            best = min(others, key=lambda lab: sum(others[lab].values()))
            b_us = sum(others[best].values())
        else:
            best, b_us = "-", float("nan")
        if e.tuned:  # the confirmation rounds decide; report their medians
            h_us, best, b_us = statistics.median(e.heuristic_us), config_label(e.config), statistics.median(e.config_us)
        gain = 100 * (h_us / b_us - 1)
        decision = "tuned" if e.tuned else "heuristic kept"
        if rep.confirm_us:
            decision += " (rounds: " + ", ".join(f"{100 * (hh / w - 1):+.1f} %" for hh, w in rep.confirm_us) + ")"
        rate_h = _rate(p, rep.times_us[hl][first], rep.patterns[first]) if first else ""
        rate_b = (_rate(p, rep.times_us[best][first], rep.patterns[first])
                  if first and best in rep.times_us else "")
        print(f"| {label} | {hl} | {h_us:.1f} | {best} | {b_us:.1f} | {gain:+.1f} | {decision} | {rate_h} | {rate_b} "
              f"| {len(rep.times_us)} / {len(rep.rejected)} |", flush=True)
        row.update(best_other=best, best_other_us=b_us, gain_pct=gain)
    return rows


def _stream_us(f, arg_sets: list[tuple], iters: int, rounds: int = 3) -> float:
    """µs per call of ``f`` dispatched back to back over rotating argument sets, one sync per round
    (the way a serving loop calls the layer); median of ``rounds``."""
    import jax

    jax.block_until_ready(f(*arg_sets[0]))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.05:  # bring the clock up
        jax.block_until_ready(f(*arg_sets[0]))
    res = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(iters):
            out = f(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        res.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(res)


def decode_layer(tokens: int = 128, reps: int = 4, iters: int = 200, *, small: bool = False) -> dict:
    """The decode-layer measurements of the module docstring, as a dict (also printed). small: the
    layer bench's smoke-test size (runs anywhere; without DeepGEMM the variants differ in name only)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from custom_calls import KernelSettings
    from moe_jax.bench.autotune_search import trace_kernel_durations
    from moe_jax.bench.layer import _config
    from moe_jax.dispatch import default_masked_m_pad, expected_m
    from moe_jax.layer import moe_forward
    from moe_jax.params import init_params, prepare_params

    cfg = _config(small)
    params = prepare_params(init_params(jax.random.PRNGKey(0), cfg), cfg)
    xs = [jax.random.normal(k, (tokens, cfg.hidden_size), jnp.bfloat16)
          for k in jax.random.split(jax.random.PRNGKey(1), reps)]
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    rows = tokens * cfg.top_k
    gemm_bytes = [e * 2 * i * h + rows * (h + 2 * 2 * i), e * h * i + rows * (i + 2 * h)]  # weights + real rows
    # XLA's default command-buffer types (xla_gpu_enable_command_buffer: FUSION, CUBLAS, CUBLASLT,
    # CUSTOM_CALL, CUDNN, and DYNAMIC_SLICE_FUSION in recent XLA; "+TYPE"/"-TYPE" edit that list)
    # include CUSTOM_CALL, so the command-buffer launcher alone lets XLA capture the DeepGEMM calls;
    # "" turns command buffers off. While the profiler runs XLA executes the plain thunks instead.
    variants = [("heuristic, plain launches", KernelSettings(), None),
                ("tuned, plain launches", KernelSettings(gemm_tuning="cached"), None),
                ("tuned, command-buffer launches", KernelSettings(gemm_tuning="cached", command_buffer=True), None),
                ("tuned, command-buffer launches, XLA command buffers off",
                 KernelSettings(gemm_tuning="cached", command_buffer=True), {"xla_gpu_enable_command_buffer": ""})]
    res = {"tokens": tokens, "m_pad": default_masked_m_pad(tokens), "expected_m": expected_m(tokens, cfg.top_k, e),
           "variants": {}}
    outs = {}
    gemm_kernel = layer_problems((tokens,))[0].family.symbol  # the masked GEMMs' __global__ function
    print(f"\ndecode layer, {tokens} tokens (masked, routing included), steady stream over {reps} inputs:",
          flush=True)
    for name, settings, opts in variants:
        f = jax.jit(lambda p, x, s=settings: moe_forward(x, p, cfg, layout="masked", backend="auto", settings=s),
                    compiler_options=opts)
        compiled = f.lower(params, xs[0]).compile()
        us = _stream_us(compiled, [(params, x) for x in xs], iters)
        outs[name] = np.asarray(compiled(params, xs[0]).astype(jnp.float32))
        # the masked GEMMs' kernel time: two per call (GEMM1 then GEMM2), over 20 calls
        durs = _gemm_durations(trace_kernel_durations, compiled, params, xs, calls=20, kernel=gemm_kernel)
        g_us = [statistics.median(durs[j::2]) * 1e6 for j in (0, 1)] if durs else [float("nan")] * 2
        tbps = [b / t / 1e6 for b, t in zip(gemm_bytes, g_us)]
        res["variants"][name] = {"us_per_call": us, "gemm_kernel_us": g_us, "gemm_tbps": tbps}
        print(f"  {name}: {us:.1f} us/call; masked GEMM1 {g_us[0]:.1f} us ({tbps[0]:.2f} TB/s), "
              f"GEMM2 {g_us[1]:.1f} us ({tbps[1]:.2f} TB/s)", flush=True)
    base, tuned = outs[variants[0][0]], outs[variants[1][0]]
    same = all(np.array_equal(outs[variants[1][0]], outs[v[0]]) for v in variants[2:])
    rel = float(np.linalg.norm(tuned - base) / max(np.linalg.norm(base), 1e-30))
    res.update(command_buffer_outputs_identical=same, tuned_vs_heuristic_rel_diff=rel)
    print(f"  outputs: tuned vs heuristic relative difference {rel:.2e}; command-buffer variants bit-identical "
          f"to plain launches: {same}", flush=True)
    return res


def _gemm_durations(trace, compiled, params, xs, calls: int, kernel: str) -> list[float]:
    """Durations of the grouped-GEMM kernels (named ``kernel``) over ``calls`` layer calls (2 per
    call), in order."""
    try:
        return trace([lambda x=xs[j % len(xs)]: compiled(params, x) for j in range(calls)],
                     (kernel,), sync_every=4, per_call=2)
    except Exception as e:  # kernel time is a column, not the point; say why it is missing
        print(f"  (GEMM kernel time unavailable: {type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return []


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0] if __doc__ else None
    p.add_argument("--quick", action="store_true", help="first contig and masked shape only, no decode layer")
    p.add_argument("--no-layer", action="store_true", help="skip the decode-layer measurements")
    p.add_argument("--max-tiles", type=int, default=16, help="phase-1 tiles per shape (default 16)")
    p.add_argument("--iters", type=int, default=8, help="timed launches per config and pattern per trace")
    p.add_argument("--cached", action="store_true", help="keep configs tuned earlier (default: search again)")
    p.add_argument("--json", metavar="PATH", help="write the reports and layer figures as JSON here")
    p.add_argument("--export", metavar="DIR", help="copy this run's tuned-config cache files here")
    p.set_defaults(func=run)


def run(args) -> int:
    from moe_jax.bench._cli import cannot_run, log, write_json
    from moe_jax.bench.gemm import gpu_reason

    if cannot_run("moe_jax.bench.tune", gpu_reason()):
        return 2
    import jax

    from moe_jax.bench.autotune_search import SearchPolicy, tune

    t0 = time.perf_counter()
    probs = problems(args.quick)
    policy = SearchPolicy(max_tiles=args.max_tiles, iters=args.iters, retune=not args.cached)
    log(f"# tuning {len(probs)} grouped GEMM shapes on {jax.devices()[0].device_kind}")
    reports = tune(probs, policy=policy)
    print(f"\nDeepGEMM grouped GEMMs, heuristic vs tuned (kernel time, us; masked: sum over the masked_m patterns "
          f"'uniform' and 'routed'; rates on the first pattern), {time.perf_counter() - t0:.0f} s:", flush=True)
    out = {"date": datetime.date.today().isoformat(), "device": str(jax.devices()[0].device_kind),
           "jax": jax.__version__, "tuning": tuning_table(reports)}
    if args.export:
        os.makedirs(args.export, exist_ok=True)
        for rep in reports:
            if rep.path is not None:
                shutil.copy2(rep.path, args.export)
    if not (args.quick or args.no_layer):
        try:
            out["decode_layer"] = decode_layer()
        except Exception as e:  # the tuning results above stand; report the failure
            log(f"decode layer measurement failed: {type(e).__name__}: {e}")
            out["decode_layer_error"] = f"{type(e).__name__}: {e}"
    log(f"# done in {time.perf_counter() - t0:.0f} s")
    if args.json:
        write_json(args.json, out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_jax.bench.tune")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
