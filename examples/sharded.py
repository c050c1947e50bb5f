"""One MoE layer sharded over 8 devices in every pattern, checked against the single-device layer.

    python examples/sharded.py          # on CPU: 8 host devices are simulated

Prints each pattern's max error relative to max |moe_forward| and ends with `OK`, or exits with
status 1 if one exceeds TOLERANCE (bf16 outputs, partial sums added in another order).

DP attention hands the MoE per-rank token buffers padded to a static size; the real counts travel
as an array (`num_tokens`). Attention-TP x EP keeps 1/attn_tp of the (replicated) tokens per rank.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from moe_jax import MoEConfig, init_params, moe_forward  # noqa: E402
from moe_jax.parallel import ParallelConfig, check_stats, shard_params, sharded_moe_forward  # noqa: E402

TOLERANCE = 2**-6


def main() -> int:
    devices = np.array(jax.devices()[:8])
    mesh = Mesh(devices.reshape(2, 4), ("dp", "mp"))  # 2 data-parallel replicas x 4-way MoE group
    config = MoEConfig.deepseek_v3().scaled(num_experts=16, top_k=4, hidden_size=256,
                                            intermediate_size=256, recipe="bf16")
    params = init_params(jax.random.key(0), config)
    tokens = 64  # global batch: 8 rows per device where tokens are sharded over all 8
    x = jax.random.normal(jax.random.key(1), (tokens, config.hidden_size), jnp.bfloat16)
    ref = np.asarray(jax.jit(moe_forward, static_argnames=("config",))(x, params, config=config),
                     np.float32)
    lengths = np.array([8, 5, 8, 0, 3, 8, 7, 1], np.int32)  # DP: real rows of each device's 8
    real = (np.arange(8)[None, :] < lengths[:, None]).reshape(-1)

    layouts = {
        "TP x TP-MoE": ParallelConfig("tp", moe_axes="mp"),
        "DP attention x TP-MoE": ParallelConfig("dp_tp", moe_axes="mp"),
        "attention-TP x EP (normal)": ParallelConfig("tp_ep", moe_axes=("dp", "mp"), attn_tp_axes="mp"),
        "DP x EP (normal)": ParallelConfig("dp_ep", moe_axes=("dp", "mp")),
        "DP x EP (low latency)": ParallelConfig("dp_ep", moe_axes=("dp", "mp"), ep_mode="low_latency",
                                                num_max_dispatch_tokens_per_rank=8),
        "DP x EP (ring)": ParallelConfig("dp_ep", moe_axes=("dp", "mp"), ep_mode="ring"),
    }
    failed = []
    step = jax.jit(sharded_moe_forward, static_argnames=("config", "mesh", "pc", "return_stats"))
    for name, pc in layouts.items():
        placed = shard_params(params, config, mesh, pc)  # weights stay put across steps
        dp = pc.pattern in ("dp_tp", "dp_ep")
        y, stats = step(x, placed, config=config, mesh=mesh, pc=pc, return_stats=True,
                        num_tokens=jnp.asarray(lengths) if dp else None)
        check_stats(stats)  # LL overflow / bad lengths would raise here
        want = np.where(real[:, None], ref, 0) if dp else ref
        err = np.abs(np.asarray(y, np.float32) - want).max() / np.abs(ref).max()
        print(f"{name:28s} max |y - moe_forward| / max |moe_forward| = {err:.1e}")
        if not err <= TOLERANCE:  # also catches nan
            failed.append(name)
    if failed:
        print(f"FAILED (error above {TOLERANCE:.1e}): {failed}")
        return 1
    print(f"OK: {len(layouts)} patterns agree with the single-device layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
