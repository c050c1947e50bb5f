"""A float64 NumPy evaluation of one DeepSeek-style MoE layer, written from the data formats alone
(it imports nothing from moe_jax): the quickstart checks the layer against it.

Weights are decoded from their checkpoint form (e4m3 bytes through ml_dtypes, e2m1 nibbles through
the OCP table, scales broadcast over their blocks / groups). The data flow the recipes define is
emulated: activations quantized to e4m3 per token group (scale = max(amax, 1e-4) / 448, a power of
two rounded up where the GEMMs take UE8M0 scales), GEMM outputs and the activation rounded to bf16.
Everything else is float64.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def bf16(a: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (nearest even) and back to float64."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def decode_e2m1(packed: np.ndarray) -> np.ndarray:
    """(..., K/2) int8, element 2j in the low nibble, 2j+1 in the high one -> (..., K) float64."""
    b = packed.astype(np.uint8)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])
    return np.where(codes & 0x8, -1.0, 1.0) * E2M1_MAGNITUDES[codes & 0x7]


def dequantize_weight(w: np.ndarray, scale: np.ndarray | None, recipe: str) -> np.ndarray:
    """Checkpoint-form expert weight (E, N, K | K/2) + scale -> (E, N, K) float64."""
    if recipe == "bf16":
        return w.astype(np.float64)
    if recipe == "mxfp4":
        values = decode_e2m1(w)
    else:  # fp8_block, mxfp8: e4m3
        values = w.astype(np.float64)
    n, k = values.shape[-2:]
    rows = n // scale.shape[-2] if recipe == "fp8_block" else 1  # 128x128 blocks, else 1x32 groups
    cols = k // scale.shape[-1]
    return values * np.repeat(np.repeat(scale.astype(np.float64), rows, axis=-2), cols, axis=-1)


def quantize_activation(a: np.ndarray, group: int, pow2_scale: bool) -> np.ndarray:
    """a: (..., K) -> its e4m3 per-group quantization, dequantized (float64): scale = max(amax, 1e-4)
    / 448 stored as fp32 (rounded up to a power of two for UE8M0), q = a / scale rounded to the
    nearest e4m3 value (ties to even)."""
    g = a.reshape(*a.shape[:-1], a.shape[-1] // group, group)
    scale = np.maximum(np.abs(g).max(-1, keepdims=True), AMAX_FLOOR) / E4M3_MAX
    scale = np.exp2(np.ceil(np.log2(scale))) if pow2_scale else scale.astype(np.float32).astype(np.float64)
    q = np.clip(g / scale, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (q * scale).reshape(a.shape)


def gated_activation(gateup: np.ndarray, swiglu_limit: float | None) -> np.ndarray:
    """silu(gate) * up over the two halves of (..., 2I); swiglu_limit clamps gate above and up."""
    gate, up = np.split(gateup, 2, axis=-1)
    if swiglu_limit is not None:
        gate = np.minimum(gate, swiglu_limit)
        up = np.clip(up, -swiglu_limit, swiglu_limit)
    return gate / (1.0 + np.exp(-gate)) * up


def scores(logits: np.ndarray, scoring: str) -> np.ndarray:
    if scoring == "softmax":
        z = np.exp(logits - logits.max(-1, keepdims=True))
        return z / z.sum(-1, keepdims=True)
    if scoring == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    if scoring == "sqrtsoftplus":
        return np.sqrt(np.logaddexp(0.0, logits))
    raise ValueError(f"scoring {scoring!r}")


def route(x, gate_weight, bias, tid2eid, token_ids, cfg) -> tuple[np.ndarray, np.ndarray]:
    """-> (ids (M, k), weights (M, k)) in float64; ties go to the lower expert / group id."""
    s = scores(x @ gate_weight.T, cfg.scoring)
    if cfg.hash_routing:
        ids = tid2eid[token_ids]
    else:
        sel = s + bias if bias is not None else s.copy()
        m, e = sel.shape
        if cfg.use_grouped_topk and cfg.n_group > 1:
            grouped = sel.reshape(m, cfg.n_group, e // cfg.n_group)
            # groups ranked by their top-2 sum when the layer has a correction bias, else by their max
            ranked = -np.sort(-grouped, axis=-1)
            group_score = ranked[..., :2].sum(-1) if bias is not None else ranked[..., 0]
            keep = np.argsort(-group_score, axis=-1, kind="stable")[:, : cfg.topk_group]
            allowed = np.zeros((m, cfg.n_group), bool)
            np.put_along_axis(allowed, keep, True, axis=-1)
            sel = np.where(np.repeat(allowed, e // cfg.n_group, axis=-1), sel, -np.inf)
        ids = np.argsort(-sel, axis=-1, kind="stable")[:, : cfg.top_k]
    w = np.take_along_axis(s, ids, axis=-1)
    if cfg.norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    return ids, w


def moe_layer(x: np.ndarray, p: dict, cfg, token_ids: np.ndarray | None = None,
              gemm_recipe: str = "bf16", gemm_arch: int = 90) -> tuple[np.ndarray, np.ndarray]:
    """x: (M, H) (the layer's bf16 input as float64), p: checkpoint-form weights as NumPy arrays
    -> (y (M, H) float64, expert ids (M, k)). SiLU layers; the GEMMs' recipe and arch as the
    layer's prepared params say (fp8_block on arch 100 requantizes its weights at load: not modelled)."""
    if cfg.activation.kind != "silu" or (gemm_recipe == "fp8_block" and gemm_arch == 100 and cfg.recipe == "fp8_block"):
        raise NotImplementedError(f"activation {cfg.activation.kind!r} with recipe {cfg.recipe!r} on arch {gemm_arch}")
    ids, weights = route(x, p["gate_weight"], p.get("e_score_correction_bias"), p.get("tid2eid"),
                         token_ids, cfg)
    w13 = dequantize_weight(p["w13"], p.get("w13_scale"), cfg.recipe)  # (E, 2I, H)
    w2 = dequantize_weight(p["w2"], p.get("w2_scale"), cfg.recipe)     # (E, H, I)
    if gemm_recipe == "bf16":
        def quant(a):
            return bf16(a)
    else:  # FP8 activations: 32-groups for mxfp8, else 128; UE8M0 (power-of-two) scales on arch 100
        group = 32 if gemm_recipe == "mxfp8" else 128

        def quant(a):
            return quantize_activation(a, group, pow2_scale=gemm_arch == 100)
    xq = quant(x)
    y = np.zeros_like(x)
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        gateup = bf16(xq[rows] @ w13[e].T)
        a = quant(bf16(gated_activation(gateup, cfg.activation.swiglu_limit)))
        d = bf16(a @ w2[e].T)
        np.add.at(y, rows, weights[rows, slot][:, None] * d)
    y *= cfg.routed_scaling_factor
    if cfg.n_shared_experts:
        gateup = bf16(x @ p["shared_w13"].astype(np.float64).T)
        a = bf16(gated_activation(gateup, cfg.activation.swiglu_limit))
        y += a @ p["shared_w2"].astype(np.float64).T
    return y, ids
