"""Load-time weight paths (docs/ARCHITECTURE.md, stage 1): checkpoint weights and scales -> what a grouped GEMM reads.

  A  MXFP4 experts on SM100: values stay int8-packed e2m1; (E, N, K/32) power-of-two scales
     become the packed UE8M0 MN-major image (recipe (1, 32), K = 2 * packed width). Lossless.
  B  MXFP4 -> FP8 block (SM90, no FP4 DeepGEMM kernel): ``mxfp4_to_fp8_block``.
  E  MXFP4 kept 4-bit on SM90 (W4A8): ``layouts.w4a8.mxfp4_to_w4a8``, the same e4m3 values as B once
     the GEMM widens them.
  C  block FP8 -> UE8M0 (SM100): ``requant_fp8_block_ue8m0`` (numerical re-quantization), then the
     row-block scale is broadcast to rows and packed.
  D  MXFP8 (SM100): from high-precision weights ``quantize_mxfp8``; from an MXFP8 checkpoint only
     the uint8 exponent scales are converted (``ue8m0_bytes_to_fp32``); then packed.
``prepare_expert_weights`` runs the path that a (recipe, arch) pair needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from layouts.archs import check_arch
from layouts.checks import (
    ceil_div,
    check_dtype,
    check_float,
    check_min_ndim,
    check_positive_int,
)
from layouts.fp4 import MAX_OFFSET_BITS, MXFP4_GROUP, decode_e2m1, unpack_e2m1
from layouts.fp8 import FP8_BLOCK, cast_to_e4m3, dequantize_fp8_per_block, quantize_fp8_per_block, quantize_mxfp8
from layouts.recipes import get_recipe
from layouts.scale_layout import transform_sf_into_required_layout
from layouts.ue8m0 import ue8m0_bytes_to_fp32
from layouts.w4a8 import group_tiles, mxfp4_to_w4a8, untile_groups


def mxfp4_to_fp8_block(packed: jax.Array, sf32: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MXFP4 -> FP8 with 128 x 128 block scales (path B; DeepSeek's e2m1 -> e4m3 cast).

    packed: (..., N, K/2) int8 e2m1 pairs; sf32: (..., N, ceil(K/32)) f32 powers of two.
    -> w_fp8: (..., N, K) float8_e4m3fn, sf128: (..., ceil(N/128), ceil(K/128)) f32 powers of two.

    Per 128 x 128 tile: sf128 = (max of the tile's 32-group scales) / 2^6, and each e2m1 value is
    multiplied by its offset sf32 / sf128 = 2^(6 - d), d = how many binades its group's scale sits
    below the tile max, then cast to e4m3 (round to nearest even).
    Exactness (dequantized values bit-identical): guaranteed when every tile's scale exponents span
    d <= 6 (offsets >= 1, all products normal e4m3). For 7 <= d <= 14 the products fall into the
    e4m3 subnormal range (step 2^-9) and are still exact. From d = 15 on, the smallest magnitudes
    of that group are rounded to the nearest even multiple of 2^-9 * sf128 (d = 15: 0.5 -> 0,
    1.5 -> 2), i.e. precision is lost in the groups far below the tile maximum.
    Partial tiles (N or K not a multiple of 128) use the groups they contain.
    """
    check_dtype("packed", packed, (jnp.int8,))
    check_dtype("sf32", sf32, (jnp.float32,))
    check_min_ndim("packed", packed, 2, "(..., N, K/2)")
    n, k = packed.shape[-2], 2 * packed.shape[-1]
    g = ceil_div(k, MXFP4_GROUP)
    expected = (*packed.shape[:-1], g)
    if tuple(sf32.shape) != expected:
        raise ValueError(
            f"sf32: expected shape {expected} (packed {tuple(packed.shape)}, K = {k}, 32-groups), "
            f"got {tuple(sf32.shape)}"
        )
    tiles = group_tiles(sf32)  # zero-padded scales never win the tile max (scales are positive)
    sf128 = jnp.max(tiles, axis=(-3, -1)) * jnp.float32(2.0**-MAX_OFFSET_BITS)
    offset = untile_groups(tiles / sf128[..., :, None, :, None], n, g)  # powers of two: exact
    values = decode_e2m1(unpack_e2m1(packed))
    w = values * jnp.repeat(offset, MXFP4_GROUP, axis=-1)[..., :k]
    return cast_to_e4m3(w), sf128


def requant_fp8_block_ue8m0(
    w_fp8: jax.Array, sf: jax.Array, block_size: int = FP8_BLOCK
) -> tuple[jax.Array, jax.Array]:
    """Block FP8 -> block FP8 with power-of-two scales (path C, numerical requant).

    w_fp8: (..., N, K) float8_e4m3fn, sf: (..., ceil(N/bs), ceil(K/bs)) f32
    -> (w_fp8 (..., N, K) float8_e4m3fn, sf_pow2 (..., ceil(N/bs), ceil(K/bs)) f32).
    Dequantizes to bf16 (as the checkpoint loader does), then re-quantizes each block with
    sf = ceil_to_ue8m0(amax / 448). Already power-of-two scaled blocks keep their values exactly.
    Layout for SM100 is a separate step (``transform_sf_into_required_layout`` with (128, 128)).
    """
    check_positive_int("block_size", block_size)
    w = dequantize_fp8_per_block(w_fp8, sf, block_size, dtype=jnp.bfloat16)
    return quantize_fp8_per_block(w, block_size, ue8m0=True)


def expand_per_tensor_scale(
    scale: jax.Array, n: int, k: int, block_size: int = FP8_BLOCK
) -> jax.Array:
    """Per-tensor (per-expert) scale -> pseudo block scale.

    scale: (E,) f32 (any leading shape) -> (E, ceil(n/bs), ceil(k/bs)) f32, every block = scale[e].
    """
    check_dtype("scale", scale, (jnp.float32,))
    for name, v in (("n", n), ("k", k), ("block_size", block_size)):
        check_positive_int(name, v)
    shape = (*scale.shape, ceil_div(n, block_size), ceil_div(k, block_size))
    return jnp.broadcast_to(scale[..., None, None], shape)


def prepare_expert_weights(
    w: jax.Array, scale: jax.Array | None, *, recipe: str, arch: int, keep_4bit: bool = False
) -> tuple[jax.Array, jax.Array | None]:
    """Run the load-time path for (recipe, arch); returns (weight, scale) in the GEMM form of
    ``get_recipe(recipe).gemm_format(arch)``.

    Inputs (E = experts or any leading dims, N x K per expert):
      bf16:      w (E, N, K) bf16, scale None                       -> (w, None)
      fp8_block: w (E, N, K) e4m3, scale (E, ceil(N/128), ceil(K/128)) f32
                 arch 90  -> unchanged (fp32 block scales)
                 arch 100 -> path C: requantized w, scale (E, ceil(ceil(K/128)/4), align(N, 4)) int32
      mxfp8 (arch 100 only): w (E, N, K) e4m3 with scale (E, N, ceil(K/32)) f32 powers of two or
                 uint8 exponent bytes; or w (E, N, K) f32/bf16 with scale None (quantized here)
                 -> (w e4m3, (E, ceil(ceil(K/32)/4), align(N, 4)) int32)
      mxfp4:     w (E, N, K/2) int8, scale (E, N, ceil(K/32)) f32 powers of two (or uint8 bytes)
                 arch 100 -> path A: (w, (E, ceil(ceil(K/32)/4), align(N, 4)) int32)
                 arch 90  -> path B: (w e4m3 (E, N, K), scale (E, ceil(N/128), ceil(K/128)) f32);
                 keep_4bit: path E, (w int8 (E, N, K/2) W4A8 words, scale (E, N, ceil(K/128)) int32),
                 the form of ``layouts.gemm_format("mxfp4", 90)``
    Weights must carry at least one leading (expert) dim.
    """
    arch = check_arch(arch)
    rec = get_recipe(recipe)
    rec.check_arch(arch)
    fmt = rec.gemm_format(arch)
    check_min_ndim("w", w, 3, "(E, N, K)")
    if not rec.is_quantized:
        check_dtype("w", w, (jnp.bfloat16,))
        if scale is not None:
            raise ValueError(f"scale: expected None for recipe {rec.name!r}, got {type(scale).__name__}")
        return w, None
    if scale is not None and scale.dtype == jnp.uint8:
        scale = ue8m0_bytes_to_fp32(scale)
    if scale is None and rec.use_mxfp8:  # path D from high-precision weights
        check_float("w", w)
        w, scale = quantize_mxfp8(w, rec.weight_block[1])
    check_dtype("w", w, rec.value_dtypes)
    _require_scale(scale, rec.name)
    n, k = w.shape[-2], w.shape[-1] * rec.weight_k_pack
    if keep_4bit:  # path E
        if arch not in rec.kept_4bit_on:
            raise ValueError(f"keep_4bit: recipe {rec.name!r} stays 4-bit on arch {rec.kept_4bit_on or '()'}, "
                             f"got arch {arch}")
        return mxfp4_to_w4a8(w, scale)
    if rec.gemm_recipe(arch) is not rec:  # path B: the arch has no GEMM for these values
        return mxfp4_to_fp8_block(w, scale)
    if not fmt.ue8m0:  # the checkpoint's fp32 block scales are what the GEMM reads
        check_dtype("scale", scale, (jnp.float32,))
        exp = rec.checkpoint_scale_shape(1, n, k)[1:]
        if tuple(scale.shape) != (*w.shape[:-2], *exp):
            raise ValueError(f"scale: expected shape {(*w.shape[:-2], *exp)}, got {tuple(scale.shape)}")
        return w, scale
    if not rec.requires_ue8m0:  # path C: power-of-two scales need a numerical requant
        w, scale = requant_fp8_block_ue8m0(w, scale, rec.weight_block[0])
    num_groups = w.shape[0] if w.ndim == 3 else None
    return w, _to_gemm(scale, n, k, rec.weight_block, num_groups, arch)


def _require_scale(scale, recipe: str) -> None:
    if scale is None:
        raise ValueError(f"scale: expected a scale array for recipe {recipe!r}, got None")


def _to_gemm(sf, n, k, recipe, num_groups, arch):
    if num_groups is None:  # more than one leading dim: transform each (E, ...) slice
        return jax.vmap(lambda s: _to_gemm(s, n, k, recipe, s.shape[0] if s.ndim == 3 else None, arch))(sf)
    return transform_sf_into_required_layout(sf, n, k, recipe, num_groups=num_groups, arch=arch)
