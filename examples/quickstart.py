"""Run a scaled DeepSeek-V3 layer and a scaled DeepSeek-V4 layer on the default backend.

    python3 examples/quickstart.py [--tokens 64] [--backend reference|auto]

Prints, per layer: output norm, a text histogram of how many routes each expert received, and
the time per jitted call (median of several, after a warm-up call that compiles).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import moe_jax as mj
from moe_jax import MoEConfig


def histogram(topk_ids: np.ndarray, num_experts: int, width: int = 40) -> str:
    counts = np.bincount(topk_ids.reshape(-1), minlength=num_experts)
    top = max(int(counts.max()), 1)
    return "\n".join(f"  expert {e:3d} | {'#' * round(width * c / top):<{width}} {c}"
                     for e, c in enumerate(counts))


def run(name: str, config: MoEConfig, tokens: int, backend: str, repeats: int = 10) -> None:
    key_p, key_x, key_t = jax.random.split(jax.random.key(0), 3)
    params = mj.prepare_params(mj.init_params(key_p, config), config)  # once, at load time
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
    print(f"== {name}: E={config.num_experts} top_k={config.top_k} H={config.hidden_size} "
          f"I={config.intermediate_size} recipe={config.recipe} (GEMMs: {params.gemm_recipe}, "
          f"arch {params.gemm_arch}) tokens={tokens} backend={backend} on {jax.default_backend()}")
    print(f"  output norm {float(jnp.linalg.norm(y.astype(jnp.float32))):.4f}   "
          f"time per call {1e3 * statistics.median(times):.2f} ms (median of {repeats})")
    print("  routes per expert:")
    print(histogram(np.asarray(ids), config.num_experts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--backend", default="reference")
    args = ap.parse_args()
    small = dict(num_experts=32, hidden_size=256, intermediate_size=256)
    run("DeepSeek-V3 (scaled)", MoEConfig.deepseek_v3().scaled(**small), args.tokens, args.backend)
    run("DeepSeek-V4 (scaled)", MoEConfig.deepseek_v4().scaled(**small), args.tokens, args.backend)
    run("DeepSeek-V4 hash-routed layer (scaled)",
        MoEConfig.deepseek_v4(hash_routing=True).scaled(vocab_size=1024, **small), args.tokens,
        args.backend)


if __name__ == "__main__":
    main()
