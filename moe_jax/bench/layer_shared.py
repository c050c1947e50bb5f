"""Measuring ``python -m moe_jax.bench layer --shared``: the benchmark layer with one shared expert run
as dense bf16, dense FP8 or FP8 fused into the routed GEMMs, side by side (layer.py's docstring)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from moe_jax.bench._cli import Progress, failure, rel_errors
from moe_jax.bench.layer_measure import RowTimer, _implementations
from moe_jax.bench.layer_model import _bench_params, _config

SHARED_VARIANTS = ("bf16", "fp8", "fused")
STEPS_PER_VARIANT = 4  # parameters and implementations, layer, shared MLP, output


def _shared_setup(variant: str, small: bool, model: str) -> tuple[Any, Any]:
    """(config, GEMM-form params) of the benchmark layer with one shared expert run as `variant`;
    the same random draws for every variant (fp8 and fused quantize the bf16 shared weights)."""
    cfg = dataclasses.replace(_config(small, model), n_shared_experts=1,
                              fuse_shared_experts=variant == "fused")
    return cfg, _bench_params(cfg, shared_recipe="bf16" if variant == "bf16" else "fp8_block")


def bench_shared(name: str, m: int, layout: str, variants: list[str], backends: list[str], reps: int, *,
                 small: bool, progress: Progress, model: str = "v3") -> dict:
    """One shape: {shape, tokens, layout, platform, <backend>: {<variant>: row}}; row keys: layer_us
    (routing included), shared_us (dense variants: the shared MLP alone), rel_vs_bf16 / rel_vs_fp8
    (‖out − out_variant‖ / ‖out_variant‖), implementations (as the stage table's rows), or error."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(1), reps)
    xs = [jax.random.normal(kk, (m, _config(small, model).hidden_size), jnp.bfloat16) for kk in keys]
    result = {"shape": name, "model": model, "tokens": m, "layout": layout, "platform": jax.default_backend()}
    for be in backends:
        rows, outs = {}, {}
        for v in variants:
            timer = RowTimer(progress, f"shared {name} {be} {v}", slow=be == "reference", reps=reps)
            timer.step("parameters, implementations")
            rows[v] = {"backend": be, "variant": v}
            try:
                out = _bench_variant(rows[v], v, layout, backends, (small, model), timer, xs)
                if out is not None:
                    outs[v] = out
            except Exception as exc:  # noqa: BLE001  e.g. an explicit backend that cannot run here: the row failed
                rows[v]["error"] = failure(exc)
            if "same_as" not in rows[v]:  # its drop said so already
                progress.note(json.dumps(dict(shape=name, **rows[v])))
        _add_rel_diffs(rows, outs)
        result[be] = rows
    return result


def _bench_variant(row: dict, variant: str, layout: str, backends: list[str], size: tuple[bool, str],
                   timer: RowTimer, xs: list) -> Any:
    """Fills `row` of one variant and backend (field by field: a failure keeps what was measured);
    returns the layer's output on xs[0] as f32, None when the row runs the code of a row measured
    anyway. size: (scaled down?, model)."""
    import jax
    import jax.numpy as jnp

    from moe_jax.layer import moe_forward, shared_experts

    be = row["backend"]
    cfg, params = _shared_setup(variant, *size)

    def layer(p, x):
        return moe_forward(x, p, cfg, layout=layout, backend=be)

    def shared_mlp(p, x):
        return shared_experts(x, p, cfg, backend=be)

    row.update(_implementations(be, backends, layer, params, xs[0]))
    if "same_as" in row:
        timer.progress.drop(STEPS_PER_VARIANT - 1, f"{be}: the {row['same_as']} row's code")
        return None
    sets = [(params, x) for x in xs]
    row["layer_us"] = timer.timed("layer", layer, sets) * 1e6
    timer.step("shared MLP")
    if variant != "fused":
        row["shared_us"] = timer.time(shared_mlp, sets) * 1e6
    timer.step("output")
    return jax.jit(layer)(params, xs[0]).astype(jnp.float32)


def _add_rel_diffs(rows: dict, outs: dict) -> None:
    """rel_vs_bf16 / rel_vs_fp8 of each variant's row: its output against that variant's."""
    for v, out in outs.items():
        for base in ("bf16", "fp8"):
            if base in outs and base != v:
                rows[v][f"rel_vs_{base}"] = rel_errors(out, outs[base])[0]
