"""Pieces shared by the three EP modes: the static EP group description, the token message format
(hidden row, optionally FP8 + scales, plus routing), and masking of routes to this rank's experts."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from layouts import gemm_format
from moe_jax.parallel.a2a import Axes, axis_index
from moe_jax.parallel.packing import RowFormat, pack_rows, row_format, unpack_rows


@dataclass(frozen=True)
class EPGroup:
    """Experts sharded over the ranks of `axes` (size `size`): rank r holds global experts
    [r * E_local, (r + 1) * E_local)."""

    axes: Axes
    size: int
    num_experts: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.num_experts % self.size:
            raise ValueError(f"num_experts={self.num_experts} must be divisible by the EP size "
                             f"{self.size} (axes {self.axes})")

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.size

    def rank(self) -> jax.Array:
        return axis_index(self.axes)


@dataclass(frozen=True)
class SendQuant:
    """FP8 per-token-group quantization of rows before they travel (the receiver dequantizes)."""

    group_size: int
    ue8m0: bool


def send_quant_for(recipe: str, arch: int) -> SendQuant | None:
    """What the routed experts would quantize activations to anyway, so sending it loses nothing
    the GEMM keeps: fp8_block / mxfp4 -> 128-groups, mxfp8 -> 32-groups, UE8M0 scales on arch 100.
    bf16 -> None (rows travel in bf16)."""
    fmt = gemm_format(recipe, arch)
    if not fmt.is_quantized:
        return None
    return SendQuant(group_size=fmt.act_group, ue8m0=fmt.ue8m0)


def encode_rows(x: jax.Array, quant: SendQuant | None, **extra: jax.Array) -> tuple[jax.Array, RowFormat]:
    """x: (M, H) float (+ extra per-row fields) -> (packed (M, B) uint8, format)."""
    if quant is None:
        fields = dict(x=x, **extra)
    else:
        import layouts

        q, sf = layouts.quantize_fp8_per_token_group(x, group_size=quant.group_size, ue8m0=quant.ue8m0)
        fields = dict(x=q, x_scale=sf, **extra)
    fmt = row_format(**fields)
    return pack_rows(fmt, **fields), fmt


def decode_rows(buf: jax.Array, fmt: RowFormat, quant: SendQuant | None, dtype) -> dict[str, jax.Array]:
    """(..., B) uint8 -> fields, with "x" dequantized to `dtype` (..., H)."""
    f = unpack_rows(buf, fmt)
    if quant is not None:
        import layouts

        f["x"] = layouts.dequantize_fp8_per_token_group(f.pop("x"), f.pop("x_scale"),
                                                        group_size=quant.group_size, dtype=dtype)
    else:
        f["x"] = f["x"].astype(dtype)
    return f


def empty_rows(n: int, fmt: RowFormat) -> jax.Array:
    """(n, B) uint8 rows that decode to x = 0 (scales 0) and every int32 field = -1: an empty slot
    (no route) in a receive buffer."""
    fields = {}
    for f in fmt.fields:
        fill = -1 if jnp.dtype(f.dtype) == jnp.int32 else 0
        fields[f.name] = jnp.full((1, f.width), fill, jnp.dtype(f.dtype))
    return jnp.broadcast_to(pack_rows(fmt, **fields), (n, fmt.nbytes))


def local_routes(topk_ids: jax.Array, topk_weights: jax.Array, group: EPGroup, rank: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
    """Keep the routes to this rank's experts: ids (R, k) global (-1 elsewhere), weights 0 elsewhere."""
    lo = rank * group.num_local_experts
    mine = (topk_ids >= lo) & (topk_ids < lo + group.num_local_experts)
    return jnp.where(mine, topk_ids, -1), jnp.where(mine, topk_weights, 0.0)


def check_routes(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array) -> None:
    if x.ndim != 2:
        raise ValueError(f"x: expected (M, H), got shape {tuple(x.shape)}")
    m = x.shape[0]
    if topk_ids.ndim != 2 or topk_ids.shape[0] != m:
        raise ValueError(f"topk_ids: expected ({m}, top_k), got shape {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights: expected shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)}")
    if topk_ids.dtype != jnp.int32:
        raise TypeError(f"topk_ids: expected int32, got {topk_ids.dtype}")
