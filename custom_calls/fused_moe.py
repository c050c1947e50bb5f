"""Fused MoE `fused_moe`: the whole routed expert branch in one op (dispatch, GEMM1, SwiGLU, FP8
quantization, GEMM2, top-k combine) with FP8 (e4m3, 128x128 block-scaled) expert weights.

The op's numerics are those of the SM90 fused kernel of the sgl-deep-gemm templates
(`custom_calls/deep_gemm/fused_moe.py`); the reference models them step by step. For token m and
each valid slot j (expert e = topk_ids[m, j]):

    xq    = 1x128 e4m3 quantization of x[m]                  (sf = max(amax, 1e-10) / 448)
    h     = dequant(xq) . dequant(w13[e])^T                  (fp32, 2I values: gate rows, then up rows)
    g, u  = h[:I], h[I:]; with activation_clamp c: g = min(g, c), u = clip(u, -c, c)
    a     = (silu(g) * u) * (topk_weights[m, j] * routed_scaling_factor)      (fp32, before quantizing)
    aq    = 1x128 e4m3 quantization of a                     (sf = max(amax, 1e-10) * fl(1/448))
    o_j   = bf16( dequant(aq) . dequant(w2[e])^T )           (fp32 accumulation)
    y[m]  = bf16( sum of o_j over the valid slots in ascending j, in fp32 )   (0 without one)

The amax floor is the kernel's 1e-10, not the 1e-4 of `layouts.fp8`, and the scales are rounded
as the kernel rounds them: the input stage divides amax by 448, the epilogue multiplies it by
fl(1/448) (the two can differ by one ulp), and both form 1 / sf and x * (1 / sf) in fp32 with
correctly rounded division (`_div_rn`). Hence a quantizer of its own here rather than
`layouts.quantize_fp8_per_token_group`; the e4m3 cast and the dequantization are the layouts'
helpers. The route weight scales `a` before its quantization, so the combine is an unweighted sum
of bf16 rows (unlike the un-permute of the staged path, which weights the bf16 GEMM2 rows).

Routes: an id outside [0, E) counts as -1 and a repeat of an expert already named by an earlier
slot of the same token is dropped (-1), for every backend (the kernel takes distinct experts per
token). A -1 slot contributes nothing. Implementations are called as impl(x, topk_ids,
topk_weights, w13, w13_scale, w2, w2_scale, *, routed_scaling_factor, activation_clamp,
w13_interleave) with w13 in the op's row order and the ids as given: each canonicalizes them
(`contracts.canonical_topk_ids`; the SM90 path inside its input kernel, no separate pass).

The reference groups the routes by expert in blocks of 128 rows, one fp32 GEMM per block (no
per-route copy of the weights): on one H200, about 0.1 s and 7 GiB at M 4096, H 7168, I 2048,
E 32, top-8.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from custom_calls import contracts
from custom_calls.backends import declare_op, resolve
from custom_calls.dispatch_map import contig_capacity, dispatch_map_contig_xla
from custom_calls.limits import check_index_extents, routes_and_rows
from custom_calls.route_topk import route_topk, sum_partials
from custom_calls.settings import KernelSettings, resolve_settings
from layouts import (
    FP8_E4M3_MAX,
    FusedMoEBuffer,
    cast_to_e4m3,
    deinterleave_gate_up,
    dequantize_fp8_per_block,
    dequantize_fp8_per_token_group,
    store_as,
)
from layouts.checks import check_dtype, check_multiple, check_rank, check_shape

OP = "fused_moe"
_HI = jax.lax.Precision.HIGHEST
_BLOCK = 128  # activation group, weight block (both axes)
AMAX_FLOOR = 1e-10  # the fused kernel's amax floor, input stage and epilogue (layouts.fp8 uses 1e-4)


def _div_rn(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den, f32, correctly rounded (to nearest even) by integer long division of the
    significands, for positive normal operands whose quotient is normal. XLA's f32 division is not
    always that: on the GPU about half of all quotients come out one ulp off, and on the CPU a
    division by a constant becomes a multiplication by its rounded reciprocal. A scale one ulp off
    decides an e4m3 tie of x * (1 / sf) the other way, and with bf16 tokens such ties are common."""
    nb = jax.lax.bitcast_convert_type(num, jnp.int32)
    db = jax.lax.bitcast_convert_type(den, jnp.int32)
    mn, md = (nb & 0x7FFFFF) | 0x800000, (db & 0x7FFFFF) | 0x800000
    small = mn < md
    rem = jnp.where(small, mn << 1, mn)  # now md <= rem < 2 md: the quotient's first bit is 1
    exp = (nb >> 23) - (db >> 23) + 127 - small.astype(jnp.int32)
    q = jnp.zeros_like(rem)
    for _ in range(24):
        bit = rem >= md
        rem = jnp.where(bit, rem - md, rem) << 1
        q = (q << 1) | bit.astype(jnp.int32)
    q = q + ((rem > md) | ((rem == md) & ((q & 1) == 1))).astype(jnp.int32)  # rem = 2 x remainder
    carry = q >> 24  # rounded up to 2^24
    bits = ((exp + carry) << 23) | ((q >> carry) & 0x7FFFFF)
    out = jax.lax.bitcast_convert_type(bits, jnp.float32)
    normal = (exp + carry > 0) & (exp + carry < 255) & jnp.isfinite(num) & jnp.isfinite(den) & (num > 0) & (den > 0)
    return jnp.where(normal, out, num / den)


def _token_scale(amax: jax.Array) -> jax.Array:
    return _div_rn(amax, jnp.full_like(amax, FP8_E4M3_MAX))  # the input stage divides by 448


def _activation_scale(amax: jax.Array) -> jax.Array:
    return amax * jnp.float32(1.0 / FP8_E4M3_MAX)  # the epilogue multiplies by fl(1/448)


def _quantize_1x128_parts(v: jax.Array, scale_of_amax) -> tuple[jax.Array, jax.Array]:
    """v (R, K) f32, K % 128 == 0 -> (q (R, K) e4m3, sf (R, K/128) f32), 1x128 groups, amax floor 1e-10."""
    r, k = v.shape
    grp = v.reshape(r, k // _BLOCK, _BLOCK)
    sf = scale_of_amax(jnp.maximum(jnp.max(jnp.abs(grp), axis=-1), jnp.float32(AMAX_FLOOR)))
    inv = _div_rn(jnp.ones_like(sf), sf)  # the kernels' 1 / sf, then x * (1 / sf): two roundings
    return cast_to_e4m3(grp * inv[..., None]).reshape(r, k), sf


def _quantize_1x128(v: jax.Array, scale_of_amax) -> jax.Array:
    """v (R, K) f32, K % 128 == 0 -> dequant(e4m3 quantization) (R, K) f32, 1x128 groups, amax floor 1e-10."""
    return dequantize_fp8_per_token_group(*_quantize_1x128_parts(v, scale_of_amax), _BLOCK)


def fused_input_reference(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, *,
                          buffer: FusedMoEBuffer, routed_scaling_factor: float) -> jax.Array:
    """The fused kernel's input stage (`custom_calls.triton.fused_input_kernel`, which writes the
    same bytes): x (M, H) bf16, topk_ids (M, k) int32, topk_weights (M, k) f32, M <= buffer.max_tokens
    -> the buffer (buffer.total_bytes,) uint8: workspace zero; input_tokens / input_scales the 1x128
    e4m3 quantization of x (sf = max(amax, 1e-10) / 448); input_topk_ids the canonical ids as int64;
    input_topk_weights topk_weights * fl32(routed_scaling_factor); every other byte 0 here (the
    kernel leaves the scratch regions as they are)."""
    if not 0 < x.shape[0] <= buffer.max_tokens:
        raise ValueError(f"x: expected 1 to {buffer.max_tokens} tokens (the buffer's capacity), got {x.shape[0]}")
    q, sf = _quantize_1x128_parts(x.astype(jnp.float32), _token_scale)
    ids = contracts.canonical_topk_ids(topk_ids, buffer.num_experts)
    ids64 = jnp.stack([ids, ids >> 31], axis=-1)  # int64 as (low, high) int32 words: -1 stays -1
    weights = topk_weights.astype(jnp.float32) * jnp.float32(routed_scaling_factor)
    out = jnp.zeros((buffer.total_bytes,), jnp.uint8)
    regions = buffer.regions
    for name, value in (("input_tokens", q), ("input_scales", sf), ("input_topk_ids", ids64),
                        ("input_topk_weights", weights)):
        data = jax.lax.bitcast_convert_type(value, jnp.uint8).reshape(-1)  # little-endian bytes
        out = jax.lax.dynamic_update_slice(out, data, (regions[name][0],))
    return out


def _expert_blocks(rows: jax.Array, block_expert: jax.Array, w: jax.Array) -> jax.Array:
    """rows (nb * 128, K) f32, block_expert (nb,) (-1: an unused block, computed with expert 0 and
    never read), w (E, N, K) f32 -> (nb * 128, N) f32: each block of 128 rows times its expert's
    w^T, looped, so that no per-block copy of the weights is materialized."""
    def one_block(args):
        blk, ex = args
        return jnp.einsum("mk,nk->mn", blk, w[jnp.maximum(ex, 0)], precision=_HI,
                          preferred_element_type=jnp.float32)

    out = jax.lax.map(one_block, (rows.reshape(-1, _BLOCK, rows.shape[1]), block_expert))
    return out.reshape(rows.shape[0], -1)


def _reference(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, *, routed_scaling_factor,
               activation_clamp, w13_interleave, settings=None):
    del settings  # how kernels are chosen and launched; the reference has none
    if w13_interleave:
        w13 = deinterleave_gate_up(w13, w13_interleave)
    m, h = x.shape
    e, two_i, _ = w13.shape
    topk_ids = contracts.canonical_topk_ids(topk_ids, e)
    i, k = two_i // 2, topk_ids.shape[1]
    if m == 0:
        return jnp.zeros((0, h), jnp.bfloat16)
    xd = _quantize_1x128(x.astype(jnp.float32), _token_scale)  # (M, H): once per token, not per route
    # The routes grouped by expert, each expert's rows padded to whole blocks of 128 (the contig
    # dispatch map's layout): one GEMM per block with its expert's weights.
    src2dst, m_indices, _, _ = dispatch_map_contig_xla(topk_ids, 0, num_local_experts=e, alignment=_BLOCK)
    cap = m_indices.shape[0]
    row_of_route = src2dst.reshape(-1)
    row = jnp.where(row_of_route >= 0, row_of_route, cap)  # cap: no row
    token = jnp.zeros((cap,), jnp.int32).at[row].set(jnp.arange(m * k, dtype=jnp.int32) // k, mode="drop")
    block_expert = m_indices.reshape(-1, _BLOCK)[:, 0]  # a block's expert is in its first row, -1: unused
    weight = jnp.zeros((cap,), jnp.float32).at[row].set(topk_weights.reshape(-1).astype(jnp.float32),
                                                         mode="drop") * jnp.float32(routed_scaling_factor)
    # padding rows compute from token 0 and are never read
    gu = _expert_blocks(xd[token], block_expert, dequantize_fp8_per_block(w13, w13_scale, _BLOCK))
    gate, up = gu[:, :i], gu[:, i:]
    if activation_clamp is not None:
        gate = jnp.minimum(gate, jnp.float32(activation_clamp))
        up = jnp.clip(up, -jnp.float32(activation_clamp), jnp.float32(activation_clamp))
    # the kernel's silu(g) * u, g * (1 / (1 + exp(-g))), then the route weight, all in fp32
    a = (gate * (jnp.float32(1.0) / (jnp.float32(1.0) + jnp.exp(-gate))) * up) * weight[:, None]
    ad = _quantize_1x128(a, _activation_scale)
    o = store_as(_expert_blocks(ad, block_expert, dequantize_fp8_per_block(w2, w2_scale, _BLOCK)), jnp.bfloat16)
    o = o[jnp.maximum(row_of_route, 0)].reshape(m, k, h)  # back to (token, slot)
    valid = (row_of_route >= 0).reshape(m, k)
    acc = jnp.zeros((m, h), jnp.float32)
    for j in range(k):  # the kernel's fixed slot order; a -1 slot's row is skipped, not added as 0
        acc = jnp.where(valid[:, j:j + 1], acc + o[:, j].astype(jnp.float32), acc)
    return acc.astype(jnp.bfloat16)


# jitted: one fused computation per static configuration, also when called eagerly
declare_op(OP, stage="gemm",
           static_args=("m", "hidden", "intermediate", "num_experts", "top_k", "x_dtype", "weight_dtype",
                        "routed_scaling_factor", "activation_clamp", "w13_interleave", "arch", "settings"),
           reference=jax.jit(_reference, static_argnames=("routed_scaling_factor", "activation_clamp",
                                                          "w13_interleave", "settings")))


def _real(name: str, value, allow_none: bool = False, positive: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or (positive and not value > 0):
        what = "a finite float" + (" > 0" if positive else "") + (" or None" if allow_none else "")
        raise ValueError(f"{name}: expected {what}, got {value!r}")
    return float(value)


def fused_moe(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, w13: jax.Array,
              w13_scale: jax.Array, w2: jax.Array, w2_scale: jax.Array, *, routed_scaling_factor: float = 1.0,
              activation_clamp: float | None = None, w13_interleave: int = 0, arch: int = 90,
              backend: str | None = None, debug_checks: bool = False,
              settings: KernelSettings | None = None) -> jax.Array:
    """The routed expert branch in one op (numerics: module docstring).

    x: (M, H) bf16; topk_ids: (M, k) int32, expert ids in [0, E) or -1 (no route; ids outside
    [0, E) and repeats within a token are dropped, `contracts.canonical_topk_ids`); topk_weights: (M, k)
    f32; w13: (E, 2I, H) float8_e4m3fn, rows gate (I) then up (I); w13_scale: (E, 2I/128, H/128)
    f32; w2: (E, H, I) float8_e4m3fn; w2_scale: (E, H/128, I/128) f32 (128x128 blocks). H and I are
    multiples of 128. routed_scaling_factor: multiplies every route weight; activation_clamp: None
    or c > 0 (gate clamped above at c, up to [-c, c]) -> y: (M, H) bf16.
    w13_interleave: 0, or g > 0 when w13's rows are stored with gate and up interleaved in groups
    of g (`layouts.interleave_gate_up`; its scales stay [gate; up]): the SM90 kernel reads g = 8,
    prepared once with the weights. arch: the GPU family the weights are prepared for (the kernel
    backend runs on 90). debug_checks: checked mode (`custom_calls.contracts`): reports an id
    outside [-1, E) or a repeated expert by (token, slot) instead of dropping it. settings:
    `custom_calls.KernelSettings` for an accelerated backend (None: the environment's when traced).
    """
    check_rank("x", x, 2, "(M, H)")
    check_dtype("x", x, (jnp.bfloat16,))
    m, h = x.shape
    if h == 0:
        raise ValueError(f"x: expected H > 0, got shape {tuple(x.shape)}")
    check_multiple("x", h, _BLOCK, "H (x.shape[1])")
    check_rank("topk_ids", topk_ids, 2, "(M, top_k)")
    check_dtype("topk_ids", topk_ids, (jnp.int32,))
    if topk_ids.shape[0] != m or topk_ids.shape[1] == 0:
        raise ValueError(f"topk_ids: expected shape (M, top_k) with M = {m} (tokens of x) and top_k >= 1, "
                         f"got {tuple(topk_ids.shape)}")
    check_shape("topk_weights", topk_weights, topk_ids.shape, "as topk_ids")
    check_dtype("topk_weights", topk_weights, (jnp.float32,))
    check_rank("w13", w13, 3, "(E, 2I, H)")
    check_dtype("w13", w13, (jnp.float8_e4m3fn,))
    e, two_i, h_w = w13.shape
    if e == 0 or two_i == 0 or two_i % 2 or h_w != h:
        raise ValueError(f"w13: expected shape (E, 2I, H) with E >= 1, 2I > 0 even and H = {h} (as x), "
                         f"got {tuple(w13.shape)}")
    i = two_i // 2
    check_multiple("w13", i, _BLOCK, "I (w13.shape[1] / 2)")
    check_shape("w13_scale", w13_scale, (e, two_i // _BLOCK, h // _BLOCK), "(E, 2I/128, H/128) of w13")
    check_dtype("w13_scale", w13_scale, (jnp.float32,))
    check_shape("w2", w2, (e, h, i), "(E, H, I) of w13 and x")
    check_dtype("w2", w2, (jnp.float8_e4m3fn,))
    check_shape("w2_scale", w2_scale, (e, h // _BLOCK, i // _BLOCK), "(E, H/128, I/128) of w2")
    check_dtype("w2_scale", w2_scale, (jnp.float32,))
    k = topk_ids.shape[1]
    check_index_extents("x", m, lambda n: routes_and_rows(n, k, lambda n: contig_capacity(n, k, e, _BLOCK),
                                                          "expert pool rows"))
    routed_scaling_factor = _real("routed_scaling_factor", routed_scaling_factor)
    activation_clamp = _real("activation_clamp", activation_clamp, allow_none=True, positive=True)
    if isinstance(w13_interleave, bool) or not isinstance(w13_interleave, int) or w13_interleave < 0 or (
            w13_interleave and i % w13_interleave):
        raise ValueError(f"w13_interleave: expected 0 or a positive int dividing I = {i}, got {w13_interleave!r}")
    if isinstance(arch, bool) or not isinstance(arch, int):
        raise ValueError(f"arch: expected an int (90, 100), got {arch!r}")
    if debug_checks:
        contracts.check_topk_ids(topk_ids, e)
    settings = resolve_settings(settings)
    impl = resolve(OP, backend, m=m, hidden=h, intermediate=i, num_experts=e, top_k=topk_ids.shape[1],
                   x_dtype=x.dtype, weight_dtype=w13.dtype, routed_scaling_factor=routed_scaling_factor,
                   activation_clamp=activation_clamp, w13_interleave=w13_interleave, arch=arch, settings=settings)
    return impl.impl(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale,
                     routed_scaling_factor=routed_scaling_factor, activation_clamp=activation_clamp,
                     w13_interleave=w13_interleave, settings=settings)


# --- the routed branch with its routing: router GEMM, routing epilogue and the fused kernel ----

OP_ROUTED = "fused_moe_routed"


def _route_reference(logits, bias, expert_offset, *, top_k, scoring, n_group, topk_group, norm_topk_prob):
    ids, weights = route_topk(logits, bias, top_k=top_k, scoring=scoring, n_group=n_group, topk_group=topk_group,
                              norm_topk_prob=norm_topk_prob, backend="reference")
    return ids - jnp.asarray(expert_offset, jnp.int32), weights


def fused_input_routed_reference(x: jax.Array, partials: jax.Array, bias: jax.Array | None,
                                 expert_offset: jax.Array, *, buffer: FusedMoEBuffer, routed_scaling_factor: float,
                                 top_k: int, scoring: str, n_group: int = 1, topk_group: int = 1,
                                 norm_topk_prob: bool = True) -> jax.Array:
    """The routed input stage (`custom_calls.triton.fused_input_kernel.fused_input_routed`): the
    logits are the partials (S, M, E_route) f32 added in order (`route_topk.sum_partials`), routed
    by the routing epilogue's reference (`route_topk`), the ids minus expert_offset (ids outside
    the buffer's [0, E) dropped), then `fused_input_reference`."""
    ids, weights = _route_reference(sum_partials(partials), bias, expert_offset, top_k=top_k, scoring=scoring,
                                    n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob)
    return fused_input_reference(x, ids, weights, buffer=buffer, routed_scaling_factor=routed_scaling_factor)


def _routed_reference(x, gate_weight, bias, expert_offset, w13, w13_scale, w2, w2_scale, *, top_k, scoring,
                      n_group, topk_group, norm_topk_prob, routed_scaling_factor, activation_clamp, w13_interleave,
                      settings=None):
    del settings
    logits = jnp.einsum("mh,eh->me", x, gate_weight, preferred_element_type=jnp.float32)
    ids, weights = _route_reference(logits, bias, expert_offset, top_k=top_k, scoring=scoring, n_group=n_group,
                                    topk_group=topk_group, norm_topk_prob=norm_topk_prob)
    return _reference(x, ids, weights, w13, w13_scale, w2, w2_scale, routed_scaling_factor=routed_scaling_factor,
                      activation_clamp=activation_clamp, w13_interleave=w13_interleave)


_ROUTED_STATIC = ("top_k", "scoring", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
                  "activation_clamp", "w13_interleave", "settings")
declare_op(OP_ROUTED, stage="gemm",
           static_args=("m", "hidden", "intermediate", "num_experts", "num_route_experts", "top_k", "scoring",
                        "n_group", "topk_group", "x_dtype", "gate_dtype", "weight_dtype", "routed_scaling_factor",
                        "activation_clamp", "w13_interleave", "arch", "settings"),
           reference=jax.jit(_routed_reference, static_argnames=_ROUTED_STATIC))


def fused_moe_routed(x: jax.Array, gate_weight: jax.Array, e_score_correction_bias: jax.Array | None,
                     w13: jax.Array, w13_scale: jax.Array, w2: jax.Array, w2_scale: jax.Array, *, top_k: int,
                     scoring: str, n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                     expert_offset=0, routed_scaling_factor: float = 1.0, activation_clamp: float | None = None,
                     w13_interleave: int = 0, arch: int = 90, backend: str | None = None,
                     settings: KernelSettings | None = None) -> jax.Array:
    """`fused_moe` with its routing: the router GEMM and the routing epilogue of `route_topk` in
    the same op, so that a backend can fuse them with the branch's own launches (on SM90: the router
    GEMM as split-K partials, the epilogue inside the fused kernel's input stage: three kernels in
    one custom call).

    x: (M, H) bf16; gate_weight: (E_route, H) bf16, the router over all E_route experts (logits =
    x @ gate_weight^T, bf16 products summed in fp32; a backend may sum in another order, which can
    reorder experts whose selection scores tie to the last bits); e_score_correction_bias:
    (E_route,) f32 or None; top_k, scoring, n_group, topk_group, norm_topk_prob: as `route_topk`;
    expert_offset: python int or traced int32 scalar, the global id of local expert 0 (the E
    experts of w13 are global ids [expert_offset, expert_offset + E); routes to other experts
    contribute nothing); the rest (settings too) as `fused_moe` -> y: (M, H) bf16.
    """
    check_rank("x", x, 2, "(M, H)")
    check_dtype("x", x, (jnp.bfloat16,))
    check_rank("gate_weight", gate_weight, 2, "(E_route, H)")
    check_dtype("gate_weight", gate_weight, (jnp.bfloat16,))
    m, h = x.shape
    e_route = gate_weight.shape[0]
    if gate_weight.shape[1] != h or e_route == 0:
        raise ValueError(f"gate_weight: expected shape (E_route, H) with E_route >= 1 and H = {h} (as x), "
                         f"got {tuple(gate_weight.shape)}")
    if e_score_correction_bias is not None:
        check_shape("e_score_correction_bias", e_score_correction_bias, (e_route,), "(E_route,) of gate_weight")
        check_dtype("e_score_correction_bias", e_score_correction_bias, (jnp.float32,))
    if jnp.ndim(expert_offset) != 0 or not jnp.issubdtype(jnp.result_type(expert_offset), jnp.integer):
        raise ValueError(f"expert_offset: expected an int or an integer scalar array, got {expert_offset!r}")
    # the routing arguments as route_topk checks them; the branch as fused_moe checks it
    ids, weights = jax.eval_shape(
        lambda lg, b: route_topk(lg, b, top_k=top_k, scoring=scoring, n_group=n_group, topk_group=topk_group,
                                 norm_topk_prob=norm_topk_prob, backend="reference"),
        jax.ShapeDtypeStruct((m, e_route), jnp.float32), e_score_correction_bias)
    jax.eval_shape(lambda *a: fused_moe(*a, routed_scaling_factor=routed_scaling_factor,
                                        activation_clamp=activation_clamp, w13_interleave=w13_interleave,
                                        arch=arch, backend="reference"),
                   x, ids, weights, w13, w13_scale, w2, w2_scale)
    routed_scaling_factor = _real("routed_scaling_factor", routed_scaling_factor)
    activation_clamp = _real("activation_clamp", activation_clamp, allow_none=True, positive=True)
    e, two_i, _ = w13.shape
    settings = resolve_settings(settings)
    static = dict(top_k=top_k, scoring=scoring, n_group=n_group, topk_group=topk_group,
                  norm_topk_prob=bool(norm_topk_prob), routed_scaling_factor=routed_scaling_factor,
                  activation_clamp=activation_clamp, w13_interleave=w13_interleave, settings=settings)
    impl = resolve(OP_ROUTED, backend, m=m, hidden=h, intermediate=two_i // 2, num_experts=e,
                   num_route_experts=e_route, top_k=top_k, scoring=scoring, n_group=n_group, topk_group=topk_group,
                   x_dtype=x.dtype, gate_dtype=gate_weight.dtype, weight_dtype=w13.dtype,
                   routed_scaling_factor=routed_scaling_factor, activation_clamp=activation_clamp,
                   w13_interleave=w13_interleave, arch=arch, settings=settings)
    return impl.impl(x, gate_weight, e_score_correction_bias, jnp.asarray(expert_offset, jnp.int32), w13, w13_scale,
                     w2, w2_scale, **static)
