"""jax version differences the parallel package must bridge (jax 0.10.x on CPU, 0.11.x on GPU)."""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import Mesh


def shard_map(f: Callable, mesh: Mesh, in_specs, out_specs, check: bool = False) -> Callable:
    """`jax.shard_map` where it exists, else `jax.experimental.shard_map.shard_map`.

    Replication checking is off by default: the EP paths hand out per-rank values (counts, dropped
    routes) whose replication the checker cannot infer across ragged collectives.
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as _sm  # pragma: no cover - older jax

    return _sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check)


def mesh_platform(mesh: Mesh) -> str:
    """Platform of the mesh's devices ("cpu", "gpu", "tpu"); read at trace time, never at import."""
    return mesh.devices.flat[0].platform


def check_auto_axes(mesh: Mesh) -> None:
    """shard_map over Explicit mesh axes demands inputs already laid out as the specs say; this
    package lays inputs out itself, so it needs Auto axes."""
    types = getattr(mesh, "axis_types", None)
    if types is None:
        return
    auto = getattr(jax.sharding, "AxisType", None)
    if auto is None:
        return
    bad = [n for n, t in zip(mesh.axis_names, types) if t != auto.Auto]
    if bad:
        raise ValueError(
            f"mesh: axes {bad} are not AxisType.Auto (got {tuple(types)}); build the mesh with "
            "jax.sharding.Mesh(devices, names) or jax.make_mesh(..., axis_types=(AxisType.Auto,) * n)")
