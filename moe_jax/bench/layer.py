"""``python -m moe_jax.bench layer``: the whole routed MoE layer, per stage and end to end.

Shapes (`SHAPES`): prefill = 4096 tokens and prefill16k = 16384 tokens, contig layout; decode32,
decode, decode512 = 32, 128, 512 tokens, masked layout (m_pad = tokens rounded up to 256); all with
the layer of `--model`: v3 (default) DeepSeek-V3's with 32 local experts (all of the model's), top-8
(sigmoid + correction bias, 8 groups of 4, top-4 groups), H 7168, I 2048, fp8_block weights; v4
DeepSeek-V4-Flash's with a slice of 32 experts, top-6 (sqrtsoftplus + correction bias), swiglu_limit
10, H 4096, I 2048, its MXFP4 experts expanded to fp8_block at load (arch 90 has no FP4 GEMM);
v4-256 the same with all 256 experts; v4-w4a8 and v4-256-w4a8 those with the experts kept 4-bit
(`MoEConfig.mxfp4_sm90_form="w4a8"`, the W4A8 grouped GEMMs; `--fused` skips them: the fused
layout runs FP8 experts). `--model` takes a comma list, measured one after the other in one run
(side by side). All on arch 90, the router gate in bf16 (as DeepSeek's
checkpoints ship it), no shared expert (its dense MLP is not part of the routed path measured here).
Backends: "auto" (Triton non-GEMM stages + DeepGEMM GEMMs on a supported GPU) and "reference" (pure
JAX through XLA).

Goals, printed first: prefill `moe_forward` including routing / its two GEMMs (<= 1.06) and decode
weights-once roofline / `moe_forward` including routing (>= 90 %), each from the steady-stream wall
time (the goal's measure), from the marginal cost per call of a running stream and from GPU kernel
time.

Method: fresh random inputs; every timing is a jitted function run over R distinct input sets in
one dispatch (inputs rotate so they are not L2-resident), 8 such dispatches back to back (the
host's start-up of a dispatch, before its first kernel, is then paid once per 8 R layers, as a
model's program would pay it once per step), wall time / 8 R, median of 5 rounds after a warm-up
(sustained clock): the steady stream a serving loop makes. "marginal" (`moe_forward` and the two
GEMMs, `_timing.time_stream`): the same stream and one three times as long, alternating; the
slope between them is what one more call adds to a running stream, and the rest of the stream's
time ("once per stream": the first dispatch's start-up, the final sync) is what the steady figure
spreads over its 8 R calls. At prefill the power cap moves the clock by more than a stream's fixed
cost, so there the two figures agree within the run-to-run spread and the fixed part is noise.
"burst": one input set in one dispatch
after 0.5 s of idle, median of 5: what a lone call after a pause costs (the host's dispatch start-up,
no overlap with the previous call, clocks ramping up). The reference backend runs one input set,
2 rounds. Stages are timed one by one on the layer's own intermediate tensors. End to end and
`moe_forward` also get their GPU kernel time (profiler trace: GEMMs, Triton kernels, the rest), which
holds no host time at all.
Error: ‖out − ref‖ / ‖ref‖ (and the worst row) against a float32 model of the same layer computed
on the routed (token, expert) pairs only (dequantized weights, unquantized activations, HIGHEST
precision dots); `--no-error` skips it. Peak temporary memory:
`jax.jit(...).lower(...).compile().memory_analysis().temp_size_in_bytes`, against the seed's goal:
the largest GEMM's activation inputs plus outputs, plus 25%.
Without a GPU the default is scaled shapes of prefill and decode (as `--small`; `--full` forces the
sizes above); on a GPU every shape of `SHAPES` runs unless `--shapes` says otherwise.
Implementations: before measuring a backend other than "reference", the layer is traced and the
backend registry says what each op resolved to; a backend that fell back to the reference for
every op (e.g. "auto" on a CPU) is labelled so, is not measured again when "reference" is, and gets
no speed-up or roofline figure (it would compare the reference's code with itself).
Output: the table on stdout; progress (one step per compile) and one JSON line per row on stderr;
`--json PATH` (every row: times in us, errors, memory in MB, implementations), `--plot PATH` (PNG).
Exit status 1 when a requested row failed (e.g. an explicit backend that cannot run here).

Shared experts (`--shared bf16,fp8,fused`): instead of the stage table, the whole layer (routing
included) with one shared expert, side by side: "bf16" the dense bf16 shared MLP, "fp8" the dense
FP8 shared MLP (e4m3 + 128x128 blocks through the dense GEMM op `gemm_nt`), "fused" the FP8 shared
expert appended to the routed grouped GEMMs (`MoEConfig.fuse_shared_experts`); prefill and decode
as above, per backend. Rows: the layer's time, the shared MLP's own time (dense variants), and the
output's relative difference to the bf16 variant's (the same weights before FP8 quantization) and to
the fp8 variant's (fused vs dense: the same numerics, so only rounding).
"""

from __future__ import annotations

import argparse

# The layer's parts, by file: layer_model (config, params, float32 model), layer_measure (one shape's
# rows), layer_shared (--shared), layer_report (goals, table, plot). tune.py and the tests import
# _config, _fp32_model, goals and print_table from here.
from moe_jax.bench._cli import (
    Progress,
    check_plot_available,
    exit_status,
    log,
    write_json,
)
from moe_jax.bench._timing import xla_copy_bandwidth
from moe_jax.bench.layer_measure import (
    FUSED_STEPS,
    STAGES,
    STEPS_PER_BACKEND,
    bench_shape,
)
from moe_jax.bench.layer_model import MODELS, _config, _fp32_model
from moe_jax.bench.layer_report import goals, plot, print_shared_table, print_table
from moe_jax.bench.layer_shared import SHARED_VARIANTS, STEPS_PER_VARIANT, bench_shared

__all__ = ["DEFAULT_SHAPES_NO_GPU", "MODELS", "SHAPES", "SHARED_VARIANTS", "STAGES", "_config", "_fp32_model",
           "add_arguments", "bench_shape", "bench_shared", "goals", "plot", "print_shared_table", "print_table",
           "run", "run_shared"]

# name: (tokens, layout, tokens at --small)
SHAPES = {"prefill": (4096, "contig", 64), "prefill16k": (16384, "contig", 128), "decode32": (32, "masked", 8),
          "decode": (128, "masked", 16), "decode512": (512, "masked", 32)}
DEFAULT_SHAPES_NO_GPU = ("prefill", "decode")


def run(args: argparse.Namespace) -> int:
    import jax

    if args.shared is not None:
        return run_shared(args)
    check_plot_available(args.plot)
    default = tuple(SHAPES) if jax.default_backend() == "gpu" else DEFAULT_SHAPES_NO_GPU
    backends, small, plan = _plan(args, default)
    models = _models(args.model)
    error = not args.no_error
    # 4-bit experts are widened to FP8 at each fused call: measured at the contig (prefill) shapes only
    fused = {(model, layout): args.fused and (layout == "contig" or not model.endswith("w4a8"))
             for model in models for _, _, layout in plan}
    steps = sum(1 + error + (STEPS_PER_BACKEND + FUSED_STEPS * fused[model, layout]) * len(backends)
                for model in models for _, _, layout in plan)
    progress = Progress("layer", total=steps + 1)
    results = [bench_shape(name, m, layout, backends, args.reps, small=small, error=error, progress=progress,
                           fused=fused[model, layout], model=model)
               for model in models for name, m, layout in plan]
    progress.step("copy bandwidth")
    bw = xla_copy_bandwidth(1 << 20 if small else 1 << 30)
    progress.close()
    device = _device()
    for model in models:
        print_table([r for r in results if r["model"] == model], backends, device, bw / 1e9, scaled=small,
                    model=model)
    if args.json:
        write_json(args.json, {"device": device, "jax": jax.__version__, "models": models, "backends": backends,
                               "copy_GBps": bw / 1e9, "scaled": small, "results": results})
    if args.plot:
        plot(args.plot, results, backends, device)
    return exit_status([f"{res['shape']} {be}" for res in results for be in backends if "error" in res.get(be, {})])


def run_shared(args: argparse.Namespace) -> int:
    """`--shared`: the shared-expert comparison (module docstring)."""
    import jax

    variants = [v for v in args.shared.split(",") if v]
    if not variants or set(variants) - set(SHARED_VARIANTS):
        raise SystemExit(f"--shared: expected a comma list of {', '.join(SHARED_VARIANTS)}, got {args.shared!r}")
    if args.plot:
        raise SystemExit("--plot: the stage plot is not drawn with --shared")
    backends, small, plan = _plan(args, DEFAULT_SHAPES_NO_GPU)
    progress = Progress("layer --shared", total=len(plan) * len(backends) * len(variants) * STEPS_PER_VARIANT)
    models = _models(args.model)
    if len(models) > 1:
        raise SystemExit("--shared: one --model at a time")
    results = [bench_shared(name, m, layout, variants, backends, args.reps, small=small, progress=progress,
                            model=models[0])
               for name, m, layout in plan]
    progress.close()
    device = _device()
    print_shared_table(results, variants, backends, device, small)
    if args.json:
        write_json(args.json, {"device": device, "jax": jax.__version__, "backends": backends, "shared": variants,
                               "scaled": small, "results": results})
    return exit_status([f"{r['shape']} {be} {v}" for r in results for be in backends for v in variants
                        if "error" in r[be][v]])


def _models(arg: str) -> list[str]:
    """--model: a comma list of `MODELS`, in the order given."""
    models = [m for m in arg.split(",") if m]
    if not models or set(models) - set(MODELS):
        raise SystemExit(f"--model: expected a comma list of {', '.join(MODELS)}, got {arg!r}")
    return models


def _device() -> str:
    import jax

    return str(jax.devices()[0].device_kind)


def _plan(args: argparse.Namespace,
          default_shapes: tuple[str, ...]) -> tuple[list[str], bool, list[tuple[str, int, str]]]:
    """--backends and --shapes (None: `default_shapes`) checked -> (backends, scaled sizes?,
    [(shape name, tokens, layout)] in `SHAPES` order)."""
    import jax

    backends = [b for b in args.backends.split(",") if b]
    if not backends:
        raise SystemExit("--backends: expected a comma list of backend names, got an empty list")
    shapes = [s for s in args.shapes.split(",") if s] if args.shapes is not None else list(default_shapes)
    if set(shapes) - set(SHAPES) or not shapes:
        raise SystemExit(f"--shapes: expected a comma list of {', '.join(SHAPES)}, got {args.shapes!r}")
    small = _small_shapes(args, jax.default_backend())
    return backends, small, [(s, SHAPES[s][2] if small else SHAPES[s][0], SHAPES[s][1]) for s in SHAPES
                             if s in shapes]


def _small_shapes(args: argparse.Namespace, platform: str) -> bool:
    """--small, --full, or by default: full sizes on a GPU, scaled shapes elsewhere (the DeepSeek-V3
    sizes take minutes and tens of GB of memory on a CPU), said on stderr."""
    if args.small or args.full:
        return args.small
    if platform == "gpu":
        return False
    log(f"moe_jax.bench layer: no GPU (jax platform {platform!r}): running scaled shapes, as --small does "
        f"(64 / 16 tokens, 16 experts, H 256, I 128); --full runs the DeepSeek-V3 sizes")
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0] if __doc__ else None
    parser.add_argument("--shapes", default=None,
                        help=f"comma list of {', '.join(SHAPES)} (default: all on a GPU, "
                             f"{','.join(DEFAULT_SHAPES_NO_GPU)} scaled elsewhere)")
    parser.add_argument("--model", default="v3",
                        help="comma list of layers, measured one after the other in this run: v3 (DeepSeek-V3, 32 "
                             "experts; default), v4 (DeepSeek-V4-Flash, a slice of 32 experts), v4-256 (V4-Flash, all "
                             "256 experts), v4-w4a8 / v4-256-w4a8 (those with the MXFP4 experts kept 4-bit: the W4A8 "
                             "GEMMs); see Shapes above")
    parser.add_argument("--backends", default="auto,reference",
                        help="comma list of backend names (default: auto,reference)")
    parser.add_argument("--reps", type=int, default=4,
                        help="distinct input sets per timed dispatch (default 4; the reference backend uses 1)")
    parser.add_argument("--json", metavar="PATH", help="write every result row as JSON here")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG here: stacked stage times per backend and shape")
    parser.add_argument("--fused", action="store_true",
                        help="also time the fused layout (the routed branch as one kernel, MoEConfig(layout="
                             "'fused')) beside each accelerated row, with its goal ratios; for the W4A8 models at the "
                             "prefill shapes only (their experts widened to FP8 at each call)")
    parser.add_argument("--no-error", action="store_true",
                        help="skip the float32 model and the error columns")
    parser.add_argument("--shared", metavar="LIST",
                        help=f"comma list of {', '.join(SHARED_VARIANTS)}: compare the layer with its shared expert "
                             "run that way (dense bf16, dense FP8, FP8 fused into the routed GEMMs) instead of the "
                             "stage table")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true",
                      help="scaled shapes: 64 / 16 tokens, 16 experts, H 256, I 128 (the default without a GPU)")
    size.add_argument("--full", action="store_true",
                      help="the DeepSeek-V3 sizes even without a GPU (the default on a GPU; minutes and tens of GB "
                           "of memory on a CPU)")
    parser.set_defaults(func=run)
