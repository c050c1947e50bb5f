"""The whole layer against an independent float64 numpy model (a per-token loop over the chosen
experts), for every recipe / arch / layout, activation and scoring; routing ids exactly; contig ==
masked; padding rows; expert subsets (EP) and intermediate shards (TP); jit; grad; bad inputs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax as mj
from custom_calls import ActivationSpec
from moe_jax import MoEConfig
from numpy_reference import decode_e2m1  # examples/numpy_reference.py: the float64 model's formats
from numpy_reference import scores as np_scores

# ------------------------------------------------------------------------------------------------
# float64 numpy model
# ------------------------------------------------------------------------------------------------

def np_dequant_weight(w, sf, recipe: str) -> np.ndarray:
    """Checkpoint-form expert weight -> (E, N, K) float64."""
    w = np.asarray(w)
    if recipe == "bf16":
        return w.astype(np.float64)
    sf = np.asarray(sf, np.float64)
    if recipe == "fp8_block":
        n, k = w.shape[-2:]
        full = np.repeat(np.repeat(sf, 128, axis=-2), 128, axis=-1)[..., :n, :k]
        return w.astype(np.float64) * full
    vals = decode_e2m1(w) if recipe == "mxfp4" else w.astype(np.float64)
    return vals * np.repeat(sf, 32, axis=-1)


def _topk_desc(values: np.ndarray, k: int) -> list[int]:
    """Indices of the k largest values, ties to the lower index."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


def np_route(x, gate_weight, bias, cfg: MoEConfig, tid2eid=None, token_ids=None):
    logits = np.asarray(x, np.float64) @ np.asarray(gate_weight, np.float64).T
    scores = np_scores(logits, cfg.scoring)
    m, e = scores.shape
    ids = np.zeros((m, cfg.top_k), np.int64)
    for t in range(m):
        if tid2eid is not None:
            ids[t] = np.asarray(tid2eid)[int(token_ids[t])]
            continue
        sel = scores[t] + (0.0 if bias is None else np.asarray(bias, np.float64))
        if cfg.use_grouped_topk and cfg.n_group > 1:
            gs = e // cfg.n_group
            # with a correction bias: sum of the group's two best; without: the group's best
            best = 2 if cfg.use_correction_bias else 1
            gscore = [sum(sorted(sel[g * gs:(g + 1) * gs])[-best:]) for g in range(cfg.n_group)]
            keep = _topk_desc(np.array(gscore), cfg.topk_group)
            sel = np.array([sel[i] if i // gs in keep else -np.inf for i in range(e)])
        ids[t] = _topk_desc(sel, cfg.top_k)
    w = np.take_along_axis(scores, ids, axis=1)
    if cfg.norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    return ids, w


def np_act(gateup: np.ndarray, cfg: MoEConfig) -> np.ndarray:
    i = gateup.shape[-1] // 2
    gate, up = gateup[..., :i], gateup[..., i:]
    act = cfg.activation
    if act.kind == "situ":
        bs, bl = act.situ_beta, act.situ_linear_beta
        return bs * np.tanh(gate / bs) / (1 + np.exp(-gate)) * bl * np.tanh(up / bl)
    if act.swiglu_limit is not None:
        gate = np.minimum(gate, act.swiglu_limit)
        up = np.clip(up, -act.swiglu_limit, act.swiglu_limit)
    if act.kind == "swiglu_oai":
        return gate / (1 + np.exp(-act.gemm1_alpha * gate)) * (up + 1)
    return gate / (1 + np.exp(-gate)) * up


def np_moe(x, params, cfg: MoEConfig, token_ids=None, ids=None, weights=None):
    """Per-token loop: out[t] = scaling * sum_j w_j * W2[e_j] act(W13[e_j] x_t) + shared(x_t)."""
    x64 = np.asarray(x, np.float64)
    if ids is None:
        ids, weights = np_route(x64, params.gate_weight, params.e_score_correction_bias, cfg,
                                params.tid2eid, token_ids)
    w13 = np_dequant_weight(params.w13, params.w13_scale, cfg.recipe)
    w2 = np_dequant_weight(params.w2, params.w2_scale, cfg.recipe)
    out = np.zeros_like(x64)
    for t in range(x64.shape[0]):
        for e, wt in zip(ids[t], weights[t]):
            if e < 0:
                continue
            out[t] += wt * (w2[e] @ np_act(w13[e] @ x64[t], cfg))
        out[t] *= cfg.routed_scaling_factor
        if cfg.n_shared_experts:
            s13 = np.asarray(params.shared_w13, np.float64)
            s2 = np.asarray(params.shared_w2, np.float64)
            out[t] += s2 @ np_act(s13 @ x64[t], cfg)
    return out


def rel_err(y, ref) -> float:
    y = np.asarray(y, np.float64)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


# ------------------------------------------------------------------------------------------------
# cached fixtures (jit compilations are the cost; reuse them)
# ------------------------------------------------------------------------------------------------
BASE = MoEConfig.deepseek_v3(recipe="bf16").scaled(num_experts=16, top_k=4, hidden_size=256,
                                      intermediate_size=128)
V4 = MoEConfig.deepseek_v4().scaled(num_experts=16, hidden_size=256, intermediate_size=128,
                                    vocab_size=97)
M = 29

_init = jax.jit(mj.init_params, static_argnames=("config", "num_local_experts", "tp_size"))
_prepare = jax.jit(mj.prepare_params, static_argnames=("config", "arch"))
_forward = jax.jit(mj.moe_forward, static_argnames=("config", "layout", "backend"))


@functools.lru_cache(maxsize=None)
def _params(init_cfg: MoEConfig, arch: int, seed: int):
    p = _init(jax.random.key(seed), config=init_cfg)
    return p, _prepare(p, config=init_cfg, arch=arch)


def params_for(cfg: MoEConfig, seed: int = 0):
    """(checkpoint form, GEMM form) params; configs differing only in fields init_params ignores
    share them (and the compilations)."""
    init_cfg = MoEConfig(num_experts=cfg.num_experts, top_k=cfg.top_k, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, recipe=cfg.recipe,
                         n_shared_experts=cfg.n_shared_experts,
                         use_correction_bias=cfg.use_correction_bias,
                         hash_routing=cfg.hash_routing, vocab_size=cfg.vocab_size)
    return _params(init_cfg, cfg.gemm_arch, seed)


def inputs(m: int = M, seed: int = 1, h: int = 256):
    return jax.random.normal(jax.random.key(seed), (m, h), jnp.float32).astype(jnp.bfloat16)


# Tolerance (relative Frobenius error vs the float64 model on the checkpoint's dequantized weights):
#  bf16: bf16 rounding of GEMM1 output and of the activation (2^-9 relative each) -> 1e-2.
#  fp8 activations (e4m3, 3 mantissa bits: <= 2^-4 relative per element, ~2% RMS), quantized twice
#  (GEMM1 and GEMM2 inputs): 5e-2; arch 100 adds power-of-two scales (up to 2x coarser steps) and
#  the UE8M0 requant of block-FP8 weights: 8e-2. The measured errors are about half of these.
TOL = {("bf16", 90): 1e-2, ("fp8_block", 90): 5e-2, ("fp8_block", 100): 8e-2,
       ("mxfp8", 100): 8e-2, ("mxfp4", 100): 8e-2, ("mxfp4", 90): 8e-2}

RECIPE_ARCH = list(TOL)


@pytest.mark.parametrize("layout", ["contig", "masked"])
@pytest.mark.parametrize("recipe,arch", RECIPE_ARCH)
def test_layer_matches_numpy_model_every_recipe(recipe, arch, layout):
    cfg = BASE.scaled(recipe=recipe, arch=arch)
    p, pp = params_for(cfg)
    x = inputs()
    y = np.asarray(_forward(x, pp, config=cfg, layout=layout).astype(jnp.float32))
    assert y.shape == (M, 256) and np.all(np.isfinite(y))
    assert np.all(np.abs(y).sum(-1) > 0)  # every token row written
    ref = np_moe(x.astype(jnp.float32), p, cfg)
    err = rel_err(y, ref)
    assert err < TOL[(recipe, arch)], err
    # a quantized recipe must not accidentally compute in high precision: error above bf16's
    if recipe != "bf16":
        assert err > 1e-3


@pytest.mark.parametrize("recipe,arch", RECIPE_ARCH)
def test_contig_and_masked_identical(recipe, arch):
    cfg = BASE.scaled(recipe=recipe, arch=arch)
    _, pp = params_for(cfg)
    x = inputs()
    yc = np.asarray(_forward(x, pp, config=cfg, layout="contig").astype(jnp.float32))
    ym = np.asarray(_forward(x, pp, config=cfg, layout="masked").astype(jnp.float32))
    np.testing.assert_array_equal(yc, ym)


ACT_CASES = {
    "silu_limit": dict(activation=ActivationSpec(swiglu_limit=0.3)),
    "swiglu_oai": dict(activation=ActivationSpec(kind="swiglu_oai", gemm1_alpha=1.702, swiglu_limit=0.4)),
    "situ": dict(activation=ActivationSpec(kind="situ", situ_beta=0.5, situ_linear_beta=0.25)),
    "softmax_flat": dict(scoring="softmax", use_correction_bias=False, use_grouped_topk=False,
                         norm_topk_prob=False, routed_scaling_factor=1.0, n_shared_experts=0),
    "sigmoid_nobias": dict(use_correction_bias=False, n_shared_experts=2),
}


@pytest.mark.parametrize("case", list(ACT_CASES))
def test_activation_and_scoring_variants_bf16(case):
    cfg = BASE.scaled(**ACT_CASES[case])
    p, pp = params_for(cfg)
    x = inputs()
    y = np.asarray(_forward(x, pp, config=cfg, layout="contig").astype(jnp.float32))
    ref = np_moe(x.astype(jnp.float32), p, cfg)
    assert rel_err(y, ref) < 1e-2
    if cfg.activation.swiglu_limit is not None:  # the clamp is active on these inputs
        h = np.asarray(x, np.float64) @ np_dequant_weight(p.w13, None, "bf16")[0].T
        assert np.abs(h).max() > cfg.activation.swiglu_limit


@pytest.mark.parametrize("recipe,arch,layout,extra", [
    ("fp8_block", 100, "masked", dict(activation=ActivationSpec(keep_fp32=True))),
    ("fp8_block", 90, "contig", dict(activation=ActivationSpec(kind="swiglu_oai", gemm1_alpha=1.702,
                                                              swiglu_limit=0.4))),
    ("mxfp8", 100, "masked", dict(activation=ActivationSpec(kind="situ", situ_beta=0.5, situ_linear_beta=0.25))),
])
def test_activation_variants_quantized(recipe, arch, layout, extra):
    cfg = BASE.scaled(recipe=recipe, arch=arch, **extra)
    p, pp = params_for(cfg)
    x = inputs()
    y = np.asarray(_forward(x, pp, config=cfg, layout=layout).astype(jnp.float32))
    assert rel_err(y, np_moe(x.astype(jnp.float32), p, cfg)) < TOL[(recipe, arch)]


@pytest.mark.parametrize("arch,hashed", [(100, False), (90, True)])
def test_deepseek_v4_score_and_hash_routed(arch, hashed):
    x = inputs(17, seed=3)
    tok = jax.random.randint(jax.random.key(4), (17,), 0, V4.vocab_size, jnp.int32)
    cfg = V4.scaled(arch=arch, hash_routing=hashed)
    p, pp = params_for(cfg)
    y = np.asarray(_forward(x, pp, config=cfg, token_ids=tok if hashed else None).astype(jnp.float32))
    ref = np_moe(x.astype(jnp.float32), p, cfg, token_ids=np.asarray(tok))
    assert rel_err(y, ref) < TOL[("mxfp4", arch)]


_route = jax.jit(mj.route, static_argnames=("config",))


@pytest.mark.parametrize("cfg", [
    BASE,
    BASE.scaled(scoring="softmax", use_correction_bias=False, use_grouped_topk=False),
    BASE.scaled(n_group=4, topk_group=1, top_k=3),
    BASE.scaled(scoring="softmax", use_correction_bias=False),  # V2: grouped, no bias
    V4,
])
def test_routing_ids_exact_and_weights(cfg):
    p, _ = params_for(cfg.scaled(recipe="bf16", arch=None))
    x = inputs(41, seed=5)
    ids, w = _route(x, p, config=cfg)
    assert ids.dtype == jnp.int32 and w.dtype == jnp.float32
    rid, rw = np_route(np.asarray(x.astype(jnp.float32)), p.gate_weight, p.e_score_correction_bias, cfg)
    np.testing.assert_array_equal(np.asarray(ids), rid)
    np.testing.assert_allclose(np.asarray(w), rw, rtol=1e-5, atol=1e-6)
    assert np.all(np.sort(np.asarray(ids), 1)[:, 1:] != np.sort(np.asarray(ids), 1)[:, :-1])


def test_grouped_topk_group_score_rule():
    """Group score: top-2 sum with a correction bias (V3), group maximum without (V2). Group 0 has
    one strong expert, group 1 two medium ones: the two rules keep different groups."""
    base = dict(num_experts=4, top_k=1, hidden_size=4, intermediate_size=8, scoring="sigmoid",
                use_grouped_topk=True, n_group=2, topk_group=1, norm_topk_prob=False)
    gate = jnp.zeros((4, 4), jnp.float32).at[:, 0].set(jnp.array([3.0, -3.0, 1.0, 1.0]))
    x = jnp.array([[1.0, 0, 0, 0]], jnp.float32)
    p = mj.MoEParams(gate_weight=gate, w13=jnp.zeros((4, 16, 4), jnp.bfloat16),
                     w2=jnp.zeros((4, 4, 8), jnp.bfloat16))
    ids, w = _route(x, p, config=MoEConfig(**base))
    assert ids.tolist() == [[0]]  # max: 0.95 (group 0) > 0.73 (group 1)
    np.testing.assert_allclose(np.asarray(w), 1 / (1 + np.exp(-3.0)), rtol=1e-6)
    pb = p.replace(e_score_correction_bias=jnp.zeros((4,), jnp.float32))
    ids, _ = _route(x, pb, config=MoEConfig(**base, use_correction_bias=True))
    assert ids.tolist() == [[2]]  # top-2 sum: 1.0 (group 0) < 1.46 (group 1); tie -> lower id


def test_bad_correction_bias_disagrees_with_config():
    cfg = MoEConfig(num_experts=4, top_k=1, hidden_size=4, intermediate_size=8)
    p = mj.MoEParams(gate_weight=jnp.ones((4, 4), jnp.float32), w13=jnp.zeros((4, 16, 4), jnp.bfloat16),
                     w2=jnp.zeros((4, 4, 8), jnp.bfloat16))
    x = jnp.ones((2, 4), jnp.float32)
    with pytest.raises(ValueError, match=r"params.e_score_correction_bias: expected shape \(4,\) "
                                         r"\(config.use_correction_bias\), got None"):
        mj.route(x, p, cfg.scaled(use_correction_bias=True))
    with pytest.raises(ValueError, match="params.e_score_correction_bias: expected None for "
                                         "config.use_correction_bias=False, got shape \\(4,\\)"):
        mj.route(x, p.replace(e_score_correction_bias=jnp.zeros((4,), jnp.float32)), cfg)


def test_routing_hash_uses_tid2eid():
    cfg = V4.scaled(recipe="bf16", hash_routing=True)
    p, _ = params_for(cfg)
    tok = jnp.array([5, 96, 0, 5, 41], jnp.int32)
    x = inputs(5, seed=6)
    ids, w = _route(x, p, config=cfg, token_ids=tok)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(p.tid2eid)[np.asarray(tok)])
    rid, rw = np_route(np.asarray(x.astype(jnp.float32)), p.gate_weight, None, cfg, p.tid2eid, np.asarray(tok))
    np.testing.assert_allclose(np.asarray(w), rw, rtol=1e-5)


def test_routing_ties_lower_id_and_stable_sqrtsoftplus():
    cfg = MoEConfig(num_experts=8, top_k=3, hidden_size=4, intermediate_size=8,
                    scoring="sqrtsoftplus", norm_topk_prob=False)
    gate = jnp.zeros((8, 4), jnp.float32).at[:, 0].set(jnp.array([1, 3, 3, 0, 3, 2, 0, 3.0]))
    p = mj.MoEParams(gate_weight=gate, w13=jnp.zeros((8, 16, 4), jnp.bfloat16),
                     w2=jnp.zeros((8, 4, 8), jnp.bfloat16))
    x = jnp.array([[1, 0, 0, 0], [200, 0, 0, 0], [-200, 0, 0, 0]], jnp.float32)
    ids, w = _route(x, p, config=cfg)
    np.testing.assert_array_equal(np.asarray(ids[0]), [1, 2, 4])  # ties -> lower ids
    assert np.all(np.isfinite(np.asarray(w)))
    np.testing.assert_allclose(np.asarray(w[1]), np.sqrt(600.0), rtol=1e-6)  # softplus(600) = 600
    np.testing.assert_array_equal(np.asarray(ids[2]), [3, 6, 0])
    np.testing.assert_allclose(np.asarray(w[2, :2]), np.sqrt(np.log(2.0)), rtol=1e-6)
    assert 0 <= float(w[2, 2]) < 1e-37  # exp(-100): tiny or flushed, never nan
    # gradients stay finite where softplus underflows (renormalized weights too)
    g = jax.jit(jax.grad(lambda x: jnp.sum(mj.route(x, p, cfg.scaled(norm_topk_prob=True))[1])))(
        x.at[2, 0].set(-2000.0))
    assert np.all(np.isfinite(np.asarray(g)))


def test_padding_rows_and_foreign_ids_contribute_nothing():
    cfg = BASE.scaled(recipe="fp8_block", arch=90, n_shared_experts=0)
    p, pp = params_for(cfg)
    x = inputs()
    ids, w = _route(x, pp, config=cfg)
    ids = ids.at[3].set(-1).at[7, 1:].set(-1)  # a padding row, and a partly excluded row
    ref = np_moe(x.astype(jnp.float32), p, cfg, ids=np.asarray(ids), weights=np.asarray(w))
    rexp = jax.jit(mj.routed_experts, static_argnames=("config", "layout", "backend", "out_dtype"))
    for layout in ("contig", "masked"):
        y = np.asarray(rexp(x, ids, w, pp, config=cfg, layout=layout, out_dtype=jnp.float32))
        assert np.all(y[3] == 0)
        assert rel_err(y, ref) < TOL[("fp8_block", 90)]


def test_expert_shards_sum_to_the_whole():
    """EP: experts split over 2 'ranks' (offset python int and traced), masked layout;
    TP: I split in 2, contig layout."""
    cfg = BASE.scaled(recipe="bf16", n_shared_experts=0)
    p, pp = params_for(cfg)
    x = inputs()
    ids, w = _route(x, pp, config=cfg)
    rexp = jax.jit(mj.routed_experts, static_argnames=("config", "layout", "backend", "out_dtype"))
    full = {lay: np.asarray(rexp(x, ids, w, pp, config=cfg, layout=lay, out_dtype=jnp.float32))
            for lay in ("contig", "masked")}
    half = cfg.num_experts // 2
    parts = []
    for r in range(2):
        pr = pp.replace(w13=pp.w13[r * half:(r + 1) * half], w2=pp.w2[r * half:(r + 1) * half])
        off = jnp.int32(r * half) if r else 0
        parts.append(np.asarray(rexp(x, ids, w, pr, config=cfg, layout="masked", expert_offset=off,
                                     out_dtype=jnp.float32)))
    np.testing.assert_allclose(parts[0] + parts[1], full["masked"], rtol=1e-5, atol=1e-5)
    assert np.abs(parts[0]).sum() > 0 and np.abs(parts[1]).sum() > 0
    i, big_i = cfg.intermediate_size // 2, cfg.intermediate_size
    tp = []
    for r in range(2):
        rows = np.r_[r * i:(r + 1) * i, big_i + r * i:big_i + (r + 1) * i]  # its gate and up rows
        pr = pp.replace(w13=pp.w13[:, rows], w2=pp.w2[:, :, r * i:(r + 1) * i])
        tp.append(np.asarray(rexp(x, ids, w, pr, config=cfg, layout="contig", out_dtype=jnp.float32)))
    assert rel_err(tp[0] + tp[1], full["contig"]) < 1e-2  # bf16 rounding of GEMM2 partials differs


def test_grad_through_bf16_path():
    cfg = BASE.scaled(recipe="bf16", use_correction_bias=False)
    _, pp = params_for(cfg)
    x = inputs(11, seed=8)
    r = jax.random.normal(jax.random.key(9), (11, 256), jnp.float32)
    ids, _ = _route(x, pp, config=cfg)

    def loss_layer(x, p):
        return jnp.sum(mj.moe_forward(x, p, cfg, layout="masked").astype(jnp.float32) * r)

    def loss_dense(x, p):  # independent dense f32 formulation with the same (fixed) expert choice
        xf = x.astype(jnp.float32)
        sc = jax.nn.sigmoid(xf @ p.gate_weight.T)
        wsel = jnp.take_along_axis(sc, ids, 1)
        wsel = wsel / wsel.sum(1, keepdims=True)
        h = jnp.einsum("mh,mknh->mkn", xf, p.w13.astype(jnp.float32)[ids])
        i = h.shape[-1] // 2
        a = jax.nn.silu(h[..., :i]) * h[..., i:]
        y = jnp.einsum("mki,mkhi->mkh", a, p.w2.astype(jnp.float32)[ids])
        y = cfg.routed_scaling_factor * jnp.einsum("mkh,mk->mh", y, wsel)
        hs = xf @ p.shared_w13.astype(jnp.float32).T
        y = y + (jax.nn.silu(hs[:, :i]) * hs[:, i:]) @ p.shared_w2.astype(jnp.float32).T
        return jnp.sum(y * r)

    g = jax.jit(jax.grad(loss_layer, argnums=(0, 1)))(x, pp)
    gd = jax.jit(jax.grad(loss_dense, argnums=(0, 1)))(x, pp)
    for a, b in [(g[0], gd[0]), (g[1].w13, gd[1].w13), (g[1].w2, gd[1].w2),
                 (g[1].gate_weight, gd[1].gate_weight), (g[1].shared_w13, gd[1].shared_w13)]:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.isfinite(a)) and np.abs(b).sum() > 0
        assert rel_err(a, b) < 3e-2


def test_jit_and_auto_layout_budget():
    cfg = BASE.scaled(recipe="bf16", masked_memory_budget_bytes=1 << 40)
    assert mj.resolve_layout("auto", cfg, num_tokens=M, num_local_experts=16,
                             local_intermediate_size=128) == "masked"
    assert mj.resolve_layout("auto", cfg.scaled(masked_memory_budget_bytes=1000), num_tokens=M,
                             num_local_experts=16, local_intermediate_size=128) == "contig"
    assert mj.resolve_layout("contig", cfg, num_tokens=M, num_local_experts=16,
                             local_intermediate_size=128) == "contig"
    p, pp = params_for(BASE.scaled(recipe="bf16"))
    x = inputs()
    eager = np.asarray(mj.moe_forward(x, p, cfg).astype(jnp.float32))  # checkpoint form, eager
    jitted = np.asarray(_forward(x, pp, config=cfg).astype(jnp.float32))
    assert rel_err(eager, jitted) < 2e-3  # op fusion may move a bf16 rounding by one ulp


# ------------------------------------------------------------------------------------------------
# bad inputs: each a clear error at trace time
# ------------------------------------------------------------------------------------------------
def test_bad_x_rank_dtype_hidden():
    cfg = BASE.scaled(recipe="bf16")
    _, pp = params_for(cfg)
    with pytest.raises(ValueError, match=r"x: expected rank >= 2 \(..., H=256\), got shape \(256,\)"):
        mj.moe_forward(jnp.zeros((256,), jnp.bfloat16), pp, cfg)
    with pytest.raises(ValueError, match=r"x: expected at least one token \(..., H=256\), got shape \(2, 0, 256\)"):
        mj.moe_forward(jnp.zeros((2, 0, 256), jnp.bfloat16), pp, cfg)
    with pytest.raises(TypeError, match="x: expected dtype"):
        mj.moe_forward(jnp.zeros((4, 256), jnp.int32), pp, cfg)
    with pytest.raises(ValueError, match=r"x: expected shape \(..., H=256\), got \(4, 128\)"):
        mj.moe_forward(jnp.ones((4, 128), jnp.bfloat16), pp, cfg)


def test_bad_params_inconsistent_with_config():
    cfg = BASE.scaled(recipe="bf16")
    _, pp = params_for(cfg)
    x = inputs(4)
    with pytest.raises(ValueError, match=r"params.gate_weight: expected shape \(16, 256\)"):
        mj.moe_forward(x, pp.replace(gate_weight=pp.gate_weight[:8]), cfg)
    with pytest.raises(ValueError, match="params.w13"):
        mj.moe_forward(x, pp.replace(w13=pp.w13[:, :100]), cfg)
    with pytest.raises(ValueError, match="params.shared_w13"):
        mj.moe_forward(x, pp.replace(shared_w13=None), cfg)
    fp8 = BASE.scaled(recipe="fp8_block", arch=90)
    with pytest.raises(TypeError, match="params.w13: expected dtype float8_e4m3fn"):
        mj.moe_forward(x, params_for(cfg)[0], fp8)
    with pytest.raises(ValueError, match="prepared as 'bf16'"):
        mj.moe_forward(x, pp, fp8)


def test_bad_hash_routing_without_token_ids():
    cfg = V4.scaled(recipe="bf16", hash_routing=True)
    p, _ = params_for(cfg)
    with pytest.raises(ValueError, match="token_ids: required for a hash-routed layer"):
        mj.route(inputs(4), p, cfg)


def test_bad_hash_table_disagrees_with_config():
    """The config decides hash routing: a table on a non-hash layer (or none on a hash layer) is an
    error, never a silent switch of the routing rule."""
    hashed = V4.scaled(recipe="bf16", hash_routing=True)
    plain = V4.scaled(recipe="bf16")
    p, _ = params_for(hashed)
    tok = jnp.arange(4, dtype=jnp.int32)
    with pytest.raises(ValueError, match="params.tid2eid: expected None for a layer with "
                                         "config.hash_routing=False, got an array of shape \\(97, 6\\)"):
        mj.route(inputs(4), p, plain, token_ids=tok)
    ids, w = mj.route(inputs(4), p.replace(tid2eid=None), plain)
    with pytest.raises(ValueError, match="params.tid2eid: expected None for a layer with config.hash"):
        mj.routed_experts(inputs(4), ids, w, p, plain)  # check_params says the same
    with pytest.raises(ValueError, match="params.tid2eid: required when config.hash_routing is True"):
        mj.route(inputs(4), p.replace(tid2eid=None), hashed, token_ids=tok)


def test_bad_routed_experts_inputs():
    cfg = BASE.scaled(recipe="bf16")
    _, pp = params_for(cfg)
    x = inputs(4)
    ids = jnp.zeros((4, cfg.top_k), jnp.int32)
    w = jnp.ones((4, cfg.top_k), jnp.float32)
    with pytest.raises(ValueError, match=r"topk_ids/topk_weights: expected shape \(4, 4\), got \(4, 3\)"):
        mj.routed_experts(x, ids[:, :3], w, pp, cfg)
    with pytest.raises(TypeError, match="topk_ids: expected an integer dtype, got float32"):
        mj.routed_experts(x, w, w, pp, cfg)
    with pytest.raises(TypeError, match="topk_weights: expected a float dtype, got int32"):
        mj.routed_experts(x, ids, ids, pp, cfg)
    with pytest.raises(ValueError, match=r"num_local_experts: expected an int in \[1, 16\]"):
        mj.init_params(jax.random.key(0), cfg, num_local_experts=17)


def test_bad_masked_capacity_too_small():
    cfg = BASE.scaled(recipe="bf16", masked_m_pad=128)
    _, pp = params_for(cfg)
    with pytest.raises(ValueError, match="m_pad=128 is too small for the static worst case"):
        mj.moe_forward(inputs(130), pp, cfg, layout="masked")


def test_bad_alignment_for_recipe():
    with pytest.raises(ValueError, match="alignment=64 must be a multiple of 128 for recipe 'fp8_block'"):
        BASE.scaled(recipe="fp8_block", alignment=64)


def test_bad_moe_forward_with_an_expert_shard():
    config = mj.MoEConfig.deepseek_v3().scaled(num_experts=8, top_k=4, hidden_size=128, intermediate_size=128,
                                                recipe="bf16")
    shard = mj.init_params(jax.random.key(0), config, num_local_experts=4)
    x = jax.random.normal(jax.random.key(1), (3, 128)).astype(jnp.bfloat16)
    with pytest.raises(ValueError, match=r"params.w13: moe_forward needs all 8 experts, got 4"):
        mj.moe_forward(x, shard, config)


@pytest.mark.parametrize("hashed", [False, True])
def test_leading_dims_are_kept(hashed):
    """(batch, seq, H) activations, as a Flax model passes them: the same rows as the flat call."""
    cfg = V4.scaled(hash_routing=hashed, arch=90)
    _, pp = params_for(cfg)
    x = inputs(12, seed=7).reshape(3, 4, 256)
    tok = jax.random.randint(jax.random.key(8), (3, 4), 0, cfg.vocab_size, jnp.int32) if hashed else None
    flat_tok = None if tok is None else tok.reshape(-1)
    y = _forward(x, pp, config=cfg, token_ids=tok)
    assert y.shape == (3, 4, 256) and y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(y).reshape(12, 256),
                                  np.asarray(_forward(x.reshape(12, 256), pp, config=cfg, token_ids=flat_tok)))
    ids, w = mj.route(x, pp, cfg, token_ids=tok)
    assert ids.shape == w.shape == (3, 4, cfg.top_k)
    routed = mj.routed_experts(x, ids, w, pp, cfg)
    shared = mj.shared_experts(x, pp, cfg)
    assert routed.shape == shared.shape == (3, 4, 256)
    flat = mj.routed_experts(x.reshape(12, 256), ids.reshape(12, -1), w.reshape(12, -1), pp, cfg)
    np.testing.assert_array_equal(np.asarray(routed).reshape(12, 256), np.asarray(flat))
    if hashed:
        with pytest.raises(ValueError, match=r"token_ids: expected shape \(3, 4\) \(the leading dims of x\), got \(12,\)"):
            mj.moe_forward(x, pp, cfg, token_ids=flat_tok)
    with pytest.raises(ValueError, match=r"topk_ids/topk_weights: expected shape \(3, 4, 6\)"):
        mj.routed_experts(x, ids.reshape(12, -1), w.reshape(12, -1), pp, cfg)


def test_router_gemm_on_bf16_operands_computes_the_fp32_products():
    """bf16 x bf16 products are exact in fp32: the cheap path must equal the fp32 GEMM of the same
    values up to summation order, and pick the same experts."""
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((64, 512)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((32, 512)) / 20, jnp.bfloat16)
    fast = np.asarray(mj.router_logits(x, g))
    exact = np.asarray(x, np.float64) @ np.asarray(g, np.float64).T
    f32 = np.asarray(mj.router_logits(x.astype(jnp.float32), g.astype(jnp.float32)))
    np.testing.assert_allclose(fast, exact, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fast, f32, rtol=1e-5, atol=1e-5)
    assert (np.argsort(-fast, axis=1)[:, :8] == np.argsort(-exact, axis=1)[:, :8]).mean() > 0.99


# ------------------------------------------------------------------------------ the fused layout

def _fused_setup(shared=0, clamp=None):
    cfg = MoEConfig.deepseek_v3(num_experts=8, n_shared_experts=shared, n_group=4, topk_group=2, top_k=3,
                                hidden_size=512, intermediate_size=256, recipe="fp8_block", arch=90,
                                layout="fused", activation=ActivationSpec(kind="silu", swiglu_limit=clamp))
    raw = mj.init_params(jax.random.PRNGKey(7), cfg)
    return cfg, raw, mj.prepare_params(raw, cfg)


@pytest.mark.parametrize("shared,clamp", [(0, None), (1, 0.05)])
def test_fused_layout_is_the_fused_op_on_the_routes(shared, clamp):
    """moe_forward with layout "fused" = route, then the fused op on the interleaved weights, then
    the dense shared expert added in fp32; its w13 is the [gate; up] weight interleaved by 8."""
    import custom_calls as cc
    from layouts import deinterleave_gate_up

    cfg, raw, params = _fused_setup(shared, clamp)
    staged = mj.prepare_params(raw, MoEConfig(**{**cfg.__dict__, "layout": "contig"}))
    assert params.w13_interleave == 8 and staged.w13_interleave == 0
    np.testing.assert_array_equal(np.asarray(deinterleave_gate_up(params.w13)).view(np.uint8),
                                  np.asarray(staged.w13).view(np.uint8))
    x = jax.random.normal(jax.random.PRNGKey(2), (19, cfg.hidden_size), jnp.bfloat16)
    got = mj.moe_forward(x, params, cfg, backend="reference")
    ids, w = mj.route(x, params, cfg)
    routed = cc.fused_moe(x, ids, w, staged.w13, staged.w13_scale, staged.w2, staged.w2_scale,
                          routed_scaling_factor=cfg.routed_scaling_factor, activation_clamp=clamp)
    want = routed.astype(jnp.float32)
    if shared:
        want = want + mj.shared_experts(x, staged, cfg, out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.bfloat16)
                                                                                  .astype(jnp.float32)))
    # the staged layouts agree up to the FP8 rounding of the intermediate (a different order)
    other = mj.moe_forward(x, staged, MoEConfig(**{**cfg.__dict__, "layout": "contig"}), backend="reference")
    d = np.asarray(got.astype(jnp.float32) - other.astype(jnp.float32))
    assert np.linalg.norm(d) / np.linalg.norm(np.asarray(other.astype(jnp.float32))) < 5e-2


@pytest.mark.parametrize("hashed,router", [(False, "f32"), (False, "bf16"), (True, "f32")])
def test_deepseek_v4_runs_the_fused_layout_on_hopper(hashed, router):
    """DeepSeek-V4's MXFP4 experts run as fp8_block on arch 90, so its config takes the fused layout:
    sqrtsoftplus + correction bias routing (inside the op with a bf16 router, `fused_moe_routed`),
    or hash routing by tid2eid before the op; the swiglu_limit clamp inside. Against the float64
    model of the checkpoint and against the contig layout of the same weights."""
    cfg = V4.scaled(arch=90, layout="fused", hash_routing=hashed)
    contig = cfg.scaled(layout="contig")
    assert cfg.recipe == "mxfp4" and cfg.gemm_recipe == "fp8_block"
    raw, _ = params_for(cfg)
    if router == "bf16":
        raw = raw.replace(gate_weight=raw.gate_weight.astype(jnp.bfloat16))
    fused, staged = mj.prepare_params(raw, cfg), mj.prepare_params(raw, contig)
    assert fused.w13_interleave == 8 and fused.gemm_recipe == "fp8_block"
    x = inputs(23, seed=8)
    tok = jax.random.randint(jax.random.key(9), (23,), 0, cfg.vocab_size, jnp.int32) if hashed else None
    y = np.asarray(_forward(x, fused, config=cfg, token_ids=tok).astype(jnp.float32))
    ref = np_moe(x.astype(jnp.float32), raw, cfg, token_ids=None if tok is None else np.asarray(tok))
    assert rel_err(y, ref) < TOL[("mxfp4", 90)]
    other = np.asarray(_forward(x, staged, config=contig, token_ids=tok).astype(jnp.float32))
    assert np.linalg.norm(y - other) / np.linalg.norm(other) < 5e-2


@pytest.mark.parametrize("hashed,router", [(False, "bf16"), (False, "f32"), (True, "f32")])
def test_deepseek_v4_fused_layout_widens_its_4bit_experts(hashed, router):
    """With the MXFP4 experts kept 4-bit (mxfp4_sm90_form="w4a8") the fused layout widens them into its
    FP8 operands at each call: prepare_params keeps them 4-bit with w13 [gate; up], and the layer's output
    equals the FP4 -> FP8 form's fused layout bit for bit (routing inside the op with a bf16 router,
    before it with an f32 one or by hash). A config of layout "auto" takes "fused" per call, and
    routed_experts runs an expert shard (expert_offset) on it."""
    cfg4 = V4.scaled(arch=90, layout="fused", hash_routing=hashed, mxfp4_sm90_form="w4a8")
    cfg8 = cfg4.scaled(mxfp4_sm90_form="fp8")
    raw, _ = params_for(cfg8)
    if router == "bf16":
        raw = raw.replace(gate_weight=raw.gate_weight.astype(jnp.bfloat16))
    p4, p8 = mj.prepare_params(raw, cfg4), mj.prepare_params(raw, cfg8)
    assert p4.kept_4bit and p4.w13.dtype == jnp.int8 and p4.w13_interleave == 0 and p8.w13_interleave == 8
    x = inputs(23, seed=8)
    tok = jax.random.randint(jax.random.key(9), (23,), 0, cfg4.vocab_size, jnp.int32) if hashed else None
    bits = lambda y: np.asarray(y).view(np.uint16)  # noqa: E731
    want = bits(_forward(x, p8, config=cfg8, token_ids=tok))
    np.testing.assert_array_equal(bits(_forward(x, p4, config=cfg4, token_ids=tok)), want)
    auto = cfg4.scaled(layout="auto")
    pa = mj.prepare_params(raw, auto)
    np.testing.assert_array_equal(bits(_forward(x, pa, config=auto, token_ids=tok, layout="fused")), want)
    if not hashed:  # an expert shard: experts 4..11 of 16, the routes of the whole layer
        ids, w = mj.route(x, raw, cfg8)
        shard = lambda p: p.replace(w13=p.w13[4:12], w13_scale=p.w13_scale[4:12], w2=p.w2[4:12],  # noqa: E731
                                    w2_scale=p.w2_scale[4:12])
        y4 = mj.routed_experts(x, ids, w, shard(p4), cfg4, expert_offset=4)
        y8 = mj.routed_experts(x, ids, w, shard(p8), cfg8, expert_offset=4)
        assert np.abs(np.asarray(y8, np.float32)).max() > 0
        np.testing.assert_array_equal(bits(y4), bits(y8))


def test_merge_repeated_routes_keeps_the_sum_over_slots():
    from moe_jax.layer import merge_repeated_routes

    rng = np.random.default_rng(4)
    ids = rng.integers(-1, 5, (200, 6)).astype(np.int32)  # many repeats, -1 among them
    w = rng.random((200, 6)).astype(np.float32)
    got_ids, got_w = (np.asarray(a) for a in merge_repeated_routes(jnp.asarray(ids), jnp.asarray(w)))
    for m in range(200):
        want = {}
        for e, v in zip(ids[m], w[m]):
            want[e] = want.get(e, 0.0) + v
        kept = [e for e in got_ids[m] if e != -1]
        assert len(kept) == len(set(kept))  # each expert once
        for e in set(ids[m]) - {-1}:
            (slot,) = np.flatnonzero(got_ids[m] == e)
            assert slot == list(ids[m]).index(e)  # at its first slot
            np.testing.assert_allclose(got_w[m, slot], want[e], rtol=1e-6)
        np.testing.assert_allclose(got_w[m, got_ids[m] != -1].sum(), w[m, ids[m] != -1].sum(), rtol=1e-6)


def test_fused_layout_refuses_mismatched_params_and_configs():
    cfg, raw, params = _fused_setup()
    contig = MoEConfig(**{**cfg.__dict__, "layout": "contig"})
    x = jnp.ones((4, cfg.hidden_size), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"params.w13: layout 'contig' needs w13 rows \[gate; up\]"):
        mj.moe_forward(x, params, contig, backend="reference")
    staged = mj.prepare_params(raw, contig)
    with pytest.raises(ValueError, match=r"params.w13: layout 'fused' needs w13 rows interleaved"):
        mj.moe_forward(x, staged, cfg, backend="reference")
    assert mj.prepare_params(staged, cfg).w13_interleave == 8  # prepared params convert both ways
    assert mj.prepare_params(params, contig).w13_interleave == 0
    with pytest.raises(ValueError, match="layout='fused' needs weights that run as recipe 'fp8_block' on arch "
                                         "90.*got recipe 'bf16', which runs as 'bf16' on arch 90"):
        MoEConfig(**{**cfg.__dict__, "recipe": "bf16"})
    with pytest.raises(ValueError, match="got recipe 'mxfp4', which runs as 'mxfp4' on arch 100"):
        MoEConfig(**{**cfg.__dict__, "recipe": "mxfp4", "arch": 100})
    with pytest.raises(ValueError, match="got recipe 'fp8_block', which runs as 'fp8_block' on arch 100"):
        MoEConfig(**{**cfg.__dict__, "arch": 100})
    assert MoEConfig(**{**cfg.__dict__, "recipe": "mxfp4", "arch": 90}).gemm_recipe == "fp8_block"
    with pytest.raises(ValueError, match="layout='fused' needs activation kind 'silu'"):
        MoEConfig(**{**cfg.__dict__, "activation": ActivationSpec(kind="situ")})
    with pytest.raises(ValueError, match="fuse_shared_experts must be False"):
        MoEConfig(**{**cfg.__dict__, "n_shared_experts": 1, "fuse_shared_experts": True})
