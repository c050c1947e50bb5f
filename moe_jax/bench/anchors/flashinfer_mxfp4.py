"""Anchor benchmark: FlashInfer's MXFP4 fused MoE on Hopper (SM90), outside moe_jax.

This is a standalone script. The moe_jax package never imports it (this folder has no
``__init__.py``), and it is the only place in the tree that imports torch. It times what SGLang
runs for DeepSeek-V4 MoE experts on H100/H200 through FlashInfer's CUTLASS fused-MoE op, so that
moe_jax's own numbers have an outside reference measured on the same card.

Modes (both are FlashInfer's SM90 mixed-input CUTLASS grouped GEMM, ``cutlass_fused_moe``):

* ``w4a16`` - MXFP4 weights (E2M1 codes + UE8M0 scales per 32 along K) x BF16 activations.
  Weights go through ``interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")`` and scales through
  ``interleave_moe_scales_for_sm90_mixed_gemm(s, group_size=32)``; the call passes
  ``use_w4_group_scaling=True`` and ``quant_scales=[w13_scales.view(int32), w2_scales.view(int32)]``.
  This is SGLang's DeepSeek W4A16 MoE method on SM90.
* ``w4a8`` - MXFP4 weights x FP8 E4M3 activations, the "Humming" path: the op takes BF16 input and
  quantizes activations to FP8 inside the fused MoE (online, per routed row); the weights are
  rewritten by ``preprocess_moe_weights_for_sm90_mixed_gemm_humming(w, s)`` which returns the
  interleaved payload, the folded E8M0 offset scales and one FP32 residual per expert. The call
  passes ``use_w4_group_scaling=True, use_wfp4afp8_humming=True`` and
  ``quant_scales=[w13_scales.view(int32), w13_residual * 64, fc2_act_global (=1.0, reserved),
  w2_scales.view(int32), w2_residual * 64]`` (64 = the fixed 2^6 epilogue compensation the
  FlashInfer docstring asks for). This is SGLang's MXFP4 x FP8 FlashInfer method on SM90. On SM90
  FlashInfer 0.7.2.post1 has no path that takes an already-FP8 input tensor with MXFP4 weights (that
  variant, ``isWMxfp4AFp8Quant``, is SM100+ only; its SM90 branch is compiled out).

Both use ``activation_type=ActivationType.Swiglu`` with per-expert ``swiglu_alpha=1``,
``swiglu_beta=0`` and ``swiglu_limit`` (DeepSeek-V4's clamp, 10.0 by default; ``--swiglu-limit 0``
passes none), which selects FlashInfer's SwigluBias epilogue: gate clamped to (-inf, limit], linear
clamped to [-limit, limit], out = silu(gate) * linear. ``tune_max_num_tokens`` is the next power of
two of the token count (as SGLang passes it), FlashInfer's autotuner picks the GEMM tactics once per
case (``flashinfer.autotune(True)`` around the first call; ``--no-autotune`` keeps the default
tactic), and a workspace from ``cutlass_fused_moe_workspace_size`` is allocated once and passed as
``workspace_buffer``.

Data: random E2M1 codes (uniform random bytes = two codes each), random UE8M0 scale bytes in
[118, 124] (2^-9 .. 2^-3), random bf16 activations (standard normal), random routing (top-k distinct
experts per token from softmax of normal logits, weights renormalised to sum 1). No checkpoint, no
accuracy check: this measures speed only (the output is checked to be finite and that is recorded).

Timing: after warm-up, ``--samples`` samples, each a loop of ``--iters`` calls between two
``torch.cuda.Event``s; the per-call time of each sample is kept and the median reported. Two
figures per case: ``graph`` (the loop of calls captured once in a CUDA graph and replayed, so host
launch overhead is out: kernel time) and ``eager`` (plain Python calls: includes FlashInfer's
host-side work whenever that is longer than the GPU work). The headline ``median_us`` is the graph
figure when capture works, else the eager one, and the JSON says which.

Effective weight bandwidth = bytes of the experts actually hit (distinct experts in the routing x
(w13 + w2 bytes: E2M1 codes at 4 bits + one UE8M0 byte per 32 values)) / median time. Activations,
routing and output bytes are not counted.

Written against flashinfer-python 0.7.2.post1 (PyPI); read in its wheel:
``flashinfer/fused_moe/core.py`` (``cutlass_fused_moe``, ``cutlass_fused_moe_workspace_size``,
``get_cutlass_fused_moe_module``), ``flashinfer/fused_moe/prepare.py`` (the interleave and Humming
helpers), ``flashinfer/fused_moe/runners.py`` (``CutlassW4A16Runner``, ``CutlassHummingRunner``:
quant_scales order and shapes), ``flashinfer/jit/fused_moe.py`` (``gen_cutlass_fused_moe_sm90_module``)
and ``data/csrc/fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu`` (the checks on
quant_scales). Other FlashInfer versions may differ; the version found is recorded.

The first call JIT-compiles FlashInfer's ``fused_moe_90`` module with nvcc and ninja: 248
translation units (220 generated CUTLASS kernel files + 28 fixed sources). Single units compiled
with nvcc 13.0 on a CPU host took 0.7 to 3 CPU-minutes each (about 2 on average), i.e. roughly 7 to
8 CPU-hours in all: about half an hour on 16 cores. The result is cached under
``~/.cache/flashinfer`` (``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer``; ninja resumes a killed
build where it stopped). ``--build-only`` does just that step. ``--mxfp4-only`` builds instead a
module with only the kernels the two modes can run, every tactic FlashInfer's autotuner enumerates
for them included (``flashinfer_sm90_mxfp4_build.py``: 48 units, 65 minutes on a 2-core CPU host),
and ``--prebuilt`` loads that module's ``.so`` from the cache without building, e.g. one built on
another host with the same FlashInfer and CUDA 13 (FlashInfer looks for it under
``.cache/flashinfer/0.7.2.post1/90a/cached_ops/fused_moe_90_mxfp4only/``; measured on one H100 this
way: BENCHMARKS.md). Any failure to import, build or run is caught and printed as one line
``flashinfer <mode>: unavailable: <ExceptionType>: <message>`` and the script still exits 0.

Run on the GPU machine (FlashInfer and its compiled dependency apache-tvm-ffi installed beside torch)::

    python3 -m pip install flashinfer-python==0.7.2.post1
    python3 moe_jax/bench/anchors/flashinfer_mxfp4.py \\
        --modes w4a16,w4a8 --tokens 128,4096 --experts 32 --json /tmp/flashinfer_mxfp4.json

(``--experts 256`` for the full expert set; ``MAX_JOBS=N`` in the environment caps the JIT build's
parallel nvcc jobs.) The build includes ``cublasLt.h``, ``curand_kernel.h`` and ``nvrtc.h`` and links
``-lnvrtc``. Where the CUDA toolkit in ``/usr/local/cuda`` lacks them but the pip packages
nvidia-cublas / nvidia-curand / nvidia-cuda-nvrtc (torch's own dependencies) are installed, point
FlashInfer at those first::

    NV=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
    mkdir -p /tmp/nvlib && ln -sf $NV/lib/libnvrtc.so.13 /tmp/nvlib/libnvrtc.so
    export FLASHINFER_EXTRA_CFLAGS="-isystem $NV/include" \\
        FLASHINFER_EXTRA_CUDAFLAGS="-isystem $NV/include" FLASHINFER_EXTRA_LDFLAGS="-L/tmp/nvlib"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

MODES = ("w4a16", "w4a8")
HUMMING_EPILOGUE_COMPENSATION = 64.0  # FlashInfer: residual scale includes a fixed 2^6
E2M1_PER_BYTE = 2
SCALE_GROUP = 32  # MXFP4: one UE8M0 scale per 32 values along K


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="w4a16,w4a8", help="comma list of: w4a16, w4a8")
    p.add_argument("--tokens", default="128,4096", help="comma list of token counts")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size H")
    p.add_argument("--intermediate", type=int, default=2048, help="expert intermediate size I")
    p.add_argument("--experts", type=int, default=32, help="local experts E (32 = an EP slice, 256 = all)")
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--swiglu-limit", type=float, default=10.0, help="SwiGLU clamp; <= 0 passes none")
    p.add_argument("--scale-min", type=int, default=118, help="smallest random UE8M0 scale byte")
    p.add_argument("--scale-max", type=int, default=124, help="largest random UE8M0 scale byte")
    p.add_argument("--warmup", type=int, default=10, help="warm-up calls per case")
    p.add_argument("--iters", type=int, default=20, help="calls per timed sample")
    p.add_argument("--samples", type=int, default=15, help="timed samples per case")
    p.add_argument("--timing", choices=("both", "graph", "eager"), default="both")
    p.add_argument("--no-autotune", action="store_true", help="keep FlashInfer's default tactics")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--build-only", action="store_true",
                   help="only JIT-build FlashInfer's SM90 fused-MoE module, then exit")
    p.add_argument("--mxfp4-only", action="store_true",
                   help="build the module with only the kernels the chosen modes can run "
                        "(flashinfer_sm90_mxfp4_build.py: 48 nvcc units instead of 248)")
    p.add_argument("--prebuilt", action="store_true",
                   help="with --mxfp4-only: load the module's .so from FlashInfer's cache without building it")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    a = p.parse_args(argv)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in a.modes if m not in MODES]
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {list(MODES)}")
    a.tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    if not a.tokens or min(a.tokens) < 1:
        p.error("--tokens needs positive integers")
    if not 0 <= a.scale_min <= a.scale_max <= 254:
        p.error("need 0 <= --scale-min <= --scale-max <= 254")
    if a.top_k > a.experts:
        p.error("--top-k larger than --experts")
    if a.hidden % 128 or a.intermediate % 128:
        p.error("FlashInfer's SM90 mixed-input path needs H and I divisible by 128")
    if min(a.iters, a.samples) < 1 or a.warmup < 0:
        p.error("--iters and --samples must be >= 1, --warmup >= 0")
    if a.prebuilt and not a.mxfp4_only:
        p.error("--prebuilt loads the module --mxfp4-only builds; pass both")
    return a


# --- reporting ----------------------------------------------------------------------------------

def _summary(exc: BaseException) -> str:
    """One line: the exception's message, or for a failed nvcc/ninja build its first error line."""
    msg = str(exc)
    if "Ninja build failed" in msg:
        lines = [ln.strip() for ln in msg.splitlines()]
        errs = [ln for ln in lines if "error" in ln.lower() and not ln.startswith("[")]
        if errs:
            msg = "Ninja build failed: " + errs[0]
    return " ".join(msg.split())[:300]


def unavailable(results: dict, mode: str, exc: BaseException, tokens: int | None = None) -> None:
    line = f"flashinfer {mode}: unavailable: {type(exc).__name__}: {_summary(exc)}"
    if tokens is not None:
        line += f" (tokens={tokens})"
    print(line, flush=True)
    detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    print(detail[-4000:], file=sys.stderr, flush=True)
    results["cases"].append(dict(mode=mode, tokens=tokens, status="unavailable",
                                 error_type=type(exc).__name__, error=_summary(exc),
                                 error_tail=str(exc)[-4000:]))


def write_json(path: str | None, results: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {path}", flush=True)


# --- weights, routing, inputs -------------------------------------------------------------------

def expert_bytes(hidden: int, inter: int) -> int:
    """Bytes of one expert's w13 ([2I, H]) and w2 ([H, I]): E2M1 codes plus UE8M0 scales."""
    w13 = 2 * inter * hidden
    w2 = hidden * inter
    return sum(n // E2M1_PER_BYTE + n // SCALE_GROUP for n in (w13, w2))


def random_mxfp4(torch, gen, experts: int, rows: int, cols: int, smin: int, smax: int, device):
    """[E, rows, cols/2] random code bytes and [E, rows, cols/32] random UE8M0 scale bytes."""
    codes = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, device=device, generator=gen)
    scales = torch.randint(smin, smax + 1, (experts, rows, cols // SCALE_GROUP), dtype=torch.uint8,
                           device=device, generator=gen)
    return codes, scales


def prepare_weights(torch, fmoe, mode: str, args, gen, device) -> dict:
    """Random MXFP4 experts in the byte layout the SM90 mixed-input kernel reads."""
    E, H, I = args.experts, args.hidden, args.intermediate
    out = {}
    for name, rows, cols in (("w13", 2 * I, H), ("w2", H, I)):
        if mode == "w4a16":
            codes, scales = random_mxfp4(torch, gen, E, rows, cols, args.scale_min, args.scale_max, device)
            out[name] = fmoe.interleave_moe_weights_for_sm90_mixed_gemm(codes, "fp4")
            out[name + "_scale"] = fmoe.interleave_moe_scales_for_sm90_mixed_gemm(scales, group_size=SCALE_GROUP)
            del codes, scales
        else:
            # The Humming rewrite expands every nibble to int64 indices: go a few experts at a time.
            parts = ([], [], [])
            step = 8
            for e0 in range(0, E, step):
                n = min(step, E - e0)
                codes, scales = random_mxfp4(torch, gen, n, rows, cols, args.scale_min, args.scale_max, device)
                w, s, r = fmoe.preprocess_moe_weights_for_sm90_mixed_gemm_humming(codes, scales)
                for acc, t in zip(parts, (w, s, r)):
                    acc.append(t)
                del codes, scales
            out[name] = torch.cat(parts[0]).contiguous()
            out[name + "_scale"] = torch.cat(parts[1]).contiguous()
            out[name + "_residual"] = (torch.cat(parts[2]).float() * HUMMING_EPILOGUE_COMPENSATION).contiguous()
        torch.cuda.synchronize()
    return out


def quant_scales(torch, mode: str, w: dict, device) -> list:
    if mode == "w4a16":
        return [w["w13_scale"].view(torch.int32), w["w2_scale"].view(torch.int32)]
    fc2_act_global = torch.ones((), dtype=torch.float32, device=device)  # reserved slot
    return [w["w13_scale"].view(torch.int32), w["w13_residual"], fc2_act_global,
            w["w2_scale"].view(torch.int32), w["w2_residual"]]


def random_routing(torch, gen, tokens: int, experts: int, top_k: int, device):
    logits = torch.randn(tokens, experts, dtype=torch.float32, device=device, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)  # distinct per token
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32).contiguous(), weights.to(torch.float32).contiguous()


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# --- timing -------------------------------------------------------------------------------------

def time_loop(torch, launch, iters: int, samples: int) -> list[float]:
    """Per-call microseconds of each sample: `launch()` runs `iters` calls (or one graph replay)."""
    out = []
    for _ in range(samples):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / iters)
    return out


def stats(us: list[float]) -> dict:
    s = sorted(us)
    return dict(median_us=statistics.median(s), min_us=s[0], max_us=s[-1], samples_us=s)


# --- one case -----------------------------------------------------------------------------------

def run_case(torch, flashinfer, fmoe, mode: str, tokens: int, w: dict, args, device) -> dict:
    E, H, I, K = args.experts, args.hidden, args.intermediate, args.top_k
    gen = torch.Generator(device=device).manual_seed(args.seed + 1000 + tokens)
    x = torch.randn(tokens, H, dtype=torch.float32, device=device, generator=gen).to(torch.bfloat16)
    ids, weights = random_routing(torch, gen, tokens, E, K, device)
    hit = int(torch.unique(ids).numel())
    out = torch.empty(tokens, H, dtype=torch.bfloat16, device=device)
    qs = quant_scales(torch, mode, w, device)
    humming = mode == "w4a8"
    swiglu = {}
    if args.swiglu_limit > 0:
        swiglu = dict(swiglu_alpha=torch.ones(E, dtype=torch.float32, device=device),
                      swiglu_beta=torch.zeros(E, dtype=torch.float32, device=device),
                      swiglu_limit=torch.full((E,), args.swiglu_limit, dtype=torch.float32, device=device))
    flags = dict(use_w4_group_scaling=True)
    if humming:
        flags["use_wfp4afp8_humming"] = True
    tune_max = next_pow2(tokens)

    workspace, ws_note = None, None
    try:
        ws_bytes = fmoe.cutlass_fused_moe_workspace_size(
            tune_max, H, I, E, K, x_dtype=torch.bfloat16, weight_dtype=torch.uint8,
            output_dtype=torch.bfloat16, device=device, **flags)
        workspace = torch.empty(int(ws_bytes), dtype=torch.uint8, device=device)
    except Exception as e:  # older FlashInfer or an unsupported combination: let the op allocate
        ws_note = f"{type(e).__name__}: {_summary(e)}"

    def call():
        kw = dict(swiglu, **flags)
        if workspace is not None:
            kw["workspace_buffer"] = workspace
        fmoe.cutlass_fused_moe(
            input=x, token_selected_experts=ids, token_final_scales=weights,
            fc1_expert_weights=w["w13"], fc2_expert_weights=w["w2"], output_dtype=torch.bfloat16,
            quant_scales=qs, activation_type=fmoe.ActivationType.Swiglu,
            tune_max_num_tokens=tune_max, output=out, **kw)

    rec = dict(mode=mode, tokens=tokens, status="ok", experts=E, hidden=H, intermediate=I, top_k=K,
               experts_hit=hit, swiglu_limit=args.swiglu_limit if args.swiglu_limit > 0 else None,
               tune_max_num_tokens=tune_max, workspace_buffer=workspace is not None,
               workspace_note=ws_note, iters_per_sample=args.iters)

    t0 = time.perf_counter()
    if args.no_autotune:
        call()
    else:
        with flashinfer.autotune(True):
            call()
    torch.cuda.synchronize()
    rec["autotuned"] = not args.no_autotune
    rec["first_call_s"] = round(time.perf_counter() - t0, 3)
    for _ in range(args.warmup):
        call()
    torch.cuda.synchronize()
    rec["output_finite"] = bool(torch.isfinite(out).all().item())

    if args.timing in ("both", "eager"):
        def eager():
            for _ in range(args.iters):
                call()
        rec["eager"] = stats(time_loop(torch, eager, args.iters, args.samples))
    if args.timing in ("both", "graph"):
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    call()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(args.iters):
                    call()
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            rec["graph"] = stats(time_loop(torch, graph.replay, args.iters, args.samples))
            del graph
        except Exception as e:
            rec["graph_error"] = f"{type(e).__name__}: {_summary(e)}"
            try:
                torch.cuda.synchronize()
            except Exception:  # the context may be unusable after a failed capture
                pass

    primary = "graph" if "graph" in rec else "eager"
    if primary not in rec:
        raise RuntimeError(f"no timing: CUDA graph capture failed ({rec.get('graph_error')}) and eager was off")
    rec["timing"] = primary
    rec["median_us"] = rec[primary]["median_us"]
    rec["weight_bytes_touched"] = hit * expert_bytes(H, I)
    rec["eff_weight_tb_s"] = rec["weight_bytes_touched"] / (rec["median_us"] * 1e-6) / 1e12
    return rec


def case_line(r: dict) -> str:
    s = (f"flashinfer {r['mode']} tokens={r['tokens']}: median {r['median_us']:.1f} us ({r['timing']}"
         + (f"; eager {r['eager']['median_us']:.1f} us" if r["timing"] == "graph" and "eager" in r else "")
         + f"), experts hit {r['experts_hit']}/{r['experts']}, weights {r['weight_bytes_touched'] / 1e6:.1f} MB"
         + f", eff. weight bandwidth {r['eff_weight_tb_s']:.2f} TB/s")
    if not r["output_finite"]:
        s += " [output not finite]"
    if "graph_error" in r:
        s += f" [graph capture failed: {r['graph_error'][:120]}]"
    return s


# --- main ---------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    results = dict(anchor="flashinfer_mxfp4", argv=sys.argv[1:] if argv is None else list(argv),
                   config=dict(hidden=args.hidden, intermediate=args.intermediate, experts=args.experts,
                               top_k=args.top_k, tokens=args.tokens, modes=args.modes,
                               swiglu_limit=args.swiglu_limit, scale_bytes=[args.scale_min, args.scale_max],
                               warmup=args.warmup, iters=args.iters, samples=args.samples,
                               timing=args.timing, autotune=not args.no_autotune, seed=args.seed),
                   meta=dict(python=platform.python_version()), cases=[])

    def all_unavailable(exc: BaseException) -> int:
        for mode in args.modes:
            unavailable(results, mode, exc)
        write_json(args.json, results)
        return 0

    try:
        import torch
        results["meta"].update(torch=torch.__version__, torch_cuda=torch.version.cuda)
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        device = torch.device("cuda", torch.cuda.current_device())
        cap = torch.cuda.get_device_capability(device)
        props = torch.cuda.get_device_properties(device)
        results["meta"].update(gpu=props.name, sm_count=props.multi_processor_count,
                               capability=f"{cap[0]}.{cap[1]}")
        if cap != (9, 0):
            raise RuntimeError(f"needs an SM90 GPU (H100/H200); found {props.name} sm_{cap[0]}{cap[1]}")
    except Exception as e:
        return all_unavailable(e)

    try:
        import flashinfer
        import flashinfer.fused_moe as fmoe
        from flashinfer.fused_moe.core import get_cutlass_fused_moe_module
        results["meta"]["flashinfer"] = getattr(flashinfer, "__version__", "unknown")
        results["meta"]["flashinfer_file"] = getattr(flashinfer, "__file__", None)
        if args.mxfp4_only:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import flashinfer_sm90_mxfp4_build as mxfp4_build

            name = mxfp4_build.install(modes=tuple({"w4a16": "w4a16", "w4a8": "humming"}[m] for m in args.modes),
                                       prebuilt=args.prebuilt)
            results["meta"].update(module=name, prebuilt=args.prebuilt)
        print(f"flashinfer {results['meta']['flashinfer']} on {props.name}; building/loading the SM90 "
              "fused-MoE module (first time: nvcc JIT, long)", flush=True)
        t0 = time.perf_counter()
        get_cutlass_fused_moe_module("90")
        results["meta"]["module_load_s"] = round(time.perf_counter() - t0, 1)
        print(f"{results['meta'].get('module', 'fused_moe_90')} module ready in {results['meta']['module_load_s']} s",
              flush=True)
    except Exception as e:
        return all_unavailable(e)
    if args.build_only:
        write_json(args.json, results)
        return 0

    for mode in args.modes:
        gen = torch.Generator(device=device).manual_seed(args.seed)
        try:
            t0 = time.perf_counter()
            w = prepare_weights(torch, fmoe, mode, args, gen, device)
            prep_s = round(time.perf_counter() - t0, 2)
        except Exception as e:
            unavailable(results, mode, e)
            torch.cuda.empty_cache()
            continue
        for tokens in args.tokens:
            try:
                rec = run_case(torch, flashinfer, fmoe, mode, tokens, w, args, device)
                rec["weight_prep_s"] = prep_s
                results["cases"].append(rec)
                print(case_line(rec), flush=True)
            except Exception as e:
                unavailable(results, mode, e, tokens)
        del w
        torch.cuda.empty_cache()

    ok = sum(c["status"] == "ok" for c in results["cases"])
    print(f"{ok} case(s) measured, {len(results['cases']) - ok} unavailable", flush=True)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
