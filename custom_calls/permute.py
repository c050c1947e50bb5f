"""Pre-permute: place each (token, k) route at its row of the grouped layout and quantize
the activations for GEMM1 in the same step (the scale image the GEMM consumes).

The placement itself (`src2dst`) is computed by the dispatcher (moe_jax.dispatch); these ops
move the data. Contig: rows no route lands on are zero (so GEMM1's padding rows are zero too).
Masked: the rows of a slab past its routes are unspecified (the reference writes zeros, the Triton
kernel leaves them unwritten), as the masked GEMM never reads them; the scale image is complete.
The quantized rows are in the format's column order (`GemmFormat.lhs_order`: the W4A8 order for mxfp4
on arch 90, which GEMM1 is then told with `lhs_order="w4a8"`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from layouts import FLOAT_DTYPES, gemm_format
from layouts.checks import check_dtype, check_rank
from custom_calls import contracts
from custom_calls.backends import declare_op, resolve
from custom_calls.limits import check_index_extents, routes_and_rows

OP_CONTIG = "permute_contig"
OP_MASKED = "permute_masked"


def scatter_rows(x: jax.Array, src2dst: jax.Array, num_rows: int) -> jax.Array:
    """x: (M, H), src2dst: (M, k) int32 (row of route (m, j), -1 = none; rows distinct)
    -> (num_rows, H) same dtype, row src2dst[m, j] = x[m], all other rows 0. Differentiable in x."""
    m, k = src2dst.shape
    # routes outside [0, num_rows) go to distinct rows past the end (dropped), so unique_indices stays true
    beyond = num_rows + jnp.arange(m * k, dtype=jnp.int32).reshape(m, k)
    dst = jnp.where((src2dst >= 0) & (src2dst < num_rows), src2dst, beyond).reshape(-1)
    vals = jnp.broadcast_to(x[:, None, :], (m, k, x.shape[1])).reshape(m * k, -1)
    return jnp.zeros((num_rows, x.shape[1]), x.dtype).at[dst].set(vals, mode="drop",
                                                                   unique_indices=True)


def _contig_reference(x, src2dst, *, num_rows, recipe, arch):
    return gemm_format(recipe, arch).quantize_lhs(scatter_rows(x, src2dst, num_rows))


def _masked_reference(x, src2dst, *, num_groups, m_pad, recipe, arch):
    rows = scatter_rows(x, src2dst, num_groups * m_pad).reshape(num_groups, m_pad, x.shape[1])
    return gemm_format(recipe, arch).quantize_lhs(rows)


declare_op(OP_CONTIG, stage="permute",
           static_args=("num_tokens", "hidden", "top_k", "num_rows", "recipe", "arch", "dtype"),
           reference=jax.jit(_contig_reference, static_argnames=("num_rows", "recipe", "arch")))
declare_op(OP_MASKED, stage="permute",
           static_args=("num_tokens", "hidden", "top_k", "num_groups", "m_pad", "recipe", "arch", "dtype"),
           reference=jax.jit(_masked_reference, static_argnames=("num_groups", "m_pad", "recipe", "arch")))


def _check(x, src2dst, recipe, arch, num_rows: int, debug_checks: bool, assume_canonical: bool) -> jax.Array:
    """Trace-time checks; with debug_checks also the src2dst contract and non-finite tokens.
    Returns src2dst canonicalized (`contracts.canonical_src2dst`, rows distinct), or as given with
    assume_canonical."""
    gemm_format(recipe, arch)
    check_rank("x", x, 2, "(M, H)")
    check_dtype("x", x, FLOAT_DTYPES)
    check_rank("src2dst", src2dst, 2, "(M, top_k)")
    if src2dst.shape[0] != x.shape[0]:
        raise ValueError(f"src2dst: expected {x.shape[0]} rows (tokens of x), got shape {tuple(src2dst.shape)}")
    check_dtype("src2dst", src2dst, (jnp.int32,))
    k = src2dst.shape[1]
    check_index_extents("x", x.shape[0], lambda n: routes_and_rows(n, k, lambda _: num_rows, "num_rows"))
    if debug_checks:
        contracts.check_finite_rows("x", x, "tokens")
        contracts.check_src2dst(src2dst, num_rows, distinct=True)
    if assume_canonical:
        return src2dst
    return contracts.canonical_src2dst(src2dst, num_rows, distinct=True)


def permute_contig(x: jax.Array, src2dst: jax.Array, *, num_rows: int, recipe: str, arch: int,
                   backend: str | None = None, debug_checks: bool = False,
                   assume_canonical: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """x: (M, H) float, src2dst: (M, k) int32 distinct rows in [0, num_rows) or -1
    -> (lhs (num_rows, H) bf16 | e4m3, lhs_scale image of `layouts.gemm_format(recipe, arch)` | None).
    num_rows = M_cap, the static contig capacity (a multiple of the alignment). Every backend drops
    a route outside [-1, num_rows) and a later route naming an already named row
    (`contracts.canonical_src2dst`). debug_checks: report those and non-finite tokens by index
    (`contracts.checked`). assume_canonical: src2dst already keeps the contract, as the
    dispatcher's does; the canonicalization pass is skipped (`contracts`, "assume_canonical")."""
    src2dst = _check(x, src2dst, recipe, arch, num_rows, debug_checks, assume_canonical)
    impl = resolve(OP_CONTIG, backend, num_tokens=x.shape[0], hidden=x.shape[1],
                   top_k=src2dst.shape[1], num_rows=num_rows, recipe=recipe, arch=arch, dtype=x.dtype)
    return impl.impl(x, src2dst, num_rows=num_rows, recipe=recipe, arch=arch)


def permute_masked(x: jax.Array, src2dst: jax.Array, *, num_groups: int, m_pad: int, recipe: str,
                   arch: int, backend: str | None = None, debug_checks: bool = False,
                   assume_canonical: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """x: (M, H) float, src2dst: (M, k) int32 distinct flat slab rows g*m_pad + r, or -1
    -> (lhs (G, m_pad, H) bf16 | e4m3, lhs_scale (G, ...) image | None); lhs rows no route lands
    on are unspecified (their scale columns hold the zero row's scale). Violating routes are
    dropped and reported as in `permute_contig` (num_rows = G * m_pad); assume_canonical as
    there."""
    if m_pad % 128:
        raise ValueError(f"m_pad: expected a multiple of 128, got {m_pad}")
    src2dst = _check(x, src2dst, recipe, arch, num_groups * m_pad, debug_checks, assume_canonical)
    impl = resolve(OP_MASKED, backend, num_tokens=x.shape[0], hidden=x.shape[1],
                   top_k=src2dst.shape[1], num_groups=num_groups, m_pad=m_pad, recipe=recipe,
                   arch=arch, dtype=x.dtype)
    return impl.impl(x, src2dst, num_groups=num_groups, m_pad=m_pad, recipe=recipe, arch=arch)
