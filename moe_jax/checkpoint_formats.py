"""The tensor formats of checkpoint expert weights, as data: one `CheckpointFormat` row per format in
`FORMATS`, and the code that reads any row: classifying a projection from its headers, checking its
scale values, converting stacked experts to a recipe's checkpoint form, dequantizing a shared one.

Per projection of logical shape (N, K); (bn, bk) is the weight block of the row's `layouts` recipe
(`get_recipe(recipe).weight_block`), never restated here:

    format          .weight                 scale: shape, dtype                             recipe
    bf16            BF16 | F16 | F32 (N, K) none                                            bf16
    fp8_block       F8_E4M3 (N, K)          (ceil(N/bn), ceil(K/bk)): F32 | BF16 | F8_E8M0  fp8_block
    fp8_per_tensor  F8_E4M3 (N, K)          () or (1,): F32 | BF16 (over pseudo blocks)     fp8_block
    mxfp8           F8_E4M3 (N, K)          (N, ceil(K/bk)): F8_E8M0 | U8 | F32 | BF16      mxfp8
    mxfp4           I8 | U8 (N, K/2)        (N, ceil(K/bk)): F8_E8M0 | U8 | F32 | BF16      mxfp4

A row's `recipe` is the recipe whose checkpoint form its stacked (values, scale) already is: its
block sizes, K packing, value dtypes and power-of-two rule come from that recipe. Formats that share
a weight dtype (F8_E4M3) are told apart by the scale's shape; when one shape fits two of them the
finer-grained scale wins. Adding a format is one row (and at most one dequantizer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import layouts
from layouts import RECIPE_NAMES, QuantRecipe, get_recipe
from layouts.checks import ceil_div
from moe_jax.safetensors_reader import ST_DTYPES, SafetensorsCheckpoint

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".scale")
E8M0_DTYPES = ("U8", "F8_E8M0")  # one exponent byte per scale, value 2^(b-127)

# (format, host values (N, Kv) as stored, host scale as exact f32 or None, N, K) -> (N, K) bf16
Dequantize = Callable[["CheckpointFormat", np.ndarray, "np.ndarray | None", int, int], jax.Array]
# (stacked values (E, N, K) on the device, target recipe) -> (values, scale) in its checkpoint form
Convert = Callable[[jax.Array, QuantRecipe], "tuple[jax.Array, jax.Array | None]"]


@dataclass(frozen=True)
class CheckpointFormat:
    """One checkpoint tensor format of a projection (N, K).

    name: the format's name (`FORMATS` key). recipe: the `layouts` recipe whose checkpoint form
      the stacked (values, scale) is; its weight block (bn, bk) is the scale's block.
    weight_dtypes: safetensors dtypes of `.weight`. values: safetensors dtype of the stacked host
      values (E, N, K / k_pack) (F16/F32 weights are cast to BF16; U8 e2m1 pairs read as I8).
    scale_dtypes: accepted scale dtypes, () for none. per_tensor: the scale is one value, shape ()
      or (1,), broadcast over (ceil(N/bn), ceil(K/bk)) pseudo blocks; else it has that shape.
    converts_to: (recipe, conversion) pairs: other recipes it is loaded as, converted here.
    dequantizer: a shared projection (values, scale) -> (N, K) bf16 (called by `dequantize`).
    label, weight_note, scale_note: in error messages ("for MXFP4 weight ...", "(N, K/2) (MXFP4: two
      e2m1 codes per byte)", "(128x128 blocks)"); scale_note is formatted with bn and bk.
    """

    name: str
    recipe: str
    weight_dtypes: tuple[str, ...]
    values: str
    scale_dtypes: tuple[str, ...]
    dequantizer: Dequantize
    per_tensor: bool = False
    converts_to: tuple[tuple[str, Convert], ...] = ()
    label: str = ""
    weight_note: str = ""
    scale_note: str = ""

    @property
    def block(self) -> tuple[int, int] | None:
        """(bn, bk): values per scale along N and K, the recipe's weight block; None: no scale."""
        return get_recipe(self.recipe).weight_block

    @property
    def k_pack(self) -> int:
        """Values per stored element along K (2: int8-packed e2m1 pairs, stored (N, K/2))."""
        return get_recipe(self.recipe).weight_k_pack

    @property
    def pow2_scales(self) -> bool:
        """Scale values must be powers of two (the recipe's GEMMs read UE8M0)."""
        return get_recipe(self.recipe).requires_ue8m0

    @property
    def values_dtype(self) -> np.dtype:
        return ST_DTYPES[self.values]

    @property
    def recipes(self) -> tuple[str, ...]:
        """The recipes it can be loaded as: its own, then those it converts to."""
        return (self.recipe, *(r for r, _ in self.converts_to))

    def weight_shape(self, n: int, k: int) -> tuple[int, int]:
        return n, k // self.k_pack

    def block_grid(self, n: int, k: int) -> tuple[int, int]:
        """(ceil(N/bn), ceil(K/bk)): the stacked scale of one (N, K) projection."""
        bn, bk = self.block
        return ceil_div(n, bn), ceil_div(k, bk)

    def scale_shapes(self, n: int, k: int) -> tuple[tuple[int, ...], ...]:
        """Accepted checkpoint scale shapes of one (N, K) projection; () when it has no scale."""
        if self.block is None:
            return ()
        return ((), (1,)) if self.per_tensor else (self.block_grid(n, k),)

    def values_per_scale(self, n: int, k: int) -> int:
        return n * k if self.per_tensor else self.block[0] * self.block[1]

    def describe_scale(self) -> str:
        bn, bk = self.block
        return self.scale_note.format(bn=bn, bk=bk)

    def block_scale(self, scale: np.ndarray, n: int, k: int) -> np.ndarray:
        """Checkpoint scale (as f32) -> (ceil(N/bn), ceil(K/bk)) f32 (a per-tensor value broadcast)."""
        return np.ascontiguousarray(np.broadcast_to(scale, self.block_grid(n, k)))

    def dequantize(self, values: np.ndarray, scale: np.ndarray | None, n: int, k: int) -> jax.Array:
        """One projection as stored (values (N, K / k_pack), scale as exact f32) -> (N, K) bf16."""
        return self.dequantizer(self, values, scale, n, k)

    def to_checkpoint_form(self, values: np.ndarray, scale: np.ndarray | None, recipe: str
                           ) -> tuple[jax.Array, jax.Array | None]:
        """Stacked host (values (E, N, Kv), scale (E, ceil(N/bn), ceil(K/bk)) f32 or None) -> jax
        arrays in the checkpoint form of `recipe` (one of `recipes`; MoEParams docstring)."""
        v = jax.device_put(values)
        if recipe != self.recipe:
            return dict(self.converts_to)[recipe](v, get_recipe(recipe))
        return v, None if scale is None else jax.device_put(scale)


def _dequantize_float(f: CheckpointFormat, w: np.ndarray, s: np.ndarray | None, n: int, k: int) -> jax.Array:
    return jnp.asarray(w).astype(jnp.bfloat16)


def _dequantize_fp8_blocks(f: CheckpointFormat, w: np.ndarray, s: np.ndarray | None, n: int, k: int
                           ) -> jax.Array:
    """Square (bs, bs) blocks; a per-tensor scale is broadcast over its pseudo blocks first."""
    s = jnp.asarray(f.block_scale(s, n, k))
    return layouts.dequantize_fp8_per_block(jnp.asarray(w), s, f.block[0], jnp.bfloat16)


def _dequantize_fp8_groups(f: CheckpointFormat, w: np.ndarray, s: np.ndarray | None, n: int, k: int
                           ) -> jax.Array:
    return layouts.dequantize_fp8_per_token_group(jnp.asarray(w), jnp.asarray(s), f.block[1], jnp.bfloat16)


def _dequantize_e2m1(f: CheckpointFormat, w: np.ndarray, s: np.ndarray | None, n: int, k: int) -> jax.Array:
    return layouts.dequantize_mxfp4(jnp.asarray(w), jnp.asarray(s), f.block[1], jnp.bfloat16)


def _quantize_mx(v: jax.Array, recipe: QuantRecipe) -> tuple[jax.Array, jax.Array]:
    """Weight path D: high-precision (E, N, K) -> e4m3 values and (E, N, ceil(K/bk)) f32 powers of two."""
    return layouts.quantize_mxfp8(v, recipe.weight_block[1])


_FP8 = {"weight_dtypes": ("F8_E4M3",), "values": "F8_E4M3", "label": "F8_E4M3"}
_TABLE = (
    CheckpointFormat("bf16", recipe="bf16", weight_dtypes=("BF16", "F16", "F32"), values="BF16",
                     scale_dtypes=(), dequantizer=_dequantize_float, converts_to=(("mxfp8", _quantize_mx),),
                     label="BF16"),
    CheckpointFormat("fp8_block", recipe="fp8_block", **_FP8, scale_dtypes=("F32", "BF16", "F8_E8M0"),
                     dequantizer=_dequantize_fp8_blocks, scale_note="{bn}x{bk} blocks"),
    CheckpointFormat("fp8_per_tensor", recipe="fp8_block", **_FP8, scale_dtypes=("F32", "BF16"),
                     per_tensor=True, dequantizer=_dequantize_fp8_blocks, scale_note="per tensor"),
    CheckpointFormat("mxfp8", recipe="mxfp8", **_FP8, scale_dtypes=("U8", "F8_E8M0", "F32", "BF16"),
                     dequantizer=_dequantize_fp8_groups, scale_note="MXFP8 {bn}x{bk} groups"),
    CheckpointFormat("mxfp4", recipe="mxfp4", weight_dtypes=("I8", "U8"), values="I8",
                     scale_dtypes=("F8_E8M0", "U8", "F32", "BF16"), dequantizer=_dequantize_e2m1,
                     label="MXFP4", weight_note=" (MXFP4: two e2m1 codes per byte)",
                     scale_note="MXFP4: one scale per {bk} values along K"),
)
FORMATS: dict[str, CheckpointFormat] = {f.name: f for f in _TABLE}
CHECKPOINT_FORMATS = tuple(FORMATS)
# config.recipe -> checkpoint formats it can be loaded from: those in its form, then conversions
RECIPE_SOURCES = {r: tuple([f.name for f in _TABLE if f.recipe == r]
                           + [f.name for f in _TABLE if r in f.recipes[1:]]) for r in RECIPE_NAMES}


@dataclass(frozen=True)
class ProjPlan:
    """The tensor names of one projection: its weight and its scale (None for unscaled formats)."""

    weight: str
    scale: str | None


def scale_kind(dtype: str) -> str:
    """A scale dtype's kind: "E8M0" (F8_E8M0 / U8 bytes), else the dtype name."""
    return "E8M0" if dtype in E8M0_DTYPES else dtype


def scale_name(ckpt: SafetensorsCheckpoint, w: str) -> str | None:
    """The scale tensor beside weight `w` (`<w without .weight>` + a SCALE_SUFFIXES entry), or None."""
    base = w[: -len(".weight")]
    for suffix in SCALE_SUFFIXES:
        if base + suffix in ckpt:
            return base + suffix
    return None


def scale_to_f32(s: np.ndarray) -> np.ndarray:
    """Scale values (E8M0 bytes, BF16 or F32) as f32 on the host; exact (a byte b is 2^(b-127),
    bits b << 23; bf16 widens exactly). Bytes 0 and 255 are refused before this is called."""
    if s.dtype == np.uint8:
        return (s.astype(np.uint32) << 23).view(np.float32)
    return s.astype(np.float32)


def scale_value_problem(ckpt: SafetensorsCheckpoint, name: str, pow2: bool, problems: list[str]) -> bool:
    """Appends the problem with the values of scale tensor `name`, if any: E8M0 bytes 0 (2^-127,
    below fp32's normal range) and 255 (NaN); F32/BF16 scales that are not positive finite, or
    (`pow2`: MX formats, whose GEMMs read UE8M0) not powers of two."""
    s, dt = ckpt.read_copy(name), ckpt.info(name).dtype
    if s.dtype == np.uint8:
        bad = int(np.count_nonzero((s == 0) | (s == 255)))
        msg = (f"{name}: {bad} scale byte(s) are 0 or 255 (E8M0 2^-127 / NaN are not usable scales; "
               f"values {int(s.min())}..{int(s.max())})")
    elif pow2:
        mant, _ = np.frexp(s.astype(np.float32))
        bad = int(np.count_nonzero(~((mant == 0.5) & np.isfinite(s))))
        msg = f"{name}: {bad} {dt} scale(s) are not positive powers of two (MX formats need UE8M0 scales)"
    else:
        bad = int(np.count_nonzero(~(np.isfinite(s) & (s > 0))))
        msg = f"{name}: {bad} {dt} scale(s) are not positive finite numbers"
    if bad:
        problems.append(msg)
    return bool(bad)


def _or(items: list[str] | tuple[str, ...], comma: str = "") -> str:
    return ", ".join(items[:-1]) + f"{comma} or {items[-1]}" if len(items) > 1 else items[0]


def _match_scale(family: list[CheckpointFormat], w: str, sname: str, shape: tuple[int, ...], n: int, k: int,
                 problems: list[str]) -> CheckpointFormat | None:
    """The format of `family` whose scale shape is `shape` (the finer-grained one if two fit), or
    None after appending the problem (a lone format names its label, a family lists its shapes)."""
    fits = [f for f in family if shape in f.scale_shapes(n, k)]
    if fits:
        return min(fits, key=lambda f: f.values_per_scale(n, k))
    if len(family) == 1:
        f = family[0]
        problems.append(f"{sname}: expected shape {f.scale_shapes(n, k)[0]} ({f.describe_scale()}), "
                        f"got {tuple(shape)}")
        return None
    listed = sorted(family, key=lambda f: f.per_tensor)  # block shapes first, then ()
    want = _or([f"{f.scale_shapes(n, k)[0]} ({f.describe_scale()})" for f in listed])
    problems.append(f"{sname}: expected shape {want} for weight {w} {(n, k)}, got {shape}")
    return None


def classify(ckpt: SafetensorsCheckpoint, w: str, n: int, k: int, problems: list[str]
             ) -> tuple[str, ProjPlan] | None:
    """(format name, tensor names) of projection `w` ((N, K) logical), or None after appending its
    problems. Scale values are part of a projection's validity: they are read and checked here
    (small tensors), before any weight is stacked."""
    if w not in ckpt:
        problems.append(f"missing {w}")
        return None
    info = ckpt.info(w)
    family = [f for f in _TABLE if info.dtype in f.weight_dtypes]
    if not family:
        kinds = dict.fromkeys("/".join(f.weight_dtypes) + (" packed e2m1" if f.k_pack == 2 else "")
                              for f in _TABLE)
        problems.append(f"{w}: dtype {info.dtype} is not an accepted expert weight dtype "
                        f"({_or(list(kinds), ',')})")
        return None
    first = family[0]  # the family shares weight dtypes, packing and label
    want = first.weight_shape(n, k)
    if k % first.k_pack or info.shape != want:
        problems.append(f"{w}: expected shape {want}{first.weight_note}, got {tuple(info.shape)}")
        return None
    sname = scale_name(ckpt, w)
    if first.block is None:
        if sname:
            problems.append(f"{sname}: unexpected scale for {info.dtype} weight {w}")
            return None
        return first.name, ProjPlan(w, None)
    if sname is None:
        scale_names = " or ".join(w[: -len(".weight")] + s for s in SCALE_SUFFIXES)
        problems.append(f"missing {scale_names} for {first.label} weight {w}")
        return None
    sinfo = ckpt.info(sname)
    f = _match_scale(family, w, sname, sinfo.shape, n, k, problems)
    if f is None:
        return None
    if sinfo.dtype not in f.scale_dtypes:
        if len(family) == 1:
            problems.append(f"{sname}: expected dtype {_or(f.scale_dtypes)} ({f.label} scales), "
                            f"got {sinfo.dtype}")
        else:
            problems.append(f"{sname}: expected dtype in {f.scale_dtypes} for format {f.name}, "
                            f"got {sinfo.dtype}")
        return None
    if scale_value_problem(ckpt, sname, f.pow2_scales, problems):
        return None
    return f.name, ProjPlan(w, sname)


__all__ = ["CHECKPOINT_FORMATS", "FORMATS", "RECIPE_SOURCES", "CheckpointFormat", "ProjPlan", "classify",
           "scale_kind", "scale_name", "scale_to_f32", "scale_value_problem"]
