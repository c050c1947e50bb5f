"""``python -m moe_jax.bench timeline``: where a steady stream of layer calls spends its time, kernel
by kernel.

The benchmark layer of ``python -m moe_jax.bench layer`` (32 experts, top-8, H 7168, I 2048,
fp8_block, routing included, `moe_forward`) in the layout asked for, run the way that benchmark's
steady stream runs it (``--reps`` input sets per dispatch, ``--chain`` dispatches back to back). One
chain is traced with the profiler; per GPU kernel name the table gives the launches per layer, the
median duration and the median and mean idle gap before it (the time between the end of the
previous kernel on the stream and its start). Per layer: the steady-stream wall time and what
one more layer adds to a running stream (`_timing.time_stream`: streams of ``--chain`` and 3 x
``--chain`` dispatches, median of 5 rounds; the rest of the stream's time is paid once per stream),
the host's enqueue time (the chain's dispatch calls
returning, the GPU still busy), GPU busy time (sum of kernel durations) and span (first kernel's
start to last kernel's end, over the layers); the start-up is the idle before the chain's first
long kernel (the host launching the first dispatch). The weights-once roofline is taken at the
copy bandwidth measured in the same run.

Needs an SM90 GPU (exits with status 2 elsewhere). Table on stdout, progress on stderr;
``--json PATH`` writes the events' summary.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import time

LAYOUTS = ("fused", "fused-route-first", "auto", "contig", "masked")
# fused-route-first: the fused layout with the routing run before the fused op (the route stage on
# its own backend), as the layer routes an fp32 router or in checked mode: the side-by-side for
# routing inside the op (`fused_moe_routed`)


def _summary(events: list[tuple[str, int, int]], layers: int) -> dict:
    """events (name, start ns, duration ns) of one traced chain -> per-name rows and per-layer totals."""
    events = sorted(events, key=lambda e: e[1])
    durs: dict[str, list[float]] = collections.defaultdict(list)
    gaps: dict[str, list[float]] = collections.defaultdict(list)
    for name, _, d in events:
        durs[name].append(d / 1e3)
    for prev, cur in zip(events, events[1:]):
        gaps[cur[0]].append((cur[1] - prev[1] - prev[2]) / 1e3)
    longest = max(events, key=lambda e: e[2])[2]
    first_long = next(e for e in events if e[2] >= longest / 2)
    rows = [dict(kernel=n, per_layer=len(d) / layers, median_us=statistics.median(d),
                 gap_median_us=statistics.median(gaps[n]) if gaps[n] else 0.0,
                 gap_mean_us=statistics.mean(gaps[n]) if gaps[n] else 0.0) for n, d in durs.items()]
    return dict(rows=rows, busy_us=sum(d for _, _, d in events) / layers / 1e3,
                span_us=(events[-1][1] + events[-1][2] - events[0][1]) / layers / 1e3,
                startup_us=(first_long[1] - events[0][1]) / 1e3)


def setup(layout: str) -> tuple:
    """(config, params, the layout moe_forward is called with) of the benchmark layer in `layout`,
    built once for every token count (1.4 GB of weights)."""
    from moe_jax.bench.layer_model import _bench_params, _config
    from moe_jax.params import prepare_params

    cfg = _config()
    params = _bench_params(cfg)
    if layout != "fused":
        return cfg, params, layout
    cfg = dataclasses.replace(cfg, layout="fused")
    return cfg, prepare_params(params, cfg), "auto"  # w13 in the fused kernel's row order (a copy)


def measure(tokens: int, layout: str, layer: tuple, *, reps: int, chain: int, log) -> dict:
    """One token count; layer: `setup(layout)`."""
    import jax
    import jax.numpy as jnp

    from custom_calls.profiling import gpu_kernel_events
    from moe_jax.bench._timing import _over_sets, time_stream
    from moe_jax.bench.layer_model import _weight_bytes
    from moe_jax.layer import moe_forward

    cfg, params, call_layout = layer
    keys = jax.random.split(jax.random.PRNGKey(1), reps)
    sets = [(params, jax.random.normal(k, (tokens, cfg.hidden_size), jnp.bfloat16)) for k in keys]
    backend = "auto"
    if layout == "fused-route-first":  # route and gemm stages on different backends: routes first
        from moe_jax.layer import STAGES

        backend = tuple((s, "triton" if s == "route" else "auto") for s in STAGES)
    fn = lambda p, x: moe_forward(x, p, cfg, layout=call_layout, backend=backend)  # noqa: E731
    log(f"# {tokens} tokens, layout {layout}: compile and steady stream")
    stream = time_stream(fn, sets, chain=chain)
    many = _over_sets(fn)
    t0 = time.perf_counter()
    outs = [many(sets) for _ in range(chain)]
    enqueue = (time.perf_counter() - t0) / (chain * reps) * 1e6
    jax.block_until_ready(outs)
    del outs
    log(f"# {tokens} tokens, layout {layout}: trace")
    events = gpu_kernel_events(lambda: jax.block_until_ready([many(sets) for _ in range(chain)]))
    return dict(tokens=tokens, layout=layout, reps=reps, chain=chain, steady_us=stream.per_call * 1e6,
                marginal_us=stream.marginal * 1e6, stream_fixed_us=stream.fixed * 1e6, enqueue_us=enqueue,
                weights_bytes=_weight_bytes(params), **_summary(events, chain * reps))


def short_names(names: list[str]) -> dict[str, str]:
    """Kernel names without "void " and template arguments; names that then coincide (two
    instantiations of one template) get " #2", " #3" in order of appearance."""
    out, seen = {}, collections.Counter()
    for n in names:
        base = n.removeprefix("void ").split("<")[0].split("(")[0]
        seen[base] += 1
        out[n] = base if seen[base] == 1 else f"{base} #{seen[base]}"
    return out


def print_result(res: dict, roofline_us: float) -> None:
    print(f"\n{res['tokens']} tokens, layout {res['layout']} ({res['chain']} dispatches of {res['reps']} layers): "
          f"steady {res['steady_us']:.1f} µs/layer (marginal {res['marginal_us']:.1f}, "
          f"{res['stream_fixed_us']:.0f} µs once per stream), host enqueue {res['enqueue_us']:.1f}, GPU busy "
          f"{res['busy_us']:.1f}, span {res['span_us']:.1f}; start-up {res['startup_us']:.0f} µs per chain; "
          f"roofline / steady {100 * roofline_us / res['steady_us']:.1f} %, / marginal "
          f"{100 * roofline_us / res['marginal_us']:.1f} %, / busy {100 * roofline_us / res['busy_us']:.1f} %")
    print(f"  {'kernel':44s} {'/layer':>6s} {'µs':>8s} {'gap med':>8s} {'gap mean':>8s}")
    names = short_names([r["kernel"] for r in res["rows"]])
    for r in res["rows"]:
        print(f"  {names[r['kernel']][:44]:44s} {r['per_layer']:6.2f} {r['median_us']:8.1f} {r['gap_median_us']:8.2f} "
              f"{r['gap_mean_us']:8.2f}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0] if __doc__ else None
    p.add_argument("--tokens", default="32,128,4096", help="token counts (default 32,128,4096)")
    p.add_argument("--layout", default="fused",
                   help=f"comma list of {', '.join(LAYOUTS)}: fused (MoEConfig(layout='fused')), the same "
                        "routing before the fused op, or the staged path's layout; several run side by side per "
                        "token count, in the order given, repeats included (default fused)")
    p.add_argument("--reps", type=int, default=4, help="input sets per dispatch (default 4, as `layer`)")
    p.add_argument("--chain", type=int, default=8, help="dispatches back to back (default 8, as `layer`)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    p.set_defaults(func=run)


def run(args) -> int:
    from moe_jax.bench._cli import cannot_run, log, write_json
    from moe_jax.bench._timing import xla_copy_bandwidth
    from moe_jax.bench.gemm import gpu_reason

    if cannot_run("moe_jax.bench timeline", gpu_reason()):
        return 2
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        log(f"--tokens: expected comma-separated ints, got {args.tokens!r}")
        return 2
    if args.reps < 1 or args.chain < 1:
        log(f"--reps and --chain: expected >= 1, got {args.reps} and {args.chain}")
        return 2
    layouts = args.layout.split(",")
    if not layouts or set(layouts) - set(LAYOUTS):
        log(f"--layout: expected a comma list of {', '.join(LAYOUTS)}, got {args.layout!r}")
        return 2
    def weights_of(lay: str) -> str:  # the two fused forms share their weights
        return "fused" if lay.startswith("fused") else lay

    built = {w: setup(w) for w in dict.fromkeys(map(weights_of, layouts))}
    # in the order given, repeats included (A,B,A,B interleaves two forms against clock drift)
    results = [measure(m, lay, built[weights_of(lay)], reps=args.reps, chain=args.chain, log=log)
               for m in tokens for lay in layouts]
    bw = xla_copy_bandwidth(1 << 30)
    roofline_us = results[0]["weights_bytes"] / bw * 1e6
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; weights-once roofline {roofline_us:.1f} µs")
    for res in results:
        print_result(res, roofline_us)
    if args.json:
        write_json(args.json, dict(copy_GBps=bw / 1e9, roofline_us=roofline_us, results=results))
    return 0
