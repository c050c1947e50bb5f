"""``python -m moe_jax.bench layer``: the whole routed MoE layer, per stage and end to end.

Shapes (`SHAPES`): prefill = 4096 tokens and prefill16k = 16384 tokens, contig layout; decode32,
decode, decode512 = 32, 128, 512 tokens, masked layout (m_pad = tokens rounded up to 256); all with
32 local experts (all of the model's), top-8 (sigmoid + correction bias, 8 groups of 4, top-4
groups), H 7168, I 2048, fp8_block weights on arch 90, the router gate in bf16 (as DeepSeek's
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
import dataclasses
import json

from moe_jax.bench._timing import StreamTime, time_op, time_stream


# name: (tokens, layout, tokens at --small)
SHAPES = {"prefill": (4096, "contig", 64), "prefill16k": (16384, "contig", 128), "decode32": (32, "masked", 8),
          "decode": (128, "masked", 16), "decode512": (512, "masked", 32)}
DEFAULT_SHAPES_NO_GPU = ("prefill", "decode")
PREFILL_GOAL = 1.06  # moe_forward including routing / (GEMM1 + GEMM2)
DECODE_GOAL = 0.90  # weights-once roofline / moe_forward including routing
BURST_IDLE_S = 0.5


def _config(small: bool = False):
    from moe_jax.config import MoEConfig

    cfg = MoEConfig.deepseek_v3(num_experts=32, n_shared_experts=0, n_group=8, topk_group=4,
                                recipe="fp8_block", arch=90)
    if small:  # a smoke-test size for machines without a GPU
        cfg = cfg.scaled(num_experts=16, hidden_size=256, intermediate_size=128, top_k=4)
    return cfg


def _bench_params(config, shared_recipe: str = "bf16"):
    """GEMM-form params of the benchmark layer (the same random draws for every call), with the
    router gate in bf16 as DeepSeek's checkpoints ship it: the router GEMM runs bf16 x bf16 -> f32."""
    import jax
    import jax.numpy as jnp

    from moe_jax.params import init_params, prepare_params

    params = prepare_params(init_params(jax.random.PRNGKey(0), config, shared_recipe=shared_recipe), config)
    return dataclasses.replace(params, gate_weight=params.gate_weight.astype(jnp.bfloat16))


def _fp32_model(x, topk_ids, topk_weights, params, config, *, block: int = 128, blocks_per_step: int = 4):
    """Float32 routed output of the layer, from the routed (token, expert) pairs only.

    x: (M, H) float; topk_ids: (M, k) int32; topk_weights: (M, k) float -> (M, H) f32.
    Dequantized weights, unquantized activations, HIGHEST precision dots. The routes are grouped by
    expert with the contig dispatch (segments aligned to `block` rows), so each block of `block`
    rows belongs to one expert: `lax.map` over the blocks dequantizes that one expert's weights and
    runs its two GEMMs on the gathered token rows (with blocks_per_step=1, padding-only blocks are
    skipped). The cost is
    that of the two grouped GEMMs in float32 plus one weight dequantization per block; no copy of
    every expert's weights, per block or at all, is made. `blocks_per_step` blocks run together
    (one batched GEMM, that many single-expert weight copies live): a single 128-row GEMM keeps only
    a fraction of a large GPU's SMs busy.
    """
    import jax
    import jax.numpy as jnp

    from custom_calls.activation import gated_activation
    from custom_calls.grouped_gemm import dequantize_rhs
    from moe_jax.dispatch import dispatch_contig

    hi = jax.lax.Precision.HIGHEST
    m, k = topk_ids.shape
    h = x.shape[1]
    e = params.w13.shape[0]
    recipe, arch, act = params.gemm_recipe, params.gemm_arch, config.activation
    disp = dispatch_contig(topk_ids, num_local_experts=e, alignment=block)
    cap = disp.num_rows_cap
    src2dst = disp.src2dst.reshape(-1)
    token = jnp.arange(m * k, dtype=jnp.int32) // k
    row_token = jnp.zeros((cap,), jnp.int32).at[jnp.where(src2dst >= 0, src2dst, cap)].set(
        token, mode="drop", unique_indices=True)  # padding rows read token 0 and are never read back
    block_expert = jnp.max(disp.m_indices.reshape(cap // block, block), axis=1)  # -1: padding only
    xf = x.astype(jnp.float32)

    def one_expert_weights(w, scale, ex):
        w1 = jax.lax.dynamic_index_in_dim(w, ex, keepdims=True)
        s1 = None if scale is None else jax.lax.dynamic_index_in_dim(scale, ex, keepdims=True)
        return dequantize_rhs(w1, s1, recipe, arch)[0]

    def compute(b):
        ex = jnp.maximum(block_expert[b], 0)
        xb = xf[jax.lax.dynamic_slice_in_dim(row_token, b * block, block)]  # (block, H)
        w13 = one_expert_weights(params.w13, params.w13_scale, ex)  # (2I, H)
        gu = jnp.einsum("mk,nk->mn", xb, w13, precision=hi, preferred_element_type=jnp.float32)
        w2 = one_expert_weights(params.w2, params.w2_scale, ex)  # (H, I)
        return jnp.einsum("mi,hi->mh", gated_activation(gu, act), w2, precision=hi,
                          preferred_element_type=jnp.float32)

    def one_block(b):
        return jax.lax.cond(block_expert[b] >= 0, compute, lambda _: jnp.zeros((block, h), jnp.float32), b)

    nb = cap // block
    ys = jax.lax.map(one_block, jnp.arange(nb), batch_size=min(blocks_per_step, nb)).reshape(cap, h)
    dst = disp.src2dst
    w = jnp.where(dst >= 0, topk_weights.astype(jnp.float32), 0.0)
    out = jnp.zeros((m, h), jnp.float32)
    for j in range(k):  # k is small and static: no (M, k, H) temporary
        out = out + w[:, j, None] * ys[jnp.maximum(dst[:, j], 0)]
    return out * config.routed_scaling_factor


def _errors(out, ref) -> dict:
    from moe_jax.bench._cli import rel_errors

    rel, worst = rel_errors(out, ref)
    return dict(rel_err=rel, worst_row=worst)


def _gemm_activation_bytes(rows: int, h: int, inter: int) -> int:
    """Activation bytes in + out of the larger grouped GEMM (weights are arguments, not temporaries):
    GEMM1 reads e4m3 (rows, H) + fp32 scales and writes bf16 (rows, 2I); GEMM2 reads e4m3 (rows, I)
    + scales and writes bf16 (rows, H)."""
    gemm1 = rows * h + 4 * rows * (h // 128) + rows * 2 * inter * 2
    gemm2 = rows * inter + 4 * rows * (inter // 128) + rows * h * 2
    return max(gemm1, gemm2)


def _temp_text(row: dict) -> str:
    """Peak temporary memory against the goal (1.25 x the larger GEMM's activations), which is for
    the accelerated path: the reference keeps dequantized fp32 operands as temporaries by design."""
    temp, bound = row.get("temp_MB"), row["temp_bound_MB"]
    if not _accelerated(row):
        return (f"temp {_f(temp, '.0f')} MB (reference: dequantized fp32 operands; the "
                f"{bound:.0f} MB goal is for accelerated backends)")
    verdict = "" if temp is None or temp != temp else (" ok" if temp <= bound else " OVER")
    return f"temp {_f(temp, '.0f')} MB (goal <= {bound:.0f} MB{verdict})"


def _weight_bytes(params) -> int:
    return sum(a.size * a.dtype.itemsize for a in (params.w13, params.w13_scale, params.w2, params.w2_scale))


STAGES = ("route (gate GEMM + top-k)", "dispatch", "permute+quant", "GEMM1", "activation+quant", "GEMM2",
          "unpermute")
# steps per backend: implementations, then compiles: end to end, its kernel time, with routing, its
# burst and kernel time, output, other layout, memory analysis, stages
STEPS_PER_BACKEND = 8 + len(STAGES)


def _implementations(backend: str, backends: list[str], forward, *args) -> dict:
    """What `backend` runs in the layer `forward(*args)`, as row fields: "implementations" {op:
    backend the registry resolved it to} (not traced for "reference", which resolves every op to
    itself); "fell_back" when no op resolved to an accelerated implementation, and then "same_as":
    "reference" when that backend is measured too (the same code is not measured twice)."""
    from moe_jax.bench._cli import resolved_backends

    if backend == "reference":
        return {}
    impls = resolved_backends(forward, *args)
    row: dict = dict(implementations=impls)
    if all(v == "reference" for v in impls.values()):
        row["fell_back"] = True
        if "reference" in backends:
            row["same_as"] = "reference"
    return row


def _bench_fused(name, be, cfg, params, xs, routed, staged_out, ref32, progress, timed, streamed) -> dict:
    """The fused layout (`MoEConfig(layout="fused")`: the routed branch as one kernel) on the same
    weights and inputs: fused_* keys of a row (times in us, its kernel time, errors)."""
    import dataclasses as dc

    import jax

    from moe_jax.layer import moe_forward, routed_experts
    from moe_jax.params import prepare_params

    fcfg = dc.replace(cfg, layout="fused")
    fparams = jax.block_until_ready(prepare_params(params, fcfg))  # w13 rows interleaved (a copy)
    f = lambda p, x, ids, w: routed_experts(x, ids, w, p, fcfg, backend=be)  # noqa: E731
    fwd = lambda p, x: moe_forward(x, p, fcfg, backend=be)  # noqa: E731
    e2e_sets = [(fparams, x, *r) for x, r in zip(xs, routed)]
    fwd_sets = [(fparams, x) for x in xs]
    out = dict(fused_end_to_end_us=timed("fused: end to end", f, e2e_sets) * 1e6)
    st = streamed("fused: with routing", fwd, fwd_sets)
    out.update(fused_with_routing_us=st.per_call * 1e6, fused_with_routing_marginal_us=st.marginal * 1e6,
               fused_with_routing_stream_fixed_us=st.fixed * 1e6)
    progress.step(f"{name} {be}: fused, kernel time and output")
    out["fused_with_routing_kernel_us"] = _kernel_time_by_family(fwd, fwd_sets)
    y = jax.jit(f)(fparams, xs[0], *routed[0]).astype(staged_out.dtype)
    if ref32 is not None:
        out.update({f"fused_{k}": v for k, v in _errors(y, ref32).items()})
    out["fused_vs_staged_rel"] = _errors(y, staged_out.astype(jax.numpy.float32))["rel_err"]
    return out


def bench_shape(name: str, m: int, layout: str, backends: list[str], reps: int, *, small: bool = False,
                error: bool = True, progress=None, fused: bool = False) -> dict:
    """One shape: {shape, tokens, layout, weights_GB, <backend>: row} (row keys: README of `run`).
    fused: also time the fused layout (`_bench_fused`) for accelerated backends.

    progress: a `_cli.Progress` (one step per compile); None makes one on stderr."""
    import jax
    import jax.numpy as jnp

    from custom_calls.activation import activation_quant_contig, activation_quant_masked
    from custom_calls.grouped_gemm import m_grouped_gemm_contig, m_grouped_gemm_masked
    from custom_calls.permute import permute_contig, permute_masked
    from custom_calls.unpermute import unpermute
    from moe_jax.bench._cli import Progress, run_untuned
    from moe_jax.dispatch import default_masked_m_pad, dispatch_contig, dispatch_masked
    from moe_jax.layer import moe_forward, routed_experts, stage_backend
    from moe_jax.routing import route

    own = progress is None
    if own:
        progress = Progress(name, total=1 + int(error) + STEPS_PER_BACKEND * len(backends))
    progress.step(f"{name}: parameters")
    cfg = _config(small)
    params = _bench_params(cfg)
    jax.block_until_ready(params.w13)
    e, h = cfg.num_experts, cfg.hidden_size
    recipe, arch, act = params.gemm_recipe, params.gemm_arch, cfg.activation
    w13, w2 = (params.w13, params.w13_scale), (params.w2, params.w2_scale)
    keys = jax.random.split(jax.random.PRNGKey(1), reps)
    xs = [jax.random.normal(kk, (m, h), jnp.bfloat16) for kk in keys]
    routed = [route(x, params, cfg) for x in xs]
    result = dict(shape=name, tokens=m, layout=layout, weights_GB=_weight_bytes(params) / 1e9,
                  platform=jax.default_backend())

    # params travel as jit arguments: closed over, 1.4 GB of weights would be embedded in every
    # program as constants (a minute of XLA compile per program at the prefill shape)
    def forward(backend, lay=layout):
        return lambda p, x, ids, w: routed_experts(x, ids, w, p, cfg, layout=lay, backend=backend)

    ref32 = None
    if error:
        progress.step(f"{name}: float32 model")
        ref32 = jax.block_until_ready(
            run_untuned(lambda p, x, i, w: _fp32_model(x, i, w, p, cfg), params, xs[0], *routed[0]))
    m_pad = default_masked_m_pad(m)
    for be in backends:
        row = dict(backend=be)
        progress.step(f"{name} {be}: implementations")
        try:
            row.update(_implementations(be, backends, lambda p, x: moe_forward(x, p, cfg, layout=layout, backend=be),
                                        params, xs[0]))
        except Exception as exc:  # e.g. an explicit backend that cannot run here: the row failed
            row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        if "error" in row or "same_as" in row:
            result[be] = row
            progress.drop(STEPS_PER_BACKEND - 1, f"{be}: " + ("failed" if "error" in row
                                                              else f"the {row['same_as']} row's code"))
            progress.note(json.dumps(dict(shape=name, **row)))
            continue
        # The reference backend is slow (one matmul per 128-row block against dequantized fp32
        # weights): one input set, fewer rounds.
        slow = be == "reference"
        n_sets = 1 if slow else reps
        kw = dict(rounds=2, chain=1) if slow else dict(chain=8)

        def timed(label, fn, arg_sets):
            progress.step(f"{name} {be}: {label}")
            return time_op(fn, arg_sets[:n_sets], **kw)

        def streamed(label, fn, arg_sets) -> StreamTime:
            """The steady stream and its marginal cost per call (`time_stream`); the slow
            reference gets `timed`'s figure and no marginal."""
            if slow:
                return StreamTime(timed(label, fn, arg_sets), float("nan"), float("nan"))
            progress.step(f"{name} {be}: {label}")
            return time_stream(fn, arg_sets[:n_sets], **kw)

        try:
            f = forward(be)
            e2e_sets = [(params, x, *r) for x, r in zip(xs, routed)]
            row["end_to_end_us"] = timed("end to end", f, e2e_sets) * 1e6
            progress.step(f"{name} {be}: end to end, kernel time")
            if not slow:  # the reference (one slow call per round) is not profiled
                row["kernel_time_us"] = _kernel_time_by_family(f, e2e_sets)
            fwd = lambda p, x: moe_forward(x, p, cfg, layout=layout, backend=be)  # noqa: E731
            fwd_sets = [(params, x) for x in xs]
            st = streamed("with routing", fwd, fwd_sets)
            row.update(with_routing_us=st.per_call * 1e6, with_routing_marginal_us=st.marginal * 1e6,
                       with_routing_stream_fixed_us=st.fixed * 1e6)
            progress.step(f"{name} {be}: with routing, burst and kernel time")
            if not slow:
                row["with_routing_burst_us"] = time_op(fwd, fwd_sets[:1], rounds=5, chain=1,
                                                       idle_s=BURST_IDLE_S) * 1e6
                row["with_routing_kernel_us"] = _kernel_time_by_family(fwd, fwd_sets)
            progress.step(f"{name} {be}: output")
            out = jax.jit(f)(params, xs[0], *routed[0])
            if ref32 is not None:
                row.update(_errors(out, ref32))
            other = "masked" if layout == "contig" else "contig"
            progress.step(f"{name} {be}: output, {other} layout")
            out_other = jax.jit(forward(be, other))(params, xs[0], *routed[0])
            row[f"vs_{other}_rel"] = _errors(out, out_other.astype(jnp.float32))["rel_err"]
            del out_other
            progress.note(f"{name} {be}: end to end {row['end_to_end_us']:.1f} us"
                          + (f", rel err {row['rel_err']:.2e}" if "rel_err" in row else ""))
            progress.step(f"{name} {be}: memory analysis")
            compiled = jax.jit(f).lower(params, xs[0], *routed[0]).compile()
            mem = compiled.memory_analysis()
            row["temp_MB"] = getattr(mem, "temp_size_in_bytes", float("nan")) / 1e6
            # stage by stage on the layer's own tensors
            stages = {}
            stages[STAGES[0]] = timed(STAGES[0], lambda p, x: route(x, p, cfg, backend=stage_backend(be, "route")),
                                      [(params, x) for x in xs])
            if layout == "contig":
                dc = lambda i: dispatch_contig(i, num_local_experts=e, alignment=cfg.alignment, backend=be)  # noqa: E731
                disp = [dc(i) for i, _ in routed[:n_sets]]
                rows = disp[0].num_rows_cap
                stages[STAGES[1]] = timed(STAGES[1], dc, [(i,) for i, _ in routed])
                perm = lambda x, s: permute_contig(x, s, num_rows=rows, recipe=recipe, arch=arch, backend=be)  # noqa: E731
                stages[STAGES[2]] = timed(STAGES[2], perm, [(x, d.src2dst) for x, d in zip(xs, disp)])
                lhs = [perm(x, d.src2dst) for x, d in zip(xs, disp)]
                g1 = lambda w, ws, a, s, mi: m_grouped_gemm_contig(a, w, mi, lhs_scale=s, rhs_scale=ws,  # noqa: E731
                                                                   recipe=recipe, arch=arch, alignment=cfg.alignment,
                                                                   backend=be)
                gemm_streams = [streamed(STAGES[3], g1, [(*w13, a, s, d.m_indices) for (a, s), d in zip(lhs, disp)])]
                stages[STAGES[3]] = gemm_streams[0].per_call
                gu = [g1(*w13, a, s, d.m_indices) for (a, s), d in zip(lhs, disp)]
                del lhs
                aq = lambda g: activation_quant_contig(g, act=act, recipe=recipe, arch=arch, backend=be)  # noqa: E731
                stages[STAGES[4]] = timed(STAGES[4], aq, [(g,) for g in gu])
                acts = [aq(g) for g in gu]
                del gu
                gemm_streams.append(streamed(STAGES[5], g1, [(*w2, a, s, d.m_indices) for (a, s), d in zip(acts, disp)]))
                stages[STAGES[5]] = gemm_streams[1].per_call
                ds = [g1(*w2, a, s, d.m_indices) for (a, s), d in zip(acts, disp)]
                del acts
                gemm_in_out = _gemm_activation_bytes(rows, h, cfg.intermediate_size)
            else:
                dm = lambda i: dispatch_masked(i, num_local_experts=e, m_pad=m_pad, num_experts_global=e,  # noqa: E731
                                               backend=be)
                disp = [dm(i) for i, _ in routed[:n_sets]]
                stages[STAGES[1]] = timed(STAGES[1], dm, [(i,) for i, _ in routed])
                perm = lambda x, s: permute_masked(x, s, num_groups=e, m_pad=m_pad, recipe=recipe, arch=arch, backend=be)  # noqa: E731
                stages[STAGES[2]] = timed(STAGES[2], perm, [(x, d.src2dst) for x, d in zip(xs, disp)])
                lhs = [perm(x, d.src2dst) for x, d in zip(xs, disp)]
                em = disp[0].expected_m
                g1 = lambda w, ws, a, s, mm: m_grouped_gemm_masked(a, w, mm, expected_m=em, lhs_scale=s,  # noqa: E731
                                                                   rhs_scale=ws, recipe=recipe, arch=arch, backend=be)
                gemm_streams = [streamed(STAGES[3], g1, [(*w13, a, s, d.masked_m) for (a, s), d in zip(lhs, disp)])]
                stages[STAGES[3]] = gemm_streams[0].per_call
                gu = [g1(*w13, a, s, d.masked_m) for (a, s), d in zip(lhs, disp)]
                del lhs
                aq = lambda g, mm: activation_quant_masked(g, mm, act=act, recipe=recipe, arch=arch, backend=be)  # noqa: E731
                stages[STAGES[4]] = timed(STAGES[4], aq, [(g, d.masked_m) for g, d in zip(gu, disp)])
                acts = [aq(g, d.masked_m) for g, d in zip(gu, disp)]
                del gu
                gemm_streams.append(streamed(STAGES[5], g1, [(*w2, a, s, d.masked_m) for (a, s), d in zip(acts, disp)]))
                stages[STAGES[5]] = gemm_streams[1].per_call
                ds = [g1(*w2, a, s, d.masked_m).reshape(e * m_pad, h) for (a, s), d in zip(acts, disp)]
                del acts
                gemm_in_out = _gemm_activation_bytes(e * m_pad, h, cfg.intermediate_size)
            stages[STAGES[6]] = timed(
                STAGES[6],
                lambda d, s, w: unpermute(d, s, w, routed_scaling_factor=cfg.routed_scaling_factor, backend=be),
                [(d, dd.src2dst, w) for d, dd, (_, w) in zip(ds, disp, routed)])
            del ds
            row["stages_us"] = {s: t * 1e6 for s, t in stages.items()}
            gemms = stages["GEMM1"] + stages["GEMM2"]
            row["gemms_us"] = gemms * 1e6
            row["gemms_marginal_us"] = sum(g.marginal for g in gemm_streams) * 1e6
            row["e2e_over_gemms"] = row["end_to_end_us"] / row["gemms_us"]
            row["temp_bound_MB"] = 1.25 * gemm_in_out / 1e6
            if fused and not slow:
                try:
                    row.update(_bench_fused(name, be, cfg, params, xs, routed, out, ref32, progress, timed, streamed))
                except Exception as exc:  # the staged row stands; the fused one failed
                    row["fused_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        except Exception as exc:  # report and go on with the other backends
            row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        result[be] = row
        progress.note(json.dumps(dict(shape=name, **row)))
    if own:
        progress.close()
    return result


def _kernel_time_by_family(fn, arg_sets) -> dict:
    """GPU time per call of fn (profiler trace), in us: total, DeepGEMM GEMMs (kernel names holding
    "deep_gemm"), Triton kernels (names ending in "_kernel", as every kernel of custom_calls.triton
    does), other (XLA fusions, memsets). {"error": why} where the profiler is unavailable."""
    from moe_jax.bench._timing import device_time

    try:
        per = device_time(fn, arg_sets)
    except Exception as exc:  # the profiler is optional: say why the column is missing
        return dict(error=f"{type(exc).__name__}: {exc}")
    total = per.pop("total")
    if not total:
        return dict(error="no GPU kernel in the profiler trace")
    gemm = sum(v for n, v in per.items() if "deep_gemm" in n)
    triton = sum(v for n, v in per.items() if n.endswith("_kernel"))
    return dict(total=total * 1e6, gemms=gemm * 1e6, triton=triton * 1e6, other=(total - gemm - triton) * 1e6)


def _f(v, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def _ratio(num: float | None, den: float | None) -> float | None:
    """num / den, None where either is missing, NaN or zero (a figure not measured)."""
    return num / den if num and den and num == num and den == den else None


def _marginal(row: dict, key: str) -> str:
    """", M us marginal (F us once per stream)" for a row's `time_stream` figures, "" where not
    measured."""
    m, fixed = row.get(f"{key}_marginal_us"), row.get(f"{key}_stream_fixed_us")
    if m is None or m != m:
        return ""
    return f", {m:.1f} us marginal ({_f(fixed, '.0f')} us once per stream)"


def _accelerated(row: dict) -> bool:
    """The row was measured and ran at least one accelerated implementation (not only the reference)."""
    return "end_to_end_us" in row and row.get("backend") != "reference" and not row.get("fell_back")


def _label(row: dict, platform: str) -> str:
    """The row's backend, with what it fell back to (see `_cli.fallback_note`)."""
    from moe_jax.bench._cli import fallback_note

    note = fallback_note(row.get("implementations", {}), platform)
    return f"{row['backend']} ({note})" if note else row["backend"]


def goals(results: list[dict], copy_gbps: float, backend: str = "auto") -> list[dict]:
    """The layer's two speed goals per measured shape of `backend` (only where it ran accelerated code):
    contig shapes: `moe_forward` including routing / (GEMM1 + GEMM2), goal <= PREFILL_GOAL; masked
    shapes: weights-once roofline / `moe_forward` including routing, goal >= DECODE_GOAL. "wall":
    steady-stream wall time (stages timed alone for the GEMMs), the goal's measure; "marginal": the
    same from what one more call adds to a running stream (`_timing.time_stream`: the stream's
    once-per-stream start-up and sync left out, GEMMs likewise), None where not measured;
    "kernel": GPU kernel time of `moe_forward` (its own GEMM kernels for the prefill ratio), no
    host time."""
    out = []

    def row_for(res, metric, us, marginal_us, kernel_us, gemms_kernel_us, row):
        if res["layout"] == "contig":
            wall, marg = us / row["gemms_us"], _ratio(marginal_us, row.get("gemms_marginal_us"))
            return dict(shape=res["shape"], tokens=res["tokens"], metric=f"{metric} / GEMMs", wall=wall,
                        marginal=marg, kernel=_ratio(kernel_us, gemms_kernel_us), goal=PREFILL_GOAL,
                        met=wall <= PREFILL_GOAL, met_marginal=marg is not None and marg <= PREFILL_GOAL)
        roof = res["weights_GB"] * 1e9 / (copy_gbps * 1e9) * 1e6
        wall, marg = roof / us, _ratio(roof, marginal_us)
        return dict(shape=res["shape"], tokens=res["tokens"], metric=f"roofline / {metric}", wall=wall,
                    marginal=marg, kernel=_ratio(roof, kernel_us), goal=DECODE_GOAL,
                    met=wall >= DECODE_GOAL, met_marginal=marg is not None and marg >= DECODE_GOAL,
                    roofline_us=roof)

    for res in results:
        row = res.get(backend, {})
        if not _accelerated(row) or "with_routing_us" not in row:
            continue
        kt = row.get("with_routing_kernel_us") or {}
        ok_kt = "error" not in kt and kt.get("total")
        gemms_kernel = kt.get("gemms") if ok_kt else None
        out.append(row_for(res, "with routing", row["with_routing_us"], row.get("with_routing_marginal_us"),
                           kt["total"] if ok_kt else None, gemms_kernel, row))
        if "fused_with_routing_us" in row:
            # the fused layout against the same yardsticks: the staged path's GEMM-only time (prefill),
            # the weights-once roofline (decode); its kernel time has no separate GEMM kernels
            fk = row.get("fused_with_routing_kernel_us") or {}
            out.append(row_for(res, "fused layout with routing", row["fused_with_routing_us"],
                               row.get("fused_with_routing_marginal_us"),
                               fk.get("total") if "error" not in fk else None, gemms_kernel, row))
    return out


def print_goals(rows: list[dict]) -> None:
    for g in rows:
        pct = g["metric"].startswith("roofline")
        fmt = (lambda v: "–" if v is None else f"{100 * v:.1f} %") if pct else (lambda v: _f(v, ".3f"))
        goal = f">= {100 * g['goal']:.0f} %" if pct else f"<= {g['goal']:.2f}"
        print(f"  goal {g['shape']:10s} {g['tokens']:6d} tokens: {g['metric']} {fmt(g['wall'])} steady wall, "
              f"{fmt(g.get('marginal'))} marginal, {fmt(g['kernel'])} GPU kernel time (goal {goal}: "
              f"{'met' if g['met'] else 'not met'}; marginal {'met' if g.get('met_marginal') else 'not met'})")


def print_table(results: list[dict], backends: list[str], device: str, copy_gbps: float, scaled: bool = False) -> None:
    """The human-readable table, on stdout. A speed-up or roofline figure is printed only for a
    backend that ran an accelerated implementation: one that fell back is the reference's code."""
    print(f"\ndevice {device}; copy bandwidth {copy_gbps:.0f} GB/s"
          + ("; shapes scaled down (--small), not the DeepSeek-V3 sizes" if scaled else ""))
    print_goals(goals(results, copy_gbps))
    for res in results:
        platform = res.get("platform", "?")
        print(f"\n== {res['shape']}: {res['tokens']} tokens, {res['layout']}, weights {res['weights_GB']:.2f} GB")
        for be in backends:
            row = res.get(be, {})
            if "error" in row:
                print(f"  {be}: FAILED {row['error']}")
                continue
            if "same_as" in row:
                print(f"  {_label(row, platform)}: the {row['same_as']} row's code, not measured again")
                continue
            other = row.get("vs_masked_rel", row.get("vs_contig_rel"))
            err = (f"rel err {_f(row['rel_err'], '.2e')} (worst row {_f(row['worst_row'], '.2e')})"
                   if "rel_err" in row else "rel err not computed (--no-error)")
            burst = row.get("with_routing_burst_us")
            print(f"  {_label(row, platform)}: end to end {row['end_to_end_us']:.1f} us (with routing "
                  f"{row['with_routing_us']:.1f} us steady" + _marginal(row, "with_routing")
                  + (f", {burst:.1f} us burst" if burst else "")
                  + f"), GEMMs {row['gemms_us']:.1f} us (e2e/GEMMs "
                  f"{row['e2e_over_gemms']:.3f}), {err}, contig vs masked {_f(other, '.1e')}, "
                  + _temp_text(row))
            if _accelerated(row):
                print("      implementations: " + ", ".join(f"{op} {b}" for op, b in row["implementations"].items()))
            kt = row.get("kernel_time_us")
            if kt and "error" not in kt:
                print(f"      end to end, GPU kernel time: {kt['total']:.1f} us = GEMMs {kt['gemms']:.1f} + Triton "
                      f"{kt['triton']:.1f} + other {kt['other']:.1f}"
                      + (f" (total/GEMMs {kt['total'] / kt['gemms']:.3f})" if kt["gemms"] else ""))
            elif kt:
                print(f"      end to end, GPU kernel time unavailable: {kt['error']}")
            kr = row.get("with_routing_kernel_us")
            if kr and "error" not in kr:
                print(f"      with routing, GPU kernel time: {kr['total']:.1f} us = GEMMs {kr['gemms']:.1f} + Triton "
                      f"{kr['triton']:.1f} + other {kr['other']:.1f}")
            for s, t in row["stages_us"].items():
                print(f"      {s:28s} {t:10.1f} us")
            if "fused_error" in row:
                print(f"      fused layout: FAILED {row['fused_error']}")
            if "fused_with_routing_us" in row:
                fk = row.get("fused_with_routing_kernel_us") or {}
                print(f"      fused layout: end to end {row['fused_end_to_end_us']:.1f} us, with routing "
                      f"{row['fused_with_routing_us']:.1f} us steady" + _marginal(row, "fused_with_routing")
                      + (f", {fk['total']:.1f} us GPU kernel time" if fk.get("total") else "")
                      + (f", rel err {_f(row['fused_rel_err'], '.2e')}" if "fused_rel_err" in row else "")
                      + f", vs the staged output {_f(row['fused_vs_staged_rel'], '.1e')}")
        auto, ref = res.get("auto", {}), res.get("reference", {})
        if res["layout"] == "masked" and _accelerated(auto):
            roof = res["weights_GB"] * 1e9 / (copy_gbps * 1e9) * 1e6
            print(f"  decode roofline (weights once at copy bandwidth) {roof:.1f} us -> "
                  f"{100 * roof / auto['end_to_end_us']:.0f}% of roofline")
        if _accelerated(auto) and "end_to_end_us" in ref:
            print(f"  auto vs reference: {ref['end_to_end_us'] / auto['end_to_end_us']:.1f}x")


def plot(path: str, results: list[dict], backends: list[str], device: str) -> None:
    """PNG: per shape, one stacked bar of the stage times per backend (black tick: the measured end to
    end time with routing, which the stages add up to)."""
    from moe_jax.bench._cli import plot_panels

    panels = []
    for res in results:
        ok = [be for be in backends if "stages_us" in res.get(be, {})]
        if not ok:
            continue
        panels.append(dict(
            title=f"{res['shape']}: {res['tokens']} tokens, {res['layout']}", ylabel="time per call (us)",
            groups=ok, stacks={s: [res[be]["stages_us"].get(s) for be in ok] for s in STAGES},
            totals=[res[be]["with_routing_us"] for be in ok], totals_label="end to end (with routing)"))
    plot_panels(path, panels, title=f"moe_jax layer stages, {device}")


def run(args) -> int:
    import jax

    from moe_jax.bench._cli import Progress, check_plot_available, exit_status, write_json

    if args.shared is not None:
        return run_shared(args)
    check_plot_available(args.plot)
    default = tuple(SHAPES) if jax.default_backend() == "gpu" else DEFAULT_SHAPES_NO_GPU
    backends, small, plan = _plan(args, default)
    error = not args.no_error
    per_backend = STEPS_PER_BACKEND + 3 * int(args.fused)
    progress = Progress("layer", total=len(plan) * (1 + int(error) + per_backend * len(backends)) + 1)
    results = [bench_shape(name, m, layout, backends, args.reps, small=small, error=error, progress=progress,
                           fused=args.fused)
               for name, m, layout in plan]
    progress.step("copy bandwidth")
    bw = _copy_bandwidth(1 << 20 if small else 1 << 30)
    progress.close()
    device = str(jax.devices()[0].device_kind)
    print_table(results, backends, device, bw / 1e9, scaled=small)
    if args.json:
        write_json(args.json, dict(device=device, jax=jax.__version__, backends=backends, copy_GBps=bw / 1e9,
                                   scaled=small, results=results))
    if args.plot:
        plot(args.plot, results, backends, device)
    return exit_status([f"{res['shape']} {be}" for res in results for be in backends if "error" in res.get(be, {})])


def _plan(args, default_shapes: tuple[str, ...]) -> tuple[list[str], bool, list[tuple[str, int, str]]]:
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


def _small_shapes(args, platform: str) -> bool:
    """--small, --full, or by default: full sizes on a GPU, scaled shapes elsewhere (the DeepSeek-V3
    sizes take minutes and tens of GB of memory on a CPU), said on stderr."""
    from moe_jax.bench._cli import log

    if args.small or args.full:
        return args.small
    if platform == "gpu":
        return False
    log(f"moe_jax.bench layer: no GPU (jax platform {platform!r}): running scaled shapes, as --small does "
        f"(64 / 16 tokens, 16 experts, H 256, I 128); --full runs the DeepSeek-V3 sizes")
    return True


def _copy_bandwidth(n: int) -> float:
    """Bytes/s (read + write) of an XLA elementwise pass over n float32 values (the f32 pass is the
    fastest XLA copy measured on the H200, so the decode roofline is not flattered)."""
    import jax
    import jax.numpy as jnp

    x = [jax.random.normal(jax.random.PRNGKey(i), (n,), jnp.float32) for i in range(2)]
    return 2 * x[0].size * 4 / time_op(lambda a: -a, [(a,) for a in x], chain=3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0] if __doc__ else None
    parser.add_argument("--shapes", default=None,
                        help=f"comma list of {', '.join(SHAPES)} (default: all on a GPU, "
                             f"{','.join(DEFAULT_SHAPES_NO_GPU)} scaled elsewhere)")
    parser.add_argument("--backends", default="auto,reference",
                        help="comma list of backend names (default: auto,reference)")
    parser.add_argument("--reps", type=int, default=4,
                        help="distinct input sets per timed dispatch (default 4; the reference backend uses 1)")
    parser.add_argument("--json", metavar="PATH", help="write every result row as JSON here")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG here: stacked stage times per backend and shape")
    parser.add_argument("--fused", action="store_true",
                        help="also time the fused layout (the routed branch as one kernel, MoEConfig(layout="
                             "'fused')) beside each accelerated row, with its goal ratios")
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


# -- shared experts: dense bf16, dense FP8, fused (--shared) ----------------------------------------

SHARED_VARIANTS = ("bf16", "fp8", "fused")


def _shared_setup(variant: str, small: bool):
    """(config, GEMM-form params) of the benchmark layer with one shared expert run as `variant`;
    the same random draws for every variant (fp8 and fused quantize the bf16 shared weights)."""
    cfg = dataclasses.replace(_config(small), n_shared_experts=1,
                              fuse_shared_experts=variant == "fused")
    return cfg, _bench_params(cfg, shared_recipe="bf16" if variant == "bf16" else "fp8_block")


def bench_shared(name: str, m: int, layout: str, variants: list[str], backends: list[str], reps: int, *,
                 small: bool, progress) -> dict:
    """One shape: {shape, tokens, layout, platform, <backend>: {<variant>: row}}; row keys: layer_us
    (routing included), shared_us (dense variants: the shared MLP alone), rel_vs_bf16 / rel_vs_fp8
    (‖out − out_variant‖ / ‖out_variant‖), implementations (as the stage table's rows), or error."""
    import jax
    import jax.numpy as jnp

    from moe_jax.bench._cli import rel_errors
    from moe_jax.layer import moe_forward, shared_experts

    keys = jax.random.split(jax.random.PRNGKey(1), reps)
    xs = None
    result = dict(shape=name, tokens=m, layout=layout, platform=jax.default_backend())
    for be in backends:
        rows, outs = {}, {}
        for v in variants:
            progress.step(f"shared {name} {be} {v}: parameters, implementations")
            row: dict = dict(backend=be, variant=v)
            try:
                cfg, params = _shared_setup(v, small)
                if xs is None:
                    xs = [jax.random.normal(kk, (m, cfg.hidden_size), jnp.bfloat16) for kk in keys]
                layer = lambda p, x, c=cfg: moe_forward(x, p, c, layout=layout, backend=be)  # noqa: E731
                row.update(_implementations(be, backends, layer, params, xs[0]))
                if "same_as" in row:
                    progress.drop(3, f"{be}: the {row['same_as']} row's code")
                    rows[v] = row
                    continue
                slow = be == "reference"
                kw = dict(rounds=2, chain=1) if slow else dict(chain=8)
                sets = [(params, x) for x in (xs[:1] if slow else xs)]
                progress.step(f"shared {name} {be} {v}: layer")
                row["layer_us"] = time_op(layer, sets, **kw) * 1e6
                progress.step(f"shared {name} {be} {v}: shared MLP")
                if v != "fused":
                    mlp = lambda p, x, c=cfg: shared_experts(x, p, c, backend=be)  # noqa: E731
                    row["shared_us"] = time_op(mlp, sets, **kw) * 1e6
                progress.step(f"shared {name} {be} {v}: output")
                outs[v] = jax.jit(layer)(params, xs[0]).astype(jnp.float32)
            except Exception as exc:  # e.g. an explicit backend that cannot run here: the row failed
                row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            rows[v] = row
            progress.note(json.dumps(dict(shape=name, **row)))
        for v, out in outs.items():
            for base in ("bf16", "fp8"):
                if base in outs and base != v:
                    rows[v][f"rel_vs_{base}"] = rel_errors(out, outs[base])[0]
        result[be] = rows
    return result


def print_shared_table(results: list[dict], variants: list[str], backends: list[str], device: str,
                       scaled: bool) -> None:
    """The shared-expert comparison on stdout, one line per (shape, backend, variant)."""
    labels = dict(bf16="bf16 dense", fp8="fp8 dense", fused="fp8 fused")
    print(f"\ndevice {device}; layer with one shared expert: dense bf16 / dense FP8 (gemm_nt) / FP8 fused into "
          f"the routed grouped GEMMs" + ("; shapes scaled down (--small)" if scaled else ""))
    for res in results:
        print(f"\n== shared experts, {res['shape']}: {res['tokens']} tokens, {res['layout']}")
        for be in backends:
            for v in variants:
                row = res[be][v]
                head = f"  {_label(row, res['platform']):>10s} {labels[v]:10s}"
                if "error" in row:
                    print(f"{head}: FAILED {row['error']}")
                elif "same_as" in row:
                    print(f"{head}: the {row['same_as']} row's code, not measured again")
                else:
                    rel = ", ".join(f"vs {b} {row[f'rel_vs_{b}']:.2e}" for b in ("bf16", "fp8") if f"rel_vs_{b}" in row)
                    print(f"{head}: layer {row['layer_us']:10.1f} us"
                          + (f", shared MLP {row['shared_us']:9.1f} us" if "shared_us" in row else " " * 26)
                          + (f", rel diff {rel}" if rel else ""))


def run_shared(args) -> int:
    """`--shared`: the shared-expert comparison (module docstring)."""
    import jax

    from moe_jax.bench._cli import Progress, exit_status, write_json

    variants = [v for v in args.shared.split(",") if v]
    if not variants or set(variants) - set(SHARED_VARIANTS):
        raise SystemExit(f"--shared: expected a comma list of {', '.join(SHARED_VARIANTS)}, got {args.shared!r}")
    if args.plot:
        raise SystemExit("--plot: the stage plot is not drawn with --shared")
    backends, small, plan = _plan(args, DEFAULT_SHAPES_NO_GPU)
    progress = Progress("layer --shared", total=len(plan) * len(backends) * len(variants) * 4)
    results = [bench_shared(name, m, layout, variants, backends, args.reps, small=small, progress=progress)
               for name, m, layout in plan]
    progress.close()
    device = str(jax.devices()[0].device_kind)
    print_shared_table(results, variants, backends, device, small)
    if args.json:
        write_json(args.json, dict(device=device, jax=jax.__version__, backends=backends, shared=variants,
                                   scaled=small, results=results))
    return exit_status([f"{r['shape']} {be} {v}" for r in results for be in backends for v in variants
                        if "error" in r[be][v]])
