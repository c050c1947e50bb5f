"""``python -m moe_jax.bench fused``: the fused MoE kernel's template options, side by side.

For each token count, the benchmark layer's weights (32 experts, top-8, H 7168, I 2048, fp8_block)
and two routed inputs (the layer's own grouped top-k): every candidate instantiation of
``heuristics.sm90_fused_moe_candidates`` (the other BLOCK_M, 2-CTA clusters with the weight tile
multicast, the L2-lag schedule, early combine, batched pull publish, the L2 staging passes,
programmatic dependent launch, one
stage fewer; ``--all`` adds every pair of options; ``--grids`` the rule's config on fewer CTAs than
the GPU has SMs) is compiled, run, and its output compared
with the heuristic config's: every option changes only the schedule, so the outputs must be
bit-identical, and a candidate that differs is reported and not timed. Kernel time (the fused
kernel alone, profiler trace, median over ``--iters`` rounds, both inputs) is taken in two traces,
the candidates interleaved round by round, the second in reverse order; a gain counts only when
both traces show it. ``--steady`` times each candidate instead as a steady stream of calls (input
and fused kernel, `_timing.time_op`: 8 dispatches over the inputs, median of ``--iters`` rounds),
in two passes, the second in reverse order: the GPU then runs at its power limit, as it does
under a serving loop, where an option that moves less data can win although a short trace shows
it slower (the clusters at BLOCK_M 128).

Needs an SM90 GPU (exits with status 2 elsewhere). Table on stdout, progress on stderr;
``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import statistics
import sys
import time


def _traced_medians(fns: dict, args: list[tuple], iters: int, reverse: bool) -> dict[str, float]:
    """Kernel µs of each candidate: per round the mean over ``args``, median over the rounds."""
    from custom_calls.deep_gemm import autotune

    order = list(reversed(fns)) if reverse else list(fns)
    seq = [(lab, a) for _ in range(iters) for lab in order for a in args]
    durs = autotune.trace_kernel_durations([functools.partial(fns[lab], *a) for lab, a in seq],
                                           ["sm90_fp8_mega_moe"])
    per: dict[str, list[float]] = {lab: [] for lab in fns}
    for i in range(0, len(seq), len(args)):
        per[seq[i][0]].append(sum(durs[i:i + len(args)]) / len(args) * 1e6)
    return {lab: statistics.median(ts) for lab, ts in per.items()}


def _steady_medians(fns: dict, args: list[tuple], iters: int, reverse: bool) -> dict[str, float]:
    """Steady-stream µs per call of each candidate over ``args``, one after the other."""
    from moe_jax.bench._timing import time_op

    order = list(reversed(fns)) if reverse else list(fns)
    return {lab: time_op(fns[lab], args, rounds=iters, chain=8) * 1e6 for lab in order}


def layer_setup():
    """(config, params, the fused layout's weight operands) of the benchmark layer."""
    from moe_jax.bench.layer import _bench_params, _config
    from moe_jax.params import prepare_params

    cfg = _config()
    params = _bench_params(cfg)
    fparams = prepare_params(params, dataclasses.replace(cfg, layout="fused"))
    return cfg, params, (fparams.w13, fparams.w13_scale, fparams.w2, fparams.w2_scale)


def sweep(tokens: int, setup, *, full: bool, iters: int, log, grids: tuple[int, ...] = (),
          steady: bool = False) -> dict:
    """One token count: {tokens, routes_per_expert, heuristic, rows, rejected}; setup: `layer_setup()`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from custom_calls.deep_gemm import autotune
    from custom_calls.deep_gemm import fused_moe as F
    from custom_calls.deep_gemm.codegen import sm90_fused_moe_source
    from custom_calls.deep_gemm.heuristics import sm90_fused_moe_candidates
    from moe_jax.routing import route

    cfg, params, weights = setup
    xs = [jax.random.normal(jax.random.PRNGKey(10 + r), (tokens, cfg.hidden_size), jnp.bfloat16) for r in range(2)]
    args = [(x, *route(x, params, cfg), *weights) for x in xs]
    counts = np.bincount(np.asarray(args[0][1]).ravel(), minlength=cfg.num_experts)
    base = F.fused_config(num_tokens=tokens, hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
                          num_experts=cfg.num_experts, top_k=cfg.top_k, activation_clamp=None)
    cands = sm90_fused_moe_candidates(base, full=full)
    labels = [F.config_label(c) for c in cands]
    for g in grids:  # the rule's choice for a grid of g CTAs (the kernel's kNumSMs)
        c = F.fused_config(num_tokens=tokens, hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
                           num_experts=cfg.num_experts, top_k=cfg.top_k, activation_clamp=None, num_sms=g)
        if c not in cands:
            cands.append(c)
            labels.append(f"{F.config_label(c)} grid {g}")
    log(f"# {tokens} tokens: compiling {len(cands)} candidates")
    cubins = autotune.compile_all([(F.kernel_name(c), sm90_fused_moe_source(c)) for c in cands])
    rejected, fns, outs = {}, {}, {}
    for c, lab in zip(cands, labels):
        err = cubins[sm90_fused_moe_source(c)]
        if isinstance(err, Exception):
            rejected[lab] = f"compile: {str(err)[-300:]}"
            continue
        fn = jax.jit(functools.partial(F.fused_moe_with_config, c, routed_scaling_factor=cfg.routed_scaling_factor))
        try:
            outs[lab] = [jax.block_until_ready(fn(*a)) for a in args]
        except Exception as e:  # a launch the driver refuses (e.g. clusters that do not fit)
            rejected[lab] = f"run: {type(e).__name__}: {str(e)[:300]}"
            continue
        fns[lab] = fn
    ref = outs.get(labels[0])
    if ref is None:
        raise RuntimeError(f"the heuristic's config {labels[0]} did not run: {rejected.get(labels[0])}")
    for lab in list(fns):
        diff = sum(int(jnp.sum(o != r)) for o, r in zip(outs[lab], ref))
        if diff:
            rejected[lab] = f"output differs from the heuristic's in {diff} elements"
            del fns[lab]
    jax.block_until_ready([fns[labels[0]](*args[0]) for _ in range(8)])  # clock up from idle
    timer = _steady_medians if steady else _traced_medians
    a = timer(fns, args, iters, reverse=False)
    b = timer(fns, args, iters, reverse=True)
    h = labels[0]
    rows = [dict(config=lab, us_a=a[lab], us_b=b[lab], gain_a=a[h] / a[lab] - 1, gain_b=b[h] / b[lab] - 1)
            for lab in fns]
    rows.sort(key=lambda r: r["us_a"] + r["us_b"])
    return dict(tokens=tokens, routes_per_expert=(int(counts.min()), int(counts.max())), heuristic=h, rows=rows,
                rejected=rejected, timing="steady stream" if steady else "kernel time")


def print_sweep(res: dict, top: int) -> None:
    lo, hi = res["routes_per_expert"]
    what = ("steady-stream µs per call, pass A / pass B (reversed order)" if res.get("timing") == "steady stream"
            else "kernel µs, trace A / trace B (reversed order)")
    print(f"\n{res['tokens']} tokens (routes per expert {lo}..{hi}); heuristic {res['heuristic']}; "
          f"{what}, gain over the heuristic:")
    print(f"  {'config':32s} {'A':>9s} {'B':>9s} {'gain A':>7s} {'gain B':>7s}")
    rows = res["rows"]
    shown = rows[:top] + [r for r in rows[top:] if r["config"] == res["heuristic"]]
    for r in shown:
        mark = "  (heuristic)" if r["config"] == res["heuristic"] else (
            "  both gain" if min(r["gain_a"], r["gain_b"]) > 0 else "")
        print(f"  {r['config']:32s} {r['us_a']:9.1f} {r['us_b']:9.1f} {100 * r['gain_a']:6.1f}% "
              f"{100 * r['gain_b']:6.1f}%{mark}")
    if len(rows) > len(shown):
        print(f"  ... {len(rows) - len(shown)} slower configs (--json for all)")
    for lab, why in res["rejected"].items():
        print(f"  not timed: {lab}: {why}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0] if __doc__ else None
    p.add_argument("--tokens", default="32,128,512,4096", help="token counts (default 32,128,512,4096)")
    p.add_argument("--all", action="store_true", help="also every pair of options (~67 configs per count)")
    p.add_argument("--grids", default="", help="comma-separated grid sizes (CTAs, even, at most the SM count) "
                   "to time the rule's config on as well (default: none)")
    p.add_argument("--steady", action="store_true",
                   help="time a steady stream of calls per candidate (the GPU at its power limit) instead of "
                        "kernel time in traces")
    p.add_argument("--iters", type=int, default=6, help="rounds per trace or steady pass (default 6)")
    p.add_argument("--top", type=int, default=12, help="rows printed per token count (default 12)")
    p.add_argument("--json", metavar="PATH", help="write every row as JSON here")
    p.set_defaults(func=run)


def run(args) -> int:
    from moe_jax.bench._cli import cannot_run, log, write_json
    from moe_jax.bench.gemm import gpu_reason

    if cannot_run("moe_jax.bench fused", gpu_reason()):
        return 2
    import jax

    try:
        tokens = [int(t) for t in args.tokens.split(",")]
        grids = tuple(int(g) for g in args.grids.split(",") if g)
    except ValueError:
        print(f"--tokens, --grids: expected comma-separated ints, got {args.tokens!r}, {args.grids!r}",
              file=sys.stderr)
        return 2
    from custom_calls.deep_gemm.toolchain import detected_device

    sms = detected_device()[2]
    bad = [g for g in grids if g < 2 or g % 2 or (sms and g > sms)]
    if bad:
        print(f"--grids: expected even sizes in [2, {sms}] (the GPU's SMs), got {bad}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    out = dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind), sweeps=[])
    setup = layer_setup()
    for m in tokens:
        res = sweep(m, setup, full=args.all, iters=args.iters, log=log, grids=grids, steady=args.steady)
        out["sweeps"].append(res)
        print_sweep(res, args.top)
    log(f"# done in {time.perf_counter() - t0:.0f} s")
    if args.json:
        write_json(args.json, out)
    return 0
