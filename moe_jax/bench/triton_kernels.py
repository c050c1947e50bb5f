"""Bandwidth of the Triton kernels at the prefill shape: ``python -m custom_calls.triton.bench``.

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
`--no-sweep` skips the tiling variants.
Also times what stays outside these kernels: routing (gate GEMM, XLA top-k and grouped top-k with
correction bias, E = 256, against the Triton routing epilogue) and the dispatcher's slot
assignment (stable argsort against the Triton two-pass ranking).
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from custom_calls._timing import device_time, time_op


def copy_bandwidth() -> dict:
    """Bytes/s (read + write) of 2 GiB passes: XLA elementwise (bf16, f32) and a Triton copy kernel."""
    import triton
    import triton.language as tl

    from custom_calls.triton.launch import triton_call

    @triton.jit
    def copy_kernel(x_ptr, y_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < N), mask=offs < N)

    n = 1 << 30
    xb = [jax.random.normal(jax.random.PRNGKey(i), (n,), jnp.bfloat16) for i in range(2)]
    res = dict(xla_bf16=2 * n * 2 / time_op(lambda a: -a, [(a,) for a in xb]))
    for block, warps in ((4096, 4), (8192, 8), (16384, 8)):
        t = time_op(lambda a: triton_call(a, kernel=copy_kernel, out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype)],
                                          grid=(n // block,), num_warps=warps, N=n, BLOCK=block)[0],
                    [(a,) for a in xb])
        res[f"triton_copy_{block}_{warps}w"] = 2 * n * 2 / t
    del xb
    xf = [jax.random.normal(jax.random.PRNGKey(i), (n // 2,), jnp.float32) for i in range(2)]
    res["xla_f32"] = 2 * n * 2 / time_op(lambda a: -a, [(a,) for a in xf])
    return res


def _nbytes(*arrays) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(arrays) if a is not None)


def _with(module, overrides: dict):
    """Context: set tiling constants of a kernel module (read at trace time), restore after."""
    import contextlib

    @contextlib.contextmanager
    def cm():
        old = {k: getattr(module, k) for k in overrides}
        for k, v in overrides.items():
            setattr(module, k, v)
        try:
            yield
        finally:
            for k, v in old.items():
                setattr(module, k, v)
    return cm()


def run(reps: int = 6, decode: bool = True, sweep: bool = True) -> list[dict]:
    from custom_calls.activation import ActivationSpec, activation_quant_contig, activation_quant_masked
    from custom_calls.act_quant import quantize_activation
    from custom_calls.permute import permute_contig, permute_masked
    from custom_calls.triton import activation_kernel, permute_kernel, quant_kernel, unpermute_kernel
    from custom_calls.triton import quantize_activation as triton_quantize_activation
    from custom_calls.unpermute import unpermute
    from moe_jax.dispatch import dispatch_contig, dispatch_masked

    m, k, h, inter, e, align = 4096, 8, 7168, 2048, 32, 128
    recipe, arch = "fp8_block", 90
    act = ActivationSpec(kind="silu", swiglu_limit=7.0)
    keys = jax.random.split(jax.random.PRNGKey(0), reps)

    def routes(key, m):
        return jnp.argsort(jax.random.uniform(key, (m, e)), axis=1)[:, :k].astype(jnp.int32)

    bws = copy_bandwidth()
    bw = max(bws.values())
    print(json.dumps({k: v / 1e9 for k, v in bws.items()}), flush=True)
    xs = [jax.random.normal(kk, (m, h), jnp.bfloat16) for kk in keys]
    disp = [dispatch_contig(routes(jax.random.fold_in(kk, 1), m), num_local_experts=e, alignment=align)
            for kk in keys]
    rows = disp[0].num_rows_cap
    table = []

    def add(name, fn, sets, nbytes, ref_fn=None):
        t = time_op(fn, sets)
        dev = device_time(fn, sets)
        k = dev.pop("total")
        row = dict(kernel=name, us=t * 1e6, kernel_us=k * 1e6, kernels={n: v * 1e6 for n, v in dev.items()},
                   GBps=nbytes / k / 1e9, pct_copy=100 * nbytes / k / bw, pct_4300=100 * nbytes / k / 4.3e12,
                   bytes=nbytes)
        if ref_fn is not None:
            tr = time_op(ref_fn, sets, rounds=3, chain=2)
            row.update(ref_us=tr * 1e6, speedup=tr / t)
        table.append(row)
        print(json.dumps(row), flush=True)

    def variants(module, default: dict, options: list[dict]):
        return [dict(default)] + (options if sweep else [])

    # 1. per-token-group quant (x -> e4m3 + fp32 MN-major image)
    q, img = quantize_activation(xs[0], recipe, arch)
    qbytes = _nbytes(xs[0], q, img)
    for ov in variants(quant_kernel, {}, [dict(_BLOCK_M=8), dict(_BLOCK_M=8, _NUM_WARPS=8), dict(_TILE=2048, _BLOCK_M=2),
                                          dict(_BLOCK_M=16, _NUM_WARPS=8), dict(_TILE=2048, _BLOCK_M=4, _NUM_WARPS=8),
                                          dict(_BLOCK_M=1, _NUM_WARPS=4), dict(_CHUNKS_FASTEST=False)]):
        with _with(quant_kernel, ov):
            add(f"quant (M,H) {ov}", lambda x: triton_quantize_activation(x, recipe, arch), [(x,) for x in xs],
                qbytes, (lambda x: quantize_activation(x, recipe, arch)) if not ov else None)
    # 2. permute contig: scatter + quant + zero rows
    lhs, img = permute_contig(xs[0], disp[0].src2dst, num_rows=rows, recipe=recipe, arch=arch)
    pbytes = _nbytes(xs[0], lhs, img, disp[0].src2dst)
    del lhs
    for ov in variants(permute_kernel, {}, [dict(_TOKENS=1), dict(_TOKENS=2), dict(_TOKENS=4, _NUM_WARPS=8),
                                            dict(_TOKENS=8, _NUM_WARPS=8), dict(_TOKENS=2, _TILE=2048, _NUM_WARPS=8),
                                            dict(_CHUNKS_FASTEST=False), dict(_IMAGE_ROWS=256, _IMAGE_GROUPS=4),
                                            dict(_IMAGE_ROWS=64, _IMAGE_GROUPS=16)]):
        with _with(permute_kernel, ov):
            add(f"permute_contig (M_cap={rows}) {ov}",
                lambda x, s: permute_contig(x, s, num_rows=rows, recipe=recipe, arch=arch, backend="triton"),
                [(x, d.src2dst) for x, d in zip(xs, disp)], pbytes,
                (lambda x, s: permute_contig(x, s, num_rows=rows, recipe=recipe, arch=arch, backend="reference"))
                if not ov else None)
    # 3. activation + quant contig
    gu = [jax.random.normal(kk, (rows, 2 * inter), jnp.bfloat16) for kk in keys]
    a, img = activation_quant_contig(gu[0], act=act, recipe=recipe, arch=arch)
    abytes = _nbytes(gu[0], a, img)
    for ov in variants(activation_kernel, {}, [dict(_NUM_WARPS=8), dict(_TILE_ELEMS=8192, _NUM_WARPS=8),
                                                dict(_TILE_ELEMS=2048), dict(_TILE_ELEMS=8192, _ROW_TILE=2048, _NUM_WARPS=8),
                                                dict(_CHUNKS_FASTEST=False)]):
        with _with(activation_kernel, ov):
            add(f"act_quant_contig silu+limit {ov}",
                lambda g: activation_quant_contig(g, act=act, recipe=recipe, arch=arch, backend="triton"),
                [(g,) for g in gu], abytes,
                (lambda g: activation_quant_contig(g, act=act, recipe=recipe, arch=arch, backend="reference"))
                if not ov else None)
    del gu
    # 4. unpermute
    ds = [jax.random.normal(kk, (rows, h), jnp.bfloat16) for kk in keys]
    ws = [jax.random.uniform(kk, (m, k)) for kk in keys]
    ubytes = m * k * h * 2 + _nbytes(disp[0].src2dst, ws[0]) + m * h * 2
    for ov in variants(unpermute_kernel, {}, [dict(_NUM_WARPS=8), dict(_BLOCK_H=2048, _NUM_WARPS=8),
                                               dict(_BLOCK_H=512, _NUM_WARPS=2)]):
        with _with(unpermute_kernel, ov):
            add(f"unpermute {ov}", lambda d, s, w: unpermute(d, s, w, routed_scaling_factor=2.5, backend="triton"),
                [(d, dd.src2dst, w) for d, dd, w in zip(ds, disp, ws)], ubytes,
                (lambda d, s, w: unpermute(d, s, w, routed_scaling_factor=2.5, backend="reference"))
                if not ov else None)
    del ds
    # jnp stages outside the kernels
    ids = [routes(jax.random.fold_in(kk, 1), m) for kk in keys]
    for be in ("reference", "triton"):
        t = time_op(lambda i: dispatch_contig(i, num_local_experts=e, alignment=align, backend=be), [(i,) for i in ids])
        table.append(dict(kernel=f"dispatch_contig ({be} ranking)", us=t * 1e6))
        print(json.dumps(table[-1]), flush=True)
    for name, t in routing_bench(m, reps).items():
        table.append(dict(kernel=f"routing {name}" + ("" if "triton" in name else " (XLA)"), us=t * 1e6))
        print(json.dumps(table[-1]), flush=True)
    if decode:
        md, m_pad = 128, 256
        xd = [jax.random.normal(kk, (md, h), jnp.bfloat16) for kk in keys]
        dm = [dispatch_masked(routes(jax.random.fold_in(kk, 2), md), num_local_experts=e, m_pad=m_pad,
                              num_experts_global=e) for kk in keys]
        _, img = permute_masked(xd[0], dm[0].src2dst, num_groups=e, m_pad=m_pad, recipe=recipe, arch=arch)
        add("decode permute_masked (bytes of routed rows)",
            lambda x, s: permute_masked(x, s, num_groups=e, m_pad=m_pad, recipe=recipe, arch=arch, backend="triton"),
            [(x, d.src2dst) for x, d in zip(xd, dm)], _nbytes(xd[0], img, dm[0].src2dst) + md * k * h,
            lambda x, s: permute_masked(x, s, num_groups=e, m_pad=m_pad, recipe=recipe, arch=arch,
                                        backend="reference"))
        gm = [jax.random.normal(kk, (e, m_pad, 2 * inter), jnp.bfloat16) for kk in keys]
        real = md * k
        add("decode act_quant_masked (bytes of real rows)",
            lambda g, mm: activation_quant_masked(g, mm, act=act, recipe=recipe, arch=arch, backend="triton"),
            [(g, d.masked_m) for g, d in zip(gm, dm)], real * (2 * inter * 2 + inter + 16 * 4),
            lambda g, mm: activation_quant_masked(g, mm, act=act, recipe=recipe, arch=arch, backend="reference"))
        ds = [jax.random.normal(kk, (e * m_pad, h), jnp.bfloat16) for kk in keys]
        wd = [jax.random.uniform(kk, (md, k)) for kk in keys]
        add("decode unpermute", lambda d, s, w: unpermute(d, s, w, routed_scaling_factor=2.5, backend="triton"),
            [(d, dd.src2dst, w) for d, dd, w in zip(ds, dm, wd)], md * k * h * 2 + md * h * 2,
            lambda d, s, w: unpermute(d, s, w, routed_scaling_factor=2.5, backend="reference"))
    return [dict(copy_GBps={k: v / 1e9 for k, v in bws.items()})] + table


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

    return dict(grouped_topk=time_op(selection("reference"), [(lg,) for lg in logits]),
                grouped_topk_triton=time_op(selection("triton"), [(lg,) for lg in logits]),
                plain_topk=time_op(lambda lg: jax.lax.top_k(lg, cfg.top_k), [(lg,) for lg in logits]),
                gate_gemm=time_op(lambda x: router_logits(x, gw), [(x,) for x in xs]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6, help="distinct input sets per timed dispatch")
    parser.add_argument("--json", help="write the table here")
    parser.add_argument("--no-sweep", action="store_true", help="only the default tiling of each kernel")
    args = parser.parse_args(argv)
    table = run(args.reps, sweep=not args.no_sweep)
    print(f"{'op':64s} {'wall us':>8s} {'kern us':>8s} {'GB/s':>6s} {'%copy':>6s} {'%4.3T':>6s} {'ref us':>8s} "
          f"{'x ref':>6s}")
    print("copy bandwidth (GB/s, read + write): " + ", ".join(f"{k} {v:.0f}" for k, v in table[0]["copy_GBps"].items()))
    nan = float("nan")
    for r in table[1:]:
        print(f"{r['kernel'][:64]:64s} {r['us']:8.1f} {r.get('kernel_us', nan):8.1f} {r.get('GBps', nan):6.0f} "
              f"{r.get('pct_copy', nan):6.1f} {r.get('pct_4300', nan):6.1f} {r.get('ref_us', nan):8.1f} "
              f"{r.get('speedup', nan):6.1f}")
        if len(r.get("kernels", {})) > 1:
            print("    " + ", ".join(f"{n[:40]} {v:.1f}" for n, v in r["kernels"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
