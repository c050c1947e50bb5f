"""Random weights in checkpoint form, drawn in chunks (`draw_params`, behind `moe_jax.init_params`).

The routed experts, then the shared expert, are drawn in chunks of expert slices (rows of w13 and
w2 together, whole scale blocks), each chunk drawn in f32 and quantized to the checkpoint form of
its recipe at once, gathered in a staging buffer and written into the preallocated result
(fori_loops over one compiled chunk); tid2eid in chunks of tokens. Values depend on the key and
the shapes only: slice u of the routed experts is drawn from fold_in(k_experts, u).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

import layouts
from layouts import get_recipe
from layouts.checks import ceil_div
from moe_jax.config import MoEConfig

SHARED_FP8 = "fp8_block"  # the one quantized shared-expert recipe: 128x128 blocks, dense FP8 GEMM
SHARED_RECIPES = ("bf16", SHARED_FP8)


def _quantize_checkpoint(w: jax.Array, recipe: str) -> tuple[jax.Array, jax.Array | None]:
    """w: (E, N, K) f32 -> checkpoint-form (values, scale) of `recipe` (its weight block / group)."""
    rec = get_recipe(recipe)
    if not rec.is_quantized:
        return w.astype(jnp.bfloat16), None
    bn, bk = rec.weight_block
    if rec.is_fp4_experts:
        return layouts.quantize_mxfp4(w, group_size=bk)
    if bn == 1:  # 1 x bk groups with power-of-two scales
        return layouts.quantize_mxfp8(w, group_size=bk)
    return layouts.quantize_fp8_per_block(w, block_size=bk, ue8m0=rec.requires_ue8m0)


CHUNK_BYTES = 256 * 2**20  # most bytes of one chunk's float32 draw ...
TEMP_FRACTION = 40         # ... and at most 1/TEMP_FRACTION of the result's bytes: the draw's temporaries
                           # (threefry counters and bits, the normals, the quantizer's; ~6-7x the chunk
                           # on CPU) and the staging buffer (2x that in the result's dtypes) then stay
                           # under a quarter of the result


class _Chunks(NamedTuple):
    """`units` draw units in chunks of `size`, gathered in a staging buffer of `stage` units (a
    multiple of size) before each write into the result. Stage J covers units [s, s + stage),
    s = min(J * stage, units - stage) (the last one moved back to end at `units`, rewriting units of
    the one before with the same values, so `stage` need not divide `units`), chunk i of it
    [s + i * size, s + (i + 1) * size). Staging makes fewer writes into the whole result, each of
    which XLA:CPU runs over all of it for float8 / bf16."""
    units: int
    size: int
    stage: int

    @property
    def stages(self) -> int:
        return ceil_div(self.units, self.stage)

    @property
    def steps(self) -> int:
        """Chunks drawn."""
        return self.stages * (self.stage // self.size)

    def starts(self) -> list[int]:
        """First unit of every chunk, in order."""
        return [min(j * self.stage, self.units - self.stage) + i * self.size
                for j in range(self.stages) for i in range(self.stage // self.size)]

    def stage_start(self, j: jax.Array) -> jax.Array:
        """First unit of stage j, an int32 loop index (j * stage < units + stage)."""
        return jnp.minimum(j * self.stage, self.units - self.stage)


SMALL_DRAW_BYTES = 64 * 2**20  # a draw this small is one chunk whatever the result's size: chunking
                               # small results buys no memory that matters and costs time (on CPU ~10x)


def _chunk_limit(out_bytes: int, budget: int = CHUNK_BYTES) -> int:
    """Most float32 bytes one chunk may draw, for a result of `out_bytes` bytes: a 1/TEMP_FRACTION
    of it, at least SMALL_DRAW_BYTES, at most `budget`."""
    return max(1, min(budget, max(out_bytes // TEMP_FRACTION, SMALL_DRAW_BYTES)))


def _expert_chunk(units: int, unit_bytes: int, unit_out_bytes: int, limit: int) -> _Chunks:
    """Chunking of `units` draw units of `unit_bytes` float32 bytes each (`unit_out_bytes` in the
    result): as many units per chunk as fit in `limit` bytes (at least one, at most all); about
    sqrt(units / chunk) chunks per stage, at most 2 * limit bytes of the result."""
    size = max(1, min(units, limit // unit_bytes))
    chunks = min(math.isqrt(units // size), 2 * limit // (size * unit_out_bytes))
    return _Chunks(units, size, size * max(1, chunks))


def _expert_slices(h: int, i: int, block_n: int) -> tuple[int, int]:
    """(g, q): an expert is drawn as g slices, slice s = rows [s, s + 1) * 2I/g of its w13 and
    [s, s + 1) * H/g of its w2 (g = gcd(2I, H), whatever the recipe), each from its own key;
    chunks hold whole quanta of q slices, whole `block_n`-row scale blocks of both weights (q =
    block_n; whole experts, q = g, when block_n does not divide 2I and H)."""
    g = math.gcd(2 * i, h)
    return g, (g if (2 * i) % block_n or h % block_n else block_n)


class _ExpertDraw(NamedTuple):
    """Experts drawn together: `experts` of intermediate size `i`, quantized by `quant` ((c, N, K)
    f32 -> (values, scale or None)) whose scale blocks have `block_n` rows."""
    experts: int
    i: int
    block_n: int
    quant: object


def _shared_quant(shared_recipe: str):
    def quant(z):  # bf16 draws, quantized to e4m3 + 128x128 block scales for "fp8_block"
        zb = z.astype(jnp.bfloat16)
        if shared_recipe == "bf16":
            return zb, None
        return _quantize_checkpoint(zb.astype(jnp.float32), SHARED_FP8)
    return quant


def _expert_draws(config: MoEConfig, e_loc: int, tp_size: int, shared_recipe: str) -> dict[str, _ExpertDraw]:
    """"experts" (the routed ones) and "shared" (the shared expert: one of intermediate size I_s)."""
    i, i_s = config.intermediate_size // tp_size, config.shared_intermediate_size // tp_size
    block_n = (get_recipe(config.recipe).weight_block or (1, 1))[0]
    routed = functools.partial(_quantize_checkpoint, recipe=config.recipe)
    draws = {"experts": _ExpertDraw(e_loc, i, block_n, routed)}
    if config.n_shared_experts:
        shared_block_n = 128 if shared_recipe == SHARED_FP8 else 1
        draws["shared"] = _ExpertDraw(1, i_s, shared_block_n, _shared_quant(shared_recipe))
    return draws


def _init_plans(config: MoEConfig, e_loc: int | None = None, tp_size: int = 1, shared_recipe: str = "bf16",
                chunk_bytes: int | None = None) -> tuple[int, dict[str, tuple[_Chunks, int, int]]]:
    """(limit, name -> (chunking, g, q)) of init_params' chunked draws, allocating nothing:
    "experts" and "shared" in units of quanta of q expert slices (g per expert: `_expert_slices`),
    "tid2eid" in units of tokens (g = q = 1). limit: float32 bytes per chunk, `chunk_bytes` or
    (None) `_chunk_limit` of the result's bytes."""
    e, h = config.num_experts, config.hidden_size
    draws = _expert_draws(config, e if e_loc is None else e_loc, tp_size, shared_recipe)
    out = {}  # result bytes of each draw
    for name, d in draws.items():
        drawn = [jax.eval_shape(d.quant, jax.ShapeDtypeStruct(s, jnp.float32))
                 for s in ((d.experts, 2 * d.i, h), (d.experts, h, d.i))]
        out[name] = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(drawn))
    if chunk_bytes is None:
        table = config.vocab_size * config.top_k if config.hash_routing else 0
        chunk_bytes = _chunk_limit(sum(out.values()) + 4 * (e * (h + 1) + table))
    plans = {}
    for name, d in draws.items():
        g, q = _expert_slices(h, d.i, d.block_n)
        units = d.experts * g // q
        plans[name] = (_expert_chunk(units, 3 * d.i * h * 4 // g * q, out[name] // units, chunk_bytes), g, q)
    if config.hash_routing:
        plans["tid2eid"] = (_expert_chunk(config.vocab_size, e * 4, config.top_k * 4, chunk_bytes), 1, 1)
    return chunk_bytes, plans


def _fill(plan: _Chunks, chunk):
    """The pytree of (units, ...) arrays whose units [s, s + size) are chunk(s) (a pytree of
    (size, ...) arrays): chunks written into a staging buffer, stages into the preallocated result
    (fori_loops over one compiled chunk)."""
    shapes = jax.eval_shape(chunk, 0)

    def zeros(n):
        return jax.tree.map(lambda s: jnp.zeros((n, *s.shape[1:]), s.dtype), shapes)

    def write(bufs, values, at):
        return jax.tree.map(lambda b, v: jax.lax.dynamic_update_slice_in_dim(b, v, at, 0), bufs, values)

    def stage(start):  # units [start, start + plan.stage)
        if plan.stage == plan.size:
            return chunk(start)
        return jax.lax.fori_loop(0, plan.stage // plan.size,
                                 lambda i, st: write(st, chunk(start + i * plan.size), i * plan.size),
                                 zeros(plan.stage))

    if plan.stages == 1:
        return stage(0)
    return jax.lax.fori_loop(0, plan.stages, lambda j, bufs: write(bufs, stage(plan.stage_start(j)),
                                                                   plan.stage_start(j)), zeros(plan.units))


def _unit_keys(key: jax.Array, start, n: int) -> jax.Array:
    """fold_in(key, u) for the n units u = start, start + 1, ..."""
    return jax.vmap(lambda u: jax.random.fold_in(key, u))(start + jnp.arange(n, dtype=jnp.int32))


def _draw_experts(key: jax.Array, plan: _Chunks, g: int, q: int, h: int, d: _ExpertDraw):
    """(d.quant(w13), d.quant(w2)) as (E, ...) arrays of w13 (E, 2I, H) ~ N(0, 1/H) and w2 (E, H, I)
    ~ N(0, 1/I) f32, E = d.experts: slice u (slice u % g of expert u // g: its w13 rows, then its w2
    rows) is drawn from fold_in(key, u), so the values depend neither on the chunking nor on E."""
    i, c = d.i, plan.size  # c quanta, c * q slices per chunk
    m13, m2 = 2 * i * h // g, h * i // g

    def chunk(start):
        keys = _unit_keys(key, start * q, c * q)
        z = jax.vmap(lambda k: jax.random.normal(k, (m13 + m2,), jnp.float32))(keys).reshape(c, q, m13 + m2)
        return (d.quant(z[..., :m13].reshape(c, q * 2 * i // g, h) * jnp.float32(h**-0.5)),
                d.quant(z[..., m13:].reshape(c, q * h // g, i) * jnp.float32(i**-0.5)))

    return jax.tree.map(lambda a: a.reshape(d.experts, -1, *a.shape[2:]), _fill(plan, chunk))


def _hash_table(key: jax.Array, plan: _Chunks, e: int, top_k: int) -> jax.Array:
    """(vocab, top_k) int32, vocab = plan.units: token t's experts are the top_k of E uniforms drawn
    from fold_in(key, t), a uniformly random ordered subset of distinct experts."""
    def chunk(start):
        u = jax.vmap(lambda k: jax.random.uniform(k, (e,), jnp.float32))(_unit_keys(key, start, plan.size))
        return jax.lax.top_k(u, top_k)[1].astype(jnp.int32)

    return _fill(plan, chunk)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def draw_params(key: jax.Array, config: MoEConfig, e_loc: int, tp_size: int, shared_recipe: str,
                chunk_bytes: int | None) -> dict[str, jax.Array]:
    """`moe_jax.init_params`' fields (its docstring) after validation, as {field: array};
    chunk_bytes: float32 bytes per chunk (None: `_chunk_limit`)."""
    e, h = config.num_experts, config.hidden_size
    _, plans = _init_plans(config, e_loc, tp_size, shared_recipe, chunk_bytes)
    draws = _expert_draws(config, e_loc, tp_size, shared_recipe)
    k_experts, k_shared, k_router, k_hash = jax.random.split(key, 4)
    (w13, w13_s), (w2, w2_s) = _draw_experts(k_experts, *plans["experts"], h, draws["experts"])
    z = jax.random.normal(k_router, (e, h + 1), jnp.float32)  # gate rows, the bias in the last column
    kw = {}
    if config.use_correction_bias:
        kw["e_score_correction_bias"] = 0.1 * z[:, h]
    if config.n_shared_experts:  # (1, N, K) -> (N, K)
        shared = _draw_experts(k_shared, *plans["shared"], h, draws["shared"])
        for name, (values, scale) in zip(("shared_w13", "shared_w2"), shared):
            kw[name], kw[f"{name}_scale"] = values[0], None if scale is None else scale[0]
    if config.hash_routing:
        kw["tid2eid"] = _hash_table(k_hash, plans["tid2eid"][0], e, config.top_k)
    return dict(gate_weight=z[:, :h] * jnp.float32(h**-0.5), w13=w13, w13_scale=w13_s, w2=w2, w2_scale=w2_s, **kw)
