"""Parallel MoE: the attention x MoE parallel patterns (docs/ARCHITECTURE.md) as `shard_map` programs over a `Mesh` (single- or
multi-host alike), EP dispatch/combine in three modes, and the bytes each moves.
CLIs (not imported here): `python -m moe_jax.parallel.bytes` (computed bytes per layer),
`python -m moe_jax.bench parallel` (timings on whatever devices jax sees).

    pc = ParallelConfig("dp_ep", moe_axes=("ep",), ep_mode="normal")
    params = shard_params(params, config, mesh, pc)
    y = jax.jit(sharded_moe_forward, static_argnames=("config", "mesh", "pc"))(
        x, params, config=config, mesh=mesh, pc=pc)
"""

from moe_jax.parallel.config import (A2A_IMPLS, DEFAULT_NUM_MAX_DISPATCH_TOKENS_PER_RANK, EP_MODES,
                                     PATTERNS, ParallelConfig)
from moe_jax.parallel.ep_common import EPGroup, SendQuant, send_quant_for
from moe_jax.parallel.ep_low_latency import ep_moe_low_latency, ll_combine, ll_dispatch
from moe_jax.parallel.ep_normal import (NormalHandle, NormalRecv, ep_moe_normal, normal_combine,
                                        normal_dispatch)
from moe_jax.parallel.ep_ring import ep_moe_ring
from moe_jax.parallel.patterns import check_stats, sharded_moe_forward
from moe_jax.parallel.sharding import from_tp_view, param_specs, place, shard_params, to_tp_view

__all__ = [
    "A2A_IMPLS", "DEFAULT_NUM_MAX_DISPATCH_TOKENS_PER_RANK", "EP_MODES", "PATTERNS", "ParallelConfig",
    "EPGroup", "SendQuant", "send_quant_for",
    "ep_moe_low_latency", "ll_combine", "ll_dispatch",
    "NormalHandle", "NormalRecv", "ep_moe_normal", "normal_combine", "normal_dispatch",
    "ep_moe_ring", "check_stats", "sharded_moe_forward",
    "from_tp_view", "param_specs", "place", "shard_params", "to_tp_view",
]
