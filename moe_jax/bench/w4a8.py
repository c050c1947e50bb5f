"""``python -m moe_jax.bench w4a8``: the W4A8 grouped GEMMs (MXFP4 experts kept 4-bit) at DeepSeek-V4-Flash's
32-expert slice, the CUDA kernel's tilings side by side with DeepGEMM's FP8 kernel on the FP4 -> FP8
expansion of the same weights and with the Triton W4A8 kernel; masked (decode, the default) or contig
(``--layout contig``: prefill).

Shapes: GEMM1 (N = 2 I, K = H) and GEMM2 (N = H, K = I) of the V4 config, 32 experts, m_pad 128,
expected_m = tokens x top-k / 32 rounded up (`moe_jax.dispatch.expected_m`, the layer's own hint).
Rows per expert (``--rows``): ``layer``, the benchmark layer's own routing of its decode inputs
(`layer_measure.layer_routes`: `layer_inputs`' routes without building the experts; one timed row set per
input set; what ``bench layer --model v4-w4a8 --shapes decode`` runs), or ``uniform``, one multinomial draw
of tokens x top-k routes over the experts (seed 0). Random MXFP4 weights (codes uniform, 32-group scales
2^-10..2^-5) and tokens (standard normal, quantized 1 x 128). Kernel time (profiler trace): the mean over
``--iters`` calls on each row set, in ``--passes`` passes over every kernel; TB/s on the weight bytes each
form stores (values + scales); "x FP8" is DeepGEMM's time over the row's, pass by pass; "diff" the largest
difference to DeepGEMM's output over the rows below masked_m (accumulation order only: both compute on the
same e4m3 values and block scales). Contig: ``--prefill-tokens`` x top-k routes in one uniform draw, each
expert's rows aligned to 128 (the layer's contig layout), the CUDA tilings of ``--contig-configs`` and the
persistent contig kernel (`custom_calls.cuda.w4a8_contig_rs`) at each of ``--rs-configs``, and the
"w4a8" contig op by expansion (`KernelSettings(w4a8_prefill="expand")`: the 4-bit weights widened to FP8 in
memory by `custom_calls.triton.w4a8_expand_kernel`, then DeepGEMM's FP8 GEMM), both timed; TFLOPS on the
real rows instead of TB/s.

Needs an SM90 GPU (exits with status 2 elsewhere). Table on stdout, progress on stderr; ``--json PATH``
writes the rows.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

NUM_EXPERTS, M_PAD = 32, 128
ALIGNMENT = 128  # contig: each expert's rows padded to a multiple of this (the layer's alignment)


def parse_configs(text: str) -> list:
    """``"4,1,4,4;4,2,4,2"`` -> W4A8CudaConfig(token_tiles, warpgroups, stages, min_blocks) per item."""
    from custom_calls.cuda.w4a8_gemm import W4A8CudaConfig

    configs = []
    for item in (t.strip() for t in text.split(";") if t.strip()):
        try:
            t, wg, s, b = (int(v) for v in item.split(","))
        except ValueError:
            raise ValueError(f"--configs: expected 'token_tiles,warpgroups,stages,min_blocks' items separated by "
                             f"';', got {item!r}") from None
        configs.append(W4A8CudaConfig(token_tiles=t, warpgroups=wg, stages=s, min_blocks=b))
    if not configs:
        raise ValueError(f"--configs: expected at least one config, got {text!r}")
    return configs


def parse_rs_configs(text: str) -> tuple:
    """'6;6,inline' -> (W4A8RsConfig(6), W4A8RsConfig(6, ahead=False))."""
    from custom_calls.cuda.w4a8_contig_rs import W4A8RsConfig

    configs = []
    for item in (t.strip() for t in text.split(";") if t.strip()):
        stages, _, widen = item.partition(",")
        try:
            if widen.strip() not in ("", "inline"):
                raise ValueError(f"the second field is 'inline' or absent, got {widen.strip()!r}")
            configs.append(W4A8RsConfig(int(stages), ahead=widen.strip() != "inline"))
        except ValueError as exc:
            raise ValueError(f"--rs-configs: expected 'stages[,inline]' items separated by ';', got {item!r}: "
                             f"{exc}") from None
    return tuple(configs)


def uniform_rows(tokens: int, top_k: int, seed: int = 0, cap: int = M_PAD):
    """(NUM_EXPERTS,) int32 rows per expert: one multinomial draw of tokens x top_k routes, capped at `cap`."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return np.minimum(rng.multinomial(tokens * top_k, np.full(NUM_EXPERTS, 1 / NUM_EXPERTS)), cap).astype(np.int32)


def contig_indices(rows, alignment: int = 128):
    """Rows per expert -> m_indices (M_cap,) int32 of the contig layout: expert e's rows, then -1 up to the
    next multiple of `alignment`."""
    import numpy as np

    segments = [np.where(np.arange(-(-int(r) // alignment) * alignment) < r, e, -1) for e, r in enumerate(rows)]
    return np.concatenate(segments).astype(np.int32)


def layer_rows(tokens: int) -> list:
    """Rows per expert of each of the benchmark layer's decode input sets (its own router), capped at M_PAD."""
    import numpy as np

    from moe_jax.bench.layer_measure import layer_routes, rows_per_expert

    routes = layer_routes(tokens, 4, False, "v4-w4a8")
    sets = rows_per_expert([ids for ids, _ in routes], NUM_EXPERTS)["sets"]
    return [np.minimum(np.asarray(c), M_PAD).astype(np.int32) for c in sets]


def _operands(n: int, k: int, seed: int, x_shape: tuple, real=None):
    """Random MXFP4 weights in both forms and tokens of `x_shape` (rows where `real` is False: zeros)
    quantized for each: {"fp8": (a, sa, w8, s8), "w4a8": (a in the W4A8 column order, sa, w4, s4)}."""
    import jax.numpy as jnp
    import numpy as np

    from layouts import gemm_format, mxfp4_to_fp8_block
    from layouts.fp4 import pack_e2m1
    from layouts.w4a8 import mxfp4_to_w4a8, to_w4a8_lhs_order

    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (NUM_EXPERTS, n, k), dtype=np.uint8)
    sf32 = jnp.asarray((2.0 ** rng.integers(-10, -4, (NUM_EXPERTS, n, k // 32))).astype(np.float32))
    packed = pack_e2m1(jnp.asarray(codes))
    x = rng.standard_normal(x_shape).astype(np.float32)
    if real is not None:
        x *= np.asarray(real, np.float32)[:, None]
    a8, sa = gemm_format("fp8_block", 90).quantize_lhs(jnp.asarray(x))
    a4 = to_w4a8_lhs_order(a8)  # the W4A8 format's lhs: the same bytes, its column order
    return {"fp8": (a8, sa, *mxfp4_to_fp8_block(packed, sf32)), "w4a8": (a4, sa, *mxfp4_to_w4a8(packed, sf32))}


def _kernels(configs: list, expected_m: int, contig: bool = False, rs_configs: tuple = ()) -> dict:
    """label -> (fn(a, sa, w, s, masked_m | m_indices), weight form "fp8" | "w4a8"); contig: also the
    persistent kernel at each of `rs_configs`."""
    from custom_calls.cuda.w4a8_contig_rs import w4a8_contig_rs
    from custom_calls.cuda.w4a8_gemm import w4a8_contig_cuda, w4a8_masked_cuda
    from custom_calls.grouped_gemm import m_grouped_gemm_contig, m_grouped_gemm_masked
    from custom_calls.triton.w4a8_gemm_kernel import w4a8_contig, w4a8_masked

    if contig:
        def fp8(a, sa, w, s, mi):
            return m_grouped_gemm_contig(a, w, mi, lhs_scale=sa, rhs_scale=s, recipe="fp8_block", arch=90,
                                         alignment=ALIGNMENT, backend="deep_gemm", assume_canonical=True)

        def cuda(cfg):
            return lambda a, sa, w, s, mi: w4a8_contig_cuda(a, sa, w, s, mi, alignment=ALIGNMENT, config=cfg)

        def triton(a, sa, w, s, mi):
            return w4a8_contig(a, sa, w, s, mi, alignment=ALIGNMENT)
    else:
        def fp8(a, sa, w, s, mm):
            return m_grouped_gemm_masked(a, w, mm, expected_m=expected_m, lhs_scale=sa, rhs_scale=s,
                                         recipe="fp8_block", arch=90, backend="deep_gemm")

        def cuda(cfg):
            return lambda a, sa, w, s, mm: w4a8_masked_cuda(a, sa, w, s, mm, expected_m=expected_m, config=cfg)

        def triton(a, sa, w, s, mm):
            return w4a8_masked(a, sa, w, s, mm, expected_m=expected_m)

    out = {"deep_gemm fp8 (FP4->FP8)": (fp8, "fp8"), "triton w4a8": (triton, "w4a8")}
    if contig:
        from custom_calls import KernelSettings

        def expand_then_fp8(a, sa, w, s, mi):  # the "w4a8" contig op by expansion, as the layer runs it
            return m_grouped_gemm_contig(a, w, mi, lhs_scale=sa, rhs_scale=s, recipe="mxfp4", arch=90,
                                         alignment=ALIGNMENT, lhs_order="w4a8", backend="w4a8", assume_canonical=True,
                                         settings=KernelSettings(w4a8_prefill="expand"))

        out["expand + deep_gemm fp8"] = (expand_then_fp8, "w4a8")
    for cfg in configs:
        out[f"cuda t{cfg.token_tiles} wg{cfg.warpgroups} s{cfg.stages} b{cfg.min_blocks}"] = (cuda(cfg), "w4a8")
    for rs_cfg in rs_configs if contig else ():
        out[f"cuda rs s{rs_cfg.stages}{'' if rs_cfg.ahead else ' inline'}"] = (
            lambda a, sa, w, s, mi, c=rs_cfg: w4a8_contig_rs(a, sa, w, s, mi, alignment=ALIGNMENT, config=c), "w4a8")
    return out


def sweep(name: str, n: int, k: int, rows: list, configs: list, expected_m: int, *, passes: int, iters: int,
          log, contig: bool = False, rs_configs: tuple = ()) -> list[dict]:
    """Rows of one GEMM shape: every kernel on every row set (masked_m per set; contig: one m_indices),
    `passes` passes."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from moe_jax.bench._timing import device_time

    if contig:
        (m_indices,) = rows
        operands = _operands(n, k, n + k, (m_indices.size, k), m_indices >= 0)
        valid = [m_indices >= 0]
    else:
        operands = _operands(n, k, n + k, (NUM_EXPERTS, M_PAD, k))
        valid = [np.arange(M_PAD)[None, :] < mm[:, None] for mm in rows]
    real_rows = sum(int(v.sum()) for v in valid)
    kernels = _kernels(configs, expected_m, contig, rs_configs)
    by_form = {form: [(*ops, jnp.asarray(idx)) for idx in rows] for form, ops in operands.items()}
    want = [np.asarray(jax.jit(kernels["deep_gemm fp8 (FP4->FP8)"][0])(*s), np.float32) for s in by_form["fp8"]]
    diffs = {}
    for label, (fn, form) in kernels.items():
        log(f"{name}: {label}: output")
        outs = [np.asarray(jax.jit(fn)(*s), np.float32) for s in by_form[form]]
        diffs[label] = max(float(np.abs(o[v] - w_[v]).max()) for o, w_, v in zip(outs, want, valid))
    times: dict[str, list[float]] = {label: [] for label in kernels}
    for p in range(passes):
        for label, (fn, form) in kernels.items():
            log(f"{name}: {label}: pass {p + 1}")
            times[label].append(device_time(fn, by_form[form], rounds=iters)["total"])
    fp8 = times["deep_gemm fp8 (FP4->FP8)"]
    out = []
    for label, (_, form) in kernels.items():
        wbytes = sum(x.nbytes for x in operands[form][2:])
        out.append(dict(gemm=name, n=n, k=k, kernel=label, us=[t * 1e6 for t in times[label]],
                        tb_s=[wbytes / t / 1e12 for t in times[label]],
                        tflops=[2.0 * real_rows * n * k / len(rows) / t / 1e12 for t in times[label]],
                        x_fp8=[f / t for f, t in zip(fp8, times[label])], max_diff=diffs[label]))
    return out


def print_table(rows: list[dict], row_sets: list, tile: int, contig: bool = False) -> None:
    """tile: the token rows of one block of the kernel's heuristic config (an expert past it is read twice).
    contig: TFLOPS on the real rows instead of TB/s."""
    print("rows per expert: " + " | ".join(f"{int(r.min())}-{int(r.max())} (mean {r.mean():.1f}, "
                                           f"{int((r > tile).sum())} past {tile})" for r in row_sets))
    rate, unit, digits = ("tflops", "TFLOPS", 0) if contig else ("tb_s", "TB/s", 2)
    print(f"{'GEMM':6s} {'kernel':28s} {'us per pass':>22s} {unit:>12s} {'x FP8':>12s} {'diff':>9s}")
    for r in rows:
        print(f"{r['gemm']:6s} {r['kernel']:28s} {' / '.join(f'{v:.1f}' for v in r['us']):>22s} "
              f"{' / '.join(f'{v:.{digits}f}' for v in r[rate]):>12s} "
              f"{' / '.join(f'{v:.3f}' for v in r['x_fp8']):>12s} {r['max_diff']:9.2e}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0] if __doc__ else None
    p.add_argument("--configs", default="4,1,4,4;4,2,4,2", metavar="LIST",
                   help="CUDA kernel tilings, 'token_tiles,warpgroups,stages,min_blocks' separated by ';' "
                        "(default '4,1,4,4;4,2,4,2': the default and two warp groups per block)")
    p.add_argument("--layout", choices=("masked", "contig"), default="masked",
                   help="masked (decode, default) or contig (prefill)")
    p.add_argument("--contig-configs", default="8,1,4,2", metavar="LIST",
                   help="CUDA contig tilings, as --configs (default '8,1,4,2', the layer's)")
    p.add_argument("--rs-configs", default="6", metavar="LIST",
                   help="contig: persistent register-operand kernel configs 'stages[,inline]' (inline: each K block "
                        "widened just before its MMA), ';'-separated (default '6'; '' for none)")
    p.add_argument("--prefill-tokens", type=int, default=4096, help="contig tokens (default 4096)")
    p.add_argument("--rows", choices=("layer", "uniform"), default="layer",
                   help="rows per expert: the benchmark layer's own routing (default) or one uniform draw")
    p.add_argument("--tokens", type=int, default=128, help="decode tokens (default 128)")
    p.add_argument("--passes", type=int, default=2, help="passes over every kernel (default 2)")
    p.add_argument("--iters", type=int, default=20, help="calls per kernel, row set and pass (default 20)")
    p.add_argument("--json", metavar="PATH", help="write every row as JSON here")
    p.set_defaults(func=run)


def run(args) -> int:
    from moe_jax.bench._cli import cannot_run, log, write_json
    from moe_jax.bench.gemm import gpu_reason

    contig = args.layout == "contig"
    try:
        configs = parse_configs(args.contig_configs if contig else args.configs)
        rs_configs = parse_rs_configs(args.rs_configs)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if cannot_run("moe_jax.bench w4a8", gpu_reason()):
        return 2
    import jax

    from custom_calls.cuda.w4a8_gemm import heuristic_config
    from moe_jax.bench.layer_model import _config
    from moe_jax.dispatch import expected_m as dispatch_expected_m

    t0 = time.perf_counter()
    cfg = _config(False, "v4-w4a8")
    if contig:
        row_sets = [uniform_rows(args.prefill_tokens, cfg.top_k, cap=args.prefill_tokens)]
        indices = [contig_indices(row_sets[0], ALIGNMENT)]
        expected_m, tile = 0, ALIGNMENT
    else:
        row_sets = layer_rows(args.tokens) if args.rows == "layer" else [uniform_rows(args.tokens, cfg.top_k)]
        indices = row_sets
        expected_m = dispatch_expected_m(args.tokens, cfg.top_k, NUM_EXPERTS)
        tile = heuristic_config(expected_m).block_tokens
    h, inter = cfg.hidden_size, cfg.intermediate_size
    rows = []
    for name, n, k in (("GEMM1", 2 * inter, h), ("GEMM2", h, inter)):
        rows += sweep(name, n, k, indices, configs, expected_m, passes=args.passes, iters=args.iters, log=log,
                      contig=contig, rs_configs=rs_configs)
    print_table(rows, row_sets, tile, contig)
    log(f"# done in {time.perf_counter() - t0:.0f} s")
    if args.json:
        write_json(args.json, dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind),
                                   rows_per_expert=[r.tolist() for r in row_sets], expected_m=expected_m,
                                   median_us={r["kernel"] + " " + r["gemm"]: statistics.median(r["us"]) for r in rows},
                                   rows=rows))
    return 0
