"""Measuring one shape of ``python -m moe_jax.bench layer``'s stage table (the method is in layer.py's
docstring): per backend, the routed branch end to end, the layer with routing, the output's errors,
peak temporary memory, the stages one by one on the layer's own tensors (`time_stages`), and, with
``--fused``, the fused layout beside it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from moe_jax.bench._cli import (
    Progress,
    failure,
    rel_errors,
    resolved_backends,
    run_untuned,
)
from moe_jax.bench._timing import StreamTime, device_time, time_op, time_stream
from moe_jax.bench.layer_model import (
    _bench_params,
    _config,
    _fp32_model,
    _gemm_activation_bytes,
    _weight_bytes,
)

STAGES = ("route (gate GEMM + top-k)", "dispatch", "permute+quant", "GEMM1", "activation+quant", "GEMM2",
          "unpermute")
# steps per backend: implementations, then compiles: end to end, its kernel time, with routing, its
# burst and kernel time, output, other layout, memory analysis, stages
STEPS_PER_BACKEND = 8 + len(STAGES)
FUSED_STEPS = 3  # --fused adds per backend: end to end, with routing, kernel time and output
BURST_IDLE_S = 0.5


@dataclasses.dataclass(frozen=True)
class RowTimer:
    """Times the functions of one row (a shape and a backend), one progress step per compile. The
    reference backend is slow (one matmul per 128-row block against dequantized fp32 weights): one
    input set, fewer rounds, no stream fit."""

    progress: Progress
    prefix: str  # "<shape> <backend>", said before each step's label
    slow: bool
    reps: int

    @property
    def n_sets(self) -> int:
        """Input sets per timed dispatch."""
        return 1 if self.slow else self.reps

    def _options(self) -> dict:
        return {"rounds": 2, "chain": 1} if self.slow else {"chain": 8}

    def step(self, label: str) -> None:
        self.progress.step(f"{self.prefix}: {label}")

    def time(self, fn: Callable, arg_sets: list[tuple]) -> float:
        """Seconds per call of fn over the first `n_sets` argument sets (`time_op`), no step."""
        return time_op(fn, arg_sets[:self.n_sets], **self._options())

    def timed(self, label: str, fn: Callable, arg_sets: list[tuple]) -> float:
        """`time` as the step `label`."""
        self.step(label)
        return self.time(fn, arg_sets)

    def streamed(self, label: str, fn: Callable, arg_sets: list[tuple]) -> StreamTime:
        """The steady stream and its marginal cost per call (`time_stream`); the slow reference gets
        `timed`'s figure and no marginal."""
        if self.slow:
            return StreamTime(self.timed(label, fn, arg_sets), float("nan"), float("nan"))
        self.step(label)
        return time_stream(fn, arg_sets[:self.n_sets], **self._options())


@dataclasses.dataclass(frozen=True)
class LayerInputs:
    """The benchmark layer at one shape: config, GEMM-form params, the layout it is called with, R
    input sets and their routes ((topk_ids, topk_weights) per set)."""

    cfg: Any
    params: Any
    layout: str
    xs: list
    routed: list

    # params travel as jit arguments: closed over, 1.4 GB of weights would be embedded in every
    # program as constants (a minute of XLA compile per program at the prefill shape)
    def routed_experts(self, backend: Any, layout: str | None = None) -> Callable:
        """fn(params, x, ids, weights): the routed branch on given routes, in `layout` (None: the shape's)."""
        from moe_jax.layer import routed_experts

        cfg, lay = self.cfg, layout or self.layout
        return lambda p, x, ids, w: routed_experts(x, ids, w, p, cfg, layout=lay, backend=backend)

    def moe_forward(self, backend: Any) -> Callable:
        """fn(params, x): the whole layer, routing included."""
        from moe_jax.layer import moe_forward

        cfg, lay = self.cfg, self.layout
        return lambda p, x: moe_forward(x, p, cfg, layout=lay, backend=backend)

    def routed_sets(self) -> list[tuple]:
        return [(self.params, x, *r) for x, r in zip(self.xs, self.routed)]

    def forward_sets(self) -> list[tuple]:
        return [(self.params, x) for x in self.xs]


def _input_sets(cfg: Any, m: int, reps: int) -> list:
    """The benchmark layer's `reps` random input sets of m tokens: (m, H) bf16 each."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(1), reps)
    return [jax.random.normal(kk, (m, cfg.hidden_size), jnp.bfloat16) for kk in keys]


def layer_inputs(m: int, layout: str, reps: int, small: bool, model: str = "v3") -> LayerInputs:
    """The benchmark layer's params (built and on the device) and `reps` random input sets of m
    tokens, routed by the layer's own router."""
    import jax

    from moe_jax.routing import route

    cfg = _config(small, model)
    params = _bench_params(cfg)
    jax.block_until_ready(params.w13)
    xs = _input_sets(cfg, m, reps)
    return LayerInputs(cfg, params, layout, xs, [route(x, params, cfg) for x in xs])


def layer_routes(m: int, reps: int, small: bool, model: str = "v3") -> list:
    """`layer_inputs(m, ..., reps, small, model).routed` without building the experts' weights:
    (topk_ids, topk_weights) per input set."""
    from moe_jax.routing import route

    cfg = _config(small, model)
    params = _bench_params(cfg, router_only=True)
    return [route(x, params, cfg) for x in _input_sets(cfg, m, reps)]


def rows_per_expert(topk_ids: list, num_experts: int) -> dict:
    """The grouped GEMMs' rows per expert over the input sets' routes (topk_ids (M, top_k) each): min,
    mean, max and each set's counts. At decode the spread decides how often an expert outgrows a
    masked kernel's token tile."""
    import numpy as np

    counts = [np.bincount(np.asarray(ids).ravel(), minlength=num_experts) for ids in topk_ids]
    flat = np.concatenate(counts)
    return {"min": int(flat.min()), "mean": float(flat.mean()), "max": int(flat.max()),
            "sets": [c.tolist() for c in counts]}


def _errors(out: Any, ref: Any) -> dict:
    rel, worst = rel_errors(out, ref)
    return {"rel_err": rel, "worst_row": worst}


def _implementations(backend: str, backends: list[str], forward: Callable, *args) -> dict:
    """What `backend` runs in the layer `forward(*args)`, as row fields: "implementations" {op:
    backend the registry resolved it to} (not traced for "reference", which resolves every op to
    itself); "fell_back" when no op resolved to an accelerated implementation, and then "same_as":
    "reference" when that backend is measured too (the same code is not measured twice)."""
    if backend == "reference":
        return {}
    impls = resolved_backends(forward, *args)
    row: dict = {"implementations": impls}
    if all(v == "reference" for v in impls.values()):
        row["fell_back"] = True
        if "reference" in backends:
            row["same_as"] = "reference"
    return row


GEMM_KERNEL_MARKERS = ("deep_gemm", "w4a8")  # DeepGEMM's kernels; the W4A8 GEMMs (CUDA and Triton)


def kernel_families(per_kernel: dict[str, float]) -> dict[str, float]:
    """Seconds per kernel name -> us per family: total; gemms (names holding a `GEMM_KERNEL_MARKERS`
    entry: DeepGEMM's and the W4A8 GEMMs, whichever language); triton (the other names ending in
    "_kernel", as every kernel of custom_calls.triton does); other (XLA fusions, memsets)."""
    us = {"total": 0.0, "gemms": 0.0, "triton": 0.0, "other": 0.0}
    for name, seconds in per_kernel.items():
        family = ("gemms" if any(m in name for m in GEMM_KERNEL_MARKERS)
                  else "triton" if name.endswith("_kernel") else "other")
        us[family] += seconds * 1e6
        us["total"] += seconds * 1e6
    return us


def _kernel_time_by_family(fn: Callable, arg_sets: list[tuple]) -> dict:
    """GPU time per call of fn (profiler trace) by `kernel_families`, in us. {"error": why} where the
    profiler is unavailable."""
    try:
        per = device_time(fn, arg_sets)
    except Exception as exc:  # noqa: BLE001  the profiler is optional: say why the column is missing
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not per.pop("total"):
        return {"error": "no GPU kernel in the profiler trace"}
    return kernel_families(per)


def _stream_fields(key: str, st: StreamTime) -> dict:
    """A `time_stream` figure as row fields: <key>_us (steady), _marginal_us, _stream_fixed_us."""
    return {f"{key}_us": st.per_call * 1e6, f"{key}_marginal_us": st.marginal * 1e6,
            f"{key}_stream_fixed_us": st.fixed * 1e6}


def bench_shape(name: str, m: int, layout: str, backends: list[str], reps: int, *, small: bool = False,
                error: bool = True, progress: Progress | None = None, fused: bool = False,
                model: str = "v3") -> dict:
    """One shape: {shape, tokens, layout, weights_GB, platform, <backend>: row} (row keys: `_bench_backend`).
    fused: also time the fused layout (`_bench_fused`) for accelerated backends. model: the layer
    (`layer_model.MODELS`).

    progress: a `_cli.Progress` (one step per compile); None makes one on stderr."""
    import jax

    own = progress is None
    if own:
        progress = Progress(name, total=1 + int(error) + STEPS_PER_BACKEND * len(backends))
    progress.step(f"{name}: parameters")
    inputs = layer_inputs(m, layout, reps, small, model)
    result = {"shape": name, "model": model, "tokens": m, "layout": layout, "weights_GB": _weight_bytes(inputs.params) / 1e9,
              "platform": jax.default_backend(),
              "rows_per_expert": rows_per_expert([ids for ids, _ in inputs.routed], inputs.cfg.num_experts)}
    ref32 = _reference_output(inputs, name, progress) if error else None
    for be in backends:
        row = _bench_backend(inputs, name, be, backends, reps, ref32, progress, fused)
        result[be] = row
        progress.note(json.dumps(dict(shape=name, **row)))
    if own:
        progress.close()
    return result


def _reference_output(inputs: LayerInputs, name: str, progress: Progress) -> Any:
    """The float32 model's output on the first input set (the error yardstick of every backend)."""
    import jax

    progress.step(f"{name}: float32 model")
    cfg = inputs.cfg
    return jax.block_until_ready(run_untuned(lambda p, x, i, w: _fp32_model(x, i, w, p, cfg),
                                             inputs.params, inputs.xs[0], *inputs.routed[0]))


def _bench_backend(inputs: LayerInputs, name: str, be: str, backends: list[str], reps: int, ref32: Any,
                   progress: Progress, fused: bool) -> dict:
    """One backend's row: what it resolved to (`_implementations`), then, unless it failed or runs the
    code of a row measured anyway, its measurements (`_measure`); "error" when either failed."""
    row = {"backend": be}
    progress.step(f"{name} {be}: implementations")
    try:
        row.update(_implementations(be, backends, inputs.moe_forward(be), inputs.params, inputs.xs[0]))
    except Exception as exc:  # noqa: BLE001  e.g. an explicit backend that cannot run here: the row failed
        row["error"] = failure(exc)
    if "error" in row or "same_as" in row:
        progress.drop(STEPS_PER_BACKEND - 1, f"{be}: " + ("failed" if "error" in row
                                                          else f"the {row['same_as']} row's code"))
        return row
    timer = RowTimer(progress, f"{name} {be}", slow=be == "reference", reps=reps)
    try:
        _measure(row, inputs, be, timer, ref32, fused)
    except Exception as exc:  # noqa: BLE001  report and go on with the other backends
        row["error"] = failure(exc)
    return row


def _measure(row: dict, inputs: LayerInputs, be: str, timer: RowTimer, ref32: Any, fused: bool) -> None:
    """Fills `row` field by field, so that a row which fails part way keeps what was measured."""
    f = inputs.routed_experts(be)
    e2e_sets = inputs.routed_sets()
    row["end_to_end_us"] = timer.timed("end to end", f, e2e_sets) * 1e6
    timer.step("end to end, kernel time")
    if not timer.slow:  # the reference (one slow call per round) is not profiled
        row["kernel_time_us"] = _kernel_time_by_family(f, e2e_sets)
    _measure_with_routing(row, inputs, be, timer)
    out = _measure_output(row, inputs, f, be, timer, ref32)
    timer.step("memory analysis")
    row["temp_MB"] = _temp_mb(f, inputs)
    stages = time_stages(inputs, be, timer)
    row["stages_us"] = {s: t * 1e6 for s, t in stages.seconds.items()}
    row["gemms_us"] = (stages.seconds["GEMM1"] + stages.seconds["GEMM2"]) * 1e6
    row["gemms_marginal_us"] = sum(g.marginal for g in stages.gemm_streams) * 1e6
    row["e2e_over_gemms"] = row["end_to_end_us"] / row["gemms_us"]
    row["temp_bound_MB"] = 1.25 * stages.gemm_activation_bytes / 1e6
    if fused and not timer.slow:
        try:
            row.update(_bench_fused(inputs, be, timer, out, ref32))
        except Exception as exc:  # noqa: BLE001  the staged row stands; the fused one failed
            row["fused_error"] = failure(exc)


def _temp_mb(f: Callable, inputs: LayerInputs) -> float:
    """XLA's temporaries of the routed branch `f` on the first input set, MB."""
    import jax

    compiled = jax.jit(f).lower(inputs.params, inputs.xs[0], *inputs.routed[0]).compile()
    return getattr(compiled.memory_analysis(), "temp_size_in_bytes", float("nan")) / 1e6


def _measure_with_routing(row: dict, inputs: LayerInputs, be: str, timer: RowTimer) -> None:
    """The whole layer, routing included: steady stream, then a burst after idle and the kernel time
    (not for the slow reference)."""
    fwd, fwd_sets = inputs.moe_forward(be), inputs.forward_sets()
    row.update(_stream_fields("with_routing", timer.streamed("with routing", fwd, fwd_sets)))
    timer.step("with routing, burst and kernel time")
    if not timer.slow:
        row["with_routing_burst_us"] = time_op(fwd, fwd_sets[:1], rounds=5, chain=1, idle_s=BURST_IDLE_S) * 1e6
        row["with_routing_kernel_us"] = _kernel_time_by_family(fwd, fwd_sets)


def _measure_output(row: dict, inputs: LayerInputs, f: Callable, be: str, timer: RowTimer, ref32: Any) -> Any:
    """The output of f (the routed branch in the shape's layout) on the first input set: its errors
    against the float32 model (when computed) and its difference to the other layout's output;
    returns the output."""
    import jax
    import jax.numpy as jnp

    args = (inputs.params, inputs.xs[0], *inputs.routed[0])
    timer.step("output")
    out = jax.jit(f)(*args)
    if ref32 is not None:
        row.update(_errors(out, ref32))
    other = "masked" if inputs.layout == "contig" else "contig"
    timer.step(f"output, {other} layout")
    out_other = jax.jit(inputs.routed_experts(be, other))(*args)
    row[f"vs_{other}_rel"] = _errors(out, out_other.astype(jnp.float32))["rel_err"]
    del out_other
    timer.progress.note(f"{timer.prefix}: end to end {row['end_to_end_us']:.1f} us"
                        + (f", rel err {row['rel_err']:.2e}" if "rel_err" in row else ""))
    return out


def _bench_fused(inputs: LayerInputs, be: str, timer: RowTimer, staged_out: Any, ref32: Any) -> dict:
    """The fused layout (`MoEConfig(layout="fused")`: the routed branch as one kernel) on the same
    weights and inputs: fused_* keys of a row (times in us, its kernel time, errors)."""
    import jax

    from moe_jax.params import prepare_params

    fcfg = dataclasses.replace(inputs.cfg, layout="fused")
    fparams = jax.block_until_ready(prepare_params(inputs.params, fcfg))  # w13 rows interleaved (a copy)
    # called with layout "auto" (the default), which follows fcfg.layout: the fused kernel
    fused = dataclasses.replace(inputs, cfg=fcfg, params=fparams, layout="auto")
    f, fwd = fused.routed_experts(be), fused.moe_forward(be)
    fwd_sets = fused.forward_sets()
    out = {"fused_end_to_end_us": timer.timed("fused: end to end", f, fused.routed_sets()) * 1e6}
    out.update(_stream_fields("fused_with_routing", timer.streamed("fused: with routing", fwd, fwd_sets)))
    timer.step("fused, kernel time and output")
    out["fused_with_routing_kernel_us"] = _kernel_time_by_family(fwd, fwd_sets)
    y = jax.jit(f)(fparams, inputs.xs[0], *inputs.routed[0]).astype(staged_out.dtype)
    if ref32 is not None:
        out.update({f"fused_{k}": v for k, v in _errors(y, ref32).items()})
    out["fused_vs_staged_rel"] = _errors(y, staged_out.astype(jax.numpy.float32))["rel_err"]
    out["fused_temp_MB"] = _temp_mb(f, fused)  # for 4-bit experts, their FP8 copy included
    return out


# -- stage by stage, on the layer's own intermediate tensors -----------------------------------------

@dataclasses.dataclass(frozen=True)
class StageTimes:
    """Seconds per call of each of STAGES, the two grouped GEMMs' stream figures, and the larger
    GEMM's activation bytes in + out (the peak temporary memory goal's yardstick)."""

    seconds: dict[str, float]
    gemm_streams: list[StreamTime]
    gemm_activation_bytes: int


@dataclasses.dataclass(frozen=True)
class _LayoutOps:
    """One layout's ops between dispatch and unpermute, with the backend under test bound."""

    permute: Callable  # (x, src2dst) -> (lhs, lhs scale)
    gemm: Callable  # (w, w scale, a, a scale, group) -> out
    activation: Callable  # (*act_args(gate-up, dispatch)) -> (act, act scale)
    group: Callable  # dispatch -> the grouped GEMM's group operand
    act_args: Callable  # (gate-up, dispatch) -> the activation's arguments
    to_rows: Callable  # GEMM2's output -> the (rows, H) array unpermute reads
    gemm_rows: int  # rows of the grouped GEMMs' operands


def _dispatcher(layout: str, cfg: Any, m_pad: int, backend: Any) -> Callable:
    """fn(topk_ids) -> the `layout` dispatch over all of cfg's experts (masked: m_pad rows each)."""
    from moe_jax.dispatch import dispatch_contig, dispatch_masked

    e = cfg.num_experts
    if layout == "contig":
        return lambda i: dispatch_contig(i, num_local_experts=e, alignment=cfg.alignment, backend=backend)
    return lambda i: dispatch_masked(i, num_local_experts=e, m_pad=m_pad, num_experts_global=e, backend=backend)


def _contig_ops(cfg: Any, params: Any, backend: Any, disp: Any) -> _LayoutOps:
    """The contig layout's ops for dispatches shaped like `disp`."""
    from custom_calls.activation import activation_quant_contig
    from custom_calls.grouped_gemm import m_grouped_gemm_contig
    from custom_calls.permute import permute_contig
    from layouts import gemm_format

    recipe, arch, rows = params.gemm_recipe, params.gemm_arch, disp.num_rows_cap

    def permute(x, s):
        return permute_contig(x, s, num_rows=rows, recipe=recipe, arch=arch, backend=backend)

    def gemm(w, ws, a, s, mi):
        return m_grouped_gemm_contig(a, w, mi, lhs_scale=s, rhs_scale=ws, recipe=recipe, arch=arch,
                                     alignment=cfg.alignment, lhs_order=gemm_format(recipe, arch).lhs_order,
                                     backend=backend)

    def activation(g):
        return activation_quant_contig(g, act=cfg.activation, recipe=recipe, arch=arch, backend=backend)

    return _LayoutOps(permute, gemm, activation, group=lambda d: d.m_indices, act_args=lambda g, d: (g,),
                      to_rows=lambda y: y, gemm_rows=rows)


def _masked_ops(cfg: Any, params: Any, backend: Any, disp: Any, m_pad: int) -> _LayoutOps:
    """The masked layout's ops for dispatches shaped like `disp` (E groups of m_pad rows)."""
    from custom_calls.activation import activation_quant_masked
    from custom_calls.grouped_gemm import m_grouped_gemm_masked
    from custom_calls.permute import permute_masked
    from layouts import gemm_format

    recipe, arch, e, h = params.gemm_recipe, params.gemm_arch, cfg.num_experts, cfg.hidden_size
    em = disp.expected_m

    def permute(x, s):
        return permute_masked(x, s, num_groups=e, m_pad=m_pad, recipe=recipe, arch=arch, backend=backend)

    def gemm(w, ws, a, s, mm):
        return m_grouped_gemm_masked(a, w, mm, expected_m=em, lhs_scale=s, rhs_scale=ws, recipe=recipe, arch=arch,
                                     lhs_order=gemm_format(recipe, arch).lhs_order, backend=backend)

    def activation(g, mm):
        return activation_quant_masked(g, mm, act=cfg.activation, recipe=recipe, arch=arch, backend=backend)

    return _LayoutOps(permute, gemm, activation, group=lambda d: d.masked_m, act_args=lambda g, d: (g, d.masked_m),
                      to_rows=lambda y: y.reshape(e * m_pad, h), gemm_rows=e * m_pad)


def time_stages(inputs: LayerInputs, be: str, timer: RowTimer) -> StageTimes:
    """Each of STAGES timed alone, its inputs the previous stage's outputs; a stage's inputs are
    dropped once the next stage's exist (at the prefill shape they are GBs)."""
    from custom_calls.unpermute import unpermute
    from moe_jax.dispatch import default_masked_m_pad
    from moe_jax.layer import stage_backend
    from moe_jax.routing import route

    cfg, params, xs, routed = inputs.cfg, inputs.params, inputs.xs, inputs.routed
    t = {STAGES[0]: timer.timed(STAGES[0], lambda p, x: route(x, p, cfg, backend=stage_backend(be, "route")),
                                inputs.forward_sets())}
    m_pad = default_masked_m_pad(xs[0].shape[0])
    dispatch = _dispatcher(inputs.layout, cfg, m_pad, be)
    disp = [dispatch(i) for i, _ in routed[:timer.n_sets]]
    t[STAGES[1]] = timer.timed(STAGES[1], dispatch, [(i,) for i, _ in routed])
    ops = (_contig_ops(cfg, params, be, disp[0]) if inputs.layout == "contig"
           else _masked_ops(cfg, params, be, disp[0], m_pad))
    t[STAGES[2]] = timer.timed(STAGES[2], ops.permute, [(x, d.src2dst) for x, d in zip(xs, disp)])
    lhs = [ops.permute(x, d.src2dst) for x, d in zip(xs, disp)]
    gemm1, gu = _time_gemm(timer, STAGES[3], ops, (params.w13, params.w13_scale), lhs, disp)
    del lhs
    act_sets = [ops.act_args(g, d) for g, d in zip(gu, disp)]
    del gu
    t[STAGES[3]] = gemm1.per_call
    t[STAGES[4]] = timer.timed(STAGES[4], ops.activation, act_sets)
    acts = [ops.activation(*a) for a in act_sets]
    del act_sets
    gemm2, ds = _time_gemm(timer, STAGES[5], ops, (params.w2, params.w2_scale), acts, disp, out=ops.to_rows)
    del acts
    t[STAGES[5]] = gemm2.per_call
    t[STAGES[6]] = timer.timed(
        STAGES[6], lambda d, s, w: unpermute(d, s, w, routed_scaling_factor=cfg.routed_scaling_factor, backend=be),
        [(d, dd.src2dst, w) for d, dd, (_, w) in zip(ds, disp, routed)])
    return StageTimes(t, [gemm1, gemm2], _gemm_activation_bytes(ops.gemm_rows, cfg.hidden_size,
                                                                cfg.intermediate_size))


def _time_gemm(timer: RowTimer, stage: str, ops: _LayoutOps, weights: tuple, operands: list, disp: list,
               out: Callable = lambda y: y) -> tuple[StreamTime, list]:
    """The grouped GEMM `stage` on (activation, scale) operands and the given weights: its stream
    figures and its outputs (through `out`), the next stage's inputs."""
    sets = [(*weights, a, s, ops.group(d)) for (a, s), d in zip(operands, disp)]
    return timer.streamed(stage, ops.gemm, sets), [out(ops.gemm(*args)) for args in sets]
