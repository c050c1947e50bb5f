"""The checkpoint format table (moe_jax/checkpoint_formats.py): complete (every recipe the loader
accepts, every format it recognizes), consistent with `layouts` (block sizes, packing, value dtypes,
power-of-two rule taken from the recipes, never restated), and every (format, scale dtype) round
trips: written with the suites' writer, loaded in checkpoint form, equal to what was written."""

from __future__ import annotations

import ast
import pathlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from layouts import RECIPE_NAMES, get_recipe
from layouts.checks import ceil_div
from moe_jax import checkpoint
from moe_jax.checkpoint import load_moe_params
from moe_jax.checkpoint_formats import CHECKPOINT_FORMATS, FORMATS, RECIPE_SOURCES
from moe_jax.params import SHARED_FP8
from moe_jax.safetensors_reader import ST_DTYPES
from test_checkpoint import E, H, I, P, build, config, e8m0_bytes, np_deq_mxfp4, write_st

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODULES = ("moe_jax/checkpoint.py", "moe_jax/checkpoint_formats.py", "moe_jax/safetensors_reader.py")
ROUND_TRIPS = [(f.name, sd) for f in FORMATS.values() for sd in (f.scale_dtypes or (None,))]


def test_table_is_complete():
    assert CHECKPOINT_FORMATS == tuple(FORMATS) == ("bf16", "fp8_block", "fp8_per_tensor", "mxfp8", "mxfp4")
    assert set(RECIPE_SOURCES) == set(RECIPE_NAMES)
    assert RECIPE_SOURCES == {"bf16": ("bf16",), "fp8_block": ("fp8_block", "fp8_per_tensor"),
                              "mxfp8": ("mxfp8", "bf16"), "mxfp4": ("mxfp4",)}
    served = {name for names in RECIPE_SOURCES.values() for name in names}
    assert served == set(FORMATS)  # every format loads as some recipe, every source has an entry
    # the loader's public names are the table's
    assert checkpoint.CHECKPOINT_FORMATS is CHECKPOINT_FORMATS and checkpoint.RECIPE_SOURCES is RECIPE_SOURCES


@pytest.mark.parametrize("name", list(FORMATS))
def test_entry_takes_its_sizes_from_layouts(name):
    f = FORMATS[name]
    rec = get_recipe(f.recipe)
    assert f.block == rec.weight_block and f.k_pack == rec.weight_k_pack
    assert f.pow2_scales == rec.requires_ue8m0
    assert jnp.dtype(f.values_dtype) in rec.value_dtypes
    assert (f.block is None) == (f.scale_dtypes == ())
    assert set(f.weight_dtypes) | set(f.scale_dtypes) | {f.values} <= set(ST_DTYPES)
    assert f.recipes[0] == f.recipe and set(f.recipes) <= set(RECIPE_NAMES)
    assert len(set(f.recipes)) == len(f.recipes)
    if f.block is not None:
        n, k = 3 * f.block[0], 5 * f.block[1] * f.k_pack
        assert f.block_grid(n, k) == (ceil_div(n, rec.weight_block[0]), ceil_div(k, rec.weight_block[1]))
        assert f.scale_shapes(n, k) == (((), (1,)) if f.per_tensor else (f.block_grid(n, k),))
    assert (checkpoint.BLOCK,) * 2 == get_recipe("fp8_block").weight_block
    assert checkpoint.MX_GROUP == get_recipe("mxfp8").weight_block[1] == get_recipe("mxfp4").weight_block[1]


def test_formats_sharing_a_weight_dtype_agree_and_differ_in_scale_shape():
    families: dict[tuple, list] = {}
    for f in FORMATS.values():
        families.setdefault(f.weight_dtypes, []).append(f)
    assert all(not set(a).intersection(b) for a in families for b in families if a != b)
    n, k = 256, 512
    for fam in families.values():
        assert len({(f.k_pack, f.label, f.weight_note) for f in fam}) == 1
        shapes = [s for f in fam for s in f.scale_shapes(n, k)]
        assert len(shapes) == len(set(shapes))


@pytest.mark.parametrize("module", MODULES)
def test_no_restated_block_sizes(module):
    tree = ast.parse((ROOT / module).read_text())
    found = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Constant)
             and type(node.value) is int and node.value in (32, 128)]
    assert not found, f"{module}: block sizes restated at lines {found} (take them from layouts)"


def _encode_scale(s, dtype: str):
    """Float scale -> (array, safetensors dtype) for write_st; E8M0 rounds to a power of two."""
    if dtype in ("F8_E8M0", "U8"):
        return e8m0_bytes(2.0 ** np.round(np.log2(s))), dtype
    return np.asarray(s, np.float32).astype(ml_dtypes.bfloat16 if dtype == "BF16" else np.float32)


def _decode_scale(v) -> np.ndarray:
    """What write_st wrote, as f32 values (an E8M0 / U8 byte b is 2^(b-127))."""
    a, _ = v if isinstance(v, tuple) else (v, None)
    if np.asarray(a).dtype == np.uint8:
        return np.ldexp(np.float32(1), a.astype(np.int32) - 127).astype(np.float32)
    return np.asarray(a, np.float32)


def _written(fmt: str, scale_dtype: str | None) -> dict:
    kind = scale_dtype if scale_dtype in ("F8_E8M0", "U8", "F32") else "F32"
    t = build(fmt, seed=21, scale_kind=kind)[0]
    if scale_dtype is not None:
        t = {k: _encode_scale(_decode_scale(v), scale_dtype) if "scale" in k else v for k, v in t.items()}
    return t


def _tensors(t: dict, f, base: str, projs: tuple[str, ...]):
    """(values, f32 scale block grids or None) of format-`f` projections `projs` under `base`,
    stacked along N as written (a per-tensor scale broadcast over its pseudo blocks)."""
    vals, scales = [], []
    for proj in projs:
        w = t[f"{base}{proj}.weight"]
        vals.append(w)
        sname = next((f"{base}{proj}{s}" for s in (".weight_scale_inv", ".weight_scale")
                      if f"{base}{proj}{s}" in t), None)
        if sname is not None:
            bn, bk = get_recipe(f.recipe).weight_block
            grid = (ceil_div(w.shape[0], bn), ceil_div(w.shape[1] * f.k_pack, bk))
            scales.append(np.broadcast_to(_decode_scale(t[sname]), grid))
    return np.concatenate(vals), (np.concatenate(scales) if scales else None)


def _np_dequantize(values, scale, f) -> np.ndarray:
    """Float64 values of written (values (N, K / k_pack), f32 scale block grid or None)."""
    if scale is None:
        return values.astype(np.float64)
    if f.k_pack == 2:
        return np_deq_mxfp4(values, scale)
    n, k = values.shape
    bn, bk = get_recipe(f.recipe).weight_block
    s = np.repeat(np.repeat(scale.astype(np.float64), bn, 0), bk, 1)[:n, :k]
    return values.astype(np.float64) * s


@pytest.mark.parametrize(("name", "scale_dtype"), ROUND_TRIPS)
def test_round_trip(tmp_path, name, scale_dtype):
    f = FORMATS[name]
    t = _written(name, scale_dtype)
    write_st(tmp_path / "m.safetensors", t)
    p = load_moe_params(tmp_path / "m.safetensors", config(f.recipe), layer=3, prepare=False)
    assert np.asarray(p.w13).dtype == f.values_dtype and p.w13.shape == (E, 2 * I, H // f.k_pack)
    for e in range(E):
        for got, got_s, projs in ((p.w13[e], p.w13_scale, ("gate_proj", "up_proj")),
                                  (p.w2[e], p.w2_scale, ("down_proj",))):
            v, s = _tensors(t, f, f"{P}experts.{e}.", projs)
            want = v.astype(f.values_dtype)  # F32 weights are loaded as bf16; the rest as stored
            np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))
            if s is None:
                assert got_s is None
            else:
                np.testing.assert_array_equal(np.asarray(got_s[e]), s)
    v, s = _tensors(t, f, f"{P}shared_experts.", ("gate_proj", "up_proj"))
    if f.recipe == SHARED_FP8:  # kept FP8, as it ships
        np.testing.assert_array_equal(np.asarray(p.shared_w13).view(np.uint8), v.view(np.uint8))
        np.testing.assert_array_equal(np.asarray(p.shared_w13_scale), s)
    else:
        assert p.shared_w13_scale is None and p.shared_w13.dtype == jnp.bfloat16
        want = _np_dequantize(v, s, f).astype(np.float32).astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(np.asarray(p.shared_w13).view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize(("name", "recipe"), [(f.name, r) for f in FORMATS.values() for r in f.recipes[1:]])
def test_conversions_give_the_recipe_checkpoint_form(tmp_path, name, recipe):
    write_st(tmp_path / "m.safetensors", _written(name, None))
    rec = get_recipe(recipe)
    p = load_moe_params(tmp_path / "m.safetensors", config(recipe), layer=3, prepare=False)
    assert p.w13.dtype in rec.value_dtypes and p.w13.shape == (E, 2 * I, H // rec.weight_k_pack)
    assert p.w13_scale.shape == rec.checkpoint_scale_shape(E, 2 * I, H)
    assert p.w2_scale.shape == rec.checkpoint_scale_shape(E, H, I)
