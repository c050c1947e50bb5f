"""Every parallel pattern and EP mode against the single-device `moe_forward`, on 8 CPU devices
with 1x8, 2x4 and 4x2 meshes; uneven per-rank token counts; the collectives in the lowered HLO
counted against SPEC §6's table; bad inputs.

One global batch of T = 48 tokens serves every case (T / token shards = 48, 24, 12 or 6 rows per
shard), so the single-device reference compiles once per config.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from moe_jax import MoEConfig, init_params, moe_forward, prepare_params, route
from moe_jax.parallel import ParallelConfig, check_stats, shard_params, sharded_moe_forward

T = 48
CFG = MoEConfig.deepseek_v3().scaled(num_experts=16, top_k=4, hidden_size=256, intermediate_size=256,
                                     recipe="bf16")
CFG_FP8 = CFG.scaled(recipe="fp8_block")
CFG_HASH = MoEConfig.deepseek_v4().scaled(num_experts=16, top_k=4, hidden_size=256,
                                          intermediate_size=256, recipe="bf16", hash_routing=True,
                                          vocab_size=97)
_STATIC = ("config", "mesh", "pc", "layout", "backend", "return_stats")


@functools.lru_cache(maxsize=None)
def _mesh(shape: tuple[int, int]) -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("dp", "mp"))


@functools.lru_cache(maxsize=None)
def _inputs(cfg: MoEConfig):
    params = init_params(jax.random.key(11), cfg)
    x = jax.random.normal(jax.random.key(12), (T, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    tok = jax.random.randint(jax.random.key(13), (T,), 0, cfg.vocab_size or 1, jnp.int32)
    fwd = jax.jit(moe_forward, static_argnames=("config",))
    ref = fwd(x, params, config=cfg, token_ids=tok if cfg.hash_routing else None)
    return params, x, tok, np.asarray(ref.astype(jnp.float32))


def _lengths(n_shards: int, m: int, seed: int) -> np.ndarray:
    """Uneven real counts per shard: one full, one empty when there are >= 3 shards, rest random."""
    rng = np.random.default_rng(seed)
    v = rng.integers(1, m + 1, n_shards)
    v[0] = m
    if n_shards >= 3:
        v[1] = 0
    return v.astype(np.int32)


def _collectives(text: str) -> dict[str, int]:
    names = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")
    c = {n: len(re.findall(rf"stablehlo\.{n}\b", text)) for n in names}
    c["ragged_all_to_all"] = len(re.findall(r"@ragged_all_to_all\b", text))
    return {k: v for k, v in c.items() if v}


# SPEC §6, as this package implements it: TP x TP-MoE one all-reduce; DP x TP-MoE (and CP) one
# gather before and one reduce-scatter after, no all-reduce; EP one all-to-all out and one back
# (ring: one all-gather out, one reduce-scatter back); attention-TP x EP one more all-gather.
def _expected(pc: ParallelConfig) -> dict[str, int]:
    if pc.pattern == "tp":
        return {"all_reduce": 1}
    if pc.pattern in ("dp_tp", "cp"):
        return {"all_gather": 1, "reduce_scatter": 1}
    if pc.ep_mode == "ring":
        want = {"all_gather": 1, "reduce_scatter": 1}
    elif pc.a2a_impl == "ragged_emulated":  # 1 count exchange + 2 emulated ragged exchanges x 2
        want = {"all_to_all": 5}
    else:
        want = {"all_to_all": 2}
    if pc.pattern == "tp_ep":
        want["all_gather"] = want.get("all_gather", 0) + 1
    return want


CASES = {
    "tp-1x8": (CFG, (1, 8), ParallelConfig("tp", ("mp",)), True),
    "tp-4x2-fp8": (CFG_FP8, (4, 2), ParallelConfig("tp", ("mp",)), False),
    "dp_tp-1x8": (CFG, (1, 8), ParallelConfig("dp_tp", ("mp",)), True),
    "dp_tp-2x4-hash-local-shared": (CFG_HASH, (2, 4),
                                    ParallelConfig("dp_tp", ("mp",), shared_on_local_tokens=True), True),
    "dp_tp-4x2-both-axes": (CFG, (4, 2), ParallelConfig("dp_tp", ("dp", "mp")), True),
    "cp-2x4": (CFG, (2, 4), ParallelConfig("cp", ("mp",)), False),
    "dp_ep-normal-1x8": (CFG, (1, 8), ParallelConfig("dp_ep", ("dp", "mp")), True),
    "dp_ep-normal-2x4-replicated-experts": (CFG, (2, 4), ParallelConfig("dp_ep", ("mp",)), True),
    "dp_ep-ragged-emulated-4x2": (CFG, (4, 2), ParallelConfig("dp_ep", ("dp", "mp"),
                                                               a2a_impl="ragged_emulated"), True),
    "dp_ep-low-latency-2x4": (CFG, (2, 4), ParallelConfig("dp_ep", ("dp", "mp"), ep_mode="low_latency",
                                                           num_max_dispatch_tokens_per_rank=6), True),
    "dp_ep-ring-4x2": (CFG, (4, 2), ParallelConfig("dp_ep", ("dp", "mp"), ep_mode="ring"), True),
    "tp_ep-normal-1x8-hash": (CFG_HASH, (1, 8), ParallelConfig("tp_ep", ("dp", "mp"),
                                                                attn_tp_axes=("mp",)), True),
    "tp_ep-normal-2x4-fp8": (CFG_FP8, (2, 4), ParallelConfig("tp_ep", ("dp", "mp"),
                                                              attn_tp_axes=("mp",)), True),
    "tp_ep-low-latency-4x2": (CFG, (4, 2), ParallelConfig("tp_ep", ("dp", "mp"), attn_tp_axes=("mp",),
                                                           ep_mode="low_latency"), False),
    "tp_ep-ring-2x4": (CFG, (2, 4), ParallelConfig("tp_ep", ("mp",), ep_mode="ring"), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pattern_matches_single_device_and_collectives(case):
    cfg, shape, pc, uneven = CASES[case]
    mesh = _mesh(shape)
    params, x, tok, ref = _inputs(cfg)
    n_tok = int(np.prod([mesh.shape[a] for a in pc.token_axes(mesh.axis_names)]))
    m = T // n_tok
    lengths = _lengths(n_tok, m, seed=len(case)) if uneven else None
    kw = dict(token_ids=tok if cfg.hash_routing else None,
              num_tokens=None if lengths is None else jnp.asarray(lengths))
    placed = shard_params(params, cfg, mesh, pc)
    f = jax.jit(sharded_moe_forward, static_argnames=_STATIC)
    lowered = f.lower(x, placed, config=cfg, mesh=mesh, pc=pc, return_stats=True, **kw)
    assert _collectives(lowered.as_text()) == _expected(pc)
    y, stats = lowered.compile()(x, placed, **kw)
    y = np.asarray(y.astype(jnp.float32))
    assert y.shape == (T, cfg.hidden_size) and np.isfinite(y).all()
    real = np.ones(T, bool)
    if lengths is not None:
        real = (np.arange(m)[None, :] < lengths[:, None]).reshape(-1)
    assert not y[~real].any()  # padding rows come back as zeros
    assert not np.asarray(stats["dropped"]).any()
    scale = np.abs(ref).max()
    np.testing.assert_allclose(y[real], ref[real], rtol=2 ** -6, atol=2 ** -6 * scale)
    if pc.is_ep and cfg.recipe != "bf16":
        # FP8 on the wire is what the experts quantize to anyway: the receiver's re-quantization
        # reproduces it, so the result equals sending bf16 rows, bit for bit
        bf16_wire = dataclasses.replace(pc, quantize_dispatch=False)
        y2 = f(x, placed, config=cfg, mesh=mesh, pc=bf16_wire, **kw)
        np.testing.assert_array_equal(np.asarray(y2.astype(jnp.float32)), y)


def test_low_latency_overflow_reported_and_strict_capacity_refused():
    cfg, mesh = CFG, _mesh((2, 4))
    params, x, _, _ = _inputs(cfg)
    c = 1
    pc = ParallelConfig("dp_ep", ("dp", "mp"), ep_mode="low_latency", num_max_dispatch_tokens_per_rank=c)
    f = jax.jit(sharded_moe_forward, static_argnames=_STATIC)
    # traced counts out of range are clamped and reported (7 > 6 rows: clamped to all-real)
    lengths = jnp.asarray([6, 7, 6, 6, 6, 6, -1, 6], jnp.int32)
    _, stats = f(x, params, config=cfg, mesh=mesh, pc=pc, return_stats=True, num_tokens=lengths)
    np.testing.assert_array_equal(np.asarray(stats["num_tokens_out_of_range"]), [0, 1, 0, 0, 0, 0, 1, 0])
    ids = np.asarray(jax.jit(route, static_argnames=("config",))(x, params, config=cfg)[0])
    m = T // 8
    n_real = np.clip(np.asarray(lengths), 0, m)
    e_loc = cfg.num_experts // 8
    want = np.zeros(8, int)  # routes of the tokens past the first c a rank sends to each peer
    for r in range(8):
        sent = np.zeros(8, int)
        for t in range(r * m, r * m + n_real[r]):
            for d in range(8):
                n_routes = int((ids[t] // e_loc == d).sum())
                if n_routes:
                    want[r] += n_routes if sent[d] >= c else 0
                    sent[d] += 1
    assert sum(want) > 0
    np.testing.assert_array_equal(np.asarray(stats["dropped"]), want)
    with pytest.raises(ValueError, match="low-latency dispatch dropped"):
        check_stats(stats)
    with pytest.raises(ValueError, match=r"num_tokens: devices \[1, 6\] got a count outside"):
        check_stats({**stats, "dropped": np.zeros(8, np.int32)})
    strict = ParallelConfig("dp_ep", ("dp", "mp"), ep_mode="low_latency",
                            num_max_dispatch_tokens_per_rank=5, strict_capacity=True)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank=5 is below the static worst "
                                         "case of 6 tokens per rank"):
        f.lower(x, params, config=cfg, mesh=mesh, pc=strict)


def _lower(cfg, pc, shape=(2, 4), params=None, x=None, **kw):
    p, xx, _, _ = _inputs(CFG)
    f = jax.jit(sharded_moe_forward, static_argnames=_STATIC)
    return f.lower(xx if x is None else x, p if params is None else params, config=cfg,
                   mesh=_mesh(shape), pc=pc, **kw)


def _abstract_params(cfg):
    return jax.eval_shape(lambda k: init_params(k, cfg), jax.random.key(0))


def test_bad_mesh_axes_that_do_not_divide_experts_or_intermediate():
    cfg12 = CFG.scaled(num_experts=12, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match=r"moe_axes \('dp', 'mp'\) \(size 8\) must divide num_experts=12"):
        _lower(cfg12, ParallelConfig("dp_ep", ("dp", "mp")), params=_abstract_params(cfg12))
    cfg_i = CFG.scaled(intermediate_size=130)
    with pytest.raises(ValueError, match=r"moe_axes \('mp',\) \(size 4\) must divide intermediate_size=130"):
        _lower(cfg_i, ParallelConfig("tp", ("mp",)), params=_abstract_params(cfg_i))
    with pytest.raises(ValueError, match=r"intermediate_size/tp = 256/4 = 64 must be a multiple of 128 "
                                         r"for recipe 'fp8_block'"):
        _lower(CFG_FP8, ParallelConfig("tp", ("mp",)), params=_abstract_params(CFG_FP8))
    with pytest.raises(ValueError, match=r"params.w13: expected all 16 experts on axis 0"):
        local = jax.eval_shape(lambda k: init_params(k, CFG, num_local_experts=2), jax.random.key(0))
        _lower(CFG, ParallelConfig("dp_ep", ("dp", "mp")), params=local)
    interleaved = dataclasses.replace(_abstract_params(CFG), w13_interleave=8)  # the fused layout's w13 order
    with pytest.raises(ValueError, match=r"params.w13: pattern 'tp' shards I, which needs w13 rows \[gate; up\]"):
        _lower(CFG, ParallelConfig("tp", ("mp",)), params=interleaved)


def test_bad_lengths_tokens_and_axes():
    pc = ParallelConfig("dp_tp", ("mp",))
    p, x, _, _ = _inputs(CFG)
    with pytest.raises(ValueError, match=r"num_tokens: every count must be in \[0, 6\]"):
        sharded_moe_forward(x, p, CFG, _mesh((2, 4)), pc,
                            num_tokens=np.asarray([6, 7, 0, 1, 2, 3, 4, 5], np.int32))
    with pytest.raises(ValueError, match=r"num_tokens: expected one count per token shard, shape \(8,\)"):
        _lower(CFG, pc, num_tokens=jnp.asarray([6, 6], jnp.int32))
    with pytest.raises(TypeError, match="num_tokens: expected an integer dtype"):
        _lower(CFG, pc, num_tokens=jnp.full((8,), 6.0))
    with pytest.raises(ValueError, match="num_tokens: pattern 'cp' gathers sequence segments"):
        _lower(CFG, ParallelConfig("cp", ("mp",)), num_tokens=jnp.full((8,), 6, jnp.int32))
    with pytest.raises(ValueError, match=r"x: 44 rows cannot be split over the 8 token shards"):
        _lower(CFG, pc, x=jnp.zeros((44, 256), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"x: expected \(T, H=256\)"):
        _lower(CFG, pc, x=jnp.zeros((48, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"mesh: axis 'ep' not in mesh axes \('dp', 'mp'\)"):
        _lower(CFG, ParallelConfig("dp_ep", ("ep",)))
    with pytest.raises(ValueError, match="layout: the low-latency EP mode computes on the masked layout"):
        _lower(CFG, ParallelConfig("dp_ep", ("mp",), ep_mode="low_latency"), layout="contig")
    with pytest.raises(ValueError, match="token_ids: required for a hash-routed layer"):
        _lower(CFG_HASH, ParallelConfig("dp_ep", ("mp",)), params=_abstract_params(CFG_HASH))
    explicit = jax.make_mesh((2, 4), ("dp", "mp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with pytest.raises(ValueError, match=r"mesh: axes \['dp', 'mp'\] are not AxisType.Auto"):
        sharded_moe_forward(_inputs(CFG)[1], _inputs(CFG)[0], CFG, explicit, pc)


def test_bad_parallel_config():
    with pytest.raises(ValueError, match="ParallelConfig.pattern: expected one of"):
        ParallelConfig("ep", ("mp",))
    with pytest.raises(ValueError, match="ParallelConfig.moe_axes: expected at least one mesh axis"):
        ParallelConfig("tp", ())
    with pytest.raises(ValueError, match="ParallelConfig.moe_axes: repeated axis"):
        ParallelConfig("tp", ("mp", "mp"))
    with pytest.raises(ValueError, match="ParallelConfig.attn_tp_axes: only pattern 'tp_ep'"):
        ParallelConfig("dp_ep", ("mp",), attn_tp_axes=("mp",))
    with pytest.raises(ValueError, match="ParallelConfig.ep_mode: expected one of"):
        ParallelConfig("dp_ep", ("mp",), ep_mode="deepep")
    with pytest.raises(ValueError, match="ParallelConfig.num_max_dispatch_tokens_per_rank: expected a "
                                         "positive int"):
        ParallelConfig("dp_ep", ("mp",), num_max_dispatch_tokens_per_rank=0)
    with pytest.raises(ValueError, match="ParallelConfig.combine_dtype: expected one of"):
        ParallelConfig("dp_ep", ("mp",), combine_dtype="float16")
    with pytest.raises(ValueError, match="ParallelConfig.shared_on_local_tokens: only meaningful"):
        ParallelConfig("tp", ("mp",), shared_on_local_tokens=True)
    with pytest.raises(TypeError, match=r"ParallelConfig.moe_axes: expected axis names \(str\), got 3"):
        ParallelConfig("tp", 3)
    with pytest.raises(TypeError, match="ParallelConfig.quantize_dispatch: expected a bool, got 'no'"):
        ParallelConfig("dp_ep", ("mp",), quantize_dispatch="no")
    with pytest.raises(TypeError, match="ParallelConfig.strict_capacity: expected a bool, got 1"):
        ParallelConfig("dp_ep", ("mp",), strict_capacity=1)
    assert ParallelConfig("tp", ["mp"]).moe_axes == ("mp",)  # a list becomes a (hashable) tuple
    assert ParallelConfig("tp_ep", "mp").attn_tp_axes == ("mp",)  # default: the EP axes
    assert hash(ParallelConfig("tp", "mp")) == hash(ParallelConfig("tp", ("mp",)))


def test_params_without_every_expert_refused_for_tp_patterns_too():
    """TP patterns route over all experts with expert offset 0: a subset would be silently taken
    for experts 0..E_local-1."""
    local = jax.eval_shape(lambda k: init_params(k, CFG, num_local_experts=8), jax.random.key(0))
    for pc in (ParallelConfig("tp", ("mp",)), ParallelConfig("dp_tp", ("mp",))):
        with pytest.raises(ValueError, match=rf"params.w13: expected all 16 experts on axis 0 \(pattern "
                                             rf"'{pc.pattern}' takes global params\), got shape "
                                             r"\(8, 512, 256\)"):
            _lower(CFG, pc, params=local)
        with pytest.raises(ValueError, match=r"params.w13: expected all 16 experts"):
            shard_params(init_params(jax.random.key(0), CFG, num_local_experts=8), CFG, _mesh((2, 4)), pc)


def test_float_token_ids_refused():
    tok = jnp.arange(T, dtype=jnp.float32)  # the DP gather would have cast them to int32
    with pytest.raises(TypeError, match="token_ids: expected an integer dtype, got float32"):
        _lower(CFG_HASH, ParallelConfig("dp_tp", ("mp",)), params=_abstract_params(CFG_HASH), token_ids=tok)


def test_low_latency_capacity_that_can_drop_needs_stats():
    pc = ParallelConfig("dp_ep", ("dp", "mp"), ep_mode="low_latency", num_max_dispatch_tokens_per_rank=5)
    with pytest.raises(ValueError, match=r"num_max_dispatch_tokens_per_rank=5 is below the static worst "
                                         r"case of 6 tokens per rank, so routes can be dropped, and "
                                         r"return_stats=False would hide their count"):
        _lower(CFG, pc)
    _lower(CFG, pc, return_stats=True)  # counted and returned: allowed
    # attention-TP x EP: the worst case is the rank's 1/attn_tp share: 48 / dp 4 / mp 2 = 6 rows
    tp_ep = ParallelConfig("tp_ep", ("dp", "mp"), attn_tp_axes=("mp",), ep_mode="low_latency",
                           num_max_dispatch_tokens_per_rank=5)
    with pytest.raises(ValueError, match="=5 is below the static worst case of 6 tokens per rank, so"):
        _lower(CFG, tp_ep, shape=(4, 2))
    _lower(CFG, dataclasses.replace(tp_ep, num_max_dispatch_tokens_per_rank=6), shape=(4, 2))


def test_fp8_wire_follows_the_arch_prepared_params_run():
    """config.arch None (fp8_block -> 90) with params prepared for 100: the GEMMs quantize
    activations with UE8M0 scales, so the wire must too — then it is lossless (equal to bf16 rows)."""
    from moe_jax import prepare_params

    cfg = CFG_FP8
    assert cfg.arch is None and cfg.gemm_arch == 90
    params = prepare_params(_inputs(cfg)[0], cfg, 100)
    x = _inputs(cfg)[1]
    mesh = _mesh((2, 4))
    pc = ParallelConfig("dp_ep", ("dp", "mp"))
    placed = shard_params(params, cfg, mesh, pc)
    f = jax.jit(sharded_moe_forward, static_argnames=_STATIC)
    y_fp8 = np.asarray(f(x, placed, config=cfg, mesh=mesh, pc=pc).astype(jnp.float32))
    y_bf16 = np.asarray(f(x, placed, config=cfg, mesh=mesh,
                          pc=dataclasses.replace(pc, quantize_dispatch=False)).astype(jnp.float32))
    assert np.isfinite(y_fp8).all() and np.abs(y_fp8).max() > 0
    np.testing.assert_array_equal(y_fp8, y_bf16)


@pytest.mark.slow
def test_sharded_example_runs_and_checks_itself():
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "examples" / "sharded.py")], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if "max |y - moe_forward|" in ln]
    assert len(lines) == 6, proc.stdout
    for ln in lines:
        assert float(ln.split("=")[-1]) <= 2**-6, ln
    assert proc.stdout.splitlines()[-1] == "OK: 6 patterns agree with the single-device layer", proc.stdout


def test_traced_out_of_range_counts_without_stats_poison_their_shard():
    """Under jit the counts are data: without return_stats nobody would see a clamp, so the shard
    whose count is outside [0, M] returns nan rows; the other shards are unaffected."""
    cfg, mesh = CFG, _mesh((2, 4))
    params, x, _, ref = _inputs(cfg)
    pc = ParallelConfig("dp_tp", ("mp",))
    lengths = np.array([6, 7, 3, 6, 0, 5, -1, 6], np.int32)  # shards 1 and 6 are out of range
    f = jax.jit(sharded_moe_forward, static_argnames=_STATIC)
    y = np.asarray(f(x, shard_params(params, cfg, mesh, pc), config=cfg, mesh=mesh, pc=pc,
                     num_tokens=jnp.asarray(lengths)).astype(jnp.float32)).reshape(8, 6, -1)
    assert np.isnan(y[[1, 6]]).all()
    good = [0, 2, 3, 4, 5, 7]
    assert np.isfinite(y[good]).all()
    real = np.arange(6)[None, :] < lengths[good][:, None]
    ref = ref.reshape(8, 6, -1)[good]
    assert not y[good][~real].any()
    np.testing.assert_allclose(y[good][real], ref[real], rtol=2 ** -6, atol=2 ** -6 * np.abs(ref).max())


@pytest.mark.slow
def test_fused_layout_under_expert_parallelism():
    """The fused layout's routed branch per EP shard (local ids, the other experts' routes dropped)
    sums to the single-device layer: only the bf16 rounding of each shard's partial output differs."""
    cfg = CFG.scaled(recipe="fp8_block", layout="fused")
    params = prepare_params(init_params(jax.random.key(11), cfg), cfg)
    assert params.w13_interleave == 8
    x = jax.random.normal(jax.random.key(2), (16, cfg.hidden_size), jnp.bfloat16)
    ref = np.asarray(moe_forward(x, params, cfg, backend="reference").astype(jnp.float32))
    mesh, pc = _mesh((2, 4)), ParallelConfig("dp_ep", ("dp", "mp"))
    got = sharded_moe_forward(x, shard_params(params, cfg, mesh, pc), config=cfg, mesh=mesh, pc=pc,
                              backend="reference")
    got = np.asarray(got.astype(jnp.float32))
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2
