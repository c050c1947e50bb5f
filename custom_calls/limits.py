"""Static size limits of the ops' int32 indices, checked at trace time.

The dispatch, permute, un-permute and fused ops index routes and buffer rows with int32: a route's
flat index (token * k + slot) and the rank of a route among its expert's routes run up to the
route count R = M * k, a `src2dst` entry up to the buffer's row count (contig M_cap, masked
E_local * m_pad, whose value itself marks a dropped route). Element offsets (row * H) are not
int32 anywhere: XLA addresses its buffers with 64-bit offsets, the Triton kernels widen the row to
int64 before multiplying, the DeepGEMM kernels address through TMA. So the limit is on those index
values: every one of them must be at most INDEX_LIMIT (the largest int32).

`check_index_extents` is the one check, shared by the ops here and the layer's entry points
(`moe_jax.validate.check_call_size`): pure Python on static shapes, nothing is traced. A call
past the limit is a ValueError naming the count, the extents over the limit, the limit and the
largest count that fits ("split the batch into chunks of at most N tokens").
"""

from __future__ import annotations

from typing import Callable, Mapping

INDEX_LIMIT = 2**31 - 1  # the largest int32: every route and row index must fit


def largest_fitting(fits: Callable[[int], bool], upper: int) -> int:
    """The largest n in [0, upper] with fits(n), for a `fits` that is True up to some n and False
    above it (0 when only n = 0 fits, or none does). Bisection: about 31 calls of `fits`."""
    lo, hi = 0, max(upper, 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_index_extents(name: str, count: int, extents: Callable[[int], Mapping[str, int]], *,
                        unit: str = "tokens", chunk: Callable[[], int] | None = None) -> None:
    """Raises ValueError when an int32 index extent of a call of `count` units (tokens, routes)
    exceeds INDEX_LIMIT. extents(n) -> {description: largest index value at n units}, each
    non-decreasing in n; name: the argument whose size is `count` (e.g. "x", "topk_ids"). The
    message names the count, each extent over the limit, the limit and the largest count that
    fits, e.g. "x: 268435456 tokens exceed the int32 index limit 2147483647: routes (M * top_k) =
    2147483648; split the batch into chunks of at most 268435455 tokens". chunk: the caller's
    largest count that passes all its limits (called only on failure); None: the largest count
    within the index limit."""
    over = {k: v for k, v in extents(count).items() if v > INDEX_LIMIT}
    if not over:
        return
    fit = chunk() if chunk is not None else largest_fitting(
        lambda n: all(v <= INDEX_LIMIT for v in extents(n).values()), count - 1)
    listed = ", ".join(f"{k} = {v}" for k, v in over.items())
    advice = (f"split the batch into chunks of at most {fit} {unit}" if fit >= 1 else
              f"no count of {unit} fits: the extent does not shrink with the {unit}; "
              f"reduce the sizes it names")
    raise ValueError(f"{name}: {count} {unit} exceed the int32 index limit {INDEX_LIMIT}: {listed}; {advice}")


def routes_and_rows(num_tokens: int, top_k: int, rows: Callable[[int], int],
                    rows_name: str) -> dict[str, int]:
    """The extents of an op over (M, k) routes into a buffer of rows(M) rows: {routes (M * top_k),
    rows_name: rows(M)}."""
    return {"routes (M * top_k)": num_tokens * top_k, rows_name: rows(num_tokens)}
