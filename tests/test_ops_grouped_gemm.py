"""Grouped GEMM reference (contig and masked) for every (recipe, arch) format, against numpy float64
matmuls of operands dequantized here from the GEMM-form arrays; padding/masked rows; bad inputs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
import layouts

_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


def np_unpack_ue8m0_image(image: np.ndarray, mn: int, g: int) -> np.ndarray:
    """(..., ceil(g/4), align(mn,4)) int32 -> (..., mn, g) float64: byte i of word j is group 4j+i."""
    b = image.view(np.uint32).astype(np.int64)
    exps = np.stack([(b >> (8 * i)) & 0xFF for i in range(4)], axis=-2)  # (..., W, 4, MNp)
    exps = exps.reshape(*b.shape[:-2], -1, b.shape[-1])[..., :g, :mn]
    return np.swapaxes(np.ldexp(1.0, exps - 127), -1, -2)


def np_dequant(q, sf, recipe, arch, role, rows):
    q = np.asarray(q)
    if recipe == "bf16":
        return q.astype(np.float64)
    sf = np.asarray(sf)
    if role == "rhs" and recipe == "mxfp4":
        b = q.view(np.uint8).astype(np.int64)
        codes = np.stack([b & 0xF, b >> 4], -1).reshape(*b.shape[:-1], -1)
        vals = np.where(codes & 8, -1, 1) * _E2M1[codes & 7]
    else:
        vals = q.astype(np.float64)
    k = vals.shape[-1]
    gk = {"lhs": {"fp8_block": 128, "mxfp8": 32, "mxfp4": 128},
          "rhs": {"fp8_block": 128, "mxfp8": 32, "mxfp4": 32}}[role][recipe]
    if arch == 90 and role == "lhs":
        per = np.swapaxes(sf[..., :rows], -1, -2).astype(np.float64)  # image[g, m] = sf[m, g]
    elif arch == 90:
        per = np.repeat(sf.astype(np.float64), 128, axis=-2)[..., :rows, :]
    else:
        per = np_unpack_ue8m0_image(sf, rows, -(-k // gk))
    return vals * np.repeat(per, gk, axis=-1)[..., :k]


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def make_rhs(key, g, n, k, recipe, arch):
    w = jax.random.normal(key, (g, n, k), jnp.float32) * k**-0.5
    if recipe == "bf16":
        return w.astype(jnp.bfloat16), None
    if recipe == "fp8_block":
        q, s = layouts.quantize_fp8_per_block(w, 128)
    elif recipe == "mxfp8":
        q, s = layouts.quantize_mxfp8(w, 32)
    else:
        q, s = layouts.quantize_mxfp4(w, 32)
    return layouts.prepare_expert_weights(q, s, recipe=recipe, arch=arch)


CASES = [("bf16", 90), ("fp8_block", 90), ("fp8_block", 100), ("mxfp8", 100), ("mxfp4", 100)]
_quant = jax.jit(cc.quantize_activation, static_argnums=(1, 2))
_contig = jax.jit(cc.m_grouped_gemm_contig, static_argnames=("recipe", "arch", "alignment", "backend"))
_masked = jax.jit(cc.m_grouped_gemm_masked, static_argnames=("expected_m", "recipe", "arch", "backend"))


@pytest.mark.parametrize("recipe,arch", CASES)
def test_contig_matches_numpy(recipe, arch):
    g, n, k, align = 3, 136, 256, 128
    counts = [70, 0, 131]
    m_cap = sum(-(-c // align) * align for c in counts) + align  # one trailing all-padding block
    mi = np.full(m_cap, -1, np.int32)
    start = 0
    for e, c in enumerate(counts):
        mi[start:start + c] = e
        start += -(-c // align) * align
    x = jax.random.normal(jax.random.key(1), (m_cap, k), jnp.float32) * 2
    x = jnp.where(jnp.asarray(mi >= 0)[:, None], x, 0)
    lhs, ls = _quant(x, recipe, arch)
    rhs, rs = make_rhs(jax.random.key(2), g, n, k, recipe, arch)
    d = _contig(lhs, rhs, jnp.asarray(mi), lhs_scale=ls, rhs_scale=rs, recipe=recipe, arch=arch,
                alignment=align)
    assert d.shape == (m_cap, n) and d.dtype == jnp.bfloat16
    a = np_dequant(lhs, ls, recipe, arch, "lhs", m_cap)
    b = np_dequant(rhs, rs, recipe, arch, "rhs", n)
    ref = np.zeros((m_cap, n))
    for r in range(m_cap):
        if mi[r] >= 0:
            ref[r] = b[mi[r]] @ a[r]
    d = np.asarray(d.astype(jnp.float32))
    np.testing.assert_allclose(d, ref, rtol=2**-8, atol=1e-6 * np.abs(ref).max())  # bf16 output
    assert np.all(d[mi < 0] == 0) and np.all(np.abs(d[mi >= 0]).sum(1) > 0)


@pytest.mark.parametrize("recipe,arch", CASES)
def test_masked_matches_numpy(recipe, arch):
    g, m_pad, n, k = 3, 128, 72, 256
    masked_m = np.array([5, 0, 128], np.int32)
    x = jax.random.normal(jax.random.key(3), (g, m_pad, k), jnp.float32)
    lhs, ls = _quant(x, recipe, arch)
    rhs, rs = make_rhs(jax.random.key(4), g, n, k, recipe, arch)
    d = _masked(lhs, rhs, jnp.asarray(masked_m), expected_m=3, lhs_scale=ls, rhs_scale=rs,
                recipe=recipe, arch=arch)
    a = np_dequant(lhs, ls, recipe, arch, "lhs", m_pad)
    b = np_dequant(rhs, rs, recipe, arch, "rhs", n)
    d = np.asarray(d.astype(jnp.float32))
    for e in range(g):
        ref = a[e, :masked_m[e]] @ b[e].T
        np.testing.assert_allclose(d[e, :masked_m[e]], ref, rtol=2**-8, atol=1e-6)
        assert np.all(d[e, masked_m[e]:] == 0)  # the reference writes zeros there


def test_contig_broken_blocks_are_padding():
    """m_indices with two experts inside one alignment block (segments not aligned as the
    `alignment` argument claims), padding before an expert's rows, or an id naming no expert are
    never multiplied with some other expert: the whole block is padding (zero rows), as on every
    backend (custom_calls/contracts.py)."""
    g, n, k, align = 2, 24, 64, 8
    mi = np.full(40, -1, np.int32)
    mi[0:5] = 0
    mi[5:11] = 1  # expert 1 starts at row 5: inside the first block of 8 rows
    mi[16:19] = 0  # a well-formed block
    mi[24:26] = 2  # no such expert (G = 2)
    mi[34:36] = 1  # padding before the expert's rows (block 4)
    x = jax.random.normal(jax.random.key(7), (40, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(8), (g, n, k), jnp.float32).astype(jnp.bfloat16)
    d = np.asarray(_contig(x, w, jnp.asarray(mi), recipe="bf16", arch=90, alignment=align)
                   .astype(jnp.float32))
    xs, ws = np.asarray(x, np.float64), np.asarray(w, np.float64)
    # block 1 (rows 8-15): expert 1's rows 8-10 then padding, well formed
    np.testing.assert_allclose(d[8:11], xs[8:11] @ ws[1].T, rtol=2**-8, atol=1e-6)
    np.testing.assert_allclose(d[16:19], xs[16:19] @ ws[0].T, rtol=2**-8, atol=1e-6)
    computed = np.zeros(40, bool)
    computed[8:11] = computed[16:19] = True
    assert np.all(d[~computed] == 0)  # blocks 0, 3, 4 and every padding row
    assert np.abs(d[computed]).min(1).max() > 0 and np.isfinite(d).all()


def test_bad_inputs():
    lhs = jnp.ones((256, 128), jnp.bfloat16)
    rhs = jnp.ones((2, 64, 128), jnp.bfloat16)
    mi = jnp.zeros((256,), jnp.int32)
    with pytest.raises(ValueError, match="alignment: expected a positive int dividing M_cap=256"):
        cc.m_grouped_gemm_contig(lhs, rhs, mi, recipe="bf16", arch=90, alignment=96)
    with pytest.raises(ValueError, match="rhs: expected last axis K=128"):
        cc.m_grouped_gemm_contig(lhs, rhs[..., :64], mi, recipe="bf16", arch=90)
    with pytest.raises(TypeError, match="lhs: expected dtype float8_e4m3fn"):
        cc.m_grouped_gemm_contig(lhs, rhs, mi, recipe="fp8_block", arch=90)
    with pytest.raises(ValueError, match="recipe 'mxfp8': GEMM formats exist for arch \\(100,\\)"):
        cc.m_grouped_gemm_contig(lhs, rhs, mi, recipe="mxfp8", arch=90)
    with pytest.raises(ValueError, match="m_indices: expected shape \\(256,\\)"):
        cc.m_grouped_gemm_contig(lhs, rhs, mi[:5], recipe="bf16", arch=90)
    with pytest.raises(ValueError, match="lhs_scale/rhs_scale: recipe 'bf16' takes no scales"):
        cc.m_grouped_gemm_contig(lhs, rhs, mi, lhs_scale=jnp.ones((1, 256)), recipe="bf16", arch=90)
    q = jnp.ones((2, 100, 128), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="m_pad \\(axis 1\\) must be a multiple of 128"):
        cc.m_grouped_gemm_masked(q, rhs, jnp.zeros((2,), jnp.int32), expected_m=1,
                                 recipe="fp8_block", arch=90)
    q = jnp.ones((2, 128, 128), jnp.float8_e4m3fn)
    rq = jnp.ones((2, 64, 128), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="lhs_scale: expected shape \\(2, 1, 128\\)"):
        cc.m_grouped_gemm_masked(q, rq, jnp.zeros((2,), jnp.int32), expected_m=1,
                                 lhs_scale=jnp.ones((2, 1, 100)), rhs_scale=jnp.ones((2, 1, 1)),
                                 recipe="fp8_block", arch=90)
    with pytest.raises(ValueError, match="backend 'nope': no implementation of op"):
        cc.m_grouped_gemm_contig(lhs, rhs, mi, recipe="bf16", arch=90, backend="nope")
