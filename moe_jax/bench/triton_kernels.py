"""``python -m moe_jax.bench triton``: bandwidth of the Triton kernels at the prefill shape.

Shape (DeepSeek-V3 layer on one rank): M = 4096 tokens, top_k 8, H 7168, I 2048, 32 local experts
(all of them), contig alignment 128, fp8_block on arch 90; decode: 128 tokens, masked, m_pad 256.
Bytes: every input read once, every output written once (the minimum; the contig buffers count
their padding rows, which the kernels write). Ceilings, measured in the same run: XLA elementwise
passes (bf16, f32) and a Triton copy kernel over 2 GiB; the table gives % of the best of them and
% of 4.3 TB/s. Time: a jitted function runs the op on R distinct input sets (together larger than
the L2). "kernel": the GPU time of every kernel (and memset) the op launches, per call, from a
profiler trace of 3 such calls; the bandwidth columns use it. "wall": 4 calls dispatched back to
back, one sync, wall time / (4 R), median of 5 rounds after a warm-up (sustained clock); for
short ops it also holds host dispatch that the GPU waits for, which inside the layer overlaps
other work. The reference ops (pure JAX through XLA) are timed by wall clock the same way.
Each kernel runs with its heuristic config (`heuristic_config` of its module, what the "triton"
backend uses), then with tiling variants passed as configs; `--no-sweep` skips the variants.
Also times what stays outside these kernels: routing (gate GEMM, XLA top-k and grouped top-k with
correction bias, E = 256, against the Triton routing epilogue) and the dispatcher's slot
assignment (stable argsort against the Triton two-pass ranking).
`--routing-only`: routing epilogue and dispatch map alone (`run_routing`), old path against new
at the DeepSeek-V3 prefill (4096 and 16384 tokens, contig) and decode (128 tokens, masked)
shapes, 32 local experts of 256: gate GEMM; epilogue = XLA reference, the Triton kernel at the
former tiling (8 tokens per program, 4 warps), at the heuristic tiling; dispatch map = XLA
reference (argsort), the former path (three Triton ranking kernels + XLA placement), the fused
dispatch-map kernels; route + dispatch together, old and new, as one jitted function. Each row:
wall and kernel time as above and the GPU kernels it launched; unless `--no-sweep`, the epilogue
also at the tilings of ROUTING_SWEEP.
Needs a CUDA GPU with jax_triton; elsewhere it exits with status 2 and says so; status 1 when a
row failed. Output: the table on stdout, one JSON line per row on stderr, `--json PATH`.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp

from moe_jax.bench._cli import failure, log
from moe_jax.bench._timing import device_time, time_op


def copy_bandwidth() -> dict:
    """Bytes/s (read + write) of 2 GiB passes: XLA elementwise (bf16, f32) and a Triton copy kernel."""
    import triton
    import triton.language as tl

    from custom_calls.triton.launch import triton_call

    @triton.jit
    def copy_kernel(x_ptr, y_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < N), mask=offs < N)

    def triton_copy(block: int, warps: int):
        return lambda a: triton_call(a, kernel=copy_kernel, out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype)],
                                     grid=(n // block,), num_warps=warps, N=n, BLOCK=block)[0]

    n = 1 << 30
    xb = [jax.random.normal(jax.random.PRNGKey(i), (n,), jnp.bfloat16) for i in range(2)]
    res = {"xla_bf16": 2 * n * 2 / time_op(lambda a: -a, [(a,) for a in xb])}
    for block, warps in ((4096, 4), (8192, 8), (16384, 8)):
        t = time_op(triton_copy(block, warps), [(a,) for a in xb])
        res[f"triton_copy_{block}_{warps}w"] = 2 * n * 2 / t
    del xb
    xf = [jax.random.normal(jax.random.PRNGKey(i), (n // 2,), jnp.float32) for i in range(2)]
    res["xla_f32"] = 2 * n * 2 / time_op(lambda a: -a, [(a,) for a in xf])
    return res


def _nbytes(*arrays) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(arrays) if a is not None)


def configs(default, variants: list[dict], sweep: bool) -> list[tuple[str, object]]:
    """(label, config) pairs: the kernel's heuristic config, then (with `sweep`) each variant, the
    heuristic with the given fields replaced."""
    out = [("heuristic", default)]
    if sweep:
        out += [(" ".join(f"{k}={v}" for k, v in ch.items()), dataclasses.replace(default, **ch)) for ch in variants]
    return out


# Tiling variants timed against each kernel's heuristic config (fields of its config dataclass).
QUANT_SWEEP = [{"block_m": 8}, {"block_m": 8, "num_warps": 8}, {"tile": 2048, "block_m": 2},
               {"block_m": 16, "num_warps": 8}, {"tile": 2048, "num_warps": 8}, {"block_m": 1},
               {"chunks_fastest": False}]
PERMUTE_SWEEP = [{"tokens": 1}, {"tokens": 2}, {"num_warps": 8}, {"tokens": 8, "num_warps": 8},
                 {"tokens": 2, "tile": 2048, "num_warps": 8}, {"chunks_fastest": False},
                 {"image_rows": 256, "image_groups": 4}, {"image_rows": 64, "image_groups": 16}]
ACT_SWEEP = [{"num_warps": 8}, {"block_m": 8, "num_warps": 8}, {"block_m": 2}, {"tile": 2048, "num_warps": 8},
             {"chunks_fastest": False}]
UNPERMUTE_SWEEP = [{"num_warps": 8}, {"block_h": 2048, "num_warps": 8}, {"block_h": 512, "num_warps": 2}]

# The shapes of the table (module docstring): prefill tokens, top-k, H, I, local experts, contig
# alignment; decode tokens and their masked m_pad; the unpermute's routed_scaling_factor.
_M, _K, _H, _INTER, _E, _ALIGN = 4096, 8, 7168, 2048, 32, 128
_RECIPE, _ARCH = "fp8_block", 90
_DECODE_M, _DECODE_M_PAD = 128, 256
_SCALE = 2.5


def _routes(key, m: int) -> jax.Array:
    """Random routes of m tokens: _K distinct experts of _E each (int32)."""
    return jnp.argsort(jax.random.uniform(key, (m, _E)), axis=1)[:, :_K].astype(jnp.int32)


def _activation_spec():
    from custom_calls.activation import ActivationSpec

    return ActivationSpec(kind="silu", swiglu_limit=7.0)


def _kernel_row(name: str, fn, sets: list[tuple], nbytes: int, bw: float, ref_fn=None, config=None) -> dict:
    """A kernel's row: wall and kernel time of fn over the argument sets, bandwidth from the kernel
    time (against `bw`, the best copy ceiling, and 4.3 TB/s), and the reference's wall time when
    `ref_fn` is given; "error" when it failed."""
    row = {"kernel": name, "bytes": nbytes}
    if config is not None:
        row["config"] = dataclasses.asdict(config)
    try:
        t = time_op(fn, sets)
        dev = device_time(fn, sets)
        kt = dev.pop("total")
        row.update(us=t * 1e6, kernel_us=kt * 1e6, kernels={n: v * 1e6 for n, v in dev.items()},
                   GBps=nbytes / kt / 1e9, pct_copy=100 * nbytes / kt / bw, pct_4300=100 * nbytes / kt / 4.3e12)
        if ref_fn is not None:
            tr = time_op(ref_fn, sets, rounds=3, chain=2)
            row.update(ref_us=tr * 1e6, speedup=tr / t)
    except Exception as exc:  # noqa: BLE001  report the row as failed and go on
        row["error"] = failure(exc)
    return row


@dataclasses.dataclass
class _Table:
    """The rows being built, each logged as a JSON line on stderr when added; `bw`: the best copy
    ceiling (B/s) that the bandwidth columns compare with."""

    bw: float
    rows: list[dict] = dataclasses.field(default_factory=list)

    def append(self, row: dict) -> None:
        self.rows.append(row)
        log(json.dumps(row))

    def add(self, name: str, fn, sets: list[tuple], nbytes: int, ref_fn=None, config=None) -> None:
        self.append(_kernel_row(name, fn, sets, nbytes, self.bw, ref_fn, config))

    def add_sweep(self, name: str, kernel, default, variants: list[dict], sweep: bool, sets: list[tuple],
                  nbytes: int, ref_fn) -> None:
        """One row per config of `configs(default, variants, sweep)`, timing kernel(*args, config=c);
        the heuristic's row also times `ref_fn`."""
        for label, cfg in configs(default, variants, sweep):
            self.add(f"{name} {label}", functools.partial(kernel, config=cfg), sets, nbytes,
                     ref_fn if label == "heuristic" else None, config=cfg)


def run(reps: int = 6, decode: bool = True, sweep: bool = True) -> list[dict]:
    """The rows of the table (the first holds the copy ceilings); a row that failed holds "error"."""
    from moe_jax.dispatch import dispatch_contig

    keys = jax.random.split(jax.random.PRNGKey(0), reps)
    bws = copy_bandwidth()
    log(json.dumps({k: v / 1e9 for k, v in bws.items()}))
    table = _Table(bw=max(bws.values()))
    xs = [jax.random.normal(kk, (_M, _H), jnp.bfloat16) for kk in keys]
    disp = [dispatch_contig(_routes(jax.random.fold_in(kk, 1), _M), num_local_experts=_E, alignment=_ALIGN)
            for kk in keys]
    _quant_rows(table, xs, sweep)
    _permute_rows(table, xs, disp, sweep)
    _activation_rows(table, keys, disp[0].num_rows_cap, sweep)
    _unpermute_rows(table, keys, disp, sweep)
    _outside_rows(table, keys, reps)
    if decode:
        _decode_rows(table, keys)
    return [{"copy_GBps": {k: v / 1e9 for k, v in bws.items()}}] + table.rows


def _quant_rows(table: _Table, xs: list, sweep: bool) -> None:
    """Per-token-group quant (x -> e4m3 + fp32 MN-major image)."""
    from custom_calls.act_quant import quantize_activation
    from custom_calls.triton import quant_kernel

    def kernel(x, config):
        return quant_kernel.quantize_activation(x, _RECIPE, _ARCH, config=config)

    def reference(x):
        return quantize_activation(x, _RECIPE, _ARCH)

    q, img = quantize_activation(xs[0], _RECIPE, _ARCH)
    table.add_sweep("quant (M,H)", kernel, quant_kernel.heuristic_config(_RECIPE, _ARCH), QUANT_SWEEP, sweep,
                    [(x,) for x in xs], _nbytes(xs[0], q, img), reference)


def _permute_rows(table: _Table, xs: list, disp: list, sweep: bool) -> None:
    """Permute contig: scatter + quant + zero rows."""
    from custom_calls.permute import permute_contig
    from custom_calls.triton import permute_kernel

    rows = disp[0].num_rows_cap

    def kernel(x, s, config):
        return permute_kernel.permute_contig(x, s, num_rows=rows, recipe=_RECIPE, arch=_ARCH, config=config)

    def reference(x, s):
        return permute_contig(x, s, num_rows=rows, recipe=_RECIPE, arch=_ARCH, backend="reference")

    lhs, img = permute_contig(xs[0], disp[0].src2dst, num_rows=rows, recipe=_RECIPE, arch=_ARCH)
    nbytes = _nbytes(xs[0], lhs, img, disp[0].src2dst)
    del lhs, img
    table.add_sweep(f"permute_contig (M_cap={rows})", kernel, permute_kernel.heuristic_config(_RECIPE),
                    PERMUTE_SWEEP, sweep, [(x, d.src2dst) for x, d in zip(xs, disp)], nbytes, reference)


def _activation_rows(table: _Table, keys, rows: int, sweep: bool) -> None:
    """Activation + quant, contig, on random gate-up rows."""
    from custom_calls.activation import activation_quant_contig
    from custom_calls.triton import activation_kernel

    act = _activation_spec()

    def kernel(g, config):
        return activation_kernel.activation_quant_contig(g, act=act, recipe=_RECIPE, arch=_ARCH, config=config)

    def reference(g):
        return activation_quant_contig(g, act=act, recipe=_RECIPE, arch=_ARCH, backend="reference")

    gu = [jax.random.normal(kk, (rows, 2 * _INTER), jnp.bfloat16) for kk in keys]
    a, img = activation_quant_contig(gu[0], act=act, recipe=_RECIPE, arch=_ARCH)
    table.add_sweep("act_quant_contig silu+limit", kernel, activation_kernel.heuristic_config(_INTER, _RECIPE),
                    ACT_SWEEP, sweep, [(g,) for g in gu], _nbytes(gu[0], a, img), reference)


def _unpermute_rows(table: _Table, keys, disp: list, sweep: bool) -> None:
    """Unpermute (weighted sum of each token's routed rows) on random GEMM2 outputs."""
    from custom_calls.triton import unpermute_kernel
    from custom_calls.unpermute import unpermute

    def kernel(d, s, w, config):
        return unpermute_kernel.unpermute(d, s, w, routed_scaling_factor=_SCALE, out_dtype=jnp.bfloat16,
                                          config=config)

    def reference(d, s, w):
        return unpermute(d, s, w, routed_scaling_factor=_SCALE, backend="reference")

    ds = [jax.random.normal(kk, (disp[0].num_rows_cap, _H), jnp.bfloat16) for kk in keys]
    ws = [jax.random.uniform(kk, (_M, _K)) for kk in keys]
    nbytes = _M * _K * _H * 2 + _nbytes(disp[0].src2dst, ws[0]) + _M * _H * 2
    table.add_sweep("unpermute", kernel, unpermute_kernel.heuristic_config(), UNPERMUTE_SWEEP, sweep,
                    [(d, dd.src2dst, w) for d, dd, w in zip(ds, disp, ws)], nbytes, reference)


def _outside_rows(table: _Table, keys, reps: int) -> None:
    """What stays outside the kernels, by wall time: the dispatcher's slot assignment per ranking
    backend, and routing (`routing_bench`)."""
    from moe_jax.dispatch import dispatch_contig

    ids = [_routes(jax.random.fold_in(kk, 1), _M) for kk in keys]
    for be in ("reference", "triton"):
        dispatch = functools.partial(dispatch_contig, num_local_experts=_E, alignment=_ALIGN, backend=be)
        t = time_op(dispatch, [(i,) for i in ids])
        table.append({"kernel": f"dispatch_contig ({be} ranking)", "us": t * 1e6})
    for name, t in routing_bench(_M, reps).items():
        table.append({"kernel": f"routing {name}" + ("" if "triton" in name else " (XLA)"), "us": t * 1e6})


def _decode_rows(table: _Table, keys) -> None:
    """The decode shape (masked): permute, activation + quant, unpermute at their heuristic configs."""
    from custom_calls.activation import activation_quant_masked
    from custom_calls.permute import permute_masked
    from custom_calls.triton import activation_kernel, permute_kernel, unpermute_kernel
    from custom_calls.unpermute import unpermute
    from moe_jax.dispatch import dispatch_masked

    md, m_pad, act, bf16 = _DECODE_M, _DECODE_M_PAD, _activation_spec(), jnp.bfloat16
    masked = {"num_groups": _E, "m_pad": m_pad, "recipe": _RECIPE, "arch": _ARCH}
    xd = [jax.random.normal(kk, (md, _H), bf16) for kk in keys]
    dm = [dispatch_masked(_routes(jax.random.fold_in(kk, 2), md), num_local_experts=_E, m_pad=m_pad,
                          num_experts_global=_E) for kk in keys]
    _, img = permute_masked(xd[0], dm[0].src2dst, **masked)
    table.add("decode permute_masked (bytes of routed rows)",
              lambda x, s: permute_kernel.permute_masked(x, s, **masked),
              [(x, d.src2dst) for x, d in zip(xd, dm)], _nbytes(xd[0], img, dm[0].src2dst) + md * _K * _H,
              lambda x, s: permute_masked(x, s, **masked, backend="reference"))
    gm = [jax.random.normal(kk, (_E, m_pad, 2 * _INTER), bf16) for kk in keys]
    quant = {"act": act, "recipe": _RECIPE, "arch": _ARCH}
    table.add("decode act_quant_masked (bytes of real rows)",
              lambda g, mm: activation_kernel.activation_quant_masked(g, mm, **quant),
              [(g, d.masked_m) for g, d in zip(gm, dm)], md * _K * (2 * _INTER * 2 + _INTER + 16 * 4),
              lambda g, mm: activation_quant_masked(g, mm, **quant, backend="reference"))
    ds = [jax.random.normal(kk, (_E * m_pad, _H), bf16) for kk in keys]
    wd = [jax.random.uniform(kk, (md, _K)) for kk in keys]
    table.add("decode unpermute",
              lambda d, s, w: unpermute_kernel.unpermute(d, s, w, routed_scaling_factor=_SCALE, out_dtype=bf16),
              [(d, dd.src2dst, w) for d, dd, w in zip(ds, dm, wd)], md * _K * _H * 2 + md * _H * 2,
              lambda d, s, w: unpermute(d, s, w, routed_scaling_factor=_SCALE, backend="reference"))


def routing_bench(m: int = 4096, reps: int = 6) -> dict:
    """Seconds of DeepSeek-V3 expert selection on (M, 256) logits: sigmoid, correction bias,
    8 groups / top-4 groups, top-8, renormalized (`custom_calls.route_topk`, reference = XLA and
    Triton), and of plain top-8; the gate GEMM (M, H) x (H, 256) fp32 is timed apart."""
    from custom_calls.route_topk import route_topk
    from moe_jax.config import MoEConfig
    from moe_jax.routing import router_logits

    cfg = MoEConfig.deepseek_v3()
    keys = jax.random.split(jax.random.PRNGKey(7), reps)
    logits = [jax.random.normal(k, (m, cfg.num_experts), jnp.float32) for k in keys]
    bias = 0.1 * jax.random.normal(jax.random.PRNGKey(8), (cfg.num_experts,), jnp.float32)
    xs = [jax.random.normal(k, (m, cfg.hidden_size), jnp.bfloat16) for k in keys]
    gw = jax.random.normal(jax.random.PRNGKey(9), (cfg.num_experts, cfg.hidden_size), jnp.float32)

    def selection(backend):
        return lambda lg: route_topk(lg, bias, top_k=cfg.top_k, scoring=cfg.scoring, n_group=cfg.n_group,
                                     topk_group=cfg.topk_group, norm_topk_prob=True, backend=backend)

    return {"grouped_topk": time_op(selection("reference"), [(lg,) for lg in logits]),
            "grouped_topk_triton": time_op(selection("triton"), [(lg,) for lg in logits]),
            "plain_topk": time_op(lambda lg: jax.lax.top_k(lg, cfg.top_k), [(lg,) for lg in logits]),
            "gate_gemm": time_op(lambda x: router_logits(x, gw), [(x,) for x in xs])}


ROUTING_SHAPES = (("prefill", 4096, "contig"), ("prefill", 16384, "contig"), ("decode", 128, "masked"))
ROUTING_LOCAL_EXPERTS = 32  # of DeepSeek-V3's 256: one rank of an 8-way expert-parallel layer


ROUTING_SWEEP = ((1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (16, 4))  # epilogue (block_t, num_warps) variants


def routing_cases(tokens: int, layout: str, sweep: bool = False) -> dict:
    """{row label: (input name, fn)} of `--routing-only` for one shape (fns of x, logits or ids,
    jit-able): gate GEMM, the epilogue variants (with `sweep`, also the ROUTING_SWEEP tilings),
    the dispatch-map variants on ids routed beforehand, and route + dispatch old and new."""
    from custom_calls.dispatch_map import (
        dispatch_map_contig,
        dispatch_map_contig_xla,
        dispatch_map_masked,
        dispatch_map_masked_xla,
    )
    from custom_calls.route_topk import route_topk
    from moe_jax.config import MoEConfig
    from moe_jax.dispatch import default_masked_m_pad
    from moe_jax.routing import router_logits

    cfg = MoEConfig.deepseek_v3()
    e_loc, align, m_pad = ROUTING_LOCAL_EXPERTS, cfg.alignment, default_masked_m_pad(tokens)
    bias = 0.1 * jax.random.normal(jax.random.PRNGKey(8), (cfg.num_experts,), jnp.float32)
    gw = (0.02 * jax.random.normal(jax.random.PRNGKey(9), (cfg.num_experts, cfg.hidden_size))).astype(jnp.bfloat16)
    sel = {"top_k": cfg.top_k, "scoring": cfg.scoring, "n_group": cfg.n_group, "topk_group": cfg.topk_group,
           "norm_topk_prob": True}

    def epilogue(which, tiling=None):
        def run(lg):
            if which == "reference":
                return route_topk(lg, bias, **sel, backend="reference")
            from custom_calls.triton import routing_kernel

            config = routing_kernel.RouteTopkConfig(*tiling) if tiling else None
            return routing_kernel.route_topk(lg, bias, **sel, config=config)
        return run

    def dispatch(which):
        def run(ids):
            if layout == "contig":
                kw = {"num_local_experts": e_loc, "alignment": align}
                if which == "old":
                    return dispatch_map_contig_xla(ids, 0, **kw, rank_backend="triton")
                return dispatch_map_contig(ids, 0, **kw, backend="triton" if which == "new" else "reference")
            kw = {"num_local_experts": e_loc, "m_pad": m_pad}
            if which == "old":
                return dispatch_map_masked_xla(ids, 0, **kw, rank_backend="triton")
            return dispatch_map_masked(ids, 0, **kw, backend="triton" if which == "new" else "reference")
        return run

    former = (8, 4)  # the epilogue's tiling at every M before the decode tiling

    def both(which):
        route = epilogue(which, former if which == "old" else None)
        return lambda x: dispatch(which)(route(router_logits(x, gw))[0])

    cases = {"gate GEMM (bf16 x bf16 -> f32)": ("x", lambda x: router_logits(x, gw)),
             "epilogue: XLA reference": ("logits", epilogue("reference")),
             "epilogue: Triton, former tiling (8 tok/program, 4 warps)": ("logits", epilogue("old", former)),
             "epilogue: Triton, heuristic tiling": ("logits", epilogue("new"))}
    if sweep:
        cases.update({f"epilogue: Triton, block_t={bt} num_warps={nw}": ("logits", epilogue("new", (bt, nw)))
                      for bt, nw in ROUTING_SWEEP})
    return cases | {f"dispatch {layout}: XLA reference (argsort)": ("ids", dispatch("reference")),
                    f"dispatch {layout}: former (3 Triton ranking kernels + XLA)": ("ids", dispatch("old")),
                    f"dispatch {layout}: fused dispatch-map kernels": ("ids", dispatch("new")),
                    "route + dispatch: former": ("x", both("old")),
                    "route + dispatch: new": ("x", both("new"))}


def run_routing(reps: int = 6, shapes=ROUTING_SHAPES, sweep: bool = True) -> list[dict]:
    """Rows of `--routing-only` (module docstring); a row that failed holds "error"."""
    table = []
    for phase, m, layout in shapes:
        inputs = _routing_inputs(m, reps)
        for label, (arg, fn) in routing_cases(m, layout, sweep).items():
            row = {"kernel": f"{phase} M={m} {label}", "phase": phase, "tokens": m, "layout": layout}
            _time_routing_row(row, fn, [(a,) for a in inputs[arg]])
            table.append(row)
            log(json.dumps(row))
    return table


def _routing_inputs(m: int, reps: int) -> dict[str, list]:
    """`reps` random sets of m tokens, by the name `routing_cases` gives its input: x, logits, ids."""
    from moe_jax.config import MoEConfig

    cfg = MoEConfig.deepseek_v3()
    keys = jax.random.split(jax.random.PRNGKey(m), reps)
    inputs = {"x": [jax.random.normal(kk, (m, cfg.hidden_size), jnp.bfloat16) for kk in keys],
              "logits": [jax.random.normal(kk, (m, cfg.num_experts), jnp.float32) for kk in keys]}
    # routes as the layer sees them: top-8 of 256 (distinct per token), about 1/8 held here
    inputs["ids"] = [jnp.argsort(jax.random.uniform(kk, (m, cfg.num_experts)), axis=1)[:, :cfg.top_k]
                     .astype(jnp.int32) for kk in keys]
    return inputs


def _time_routing_row(row: dict, fn, sets: list[tuple]) -> None:
    """Wall time, then kernel time of fn, into `row` field by field (a failure keeps what was measured)."""
    try:
        row["us"] = time_op(fn, sets) * 1e6
        dev = device_time(fn, sets)
        row["kernel_us"] = dev.pop("total") * 1e6
        row["kernels"] = {n: v * 1e6 for n, v in dev.items()}
    except Exception as exc:  # noqa: BLE001  report the row as failed and go on
        row["error"] = failure(exc)


def print_routing_table(table: list[dict]) -> None:
    print(f"{'route / dispatch (DeepSeek-V3, 32 local experts of 256)':76s} {'wall us':>8s} {'kern us':>8s} "
          f"{'kernels':>7s}")
    for r in table:
        if "error" in r:
            print(f"{r['kernel'][:76]:76s} FAILED {r['error']}")
            continue
        print(f"{r['kernel'][:76]:76s} {r['us']:8.1f} {r['kernel_us']:8.1f} {len(r['kernels']):7d}")
        if r["kernels"]:
            print("    " + ", ".join(f"{n[:40]} {v:.1f}" for n, v in r["kernels"].items()))


def gpu_reason() -> str | None:
    """Why the Triton kernels cannot run here (they need a CUDA GPU and jax_triton), or None."""
    from custom_calls.triton.launch import missing_dependencies

    platform = jax.default_backend()
    if platform != "gpu":
        return f"needs a CUDA GPU visible to jax (compute capability >= 8.9); jax platform is {platform!r}"
    missing = missing_dependencies()
    if missing:
        return f"needs the Python package(s) {missing} (pip install 'moe-jax[gpu]')"
    return None


def print_table(table: list[dict]) -> None:
    print(f"{'op':64s} {'wall us':>8s} {'kern us':>8s} {'GB/s':>6s} {'%copy':>6s} {'%4.3T':>6s} {'ref us':>8s} "
          f"{'x ref':>6s}")
    print("copy bandwidth (GB/s, read + write): " + ", ".join(f"{k} {v:.0f}" for k, v in table[0]["copy_GBps"].items()))
    nan = float("nan")
    for r in table[1:]:
        if "error" in r:
            print(f"{r['kernel'][:64]:64s} FAILED {r['error']}")
            continue
        print(f"{r['kernel'][:64]:64s} {r['us']:8.1f} {r.get('kernel_us', nan):8.1f} {r.get('GBps', nan):6.0f} "
              f"{r.get('pct_copy', nan):6.1f} {r.get('pct_4300', nan):6.1f} {r.get('ref_us', nan):8.1f} "
              f"{r.get('speedup', nan):6.1f}")
        if len(r.get("kernels", {})) > 1:
            print("    " + ", ".join(f"{n[:40]} {v:.1f}" for n, v in r["kernels"].items()))


def run_cli(args) -> int:
    from moe_jax.bench._cli import cannot_run, exit_status, write_json

    if cannot_run("moe_jax.bench triton", gpu_reason()):
        return 2
    if args.routing_only:
        table = run_routing(args.reps, sweep=not args.no_sweep)
        print_routing_table(table)
        failed = [r["kernel"] for r in table if "error" in r]
    else:
        table = run(args.reps, sweep=not args.no_sweep)
        print_table(table)
        failed = [r["kernel"] for r in table[1:] if "error" in r]
    if args.json:
        write_json(args.json, table)
    return exit_status(failed)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0] if __doc__ else None
    parser.add_argument("--reps", type=int, default=6, help="distinct input sets per timed dispatch (default 6)")
    parser.add_argument("--json", metavar="PATH", help="write every row as JSON here")
    parser.add_argument("--no-sweep", action="store_true", help="only the heuristic config of each kernel")
    parser.add_argument("--routing-only", action="store_true",
                        help="only routing epilogue + dispatch map, former path against new, at the prefill "
                             "(4096, 16384 tokens) and decode (128 tokens) shapes")
    parser.set_defaults(func=run_cli)
