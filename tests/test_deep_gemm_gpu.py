"""DeepGEMM custom calls on an SM90 GPU, against float64 numpy products of the dequantized operands
(quantizers and layouts written here, independently of the code under test) and against the
reference backend. Every output row is checked; padding rows of contig must be exactly 0."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

pytestmark = pytest.mark.gpu

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16


def _align(a, b):
    return -(-a // b) * b


def quant_rows(x: np.ndarray, gs: int = 128):
    """x (..., R, K) -> q e4m3 (..., R, K), sf f32 (..., R, K/gs): per-row 1 x gs groups."""
    *lead, r, k = x.shape
    xs = x.reshape(*lead, r, k // gs, gs)
    sf = (np.maximum(np.abs(xs).max(-1), 1e-4) / 448.0).astype(np.float32)
    q = (xs / sf[..., None]).astype(E4M3).reshape(x.shape)
    return q, sf


def quant_blocks(w: np.ndarray, bs: int = 128):
    """w (G, N, K) -> q e4m3, sf f32 (G, ceil(N/bs), K/bs): 128 x 128 blocks."""
    g, n, k = w.shape
    npad = _align(n, bs)
    wp = np.zeros((g, npad, k), np.float32)
    wp[:, :n] = w
    blocks = wp.reshape(g, npad // bs, bs, k // bs, bs)
    sf = (np.maximum(np.abs(blocks).max(axis=(2, 4)), 1e-4) / 448.0).astype(np.float32)
    q = (blocks / sf[:, :, None, :, None]).astype(E4M3).reshape(g, npad, k)[:, :n]
    return q, sf


def mn_major_image(sf: np.ndarray) -> np.ndarray:
    """sf (..., M, G) -> (..., G, align(M, 4)) with image[..., g, m] = sf[..., m, g], zero padded."""
    *lead, m, g = sf.shape
    img = np.zeros((*lead, g, _align(m, 4)), np.float32)
    img[..., :m] = np.swapaxes(sf, -1, -2)
    return img


def deq_rows(q, sf, gs=128):
    return q.astype(np.float64) * np.repeat(sf.astype(np.float64), gs, axis=-1)


def deq_blocks(q, sf, bs=128):
    n = q.shape[-2]
    s = np.repeat(np.repeat(sf.astype(np.float64), bs, axis=-2)[..., :n, :], bs, axis=-1)
    return q.astype(np.float64) * s


def row_rel_err(out: np.ndarray, ref: np.ndarray) -> np.ndarray:
    out = out.astype(np.float64)
    return np.linalg.norm(out - ref, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)


def contig_layout(sizes, tail_blocks=1, align=128):
    """m_indices for segments of the given sizes, each padded to `align`, plus tail padding blocks."""
    idx = []
    for e, s in enumerate(sizes):
        idx += [e] * s + [-1] * (_align(s, align) - s)
    idx += [-1] * (align * tail_blocks)
    return np.array(idx, np.int32)


@pytest.fixture(scope="module")
def dg():
    import custom_calls.deep_gemm as dg

    return dg


def _contig_inputs(rng, sizes, n, k, recipe):
    m_idx = contig_layout(sizes)
    m_cap = len(m_idx)
    g = len(sizes)
    x = rng.standard_normal((m_cap, k)).astype(np.float32)
    x[m_idx < 0] = 0.0  # the permute op's contract: padding rows are zero
    w = (rng.standard_normal((g, n, k)) * 0.05).astype(np.float32)
    if recipe == "bf16":
        a, b = x.astype(BF16), w.astype(BF16)
        return m_idx, (a, b, None, None), a.astype(np.float64), b.astype(np.float64)
    qa, sa = quant_rows(x)
    qb, sb = quant_blocks(w)
    return m_idx, (qa, qb, mn_major_image(sa), sb), deq_rows(qa, sa), deq_blocks(qb, sb)


@pytest.mark.parametrize("recipe", ["fp8_block", "bf16"])
def test_contig_matches_float64_every_row(dg, recipe):
    rng = np.random.default_rng(1)
    sizes = [300, 0, 129, 31, 512, 1]  # empty expert, odd sizes, one-row expert
    n, k = 384, 640
    m_idx, (a, b, sa, sb), A, B = _contig_inputs(rng, sizes, n, k, recipe)
    f = jax.jit(lambda a, b, m, sa, sb: dg.m_grouped_gemm_contig(a, b, m, lhs_scale=sa, rhs_scale=sb,
                                                                   recipe=recipe, arch=90))
    out = np.asarray(f(a, b, m_idx, sa, sb)).astype(np.float64)
    assert out.shape == (len(m_idx), n)
    valid = m_idx >= 0
    ref = np.einsum("mk,mnk->mn", A[valid], B[m_idx[valid]])
    err = row_rel_err(out[valid], ref)
    tol = 1e-2 if recipe == "fp8_block" else 5e-3
    assert err.max() < tol, f"worst row error {err.max():.3e}"
    assert np.all(out[~valid] == 0.0), "padding rows must be exactly zero"


@pytest.mark.parametrize("recipe", ["fp8_block", "bf16"])
def test_masked_matches_float64_every_valid_row(dg, recipe):
    rng = np.random.default_rng(2)
    g, m_pad, n, k = 5, 256, 320, 512
    masked_m = np.array([0, 1, 77, 128, 256], np.int32)
    x = rng.standard_normal((g, m_pad, k)).astype(np.float32)
    w = (rng.standard_normal((g, n, k)) * 0.05).astype(np.float32)
    if recipe == "bf16":
        a, b, sa, sb = x.astype(BF16), w.astype(BF16), None, None
        A, B = a.astype(np.float64), b.astype(np.float64)
    else:
        a, sa_rows = quant_rows(x)
        b, sb = quant_blocks(w)
        sa = mn_major_image(sa_rows)
        A, B = deq_rows(a, sa_rows), deq_blocks(b, sb)
    for expected_m in (1, 64, 200):
        out = np.asarray(dg.m_grouped_gemm_masked(a, b, masked_m, expected_m=expected_m, lhs_scale=sa,
                                                  rhs_scale=sb, recipe=recipe, arch=90)).astype(np.float64)
        assert out.shape == (g, m_pad, n)
        tol = 1e-2 if recipe == "fp8_block" else 5e-3
        for e in range(g):
            r = masked_m[e]
            if r == 0:
                continue
            err = row_rel_err(out[e, :r], A[e, :r] @ B[e].T)
            assert err.max() < tol, f"group {e} expected_m {expected_m}: worst row {err.max():.3e}"


def test_masked_m_above_m_pad_is_clamped(dg):
    rng = np.random.default_rng(3)
    g, m_pad, n, k = 3, 128, 256, 256
    a = rng.standard_normal((g, m_pad, k)).astype(BF16)
    b = (rng.standard_normal((g, n, k)) * 0.05).astype(BF16)
    masked_m = np.array([m_pad + 50, 10, 1 << 20], np.int32)
    out = np.asarray(dg.m_grouped_gemm_masked(a, b, masked_m, expected_m=64, recipe="bf16", arch=90))
    ref = np.einsum("gmk,gnk->gmn", a.astype(np.float64), b.astype(np.float64))
    assert row_rel_err(out[0], ref[0]).max() < 5e-3
    assert row_rel_err(out[1, :10], ref[1, :10]).max() < 5e-3
    assert row_rel_err(out[2], ref[2]).max() < 5e-3


def test_matches_reference_backend(dg):
    import custom_calls

    rng = np.random.default_rng(4)
    m_idx, (a, b, sa, sb), _, _ = _contig_inputs(rng, [200, 57, 128], 256, 384, "fp8_block")
    args = (jnp.asarray(a), jnp.asarray(b), jnp.asarray(m_idx))
    kw = dict(lhs_scale=jnp.asarray(sa), rhs_scale=jnp.asarray(sb), recipe="fp8_block", arch=90)
    ours = np.asarray(custom_calls.m_grouped_gemm_contig(*args, backend="deep_gemm", **kw)).astype(np.float64)
    ref = np.asarray(custom_calls.m_grouped_gemm_contig(*args, backend="reference", **kw)).astype(np.float64)
    valid = m_idx >= 0
    assert row_rel_err(ours[valid], ref[valid]).max() < 1e-2
    assert np.all(ours[~valid] == 0) and np.all(ref[~valid] == 0)


def test_contig_expert_id_past_the_groups_stays_in_bounds(dg):
    """Blocks with an id >= G reach the kernel as padding (custom_calls/contracts.py; the FP8 kernel
    would otherwise offset its B-scale pointer past rhs_scale): the call completes, those rows are
    0 as on the reference, and every other row is right."""
    rng = np.random.default_rng(9)
    sizes = [200, 57, 128]
    m_idx, (a, b, sa, sb), A, B = _contig_inputs(rng, sizes, 256, 384, "fp8_block")
    stray = m_idx.copy()
    stray[stray == 2] = 2 + 1000  # the last expert's whole segment
    out = np.asarray(dg.m_grouped_gemm_contig(a, b, stray, lhs_scale=sa, rhs_scale=sb, recipe="fp8_block",
                                              arch=90)).astype(np.float64)
    valid = (m_idx >= 0) & (m_idx != 2)
    ref = np.einsum("mk,mnk->mn", A[valid], B[m_idx[valid]])
    assert row_rel_err(out[valid], ref).max() < 1e-2
    assert np.all(out[~valid] == 0.0)


def test_contig_empty_and_all_padding(dg):
    b = jnp.ones((2, 128, 256), jnp.bfloat16)
    out = dg.m_grouped_gemm_contig(jnp.zeros((0, 256), jnp.bfloat16), b, jnp.zeros((0,), jnp.int32),
                                   recipe="bf16", arch=90)
    assert out.shape == (0, 128)
    m_idx = np.full((256,), -1, np.int32)
    out = np.asarray(dg.m_grouped_gemm_contig(jnp.zeros((256, 256), jnp.bfloat16), b, m_idx,
                                              recipe="bf16", arch=90))
    assert np.all(out == 0)


def test_dense_fp8(dg):
    rng = np.random.default_rng(5)
    m, n, k = 203, 448, 768
    qa, sa = quant_rows(rng.standard_normal((m, k)).astype(np.float32))
    qb, sb = quant_blocks((rng.standard_normal((1, n, k)) * 0.05).astype(np.float32))
    out = np.asarray(dg.gemm_nt_fp8(qa, qb[0], a_scale=mn_major_image(sa), b_scale=sb[0]))
    ref = deq_rows(qa, sa) @ deq_blocks(qb, sb)[0].T
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert row_rel_err(out, ref).max() < 1e-2


@pytest.mark.parametrize("out_dtype,tol", [(jnp.bfloat16, 5e-3), (jnp.float32, 1e-4)])
def test_dense_bf16(dg, out_dtype, tol):
    rng = np.random.default_rng(6)
    m, n, k = 77, 320, 448
    a = rng.standard_normal((m, k)).astype(BF16)
    b = rng.standard_normal((n, k)).astype(BF16)
    out = np.asarray(dg.gemm_nt_bf16(a, b, out_dtype=out_dtype))
    assert out.dtype == out_dtype and out.shape == (m, n)
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    assert row_rel_err(out, ref).max() < tol


@pytest.mark.parametrize("num_splits", [1, 2])
def test_tf32_prenorm(dg, num_splits):
    rng = np.random.default_rng(7)
    m, n, k = 301, 24, 1024
    x = rng.standard_normal((m, k)).astype(BF16)
    fn = rng.standard_normal((n, k)).astype(np.float32)
    d, sq = dg.tf32_prenorm_gemm(x, fn, num_splits=num_splits)
    d, sq = np.asarray(d), np.asarray(sq)
    X = x.astype(np.float64)
    assert d.shape == (m, n) and sq.shape == (m,)
    assert row_rel_err(d, X @ fn.astype(np.float64).T).max() < 3e-3  # TF32: 10-bit mantissa
    np.testing.assert_allclose(sq, (X * X).sum(-1), rtol=1e-4)


def test_jit_reuses_kernel_with_new_buffers(dg):
    """Tensor maps are re-encoded per launch: a compiled function fed new arrays gives new results."""
    rng = np.random.default_rng(8)
    f = jax.jit(lambda a, b: dg.gemm_nt_bf16(a, b))
    for _ in range(3):
        a = rng.standard_normal((130, 256)).astype(BF16)
        b = rng.standard_normal((192, 256)).astype(BF16)
        out = np.asarray(f(a, b))
        assert row_rel_err(out, a.astype(np.float64) @ b.astype(np.float64).T).max() < 5e-3


def test_unsupported_arch_names_detected_capability(dg):
    a = jnp.zeros((128, 256), jnp.bfloat16)
    b = jnp.zeros((1, 128, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"arch 100 requested.*compute capability 9\.0"):
        ok, _ = dg.supports_m_grouped_gemm_contig(m_cap=128, n=128, k=256, num_groups=1, recipe="fp8_block",
                                                  arch=100)
        assert not ok
        dg.m_grouped_gemm_contig(a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn),
                                 jnp.zeros((128,), jnp.int32),
                                 lhs_scale=jnp.ones((1, 1, 128), jnp.int32)[0],
                                 rhs_scale=jnp.ones((1, 1, 128), jnp.int32), recipe="fp8_block", arch=100)


def test_registry_resolves_deep_gemm(dg):
    import custom_calls

    impl = custom_calls.resolve("m_grouped_gemm_contig", "auto", m_cap=256, n=256, k=256, num_groups=2,
                                recipe="bf16", arch=90, alignment=128, lhs_dtype=jnp.bfloat16,
                                rhs_dtype=jnp.bfloat16, settings=custom_calls.KernelSettings())
    assert impl.backend == "deep_gemm"
