"""Grouped GEMMs of the MoE core (SPEC §4, §7): `m_grouped_gemm_contig` and `m_grouped_gemm_masked`,
D = A . B^T per expert ("nt": A (rows, K) K-major, B (N, K) K-major), bf16 output.

Operand formats by (recipe, arch) — what every implementation consumes:
    bf16                lhs/rhs bf16, no scales
    fp8_block, 90       lhs e4m3 + fp32 MN-major TMA-aligned image of the per-row 128-group scales
                        (contig (ceil(K/128), align(M_cap,4)); masked (G, ceil(K/128), align(m_pad,4)));
                        rhs e4m3 (G, N, K) + fp32 (G, ceil(N/128), ceil(K/128)) block scales
    arch 100            packed UE8M0 MN-major int32 images: lhs (..., ceil(ceil(K/gk)/4), align(rows,4)),
                        rhs (G, ceil(ceil(K/gk)/4), align(N,4)) per-row; gk 128 (fp8_block), 32 (mxfp8);
                        mxfp4: lhs e4m3 with gk 128, rhs int8-packed e2m1 (G, N, K//2) with gk 32
The reference dequantizes both operands exactly as stated, multiplies in fp32 and rounds to bf16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import layouts
from layouts import store_as
from custom_calls._checks import (ACT_GROUP, FLOATS, WEIGHT_GROUP, act_scale_image_shape, ceil_div,
                                  check_dtype, check_rank, check_recipe_arch, check_shape, round_up)
from custom_calls.backends import REFERENCE, register, resolve

OP_CONTIG = "m_grouped_gemm_contig"
OP_MASKED = "m_grouped_gemm_masked"
_HI = jax.lax.Precision.HIGHEST


def _check_operands(lhs, rhs, lhs_scale, rhs_scale, recipe, arch, batch: tuple[int, ...]):
    """Shared checks; lhs is (*batch, rows, K). Returns (rows, K, G, N)."""
    rows, k = lhs.shape[-2:]
    check_rank("rhs", rhs, 3, "(G, N, K)")
    g, n, kb = rhs.shape
    packed = recipe == "mxfp4"
    if kb != (k // 2 if packed else k) or (packed and k % 2):
        want = f"K//2={k // 2} (int8-packed e2m1)" if packed else f"K={k}"
        raise ValueError(f"rhs: expected last axis {want} to match lhs {tuple(lhs.shape)}, got {tuple(rhs.shape)}")
    if recipe == "bf16":
        check_dtype("lhs", lhs, FLOATS)
        check_dtype("rhs", rhs, FLOATS)
        if lhs_scale is not None or rhs_scale is not None:
            raise ValueError("lhs_scale/rhs_scale: recipe 'bf16' takes no scales, got an array")
        return rows, k, g, n
    check_dtype("lhs", lhs, (jnp.float8_e4m3fn,))
    check_dtype("rhs", rhs, (jnp.int8,) if packed else (jnp.float8_e4m3fn,))
    ls_shape, ls_dtype = act_scale_image_shape(recipe, arch, rows, k)
    check_shape("lhs_scale", lhs_scale, (*batch, *ls_shape))
    check_dtype("lhs_scale", lhs_scale, (ls_dtype,))
    if arch == 90:
        check_shape("rhs_scale", rhs_scale, (g, ceil_div(n, 128), ceil_div(k, 128)))
        check_dtype("rhs_scale", rhs_scale, (jnp.float32,))
    else:
        gk = WEIGHT_GROUP[recipe]
        check_shape("rhs_scale", rhs_scale, (g, ceil_div(ceil_div(k, gk), 4), round_up(n, 4)))
        check_dtype("rhs_scale", rhs_scale, (jnp.int32,))
    return rows, k, g, n


@functools.partial(jax.jit, static_argnums=(2, 3))
def dequantize_lhs(lhs, lhs_scale, recipe: str, arch: int) -> jax.Array:
    """lhs (..., rows, K) + its scale image -> (..., rows, K) f32."""
    if recipe == "bf16":
        return lhs.astype(jnp.float32)
    rows, k = lhs.shape[-2:]
    gk = ACT_GROUP[recipe]
    if arch == 90:
        sf = layouts.from_mn_major_tma_aligned(lhs_scale, rows)
    else:
        sf = layouts.unpack_ue8m0_mn_major_tma_aligned(lhs_scale, rows, ceil_div(k, gk))
    return lhs.astype(jnp.float32) * jnp.repeat(sf, gk, axis=-1)[..., :k]


@functools.partial(jax.jit, static_argnums=(2, 3))
def dequantize_rhs(rhs, rhs_scale, recipe: str, arch: int) -> jax.Array:
    """rhs (G, N, K) [(G, N, K//2) int8 for mxfp4] + its scales -> (G, N, K) f32."""
    if recipe == "bf16":
        return rhs.astype(jnp.float32)
    g, n, kb = rhs.shape
    k = 2 * kb if recipe == "mxfp4" else kb
    if arch == 90:
        sf = jnp.repeat(jnp.repeat(rhs_scale, 128, axis=-2)[..., :n, :], 128, axis=-1)[..., :k]
        return rhs.astype(jnp.float32) * sf
    gk = WEIGHT_GROUP[recipe]
    sf = layouts.unpack_ue8m0_mn_major_tma_aligned(rhs_scale, n, ceil_div(k, gk))  # (G, N, K/gk)
    if recipe == "mxfp4":
        return layouts.dequantize_mxfp4(rhs, sf, group_size=gk).astype(jnp.float32)
    return rhs.astype(jnp.float32) * jnp.repeat(sf, gk, axis=-1)[..., :k]


def _contig_reference(lhs, rhs, m_indices, *, lhs_scale, rhs_scale, recipe, arch, alignment):
    a = dequantize_lhs(lhs, lhs_scale, recipe, arch)  # (M_cap, K)
    b = dequantize_rhs(rhs, rhs_scale, recipe, arch)  # (G, N, K)
    m_cap, k = a.shape
    nb = m_cap // alignment
    # every segment starts at a multiple of `alignment`, so each block of `alignment` rows holds one
    # expert's rows (plus its tail padding): one matmul per block against that expert's weights,
    # looped so that no per-block copy of the weights is ever materialized (at a DeepSeek-V3
    # prefill shape that copy would be ~34 GB)
    block_expert = jnp.max(m_indices.reshape(nb, alignment), axis=1)

    def one_block(args):
        a_blk, e = args
        return jnp.einsum("mk,nk->mn", a_blk, b[e], precision=_HI, preferred_element_type=jnp.float32)

    d = jax.lax.map(one_block, (a.reshape(nb, alignment, k), jnp.clip(block_expert, 0, b.shape[0] - 1)))
    d = d.reshape(m_cap, -1)
    # m_indices that break the block contract (two experts in one block, i.e. segments not aligned
    # as `alignment` says) or name no expert of rhs would be multiplied with the wrong expert: such
    # rows become NaN instead
    wrong = (m_indices >= 0) & ((m_indices != jnp.repeat(block_expert, alignment))
                                | (m_indices >= b.shape[0]))
    d = jnp.where(wrong[:, None], jnp.nan, d)
    return store_as(jnp.where((m_indices >= 0)[:, None], d, 0.0), jnp.bfloat16)


def _masked_reference(lhs, rhs, masked_m, *, expected_m, lhs_scale, rhs_scale, recipe, arch):
    del expected_m  # a tuning hint only
    a = dequantize_lhs(lhs, lhs_scale, recipe, arch)  # (G, m_pad, K)
    b = dequantize_rhs(rhs, rhs_scale, recipe, arch)
    d = jnp.einsum("gmk,gnk->gmn", a, b, precision=_HI, preferred_element_type=jnp.float32)
    valid = jnp.arange(a.shape[1])[None, :] < masked_m[:, None]
    return store_as(jnp.where(valid[..., None], d, 0.0), jnp.bfloat16)


# jitted: one fused computation per static configuration, also when called eagerly
register(OP_CONTIG, REFERENCE, jax.jit(_contig_reference, static_argnames=("recipe", "arch", "alignment")))
register(OP_MASKED, REFERENCE, jax.jit(_masked_reference, static_argnames=("expected_m", "recipe", "arch")))


def m_grouped_gemm_contig(lhs: jax.Array, rhs: jax.Array, m_indices: jax.Array, *,
                          lhs_scale: jax.Array | None = None, rhs_scale: jax.Array | None = None,
                          recipe: str, arch: int, alignment: int = 128,
                          backend: str | None = None) -> jax.Array:
    """Contiguous grouped GEMM: D[r] = lhs[r] . rhs[m_indices[r]]^T.

    lhs: (M_cap, K) bf16 | e4m3; rhs: (G, N, K) [(G, N, K//2) int8 for mxfp4];
    m_indices: (M_cap,) int32 expert of each row, -1 = padding row -> (M_cap, N) bf16.
    M_cap is a multiple of `alignment` and every expert segment starts at a multiple of it (one
    expert per block of `alignment` rows, as the GEMM kernels read it); the reference returns NaN
    rows where m_indices breaks that rule or names no expert (>= G). Padding rows of D are 0 (the permute writes zero lhs
    rows; the reference also zeroes them).
    """
    check_recipe_arch(recipe, arch)
    check_rank("lhs", lhs, 2, "(M_cap, K)")
    m_cap = lhs.shape[0]
    if not isinstance(alignment, int) or alignment < 1 or m_cap % alignment:
        raise ValueError(f"alignment: expected a positive int dividing M_cap={m_cap}, got {alignment!r}")
    _, k, g, n = _check_operands(lhs, rhs, lhs_scale, rhs_scale, recipe, arch, ())
    check_shape("m_indices", m_indices, (m_cap,))
    check_dtype("m_indices", m_indices, (jnp.int32,))
    impl = resolve(OP_CONTIG, backend, m_cap=m_cap, n=n, k=k, num_groups=g, recipe=recipe,
                   arch=arch, alignment=alignment, lhs_dtype=lhs.dtype, rhs_dtype=rhs.dtype)
    return impl.impl(lhs, rhs, m_indices, lhs_scale=lhs_scale, rhs_scale=rhs_scale, recipe=recipe,
                     arch=arch, alignment=alignment)


def m_grouped_gemm_masked(lhs: jax.Array, rhs: jax.Array, masked_m: jax.Array, *, expected_m: int,
                          lhs_scale: jax.Array | None = None, rhs_scale: jax.Array | None = None,
                          recipe: str, arch: int, backend: str | None = None) -> jax.Array:
    """Masked grouped GEMM: D[g, r] = lhs[g, r] . rhs[g]^T for r < masked_m[g].

    lhs: (G, m_pad, K) bf16 | e4m3, m_pad a multiple of 128; rhs: (G, N, K) [(G, N, K//2) int8 for
    mxfp4]; masked_m: (G,) int32 real rows per slab; expected_m: static tuning hint
    (ceil(M*top_k / E_global)) -> (G, m_pad, N) bf16. Rows >= masked_m[g] are UNSPECIFIED for
    accelerated implementations (the reference writes zeros); consumers never read them.
    """
    check_recipe_arch(recipe, arch)
    check_rank("lhs", lhs, 3, "(G, m_pad, K)")
    g, m_pad, _ = lhs.shape
    if m_pad % 128:
        raise ValueError(f"lhs: m_pad (axis 1) must be a multiple of 128, got shape {tuple(lhs.shape)}")
    if not isinstance(expected_m, int) or expected_m < 0:
        raise ValueError(f"expected_m: expected a static int >= 0, got {expected_m!r}")
    _, k, gr, n = _check_operands(lhs, rhs, lhs_scale, rhs_scale, recipe, arch, (g,))
    if gr != g:
        raise ValueError(f"rhs: expected {g} groups (lhs axis 0), got shape {tuple(rhs.shape)}")
    check_shape("masked_m", masked_m, (g,))
    check_dtype("masked_m", masked_m, (jnp.int32,))
    impl = resolve(OP_MASKED, backend, num_groups=g, m_pad=m_pad, n=n, k=k, expected_m=expected_m,
                   recipe=recipe, arch=arch, lhs_dtype=lhs.dtype, rhs_dtype=rhs.dtype)
    return impl.impl(lhs, rhs, masked_m, expected_m=expected_m, lhs_scale=lhs_scale,
                     rhs_scale=rhs_scale, recipe=recipe, arch=arch)
