"""Conformance of every registered implementation of every op with the op's reference.

The cases come from the registry: for each declared op, each backend that registered an
implementation (`custom_calls.backends(op)`) runs the same cases through the public op function
with `backend=<name>`: fresh random inputs, odd shapes, every (recipe, arch) GEMM format. A
backend that does not claim a case (its `supports` refuses it) must say why; a backend that cannot
run on this machine is skipped with its environment's reason, except the Triton backend, which
runs here under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the variable must be
set before triton is imported). A new backend is tested by registering it.

Bad inputs are checked for every backend too: the public op functions reject them before any
backend is resolved, with the argument's name. Inputs that break an op's index contract
("violations" cases) must give every backend the reference's result.
"""

from __future__ import annotations

import dataclasses
import sys
import zlib
from typing import Callable

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import custom_calls as cc
from custom_calls import ActivationSpec
from interpreter_script import InterpreterServer, serve
from layouts import gemm_format

FORMATS = [("bf16", 90), ("fp8_block", 90), ("fp8_block", 100), ("mxfp8", 100), ("mxfp4", 100)]
E4M3 = np.dtype(jnp.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    name: str
    make: Callable  # rng -> (args, kwargs) for the public op function
    compare: Callable  # (got, ref, args, kwargs) -> None, raising AssertionError

    @property
    def id(self) -> str:
        return f"{self.op}:{self.name}"


# ------------------------------------------------------------------------------ comparisons

def _np(a):
    return np.asarray(jax.device_get(a))


def _exact(got, ref, *_):
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        assert g.shape == r.shape and g.dtype == r.dtype, (g.shape, g.dtype, r.shape, r.dtype)
        assert np.array_equal(_np(g), _np(r), equal_nan=True)


def _values_agree(got, ref, min_equal: float, rows=None) -> None:
    """Quantized or rounded values: equal except a fraction, those within one e4m3 / bf16 step.
    XLA's f32 division (x * fl(1/448)) and transcendental ulps may move a rounding."""
    g, r = _np(got).astype(np.float32), _np(ref).astype(np.float32)
    if rows is not None:
        g, r = g[rows], r[rows]
    assert g.shape == r.shape and np.isfinite(g).all(), "non-finite or wrong-shaped output"
    same = g == r
    assert same.mean() >= min_equal, f"only {same.mean():.4f} of the values equal"
    step = np.maximum(0.125 * np.maximum(np.abs(g), np.abs(r)), 2.0**-9)  # e4m3 subnormals: 2^-9 apart
    assert (np.abs(g - r)[~same] <= step[~same]).all(), "a value differs by more than one step"


def _images_agree(got, ref, fmt, min_equal: float = 1.0, rtol: float = 2.4e-7, cols=None) -> None:
    g, r = _np(got), _np(ref)
    if cols is not None:
        g, r = g[..., cols], r[..., cols]
    assert g.shape == r.shape and g.dtype == r.dtype
    if g.size == 0:
        return
    if fmt.ue8m0:
        assert (g == r).mean() >= min_equal, (g != r).sum()
    else:
        np.testing.assert_allclose(g, r, rtol=rtol)


def _rel_err(got, ref, rows=None) -> float:
    g, r = _np(got).astype(np.float64), _np(ref).astype(np.float64)
    if rows is not None:
        g, r = g[rows], r[rows]
    return float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30))


# ------------------------------------------------------------------------------ input makers

def _tokens(rng, m, h):
    scale = rng.uniform(0.05, 30, (m, 1))
    return jnp.asarray(rng.standard_normal((m, h)) * scale, jnp.bfloat16)


def _routes(rng, m, k, e, drop=0.1):
    ids = np.argsort(rng.random((m, e)), axis=1)[:, :k].astype(np.int32)
    ids[rng.random((m, k)) < drop] = -1
    return ids


def _contig_src2dst(rng, m, k, e):
    from moe_jax.dispatch import dispatch_contig

    d = dispatch_contig(jnp.asarray(_routes(rng, m, k, e)), num_local_experts=e, alignment=128)
    return d.src2dst, d.num_rows_cap, d.m_indices


def _masked_src2dst(rng, m, k, e, m_pad):
    from moe_jax.dispatch import dispatch_masked

    d = dispatch_masked(jnp.asarray(_routes(rng, m, k, e)), num_local_experts=e, m_pad=m_pad,
                        num_experts_global=e)
    return d.src2dst, d.masked_m


def _routed_rows(src2dst) -> np.ndarray:
    s = _np(src2dst).reshape(-1)
    return np.unique(s[s >= 0])


# ------------------------------------------------------------------------------ the cases

def _route_cases():
    def make(m, e, k, scoring, n_group, topk_group, bias):
        def f(rng):
            logits = jnp.asarray(rng.standard_normal((m, e)) * 2, jnp.float32)
            b = jnp.asarray(rng.standard_normal(e) * 0.1, jnp.float32) if bias else None
            return (logits, b), dict(top_k=k, scoring=scoring, n_group=n_group, topk_group=topk_group)
        return f

    def compare(got, ref, *_):
        (gi, gw), (ri, rw) = (tuple(map(_np, got)), tuple(map(_np, ref)))
        same = (gi == ri).all(axis=1)
        assert same.mean() >= 0.9, same.mean()  # near-ties may order differently under exp ulps
        np.testing.assert_allclose(gw[same], rw[same], rtol=1e-5, atol=1e-7)

    return [Case("route_topk", "sigmoid_grouped_bias_m13_e64", make(13, 64, 6, "sigmoid", 8, 4, True), compare),
            Case("route_topk", "softmax_m7_e20", make(7, 20, 3, "softmax", 1, 1, False), compare),
            Case("route_topk", "sigmoid_bias_3_groups_m11_e96", make(11, 96, 8, "sigmoid", 3, 2, True), compare),
            Case("route_topk", "v3_decode_m5_e256", make(5, 256, 8, "sigmoid", 8, 4, True), compare),
            Case("route_topk", "sqrtsoftplus_bias_m9_e256", make(9, 256, 8, "sqrtsoftplus", 1, 1, True), compare)]


def _rank_cases():
    def make(r, e):
        def f(rng):
            return (jnp.asarray(rng.integers(0, e + 1, r), jnp.int32),), dict(num_experts=e)
        return f

    return [Case("rank_within_expert", "r333_e5", make(333, 5), _exact),
            Case("rank_within_expert", "r1000_e32", make(1000, 32), _exact)]


def _dispatch_map_cases():
    def ids(rng, m, k, e, offset):  # ids below, inside and above [offset, offset + e), and -1
        return jnp.asarray(rng.integers(-1, e + 2 * offset + 3, (m, k)), jnp.int32)

    def contig(m, k, e, offset, alignment):
        return lambda rng: ((ids(rng, m, k, e, offset), jnp.int32(offset)),
                            dict(num_local_experts=e, alignment=alignment))

    def masked(m, k, e, offset, m_pad, mark_dropped=False):
        return lambda rng: ((ids(rng, m, k, e, offset), jnp.int32(offset)),
                            dict(num_local_experts=e, m_pad=m_pad, mark_dropped=mark_dropped))

    return [Case("dispatch_map_contig", "m37_k6_e5_off3", contig(37, 6, 5, 3, 16), _exact),
            Case("dispatch_map_contig", "m700_k8_e20_two_launches", contig(700, 8, 20, 7, 128), _exact),
            Case("dispatch_map_masked", "m37_k6_e5_off3", masked(37, 6, 5, 3, 128), _exact),
            Case("dispatch_map_masked", "m600_k8_e3_dropped", masked(600, 8, 3, 0, 128), _exact),
            Case("dispatch_map_masked", "m600_k8_e3_dropped_marked", masked(600, 8, 3, 0, 128, True), _exact)]


def _permute_cases():
    m, h, k, e, m_pad = 21, 640, 3, 5, 128  # H: 5 groups of 128 (a partial packed word), 20 of 32
    cases = []
    for recipe, arch in FORMATS:
        fmt = gemm_format(recipe, arch)

        def make_contig(rng, recipe=recipe, arch=arch):
            s2d, rows, _ = _contig_src2dst(rng, m, k, e)
            return (_tokens(rng, m, h), s2d), dict(num_rows=rows, recipe=recipe, arch=arch)

        def cmp_contig(got, ref, args, kwargs, fmt=fmt):
            if not fmt.is_quantized:
                return _exact(got, ref)
            _values_agree(got[0], ref[0], 0.99 if fmt.scale_kind == "fp32" else 1.0)
            _images_agree(got[1], ref[1], fmt)

        def make_masked(rng, recipe=recipe, arch=arch):
            s2d, _ = _masked_src2dst(rng, m, k, e, m_pad)
            return (_tokens(rng, m, h), s2d), dict(num_groups=e, m_pad=m_pad, recipe=recipe, arch=arch)

        def cmp_masked(got, ref, args, kwargs, fmt=fmt):
            rows = _routed_rows(args[1])  # the others are unspecified
            flat = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
            _values_agree(flat(got[0]), flat(ref[0]), 0.99 if fmt.scale_kind == "fp32" else 1.0, rows)
            if fmt.is_quantized:
                _images_agree(got[1], ref[1], fmt)

        cases += [Case("permute_contig", f"{recipe}_{arch}", make_contig, cmp_contig),
                  Case("permute_masked", f"{recipe}_{arch}", make_masked, cmp_masked)]
    return cases


_ACTS = {
    "silu": ActivationSpec(),
    "silu_limit": ActivationSpec(swiglu_limit=7.0),
    "swiglu_oai": ActivationSpec(kind="swiglu_oai", gemm1_alpha=1.702, swiglu_limit=7.0),
    "situ": ActivationSpec(kind="situ", situ_beta=3.0, situ_linear_beta=5.0),
    "keep_fp32": ActivationSpec(keep_fp32=True),
}
_ACT_FOR_FORMAT = {("bf16", 90): "silu", ("fp8_block", 90): "swiglu_oai", ("fp8_block", 100): "keep_fp32",
                   ("mxfp8", 100): "situ", ("mxfp4", 100): "silu_limit"}


def _activation_cases():
    inter, slabs, m_pad, rows = 512, 3, 128, 130  # 4 groups of 128, 16 of 32; rows % 4 == 2
    cases = []
    for (recipe, arch), act_name in _ACT_FOR_FORMAT.items():
        fmt, act = gemm_format(recipe, arch), _ACTS[act_name]

        def gateup(rng, shape):
            return jnp.asarray(rng.standard_normal(shape) * 3, jnp.bfloat16)

        def make_contig(rng, recipe=recipe, arch=arch, act=act):
            return (gateup(rng, (rows, 2 * inter)),), dict(act=act, recipe=recipe, arch=arch)

        def make_masked(rng, recipe=recipe, arch=arch, act=act):
            masked_m = jnp.asarray(rng.integers(0, m_pad + 1, slabs), jnp.int32)
            return (gateup(rng, (slabs, m_pad, 2 * inter)), masked_m), dict(act=act, recipe=recipe, arch=arch)

        def cmp_contig(got, ref, args, kwargs, fmt=fmt):
            _values_agree(got[0], ref[0], 0.99)
            if fmt.is_quantized:
                _images_agree(got[1], ref[1], fmt, min_equal=0.99, rtol=1e-5)

        def cmp_masked(got, ref, args, kwargs, fmt=fmt):
            masked_m = _np(args[1])
            real = (np.arange(m_pad)[None, :] < masked_m[:, None]).reshape(-1)
            flat = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
            _values_agree(flat(got[0]), flat(ref[0]), 0.99, real)
            if fmt.is_quantized:  # the scale columns of the real rows
                for s in range(slabs):
                    _images_agree(got[1][s], ref[1][s], fmt, 0.99, 1e-5, cols=np.arange(int(masked_m[s])))

        cases += [Case("activation_quant_contig", f"{recipe}_{arch}_{act_name}", make_contig, cmp_contig),
                  Case("activation_quant_masked", f"{recipe}_{arch}_{act_name}", make_masked, cmp_masked)]
    return cases


def _unpermute_cases():
    def make(out_dtype):
        def f(rng):
            r, h, m, k = 300, 520, 50, 4
            d = jnp.asarray(rng.standard_normal((r, h)), jnp.bfloat16)
            s2d = rng.permutation(r)[: m * k].reshape(m, k).astype(np.int32)
            s2d[rng.random((m, k)) < 0.15] = -1
            w = jnp.asarray(rng.random((m, k)), jnp.float32)
            return (d, jnp.asarray(s2d), w), dict(routed_scaling_factor=2.5, out_dtype=out_dtype)
        return f

    def cmp(got, ref, *_):
        rtol = 1e-5 if got.dtype == jnp.float32 else 8e-3  # fp32 sums in another order; one bf16 ulp
        np.testing.assert_allclose(_np(got).astype(np.float32), _np(ref).astype(np.float32), rtol=rtol, atol=1e-6)

    return [Case("unpermute", "bf16_out", make(jnp.bfloat16), cmp), Case("unpermute", "f32_out", make(jnp.float32), cmp)]


def _weights(rng, fmt, g, n, k):
    """rhs (G, N, K) and its scales in `fmt`, from random weights through the load-time paths."""
    import layouts

    rec = layouts.get_recipe(fmt.recipe)
    w = jnp.asarray(rng.standard_normal((g, n, k)) * 0.05, jnp.float32)
    from moe_jax.random_init import _quantize_checkpoint

    values, scale = _quantize_checkpoint(w, rec.name)
    return layouts.prepare_expert_weights(values, scale, recipe=rec.name, arch=fmt.arch)


def _gemm_cases():
    g, n, k, m_pad = 3, 256, 384, 128
    cases = []
    for recipe, arch in FORMATS:
        fmt = gemm_format(recipe, arch)

        def make_contig(rng, fmt=fmt):
            _, rows, m_indices = _contig_src2dst(rng, 40, 3, g)
            # lhs padding rows are zero, as the permute writes them: the padding output rows are then
            # 0 on every backend (docs/ARCHITECTURE.md, "Contracts and checked mode")
            x = jnp.where((m_indices >= 0)[:, None], _tokens(rng, rows, k), 0)
            lhs, lhs_scale = fmt.quantize_lhs(x)
            rhs, rhs_scale = _weights(rng, fmt, g, n, k)
            return (lhs, rhs, m_indices), dict(lhs_scale=lhs_scale, rhs_scale=rhs_scale, recipe=fmt.recipe,
                                               arch=fmt.arch)

        def cmp_contig(got, ref, args, kwargs):
            rows = _np(args[2]) >= 0
            assert _rel_err(got, ref, rows) < 5e-3
            assert (_np(got)[~rows].astype(np.float32) == 0).all()  # padding rows are zero

        def make_masked(rng, fmt=fmt):
            lhs, lhs_scale = fmt.quantize_lhs(_tokens(rng, g * m_pad, k).reshape(g, m_pad, k))
            rhs, rhs_scale = _weights(rng, fmt, g, n, k)
            masked_m = jnp.asarray(rng.integers(0, m_pad + 1, g), jnp.int32)
            return (lhs, rhs, masked_m), dict(expected_m=24, lhs_scale=lhs_scale, rhs_scale=rhs_scale,
                                              recipe=fmt.recipe, arch=fmt.arch)

        def cmp_masked(got, ref, args, kwargs):
            real = (np.arange(m_pad)[None, :] < _np(args[2])[:, None]).reshape(-1)
            assert _rel_err(got.reshape(-1, n), ref.reshape(-1, n), real) < 5e-3

        cases += [Case("m_grouped_gemm_contig", f"{recipe}_{arch}", make_contig, cmp_contig),
                  Case("m_grouped_gemm_masked", f"{recipe}_{arch}", make_masked, cmp_masked)]
    return cases


def _dense_gemm_cases():
    m, n, k = 37, 192, 384  # odd rows, N not a multiple of the 128-row weight block
    cases = []
    for recipe, arch in FORMATS:
        fmt = gemm_format(recipe, arch)
        if fmt.rhs_k_pack != 1:  # gemm_nt takes unpacked weights
            continue

        def make(rng, fmt=fmt):
            lhs, lhs_scale = fmt.quantize_lhs(_tokens(rng, m, k))
            rhs, rhs_scale = _weights(rng, fmt, 1, n, k)
            return (lhs, rhs[0]), dict(lhs_scale=lhs_scale, rhs_scale=None if rhs_scale is None else rhs_scale[0],
                                       recipe=fmt.recipe, arch=fmt.arch)

        def cmp(got, ref, args, kwargs):
            assert got.shape == ref.shape == (m, n) and got.dtype == ref.dtype
            assert np.isfinite(_np(got).astype(np.float32)).all()  # every element written
            assert _rel_err(got, ref, np.ones(m, bool)) < 5e-3

        cases.append(Case("gemm_nt", f"{recipe}_{arch}", make, cmp))
    return cases


def _fused_moe_cases():
    """Odd token counts, -1 routes and a token without routes, a clamp; w13 in the row order each
    backend reads (interleaved for the kernel, which refuses [gate; up] with a reason)."""
    from layouts import interleave_gate_up, quantize_fp8_per_block

    cases = []
    for name, (m, h, i, e, k, clamp, inter) in {"m7_h1024_i512_e8_k4": (7, 1024, 512, 8, 4, None, 8),
                                                "m130_h2048_i512_e16_k6_clamp": (130, 2048, 512, 16, 6, 0.05, 8),
                                                "m33_h1024_i512_e8_k2_natural": (33, 1024, 512, 8, 2, None, 0)}.items():
        def make(rng, m=m, h=h, i=i, e=e, k=k, clamp=clamp, inter=inter):
            x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
            ids = np.argsort(rng.random((m, e)), axis=1)[:, :k].astype(np.int32)
            ids[rng.random((m, k)) < 0.2] = -1
            ids[0] = -1
            w = rng.random((m, k)).astype(np.float32) + 0.1
            w13, s13 = quantize_fp8_per_block(jnp.asarray(rng.standard_normal((e, 2 * i, h)) * 0.05, jnp.float32), 128)
            w2, s2 = quantize_fp8_per_block(jnp.asarray(rng.standard_normal((e, h, i)) * 0.05, jnp.float32), 128)
            if inter:
                w13 = interleave_gate_up(w13, inter)
            return ((x, jnp.asarray(ids), jnp.asarray(w), w13, s13, w2, s2),
                    dict(routed_scaling_factor=2.5, activation_clamp=clamp, w13_interleave=inter))

        def cmp(got, ref, args, kwargs):
            g, r = _np(got).astype(np.float32), _np(ref).astype(np.float32)
            assert g.shape == r.shape and np.isfinite(g).all()
            routed = (_np(args[1]) >= 0).any(1)
            assert (g[~routed] == 0).all()
            # the kernel accumulates GEMM1 in its own order; an e4m3 rounding of the intermediate
            # may land one step apart: 1e-3-level relative error, far below a wrong formula's
            assert _rel_err(got, ref, routed) < 2e-2

        cases.append(Case("fused_moe", name, make, cmp))
    return cases


def _fused_moe_routed_cases():
    """The routed branch with its routing: grouped top-k with a correction bias over more experts
    than held here (an expert offset), softmax without groups, odd token counts."""
    from layouts import interleave_gate_up, quantize_fp8_per_block

    cases = []
    for name, (m, h, i, e, e_route, k, scoring, ng, tg, bias, offset) in {
            "m37_h1024_i512_e8_of32_k6_v3": (37, 1024, 512, 8, 32, 6, "sigmoid", 4, 2, True, 8),
            "m5_h2048_i256_e16_k4_softmax": (5, 2048, 256, 16, 16, 4, "softmax", 1, 1, False, 0)}.items():
        def make(rng, m=m, h=h, i=i, e=e, e_route=e_route, k=k, scoring=scoring, ng=ng, tg=tg, bias=bias,
                 offset=offset):
            x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
            gate = jnp.asarray(rng.standard_normal((e_route, h)) * 0.05, jnp.bfloat16)
            b = jnp.asarray(rng.standard_normal(e_route) * 0.1, jnp.float32) if bias else None
            w13, s13 = quantize_fp8_per_block(jnp.asarray(rng.standard_normal((e, 2 * i, h)) * 0.05, jnp.float32), 128)
            w2, s2 = quantize_fp8_per_block(jnp.asarray(rng.standard_normal((e, h, i)) * 0.05, jnp.float32), 128)
            return ((x, gate, b, interleave_gate_up(w13, 8), s13, w2, s2),
                    dict(top_k=k, scoring=scoring, n_group=ng, topk_group=tg, expert_offset=offset,
                         routed_scaling_factor=2.5, w13_interleave=8))

        def cmp(got, ref, args, kwargs):
            g, r = _np(got).astype(np.float32), _np(ref).astype(np.float32)
            assert g.shape == r.shape == (args[0].shape[0], args[0].shape[1]) and np.isfinite(g).all()
            routed = np.abs(r).max(1) > 0  # tokens with a route to an expert held here
            assert (g[~routed] == 0).all()
            assert _rel_err(got, ref, routed) < 2e-2

        cases.append(Case("fused_moe_routed", name, make, cmp))
    return cases


# ------------------------------------------------------------------------------ violations
# Inputs that break an op's index contract: every backend must produce what the reference produces
# (the public ops canonicalize the index arrays, custom_calls/contracts.py). The models here are
# independent numpy restatements of the documented rules.

def np_canonical_m_indices(mi: np.ndarray, g: int, align: int) -> np.ndarray:
    """A block stays when it is all -1 or one id in [0, g) from its first row on, then -1s."""
    out = mi.copy()
    for b0 in range(0, mi.shape[0], align):
        blk = mi[b0:b0 + align]
        e = blk[0]
        real = int(np.sum(blk != -1))
        ok = (np.all(blk == -1) or (0 <= e < g and np.all(blk[:real] == e) and np.all(blk[real:] == -1)))
        if not ok:
            out[b0:b0 + align] = -1
    return out


def np_canonical_src2dst(s2d: np.ndarray, num_rows: int, distinct: bool) -> np.ndarray:
    """Entries outside [-1, num_rows) -> -1; with distinct, a row named again later -> -1."""
    out = np.where((s2d >= 0) & (s2d < num_rows), s2d, -1).reshape(-1)
    if distinct:
        seen = set()
        for i, v in enumerate(out):
            if v >= 0 and v in seen:
                out[i] = -1
            seen.add(int(v))
    return out.reshape(s2d.shape)


def _break_src2dst(rng, s2d, num_rows):
    """Out-of-range entries (past the end, below -1) and a row named twice."""
    s = np.array(_np(s2d))
    live = np.argwhere(s >= 0)
    picks = live[rng.permutation(len(live))[:4]]
    s[tuple(picks[0])] = num_rows + 3
    s[tuple(picks[1])] = -4
    s[tuple(picks[2])] = s[tuple(picks[3])]  # a duplicate row
    return jnp.asarray(s)


def _violation_cases():
    cases = []
    m, h, k, e, m_pad = 21, 640, 3, 5, 128
    for recipe, arch in (("fp8_block", 90), ("bf16", 90)):
        fmt = gemm_format(recipe, arch)

        def make_permute(rng, recipe=recipe, arch=arch):
            s2d, rows, _ = _contig_src2dst(rng, m, k, e)
            return (_tokens(rng, m, h), _break_src2dst(rng, s2d, rows)), dict(num_rows=rows, recipe=recipe,
                                                                               arch=arch)

        def cmp_permute(got, ref, args, kwargs, fmt=fmt):
            if not fmt.is_quantized:
                return _exact(got, ref)
            _values_agree(got[0], ref[0], 0.99)
            _images_agree(got[1], ref[1], fmt)

        cases.append(Case("permute_contig", f"violations_{recipe}_{arch}", make_permute, cmp_permute))

    def make_permute_masked(rng):
        s2d, _ = _masked_src2dst(rng, m, k, e, m_pad)
        return ((_tokens(rng, m, h), _break_src2dst(rng, s2d, e * m_pad)),
                dict(num_groups=e, m_pad=m_pad, recipe="fp8_block", arch=100))

    def cmp_permute_masked(got, ref, args, kwargs):
        s = np_canonical_src2dst(_np(args[1]), e * m_pad, True)
        rows = np.unique(s[s >= 0])  # the others are unspecified
        _values_agree(got[0].reshape(-1, h), ref[0].reshape(-1, h), 1.0, rows)
        _images_agree(got[1], ref[1], gemm_format("fp8_block", 100))

    cases.append(Case("permute_masked", "violations_fp8_block_100", make_permute_masked, cmp_permute_masked))

    def make_unpermute(rng):
        r, hh, mm, kk = 300, 264, 40, 4
        d = jnp.asarray(rng.standard_normal((r, hh)), jnp.bfloat16)
        s2d = rng.permutation(r)[: mm * kk].reshape(mm, kk).astype(np.int32)
        s2d[:3, 1] = [r, r + 1000, -9]
        return (d, jnp.asarray(s2d), jnp.asarray(rng.random((mm, kk)), jnp.float32)), dict(out_dtype=jnp.float32)

    def cmp_unpermute(got, ref, args, *_):
        s = np_canonical_src2dst(_np(args[1]), args[0].shape[0], False)
        want = np.einsum("mkh,mk->mh", _np(args[0]).astype(np.float64)[np.maximum(s, 0)],
                         np.where(s >= 0, _np(args[2]), 0.0))
        for out in (got, ref):  # both the documented result, so both agree
            np.testing.assert_allclose(_np(out), want, rtol=1e-5, atol=1e-5)

    cases.append(Case("unpermute", "violations", make_unpermute, cmp_unpermute))

    inter, slabs = 256, 3

    def make_act_masked(rng):
        masked_m = jnp.asarray([-3, m_pad + 50, 17], jnp.int32)
        gateup = jnp.asarray(rng.standard_normal((slabs, m_pad, 2 * inter)) * 3, jnp.bfloat16)
        return (gateup, masked_m), dict(act=_ACTS["silu"], recipe="fp8_block", arch=90)

    def cmp_act_masked(got, ref, args, kwargs):
        real = (np.arange(m_pad)[None, :] < np.clip(_np(args[1]), 0, m_pad)[:, None]).reshape(-1)
        _values_agree(got[0].reshape(-1, inter), ref[0].reshape(-1, inter), 0.99, real)

    cases.append(Case("activation_quant_masked", "violations_fp8_block_90", make_act_masked, cmp_act_masked))

    g, n, kk = 3, 256, 384
    for recipe, arch in (("fp8_block", 90), ("bf16", 90), ("mxfp8", 100)):
        fmt = gemm_format(recipe, arch)

        def make_contig(rng, fmt=fmt):
            mi = np.full(8 * 128, -1, np.int32)
            mi[0:128] = 0  # well formed: full, partial, and the same expert again
            mi[128:200] = 2
            mi[256:300] = 0
            mi[384:450] = 1
            mi[420] = 2  # two experts in one block
            mi[512:520] = g  # no such expert
            mi[640:650], mi[650:660] = -1, 1  # padding before the rows
            mi[768:800] = -6  # padding spelled < -1
            mi[896:1000] = 2
            canon = np_canonical_m_indices(mi, g, 128)
            # lhs rows are zero where the canonical id is -1, as the permute writes them (docs/ARCHITECTURE.md)
            x = jnp.where(jnp.asarray(canon >= 0)[:, None], _tokens(rng, mi.shape[0], kk), 0)
            lhs, lhs_scale = fmt.quantize_lhs(x)
            rhs, rhs_scale = _weights(rng, fmt, g, n, kk)
            return (lhs, rhs, jnp.asarray(mi)), dict(lhs_scale=lhs_scale, rhs_scale=rhs_scale, recipe=fmt.recipe,
                                                     arch=fmt.arch)

        def cmp_contig(got, ref, args, kwargs):
            rows = np_canonical_m_indices(_np(args[2]), g, 128) >= 0
            assert _rel_err(got, ref, rows) < 5e-3
            assert (_np(got)[~rows].astype(np.float32) == 0).all() and (_np(ref)[~rows].astype(np.float32) == 0).all()

        cases.append(Case("m_grouped_gemm_contig", f"violations_{recipe}_{arch}", make_contig, cmp_contig))

    def make_masked(rng):
        fmt = gemm_format("fp8_block", 90)
        lhs, lhs_scale = fmt.quantize_lhs(_tokens(rng, g * m_pad, kk).reshape(g, m_pad, kk))
        rhs, rhs_scale = _weights(rng, fmt, g, n, kk)
        return (lhs, rhs, jnp.asarray([-5, m_pad + 1, 40], jnp.int32)), dict(
            expected_m=24, lhs_scale=lhs_scale, rhs_scale=rhs_scale, recipe="fp8_block", arch=90)

    def cmp_masked(got, ref, args, kwargs):
        real = (np.arange(m_pad)[None, :] < np.clip(_np(args[2]), 0, m_pad)[:, None]).reshape(-1)
        assert _rel_err(got.reshape(-1, n), ref.reshape(-1, n), real) < 5e-3

    cases.append(Case("m_grouped_gemm_masked", "violations_fp8_block_90", make_masked, cmp_masked))
    return cases


def _widen_cases():
    """MXFP4 weights in the W4A8 form widened to FP8 block weights: both column orders, odd N (a partial
    last row tile), w13's rows interleaved; every e4m3 table used (a spread of 24 exponents)."""
    from layouts.fp4 import pack_e2m1
    from layouts.w4a8 import mxfp4_to_w4a8

    def make(n, k, order, gran):
        def f(rng):
            codes = jnp.asarray(rng.integers(0, 16, (3, n, k), dtype=np.uint8))
            sf32 = jnp.asarray((2.0 ** rng.integers(-26, -2, (3, n, k // 32))).astype(np.float32))
            return mxfp4_to_w4a8(pack_e2m1(codes), sf32), dict(column_order=order, gate_up_interleave=gran)
        return f

    return [Case("widen_w4a8_weights", name, make(n, k, order, gran), _exact)
            for name, n, k, order, gran in (("columns_n200", 200, 384, "columns", 0),
                                            ("w4a8_n200", 200, 384, "w4a8", 0),
                                            ("w13_interleaved_n512", 512, 256, "columns", 8))]


CASES = {c.id: c for c in (_route_cases() + _rank_cases() + _dispatch_map_cases() + _permute_cases()
                           + _activation_cases() + _unpermute_cases() + _gemm_cases() + _dense_gemm_cases()
                           + _fused_moe_cases() + _fused_moe_routed_cases() + _violation_cases() + _widen_cases())}


def run_case(case: Case, backend: str) -> str:
    """"ok", or "refused: <reason>" when the backend does not claim the case; raises on a mismatch."""
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    args, kwargs = case.make(rng)
    fn = getattr(cc, case.op)
    ref = fn(*args, **kwargs, backend="reference")
    try:
        got = fn(*args, **kwargs, backend=backend)
    except ValueError as exc:
        if f"backend {backend!r} cannot run op" in str(exc):
            return f"refused: {exc}"
        raise
    case.compare(got, ref, args, kwargs)
    return "ok"


# ------------------------------------------------------------------------------ the pytest side

def _implementations():
    """(backend, case id) of every accelerated implementation; the Triton cases (run by Triton's
    interpreter in a subprocess, off a GPU) are in the slow set."""
    out = []
    for case in CASES.values():
        for backend in cc.backends(case.op):
            if backend != cc.REFERENCE:
                interpreted = backend == "triton" and not _has_gpu()
                marks = (pytest.mark.slow,) if interpreted else ()
                out.append(pytest.param(backend, case.id, marks=marks))
    return out


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def _environment(backend: str, case: Case) -> str:
    """Why `backend` cannot run here at all ("" when it can), from the registry's own checks."""
    arch = 100 if case.name.endswith("_100") or "_100_" in case.name else 90
    return cc.unavailable_reason(backend, arch=arch)


@pytest.fixture(scope="session")  # one subprocess per worker that runs an interpreted case
def interpreted():
    """The Triton cases under Triton's interpreter, one subprocess serving them."""
    server = InterpreterServer(__file__, "triton")
    yield server
    server.close()


@pytest.mark.parametrize("backend,case_id", _implementations())
def test_implementation_matches_reference(backend, case_id, request):
    case = CASES[case_id]
    reason = _environment(backend, case)
    if reason and backend == "triton":
        result = request.getfixturevalue("interpreted").run(case_id)
    elif reason:
        pytest.skip(f"backend {backend!r} cannot run here: {reason}")
    else:
        result = run_case(case, backend)
    if result.startswith("refused: "):
        assert len(result) > len("refused: ") + 10, "a refusal must say why"
        pytest.skip(f"{backend} does not claim {case_id}: {result}")
    assert result == "ok", result


# bad inputs: rejected by the public op function, naming the argument, whatever the backend
def _routed_args(gate_dtype):
    """fused_moe_routed operands: 4 tokens, H 128, a router over 8 experts, 4 held (I 128)."""
    z = jnp.zeros
    return (z((4, 128), jnp.bfloat16), z((8, 128), gate_dtype), None, z((4, 256, 128), jnp.float8_e4m3fn),
            z((4, 2, 1), jnp.float32), z((4, 128, 128), jnp.float8_e4m3fn), z((4, 1, 1), jnp.float32))


def _bad_inputs():
    f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    z = jnp.zeros
    return [
        ("route_topk", lambda b: cc.route_topk(z((4, 8), bf16), None, top_k=2, scoring="softmax", backend=b),
         TypeError, "logits: expected dtype float32"),
        ("route_topk", lambda b: cc.route_topk(z((4, 8), f32), None, top_k=9, scoring="softmax", backend=b),
         ValueError, r"top_k: expected an int in \[1, 8\]"),
        ("fused_moe_routed", lambda b: cc.fused_moe_routed(*_routed_args(f32), top_k=2, scoring="softmax",
                                                           w13_interleave=8, backend=b),
         TypeError, "gate_weight: expected dtype bfloat16"),
        ("fused_moe_routed", lambda b: cc.fused_moe_routed(*_routed_args(bf16), top_k=2, scoring="softmax", n_group=3,
                                                           w13_interleave=8, backend=b),
         ValueError, "n_group: expected a divisor of E = 8, got 3"),
        ("fused_moe_routed", lambda b: cc.fused_moe_routed(*_routed_args(bf16), top_k=2, scoring="softmax",
                                                           expert_offset=z((2,), i32), w13_interleave=8, backend=b),
         ValueError, "expert_offset: expected an int or an integer scalar"),
        ("rank_within_expert", lambda b: cc.rank_within_expert(z((8,), f32), num_experts=2, backend=b),
         TypeError, "e_flat: expected dtype int32"),
        ("dispatch_map_contig", lambda b: cc.dispatch_map_contig(z((4, 2), f32), 0, num_local_experts=2,
                                                                 alignment=8, backend=b),
         TypeError, "topk_ids: expected an integer dtype"),
        ("dispatch_map_masked", lambda b: cc.dispatch_map_masked(z((4, 2), i32), z((2,), i32), num_local_experts=2,
                                                                 m_pad=128, backend=b),
         ValueError, "expert_offset: expected an integer scalar"),
        ("permute_contig", lambda b: cc.permute_contig(z((4, 128), i32), z((4, 2), i32), num_rows=128,
                                                       recipe="bf16", arch=90, backend=b),
         TypeError, "x: expected dtype"),
        ("permute_masked", lambda b: cc.permute_masked(z((4, 128), bf16), z((4, 2), i32), num_groups=2, m_pad=100,
                                                       recipe="bf16", arch=90, backend=b),
         ValueError, "m_pad: expected a multiple of 128"),
        ("activation_quant_contig", lambda b: cc.activation_quant_contig(z((4, 7), bf16), act=ActivationSpec(),
                                                                         recipe="bf16", arch=90, backend=b),
         ValueError, "gateup: last axis must be even"),
        ("activation_quant_masked", lambda b: cc.activation_quant_masked(z((2, 128, 8), bf16), z((3,), i32),
                                                                         act=ActivationSpec(), recipe="bf16",
                                                                         arch=90, backend=b),
         ValueError, r"masked_m: expected shape \(2,\)"),
        ("unpermute", lambda b: cc.unpermute(z((8, 16), bf16), z((4, 2), i32), z((4, 3), f32), backend=b),
         ValueError, r"topk_weights: expected shape \(4, 2\)"),
        ("m_grouped_gemm_contig", lambda b: cc.m_grouped_gemm_contig(z((128, 128), bf16), z((1, 64, 128), bf16),
                                                                     z((64,), i32), recipe="bf16", arch=90, backend=b),
         ValueError, r"m_indices: expected shape \(128,\)"),
        ("m_grouped_gemm_masked", lambda b: cc.m_grouped_gemm_masked(z((1, 128, 128), bf16), z((1, 64, 128), bf16),
                                                                     z((1,), i32), expected_m=True, recipe="bf16",
                                                                     arch=90, backend=b),
         ValueError, "expected_m: expected a static int >= 0, got True"),
        ("m_grouped_gemm_masked", lambda b: cc.m_grouped_gemm_masked(z((1, 128, 128), bf16), z((1, 64, 128), bf16),
                                                                     z((1,), i32), expected_m=4, recipe="mxfp8",
                                                                     arch=90, backend=b),
         ValueError, r"recipe 'mxfp8': GEMM formats exist for arch \(100,\), got arch 90"),
        ("m_grouped_gemm_masked", lambda b: cc.m_grouped_gemm_masked(
            z((1, 128, 128), jnp.float8_e4m3fn), z((1, 64, 64), jnp.int8), z((1,), i32), expected_m=4,
            lhs_scale=z((1, 1, 128), jnp.float32), rhs_scale=z((1, 64, 1), jnp.float32), recipe="mxfp4", arch=90,
            backend=b),
         TypeError, "rhs_scale: expected dtype int32, got float32"),
    ]


@pytest.mark.parametrize("op,call,exc,match", _bad_inputs(), ids=lambda v: v if isinstance(v, str) else "")
def test_bad_inputs_are_named_for_every_backend(op, call, exc, match):
    for backend in cc.backends(op):
        with pytest.raises(exc, match=match):
            call(backend)


def test_every_declared_op_has_cases():
    from custom_calls.backends import _OPS  # the declarations themselves

    assert set(_OPS) - {"test_only_op"} <= {c.op for c in CASES.values()}


# ------------------------------------------------------------------------------ subprocess side

if __name__ == "__main__":
    backend = sys.argv[1]
    serve(lambda case_id: run_case(CASES[case_id], backend))
