"""What ``python -m moe_jax.bench layer`` reports from its measured rows: the goal lines, the stage
table, the ``--shared`` comparison and the stage plot. A speed-up, roofline or goal figure is given
only to a row that ran accelerated code: a backend that fell back runs the reference's code."""

from __future__ import annotations

import math

from moe_jax.bench._cli import fallback_note, plot_panels
from moe_jax.bench.layer_measure import STAGES

PREFILL_GOAL = 1.06  # moe_forward including routing / (GEMM1 + GEMM2)
DECODE_GOAL = 0.90  # weights-once roofline / moe_forward including routing
# V4's smaller experts (H 4096) leave the fixed costs per layer more weight: its decode goal is lower
DECODE_GOALS = {"v3": DECODE_GOAL, "v4": 0.85, "v4-256": 0.85, "v4-w4a8": 0.85, "v4-256-w4a8": 0.85}
SHARED_LABELS = {"bf16": "bf16 dense", "fp8": "fp8 dense", "fused": "fp8 fused"}


def _f(v: float | None, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def _missing(v: float | None) -> bool:
    """Not measured: None or NaN."""
    return v is None or math.isnan(v)


def _ratio(num: float | None, den: float | None) -> float | None:
    """num / den, None where either is missing, NaN or zero (a figure not measured)."""
    return num / den if num and den and not math.isnan(num) and not math.isnan(den) else None


def _marginal(row: dict, key: str) -> str:
    """", M us marginal (F us once per stream)" for a row's `time_stream` figures, "" where not
    measured."""
    m, fixed = row.get(f"{key}_marginal_us"), row.get(f"{key}_stream_fixed_us")
    if _missing(m):
        return ""
    return f", {m:.1f} us marginal ({_f(fixed, '.0f')} us once per stream)"


def _accelerated(row: dict) -> bool:
    """The row was measured and ran at least one accelerated implementation (not only the reference)."""
    return "end_to_end_us" in row and row.get("backend") != "reference" and not row.get("fell_back")


def _label(row: dict, platform: str) -> str:
    """The row's backend, with what it fell back to (see `_cli.fallback_note`)."""
    note = fallback_note(row.get("implementations", {}), platform)
    return f"{row['backend']} ({note})" if note else row["backend"]


def _roofline_us(res: dict, copy_gbps: float) -> float:
    """The decode roofline: the shape's weights read once at the copy bandwidth."""
    return res["weights_GB"] * 1e9 / (copy_gbps * 1e9) * 1e6


def _temp_text(row: dict) -> str:
    """Peak temporary memory against the goal (1.25 x the larger GEMM's activations), which is for
    the accelerated path: the reference keeps dequantized fp32 operands as temporaries by design."""
    temp, bound = row.get("temp_MB"), row["temp_bound_MB"]
    if not _accelerated(row):
        return (f"temp {_f(temp, '.0f')} MB (reference: dequantized fp32 operands; the "
                f"{bound:.0f} MB goal is for accelerated backends)")
    verdict = "" if _missing(temp) else (" ok" if temp <= bound else " OVER")
    # the W4A8 contig op by expansion runs DeepGEMM inside it: its FP8 weight copy is a temporary too
    expanded = {"w4a8", "deep_gemm"} <= set(row.get("implementations", {}).get("m_grouped_gemm_contig", "").split(","))
    note = "; includes the FP8 copy of the W4A8 weights that w4a8_prefill='expand' writes" if expanded else ""
    return f"temp {_f(temp, '.0f')} MB (goal <= {bound:.0f} MB{verdict}{note})"


# -- goals -------------------------------------------------------------------------------------------

def goals(results: list[dict], copy_gbps: float, backend: str = "auto") -> list[dict]:
    """The layer's two speed goals per measured shape of `backend` (only where it ran accelerated code):
    contig shapes: `moe_forward` including routing / (GEMM1 + GEMM2), goal <= PREFILL_GOAL; masked
    shapes: weights-once roofline / `moe_forward` including routing, goal >= DECODE_GOALS[model]. "wall":
    steady-stream wall time (stages timed alone for the GEMMs), the goal's measure; "marginal": the
    same from what one more call adds to a running stream (`_timing.time_stream`: the stream's
    once-per-stream start-up and sync left out, GEMMs likewise), None where not measured;
    "kernel": GPU kernel time of `moe_forward` (its own GEMM kernels for the prefill ratio), no
    host time."""
    out = []
    for res in results:
        row = res.get(backend, {})
        if not _accelerated(row) or "with_routing_us" not in row:
            continue
        kt = row.get("with_routing_kernel_us") or {}
        ok_kt = "error" not in kt and kt.get("total")
        gemms_kernel = kt.get("gemms") if ok_kt else None
        out.append(_goal(res, row, copy_gbps, "with routing", row["with_routing_us"],
                         row.get("with_routing_marginal_us"), kt["total"] if ok_kt else None, gemms_kernel))
        if "fused_with_routing_us" in row:
            # the fused layout against the same yardsticks: the staged path's GEMM-only time (prefill),
            # the weights-once roofline (decode); its kernel time has no separate GEMM kernels
            fk = row.get("fused_with_routing_kernel_us") or {}
            out.append(_goal(res, row, copy_gbps, "fused layout with routing", row["fused_with_routing_us"],
                             row.get("fused_with_routing_marginal_us"),
                             fk.get("total") if "error" not in fk else None, gemms_kernel))
    return out


def _goal(res: dict, row: dict, copy_gbps: float, metric: str, us: float, marginal_us: float | None,
          kernel_us: float | None, gemms_kernel_us: float | None) -> dict:
    """One goal line of a shape (`goals`) from the time of `metric` per call: steady wall, marginal,
    GPU kernel (us; None where not measured)."""
    head = {"shape": res["shape"], "tokens": res["tokens"]}
    if res["layout"] == "contig":
        wall, marg = us / row["gemms_us"], _ratio(marginal_us, row.get("gemms_marginal_us"))
        return dict(head, metric=f"{metric} / GEMMs", wall=wall, marginal=marg,
                    kernel=_ratio(kernel_us, gemms_kernel_us), goal=PREFILL_GOAL, met=wall <= PREFILL_GOAL,
                    met_marginal=marg is not None and marg <= PREFILL_GOAL)
    roof, goal = _roofline_us(res, copy_gbps), DECODE_GOALS[res.get("model", "v3")]
    wall, marg = roof / us, _ratio(roof, marginal_us)
    return dict(head, metric=f"roofline / {metric}", wall=wall, marginal=marg, kernel=_ratio(roof, kernel_us),
                goal=goal, met=wall >= goal, met_marginal=marg is not None and marg >= goal, roofline_us=roof)


def _goal_figure(v: float | None, percent: bool) -> str:
    if not percent:
        return _f(v, ".3f")
    return "–" if v is None else f"{100 * v:.1f} %"


def print_goals(rows: list[dict]) -> None:
    for g in rows:
        pct = g["metric"].startswith("roofline")
        goal = f">= {100 * g['goal']:.0f} %" if pct else f"<= {g['goal']:.2f}"
        print(f"  goal {g['shape']:10s} {g['tokens']:6d} tokens: {g['metric']} {_goal_figure(g['wall'], pct)} "
              f"steady wall, {_goal_figure(g.get('marginal'), pct)} marginal, {_goal_figure(g['kernel'], pct)} "
              f"GPU kernel time (goal {goal}: {'met' if g['met'] else 'not met'}; marginal "
              f"{'met' if g.get('met_marginal') else 'not met'})")


# -- the stage table ---------------------------------------------------------------------------------

def print_table(results: list[dict], backends: list[str], device: str, copy_gbps: float, scaled: bool = False,
                model: str = "v3") -> None:
    """The human-readable table, on stdout. A speed-up or roofline figure is printed only for a
    backend that ran an accelerated implementation: one that fell back is the reference's code."""
    print(f"\ndevice {device}; copy bandwidth {copy_gbps:.0f} GB/s; model {model}"
          + ("; shapes scaled down (--small), not the model's sizes" if scaled else ""))
    print_goals(goals(results, copy_gbps))
    for res in results:
        platform = res.get("platform", "?")
        rows = res.get("rows_per_expert")
        print(f"\n== {res['shape']}: {res['tokens']} tokens, {res['layout']}, weights {res['weights_GB']:.2f} GB"
              + (f", rows per expert {rows['min']}-{rows['max']} (mean {rows['mean']:.1f})" if rows else ""))
        for be in backends:
            for line in _row_lines(res.get(be, {}), be, platform):
                print(line)
        for line in _comparison_lines(res, copy_gbps):
            print(line)


def _row_lines(row: dict, be: str, platform: str) -> list[str]:
    """The table's lines of one backend's row."""
    if "error" in row:
        return [f"  {be}: FAILED {row['error']}"]
    if "same_as" in row:
        return [f"  {_label(row, platform)}: the {row['same_as']} row's code, not measured again"]
    lines = [_summary_line(row, platform)]
    if _accelerated(row):
        lines.append("      implementations: " + ", ".join(f"{op} {b}" for op, b in row["implementations"].items()))
    lines += _kernel_time_lines(row)
    lines += [f"      {s:28s} {t:10.1f} us" for s, t in row["stages_us"].items()]
    return lines + _fused_lines(row)


def _summary_line(row: dict, platform: str) -> str:
    """End to end, with routing, GEMMs, errors and peak temporary memory of a measured row."""
    other = row.get("vs_masked_rel", row.get("vs_contig_rel"))
    err = (f"rel err {_f(row['rel_err'], '.2e')} (worst row {_f(row['worst_row'], '.2e')})"
           if "rel_err" in row else "rel err not computed (--no-error)")
    burst = row.get("with_routing_burst_us")
    return (f"  {_label(row, platform)}: end to end {row['end_to_end_us']:.1f} us (with routing "
            f"{row['with_routing_us']:.1f} us steady" + _marginal(row, "with_routing")
            + (f", {burst:.1f} us burst" if burst else "")
            + f"), GEMMs {row['gemms_us']:.1f} us (e2e/GEMMs "
            f"{row['e2e_over_gemms']:.3f}), {err}, contig vs masked {_f(other, '.1e')}, "
            + _temp_text(row))


def _kernel_split(kt: dict) -> str:
    return (f"{kt['total']:.1f} us = GEMMs {kt['gemms']:.1f} + Triton {kt['triton']:.1f} + other "
            f"{kt['other']:.1f}")


def _kernel_time_lines(row: dict) -> list[str]:
    """GPU kernel time by family: end to end (or why it is unavailable) and with routing."""
    lines = []
    kt = row.get("kernel_time_us")
    if kt and "error" not in kt:
        lines.append("      end to end, GPU kernel time: " + _kernel_split(kt)
                     + (f" (total/GEMMs {kt['total'] / kt['gemms']:.3f})" if kt["gemms"] else ""))
    elif kt:
        lines.append(f"      end to end, GPU kernel time unavailable: {kt['error']}")
    kr = row.get("with_routing_kernel_us")
    if kr and "error" not in kr:
        lines.append("      with routing, GPU kernel time: " + _kernel_split(kr))
    return lines


def _fused_lines(row: dict) -> list[str]:
    """The fused layout's line (--fused), or why it failed."""
    lines = []
    if "fused_error" in row:
        lines.append(f"      fused layout: FAILED {row['fused_error']}")
    if "fused_with_routing_us" in row:
        fk = row.get("fused_with_routing_kernel_us") or {}
        lines.append(f"      fused layout: end to end {row['fused_end_to_end_us']:.1f} us, with routing "
                     f"{row['fused_with_routing_us']:.1f} us steady" + _marginal(row, "fused_with_routing")
                     + (f", {fk['total']:.1f} us GPU kernel time" if fk.get("total") else "")
                     + (f", rel err {_f(row['fused_rel_err'], '.2e')}" if "fused_rel_err" in row else "")
                     + f", vs the staged output {_f(row['fused_vs_staged_rel'], '.1e')}"
                     + (f", temp {row['fused_temp_MB']:.0f} MB" if "fused_temp_MB" in row else ""))
    return lines


def _comparison_lines(res: dict, copy_gbps: float) -> list[str]:
    """A shape's decode roofline and auto-vs-reference lines, where "auto" ran accelerated code."""
    auto, ref = res.get("auto", {}), res.get("reference", {})
    lines = []
    if res["layout"] == "masked" and _accelerated(auto):
        roof = _roofline_us(res, copy_gbps)
        lines.append(f"  decode roofline (weights once at copy bandwidth) {roof:.1f} us -> "
                     f"{100 * roof / auto['end_to_end_us']:.0f}% of roofline")
    if _accelerated(auto) and "end_to_end_us" in ref:
        lines.append(f"  auto vs reference: {ref['end_to_end_us'] / auto['end_to_end_us']:.1f}x")
    return lines


def plot(path: str, results: list[dict], backends: list[str], device: str) -> None:
    """PNG: per shape, one stacked bar of the stage times per backend (black tick: the measured end to
    end time with routing, which the stages add up to)."""
    panels = []
    for res in results:
        ok = [be for be in backends if "stages_us" in res.get(be, {})]
        if not ok:
            continue
        panels.append({
            "title": f"{res['shape']}: {res['tokens']} tokens, {res['layout']}", "ylabel": "time per call (us)",
            "groups": ok, "stacks": {s: [res[be]["stages_us"].get(s) for be in ok] for s in STAGES},
            "totals": [res[be]["with_routing_us"] for be in ok], "totals_label": "end to end (with routing)"})
    plot_panels(path, panels, title=f"moe_jax layer stages, {device}")


# -- the --shared comparison -------------------------------------------------------------------------

def print_shared_table(results: list[dict], variants: list[str], backends: list[str], device: str,
                       scaled: bool) -> None:
    """The shared-expert comparison on stdout, one line per (shape, backend, variant)."""
    print(f"\ndevice {device}; layer with one shared expert: dense bf16 / dense FP8 (gemm_nt) / FP8 fused into "
          f"the routed grouped GEMMs" + ("; shapes scaled down (--small)" if scaled else ""))
    for res in results:
        print(f"\n== shared experts, {res['shape']}: {res['tokens']} tokens, {res['layout']}")
        for be in backends:
            for v in variants:
                print(_shared_line(res[be][v], v, res["platform"]))


def _shared_line(row: dict, variant: str, platform: str) -> str:
    head = f"  {_label(row, platform):>10s} {SHARED_LABELS[variant]:10s}"
    if "error" in row:
        return f"{head}: FAILED {row['error']}"
    if "same_as" in row:
        return f"{head}: the {row['same_as']} row's code, not measured again"
    rel = ", ".join(f"vs {b} {row[f'rel_vs_{b}']:.2e}" for b in ("bf16", "fp8") if f"rel_vs_{b}" in row)
    return (f"{head}: layer {row['layer_us']:10.1f} us"
            + (f", shared MLP {row['shared_us']:9.1f} us" if "shared_us" in row else " " * 26)
            + (f", rel diff {rel}" if rel else ""))
