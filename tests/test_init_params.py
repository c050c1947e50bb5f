"""init_params at any size: the chunking rule at the presets' full sizes (no allocation), values
independent of the chunking and of num_local_experts, the distribution of the dequantized draws,
eval_shape at the full V3 size, and the compiled program's temporaries against its result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import layouts
from moe_jax import MoEConfig, MoEParams, check_params, init_params
from moe_jax.random_init import (CHUNK_BYTES, SMALL_DRAW_BYTES, TEMP_FRACTION, _chunk_limit, _Chunks, _expert_chunk,
                                 _expert_slices, _init_plans, draw_params)

INT32_LIMIT = 2**31
PRESETS = {
    "v3": MoEConfig.deepseek_v3(),
    "v3_e64": MoEConfig.deepseek_v3(num_experts=64),
    "v4": MoEConfig.deepseek_v4(),
    "v4_hash": MoEConfig.deepseek_v4(hash_routing=True),
}
SMALL = MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=256, n_shared_experts=1,
                  scoring="sigmoid", use_correction_bias=True, recipe="fp8_block")
MODERATE = MoEConfig.deepseek_v3().scaled(num_experts=16, hidden_size=1024, intermediate_size=512)
DIST = MoEConfig.deepseek_v3().scaled(num_experts=4, hidden_size=512, intermediate_size=256, fit_routing=True)


def _covered(plan: _Chunks) -> np.ndarray:
    """How often each unit is written."""
    hits = np.zeros(plan.units, np.int64)
    for s in plan.starts():
        hits[s:s + plan.size] += 1
    return hits


# -- (a) the chunking rule, at full sizes, allocating nothing -------------------------------------

def test_chunk_rule_pieces():
    assert _chunk_limit(2**40) == CHUNK_BYTES
    big = TEMP_FRACTION * (SMALL_DRAW_BYTES + 1000)
    assert _chunk_limit(big) == SMALL_DRAW_BYTES + 1000  # a fortieth of a large result
    assert _chunk_limit(1000) == _chunk_limit(0) == SMALL_DRAW_BYTES  # small results: one draw
    assert _chunk_limit(TEMP_FRACTION * 1000, budget=500) == 500
    # V3: 2048 units of 1/8 expert (22 MB f32, 5.5 MB e4m3): 12 a chunk, 8 chunks a stage
    unit = 3 * 2048 * 7168 // 8
    assert _expert_chunk(2048, 4 * unit, unit, CHUNK_BYTES) == _Chunks(2048, 12, 96)
    assert _expert_chunk(10, 100, 25, 1) == _Chunks(10, 1, 1)           # at least one unit, no staging
    assert _expert_chunk(10, 100, 25, 10**9) == _Chunks(10, 10, 10)     # at most all
    assert _expert_chunk(100, 100, 25, 100) == _Chunks(100, 1, 8)       # 8 * 25 <= 2 * 100 bytes staged
    assert _expert_chunk(100, 100, 1, 100) == _Chunks(100, 1, 10)       # sqrt(100) chunks a stage
    plan = _Chunks(10, 4, 4)
    assert plan.steps == 3 and plan.starts() == [0, 4, 6]  # the last stage moved back, overlapping
    assert [int(plan.stage_start(jnp.int32(j))) for j in range(plan.stages)] == plan.starts()
    assert _Chunks(10, 2, 4).starts() == [0, 2, 4, 6, 6, 8]
    # (slices per expert, slices per quantum): quanta of whole 128-row blocks of w13 and w2 for
    # fp8_block, single slices for 1 x 32 groups, whole experts when 128 divides 2I or H not
    assert _expert_slices(7168, 2048, 128) == (1024, 128) and _expert_slices(4096, 2048, 1) == (4096, 1)
    assert _expert_slices(200, 96, 128) == (8, 8) and _expert_slices(256, 128, 128) == (256, 128)


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("shard", [{}, {"e_loc": 32, "tp_size": 4, "shared_recipe": "fp8_block"}])
def test_chunk_rule_at_preset_sizes(name, shard):
    cfg = PRESETS[name]
    e, h = cfg.num_experts, cfg.hidden_size
    e_loc, tp, shared = shard.get("e_loc", e), shard.get("tp_size", 1), shard.get("shared_recipe", "bf16")
    i = cfg.intermediate_size // tp
    limit, plans = _init_plans(cfg, e_loc, tp, shared)
    assert 1 <= limit <= CHUNK_BYTES
    assert set(plans) == {"experts", "shared"} | ({"tid2eid"} if cfg.hash_routing else set())
    p = jax.eval_shape(lambda k: init_params(k, cfg, num_local_experts=e_loc, tp_size=tp,
                                             shared_recipe=shared), jax.random.key(0))
    fields = {"experts": ("w13", "w13_scale", "w2", "w2_scale"), "tid2eid": ("tid2eid",),
              "shared": ("shared_w13", "shared_w13_scale", "shared_w2", "shared_w2_scale")}
    # per field: (experts, f32 normals per expert)
    per_expert = {"experts": (e_loc, 3 * i * h), "shared": (1, 3 * i * cfg.n_shared_experts * h),
                  "tid2eid": (cfg.vocab_size, e)}
    for field, (plan, g, q) in plans.items():
        experts, normals = per_expert[field]
        assert plan.units * q == experts * g and normals % g == 0, field  # the units tile every row
        unit_normals = normals // g * q
        out = sum(a.size * a.dtype.itemsize for n in fields[field] if (a := getattr(p, n)) is not None)
        assert plan.size * unit_normals * 4 <= limit, field           # a chunk's f32 draw under the budget
        assert plan.stage * out // plan.units <= 2 * limit, field     # and its staging buffer
        assert np.all(_covered(plan) >= 1), field                      # every unit drawn
        assert max(plan.starts()) + plan.size == plan.units
        # int32: unit indices (and j * stage in the loop) and a chunk's element count
        assert plan.units + plan.stage < INT32_LIMIT and plan.size * unit_normals < INT32_LIMIT, field
    if name == "v3" and not shard:  # the array the single flat draw overflowed on: 1/8 expert a unit
        assert plans["experts"][0].units == 256 * 8 and e * 2 * i * h >= INT32_LIMIT


# -- (b) determinism: chunking, keys, shards ------------------------------------------------------

def _assert_same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype
        if x.dtype.itemsize == 1:  # compare float8 bit patterns
            x, y = x.view(jnp.uint8), y.view(jnp.uint8)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("cfg,shared", [
    (SMALL, "fp8_block"),
    (MoEConfig.deepseek_v4(hash_routing=True).scaled(num_experts=8, hidden_size=256, intermediate_size=256,
                                                     vocab_size=53), "bf16"),
])
def test_values_independent_of_chunk_size(cfg, shared):
    key = jax.random.key(3)
    e = cfg.num_experts
    _, whole = _init_plans(cfg, e, 1, shared, 2**40)
    assert whole["experts"][0].steps == 1
    _, g, q = whole["experts"]
    units = e * g // q
    unit = 3 * cfg.intermediate_size * cfg.hidden_size * 4 // g * q  # f32 bytes of a unit
    ref = MoEParams(**draw_params(key, cfg, e, 1, shared, 2**40))
    plans = [_init_plans(cfg, e, 1, shared, size * unit)[1]["experts"][0]  # chunkings of several steps
             for size in (max(1, units // 7), units // 3 + 1)]
    assert all(p.units == units and p.steps > 1 for p in plans)
    assert any(p.stage > p.size for p in plans) and any(units % p.stage for p in plans)  # staged, overlapping
    for plan in plans:
        _assert_same(MoEParams(**draw_params(key, cfg, e, 1, shared, plan.size * unit)), ref)
    _assert_same(init_params(key, cfg, shared_recipe=shared), ref)  # the rule's chunking
    other = init_params(jax.random.key(4), cfg, shared_recipe=shared)
    assert not np.array_equal(np.asarray(other.gate_weight), np.asarray(ref.gate_weight))
    assert not np.array_equal(np.asarray(other.w2), np.asarray(ref.w2))


def test_shard_is_the_first_experts_of_the_full_draw():
    key = jax.random.key(5)
    full = init_params(key, SMALL, shared_recipe="fp8_block")
    shard = init_params(key, SMALL, num_local_experts=2, shared_recipe="fp8_block")
    assert shard.w13.shape[0] == 2 and check_params(shard, SMALL) == (2, 256)
    _assert_same(shard, full.replace(w13=full.w13[:2], w2=full.w2[:2], w13_scale=full.w13_scale[:2],
                                     w2_scale=full.w2_scale[:2]))


def test_hash_table_distinct_and_uniform():
    cfg = MoEConfig.deepseek_v4(hash_routing=True).scaled(num_experts=16, hidden_size=128,
                                                          intermediate_size=128, vocab_size=4000)
    t = np.asarray(init_params(jax.random.key(6), cfg).tid2eid)
    assert t.shape == (4000, 6) and t.dtype == np.int32
    s = np.sort(t, axis=1)
    assert np.all(s[:, 1:] != s[:, :-1]) and t.min() >= 0 and t.max() < 16
    counts = np.bincount(t.ravel(), minlength=16)  # 1500 expected per expert, sd ~ 37
    assert np.all(np.abs(counts - 1500) < 200), counts
    first = np.bincount(t[:, 0], minlength=16)     # each rank uniform too: 250 expected, sd ~ 15
    assert np.all(np.abs(first - 250) < 80), first


# -- (c) the distribution of the (dequantized) draws ----------------------------------------------

def _dequant(values, scale, recipe):
    if recipe == "fp8_block":
        return layouts.dequantize_fp8_per_block(values, scale, block_size=128)
    if recipe == "mxfp4":
        return layouts.dequantize_mxfp4(values, scale, group_size=32)
    return values.astype(jnp.float32)


def _check_std(name, a, std, rtol, axis=None):
    """std within rtol of `std` and a mean within 5 standard errors of 0, over `axis`."""
    a = np.asarray(a, np.float64)
    n = a.size if axis is None else a.shape[axis]
    np.testing.assert_allclose(a.std(axis=axis), std, rtol=rtol, err_msg=f"{name}: std")
    assert np.all(np.abs(a.mean(axis=axis)) < 5 * std / np.sqrt(n)), f"{name}: mean"


@pytest.mark.parametrize("recipe", ["fp8_block", "mxfp4", "bf16"])
def test_distribution(recipe):
    cfg = DIST.scaled(recipe=recipe)
    h, i = cfg.hidden_size, cfg.intermediate_size
    p = init_params(jax.random.key(7), cfg)
    w13 = _dequant(p.w13, p.w13_scale, recipe)
    w2 = _dequant(p.w2, p.w2_scale, recipe)
    assert w13.shape == (4, 2 * i, h) and w2.shape == (4, h, i)
    # each expert separately (~1.3e5 samples: sampling error ~0.2%); quantization adds well under 5%
    rtol = 0.05 if recipe == "mxfp4" else 0.02
    _check_std("w13", w13.reshape(4, -1), h**-0.5, rtol, axis=1)
    _check_std("w2", w2.reshape(4, -1), i**-0.5, rtol, axis=1)
    _check_std("gate_weight", p.gate_weight, h**-0.5, 0.08)  # 2048 samples: sd of the std ~1.6%
    assert p.gate_weight.dtype == jnp.float32
    _check_std("shared_w13", p.shared_w13, h**-0.5, 0.02)
    _check_std("shared_w2", p.shared_w2, cfg.shared_intermediate_size**-0.5, 0.02)
    assert p.shared_w13.dtype == jnp.bfloat16
    # distinct experts: no two experts (nor gate and up rows) share draws
    assert not np.array_equal(np.asarray(w13[0]), np.asarray(w13[1]))
    assert not np.array_equal(np.asarray(w13[0, :i]), np.asarray(w13[0, i:]))


def test_shared_fp8_and_bias_distribution():
    cfg = MODERATE.scaled(num_experts=256, top_k=8, hidden_size=128, intermediate_size=128, recipe="mxfp4")
    p = init_params(jax.random.key(8), cfg, shared_recipe="fp8_block")
    s13 = layouts.dequantize_fp8_per_block(p.shared_w13, p.shared_w13_scale, block_size=128)
    _check_std("shared_w13 (fp8)", s13, 128**-0.5, 0.05)
    b = np.asarray(p.e_score_correction_bias)
    assert b.shape == (256,) and b.dtype == np.float32
    assert 0.08 < b.std() < 0.12 and abs(b.mean()) < 0.025  # 256 samples: sd of the std ~4.4%


# -- (d) full size under eval_shape ---------------------------------------------------------------

def test_eval_shape_full_v3():
    cfg = MoEConfig.deepseek_v3()
    p = jax.eval_shape(lambda k: init_params(k, cfg), jax.random.key(0))
    got = {n: (tuple(a.shape), jnp.dtype(a.dtype)) for n, a in vars(p).items() if hasattr(a, "shape")}
    f32, e4m3, bf16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.bfloat16)
    assert got == {
        "gate_weight": ((256, 7168), f32), "e_score_correction_bias": ((256,), f32),
        "w13": ((256, 4096, 7168), e4m3), "w13_scale": ((256, 32, 56), f32),
        "w2": ((256, 7168, 2048), e4m3), "w2_scale": ((256, 56, 16), f32),
        "shared_w13": ((4096, 7168), bf16), "shared_w2": ((7168, 2048), bf16),
    }
    assert p.tid2eid is None and check_params(p, cfg) == (256, 2048)


def test_eval_shape_full_v4_hash():
    cfg = MoEConfig.deepseek_v4(hash_routing=True)
    p = jax.eval_shape(lambda k: init_params(k, cfg), jax.random.key(0))
    assert p.w13.shape == (256, 4096, 2048) and p.w13.dtype == jnp.int8
    assert p.w13_scale.shape == (256, 4096, 128) and p.w2.shape == (256, 4096, 1024)
    assert p.tid2eid.shape == (129280, 6) and p.tid2eid.dtype == jnp.int32
    assert p.e_score_correction_bias is None and check_params(p, cfg) == (256, 2048)


# -- (e) peak memory: the compiled program's temporaries against its result -----------------------

def _temp_ratio(cfg, **kw):
    """The compiled init_params' temporaries / its result's bytes (compiled, never run)."""
    f = jax.jit(init_params, static_argnames=("config", "shared_recipe"))
    mem = f.lower(jax.random.key(0), config=cfg, **kw).compile().memory_analysis()
    if mem is None:
        pytest.skip("no memory_analysis on this backend")
    leaves = jax.tree.leaves(jax.eval_shape(lambda k: init_params(k, cfg, **kw), jax.random.key(0)))
    out = sum(a.size * a.dtype.itemsize for a in leaves)
    assert out <= mem.output_size_in_bytes <= out + 64 * len(leaves)  # + alignment
    return mem.temp_size_in_bytes / out


@pytest.mark.parametrize("cfg,kw", [
    (MODERATE, {}),
    (MODERATE, {"shared_recipe": "fp8_block"}),
    (MoEConfig.deepseek_v4(hash_routing=True).scaled(num_experts=16, hidden_size=1024,
                                                     intermediate_size=512), {}),
])
def test_peak_memory_moderate(cfg, kw):
    """Below the small-draw floor a result is drawn at once: its temporaries are those of one draw of
    at most SMALL_DRAW_BYTES (the threefry bits, the normals, the quantizer's: under 8x it)."""
    leaves = jax.tree.leaves(jax.eval_shape(lambda k: init_params(k, cfg, **kw), jax.random.key(0)))
    out = sum(a.size * a.dtype.itemsize for a in leaves)
    assert _temp_ratio(cfg, **kw) * out <= max(0.25 * out, 8 * SMALL_DRAW_BYTES)


def test_peak_memory_full_v3():
    """Compiled, never run: the 256-expert preset's temporaries (~1.3 GiB) against its ~10.6 GiB."""
    assert _temp_ratio(MoEConfig.deepseek_v3()) <= 0.25
