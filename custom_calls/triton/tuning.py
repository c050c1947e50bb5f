"""Tuning of the Triton kernels as data.

Each kernel module defines a frozen config dataclass (hashable, so it can be a static jit
argument) holding every tile size and launch choice of its kernels, and `heuristic_config(...)`,
the config its entry point uses when none is passed. A config is checked when it is built (sizes
are powers of two: they are `tl.arange` extents; num_warps is one Triton accepts) and, by the
entry point, against the problem (tiles cut into whole scale groups). Any valid config gives the
same result; it only changes speed. This module holds what the kernel modules share: the checks,
the column unit of a recipe, and `BlockTiling` (a [block_m, tile] block per program); it does not
import triton.
"""

from __future__ import annotations

import dataclasses

from layouts import get_recipe

NUM_WARPS = (1, 2, 4, 8, 16, 32)
BF16_CHUNK = 128  # the column unit of a kernel when nothing is quantized (the bf16 recipe)


def column_group(recipe: str) -> int:
    """Elements per scale group along a row: the recipe's activation group size, or BF16_CHUNK
    when the recipe quantizes nothing."""
    rec = get_recipe(recipe)
    return rec.act_group_size if rec.is_quantized else BF16_CHUNK


def _name(config, field: str) -> str:
    return f"{type(config).__name__}.{field}"


def check_powers_of_two(config, *fields: str) -> None:
    """Every named field of `config` is an int power of two (ValueError naming the field otherwise)."""
    for field in fields:
        v = getattr(config, field)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"{_name(config, field)}: expected a power of two, got {v!r}")


def check_launch(config) -> None:
    """`config.num_warps` is a warp count Triton accepts and `config.chunks_fastest` (when the
    config has it) is a bool."""
    if isinstance(config.num_warps, bool) or config.num_warps not in NUM_WARPS:
        raise ValueError(f"{_name(config, 'num_warps')}: expected one of {NUM_WARPS}, got {config.num_warps!r}")
    if hasattr(config, "chunks_fastest") and not isinstance(config.chunks_fastest, bool):
        raise ValueError(f"{_name(config, 'chunks_fastest')}: expected a bool, got {config.chunks_fastest!r}")


def tile_groups(config, field: str, *, group: int, packed: bool) -> int:
    """Scale groups of `group` elements in the tile `config.<field>` (elements along the row).

    The tile holds whole groups; with `packed` (the program writes packed UE8M0 words, 4 groups
    each) a multiple of 4 groups, so no word is shared by two programs."""
    tile = getattr(config, field)
    if tile % group:
        raise ValueError(f"{_name(config, field)}: expected a multiple of the scale group size {group}, got {tile}")
    groups = tile // group
    if packed and groups % 4:
        raise ValueError(f"{_name(config, field)}: expected a multiple of 4 x {group} = {4 * group} (packed UE8M0 "
                         f"scale words hold 4 groups and must not straddle two programs), got {tile}")
    return groups


def check_groups(config, field: str, *, packed: bool) -> None:
    """`config.<field>` counts scale groups; with `packed` it is a multiple of 4 (see `tile_groups`)."""
    if packed and getattr(config, field) % 4:
        raise ValueError(f"{_name(config, field)}: expected a multiple of 4 (packed UE8M0 scale words hold 4 "
                         f"groups and must not straddle two programs), got {getattr(config, field)}")


def config_or_default(config, cls: type, default):
    """`config` when given (TypeError unless it is a `cls`), else `default()` (the heuristic)."""
    if config is None:
        return default()
    if not isinstance(config, cls):
        raise TypeError(f"config: expected a {cls.__name__} or None, got {type(config).__name__}")
    return config


@dataclasses.dataclass(frozen=True)
class BlockTiling:
    """One [block_m, tile] block per program of a kernel over (rows, columns): tile columns (whole
    scale groups, checked by the entry point) and block_m rows, both powers of two; num_warps;
    chunks_fastest: the column chunks of one row block are neighbouring programs, so the programs in
    flight sweep whole rows."""

    tile: int
    block_m: int
    num_warps: int
    chunks_fastest: bool

    def __post_init__(self) -> None:
        check_powers_of_two(self, "tile", "block_m")
        check_launch(self)
