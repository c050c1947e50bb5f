"""Run scaled DeepSeek-V3 and DeepSeek-V4 MoE layers and check each against float64 NumPy.

    python3 examples/quickstart.py [--tokens 64] [--backend reference|auto]

For each layer: what its recipe and arch mean, how the tokens were routed, the time per jitted
call, and the largest difference from an independent float64 NumPy evaluation of the same layer
(examples/numpy_reference.py: same weights, the recipe's quantization emulated) against a
tolerance. Ends with OK, or exits with status 1 naming the layers that disagree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np

import moe_jax as mj
from moe_jax import MoEConfig
from numpy_reference import moe_layer

RECIPES = {
    "bf16": "bf16 weights and activations",
    "fp8_block": "FP8 (e4m3) weights with one scale per 128x128 block, activations quantized to FP8 "
                 "per 128 values of each token",
    "mxfp8": "FP8 (e4m3) weights and activations with one power-of-two scale per 32 values",
    "mxfp4": "4-bit (e2m1) weights with one power-of-two scale per 32 values, FP8 activations",
}
ARCHS = {90: "Hopper GPUs (H100 / H200)", 100: "Blackwell GPUs (B200 / B300)"}
# max |y - y_np| / max |y_np| allowed, by recipe. NumPy rounds the same tensors to bf16 and e4m3 at
# the same places as the layer. bf16: what remains is the layer's final bf16 rounding (2^-9 of an
# element) and fp32 sums rounding an intermediate to the neighbouring bf16 value; measured up to
# 3.6e-3 (64 to 1000 tokens, two seeds), so 2^-7. FP8 activations: a bf16 value divided by its
# group's fp32 scale (amax / 448) often lands exactly between two e4m3 values, and then the last
# bits of the scale (this file's and the JAX reference's differ there) or a sum taken in another
# order on a GPU pick the neighbour: implementations legitimately differ by one e4m3 step (up to
# 1/8 of a value) in about 0.5 % of the activations; measured 1.3e-2 to 2.4e-2, so 2^-4. A wrong
# expert, weight, scale or scaling factor is of order 1.
TOLERANCE = {"bf16": 2**-7, "fp8_block": 2**-4, "mxfp8": 2**-4, "mxfp4": 2**-4}


def describe(config: MoEConfig, params: mj.MoEParams, backend: str) -> list[str]:
    lines = [f"recipe {config.recipe}: {RECIPES[config.recipe]}"]
    arch = params.gemm_arch
    line = f"arch {arch}: the GEMMs use the scale formats of {ARCHS[arch]}"
    if params.gemm_recipe != config.recipe:
        line += f"; {config.recipe} has no GEMM there: its weights became {params.gemm_recipe} once, at load"
    platform = jax.default_backend()
    if platform != "gpu":
        line += f"; on this {platform.upper()} the reference backend emulates them"
        if backend == "auto":
            line += " ('auto' picks it: no GPU)"
    return lines + [line]


def routing_summary(ids: np.ndarray, ids_np: np.ndarray, config: MoEConfig) -> list[str]:
    counts = np.bincount(ids.reshape(-1), minlength=config.num_experts)
    how = "a table lookup of the token id" if config.hash_routing else f"{config.scoring} scores"
    if config.use_grouped_topk and not config.hash_routing:
        how += f", best {config.topk_group} of {config.n_group} expert groups"
    same = int((np.sort(ids, axis=1) == np.sort(ids_np, axis=1)).all(axis=1).sum())
    return [f"routing by {how}: {ids.shape[0]} tokens x top-{config.top_k} = {ids.size} routes, "
            f"{counts.min()} to {counts.max()} per expert (mean {counts.mean():.0f})",
            f"NumPy routes {same} of {ids.shape[0]} tokens to the same experts"]


def run(name: str, config: MoEConfig, tokens: int, backend: str, repeats: int = 10) -> bool:
    """Run one layer, print what it is and how it compares with NumPy; True when within tolerance."""
    key_p, key_x, key_t = jax.random.split(jax.random.key(0), 3)
    raw = mj.init_params(key_p, config)                  # checkpoint form, what NumPy reads
    params = mj.prepare_params(raw, config)              # GEMM form, once, at load time
    x = jax.random.normal(key_x, (tokens, config.hidden_size), jnp.float32).astype(jnp.bfloat16)
    token_ids = None
    if config.hash_routing:
        token_ids = jax.random.randint(key_t, (tokens,), 0, config.vocab_size, jnp.int32)
    forward = jax.jit(mj.moe_forward, static_argnames=("config", "layout", "backend"))
    y = forward(x, params, config=config, token_ids=token_ids, backend=backend).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        forward(x, params, config=config, token_ids=token_ids, backend=backend).block_until_ready()
        times.append(time.perf_counter() - t0)

    ids, _ = mj.route(x, params, config, token_ids=token_ids)
    weights = {k: np.asarray(v) for k, v in vars(raw).items() if isinstance(v, jax.Array)}
    y_np, ids_np = moe_layer(np.asarray(x, np.float64), weights, config,
                          None if token_ids is None else np.asarray(token_ids),
                          gemm_recipe=params.gemm_recipe, gemm_arch=params.gemm_arch)
    y64 = np.asarray(y.astype(jnp.float32), np.float64)
    err = float(np.max(np.abs(y64 - y_np)) / np.max(np.abs(y_np)))
    tol = TOLERANCE[config.recipe]
    ok = bool(np.isfinite(y64).all()) and err <= tol

    n_shared = config.n_shared_experts
    lines = [*describe(config, params, backend), *routing_summary(np.asarray(ids), ids_np, config),
             f"{tokens} tokens on the {backend} backend ({jax.default_backend()}): "
             f"{1e3 * statistics.median(times):.2f} ms per call (median of {repeats})",
             f"vs float64 NumPy: max |y - y_np| / max |y_np| = {err:.1e} (tolerance {tol:.1e}) "
             f"{'ok' if ok else 'DISAGREES'}"]
    print(f"== {name}: {config.num_experts} experts, top-{config.top_k}, hidden {config.hidden_size}, "
          f"intermediate {config.intermediate_size}, {n_shared} shared expert{'s' * (n_shared != 1)}")
    for line in lines:
        print(textwrap.fill(line, width=100, initial_indent="   ", subsequent_indent="     "))
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--backend", default="reference", help="reference | auto (GPU kernels where they run)")
    args = ap.parse_args(argv)
    small = dict(num_experts=32, hidden_size=256, intermediate_size=256)
    layers = {
        "DeepSeek-V3 (scaled)": MoEConfig.deepseek_v3().scaled(**small),
        "DeepSeek-V4 (scaled)": MoEConfig.deepseek_v4().scaled(**small),
        "DeepSeek-V4 hash-routed layer (scaled)":
            MoEConfig.deepseek_v4(hash_routing=True).scaled(vocab_size=1024, **small),
    }
    failed = [name for name, config in layers.items() if not run(name, config, args.tokens, args.backend)]
    if failed:
        print(f"FAILED: {', '.join(failed)} disagree with float64 NumPy")
        return 1
    print(f"OK: {len(layers)} layers agree with float64 NumPy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
