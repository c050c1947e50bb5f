"""Trace-time checks of the layer's per-call inputs (tokens, token ids, routes) against the config:
clear ValueError/TypeError naming the argument, the expected and the actual value. Each public
entry point of `moe_jax.layer` / `moe_jax.routing` runs them once; the parameters are checked by
`moe_jax.params.check_params`.

Tokens may carry any number of leading dimensions, `(..., H)`: the entry points flatten them to
`(M, H)` (M = their product) and restore them on the way out.

Size limits of one call (`check_call_size`, pure Python on static shapes, nothing traced): the
int32 index extents of the routed branch (`custom_calls.limits`: routes M * k' and the buffer rows
below, each at most 2**31 - 1) and the estimate `temporary_bytes` of its largest temporaries, at
most MAX_TEMPORARY_BYTES. With k' routes per token (top_k, plus n_shared with shared-expert
fusion) over E' local experts (likewise), the routed buffers hold

    rows = M_cap = contig_capacity(M, k', E', alignment)     (contig and fused layouts)
    rows = E' * m_pad                                         (masked layout)

and the estimate is

    temporary_bytes = rows * grouped_row_bytes(H, I) + M * (8 H + 4 E + 8 I_shared)

grouped_row_bytes (moe_jax/dispatch.py) being the expert MLP's per-row peak (GEMM1 input + its
(rows, 2I) bf16 output, or the activation's, or GEMM2's input + (rows, H) bf16 output; FP8 inputs
1 byte per value plus scales); the per-token term counts the output and its fp32 combine (M, H),
the router logits (M, E) f32 and the dense shared MLP's (M, 2 I_shared) intermediate in fp32
(I_shared = 0 when the call runs no dense shared MLP). It is an estimate of what XLA keeps live,
not an exact peak. At the full DeepSeek-V3 sizes (H 7168, I 2048, E 256, top-8, one shared expert,
fp8_block, contig) it is 3.7 GiB at 16384 tokens, 13.2 GiB at 65536 and 204 GiB at 2**20 tokens;
the bound stops at 327983 tokens (`max_tokens_per_call`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from custom_calls import contracts
from custom_calls.dispatch_map import contig_capacity
from custom_calls.limits import INDEX_LIMIT, check_index_extents, largest_fitting
from layouts import FLOAT_DTYPES, get_recipe
from layouts.checks import check_dtype
from moe_jax.config import MoEConfig
from moe_jax.dispatch import default_masked_m_pad, grouped_row_bytes

# The bound on `temporary_bytes` of one call (64 GiB: the full-size V3 layer at 65536 tokens needs
# 13.2 GiB). Read at trace time: to change it, assign moe_jax.validate.MAX_TEMPORARY_BYTES before
# tracing (a function already compiled keeps the bound it was traced with).
MAX_TEMPORARY_BYTES = 64 * 2**30


def check_x(x: jax.Array, config: MoEConfig) -> tuple[int, ...]:
    """x: (..., H) float with at least one token; returns the leading shape."""
    if x.ndim < 2:
        raise ValueError(f"x: expected rank >= 2 (..., H={config.hidden_size}), got shape {tuple(x.shape)}")
    if x.shape[-1] != config.hidden_size:
        raise ValueError(f"x: expected shape (..., H={config.hidden_size}), got {tuple(x.shape)}")
    if math.prod(x.shape[:-1]) < 1:
        raise ValueError(f"x: expected at least one token (..., H={config.hidden_size}), got shape "
                         f"{tuple(x.shape)}")
    check_dtype("x", x, FLOAT_DTYPES)
    return tuple(x.shape[:-1])


def flatten_tokens(x: jax.Array, config: MoEConfig) -> tuple[jax.Array, tuple[int, ...]]:
    """Checked x (..., H) -> ((M, H), leading shape)."""
    lead = check_x(x, config)
    return x.reshape(-1, x.shape[-1]), lead


def check_token_ids(token_ids: jax.Array | None, lead: tuple[int, ...], config: MoEConfig, *,
                    debug_checks: bool = False) -> jax.Array | None:
    """token_ids: lead-shaped int (hash-routed layers need them) -> (M,) or None.

    Values must be in [0, config.vocab_size). Checked mode (debug_checks: a `checkify` check, run
    under `custom_calls.checked`, jitted or not) reports the first position outside and its value;
    otherwise concrete ids (an eager call) are checked here, a ValueError naming them. Traced ids
    without checks are not: an id outside routes its token nowhere (`moe_jax.routing.hash_route_ids`)."""
    if not config.hash_routing:
        return None if token_ids is None else token_ids.reshape(-1)
    if token_ids is None:
        raise ValueError("token_ids: required for a hash-routed layer (config.hash_routing), got None")
    if tuple(token_ids.shape) != lead:
        raise ValueError(f"token_ids: expected shape {lead} (the leading dims of x), got {tuple(token_ids.shape)}")
    if not jnp.issubdtype(token_ids.dtype, jnp.integer):
        raise TypeError(f"token_ids: expected an integer dtype, got {token_ids.dtype}")
    if debug_checks:
        contracts.check_in_range("token_ids", jnp.asarray(token_ids), config.vocab_size, "vocab_size")
    elif not isinstance(token_ids, jax.core.Tracer):
        check_token_id_values(token_ids, config.vocab_size)
    return token_ids.reshape(-1)


def check_token_id_values(token_ids, vocab_size: int) -> None:
    """Concrete token_ids (any shape): ValueError naming the first position whose value is
    outside [0, vocab_size), its value and how many more there are."""
    v = np.asarray(token_ids)
    bad = (v < 0) | (v >= vocab_size)
    if v.size == 0 or not bad.any():
        return
    pos = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), v.shape))
    more = int(bad.sum()) - 1
    extra = f" ({more} more outside)" if more else ""
    raise ValueError(f"token_ids: expected values in [0, vocab_size={vocab_size}), got {v[pos]} at position "
                     f"{pos}{extra}")


def flatten_routes(topk_ids: jax.Array, topk_weights: jax.Array, lead: tuple[int, ...],
                   config: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """topk_ids / topk_weights (*lead, k) int / float -> (M, k) each."""
    want = (*lead, config.top_k)
    if tuple(topk_ids.shape) != want or tuple(topk_weights.shape) != want:
        raise ValueError(f"topk_ids/topk_weights: expected shape {want}, got "
                         f"{tuple(topk_ids.shape)} / {tuple(topk_weights.shape)}")
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise TypeError(f"topk_ids: expected an integer dtype, got {topk_ids.dtype}")
    if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
        raise TypeError(f"topk_weights: expected a float dtype, got {topk_weights.dtype}")
    k = config.top_k
    return topk_ids.reshape(-1, k), topk_weights.reshape(-1, k)


# -- size limits of one call (module docstring) ----------------------------------------------------

def _call_sizes(config: MoEConfig, layout: str | None, routes_per_token: int | None,
                num_local_experts: int | None, intermediate_size: int | None,
                shared_intermediate_size: int | None) -> tuple[str, int, int, int, int]:
    """The defaults of `check_call_size`: the whole layer of `config` (shared-expert fusion
    included), layout config.layout or contig for "auto"."""
    fused = config.n_shared_experts if config.fuse_shared_experts else 0
    if layout is None:
        layout = config.layout if config.layout != "auto" else "contig"
    k = config.top_k + fused if routes_per_token is None else routes_per_token
    e = config.num_experts + fused if num_local_experts is None else num_local_experts
    i = config.intermediate_size if intermediate_size is None else intermediate_size
    i_s = (0 if fused else config.shared_intermediate_size) if shared_intermediate_size is None \
        else shared_intermediate_size
    return layout, k, e, i, i_s


def routed_rows(num_tokens: int, config: MoEConfig, *, layout: str, routes_per_token: int,
                num_local_experts: int) -> int:
    """Rows of the routed branch's grouped buffers at num_tokens tokens: masked E' * m_pad
    (config.masked_m_pad or round_up(M, 256)), else the contig capacity M_cap; 0 without routes."""
    if routes_per_token == 0 or num_tokens == 0:
        return 0
    if layout == "masked":
        m_pad = config.masked_m_pad if config.masked_m_pad is not None else default_masked_m_pad(num_tokens)
        return num_local_experts * m_pad
    return contig_capacity(num_tokens, routes_per_token, num_local_experts, config.alignment)


def _extents(num_tokens: int, config: MoEConfig, layout: str, k: int, e: int) -> dict[str, int]:
    rows_name = "masked rows (E_local * m_pad)" if layout == "masked" else "contig rows (M_cap)"
    return {"routes (M * top_k)": num_tokens * k,
            rows_name: routed_rows(num_tokens, config, layout=layout, routes_per_token=k,
                                   num_local_experts=e)}


def temporary_bytes(num_tokens: int, config: MoEConfig, *, layout: str | None = None,
                    routes_per_token: int | None = None, num_local_experts: int | None = None,
                    intermediate_size: int | None = None, shared_intermediate_size: int | None = None) -> int:
    """The estimate of one call's largest temporaries at num_tokens tokens (module docstring):
    rows * grouped_row_bytes(H, I) + M * (8 H + 4 E + 8 I_shared). Keywords as `check_call_size`."""
    layout, k, e, i, i_s = _call_sizes(config, layout, routes_per_token, num_local_experts, intermediate_size,
                                       shared_intermediate_size)
    h = config.hidden_size
    rows = routed_rows(num_tokens, config, layout=layout, routes_per_token=k, num_local_experts=e)
    quantized = get_recipe(config.recipe).is_quantized
    per_row = grouped_row_bytes(hidden_size=h, intermediate_size=i, quantized=quantized)
    return rows * per_row + num_tokens * (8 * h + 4 * config.num_experts + 8 * i_s)


def max_tokens_per_call(config: MoEConfig, **sizes) -> int:
    """The largest token count `check_call_size(num_tokens, config, **sizes)` accepts: the chunk
    size to split a larger batch into."""
    layout, k, e, _, _ = _call_sizes(config, sizes.get("layout"), sizes.get("routes_per_token"),
                                     sizes.get("num_local_experts"), None, None)

    def fits(m: int) -> bool:
        return (all(v <= INDEX_LIMIT for v in _extents(m, config, layout, k, e).values())
                and temporary_bytes(m, config, **sizes) <= MAX_TEMPORARY_BYTES)

    return largest_fitting(fits, 2**31)


def check_call_size(num_tokens: int, config: MoEConfig, *, layout: str | None = None,
                    routes_per_token: int | None = None, num_local_experts: int | None = None,
                    intermediate_size: int | None = None, shared_intermediate_size: int | None = None) -> None:
    """The size limits of one call of num_tokens tokens (module docstring), at trace time: a
    ValueError naming the token count, the extent or estimate, the limit and the chunk size to
    split the batch into when an int32 index extent exceeds 2**31 - 1 or `temporary_bytes`
    exceeds MAX_TEMPORARY_BYTES. layout: "contig" | "masked" | "fused" as the call resolves it;
    routes_per_token, num_local_experts, intermediate_size, shared_intermediate_size: the call's
    k', E', I and I_shared. None: the whole layer of config (`config.layout`, contig for "auto")."""
    sizes = dict(layout=layout, routes_per_token=routes_per_token, num_local_experts=num_local_experts,
                 intermediate_size=intermediate_size, shared_intermediate_size=shared_intermediate_size)
    lay, k, e, _, _ = _call_sizes(config, layout, routes_per_token, num_local_experts, None, None)
    check_index_extents("x", num_tokens, lambda m: _extents(m, config, lay, k, e),
                        chunk=lambda: max_tokens_per_call(config, **sizes))
    est = temporary_bytes(num_tokens, config, **sizes)
    if est > MAX_TEMPORARY_BYTES:
        fit = max_tokens_per_call(config, **sizes)
        rows = routed_rows(num_tokens, config, layout=lay, routes_per_token=k, num_local_experts=e)
        raise ValueError(f"x: {num_tokens} tokens need an estimated {est / 2**30:.1f} GiB of temporaries "
                         f"({lay} layout: {rows} grouped rows, H={config.hidden_size}), above "
                         f"MAX_TEMPORARY_BYTES = {MAX_TEMPORARY_BYTES / 2**30:g} GiB (moe_jax.validate); "
                         f"split the batch into chunks of at most {fit} tokens")
