"""``python -m moe_jax.bench parallel``: the parallel patterns on whatever devices jax sees (1, 2, 8,
... GPUs; or CPU).

    python -m moe_jax.bench parallel                       # small shapes, every pattern / EP mode
    python -m moe_jax.bench parallel --model v3 --tokens 128,4096 --iters 20   # DeepSeek-V3 sizes

One row per (pattern, EP mode, tokens per device): median step time over --iters timed runs after
--warmup runs (block_until_ready; fresh random inputs, burst protocol: the GPU idles between
configurations), tokens/s, the bytes per device the layout moves (moe_jax.parallel.bytes, uniform
routing), the implied GB/s, the max error against single-device `moe_forward` (--check, small
shapes only: the reference runs on one device), and the routes the low-latency mode dropped over
the timed runs (--capacity below the tokens per device), and, for a backend other than
"reference", the ops that fell back to the reference implementation (from the backend registry).
Everything is one 1-D mesh over all devices.
A pattern the mesh cannot hold (it does not divide the experts or the intermediate size) is
skipped and says why; a row that fails makes the exit status 1.
"""

from __future__ import annotations

import argparse
import time

CASES = (("tp", "-"), ("dp_tp", "-"), ("dp_ep", "normal"), ("dp_ep", "low_latency"),
         ("dp_ep", "ring"), ("tp_ep", "normal"), ("tp_ep", "ring"))


def _config(model: str, n: int, recipe: str):
    from layouts import get_recipe
    from moe_jax import MoEConfig

    if model == "v3":
        return MoEConfig.deepseek_v3(recipe=recipe)
    e = max(16, 2 * n)
    quantized = get_recipe(recipe).is_quantized
    return MoEConfig.deepseek_v3().scaled(num_experts=e, top_k=4, hidden_size=512,
                                          intermediate_size=128 * max(1, n // 2) if quantized else 64 * n,
                                          recipe=recipe, fit_routing=True)


def _traffic(config, n, tokens, pattern, mode, capacity, platform) -> float:
    """Computed bytes per device for the row the run exercises (normal: ragged on GPU, dense else)."""
    from layouts import get_recipe
    from moe_jax.parallel.bytes import layer_traffic

    wire = "fp8" if get_recipe(config.recipe).is_quantized else "bf16"
    label = {"normal": "normal (ragged)" if platform == "gpu" else "normal (dense)",
             "low_latency": "low_latency", "ring": "ring"}.get(mode, "-")
    for t in layer_traffic(config, n, tokens, capacity=capacity):
        if t.pattern == pattern and t.mode.startswith(label) and (mode == "-" or t.wire == wire):
            return t.bytes_per_gpu
    return float("nan")


def bench(model: str = "small", recipe: str = "bf16", tokens=(128,), iters: int = 10,
          warmup: int = 2, check: bool = True, capacity: int | None = None,
          backend: str = "reference") -> list[dict]:
    """Rows: {pattern, mode, tokens, ...}; "skipped": why the mesh cannot hold the pattern;
    "error": why the row failed."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from moe_jax import init_params, moe_forward
    from moe_jax.bench._cli import fallback_note, resolved_backends
    from moe_jax.parallel.config import ParallelConfig
    from moe_jax.parallel.patterns import sharded_moe_forward
    from moe_jax.parallel.sharding import shard_params

    devs = np.array(jax.devices())
    n = devs.size
    mesh = Mesh(devs, ("x",))
    config = _config(model, n, recipe)
    params = init_params(jax.random.key(0), config)
    f = jax.jit(sharded_moe_forward, static_argnames=("config", "mesh", "pc", "backend", "return_stats"))
    ref_fn = jax.jit(moe_forward, static_argnames=("config",))
    rows = []
    for t in tokens:
        for pattern, mode in CASES:
            if pattern == "tp" and n > 1 and config.intermediate_size % n:
                rows.append(dict(pattern=pattern, mode=mode, tokens=t,
                                 skipped=f"{n} devices do not divide intermediate_size {config.intermediate_size}"))
                continue
            cap = capacity or t
            kw = dict(pattern=pattern, moe_axes=("x",))
            if mode != "-":
                kw.update(ep_mode=mode, num_max_dispatch_tokens_per_rank=cap)
            pc = ParallelConfig(**kw)
            try:
                placed = shard_params(params, config, mesh, pc)
            except ValueError as e:  # e.g. a mesh that does not divide E or I
                rows.append(dict(pattern=pattern, mode=mode, tokens=t, skipped=str(e)))
                continue
            # tokens per device t: replicated patterns ("tp", "tp_ep") hold t rows on every device
            total = t if pattern in ("tp", "tp_ep") else t * n
            spec = P(None, None) if pattern in ("tp", "tp_ep") else P("x", None)
            try:
                note = ""
                if backend != "reference":  # what the registry resolved each op to, for this pattern
                    x = jax.device_put(jnp.zeros((total, config.hidden_size), jnp.bfloat16), NamedSharding(mesh, spec))
                    impls = resolved_backends(lambda x, p: f(x, p, config=config, mesh=mesh, pc=pc, backend=backend,
                                                             return_stats=True), x, placed)
                    note = fallback_note(impls, devs.flat[0].platform)
                times, dropped = [], 0
                for i in range(warmup + iters):
                    x = jax.random.normal(jax.random.key(100 + i), (total, config.hidden_size), jnp.bfloat16)
                    x = jax.device_put(x, NamedSharding(mesh, spec))
                    jax.block_until_ready(x)
                    t0 = time.perf_counter()
                    y, stats = jax.block_until_ready(f(x, placed, config=config, mesh=mesh, pc=pc,
                                                       backend=backend, return_stats=True))
                    if i >= warmup:
                        times.append(time.perf_counter() - t0)
                        dropped += int(np.asarray(stats["dropped"]).sum())
                sec = float(np.median(times))
                err = float("nan")
                if check:
                    ref = ref_fn(jax.device_put(x, devs[0]), jax.device_put(params, devs[0]), config=config)
                    r = np.asarray(ref, np.float32)
                    err = float(np.abs(np.asarray(y, np.float32) - r).max() / max(np.abs(r).max(), 1e-30))
            except Exception as e:  # report the row as failed and go on
                rows.append(dict(pattern=pattern, mode=mode, tokens=t, error=f"{type(e).__name__}: {str(e)[:300]}"))
                continue
            b = _traffic(config, n, t, pattern, mode, cap, devs.flat[0].platform)
            rows.append(dict(pattern=pattern, mode=mode, tokens=t, devices=n, ms=sec * 1e3,
                             tok_per_s=total / sec, mb=b / 1e6, gbps=b / sec / 1e9, rel_err=err,
                             dropped=dropped, fallback=note))
    return rows


def run(a) -> int:
    import jax

    from moe_jax.bench._cli import exit_status, write_json

    rows = bench(a.model, a.recipe, tuple(int(v) for v in a.tokens.split(",")), a.iters, a.warmup,
                 check=not a.no_check and a.model == "small", capacity=a.capacity, backend=a.backend)
    dev = jax.devices()[0]
    print(f"# {len(jax.devices())} x {dev.device_kind} ({dev.platform}), model={a.model}, "
          f"recipe={a.recipe}, backend={a.backend}, median of {a.iters} after {a.warmup} warm-up (burst)")
    print("| pattern | EP mode | tok/dev | ms | tok/s | MB/dev (computed) | GB/s | rel err "
          "| dropped routes | fell back |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        if "skipped" in r or "error" in r:
            what = f"skipped: {r['skipped']}" if "skipped" in r else f"FAILED: {r['error']}"
            print(f"| {r['pattern']} | {r['mode']} | {r['tokens']} | {what} |||||||")
            continue
        print(f"| {r['pattern']} | {r['mode']} | {r['tokens']} | {r['ms']:.3f} | {r['tok_per_s']:.0f} | "
              f"{r['mb']:.2f} | {r['gbps']:.2f} | {r['rel_err']:.1e} | {r['dropped']} | {r['fallback'] or '–'} |")
    if a.json:
        write_json(a.json, dict(devices=len(jax.devices()), device=str(dev.device_kind), model=a.model,
                                recipe=a.recipe, backend=a.backend, rows=rows))
    return exit_status([f"{r['pattern']} {r['mode']} {r['tokens']} tokens" for r in rows if "error" in r])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.description = __doc__.split("\n\n")[0] if __doc__ else None
    ap.add_argument("--model", choices=("small", "v3"), default="small")
    ap.add_argument("--recipe", default="bf16")
    ap.add_argument("--tokens", default="128", help="tokens per device, comma separated")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=None, help="LL capacity (default: tokens)")
    ap.add_argument("--backend", default="reference", help="kernels: reference | auto | deep_gemm ...")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--json", metavar="PATH", help="write every row as JSON here")
    ap.set_defaults(func=run)
