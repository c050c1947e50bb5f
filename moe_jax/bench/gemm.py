"""``python -m moe_jax.bench gemm``: DeepGEMM grouped GEMMs (custom calls) vs ``jax.lax.ragged_dot``.

Method: inputs are fresh random normals (weights ×0.05) quantized on the device (1x128 activation
groups, 128x128 weight blocks); every weight set is larger than the L2. Times come from
back-to-back asynchronous dispatch of a jitted call, divided by the number of calls:
* burst: after 1 s idle and ~30 ms of untimed warm-up calls (the clock ramps up from idle), at
  least 10 calls and at least ~20 ms of them (so the host's dispatch gap before the first call is
  under ~0.5 % of the window even for 0.3 ms GEMMs); median of 3 rounds;
* sustained: 100 calls back to back, 400 for the masked decode (the H200 lowers its clock under its
  power cap);
* kernel (DeepGEMM rows): the median device duration of the kernel over one more burst, from a
  profiler trace — kernel time without dispatch, the protocol of DeepGEMM's own benchmark.
Error: relative Frobenius norm ‖D − R‖/‖R‖ over every row, R = float32 (HIGHEST) product of the
dequantized operands, plus the worst single row. W4A8 rows (`gemm_w4a8`): the same weights as MXFP4,
kept 4-bit (backend "w4a8") beside DeepGEMM FP8 on their FP4 -> FP8 expansion; err against the
latter. Launch overhead: per-GEMM time of a jitted chain
of 32 small GEMMs minus the kernel's own duration (from a profiler trace).
Needs a CUDA GPU of compute capability 9.x (H100/H200); elsewhere it exits with status 2 and says so;
status 1 when a row failed (an exception in a DeepGEMM row stops the run with its traceback).
Output: the table on stdout; progress (DeepGEMM kernel compiles, first calls of jitted functions) on
stderr; `--json PATH` (every row), `--markdown PATH`, `--plot PATH` (PNG: TFLOPS, TB/s for masked).
"""

from __future__ import annotations

import argparse
import math
import datetime
import statistics
import sys
import time

from moe_jax.bench.gemm_w4a8 import bench_w4a8

CONTIG = [(32, 1024, 4096, 7168), (32, 1024, 7168, 2048), (8, 4096, 4096, 7168), (32, 256, 4096, 7168)]
MASKED = [(32, 256, 32, 4096, 7168), (32, 256, 32, 7168, 2048)]  # G, m_pad, expected_m, N, K


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0] if __doc__ else None
    p.add_argument("--quick", action="store_true", help="fewer repetitions, first contig and masked shapes only")
    p.add_argument("--no-ragged", action="store_true", help="skip jax.lax.ragged_dot")
    p.add_argument("--json", metavar="PATH", help="write every row (and the launch overhead) as JSON here")
    p.add_argument("--markdown", metavar="PATH", help="write the table as markdown here")
    p.add_argument("--plot", metavar="PATH",
                   help="write a PNG here: TFLOPS per implementation and shape (TB/s for masked)")
    p.set_defaults(func=run)


def gpu_reason() -> str | None:
    """Why this benchmark cannot run here (it needs an SM90 CUDA GPU for jax), or None."""
    from custom_calls.deep_gemm import detected_device

    platform, arch, _ = detected_device()
    if arch is None:
        return (f"needs a CUDA GPU (compute capability 9.x, e.g. H100/H200) visible to jax; jax platform "
                f"is {platform!r}")
    if arch // 10 != 9:
        return f"needs a CUDA GPU of compute capability 9.x (H100/H200); the device has {arch // 10}.{arch % 10}"
    return None


def warmup_shapes(plan: list[tuple[str, tuple]]) -> list:
    """DeepGEMM kernels the run will launch (custom_calls.deep_gemm.GemmShape list)."""
    from custom_calls.deep_gemm import GemmShape

    shapes = [GemmShape("dense", rows=128, n=256, k=256, recipe="bf16")]  # launch overhead chain
    for what, shp in plan:
        if what == "contig":
            g, rows, n, k = shp
            shapes.append(GemmShape("contig", rows=g * rows, n=n, k=k, num_groups=g))
            if shp == CONTIG[0]:
                shapes.append(GemmShape("contig", rows=g * rows, n=n, k=k, num_groups=g, recipe="bf16"))
        else:
            g, m_pad, em, n, k = shp
            shapes.append(GemmShape("masked", rows=m_pad, n=n, k=k, num_groups=g, expected_m=em))
    return shapes


def _timeit(f, args, *, burst_rounds=3, burst_iters=10, sustained_iters=150, idle=1.0, kernel=None):
    """(burst s, sustained s | None, kernel s | None). kernel: a substring of the GPU kernel's name (or a
    tuple of them, `_kernel_s`); its median device duration over one more burst, read from a profiler
    trace (the protocol of DeepGEMM's own benchmark, which times kernels, not dispatch)."""
    import jax

    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    t_one = max(time.perf_counter() - t0, 1e-6)
    warm = max(1, int(0.03 / t_one))  # ~30 ms of work brings the clock up
    # a window of >= ~20 ms: the idle gap before the first call's kernel starts must not weigh on
    # short calls (10 calls of a 0.28 ms GEMM made burst read lower than sustained)
    burst_iters = max(burst_iters, math.ceil(0.02 / t_one)) if burst_iters > 2 else burst_iters
    burst = []
    for _ in range(burst_rounds):
        time.sleep(idle)
        for _ in range(warm):
            out = f(*args)
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        for _ in range(burst_iters):
            out = f(*args)
        jax.block_until_ready(out)
        burst.append((time.perf_counter() - t0) / burst_iters)
    sustained = None
    if sustained_iters:
        t0 = time.perf_counter()
        for _ in range(sustained_iters):
            out = f(*args)
        jax.block_until_ready(out)
        sustained = (time.perf_counter() - t0) / sustained_iters
    kernel_s = None
    if kernel:
        try:
            time.sleep(idle)
            for _ in range(warm):
                out = f(*args)
            jax.block_until_ready(out)
            kernel_s = _kernel_s(lambda: jax.block_until_ready([f(*args) for _ in range(burst_iters)]), kernel)
        except Exception as e:  # the profiler is optional: the column stays empty, and says why
            print(f"kernel timing unavailable: {type(e).__name__}: {e}", file=sys.stderr)
    return statistics.median(burst), sustained, kernel_s


def _quant_inputs(key, g, rows, n, k):
    import jax
    import jax.numpy as jnp

    import layouts

    k1, k2 = jax.random.split(key)
    x = jax.random.normal(k1, (g * rows, k), jnp.float32)
    w = jax.random.normal(k2, (g, n, k), jnp.float32) * 0.05
    qa, sa = layouts.quantize_fp8_per_token_group(x, 128)
    qb, sb = layouts.quantize_fp8_per_block(w, 128)
    a_deq = qa.astype(jnp.float32) * jnp.repeat(sa, 128, axis=-1)[:, :k]
    b_deq = qb.astype(jnp.float32) * jnp.repeat(jnp.repeat(sb, 128, axis=-2)[:, :n], 128, axis=-1)[..., :k]
    return x, w, qa, sa, qb, sb, a_deq, b_deq


def _kernel_s(run, needle: str | tuple[str, ...]) -> float | None:
    """Median device duration (s) of the kernels whose name contains ``needle`` while ``run()`` runs; a
    tuple of needles: the sum of each matched needle's median, for a call that runs one kernel of each
    (the W4A8 contig op by expansion: the widening, then DeepGEMM's FP8 GEMM). None: nothing matched."""
    from moe_jax.bench._timing import trace_kernels

    traced = trace_kernels(run)
    medians = [statistics.median(durs) for n in ((needle,) if isinstance(needle, str) else needle)
               if (durs := [d for name, ds in traced.items() if n in name for d in ds])]
    return sum(medians) if medians else None


def launch_overhead(chain: int = 32, iters: int = 100, rounds: int = 9) -> dict:
    """Per-GEMM time in a jitted chain of ``chain`` small BF16 GEMMs (128x256x256), the kernel's own
    duration, and their difference; the same chain of XLA dots for comparison. Each step figure is
    the median of ``rounds`` rounds of ``iters`` chained calls, the two implementations alternating
    round by round (so a clock ramp hits both alike), with the rounds' min and max as its spread."""
    import jax
    import jax.numpy as jnp

    import custom_calls.deep_gemm as dg

    x = jax.random.normal(jax.random.key(0), (128, 256), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (256, 256), jnp.float32) * 0.06).astype(jnp.bfloat16)

    def make(gemm):
        def f(x, w):
            for _ in range(chain):
                x = gemm(x, w)
            return x
        return jax.jit(f)

    fns = {"deep_gemm": make(lambda x, w: dg.gemm_nt_bf16(x, w)),
           "xla_dot": make(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16))}
    steps: dict[str, list[float]] = {name: [] for name in fns}
    for f in fns.values():
        jax.block_until_ready(f(x, w))
    for _ in range(rounds):
        for name, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                out = f(x, w)
            jax.block_until_ready(out)
            steps[name].append((time.perf_counter() - t0) / iters / chain * 1e6)
    res = {}
    for name, vals in steps.items():
        res[f"{name}_step_us"] = statistics.median(vals)
        res[f"{name}_step_us_min"], res[f"{name}_step_us_max"] = min(vals), max(vals)
    kernel_s = None
    try:
        kernel_s = _kernel_s(lambda: jax.block_until_ready([fns["deep_gemm"](x, w) for _ in range(5)]),
                             "sm90_bf16_gemm")
    except Exception as e:  # the profiler is optional; say why it is missing
        res["profiler_error"] = f"{type(e).__name__}: {e}"
    res["kernel_us"] = kernel_s * 1e6 if kernel_s else None
    if kernel_s:
        for key in ("", "_min", "_max"):
            res[f"overhead_us{key}"] = res[f"deep_gemm_step_us{key}"] - res["kernel_us"]
    else:
        res["overhead_us"] = None
    return res


def format_launch_overhead(lo: dict) -> str:
    """One line of `launch_overhead`'s result: each step as median (min-max over the rounds)."""
    def spread(key: str) -> str:
        if lo.get(key) is None:
            return "n/a"
        return f"{lo[key]:.2f} ({lo[key + '_min']:.2f}-{lo[key + '_max']:.2f})"
    kernel = "n/a" if lo.get("kernel_us") is None else f"{lo['kernel_us']:.2f}"
    line = (f"launch overhead (us per call, median (min-max) of the rounds): DeepGEMM custom-call step "
            f"{spread('deep_gemm_step_us')}, its kernel {kernel}, overhead {spread('overhead_us')}; "
            f"XLA dot step {spread('xla_dot_step_us')}")
    return line + (f"; profiler: {lo['profiler_error']}" if "profiler_error" in lo else "")


def run(args) -> int:
    from moe_jax.bench._cli import Progress, cannot_run, check_plot_available, exit_status, log, write_json

    check_plot_available(args.plot)
    if cannot_run("moe_jax.bench gemm", gpu_reason()):
        return 2
    import jax

    import custom_calls.deep_gemm as dg
    from custom_calls.native.toolchain import ToolchainError

    dev = jax.devices()[0]
    rows_out: list[dict] = []
    sustained_iters = 40 if args.quick else 100
    contig = CONTIG[:1] if args.quick else CONTIG
    masked = MASKED[:1] if args.quick else MASKED
    # Headline shapes first, so a cut-short run still has them.
    plan = [("contig", s) for s in contig[:1]] + [("masked", s) for s in masked[:1]]
    plan += [("contig", s) for s in contig[1:]] + [("masked", s) for s in masked[1:]]
    shapes = warmup_shapes(plan)
    log(f"# compiling (or finding in the cache) the DeepGEMM kernels of {len(shapes)} GEMM shapes")
    try:
        dg.warmup(shapes, progress=True)
    except ToolchainError as e:
        print(f"python -m moe_jax.bench gemm: the DeepGEMM kernels cannot be built here: {e}", file=sys.stderr)
        return 2
    progress = Progress("gemm first calls")

    def row(impl, kind, shape, t, flops=None, bytes_=None, err=(None, None), note="", failed=False):
        burst, sus, kern = t if t else (None, None, None)
        r = {"impl": impl, "kind": kind, "shape": shape,
             "burst_ms": burst * 1e3 if burst else None, "sustained_ms": sus * 1e3 if sus else None,
             "kernel_ms": kern * 1e3 if kern else None,
             "tflops_burst": flops / burst / 1e12 if (flops and burst) else None,
             "tflops_sustained": flops / sus / 1e12 if (flops and sus) else None,
             "tflops_kernel": flops / kern / 1e12 if (flops and kern) else None,
             "tbps_burst": bytes_ / burst / 1e12 if (bytes_ and burst) else None,
             "tbps_sustained": bytes_ / sus / 1e12 if (bytes_ and sus) else None,
             "tbps_kernel": bytes_ / kern / 1e12 if (bytes_ and kern) else None,
             "rel_err": err[0], "worst_row_err": err[1], "note": note, "failed": failed}
        rows_out.append(r)
        progress.print_out(_fmt_row(r))

    progress.step("launch overhead chains")
    lo = launch_overhead()
    print(format_launch_overhead(lo), flush=True)
    print(_HEADER, flush=True)
    key = jax.random.key(0)
    for i, (what, shp) in enumerate(plan):
        key, sub = jax.random.split(key)
        bench = _bench_contig if what == "contig" else _bench_masked
        # ragged_dot costs ~80 ms a call: measure it on the two headline shapes only.
        bench(sub, shp, row, ragged=not args.no_ragged and i < 2, fp8_ragged=(i == 0),
              sustained_iters=sustained_iters, step=lambda what_, s=shp, w=what: progress.step(f"{w} {s}: {what_}"))
    progress.close()
    tuned = print_tuned(plan)
    meta = {"date": datetime.date.today().isoformat(), "device": str(dev.device_kind),
            "jax": jax.__version__, "rows": rows_out, "launch_overhead": lo, "tuned": tuned}
    if args.json:
        write_json(args.json, meta)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"{meta['date']}, {meta['device']}, jax {meta['jax']}\n\n{_HEADER}\n")
            for r in rows_out:
                f.write(_fmt_row(r) + "\n")
            f.write(f"\n{format_launch_overhead(lo)}\n")
            if tuned:
                f.write(f"\n{_TUNED_HEADER}\n" + "".join(_fmt_tuned(r) + "\n" for r in tuned))
    if args.plot:
        plot(args.plot, rows_out, meta["device"])
    return exit_status([f"{r['impl']} {r['shape']}" for r in rows_out if r["failed"]])


def plot(path: str, rows: list[dict], device: str) -> None:
    """PNG: contig panel in TFLOPS, masked panel in TB/s; one bar per implementation and shape (burst),
    dots at the sustained value."""
    from moe_jax.bench._cli import plot_panels

    panels = []
    for kind, unit, ylabel in (("contig", "tflops", "TFLOPS"), ("masked", "tbps", "TB/s (weights + real rows)")):
        sel = [r for r in rows if r["kind"] == kind]
        if not sel:
            continue
        groups = list(dict.fromkeys(r["shape"] for r in sel))
        impls = list(dict.fromkeys(r["impl"] for r in sel))
        val = {(r["impl"], r["shape"]): r for r in sel}
        series = {i: [val.get((i, g), {}).get(f"{unit}_burst") for g in groups] for i in impls}
        markers = {i: [val.get((i, g), {}).get(f"{unit}_sustained") for g in groups] for i in impls}
        panels.append(dict(title=f"{kind} grouped GEMMs (bars: burst, dots: sustained)", ylabel=ylabel,
                           groups=[g.split(" ", 1)[1] if g.startswith(kind) else g for g in groups],
                           series=series, markers=markers))
    plot_panels(path, panels, title=f"moe_jax GEMMs, {device}")


def _ragged(a, b, s):
    import jax
    import jax.numpy as jnp

    return jax.lax.ragged_dot(a, b, s, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _bench_contig(key, shp, row, *, ragged, fp8_ragged, sustained_iters, step=lambda what: None):
    import jax
    import jax.numpy as jnp

    import custom_calls.deep_gemm as dg
    from moe_jax.bench._cli import rel_errors, run_untuned

    g, rows, n, k = shp
    shape = f"contig {g}x{rows}, N={n}, K={k}"
    x, w, qa, sa, qb, sb, a_deq, b_deq = _quant_inputs(key, g, rows, n, k)
    m_idx = jnp.repeat(jnp.arange(g, dtype=jnp.int32), rows)
    hi = jax.lax.Precision.HIGHEST
    step("float32 reference")
    ref = run_untuned(lambda a, b: jnp.einsum("gmk,gnk->gmn", a.reshape(g, rows, k), b, precision=hi
                                             ).reshape(g * rows, n), a_deq, b_deq)
    del a_deq, b_deq
    flops = 2.0 * g * rows * n * k
    img = dg_image(sa)
    f8 = jax.jit(lambda a, b, m, s1, s2: dg.m_grouped_gemm_contig(a, b, m, lhs_scale=s1, rhs_scale=s2,
                                                                    recipe="fp8_block", arch=90))
    step("deep_gemm fp8")
    out = jax.block_until_ready(f8(qa, qb, m_idx, img, sb))
    row("deep_gemm fp8", "contig", shape, _timeit(f8, (qa, qb, m_idx, img, sb), sustained_iters=sustained_iters,
                                                  kernel="sm90_fp8_gemm_1d2d"),
        flops, err=rel_errors(out, ref))
    del ref, out
    bench_w4a8("contig", shape, w, (qa, img, m_idx), row, _timeit, flops=flops, act_bytes=0,
               sustained_iters=sustained_iters, step=step)
    xb = x.astype(jnp.bfloat16)
    if shp == CONTIG[0]:
        wb = w.astype(jnp.bfloat16)
        step("bf16 float32 reference")
        refb = run_untuned(lambda a, b: jnp.einsum("gmk,gnk->gmn", a.astype(jnp.float32).reshape(g, rows, k),
                                                  b.astype(jnp.float32), precision=hi).reshape(g * rows, n), xb, wb)
        fb = jax.jit(lambda a, b, m: dg.m_grouped_gemm_contig(a, b, m, recipe="bf16", arch=90))
        step("deep_gemm bf16")
        out = jax.block_until_ready(fb(xb, wb, m_idx))
        row("deep_gemm bf16", "contig", shape, _timeit(fb, (xb, wb, m_idx), sustained_iters=sustained_iters,
                                                       kernel="sm90_bf16_gemm"),
            flops, err=rel_errors(out, refb))
        del refb, wb, out
    if ragged:
        gs = jnp.full((g,), rows, jnp.int32)
        wt = jnp.swapaxes(w, 1, 2).astype(jnp.bfloat16)
        rd = jax.jit(_ragged)
        step("ragged_dot bf16")
        out = jax.block_until_ready(rd(xb, wt, gs))
        refb = run_untuned(lambda a, b: jnp.einsum("gmk,gkn->gmn", a.astype(jnp.float32).reshape(g, rows, k),
                                                  b.astype(jnp.float32), precision=hi).reshape(g * rows, n), xb, wt)
        row("ragged_dot bf16", "contig", shape, _timeit(rd, (xb, wt, gs), burst_rounds=2, burst_iters=2,
                                                       sustained_iters=0), flops, err=rel_errors(out, refb))
        del refb, wt, out
        if fp8_ragged:
            try:
                qbt = jnp.swapaxes(qb, 1, 2)
                rd8 = jax.jit(_ragged)
                step("ragged_dot fp8")
                jax.block_until_ready(rd8(qa, qbt, gs))
                row("ragged_dot fp8 (no scales)", "contig", shape,
                    _timeit(rd8, (qa, qbt, gs), burst_rounds=2, burst_iters=2, sustained_iters=0), flops,
                    note="unscaled e4m3 operands: speed only")
            except Exception as e:
                row("ragged_dot fp8", "contig", shape, None, note=f"fails: {type(e).__name__}: {str(e)[:80]}",
                    failed=True)


def _bench_masked(key, shp, row, *, ragged, fp8_ragged, sustained_iters, step=lambda what: None):
    import jax
    import jax.numpy as jnp

    import custom_calls.deep_gemm as dg
    from moe_jax.bench._cli import rel_errors, run_untuned

    del fp8_ragged
    g, m_pad, em, n, k = shp
    shape = f"masked G={g}, m_pad={m_pad}, expected_m={em}, N={n}, K={k}"
    x, w, qa, sa, qb, sb, a_deq, b_deq = _quant_inputs(key, g, m_pad, n, k)
    qa3, img = qa.reshape(g, m_pad, k), dg_image(sa.reshape(g, m_pad, -1))
    masked_m = jnp.full((g,), em, jnp.int32)
    step("float32 reference")
    ref = run_untuned(lambda a, b: jnp.einsum("gmk,gnk->gmn", a.reshape(g, m_pad, k)[:, :em], b,
                                             precision=jax.lax.Precision.HIGHEST), a_deq, b_deq)
    del a_deq, b_deq
    fm = jax.jit(lambda a, b, mm, s1, s2: dg.m_grouped_gemm_masked(a, b, mm, expected_m=em, lhs_scale=s1,
                                                                     rhs_scale=s2, recipe="fp8_block", arch=90))
    step("deep_gemm fp8")
    out = jax.block_until_ready(fm(qa3, qb, masked_m, img, sb))
    # Effective bytes: weights + real activation rows + real output rows.
    bytes_ = g * n * k + g * em * k + g * em * n * 2
    row("deep_gemm fp8", "masked", shape, _timeit(fm, (qa3, qb, masked_m, img, sb),
                                                  sustained_iters=sustained_iters * 4,
                                                  kernel="sm90_fp8_gemm_1d2d"),
        2.0 * g * em * n * k, bytes_=bytes_, err=rel_errors(out[:, :em], ref))
    bench_w4a8("masked", shape, w, (qa3, img, masked_m, em), row, _timeit, flops=2.0 * g * em * n * k,
               act_bytes=g * em * k + g * em * n * 2, sustained_iters=sustained_iters, step=step)
    if ragged:
        xb = x.reshape(g, m_pad, k)[:, :em].reshape(g * em, k).astype(jnp.bfloat16)
        wt = jnp.swapaxes(w, 1, 2).astype(jnp.bfloat16)
        gs = jnp.full((g,), em, jnp.int32)
        rd = jax.jit(_ragged)
        step("ragged_dot bf16")
        jax.block_until_ready(rd(xb, wt, gs))
        row("ragged_dot bf16", "masked", shape, _timeit(rd, (xb, wt, gs), burst_rounds=2, burst_iters=3,
                                                       sustained_iters=0),
            2.0 * g * em * n * k, bytes_=g * n * k * 2 + g * em * k * 2 + g * em * n * 2)


def dg_image(sf):
    import layouts

    return layouts.to_mn_major_tma_aligned(sf)


_HEADER = ("| implementation | kind | shape | burst ms | sustained ms | kernel ms | TFLOPS burst | TFLOPS sustained "
           "| TFLOPS kernel | TB/s burst | TB/s sustained | TB/s kernel | rel err | worst row | note |\n"
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _fmt_row(r) -> str:
    def f(v, p):
        return "–" if v is None else f"{v:.{p}f}"

    def e(v):
        return "–" if v is None else f"{v:.2e}"

    return (f"| {r['impl']} | {r['kind']} | {r['shape']} | {f(r['burst_ms'], 4)} | {f(r['sustained_ms'], 4)} "
            f"| {f(r['kernel_ms'], 4)} | {f(r['tflops_burst'], 1)} | {f(r['tflops_sustained'], 1)} "
            f"| {f(r['tflops_kernel'], 1)} | {f(r['tbps_burst'], 2)} | {f(r['tbps_sustained'], 2)} "
            f"| {f(r['tbps_kernel'], 2)} "
            f"| {e(r['rel_err'])} | {e(r['worst_row_err'])} | {r['note']} |")


# --- tuned vs heuristic (when python -m moe_jax.bench.tune has cached tuned configs) ---------------

def tuning_problems(plan: list[tuple[str, tuple]]) -> list:
    """The autotuner's problems of this benchmark's DeepGEMM shapes: FP8 contig and masked, and BF16
    contig on the first contig shape (`autotune_search.bench_problems`)."""
    from moe_jax.bench.autotune_search import bench_problems

    return bench_problems(plan, bf16_contig=(CONTIG[0],))


_TUNED_HEADER = ("| shape | heuristic | tuned | heuristic kernel us | tuned kernel us | gain % |\n"
                 "|---|---|---|---|---|---|")


def _fmt_tuned(r: dict) -> str:
    def us(d):
        return " + ".join(f"{v:.1f}" for v in d.values()) + (f" ({', '.join(d)})" if len(d) > 1 else "")

    return (f"| {r['problem']} | {r['heuristic']} | {r['tuned']} | {us(r['heuristic_us'])} | {us(r['tuned_us'])} "
            f"| {100 * r['gain']:+.1f} |")


def print_tuned(plan: list[tuple[str, tuple]]) -> list[dict]:
    """Kernel time of the tuned config beside the heuristic's, now, for the shapes whose tuned config
    is cached (masked: the sum over two masked_m patterns); prints the table, returns its rows."""
    from moe_jax.bench._cli import log
    from moe_jax.bench.autotune_search import compare_cached

    try:
        rows = compare_cached(tuning_problems(plan))
    except Exception as e:  # the main table stands without this one; say why it is missing
        log(f"tuned vs heuristic unavailable: {type(e).__name__}: {e}")
        return []
    if rows:
        print(f"\ntuned configs (custom_calls/deep_gemm/autotune.py cache) vs DeepGEMM's heuristic, kernel time:\n"
              f"{_TUNED_HEADER}", flush=True)
        for r in rows:
            print(_fmt_tuned(r), flush=True)
    return rows
