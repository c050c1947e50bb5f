"""The layer that ``python -m moe_jax.bench layer`` measures (``fused``, ``timeline`` and ``tune`` reuse it):
its config, its GEMM-form params, its sizes, and the float32 model its output is checked against."""

from __future__ import annotations

import dataclasses
from typing import Any


# --model: the layer measured. "v3": DeepSeek-V3's routed layer with 32 experts (top-8 of 8 groups / top-4
# groups, sigmoid + correction bias, H 7168, I 2048); "v4": DeepSeek-V4-Flash's with a slice of 32 experts
# (top-6, sqrtsoftplus + correction bias, swiglu_limit 10, H 4096, I 2048, MXFP4 experts, which arch 90
# runs as fp8_block after the load-time FP4 -> FP8 expansion); "v4-256": the same with all 256 experts;
# "-w4a8": those V4 layers with the experts kept 4-bit (MoEConfig.mxfp4_sm90_form="w4a8").
MODELS = ("v3", "v4", "v4-256", "v4-w4a8", "v4-256-w4a8")


def _config(small: bool = False, model: str = "v3") -> Any:
    """The routed layer of `model` (`MODELS`) on one rank, arch 90, no shared expert (its dense MLP is
    not part of the routed path measured here)."""
    from moe_jax.config import MoEConfig

    if model == "v3":
        cfg = MoEConfig.deepseek_v3(num_experts=32, n_shared_experts=0, n_group=8, topk_group=4,
                                    recipe="fp8_block", arch=90)
    elif model in MODELS:
        cfg = MoEConfig.deepseek_v4(num_experts=256 if "256" in model else 32, n_shared_experts=0, arch=90,
                                    mxfp4_sm90_form="w4a8" if model.endswith("w4a8") else "fp8")
    else:
        raise ValueError(f"model: expected one of {', '.join(MODELS)}, got {model!r}")
    if small:  # a smoke-test size for machines without a GPU
        cfg = cfg.scaled(num_experts=16, hidden_size=256, intermediate_size=128, top_k=4)
    return cfg


def _bench_params(config: Any, shared_recipe: str = "bf16", *, router_only: bool = False) -> Any:
    """GEMM-form params of the benchmark layer (the same random draws for every call), with the
    router gate in bf16 as DeepSeek's checkpoints ship it: the router GEMM runs bf16 x bf16 -> f32.
    router_only: the same router fields with one expert of checkpoint-form weights instead of all of
    them (`init_params` draws every other field independently of the experts drawn): enough to route."""
    import jax
    import jax.numpy as jnp

    from moe_jax.params import init_params, prepare_params

    key = jax.random.PRNGKey(0)
    if router_only:
        params = init_params(key, config, num_local_experts=1, shared_recipe=shared_recipe)
    else:
        params = prepare_params(init_params(key, config, shared_recipe=shared_recipe), config)
    return dataclasses.replace(params, gate_weight=params.gate_weight.astype(jnp.bfloat16))


def _weight_bytes(params: Any) -> int:
    """Bytes of the routed experts' weights and scales: what a decode step must read at least once."""
    return sum(a.size * a.dtype.itemsize for a in (params.w13, params.w13_scale, params.w2, params.w2_scale))


def _gemm_activation_bytes(rows: int, h: int, inter: int) -> int:
    """Activation bytes in + out of the larger grouped GEMM (weights are arguments, not temporaries):
    GEMM1 reads e4m3 (rows, H) + fp32 scales and writes bf16 (rows, 2I); GEMM2 reads e4m3 (rows, I)
    + scales and writes bf16 (rows, H)."""
    gemm1 = rows * h + 4 * rows * (h // 128) + rows * 2 * inter * 2
    gemm2 = rows * inter + 4 * rows * (inter // 128) + rows * h * 2
    return max(gemm1, gemm2)


def _fp32_model(x, topk_ids, topk_weights, params, config, *, block: int = 128, blocks_per_step: int = 4):
    """Float32 routed output of the layer, from the routed (token, expert) pairs only.

    x: (M, H) float; topk_ids: (M, k) int32; topk_weights: (M, k) float -> (M, H) f32.
    Dequantized weights, unquantized activations, HIGHEST precision dots. The routes are grouped by
    expert with the contig dispatch (segments aligned to `block` rows), so each block of `block`
    rows belongs to one expert: `lax.map` over the blocks dequantizes that one expert's weights and
    runs its two GEMMs on the gathered token rows (with blocks_per_step=1, padding-only blocks are
    skipped). The cost is
    that of the two grouped GEMMs in float32 plus one weight dequantization per block; no copy of
    every expert's weights, per block or at all, is made. `blocks_per_step` blocks run together
    (one batched GEMM, that many single-expert weight copies live): a single 128-row GEMM keeps only
    a fraction of a large GPU's SMs busy.
    """
    import jax
    import jax.numpy as jnp

    from custom_calls.activation import gated_activation
    from custom_calls.grouped_gemm import dequantize_rhs
    from moe_jax.dispatch import dispatch_contig

    hi = jax.lax.Precision.HIGHEST
    m, k = topk_ids.shape
    h = x.shape[1]
    e = params.w13.shape[0]
    recipe, arch, act = params.gemm_recipe, params.gemm_arch, config.activation
    disp = dispatch_contig(topk_ids, num_local_experts=e, alignment=block)
    cap = disp.num_rows_cap
    src2dst = disp.src2dst.reshape(-1)
    token = jnp.arange(m * k, dtype=jnp.int32) // k
    row_token = jnp.zeros((cap,), jnp.int32).at[jnp.where(src2dst >= 0, src2dst, cap)].set(
        token, mode="drop", unique_indices=True)  # padding rows read token 0 and are never read back
    block_expert = jnp.max(disp.m_indices.reshape(cap // block, block), axis=1)  # -1: padding only
    xf = x.astype(jnp.float32)

    def one_expert_weights(w, scale, ex):
        w1 = jax.lax.dynamic_index_in_dim(w, ex, keepdims=True)
        s1 = None if scale is None else jax.lax.dynamic_index_in_dim(scale, ex, keepdims=True)
        return dequantize_rhs(w1, s1, recipe, arch)[0]

    def compute(b):
        ex = jnp.maximum(block_expert[b], 0)
        xb = xf[jax.lax.dynamic_slice_in_dim(row_token, b * block, block)]  # (block, H)
        w13 = one_expert_weights(params.w13, params.w13_scale, ex)  # (2I, H)
        gu = jnp.einsum("mk,nk->mn", xb, w13, precision=hi, preferred_element_type=jnp.float32)
        w2 = one_expert_weights(params.w2, params.w2_scale, ex)  # (H, I)
        return jnp.einsum("mi,hi->mh", gated_activation(gu, act), w2, precision=hi,
                          preferred_element_type=jnp.float32)

    def one_block(b):
        return jax.lax.cond(block_expert[b] >= 0, compute, lambda _: jnp.zeros((block, h), jnp.float32), b)

    nb = cap // block
    ys = jax.lax.map(one_block, jnp.arange(nb), batch_size=min(blocks_per_step, nb)).reshape(cap, h)
    dst = disp.src2dst
    w = jnp.where(dst >= 0, topk_weights.astype(jnp.float32), 0.0)
    out = jnp.zeros((m, h), jnp.float32)
    for j in range(k):  # k is small and static: no (M, k, H) temporary
        out = out + w[:, j, None] * ys[jnp.maximum(dst[:, j], 0)]
    return out * config.routed_scaling_factor
