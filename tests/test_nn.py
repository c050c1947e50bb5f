"""moe_jax.nn.MoE: forward against a float64 numpy model, nnx transforms (jit, split/merge/state,
update), sharding annotations and sharded execution on 8 host CPU devices, checkpoint loading,
bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from moe_jax import MoEConfig, init_params, moe_forward, prepare_params
from moe_jax.nn import MoE, Table, partition_specs
from moe_jax.parallel import ParallelConfig

E, H, I, M = 8, 64, 128, 19


def bf16_config(**kw) -> MoEConfig:
    base = dict(num_experts=E, top_k=3, hidden_size=H, intermediate_size=I, n_shared_experts=1,
                scoring="softmax", norm_topk_prob=False, routed_scaling_factor=1.5, recipe="bf16")
    base.update(kw)
    return MoEConfig(**base)


def x_input(m=M, seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(0, 1, (m, H)), jnp.bfloat16)


@nnx.jit
def fwd(module, x, token_ids=None):
    return module(x, token_ids=token_ids)


def np_model(x, v, cfg):
    """Float64 softmax top-k layer from the module's variables (dict of numpy arrays); returns
    (y, selection margin per row)."""
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    logits = xf @ v["gate_weight"].T
    s = np.exp(logits - logits.max(1, keepdims=True))
    s /= s.sum(1, keepdims=True)
    order = np.argsort(-s, 1)
    ids = order[:, :cfg.top_k]
    srt = np.take_along_axis(s, order, 1)
    margin = srt[:, cfg.top_k - 1] - srt[:, cfg.top_k]

    def mlp(w_gate, w_up, w_down, h):
        a, b = h @ w_gate.T, h @ w_up.T
        return (a / (1 + np.exp(-a)) * b) @ w_down.T

    y = np.zeros_like(xf)
    for m in range(xf.shape[0]):
        for e in ids[m]:
            y[m] += s[m, e] * mlp(v["w13"][e, 0], v["w13"][e, 1], v["w2"][e], xf[m])
    y *= cfg.routed_scaling_factor
    i_s = v["shared_w13"].shape[0] // 2
    y += mlp(v["shared_w13"][:i_s], v["shared_w13"][i_s:], v["shared_w2"], xf)
    return y, margin


def test_forward_matches_numpy_model():
    cfg = bf16_config()
    moe = MoE(cfg, rngs=nnx.Rngs(3))
    x = x_input()
    y = fwd(moe, x)
    assert y.shape == (M, H) and y.dtype == jnp.bfloat16
    v = {k: np.asarray(a.astype(jnp.float32), np.float64)
         for k, a in nnx.to_pure_dict(nnx.state(moe)).items()}
    assert v["w13"].shape == (E, 2, I, H)  # gate rows [:, 0], up rows [:, 1]
    ref, margin = np_model(x, v, cfg)
    ok = margin > 1e-4
    assert ok.sum() >= M - 2
    yf = np.asarray(y.astype(jnp.float32), np.float64)
    assert np.isfinite(yf).all()
    err = np.linalg.norm(yf[ok] - ref[ok], axis=1) / np.linalg.norm(ref[ok], axis=1)
    assert err.max() < 0.03, err


def test_wraps_moe_forward_and_nnx_transforms():
    cfg = MoEConfig.deepseek_v3().scaled(num_experts=8, hidden_size=128, intermediate_size=128, top_k=2)
    raw = init_params(jax.random.key(5), cfg)
    moe = MoE.from_params(raw, cfg)  # prepared here, once
    assert moe.gemm_recipe == "fp8_block" and moe.gemm_arch == 90
    x = jnp.asarray(np.random.default_rng(2).normal(0, 1, (23, 128)), jnp.bfloat16)
    y = fwd(moe, x)
    want = jax.jit(moe_forward, static_argnames=("config", "backend"))(
        x, prepare_params(raw, cfg), config=cfg, backend="auto")
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    # split / merge / functional jit over the state
    graphdef, state = nnx.split(moe)
    y2 = jax.jit(lambda s, v: nnx.merge(graphdef, s)(v))(state, x)
    np.testing.assert_array_equal(np.asarray(y2.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))
    names = set(nnx.to_pure_dict(nnx.state(moe, nnx.Param)))
    assert names == {"gate_weight", "e_score_correction_bias", "w13", "w13_scale", "w2", "w2_scale",
                     "shared_w13", "shared_w2"}
    # nnx.update with another layer's state changes the output to that layer's
    other = MoE(cfg, rngs=nnx.Rngs(9))
    nnx.update(moe, nnx.state(other))
    np.testing.assert_array_equal(np.asarray(fwd(moe, x).astype(jnp.float32)),
                                  np.asarray(fwd(other, x).astype(jnp.float32)))
    assert not np.array_equal(np.asarray(fwd(other, x).astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))


def test_partition_annotations():
    cfg = bf16_config()
    specs = partition_specs(nnx.eval_shape(lambda: MoE(cfg, rngs=nnx.Rngs(0))))
    assert specs["w13"].get_value() == P("ep", None, "tp", None)
    assert specs["w2"].get_value() == P("ep", None, "tp")
    assert specs["gate_weight"].get_value() == P(None, None)
    assert specs["shared_w13"].get_value() == P(None, None)
    specs = partition_specs(nnx.eval_shape(
        lambda: MoE(cfg, rngs=nnx.Rngs(0), expert_axis=("x", "y"), intermediate_axis=None)))
    assert specs["w13"].get_value() == P(("x", "y"), None, None, None)
    # arch-100 GEMM-form scales (packed MN-major): expert axis only
    c100 = MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128, recipe="mxfp8")
    specs = partition_specs(nnx.eval_shape(lambda: MoE(c100, rngs=nnx.Rngs(0))))
    assert specs["w13"].get_value() == P("ep", None, "tp", None)
    assert specs["w13_scale"].get_value() == P("ep", None, None)
    assert specs["w2_scale"].get_value() == P("ep", None, None)


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "mp"))


def test_sharded_patterns_match_single_device(mesh):
    cfg = bf16_config()
    raw = init_params(jax.random.key(11), cfg)
    x = x_input(32, seed=4)
    ref = np.asarray(fwd(MoE.from_params(raw, cfg), x).astype(jnp.float32))
    cases = {
        "dp_ep": (ParallelConfig("dp_ep", moe_axes=("dp", "mp")), P(("dp", "mp"), None, None, None)),
        "tp": (ParallelConfig("tp", moe_axes="mp"), P(None, None, "mp", None)),
    }
    for name, (pc, w13_spec) in cases.items():
        moe = MoE.from_params(raw, cfg, mesh=mesh, parallel=pc)
        assert partition_specs(moe)["w13"].get_value() == w13_spec, name
        sh = moe.w13.get_value().sharding
        assert sh.mesh.shape == mesh.shape and sh.spec == w13_spec, name  # placed at construction
        y = np.asarray(fwd(moe, x).astype(jnp.float32))
        np.testing.assert_allclose(y, ref, rtol=0.02, atol=0.02 * np.abs(ref).max(), err_msg=name)
    # mesh alone: placement only, single-device semantics
    moe = MoE.from_params(raw, cfg, mesh=Mesh(np.array(jax.devices()[:4]), ("ep",)))
    assert partition_specs(moe)["w13"].get_value() == P("ep", None, None, None)  # no "tp" axis in this mesh
    assert moe.w2.get_value().sharding.spec == P("ep", None, None)


def test_hash_routing_takes_token_ids():
    cfg = bf16_config(hash_routing=True, vocab_size=40)
    moe = MoE(cfg, rngs=nnx.Rngs(2))
    assert isinstance(moe.tid2eid, Table) and "tid2eid" not in nnx.to_pure_dict(nnx.state(moe, nnx.Param))
    x = x_input()
    tok = jnp.asarray(np.random.default_rng(0).integers(0, 40, M), jnp.int32)
    y = fwd(moe, x, token_ids=tok)
    want = jax.jit(moe_forward, static_argnames=("config", "backend"))(
        x, moe.moe_params(), config=cfg, token_ids=tok, backend="auto")
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    with pytest.raises(ValueError, match="token_ids: required for a hash-routed layer"):
        moe(x)


def test_batch_seq_hidden_activations_keep_their_shape():
    """A flax user's (batch, seq, hidden) activations (and (batch, seq) token ids): the same rows as the
    flattened (batch * seq, hidden) call, in the caller's shape."""
    cfg = bf16_config(hash_routing=True, vocab_size=40)
    moe = MoE(cfg, rngs=nnx.Rngs(4))
    b, t = 3, 7
    x = jnp.asarray(np.random.default_rng(5).normal(0, 1, (b, t, H)), jnp.bfloat16)
    tok = jnp.asarray(np.random.default_rng(6).integers(0, 40, (b, t)), jnp.int32)
    y = fwd(moe, x, token_ids=tok)
    assert y.shape == (b, t, H) and y.dtype == jnp.bfloat16
    flat = fwd(moe, x.reshape(b * t, H), token_ids=tok.reshape(-1))
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)).reshape(b * t, H),
                                  np.asarray(flat.astype(jnp.float32)))
    assert (np.abs(np.asarray(flat.astype(jnp.float32))).max(axis=1) > 0).all()  # every row computed
    with pytest.raises(ValueError, match=r"token_ids: expected shape \(3, 7\)"):
        fwd(moe, x, token_ids=tok.reshape(-1))


@pytest.mark.slow
def test_checked_mode_names_the_non_finite_tokens(mesh):
    from jax.experimental import checkify

    from custom_calls import checked

    cfg = bf16_config()
    moe = MoE(cfg, rngs=nnx.Rngs(8))
    x = x_input()
    checked_moe = checked(lambda v: moe(v, debug_checks=True))
    y = checked_moe(x)  # clean input: no error, the usual output
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(fwd(moe, x).astype(jnp.float32)))
    bad = x.at[3, 5].set(jnp.nan).at[11, 0].set(jnp.inf)
    with pytest.raises(checkify.JaxRuntimeError, match=r"x has non-finite values in tokens \[3, 11\]"):
        checked_moe(bad)  # the program compiled for x
    sharded = MoE.from_params(init_params(jax.random.key(1), cfg), cfg, mesh=mesh,
                              parallel=ParallelConfig("tp", moe_axes="mp"))
    with pytest.raises(ValueError, match="debug_checks: the checked mode runs on a single device"):
        sharded(x, debug_checks=True)


def test_from_checkpoint(tmp_path):
    from safetensors.numpy import save_file

    cfg = bf16_config(n_shared_experts=0)
    r = np.random.default_rng(6)
    pre = "model.layers.0.mlp."
    t = {pre + "gate.weight": r.normal(0, 0.1, (E, H)).astype(np.float32)}
    for e in range(E):
        for n, shp in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            t[f"{pre}experts.{e}.{n}_proj.weight"] = r.normal(0, 0.1, shp).astype(ml_dtypes.bfloat16)
    save_file(t, str(tmp_path / "m.safetensors"))
    moe = MoE.from_checkpoint(tmp_path / "m.safetensors", cfg, layer=0, expert_range=(2, 8))
    w13 = np.asarray(moe.w13.get_value())
    assert w13.shape == (6, 2, I, H)
    np.testing.assert_array_equal(w13[1, 0], t[f"{pre}experts.3.gate_proj.weight"])
    np.testing.assert_array_equal(w13[1, 1], t[f"{pre}experts.3.up_proj.weight"])
    np.testing.assert_array_equal(np.asarray(moe.w2.get_value())[5], t[f"{pre}experts.7.down_proj.weight"])


def test_bad_input(mesh):
    cfg = bf16_config()
    with pytest.raises(TypeError, match="config: expected MoEConfig, got dict"):
        MoE({"num_experts": 4}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rngs: required to initialize weights when params is None"):
        MoE(cfg)
    with pytest.raises(ValueError, match=r"layout: expected one of \('auto', 'contig', 'masked', 'fused'\), got 'ragged'"):
        MoE(cfg, rngs=nnx.Rngs(0), layout="ragged")
    with pytest.raises(ValueError, match=r"layout: 'fused' is chosen by MoEConfig\(layout='fused'\)"):
        MoE(cfg, rngs=nnx.Rngs(0), layout="fused")
    with pytest.raises(TypeError, match="params: expected MoEParams, got tuple"):
        MoE(cfg, params=(1, 2))
    raw = init_params(jax.random.key(0), cfg)
    with pytest.raises(ValueError, match=r"params.gate_weight: expected shape \(4, 64\), got \(8, 64\)"):
        MoE.from_params(raw, bf16_config(num_experts=4, top_k=2))
    with pytest.raises(ValueError, match="mesh: required with parallel='dp_ep', got None"):
        MoE.from_params(raw, cfg, parallel=ParallelConfig("dp_ep", moe_axes="dp"))
    with pytest.raises(TypeError, match="parallel: expected ParallelConfig or None, got str"):
        MoE.from_params(raw, cfg, mesh=mesh, parallel="dp_ep")
    with pytest.raises(TypeError, match="mesh: expected jax.sharding.Mesh or None, got str"):
        MoE.from_params(raw, cfg, mesh="dp")
    with pytest.raises(ValueError, match=r"expert_axis: axis \['ep'\] not in mesh axes \('dp', 'mp'\)"):
        MoE.from_params(raw, cfg, mesh=mesh, expert_axis="ep")
    with pytest.raises(TypeError, match="intermediate_axis: expected a mesh axis name"):
        MoE.from_params(raw, cfg, intermediate_axis=3)
    with pytest.raises(ValueError, match=r"moe_axes \('dp', 'mp'\) \(size 8\) must divide num_experts=6"):
        MoE(bf16_config(num_experts=6), rngs=nnx.Rngs(0), mesh=mesh,
            parallel=ParallelConfig("dp_ep", moe_axes=("dp", "mp")))
    moe = MoE.from_params(raw, cfg)
    with pytest.raises(ValueError, match="num_tokens: only used with a parallel pattern"):
        moe(x_input(), num_tokens=jnp.array([M]))
    with pytest.raises(ValueError, match=r"x: expected shape \(..., H=64\), got \(3, 32\)"):
        moe(jnp.ones((3, 32), jnp.bfloat16))


@pytest.mark.parametrize("backend,msg", [
    ("nonsense", r"backend: expected one of \('reference', 'auto', 'deep_gemm', 'triton', 'w4a8'\), a \{stage: name\} "
                 r"dict or None, got 'nonsense'"),
    ({"gemm": "cutlass"}, r"backend\['gemm'\]: expected one of .* got 'cutlass'"),
    ({"matmul": "deep_gemm"}, r"unknown stage\(s\) \['matmul'\]; stages are \('route'"),
])
def test_backend_is_checked_at_construction(backend, msg):
    with pytest.raises(ValueError, match=msg):
        MoE(bf16_config(), rngs=nnx.Rngs(0), backend=backend)
    # names of accelerated backends are accepted here (whether they run is decided at the call)
    for ok in ("auto", "reference", "deep_gemm", None, {"gemm": "deep_gemm"}, (("permute", "triton"),)):
        assert MoE(bf16_config(), rngs=nnx.Rngs(0), backend=ok).backend == ok


@pytest.mark.gpu
def test_gpu_auto_backend_matches_reference():
    """On an SM90 GPU: the module with the accelerated kernels ("auto") against the reference."""
    cfg = MoEConfig.deepseek_v3(arch=90).scaled(num_experts=16, hidden_size=512, intermediate_size=256, top_k=4)
    raw = init_params(jax.random.key(21), cfg)
    x = jnp.asarray(np.random.default_rng(8).normal(0, 1, (300, 512)), jnp.bfloat16)
    y_auto = np.asarray(fwd(MoE.from_params(raw, cfg, backend="auto"), x).astype(jnp.float32), np.float64)
    y_ref = np.asarray(fwd(MoE.from_params(raw, cfg, backend="reference"), x).astype(jnp.float32), np.float64)
    assert np.isfinite(y_auto).all()
    assert np.linalg.norm(y_auto - y_ref) / np.linalg.norm(y_ref) < 2e-2


def test_module_with_a_subset_of_experts_refuses_to_run(tmp_path):
    """A module loaded with expert_range holds experts [start, stop): moe_forward would take them for
    experts 0..E_local-1 and silently route to the wrong weights."""
    raw = init_params(jax.random.key(0), bf16_config())
    sub = raw.replace(w13=raw.w13[2:8], w2=raw.w2[2:8])
    moe = MoE.from_params(sub, bf16_config())
    assert moe.w13.get_value().shape == (6, 2, I, H)  # the weights are held, only running is refused
    with pytest.raises(ValueError, match=r"w13: the layer needs all 8 experts, this module holds 6 "
                                         r"\(loaded with expert_range\)"):
        moe(x_input())


def test_return_stats_reaches_the_parallel_pattern(mesh):
    cfg = bf16_config()
    raw = init_params(jax.random.key(11), cfg)
    x = x_input(32, seed=4)  # 4 rows per device
    ll = ParallelConfig("dp_ep", moe_axes=("dp", "mp"), ep_mode="low_latency",
                        num_max_dispatch_tokens_per_rank=1)
    moe = MoE.from_params(raw, cfg, mesh=mesh, parallel=ll)
    with pytest.raises(ValueError, match="return_stats=False would hide their count"):
        moe(x)
    y, stats = nnx.jit(lambda m, v: m(v, return_stats=True))(moe, x)
    assert y.shape == (32, H) and stats["dropped"].shape == (8,)
    assert int(np.asarray(stats["dropped"]).sum()) > 0  # 4 tokens per rank, 1 slot per peer
    with pytest.raises(ValueError, match="return_stats: only used with a parallel pattern"):
        MoE.from_params(raw, cfg)(x, return_stats=True)


def test_fused_layout_config_keeps_the_interleaved_weights():
    """MoE(config with layout="fused") keeps w13 in the fused kernel's row order (w13_interleave=8)
    and runs the fused op: the same output as moe_forward on the same prepared params."""
    cfg = MoEConfig.deepseek_v3(num_experts=8, top_k=3, n_group=4, topk_group=2, hidden_size=256,
                                intermediate_size=128, recipe="fp8_block", arch=90, layout="fused")
    moe = MoE(cfg, rngs=nnx.Rngs(3), backend="reference")
    p = moe.moe_params()
    assert moe.w13_interleave == 8 and p.w13_interleave == 8 and moe.w13.get_value().shape == (8, 256, 256)
    x = jnp.asarray(np.random.default_rng(2).normal(0, 1, (M, 256)), jnp.bfloat16)
    y = np.asarray(fwd(moe, x).astype(jnp.float32))
    want = np.asarray(moe_forward(x, p, cfg).astype(jnp.float32))
    np.testing.assert_array_equal(y, want)
    assert np.isfinite(y).all() and np.abs(y).max() > 0
    _, state = nnx.split(moe)  # the layout survives a split/merge round trip
    assert nnx.merge(nnx.graphdef(moe), state).moe_params().w13_interleave == 8
