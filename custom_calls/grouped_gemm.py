"""Grouped GEMMs of the MoE core: `m_grouped_gemm_contig` and `m_grouped_gemm_masked`,
D = A . B^T per expert ("nt": A (rows, K) K-major, B (N, K) K-major), bf16 output.

Operand formats: `layouts.gemm_format(recipe, arch)` (the `GemmFormat` table). The reference
dequantizes both operands as the format states, multiplies in fp32 and rounds to bf16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from layouts import GemmFormat, gemm_format, store_as
from layouts.checks import check_dtype, check_rank, check_shape, check_static_int
from custom_calls import contracts
from custom_calls.backends import declare_op, resolve
from custom_calls.settings import KernelSettings, resolve_settings

OP_CONTIG = "m_grouped_gemm_contig"
OP_MASKED = "m_grouped_gemm_masked"
_HI = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnums=(2, 3))
def dequantize_lhs(lhs, lhs_scale, recipe: str, arch: int) -> jax.Array:
    """lhs (..., rows, K) + its scale image -> (..., rows, K) f32 (`GemmFormat.dequantize_lhs`)."""
    return gemm_format(recipe, arch).dequantize_lhs(lhs, lhs_scale)


@functools.partial(jax.jit, static_argnums=(2, 3))
def dequantize_rhs(rhs, rhs_scale, recipe: str, arch: int) -> jax.Array:
    """rhs (G, N, K) [(G, N, K//2) int8 for mxfp4] + its scales -> (G, N, K) f32."""
    return gemm_format(recipe, arch).dequantize_rhs(rhs, rhs_scale)


def _contig_reference(lhs, rhs, m_indices, *, lhs_scale, rhs_scale, recipe, arch, alignment, settings=None):
    del settings  # how kernels are chosen and launched; the reference has none
    fmt = gemm_format(recipe, arch)
    a = fmt.dequantize_lhs(lhs, lhs_scale)  # (M_cap, K)
    b = fmt.dequantize_rhs(rhs, rhs_scale)  # (G, N, K)
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
    # the public op canonicalizes m_indices first (custom_calls/contracts.py); called directly, m_indices
    # that break the block contract (two experts in one block) or name no expert of rhs would be
    # multiplied with the wrong expert: such rows become NaN instead
    wrong = (m_indices >= 0) & ((m_indices != jnp.repeat(block_expert, alignment))
                                | (m_indices >= b.shape[0]))
    d = jnp.where(wrong[:, None], jnp.nan, d)
    return store_as(jnp.where((m_indices >= 0)[:, None], d, 0.0), jnp.bfloat16)


def _masked_reference(lhs, rhs, masked_m, *, expected_m, lhs_scale, rhs_scale, recipe, arch, settings=None):
    del expected_m, settings  # a tuning hint; how kernels are chosen and launched
    fmt = gemm_format(recipe, arch)
    a = fmt.dequantize_lhs(lhs, lhs_scale)  # (G, m_pad, K)
    b = fmt.dequantize_rhs(rhs, rhs_scale)
    d = jnp.einsum("gmk,gnk->gmn", a, b, precision=_HI, preferred_element_type=jnp.float32)
    valid = jnp.arange(a.shape[1])[None, :] < masked_m[:, None]
    return store_as(jnp.where(valid[..., None], d, 0.0), jnp.bfloat16)


# jitted: one fused computation per static configuration, also when called eagerly
declare_op(OP_CONTIG, stage="gemm",
           static_args=("m_cap", "n", "k", "num_groups", "recipe", "arch", "alignment", "lhs_dtype", "rhs_dtype",
                        "settings"),
           reference=jax.jit(_contig_reference, static_argnames=("recipe", "arch", "alignment", "settings")))
declare_op(OP_MASKED, stage="gemm",
           static_args=("num_groups", "m_pad", "n", "k", "expected_m", "recipe", "arch", "lhs_dtype", "rhs_dtype",
                        "settings"),
           reference=jax.jit(_masked_reference, static_argnames=("expected_m", "recipe", "arch", "settings")))


def check_contig(lhs, rhs, m_indices, lhs_scale, rhs_scale, fmt: GemmFormat, alignment) -> tuple[int, int, int, int]:
    """Trace-time checks of a contig grouped GEMM call; returns (M_cap, K, G, N)."""
    check_rank("lhs", lhs, 2, "(M_cap, K)")
    m_cap = lhs.shape[0]
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or m_cap % alignment:
        raise ValueError(f"alignment: expected a positive int dividing M_cap={m_cap}, got {alignment!r}")
    _, k, g, n = fmt.check_operands(lhs, rhs, lhs_scale, rhs_scale)
    check_shape("m_indices", m_indices, (m_cap,))
    check_dtype("m_indices", m_indices, (jnp.int32,))
    return m_cap, k, g, n


def check_masked(lhs, rhs, masked_m, expected_m, lhs_scale, rhs_scale, fmt: GemmFormat) -> tuple[int, int, int, int]:
    """Trace-time checks of a masked grouped GEMM call; returns (G, m_pad, K, N)."""
    check_rank("lhs", lhs, 3, "(G, m_pad, K)")
    g, m_pad, _ = lhs.shape
    if m_pad % 128:
        raise ValueError(f"lhs: m_pad (axis 1) must be a multiple of 128, got shape {tuple(lhs.shape)}")
    check_static_int("expected_m", expected_m, 0)
    _, k, gr, n = fmt.check_operands(lhs, rhs, lhs_scale, rhs_scale, batch=(g,))
    if gr != g:
        raise ValueError(f"rhs: expected {g} groups (lhs axis 0), got shape {tuple(rhs.shape)}")
    check_shape("masked_m", masked_m, (g,))
    check_dtype("masked_m", masked_m, (jnp.int32,))
    return g, m_pad, k, n


def _check_weights(rhs, rhs_scale) -> None:
    """Checked mode: non-finite weights (float rhs) or weight scales, reported by expert."""
    if jnp.issubdtype(rhs.dtype, jnp.floating):
        contracts.check_finite_rows("rhs", rhs, "experts")
    if rhs_scale is not None:
        contracts.check_finite_scales("rhs_scale", rhs_scale, "experts")


def m_grouped_gemm_contig(lhs: jax.Array, rhs: jax.Array, m_indices: jax.Array, *,
                          lhs_scale: jax.Array | None = None, rhs_scale: jax.Array | None = None,
                          recipe: str, arch: int, alignment: int = 128, lhs_order: str | None = None,
                          backend: str | None = None, debug_checks: bool = False,
                          assume_canonical: bool = False, settings: KernelSettings | None = None) -> jax.Array:
    """Contiguous grouped GEMM: D[r] = lhs[r] . rhs[m_indices[r]]^T.

    lhs: (M_cap, K) bf16 | e4m3; rhs: (G, N, K) [(G, N, K//2) int8 for mxfp4]; scales as
    `layouts.gemm_format(recipe, arch)` states; lhs_order: static, the column order lhs is in (for
    W4A8, mxfp4 on arch 90, required: `m_grouped_gemm_masked`); m_indices: (M_cap,) int32 expert of
    each row, -1 = padding row -> (M_cap, N) bf16.
    M_cap is a multiple of `alignment`; each block of `alignment` rows holds one expert's rows
    from its first row on, then -1 padding (the GEMM kernels take a block's expert from its first
    row). A block that breaks this or names no expert (< -1, >= G) is padding for every backend
    (`contracts.canonical_m_indices`). Padding rows of D are 0 when lhs's padding rows are 0 (the
    permute writes zero rows there) and the expert's weights and scales are finite; an accelerated
    kernel computes them from lhs, so a non-finite weight scale of the block's expert makes them
    NaN there (rows no route reads). debug_checks: report violations and non-finite weights
    (`contracts.checked`). assume_canonical: the caller vouches that every block is well formed,
    as the dispatcher's m_indices are by construction, and the canonicalization pass is skipped.
    A broken promise is undefined behaviour (like jax's `unique_indices`): an accelerated kernel
    may read weight scales of an expert that does not exist. Pass it only for indices built by
    `dispatch_map_contig`. settings: how an accelerated backend picks and launches its kernel
    (`custom_calls.KernelSettings`; None: the environment's defaults when traced).
    """
    fmt = gemm_format(recipe, arch)
    m_cap, k, g, n = check_contig(lhs, rhs, m_indices, lhs_scale, rhs_scale, fmt, alignment)
    lhs = fmt.lhs_for_gemm(lhs, lhs_order)
    if debug_checks:
        contracts.check_m_indices(m_indices, g, alignment)
        _check_weights(rhs, rhs_scale)
    if not assume_canonical:
        m_indices = contracts.canonical_m_indices(m_indices, g, alignment)
    settings = resolve_settings(settings)
    impl = resolve(OP_CONTIG, backend, m_cap=m_cap, n=n, k=k, num_groups=g, recipe=recipe, arch=arch,
                   alignment=alignment, lhs_dtype=lhs.dtype, rhs_dtype=rhs.dtype, settings=settings)
    return impl.impl(lhs, rhs, m_indices, lhs_scale=lhs_scale, rhs_scale=rhs_scale, recipe=recipe,
                     arch=arch, alignment=alignment, settings=settings)


def m_grouped_gemm_masked(lhs: jax.Array, rhs: jax.Array, masked_m: jax.Array, *, expected_m: int,
                          lhs_scale: jax.Array | None = None, rhs_scale: jax.Array | None = None,
                          recipe: str, arch: int, lhs_order: str | None = None, backend: str | None = None,
                          debug_checks: bool = False, assume_canonical: bool = False,
                          settings: KernelSettings | None = None) -> jax.Array:
    """Masked grouped GEMM: D[g, r] = lhs[g, r] . rhs[g]^T for r < masked_m[g].

    lhs: (G, m_pad, K) bf16 | e4m3, m_pad a multiple of 128; rhs: (G, N, K) [(G, N, K//2) int8 for
    mxfp4]; scales as `layouts.gemm_format(recipe, arch)` states. lhs_order: static, the column order
    lhs is in (`GemmFormat.lhs_for_gemm`): None or "columns" for every format but W4A8 (mxfp4 on arch
    90), whose GEMMs read the lhs in the W4A8 column order and which needs it stated, since the two
    orders have the same shape and dtype: "w4a8" for the order `gemm_format("mxfp4", 90).quantize_lhs`
    writes, "columns" for an lhs quantized as fp8_block (the op permutes it, one pass over lhs);
    omitted there, a ValueError. masked_m: (G,) int32 real rows
    per slab, clamped to [0, m_pad] for every backend; expected_m: static tuning hint
    (ceil(M*top_k / E_global)) -> (G, m_pad, N) bf16. Rows >= masked_m[g] are UNSPECIFIED for
    accelerated implementations (the reference writes zeros); consumers never read them.
    debug_checks: report masked_m outside [0, m_pad] and non-finite weights (`contracts.checked`).
    assume_canonical: masked_m is already in [0, m_pad] (the dispatcher's is), the clamp is skipped;
    a broken promise is undefined behaviour, as for the contig op. settings: as for the contig op.
    """
    fmt = gemm_format(recipe, arch)
    g, m_pad, k, n = check_masked(lhs, rhs, masked_m, expected_m, lhs_scale, rhs_scale, fmt)
    lhs = fmt.lhs_for_gemm(lhs, lhs_order)
    if debug_checks:
        contracts.check_masked_m(masked_m, m_pad)
        _check_weights(rhs, rhs_scale)
    if not assume_canonical:
        masked_m = contracts.canonical_masked_m(masked_m, m_pad)
    settings = resolve_settings(settings)
    impl = resolve(OP_MASKED, backend, num_groups=g, m_pad=m_pad, n=n, k=k, expected_m=expected_m,
                   recipe=recipe, arch=arch, lhs_dtype=lhs.dtype, rhs_dtype=rhs.dtype, settings=settings)
    return impl.impl(lhs, rhs, masked_m, expected_m=expected_m, lhs_scale=lhs_scale,
                     rhs_scale=rhs_scale, recipe=recipe, arch=arch, settings=settings)
