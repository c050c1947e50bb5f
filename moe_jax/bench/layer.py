"""``python -m moe_jax.bench layer``: the whole routed MoE layer, per stage and end to end.

Shapes: prefill = 4096 tokens, contig layout; decode = 128 tokens, masked layout (m_pad 256);
both with 32 local experts (all of the model's), top-8 (sigmoid + correction bias, 8 groups of 4,
top-4 groups), H 7168, I 2048, fp8_block weights on arch 90, no shared expert (its dense MLP is
not part of the routed path measured here). Backends: "auto" (Triton non-GEMM stages + DeepGEMM
GEMMs on a supported GPU) and "reference" (pure JAX through XLA).

Method: fresh random inputs; every timing is a jitted function run over R distinct input sets in
one dispatch (inputs rotate so they are not L2-resident), wall time / R, median of 5 rounds after
a warm-up (sustained clock). Stages are timed one by one on the layer's own intermediate tensors.
Error: ‖out − ref‖ / ‖ref‖ (and the worst row) against a float32 model of the same layer
(dequantized weights, unquantized activations, HIGHEST precision dots). Peak temporary memory:
`jax.jit(...).lower(...).compile().memory_analysis().temp_size_in_bytes`, against the seed's goal:
the largest GEMM's activation inputs plus outputs, plus 25%.
Bars (BENCHMARKS.md): prefill end to end <= 1.15 x (GEMM1 + GEMM2); decode end to end >= 70% of the
HBM roofline for reading the expert weights once; >= 20 x the reference backend at prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable


def _time(fn: Callable, arg_sets: list[tuple], rounds: int = 5, chain: int = 3) -> float:
    """Seconds per call: `chain` dispatches of a jitted function over all argument sets, back to
    back (dispatch overlaps the GPU), one sync; median over `rounds`."""
    import jax

    many = jax.jit(lambda sets: [fn(*s) for s in sets])
    jax.block_until_ready(many(arg_sets))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = [many(arg_sets) for _ in range(chain)]
        jax.block_until_ready(outs)
        del outs
        times.append((time.perf_counter() - t0) / (chain * len(arg_sets)))
    return statistics.median(times)


def _config(small: bool = False):
    from moe_jax.config import MoEConfig

    cfg = MoEConfig.deepseek_v3(num_experts=32, n_shared_experts=0, n_group=8, topk_group=4,
                                recipe="fp8_block", arch=90)
    if small:  # a smoke-test size for machines without a GPU
        cfg = cfg.scaled(num_experts=16, hidden_size=256, intermediate_size=128, top_k=4)
    return cfg


def _fp32_model(x, topk_ids, topk_weights, params, config):
    """Float32 routed output: dequantized weights, unquantized activations, per-expert dense dots."""
    import jax
    import jax.numpy as jnp

    from custom_calls.activation import gated_activation
    from custom_calls.grouped_gemm import dequantize_rhs
    from moe_jax.core import activation_spec

    hi = jax.lax.Precision.HIGHEST
    w13 = dequantize_rhs(params.w13, params.w13_scale, params.gemm_recipe, params.gemm_arch)
    w2 = dequantize_rhs(params.w2, params.w2_scale, params.gemm_recipe, params.gemm_arch)
    xf = x.astype(jnp.float32)
    act = activation_spec(config)

    def one_expert(acc, e):
        h = jnp.einsum("mk,nk->mn", xf, w13[e], precision=hi)
        y = jnp.einsum("mi,hi->mh", gated_activation(h, act), w2[e], precision=hi)
        w = jnp.sum(jnp.where(topk_ids == e, topk_weights, 0.0), axis=1)
        return acc + w[:, None] * y, None

    out, _ = jax.lax.scan(one_expert, jnp.zeros(x.shape, jnp.float32), jnp.arange(w13.shape[0]))
    return out * config.routed_scaling_factor


def _errors(out, ref) -> dict:
    import jax.numpy as jnp

    d = out.astype(jnp.float32) - ref
    rows = jnp.linalg.norm(d, axis=-1) / jnp.maximum(jnp.linalg.norm(ref, axis=-1), 1e-30)
    return dict(rel_err=float(jnp.linalg.norm(d) / jnp.linalg.norm(ref)), worst_row=float(rows.max()))


def _gemm_activation_bytes(rows: int, h: int, inter: int) -> int:
    """Activation bytes in + out of the larger grouped GEMM (weights are arguments, not temporaries):
    GEMM1 reads e4m3 (rows, H) + fp32 scales and writes bf16 (rows, 2I); GEMM2 reads e4m3 (rows, I)
    + scales and writes bf16 (rows, H)."""
    gemm1 = rows * h + 4 * rows * (h // 128) + rows * 2 * inter * 2
    gemm2 = rows * inter + 4 * rows * (inter // 128) + rows * h * 2
    return max(gemm1, gemm2)


def _weight_bytes(params) -> int:
    return sum(a.size * a.dtype.itemsize for a in (params.w13, params.w13_scale, params.w2, params.w2_scale))


def bench_shape(name: str, m: int, layout: str, backends: list[str], reps: int, log,
                small: bool = False) -> dict:
    import jax
    import jax.numpy as jnp

    from custom_calls.activation import activation_quant_contig, activation_quant_masked
    from custom_calls.grouped_gemm import m_grouped_gemm_contig, m_grouped_gemm_masked
    from custom_calls.permute import permute_contig, permute_masked
    from custom_calls.unpermute import unpermute
    from moe_jax.core import activation_spec
    from moe_jax.dispatch import default_masked_m_pad, dispatch_contig, dispatch_masked
    from moe_jax.layer import moe_forward, routed_experts
    from moe_jax.params import init_params, prepare_params
    from moe_jax.routing import route

    t_start = time.perf_counter()

    def progress(what: str) -> None:
        log(f"  [{name} {time.perf_counter() - t_start:6.1f} s] {what}")

    cfg = _config(small)
    params = prepare_params(init_params(jax.random.PRNGKey(0), cfg), cfg)
    jax.block_until_ready(params.w13)
    progress("parameters ready")
    e, h, k = cfg.num_experts, cfg.hidden_size, cfg.top_k
    recipe, arch, act = params.gemm_recipe, params.gemm_arch, activation_spec(cfg)
    keys = jax.random.split(jax.random.PRNGKey(1), reps)
    xs = [jax.random.normal(kk, (m, h), jnp.bfloat16) for kk in keys]
    routed = [route(x, params, cfg) for x in xs]
    result = dict(shape=name, tokens=m, layout=layout, weights_GB=_weight_bytes(params) / 1e9)

    def forward(backend):
        return lambda x, ids, w: routed_experts(x, ids, w, params, cfg, layout=layout, backend=backend)

    ref32 = jax.block_until_ready(jax.jit(lambda x, i, w: _fp32_model(x, i, w, params, cfg))(xs[0], *routed[0]))
    progress("float32 model done")
    m_pad = default_masked_m_pad(m)
    for be in backends:
        row = dict(backend=be)
        try:
            f = forward(be)
            slow = be == "reference"
            row["end_to_end_us"] = _time(f, [(x, *r) for x, r in zip(xs, routed)],
                                         rounds=2 if slow else 5, chain=1 if slow else 3) * 1e6
            row["with_routing_us"] = _time(lambda x: moe_forward(x, params, cfg, layout=layout, backend=be),
                                           [(x,) for x in xs], rounds=2 if slow else 5, chain=1 if slow else 3) * 1e6
            out = jax.jit(f)(xs[0], *routed[0])
            row.update(_errors(out, ref32))
            other = "masked" if layout == "contig" else "contig"
            out_other = jax.jit(lambda x, i, w: routed_experts(x, i, w, params, cfg, layout=other, backend=be))(
                xs[0], *routed[0])
            row[f"vs_{other}_rel"] = _errors(out, out_other.astype(jnp.float32))["rel_err"]
            progress(f"{be}: end to end {row['end_to_end_us']:.1f} us, rel err {row['rel_err']:.2e}")
            compiled = jax.jit(f).lower(xs[0], *routed[0]).compile()
            mem = compiled.memory_analysis()
            row["temp_MB"] = getattr(mem, "temp_size_in_bytes", float("nan")) / 1e6
            # stage by stage on the layer's own tensors
            stages = {}
            stages["route (gate GEMM + top-k)"] = _time(lambda x: route(x, params, cfg), [(x,) for x in xs])
            if layout == "contig":
                disp = [dispatch_contig(i, num_local_experts=e, alignment=cfg.alignment) for i, _ in routed]
                rows = disp[0].num_rows_cap
                stages["dispatch (jnp)"] = _time(lambda i: dispatch_contig(i, num_local_experts=e,
                                                                           alignment=cfg.alignment),
                                                 [(i,) for i, _ in routed])
                perm = lambda x, s: permute_contig(x, s, num_rows=rows, recipe=recipe, arch=arch, backend=be)  # noqa: E731
                lhs = [perm(x, d.src2dst) for x, d in zip(xs, disp)]
                stages["permute+quant"] = _time(perm, [(x, d.src2dst) for x, d in zip(xs, disp)])
                g1 = lambda a, s, mi: m_grouped_gemm_contig(a, params.w13, mi, lhs_scale=s, rhs_scale=params.w13_scale,  # noqa: E731
                                                            recipe=recipe, arch=arch, alignment=cfg.alignment, backend=be)
                gu = [g1(a, s, d.m_indices) for (a, s), d in zip(lhs, disp)]
                stages["GEMM1"] = _time(g1, [(a, s, d.m_indices) for (a, s), d in zip(lhs, disp)])
                del lhs
                aq = lambda g: activation_quant_contig(g, act=act, recipe=recipe, arch=arch, backend=be)  # noqa: E731
                acts = [aq(g) for g in gu]
                stages["activation+quant"] = _time(aq, [(g,) for g in gu])
                del gu
                g2 = lambda a, s, mi: m_grouped_gemm_contig(a, params.w2, mi, lhs_scale=s, rhs_scale=params.w2_scale,  # noqa: E731
                                                            recipe=recipe, arch=arch, alignment=cfg.alignment, backend=be)
                ds = [g2(a, s, d.m_indices) for (a, s), d in zip(acts, disp)]
                stages["GEMM2"] = _time(g2, [(a, s, d.m_indices) for (a, s), d in zip(acts, disp)])
                gemm_in_out = _gemm_activation_bytes(rows, h, cfg.intermediate_size)
            else:
                disp = [dispatch_masked(i, num_local_experts=e, m_pad=m_pad, num_experts_global=e) for i, _ in routed]
                stages["dispatch (jnp)"] = _time(lambda i: dispatch_masked(i, num_local_experts=e, m_pad=m_pad,
                                                                           num_experts_global=e),
                                                 [(i,) for i, _ in routed])
                perm = lambda x, s: permute_masked(x, s, num_groups=e, m_pad=m_pad, recipe=recipe, arch=arch, backend=be)  # noqa: E731
                lhs = [perm(x, d.src2dst) for x, d in zip(xs, disp)]
                stages["permute+quant"] = _time(perm, [(x, d.src2dst) for x, d in zip(xs, disp)])
                em = disp[0].expected_m
                g1 = lambda a, s, mm: m_grouped_gemm_masked(a, params.w13, mm, expected_m=em, lhs_scale=s,  # noqa: E731
                                                            rhs_scale=params.w13_scale, recipe=recipe, arch=arch, backend=be)
                gu = [g1(a, s, d.masked_m) for (a, s), d in zip(lhs, disp)]
                stages["GEMM1"] = _time(g1, [(a, s, d.masked_m) for (a, s), d in zip(lhs, disp)])
                aq = lambda g, mm: activation_quant_masked(g, mm, act=act, recipe=recipe, arch=arch, backend=be)  # noqa: E731
                acts = [aq(g, d.masked_m) for g, d in zip(gu, disp)]
                stages["activation+quant"] = _time(aq, [(g, d.masked_m) for g, d in zip(gu, disp)])
                g2 = lambda a, s, mm: m_grouped_gemm_masked(a, params.w2, mm, expected_m=em, lhs_scale=s,  # noqa: E731
                                                            rhs_scale=params.w2_scale, recipe=recipe, arch=arch, backend=be)
                ds = [g2(a, s, d.masked_m).reshape(e * m_pad, h) for (a, s), d in zip(acts, disp)]
                stages["GEMM2"] = _time(g2, [(a, s, d.masked_m) for (a, s), d in zip(acts, disp)])
                gemm_in_out = _gemm_activation_bytes(e * m_pad, h, cfg.intermediate_size)
            stages["unpermute"] = _time(
                lambda d, s, w: unpermute(d, s, w, routed_scaling_factor=cfg.routed_scaling_factor, backend=be),
                [(d, dd.src2dst, w) for d, dd, (_, w) in zip(ds, disp, routed)])
            row["stages_us"] = {s: t * 1e6 for s, t in stages.items()}
            progress(f"{be}: stages done")
            gemms = stages["GEMM1"] + stages["GEMM2"]
            row["gemms_us"] = gemms * 1e6
            row["e2e_over_gemms"] = row["end_to_end_us"] / row["gemms_us"]
            row["temp_bound_MB"] = 1.25 * gemm_in_out / 1e6
        except Exception as exc:  # report and go on with the other backends
            row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        result[be] = row
        log(json.dumps(dict(shape=name, **row)))
    return result


def run(args) -> int:
    import jax

    log = print
    results = []
    backends = args.backends.split(",")
    if "prefill" in args.shapes:
        results.append(bench_shape("prefill", 64 if args.small else 4096, "contig", backends, args.reps, log,
                                   args.small))
    if "decode" in args.shapes:
        results.append(bench_shape("decode", 16 if args.small else 128, "masked", backends, args.reps, log,
                                   args.small))
    bw = _copy_bandwidth(1 << 20 if args.small else 1 << 30)
    print(f"\ndevice {jax.devices()[0].device_kind}; copy bandwidth {bw / 1e9:.0f} GB/s")
    for res in results:
        print(f"\n== {res['shape']}: {res['tokens']} tokens, {res['layout']}, weights {res['weights_GB']:.2f} GB")
        for be in backends:
            row = res.get(be, {})
            if "error" in row:
                print(f"  {be}: FAILED {row['error']}")
                continue
            print(f"  {be}: end to end {row['end_to_end_us']:.1f} us (with routing {row['with_routing_us']:.1f} us), "
                  f"GEMMs {row['gemms_us']:.1f} us "
                  f"(e2e/GEMMs {row['e2e_over_gemms']:.3f}), rel err {row['rel_err']:.2e} "
                  f"(worst row {row['worst_row']:.2e}), contig vs masked {row.get('vs_masked_rel', row.get('vs_contig_rel')):.1e}, "
                  f"temp {row['temp_MB']:.0f} MB "
                  f"(bound {row['temp_bound_MB']:.0f} MB)")
            for s, t in row["stages_us"].items():
                print(f"      {s:28s} {t:10.1f} us")
        if res["shape"] == "decode" and "auto" in res and "end_to_end_us" in res["auto"]:
            roof = res["weights_GB"] * 1e9 / bw * 1e6
            print(f"  decode roofline (weights once at copy bandwidth) {roof:.1f} us -> "
                  f"{100 * roof / res['auto']['end_to_end_us']:.0f}% of roofline")
        if "auto" in res and "reference" in res and "end_to_end_us" in res["auto"] and "end_to_end_us" in res["reference"]:
            print(f"  auto vs reference: {res['reference']['end_to_end_us'] / res['auto']['end_to_end_us']:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_GBps=bw / 1e9, results=results), f, indent=1)
    return 0


def _copy_bandwidth(n: int) -> float:
    import jax
    import jax.numpy as jnp

    x = [jax.random.normal(jax.random.PRNGKey(i), (n,), jnp.bfloat16) for i in range(2)]
    return 2 * x[0].size * 2 / _time(lambda a: -a, [(a,) for a in x])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default="prefill,decode", help="comma list of prefill, decode")
    parser.add_argument("--backends", default="auto,reference", help="comma list of backend names")
    parser.add_argument("--reps", type=int, default=4, help="distinct input sets per timed dispatch")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--small", action="store_true", help="tiny sizes (smoke test without a GPU)")
    parser.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_jax.bench layer", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
