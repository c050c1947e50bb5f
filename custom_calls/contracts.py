"""The ops' index contracts: what a violating input produces (canonicalization, always on) and a
checked mode that reports the violation by index (`debug_checks=True`, through
`jax.experimental.checkify`). docs/ARCHITECTURE.md, "Contracts and checked mode", is the summary.

Canonicalization makes every backend produce the same result for a violating input: the public
op functions rewrite the small index arrays before any implementation sees them, so a kernel
never reads an index it was not written for and the reference computes the same thing.

* contig `m_indices` (M_cap,): a block of `alignment` rows is well formed when its first row holds
  an expert id e in [0, G), every other row holds e or -1, and the -1 rows come after the e rows
  (the GEMM kernels take the expert of a block from its first row), or when it is all -1. Every
  row of a block that is not well formed becomes -1: the block is padding.
* `masked_m` (G,): clamped to [0, m_pad].
* `src2dst` (M, k): an entry outside [-1, num_rows) becomes -1 (the route is dropped); for the
  permute ops, whose rows must be distinct, a row named again by a later route (flat (token, k)
  order) is dropped for the later route.
* `topk_ids` (M, k) of the fused op: an id outside [-1, E) becomes -1, and an expert a token names
  again in a later slot is dropped for that slot (the fused kernel's pool holds a token once per
  expert).

assume_canonical (permute and un-permute ops): the caller vouches that src2dst already keeps its
contract, as the dispatcher's src2dst does by construction, and the canonicalization pass (at
decode a few small kernels, as long as the permute itself) is skipped; the layer passes it. A
violating src2dst then gives unspecified values in the rows and tokens it names, never an access
outside a buffer: every implementation masks row indices outside [0, num_rows) (like jax's
`unique_indices` hint to scatter, a promise the caller keeps, not a check).

Checked mode (`debug_checks=True` on the ops and the layer) adds `checkify.check`s naming the
argument, the index and the value, and reports non-finite tokens and weights by index. Such a
function must run under `checked` (or `checkify.checkify`); with debug_checks=False (the default)
no check is traced at all. All functions here are pure and jit-able; shapes are static.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from custom_calls.backends import split_arrays

MAX_REPORTED = 8  # indices named in a message; the count says how many there are in all


# ------------------------------------------------------------------ canonicalization (always on)

def _blocks(m_indices: jax.Array, alignment: int) -> jax.Array:
    return m_indices.reshape(m_indices.shape[0] // alignment, alignment)


def _block_rules(blk: jax.Array, num_groups: int) -> dict[str, jax.Array]:
    """blk: (nb, A) int32 -> per-row violation masks (nb, A) bool, one per rule."""
    first = blk[:, :1]
    pad = blk == -1
    out_of_range = (blk < -1) | (blk >= num_groups)
    differs = ~pad & ~out_of_range & (blk != first)
    # a real row after a padding row (the -1 rows must be the block's tail)
    after_pad = jnp.concatenate([jnp.zeros_like(pad[:, :1]), ~pad[:, 1:] & pad[:, :-1]], axis=1)
    return {"range": out_of_range, "differs": differs, "after_pad": after_pad}


def canonical_m_indices(m_indices: jax.Array, num_groups: int, alignment: int) -> jax.Array:
    """m_indices: (M_cap,) int32, M_cap % alignment == 0 -> (M_cap,) int32 where every block of
    `alignment` rows that is not well formed (module docstring) is all -1. Work on the index array
    only: one pass over M_cap int32."""
    blk = _blocks(m_indices, alignment)
    rules = _block_rules(blk, num_groups)
    bad = jnp.any(rules["range"] | rules["differs"] | rules["after_pad"], axis=1, keepdims=True)
    return jnp.where(bad, -1, blk).reshape(-1)


def canonical_masked_m(masked_m: jax.Array, m_pad: int) -> jax.Array:
    """masked_m: (G,) int32 -> (G,) int32 clamped to [0, m_pad]."""
    return jnp.clip(masked_m, 0, m_pad)


def _first_claims(flat: jax.Array, num_rows: int) -> jax.Array:
    """flat: (R,) int32 rows in [-1, num_rows) -> (R,) bool: the route is the first (lowest flat
    index) to name its row; -1 routes are False."""
    r = flat.shape[0]
    idx = jnp.arange(r, dtype=jnp.int32)
    ok = flat >= 0
    first = jnp.full((num_rows,), r, jnp.int32).at[jnp.where(ok, flat, num_rows)].min(idx, mode="drop")
    return ok & (first[jnp.clip(flat, 0, max(num_rows - 1, 0))] == idx)


def canonical_src2dst(src2dst: jax.Array, num_rows: int, *, distinct: bool) -> jax.Array:
    """src2dst: (M, k) int32 -> (M, k) int32: entries outside [-1, num_rows) become -1; with
    `distinct` (the permute ops) a row already named by an earlier route, in flat (token, k)
    order, becomes -1 for the later one. Work on the (M, k) index array and, with `distinct`, one
    (num_rows,) int32 scatter."""
    s = jnp.where((src2dst >= 0) & (src2dst < num_rows), src2dst, -1)
    if not distinct or s.size == 0 or num_rows == 0:
        return s
    flat = s.reshape(-1)
    return jnp.where(_first_claims(flat, num_rows), flat, -1).reshape(s.shape)


def _topk_repeats(ids: jax.Array) -> jax.Array:
    """ids (M, k), -1 or valid: (M, k) bool, True where the slot names an expert an earlier slot
    of the same token names."""
    k = ids.shape[1]
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)  # [j, j2]: slot j2 comes before slot j
    return jnp.any((ids[:, :, None] == ids[:, None, :]) & earlier & (ids[:, None, :] >= 0), axis=2)


def canonical_topk_ids(topk_ids: jax.Array, num_experts: int) -> jax.Array:
    """topk_ids (M, k) int32 -> (M, k) int32: an id outside [0, num_experts) and a repeat of an
    expert named by an earlier slot of the same token become -1."""
    ids = jnp.where((topk_ids >= 0) & (topk_ids < num_experts), topk_ids, -1)
    return jnp.where(_topk_repeats(ids), -1, ids)


# ------------------------------------------------------------------ checked mode (debug_checks=True)

def _first(mask: jax.Array) -> jax.Array:
    """The flat index of the first True of `mask` (0 when none; only read when there is one)."""
    return jnp.argmax(mask.reshape(-1)).astype(jnp.int32)


def report_indices(bad: jax.Array, message: str) -> None:
    """bad: (N,) bool. Adds checks that fail when any is True, with `message` followed by the first
    MAX_REPORTED indices, e.g. "x has non-finite values in tokens [3, 17]" or
    "... [0, 1, 2, 3, 4, 5, 6, 7] (first 8 of 40)". One check per count, so that the message lists
    exactly the indices found (a check's message is a static format string)."""
    n = jnp.sum(bad, dtype=jnp.int32)
    idx = jnp.nonzero(bad, size=MAX_REPORTED, fill_value=-1)[0].astype(jnp.int32)
    for count in range(1, MAX_REPORTED + 1):
        names = [f"i{j}" for j in range(count)]
        listed = ", ".join("{" + a + "}" for a in names)
        suffix = " (first {} of {{n}})".format(MAX_REPORTED) if count == MAX_REPORTED else ""
        pred = (n != count) if count < MAX_REPORTED else (n < count)
        checkify.check(pred, f"{message} [{listed}]{suffix}", n=n, **{a: idx[j] for j, a in enumerate(names)})


def check_m_indices(m_indices: jax.Array, num_groups: int, alignment: int) -> None:
    """Checks the contig m_indices contract (module docstring), one check per rule, each naming the
    first violating row, its value and its block."""
    if m_indices.size == 0:
        return
    blk = _blocks(m_indices, alignment)
    rules = _block_rules(blk, num_groups)
    flat = m_indices
    a = alignment

    def where(rule: str) -> dict[str, jax.Array]:
        r = _first(rules[rule])
        b = r // a
        return dict(r=r, v=flat[r], b=b, b0=b * a, b1=b * a + a - 1, e=flat[b * a])

    checkify.check(~jnp.any(rules["range"]),
                   "m_indices[{r}] = {v} is outside [-1, " + str(num_groups) + ") (alignment block {b}, "
                   "rows {b0}..{b1})", **where("range"))
    checkify.check(~jnp.any(rules["after_pad"]),
                   "m_indices[{r}] = {v} follows padding (-1) inside alignment block {b} (rows {b0}..{b1}); "
                   "padding rows must come after the expert's rows", **where("after_pad"))
    checkify.check(~jnp.any(rules["differs"]),
                   "m_indices[{r}] = {v} differs from m_indices[{b0}] = {e} inside alignment block {b} "
                   "(rows {b0}..{b1})", **where("differs"))


def check_masked_m(masked_m: jax.Array, m_pad: int) -> None:
    """Checks 0 <= masked_m[g] <= m_pad, naming the first group that is not."""
    if masked_m.size == 0:
        return
    bad = (masked_m < 0) | (masked_m > m_pad)
    g = _first(bad)
    checkify.check(~jnp.any(bad), "masked_m[{g}] = {v} is outside [0, m_pad=" + str(m_pad) + "]",
                   g=g, v=masked_m[g])


def _check_range(name: str, flat: jax.Array, k: int, bound_name: str, bound: int) -> jax.Array:
    """flat: an (M, k) array flattened. Checks every entry is in [-1, bound), naming the first
    (token, slot) outside; returns the mask of those outside."""
    bad = (flat < -1) | (flat >= bound)
    i = _first(bad)
    checkify.check(~jnp.any(bad), name + "[{t}, {j}] = {v} is outside [-1, " + bound_name + "=" + str(bound) + ")",
                   t=i // k, j=i % k, v=flat[i])
    return bad


def check_src2dst(src2dst: jax.Array, num_rows: int, *, distinct: bool) -> None:
    """Checks every entry of src2dst (M, k) is -1 or a row in [0, num_rows) and, with `distinct`,
    that no row is named twice; names the first offending (token, k) entry."""
    if src2dst.size == 0:
        return
    k = src2dst.shape[1]
    flat = src2dst.reshape(-1)
    bad = _check_range("src2dst", flat, k, "num_rows", num_rows)
    if not distinct or num_rows == 0:
        return
    inside = jnp.where(bad, -1, flat)
    again = (inside >= 0) & ~_first_claims(inside, num_rows)
    i = _first(again)
    idx = jnp.arange(flat.shape[0], dtype=jnp.int32)
    earlier = _first((inside == inside[i]) & (idx < i))
    checkify.check(~jnp.any(again), "src2dst[{t}, {j}] = {v} names the same row as src2dst[{t0}, {j0}] "
                   "(rows must be distinct)", t=i // k, j=i % k, v=flat[i], t0=earlier // k, j0=earlier % k)


def check_topk_ids(topk_ids: jax.Array, num_experts: int) -> None:
    """Checks every entry of topk_ids (M, k) is -1 or an expert in [0, num_experts) and that no
    token names an expert twice; names the first offending (token, slot) entry."""
    if topk_ids.size == 0:
        return
    k = topk_ids.shape[1]
    bad = _check_range("topk_ids", topk_ids.reshape(-1), k, "num_experts", num_experts)
    ids = jnp.where(bad.reshape(topk_ids.shape), -1, topk_ids)
    again = _topk_repeats(ids)
    i = _first(again)
    t, j = i // k, i % k
    j0 = _first((ids[t] == ids[t, j]) & (jnp.arange(k) < j))
    checkify.check(~jnp.any(again), "topk_ids[{t}, {j}] = {v} repeats topk_ids[{t}, {j0}] (a token names each "
                   "expert at most once)", t=t, j=j, v=ids[t, j], j0=j0)


def check_in_range(name: str, values: jax.Array, bound: int, bound_name: str) -> None:
    """Checks every entry of values (any shape, integer) is in [0, bound), naming the first one
    outside by its index and value, e.g. "token_ids[1, 3] = 129280 is outside [0, vocab_size=129280)"."""
    if values.size == 0:
        return
    bad = (values < 0) | (values >= bound)
    i = _first(bad)
    pos = jnp.unravel_index(i, values.shape)
    names = [f"p{j}" for j in range(values.ndim)]
    where = ", ".join("{" + a + "}" for a in names)
    checkify.check(~jnp.any(bad), f"{name}[{where}] = {{v}} is outside [0, {bound_name}={bound})",
                   v=values.reshape(-1)[i], **dict(zip(names, pos)))


def check_finite_rows(name: str, x: jax.Array, what: str = "tokens") -> None:
    """x: (N, ...) float: reports the leading-axis indices holding a NaN or Inf, e.g.
    "x has non-finite values in tokens [3, 17]"."""
    if x.size == 0:
        return
    bad = ~jnp.all(jnp.isfinite(x).reshape(x.shape[0], -1), axis=1)
    report_indices(bad, f"{name} has non-finite values in {what}")


def check_finite_scales(name: str, scale: jax.Array, what: str = "experts") -> None:
    """scale: (G, ...) f32, or int32 words of four UE8M0 bytes (0xFF is NaN): reports the groups
    of the leading axis holding a non-finite scale."""
    if scale.size == 0:
        return
    if jnp.issubdtype(scale.dtype, jnp.floating):
        return check_finite_rows(name, scale, what)
    words = jax.lax.bitcast_convert_type(scale, jnp.uint32)
    nan_byte = jnp.zeros(words.shape, bool)
    for shift in (0, 8, 16, 24):
        nan_byte |= ((words >> shift) & 0xFF) == 0xFF
    report_indices(jnp.any(nan_byte.reshape(scale.shape[0], -1), axis=1),
                   f"{name} has non-finite (0xFF UE8M0) values in {what}")


# ------------------------------------------------------------------ the user-facing wrapper

def checked(fn: Callable, *, throw: bool = True) -> Callable:
    """Runs `fn` with its checks functionalized (`checkify.checkify`, user checks, i.e. the
    `debug_checks=True` ones). throw=True: the wrapper returns fn's result and raises
    `checkify.JaxRuntimeError` carrying the first failed check's message; throw=False: it returns
    (error, result), `error.get()` being the message or None. Non-array arguments (recipe names,
    sizes) are passed through as static values; array arguments are traced. As under `jax.jit`, fn is
    traced and compiled once per combination of static values and array shapes and dtypes, so a
    second call costs only the run (and Python state fn reads is read when it is traced); a call
    with a static value that cannot be hashed is traced anew."""
    programs: dict[tuple, Callable] = {}

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any):
        split = split_arrays(fn, args, kwargs, lambda v: isinstance(v, jax.Array) or hasattr(v, "__array__"))
        key = split.static_key
        try:
            program = programs.get(key)
        except TypeError:  # an unhashable static value: nothing to find the program by
            key = program = None
        if program is None:
            # compiled, not op by op: a layer's checks then cost one compile instead of one dispatch per op
            program = jax.jit(checkify.checkify(split.run, errors=checkify.user_checks))
            if key is not None:
                programs[key] = program
        err, out = program(*split.arrays)
        if throw:
            err.throw()
            return out
        return err, out

    return wrapper
