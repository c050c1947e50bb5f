"""Post-permute (standard path): weighted gather-sum over top-k via src2dst, in fp32,
times routed_scaling_factor, in one pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from layouts import FLOAT_DTYPES
from layouts.checks import check_dtype, check_rank
from custom_calls import contracts
from custom_calls.backends import declare_op, resolve
from custom_calls.limits import check_index_extents, routes_and_rows

OP = "unpermute"


def _reference(d, src2dst, topk_weights, addend=None, *, routed_scaling_factor, out_dtype):
    rows = d[jnp.clip(src2dst, 0, d.shape[0] - 1)].astype(jnp.float32)  # (M, k, H)
    w = jnp.where(src2dst >= 0, topk_weights.astype(jnp.float32), 0.0)
    # a -1 route must contribute exactly nothing, even if its gathered row holds inf/nan
    rows = jnp.where((src2dst >= 0)[..., None], rows, 0.0)
    out = jnp.einsum("mkh,mk->mh", rows, w, precision=jax.lax.Precision.HIGHEST)
    # the public op drops such routes first (custom_calls/contracts.py); called directly, a row index
    # past d would read a clamped, unrelated row: the token becomes NaN instead
    beyond = jnp.any(src2dst >= d.shape[0], axis=1)
    out = jnp.where(beyond[:, None], jnp.nan, out)
    out = out * jnp.float32(routed_scaling_factor)
    if addend is not None:
        out = out + addend.astype(jnp.float32)
    return out.astype(out_dtype)


declare_op(OP, stage="unpermute", static_args=("num_rows", "hidden", "num_tokens", "top_k", "out_dtype"),
           reference=jax.jit(_reference, static_argnames=("routed_scaling_factor", "out_dtype")))


def unpermute(d: jax.Array, src2dst: jax.Array, topk_weights: jax.Array, *,
              routed_scaling_factor: float = 1.0, out_dtype=jnp.bfloat16, addend: jax.Array | None = None,
              backend: str | None = None, debug_checks: bool = False,
              assume_canonical: bool = False) -> jax.Array:
    """d: (R, H) GEMM2 output rows (masked slabs flattened to (G*m_pad, H)), src2dst: (M, k) int32
    (-1 = route not here), topk_weights: (M, k) f32, addend: (M, H) float or None
    -> (M, H) out_dtype: out[m] = scaling * sum_j w[m, j] * d[src2dst[m, j]] (+ addend[m]),
    accumulated in fp32 and cast once (the layer adds its shared-expert output here, so the sum
    of the two is not a separate pass over an fp32 array).
    Every backend drops a route outside [-1, R) (`contracts.canonical_src2dst`). debug_checks:
    report such routes and non-finite weights by token (`contracts.checked`). assume_canonical:
    the canonicalization pass is skipped (`contracts`, "assume_canonical"); a route naming a row
    >= R then makes its token's output NaN on every backend (the layer marks a route it had to
    drop this way)."""
    check_rank("d", d, 2, "(R, H)")
    check_dtype("d", d, FLOAT_DTYPES)
    check_rank("src2dst", src2dst, 2, "(M, top_k)")
    check_dtype("src2dst", src2dst, (jnp.int32,))
    k, rows = src2dst.shape[1], d.shape[0]
    check_index_extents("src2dst", src2dst.shape[0],
                        lambda n: routes_and_rows(n, k, lambda _: rows, "d rows (R)"))
    if topk_weights.shape != src2dst.shape:
        raise ValueError(f"topk_weights: expected shape {tuple(src2dst.shape)} (as src2dst), got "
                         f"{tuple(topk_weights.shape)}")
    check_dtype("topk_weights", topk_weights, FLOAT_DTYPES)
    if addend is not None:
        check_rank("addend", addend, 2, "(M, H)")
        if addend.shape != (src2dst.shape[0], d.shape[1]):
            raise ValueError(f"addend: expected shape {(src2dst.shape[0], d.shape[1])} (tokens of src2dst, H of d), "
                             f"got {tuple(addend.shape)}")
        check_dtype("addend", addend, FLOAT_DTYPES)
    if debug_checks:
        contracts.check_src2dst(src2dst, d.shape[0], distinct=False)
        contracts.check_finite_rows("topk_weights", topk_weights, "tokens")
    if not assume_canonical:
        src2dst = contracts.canonical_src2dst(src2dst, d.shape[0], distinct=False)
    out_dtype = jnp.dtype(out_dtype)
    impl = resolve(OP, backend, num_rows=d.shape[0], hidden=d.shape[1], num_tokens=src2dst.shape[0],
                   top_k=src2dst.shape[1], out_dtype=out_dtype)
    return impl.impl(d, src2dst, topk_weights, addend, routed_scaling_factor=float(routed_scaling_factor),
                     out_dtype=out_dtype)
