"""``python -m moe_jax.bench fused``: the fused MoE kernel's template options, side by side.

For each token count, the benchmark layer's weights (32 experts, top-8, H 7168, I 2048, fp8_block)
and two routed inputs (the layer's own grouped top-k): every candidate instantiation of
`sm90_fused_moe_candidates` (the other BLOCK_M, 2-CTA clusters with the weight tile multicast, more
dispatch warps, the L2 staging passes, programmatic dependent launch, one stage fewer; ``--all``
adds every pair of options; ``--grids`` the rule's config on fewer CTAs than the GPU has SMs; ``--only`` keeps the
named ones) is compiled, run, and its output compared with the heuristic config's: every option
changes only the schedule, so the outputs must be bit-identical, and a candidate that differs is
reported and not timed. Kernel time (the fused kernel alone, profiler trace, median over
``--iters`` rounds, both inputs) is taken in two traces, the candidates interleaved round by
round, the second in reverse order; a gain counts only when both traces show it. ``--steady``
times each candidate instead as a steady stream of calls (input and fused kernel,
`_timing.time_op`: 8 dispatches over the inputs, median of ``--iters`` rounds), in two passes, the
second in reverse order: the GPU then runs at its power limit, as it does under a serving loop,
where an option that moves less data can win although a short trace shows it slower (the clusters
at BLOCK_M 128); at prefill sizes the GPU also heats over a pass, so a config timed later in a pass
reads slower, which the reversed second pass cancels. ``--trace`` instead builds the rule's config with the
template's event trace and prints where the kernel's time goes (`trace_phases`: the start before
the first tile, each GEMM phase's span and bandwidth, the combine and its slowest CTA).

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
    from moe_jax.bench.autotune_search import trace_kernel_durations

    order = list(reversed(fns)) if reverse else list(fns)
    seq = [(lab, a) for _ in range(iters) for lab in order for a in args]
    durs = trace_kernel_durations([functools.partial(fns[lab], *a) for lab, a in seq], ["sm90_fp8_mega_moe"])
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
    from moe_jax.bench.layer_model import _bench_params, _config
    from moe_jax.params import prepare_params

    cfg = _config()
    params = _bench_params(cfg)
    fparams = prepare_params(params, dataclasses.replace(cfg, layout="fused"))
    return cfg, params, (fparams.w13, fparams.w13_scale, fparams.w2, fparams.w2_scale)


def _routed_inputs(setup, tokens: int, count: int) -> list[tuple]:
    """``count`` operand tuples (x, topk_ids, topk_weights, *weights) of ``tokens`` random tokens
    (seeds 10, 11, ...) routed by the layer's own grouped top-k; setup: `layer_setup()`."""
    import jax
    import jax.numpy as jnp

    from moe_jax.routing import route

    cfg, params, weights = setup
    xs = [jax.random.normal(jax.random.PRNGKey(10 + r), (tokens, cfg.hidden_size), jnp.bfloat16) for r in range(count)]
    return [(x, *route(x, params, cfg), *weights) for x in xs]


def _rule_config(cfg, tokens: int, num_sms: int | None = None):
    """The kernel rule's config for ``tokens`` tokens of the benchmark layer ``cfg`` (num_sms: the
    grid, None for the GPU's SM count)."""
    from custom_calls.deep_gemm import fused_moe as F

    return F.fused_config(num_tokens=tokens, hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
                          num_experts=cfg.num_experts, top_k=cfg.top_k, activation_clamp=None, num_sms=num_sms)


def sm90_fused_moe_candidates(base, *, full: bool = False) -> list:
    """Legal variants of ``base`` (a ``sm90_fused_moe_config`` result, `Sm90FusedMoEConfig`), ``base``
    first, each with the most stages its options leave room for: from ``base``, the same BLOCK_M at
    the template's defaults, and the other BLOCK_M with and without the rules' options, one schedule
    option changed at a time (2-CTA clusters with the weight tile multicast, four dispatch warps
    (with four loader warps, to keep the math warpgroups aligned) or six instead of two, the L2
    staging passes and row modes, programmatic dependent launch toggled); then ``base`` with one
    stage fewer. ``full``: also every pair of the single options. Unique, in this order."""
    from custom_calls.deep_gemm.fused_moe_config import (sm90_fused_moe_config, sm90_fused_moe_max_stages,
                                                         sm90_fused_moe_options_reason)

    def heuristic(bm, options):
        try:
            return sm90_fused_moe_config(
                max_tokens=base.max_tokens, hidden=base.hidden, intermediate=base.intermediate,
                num_experts=base.num_experts, top_k=base.top_k, num_sms=base.num_sms,
                activation_clamp=base.activation_clamp, block_m=bm, schedule_options=options)
        except ValueError:
            return None

    singles = [dict(cluster_size=2), dict(num_dispatch_threads=128, num_non_epilogue_threads=128),
               dict(num_dispatch_threads=192), dict(l2_cd_passes=4),
               dict(l2_cd_passes=4, l2_stage_mode=2), dict(l2_cd_passes=4, l2_stage_mode=4), dict(l2_cd_passes=2),
               dict(pdl=not base.pdl)]
    changes = [dict()] + singles
    if full:
        changes += [a | b for i, a in enumerate(singles) for b in singles[i + 1:] if not a.keys() & b.keys()]
    # the options vary from the template's defaults, at this BLOCK_M and the other
    other = 64 if base.block_m == 128 else 128
    roots = [c for c in (base, heuristic(base.block_m, False), heuristic(other, True), heuristic(other, False))
             if c is not None]
    out = []
    for root in roots:
        for change in changes:
            cfg = dataclasses.replace(root, **change)
            if cfg.l2_cd_passes == (2 if cfg.half_l2_cd else 1):  # the kernel's own choice: the same kernel
                cfg = dataclasses.replace(cfg, l2_cd_passes=0)
            stages = sm90_fused_moe_max_stages(cfg)
            if stages:
                cfg = dataclasses.replace(cfg, num_stages=stages)
                if sm90_fused_moe_options_reason(cfg) is None and cfg not in out:
                    out.append(cfg)
    fewer = dataclasses.replace(base, num_stages=base.num_stages - 1)
    if sm90_fused_moe_options_reason(fewer) is None and fewer not in out:
        out.append(fewer)
    return out


def sweep(tokens: int, setup, *, full: bool, iters: int, log, grids: tuple[int, ...] = (),
          steady: bool = False, only: tuple[str, ...] = ()) -> dict:
    """One token count: {tokens, routes_per_expert, heuristic, rows, rejected}; setup: `layer_setup()`;
    only: the candidates of these labels (and the heuristic's), all when empty."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from custom_calls import fused_moe_sm90 as S
    from custom_calls.deep_gemm import fused_moe as F
    from custom_calls.deep_gemm.codegen import sm90_fused_moe_source
    from moe_jax.bench.autotune_search import compile_all

    cfg = setup[0]
    args = _routed_inputs(setup, tokens, 2)
    counts = np.bincount(np.asarray(args[0][1]).ravel(), minlength=cfg.num_experts)
    base = _rule_config(cfg, tokens)
    cands = sm90_fused_moe_candidates(base, full=full)
    if only:
        missing = set(only) - {F.config_label(c) for c in cands}
        if missing:
            log(f"# {tokens} tokens: --only names no candidate here: {', '.join(sorted(missing))}")
        cands = [c for i, c in enumerate(cands) if i == 0 or F.config_label(c) in only]
    labels = [F.config_label(c) for c in cands]
    for g in grids:  # the rule's choice for a grid of g CTAs (the kernel's kNumSMs)
        c = _rule_config(cfg, tokens, num_sms=g)
        if c not in cands:
            cands.append(c)
            labels.append(f"{F.config_label(c)} grid {g}")
    log(f"# {tokens} tokens: compiling {len(cands)} candidates")
    cubins = compile_all([(F.kernel_name(c), sm90_fused_moe_source(c)) for c in cands], 90)  # the SM90 kernel
    rejected, fns, outs = {}, {}, {}
    for c, lab in zip(cands, labels):
        err = cubins[sm90_fused_moe_source(c)]
        if isinstance(err, Exception):
            rejected[lab] = f"compile: {str(err)[-300:]}"
            continue
        fn = jax.jit(functools.partial(S.fused_moe_with_config, c, routed_scaling_factor=cfg.routed_scaling_factor))
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


# the kernel's trace events (sm90_fp8_mega_moe.cuh), by role: 0 dispatch warp 0, 1 the activation
# loader, 2 math warpgroup 0
_DISPATCH_EVENTS = {"prologue done": 23, "routing done": 2, "dispatch sync done": 4, "pull done": 3,
                    "clean start": 5, "kernel end": 22}
_MATH_EVENTS = {"tiles done": 19, "combine start": 20, "combine end": 21}
_KERNEL_START, _TILE_START, _MAINLOOP_END, _EPILOGUE_END = 1, 40, 43, 44
_WAIT_ARRIVAL_START, _WAIT_ARRIVAL_END = 30, 31


def trace_phases(words, *, phase_bytes: tuple[float, float] | None = None) -> dict:
    """The fused kernel's event trace (`fused_moe_traced`: (CTAs, 4 roles, slots, 4) uint32) ->
    where its time goes, in µs from the first CTA's start: per event of dispatch warp 0 and math
    warpgroup 0 the median and the last CTA; per GEMM phase (1: GEMM1, 2: GEMM2) its span (first
    tile start to last tile end over all CTAs), the median CTA's tiles, mainloop time (tile start to
    its last MMA) and epilogue time, and the median CTA's loader wait for the phase's inputs
    (GEMM2 tiles wait for their GEMM1 outputs). phase_bytes: the weight bytes of each phase, for
    the bandwidth over its span (TB/s)."""
    import numpy as np

    pairs = np.ascontiguousarray(words).view(np.uint64).reshape(*words.shape[:3], 2)
    event = (pairs[..., 0] >> np.uint64(56)).astype(np.int64)
    aux = (pairs[..., 0] & np.uint64((1 << 56) - 1)).astype(np.int64)
    t = pairs[..., 1].astype(np.float64)
    used = t > 0
    starts = t[:, 0][(event[:, 0] == _KERNEL_START) & used[:, 0]]
    if starts.size == 0:
        raise ValueError("trace: no KERNEL_START event (an untraced kernel, or the trace was not written)")
    t0 = starts.min()
    us = (t - t0) / 1e3

    def per_cta(role, ev):  # each CTA's last such event
        out = []
        for c in range(words.shape[0]):
            hit = us[c, role][(event[c, role] == ev) & used[c, role]]
            out.append(hit.max() if hit.size else np.nan)
        return np.asarray(out)

    def stat(v):
        v = v[np.isfinite(v)]
        return dict(median=float(np.median(v)), last=float(np.max(v))) if v.size else dict(median=np.nan, last=np.nan)

    events = {name: stat(per_cta(0, ev)) for name, ev in _DISPATCH_EVENTS.items()}
    events.update({name: stat(per_cta(2, ev)) for name, ev in _MATH_EVENTS.items()})
    phases = {}
    for ph in (1, 2):
        spans, main, epi, tiles, waits = [], [], [], [], []
        for c in range(words.shape[0]):
            ev, ax, tt = event[c, 2][used[c, 2]], aux[c, 2][used[c, 2]], us[c, 2][used[c, 2]]
            order = np.argsort(tt, kind="stable")
            ev, ax, tt = ev[order], ax[order], tt[order]
            n, m_sum, e_sum, start, main_end = 0, 0.0, 0.0, None, None
            for e, a, x in zip(ev, ax, tt):
                if e == _TILE_START:
                    start = x if (a & 0xFF) == ph else None
                    n += start is not None
                    if start is not None:
                        spans.append(x)
                elif start is not None and e == _MAINLOOP_END:
                    m_sum += x - start
                    main_end = x
                elif start is not None and e == _EPILOGUE_END:
                    e_sum += x - (main_end if main_end is not None else start)
                    spans.append(x)
                    start = main_end = None
            tiles.append(n)
            main.append(m_sum)
            epi.append(e_sum)
            lev, lax, lt = event[c, 1][used[c, 1]], aux[c, 1][used[c, 1]], us[c, 1][used[c, 1]]
            w_start = {int(a): x for e, a, x in zip(lev, lax, lt) if e == _WAIT_ARRIVAL_START}
            waits.append(sum(x - w_start[int(a)] for e, a, x in zip(lev, lax, lt)
                             if e == _WAIT_ARRIVAL_END and int(a) in w_start and (int(a) >> 32) == ph))
        row = dict(first_start=float(min(spans)) if spans else np.nan, last_end=float(max(spans)) if spans else np.nan,
                   tiles_median=float(np.median(tiles)), tiles_total=int(np.sum(tiles)),
                   mainloop_median=float(np.median(main)), epilogue_median=float(np.median(epi)),
                   wait_median=float(np.median(waits)))
        row["span"] = row["last_end"] - row["first_start"]
        if phase_bytes is not None and row["span"] > 0:
            row["TBps"] = phase_bytes[ph - 1] / (row["span"] * 1e-6) / 1e12
        phases[ph] = row
    return dict(events=events, phases=phases, ctas=int(words.shape[0]))


def print_trace(tokens: int, label: str, res: dict, total_us: float) -> None:
    print(f"\n{tokens} tokens, {label}: in-kernel event trace (µs from the first CTA's start; kernel "
          f"{total_us:.1f} µs, {res['ctas']} CTAs)")
    for name, v in res["events"].items():
        print(f"  {name:22s} median {v['median']:8.1f}   last CTA {v['last']:8.1f}")
    for ph, r in res["phases"].items():
        bw = f", {r['TBps']:.2f} TB/s of weights over the span" if "TBps" in r else ""
        print(f"  GEMM{ph}: {r['first_start']:.1f} -> {r['last_end']:.1f} (span {r['span']:.1f}{bw}); "
              f"{r['tiles_total']} tiles, per CTA (median) {r['tiles_median']:.0f} tiles, mainloop "
              f"{r['mainloop_median']:.1f}, epilogue {r['epilogue_median']:.1f}, loader waiting for inputs "
              f"{r['wait_median']:.1f}")


def trace_run(tokens: int, setup, *, log) -> dict:
    """The rule's config at ``tokens``, built with the event trace: its phases (`trace_phases`) for
    the last of 4 calls, and the untraced kernel's time in the same process for scale."""
    import dataclasses as dc

    import jax
    import jax.numpy as jnp
    import numpy as np

    from custom_calls import fused_moe_sm90 as S
    from custom_calls.deep_gemm import fused_moe as F
    from moe_jax.bench.autotune_search import trace_kernel_durations

    cfg, weights = setup[0], setup[2]
    (args,) = _routed_inputs(setup, tokens, 1)
    base = _rule_config(cfg, tokens)
    traced = dc.replace(base, trace=True)
    log(f"# {tokens} tokens: traced {F.config_label(traced)}")
    plain = jax.jit(functools.partial(S.fused_moe_with_config, base, routed_scaling_factor=cfg.routed_scaling_factor))
    fn = jax.jit(functools.partial(S.fused_moe_traced, traced, routed_scaling_factor=cfg.routed_scaling_factor))
    for _ in range(4):  # the last call's trace: compiled and clocked up by then
        y, words = fn(*args)
    same = bool(jnp.all(y == plain(*args)))
    kernel = trace_kernel_durations([functools.partial(plain, *args) for _ in range(8)], ["sm90_fp8_mega_moe"])
    w13, w2 = weights[0], weights[2]
    res = trace_phases(np.asarray(words), phase_bytes=(w13.size, w2.size))  # e4m3: one byte each
    res.update(tokens=tokens, config=F.config_label(base), kernel_us=float(np.median(kernel)) * 1e6,
               same_output=same)
    return res


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0] if __doc__ else None
    p.add_argument("--tokens", default="32,128,512,4096", help="token counts (default 32,128,512,4096)")
    p.add_argument("--all", action="store_true", help="also every pair of options (~35 configs per count)")
    p.add_argument("--grids", default="", help="comma-separated grid sizes (CTAs, even, at most the SM count) "
                   "to time the rule's config on as well (default: none)")
    p.add_argument("--steady", action="store_true",
                   help="time a steady stream of calls per candidate (the GPU at its power limit) instead of "
                        "kernel time in traces")
    p.add_argument("--trace", action="store_true",
                   help="instead of the sweep: the rule's config built with the kernel's event trace, where its "
                        "time goes (phases, GEMM1 / GEMM2 spans and bandwidth)")
    p.add_argument("--only", default="", metavar="LIST",
                   help="comma list of candidate labels to time beside the heuristic's (as printed, e.g. "
                        "'64x256 s4 c2'; default: every candidate)")
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
    from custom_calls.native.toolchain import detected_device

    sms = detected_device()[2]
    bad = [g for g in grids if g < 2 or g % 2 or (sms and g > sms)]
    if bad:
        print(f"--grids: expected even sizes in [2, {sms}] (the GPU's SMs), got {bad}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    out = dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind), sweeps=[])
    setup = layer_setup()
    if args.trace:
        out["traces"] = []
        for m in tokens:
            res = trace_run(m, setup, log=log)
            out["traces"].append(res)
            print_trace(m, res["config"] + ("" if res["same_output"] else " (OUTPUT DIFFERS from the untraced build)"),
                        res, res["kernel_us"])
        tokens = []
    for m in tokens:
        res = sweep(m, setup, full=args.all, iters=args.iters, log=log, grids=grids, steady=args.steady,
                    only=tuple(lab.strip() for lab in args.only.split(",") if lab.strip()))
        out["sweeps"].append(res)
        print_sweep(res, args.top)
    log(f"# done in {time.perf_counter() - t0:.0f} s")
    if args.json:
        write_json(args.json, out)
    return 0
