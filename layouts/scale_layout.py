"""Memory images of DeepGEMM's scale-factor layouts.

Convention: JAX arrays carry no strides, so a GPU layout is represented by the array that holds
its bytes in row-major order. DeepGEMM's "MN-major, TMA-aligned" scale tensor of logical shape
(..., MN, G) with strides (..., 1, align(MN, 4)) is therefore the row-major array
image (..., G, align(MN, 4)) with image[..., g, m] = sf[..., m, g]; columns m >= MN are padding
(zero), so each g-row starts on a 16-byte boundary (4 elements of 4 bytes). A kernel receives the
image's buffer as is.

  fp32 (SM90):          sf (..., MN, G) f32      -> image (..., G, align(MN, 4)) f32
  packed UE8M0 (SM100): sf (..., MN, G) pow2 f32 -> image (..., ceil(G/4), align(MN, 4)) int32,
                        word [..., j, m] holds the exponent bytes of sf[..., m, 4j:4j+4], group
                        4j+i in byte i (lowest first); missing groups and padding columns are 0.

Leading dims (experts/groups) stay outermost, so the group stride is G * align(MN, 4) elements.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from layouts.archs import ARCHS, SCALE_UE8M0, check_arch
from layouts.checks import align, ceil_div, check_dtype, check_min_ndim
from layouts.ue8m0 import ceil_to_ue8m0, pack_ue8m0, unpack_ue8m0

TMA_ALIGNMENT_BYTES = 16


def get_tma_aligned_size(mn: int, element_size: int = 4) -> int:
    """MN rounded up so that one column of the MN-major image spans a multiple of 16 bytes."""
    return align(mn, TMA_ALIGNMENT_BYTES // element_size)


def _pad_mn(image: jax.Array, mn: int) -> jax.Array:
    pad = get_tma_aligned_size(mn) - mn
    return jnp.pad(image, [(0, 0)] * (image.ndim - 1) + [(0, pad)])


def _check_image(name: str, image: jax.Array, mn: int, rows: int | None) -> None:
    check_min_ndim(name, image, 2, "(..., rows, align(MN, 4))")
    if not isinstance(mn, int) or mn <= 0:
        raise ValueError(f"mn: expected a positive int, got {mn!r}")
    if image.shape[-1] != get_tma_aligned_size(mn):
        raise ValueError(
            f"{name}: expected last axis align(mn, 4) = {get_tma_aligned_size(mn)} for mn = {mn}, "
            f"got shape {tuple(image.shape)}"
        )
    if rows is not None and image.shape[-2] != rows:
        raise ValueError(f"{name}: expected {rows} rows (axis -2), got shape {tuple(image.shape)}")


def to_mn_major_tma_aligned(sf: jax.Array) -> jax.Array:
    """sf: (..., MN, G) f32 -> image (..., G, align(MN, 4)) f32; image[..., g, m] = sf[..., m, g]."""
    check_dtype("sf", sf, (jnp.float32,))
    check_min_ndim("sf", sf, 2, "(..., MN, G)")
    return _pad_mn(jnp.swapaxes(sf, -1, -2), sf.shape[-2])


def from_mn_major_tma_aligned(image: jax.Array, mn: int) -> jax.Array:
    """Inverse of ``to_mn_major_tma_aligned``: image (..., G, align(mn, 4)) f32 -> sf (..., mn, G) f32."""
    check_dtype("image", image, (jnp.float32,))
    _check_image("image", image, mn, None)
    return jnp.swapaxes(image[..., :mn], -1, -2)


def pack_ue8m0_mn_major_tma_aligned(sf: jax.Array, *, check: bool = True) -> jax.Array:
    """sf: (..., MN, G) f32 powers of two -> image (..., ceil(G/4), align(MN, 4)) int32.

    check: see ``pack_ue8m0`` (raises on non-powers-of-two for concrete input; skipped under jit).
    """
    check_dtype("sf", sf, (jnp.float32,))
    check_min_ndim("sf", sf, 2, "(..., MN, G)")
    packed = pack_ue8m0(sf, check=check)  # (..., MN, ceil(G/4))
    return _pad_mn(jnp.swapaxes(packed, -1, -2), sf.shape[-2])


def unpack_ue8m0_mn_major_tma_aligned(image: jax.Array, mn: int, num_groups: int) -> jax.Array:
    """Inverse of ``pack_ue8m0_mn_major_tma_aligned``: image (..., ceil(G/4), align(mn, 4)) int32
    -> sf (..., mn, num_groups) f32."""
    check_dtype("image", image, (jnp.int32,))
    if not isinstance(num_groups, int) or num_groups <= 0:
        raise ValueError(f"num_groups: expected a positive int, got {num_groups!r}")
    _check_image("image", image, mn, ceil_div(num_groups, 4))
    return unpack_ue8m0(jnp.swapaxes(image[..., :mn], -1, -2), num_groups)


def broadcast_block_scale_to_rows(sf: jax.Array, mn: int, block_mn: int = 128) -> jax.Array:
    """Per-row copy of a row-block scale (``index_select(-2, arange(mn) // block_mn)``).

    sf: (..., ceil(mn/block_mn), G) -> (..., mn, G), same dtype.
    """
    check_min_ndim("sf", sf, 2, "(..., ceil(mn/block_mn), G)")
    if sf.shape[-2] != ceil_div(mn, block_mn):
        raise ValueError(
            f"sf: expected axis -2 = ceil({mn}/{block_mn}) = {ceil_div(mn, block_mn)}, "
            f"got shape {tuple(sf.shape)}"
        )
    return jnp.repeat(sf, block_mn, axis=-2)[..., :mn, :]


def _check_recipe(recipe) -> tuple[int, int]:
    if (
        not isinstance(recipe, tuple)
        or len(recipe) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in recipe)
    ):
        raise ValueError(f"recipe: expected a (gran_mn, gran_k) tuple of ints, got {recipe!r}")
    return recipe


def transform_sf_into_required_layout(
    sf: jax.Array,
    mn: int,
    k: int,
    recipe: tuple[int, int],
    *,
    num_groups: int | None = None,
    arch: int,
    ue8m0_cast: bool = False,
    check: bool = True,
) -> jax.Array:
    """Turn a checkpoint or activation scale into what a DeepGEMM GEMM of ``arch`` consumes.

    sf: ([num_groups,] ceil(mn/gran_mn), ceil(k/gran_k)) f32, recipe = (gran_mn, gran_k):
    (1, 128) per-row activation groups, (128, 128) weight blocks, (1, 32) MX groups.
    arch 90 (fp32 scales; recipes (1,128), (128,128)):
      (1, 128)   -> MN-major TMA-aligned image ([G,] ceil(k/128), align(mn, 4)) f32
      (128, 128) -> returned unchanged ([G,] ceil(mn/128), ceil(k/128)) f32 (SM90 reads weight
                    block scales row-major through a plain pointer)
    arch 100 (packed UE8M0; recipes (1,128), (128,128), (1,32)):
      the row-block scale of (128, 128) is broadcast to every row first, then
      -> ([G,] ceil(ceil(k/gran_k)/4), align(mn, 4)) int32. An int32 sf is taken as an image
      already in this layout: its shape is checked and it is returned unchanged.
    UE8M0 scales must already be powers of two (checked eagerly when ``check``; see
    ``pack_ue8m0``); ``ue8m0_cast=True`` instead rounds them up with ``ceil_to_ue8m0`` — this
    changes non-power-of-two values, so it is opt-in.
    """
    spec = ARCHS[check_arch(arch)]
    ue8m0 = spec.scale_kind == SCALE_UE8M0
    gran_mn, gran_k = _check_recipe(recipe)
    allowed = spec.scale_recipes
    if (gran_mn, gran_k) not in allowed:
        raise ValueError(f"recipe: expected one of {allowed} for arch {arch}, got {recipe!r}")
    for name, v in (("mn", mn), ("k", k)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    lead = ()
    if num_groups is not None:
        if not isinstance(num_groups, int) or num_groups <= 0:
            raise ValueError(f"num_groups: expected a positive int or None, got {num_groups!r}")
        lead = (num_groups,)
    g = ceil_div(k, gran_k)

    if ue8m0 and sf.dtype == jnp.int32:
        expected = (*lead, ceil_div(g, 4), get_tma_aligned_size(mn))
        if tuple(sf.shape) != expected:
            raise ValueError(
                f"sf: expected a packed UE8M0 image of shape {expected} (mn {mn}, k {k}, "
                f"recipe {recipe}, num_groups {num_groups}), got {tuple(sf.shape)}"
            )
        return sf
    check_dtype("sf", sf, (jnp.float32,))
    expected = (*lead, ceil_div(mn, gran_mn), g)
    if tuple(sf.shape) != expected:
        raise ValueError(
            f"sf: expected shape {expected} (mn {mn}, k {k}, recipe {recipe}, "
            f"num_groups {num_groups}), got {tuple(sf.shape)}"
        )

    if not ue8m0:
        if gran_mn == 1:
            return to_mn_major_tma_aligned(sf)
        return sf
    if ue8m0_cast:
        sf = ceil_to_ue8m0(sf)
    if gran_mn != 1:
        sf = broadcast_block_scale_to_rows(sf, mn, gran_mn)
    return pack_ue8m0_mn_major_tma_aligned(sf, check=check)
