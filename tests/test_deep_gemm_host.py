"""DeepGEMM host side without a GPU: tile heuristics, code generation, launch geometry (SM90 and
SM100), FFI attribute encoding, argument checks, nvcc compilation of sm_90a / sm_100a
instantiations with the disk cache (second process compiles nothing; concurrent processes compile
once), and the FFI launcher build."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from custom_calls.deep_gemm import (families, family as FAM, ops, sm90_bf16 as BF16, sm90_fp8_1d2d as FP8,
                                    sm90_gemm as G, sm90_prenorm as PN, sm100_1d1d as B)
from custom_calls.native import launch, launch_plan as LP, toolchain
from custom_calls.settings import KernelSettings
from layouts import ceil_div

REPO = Path(__file__).resolve().parents[1]


def _has_toolchain() -> bool:
    try:
        toolchain.deep_gemm_include_dir()
        toolchain.find_nvcc()
        launch.find_cxx()  # the launcher library is built with g++
        return True
    except toolchain.ToolchainError:
        return False


needs_nvcc = pytest.mark.skipif(not _has_toolchain(), reason="needs nvcc >= 12.9, g++ and sgl-deep-gemm")


def _p(recipe, kind, m, n, k, g, em=None, cd="bf16"):
    """The problem of an SM90 GEMM in ``recipe`` (expected_m: masked only)."""
    return families.gemm_problem(kind, m, n, k, g, recipe, 90, em, cd)


# --- heuristics -----------------------------------------------------------------------------

def test_sm90_fp8_contig_reproduces_known_tile():
    c = G.sm90_gemm_config(_p("fp8_block", "contig", 32 * 1024, 4096, 7168, 32), 132)
    assert (c.block_m, c.block_n, c.block_k, c.num_stages, c.smem_bytes) == (128, 192, 128, 4, 215744)
    assert (c.cluster_m, c.cluster_n, c.num_threads, c.swizzle_cd) == (2, 1, 384, 128)
    assert not c.multicast_on_a and c.grid == 132


def test_sm90_bf16_contig_and_fp8_masked_tiles():
    b = G.sm90_gemm_config(_p("bf16", "contig", 32 * 1024, 4096, 7168, 32), 132)
    assert (b.block_m, b.block_n, b.block_k, b.num_stages, b.smem_bytes) == (128, 256, 64, 3, 213248)
    m = G.sm90_gemm_config(_p("fp8_block", "masked", 256, 4096, 7168, 32, em=32), 132)
    assert (m.block_m, m.block_n, m.num_stages, m.smem_bytes, m.num_threads) == (64, 128, 8, 215520, 256)


@pytest.mark.parametrize("recipe", ["fp8_block", "bf16"])
@pytest.mark.parametrize("kind", ["normal", "contig", "masked"])
def test_sm90_configs_are_legal(recipe, kind):
    rng = np.random.default_rng(0)
    for _ in range(40):
        m = int(rng.integers(1, 40)) * 128
        n = int(rng.integers(1, 80)) * 64
        k = int(rng.integers(1, 60)) * 128
        g = int(rng.integers(1, 40))
        em = int(rng.integers(1, m + 1))
        c = G.sm90_gemm_config(_p(recipe, kind, m, n, k, g, em=em if kind == "masked" else None), 132)
        assert c.smem_bytes <= FAM.SM90_SMEM_CAPACITY
        assert c.num_stages >= 3 and c.grid % c.cluster == 0
        assert c.block_k * c.family.sm90.ab_bytes == 128 and c.family.block_k == c.block_k
        if kind == "contig":
            assert c.block_m == FAM.CONTIG_ALIGNMENT
        if kind == "masked":
            assert ceil_div(n, c.block_n) % c.cluster == 0
        assert not (c.block_m > 128 and c.block_n > 128)
        assert c.num_math_threads == (128 if c.block_m <= 64 else 256)


def test_heuristic_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_sms"):
        G.sm90_gemm_config(_p("bf16", "normal", 128, 128, 128, 1), 131)
    with pytest.raises(ValueError, match="not tiled by the SM90 rules"):
        G.sm90_gemm_config(families.gemm_problem("contig", 128, 128, 128, 1, "mxfp8", 100), 148)
    with pytest.raises(ValueError, match=r"cd_dtype: family 'fp8_1d2d' writes \('bf16',\)"):
        _p("fp8_block", "normal", 128, 128, 128, 1, cd="f32")
    with pytest.raises(ValueError, match="n <= 32"):
        PN.sm90_prenorm_config(40, 256)
    with pytest.raises(ValueError, match="multiple of 64"):
        PN.sm90_prenorm_config(24, 100)


def test_prenorm_config():
    c = PN.sm90_prenorm_config(24, 7168)
    assert (c.block_n, c.swizzle_cd, c.smem_bytes) == (32, 128, FAM.SM90_SMEM_CAPACITY)
    assert c.swizzle_cd // 4 == c.block_n  # the kernel asserts this
    used = c.num_stages * (64 * 64 * 2 + c.block_n * 64 * 4) + 64 * c.swizzle_cd + 16 * c.num_stages
    assert used <= FAM.SM90_SMEM_CAPACITY and c.num_stages <= 12
    assert c.grid(129) == 3 and PN.sm90_prenorm_config(16, 256, 2).grid(64) == 2


# --- the family table -----------------------------------------------------------------------

def test_every_gemm_format_has_at_most_one_family():
    from layouts import RECIPE_NAMES, SUPPORTED_ARCHS, gemm_format

    served = {}
    for recipe in RECIPE_NAMES:
        for arch in SUPPORTED_ARCHS:
            try:
                fmt = gemm_format(recipe, arch)
            except ValueError:  # converted at load time on this arch, or not run there
                continue
            assert len([f for f in families.FAMILIES if f.serves(fmt)]) <= 1, fmt
            fam = families.family_for(fmt)
            served[(recipe, arch)] = fam.name if fam else None
    assert served == {("bf16", 90): "bf16", ("bf16", 100): None, ("fp8_block", 90): "fp8_1d2d",
                      ("fp8_block", 100): "sm100_1d1d", ("mxfp8", 100): "sm100_1d1d", ("mxfp4", 100): "sm100_1d1d",
                      ("mxfp4", 90): None}  # W4A8: the Triton backend's kernel
    assert len({f.name for f in families.FAMILIES}) == len(families.FAMILIES)
    assert all(set(f.archs) <= set(SUPPORTED_ARCHS) for f in families.FAMILIES)
    with pytest.raises(ValueError, match="has no DeepGEMM kernel wired here"):
        families.gemm_problem("contig", 128, 128, 128, 1, "bf16", 100)
    with pytest.raises(ValueError, match="family 'sm100_1d1d' has no dense kernel"):
        families.gemm_problem("normal", 128, 128, 128, 1, "fp8_block", 100)


def test_a_family_must_be_on_a_known_arch():
    with pytest.raises(ValueError, match=r"arch: expected one of \(90, 100\), got 80"):
        FAM.KernelFamily("x", "x", (80,), ("bf16",), 64, ("bf16",), False, None, None, None, None)


def test_nvcc_targets_follow_the_archs():
    from custom_calls.native import compiler
    from layouts import SUPPORTED_ARCHS

    assert [compiler.nvcc_arch(a) for a in SUPPORTED_ARCHS] == ["sm_90a", "sm_100a"]
    with pytest.raises(ValueError, match="arch"):
        compiler.nvcc_arch(80)


def test_no_library_code_branches_on_a_family_name():
    """Which family serves a call is decided once, from the GEMM format (`families.family_for`);
    nothing compares a family's name ("bf16" is left out: it also names a recipe and a dtype)."""
    import ast

    names = {f.name for f in families.FAMILIES} - {"bf16"}
    hits = []
    for pkg in ("layouts", "custom_calls", "moe_jax"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare) and any(
                        isinstance(x, ast.Constant) and x.value in names for x in (node.left, *node.comparators)):
                    hits.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not hits, hits


# --- code generation ------------------------------------------------------------------------

def _template_args(src: str) -> list[str]:
    body = src[src.index("<", src.index("&")) + 1: src.rindex(">")]
    return [a.strip() for a in body.split(",")]


def test_codegen_parameter_lists_match_the_headers():
    c = G.sm90_gemm_config(_p("fp8_block", "contig", 4096, 4096, 7168, 8), 132)
    a = _template_args(c.family.source(c, 4096, 7168))
    assert len(a) == 20 and a[-1] == "128" and a[-2] == "cutlass::bfloat16_t"
    assert a[1:4] == ["0", "4096", "7168"] and "GemmType::MGroupedContiguous" in a
    b = G.sm90_gemm_config(_p("bf16", "normal", 100, 512, 256, 1, cd="f32"), 132)
    a = _template_args(b.family.source(b, 512, 256))
    assert len(a) == 21 and a[-1] == "float" and a[-2] == "false" and "GemmType::Normal" in a
    p = _template_args(PN.sm90_prenorm_source(PN.sm90_prenorm_config(24, 512)))
    assert len(p) == 10 and p[:2] == ["24", "512"]
    for recipe, b_type in (("fp8_block", "cutlass::float_e4m3_t"), ("mxfp8", "cutlass::float_e4m3_t"),
                           ("mxfp4", "cutlass::detail::float_e2m1_unpacksmem_t")):
        s = B.sm100_mgrouped_config(recipe, "masked", 4096, 7168, 8, 148)
        a = _template_args(B.source(s, 4096, 7168))
        assert len(a) == 31 and a[26] == "cutlass::float_e4m3_t" and a[27] == b_type and a[29] == "epilogue::operators::Identity"
        assert a[2:5] == [str(s.gran_k_a), str(s.gran_k_b), str(s.gran_k_a)]
        assert "GemmType::MGroupedMasked" in a


def test_codegen_instantiates_exactly_one_kernel():
    c = G.sm90_gemm_config(_p("bf16", "masked", 256, 512, 512, 4, em=10), 132)
    src = c.family.source(c, 512, 512)
    assert src.count("#include") == 1 and src.count("reinterpret_cast<void*>(&") == 1


# --- launch plans -----------------------------------------------------------------------------

def _maps(plan):
    return {i: t for i, t in enumerate(plan.tmaps)}


def test_sm90_fp8_plans():
    c = G.sm90_gemm_config(_p("fp8_block", "masked", 256, 4096, 7168, 32, em=32), 132)
    p = FP8.plan(c, "/x.cubin", m=256, n=4096, k=7168)
    p.check()
    a, b, d, sfa = p.tmaps
    assert a.dims == (7168, 32 * 256) and a.box == (128, c.block_m) and a.swizzle == 128
    assert b.dims == (7168, 32 * 4096) and b.box == (128, c.block_n)
    assert d.operand == 5 and d.dims == (4096, 32 * 256) and d.dtype == LP.TMA_BFLOAT16
    assert sfa.dims == (256, 56 * 32) and sfa.strides == (256 * 4,) and sfa.box == (c.block_m, 1)
    assert [x.kind for x in p.args] == [LP.ARG_PTR, LP.ARG_PTR] + [LP.ARG_U32] * 3 + [LP.ARG_TMAP] * 4
    assert p.args[2].value == 256 and p.grid == 132 and p.smem == c.smem_bytes
    cc = G.sm90_gemm_config(_p("fp8_block", "contig", 1000 // 128 * 128 + 128, 512, 256, 3), 132)
    q = FP8.plan(cc, "/x", m=1024, n=512, k=256)
    assert q.tmaps[0].dims == (256, 1024) and q.tmaps[1].dims == (256, 3 * 512)
    assert q.tmaps[3].dims == (1024, 2)  # contiguous: no group factor on the scales


def test_dense_plan_pads_scale_rows_to_four():
    c = G.sm90_gemm_config(_p("fp8_block", "normal", 203, 448, 768, 1), 132)
    p = FP8.plan(c, "/x", m=203, n=448, k=768)
    assert p.args[1].kind == LP.ARG_NULL and p.tmaps[3].dims == (204, 6) and p.tmaps[3].strides == (816,)
    assert p.tmaps[2].operand == 4


def test_bf16_f32_output_plan_is_unswizzled():
    c = G.sm90_gemm_config(_p("bf16", "normal", 77, 320, 448, 1, cd="f32"), 132)
    p = BF16.plan(c, "/x", m=77, n=320, k=448)
    d = p.tmaps[2]
    assert d.dtype == LP.TMA_FLOAT32 and d.swizzle == 0 and d.box == (c.block_n, c.block_m)
    assert d.strides == (320 * 4,)


@pytest.mark.parametrize("recipe", ["fp8_block", "mxfp8", "mxfp4"])
@pytest.mark.parametrize("kind", ["contig", "masked"])
def test_sm100_launch_geometry(recipe, kind):
    g, n, k, rows, sms = 8, 4096, 7168, 512, 148
    c = B.sm100_mgrouped_config(recipe, kind, n, k, g, sms)
    p = B.plan(c, "/x", m=rows, n=n, k=k)
    p.check()
    assert (p.grid, p.block, p.cluster) == (148, 256, 2)
    assert p.smem == c.smem_bytes <= FAM.SM100_SMEM_CAPACITY and c.num_stages == 8
    a, b, sfa, sfb, cd = p.tmaps
    rows_a = g * rows if kind == "masked" else rows
    assert a.dtype == LP.TMA_UINT8 and a.dims == (k, rows_a) and a.box == (128, 64) and a.swizzle == 128
    if recipe == "mxfp4":
        assert b.dtype == LP.TMA_16U4_ALIGN16B and b.strides == (k // 2,)
    else:
        assert b.dtype == LP.TMA_UINT8 and b.strides == (k,)
    assert b.dims == (k, g * n) and b.box == (128, 128)
    gka, gkb, _ = B.sm100_operands(recipe)
    assert sfa.dtype == LP.TMA_INT32 and sfa.box == (128, 1) and sfa.strides == (rows * 4,)
    assert sfa.dims == (rows, ceil_div(k, 4 * gka) * (g if kind == "masked" else 1))
    assert sfb.dims == (n, ceil_div(k, 4 * gkb) * g) and sfb.box == (128, 1)
    assert cd.operand == 5 and cd.dims == (n, rows_a) and cd.box == (64, 16) and cd.swizzle == 128
    ep = p.args[4]
    assert ep.kind == LP.ARG_BYTES and len(ep.data) == 48
    assert np.frombuffer(ep.data[20:24], np.float32)[0] == 1.0  # alpha


def test_sm100_odd_n_blocks_disable_cluster():
    c = B.sm100_mgrouped_config("fp8_block", "contig", 128 * 3, 1024, 4, 148)
    assert c.cluster == 1 and c.load_block_m == 128


def test_plan_checks_reject_illegal_descriptors():
    bad = LP.TensorMap(0, LP.TMA_UINT8, (100, 10), (100,), (128, 8), 128)  # stride not 16-aligned
    with pytest.raises(ValueError, match="strides"):
        bad.check()
    with pytest.raises(ValueError, match="box"):
        LP.TensorMap(0, LP.TMA_UINT8, (128, 10), (128,), (128, 300), 128).check()
    with pytest.raises(ValueError, match="exceeds"):
        LP.TensorMap(0, LP.TMA_BFLOAT16, (128, 10), (256,), (128, 8), 128).check()
    with pytest.raises(ValueError, match="cluster"):
        LP.LaunchPlan("k", "/x", 131, 256, 2, 0, (), ()).check()
    with pytest.raises(ValueError, match="cluster must be 1 or 2, got 0"):
        LP.LaunchPlan("k", "/x", 132, 256, 0, 0, (), ()).check()
    with pytest.raises(ValueError, match="not a multiple of 16 B"):  # 6 fp32 scales = 24 B
        LP.TensorMap(2, LP.TMA_FLOAT32, (8, 4), (32,), (6, 1), 0).check()
    with pytest.raises(ValueError, match="dtype 99"):
        LP.TensorMap(0, 99, (128, 10), (128,), (128, 8), 0).check()


def test_ffi_attribute_encoding():
    c = B.sm100_mgrouped_config("mxfp4", "contig", 512, 1024, 2, 148)
    attrs = LP.sequence_attributes((B.plan(c, "/x.cubin", m=256, n=512, k=1024),))
    assert attrs["cubin"] == "/x.cubin"
    # grid x, block, cluster, smem, cooperative, programmatic, grid y, grid z
    assert attrs["launch"].tolist() == [148, 256, 2, c.smem_bytes, 0, 0, 1, 1]
    assert attrs["counts"].tolist() == [10, 5]  # arguments, tensor maps
    args = attrs["args"].reshape(-1, 3)
    assert args.shape[0] == 10 and args[4].tolist() == [LP.ARG_BYTES, 0, 48]
    assert attrs["blob"].tobytes()[:48] == B.SM100_EPILOGUE_ARGS
    tm = attrs["tmaps"].reshape(-1, LP.TMAP_WORDS)
    assert tm.shape[0] == 5
    row = tm[1]  # B: operand, offset, dtype, rank, dims[5], strides[4], box[5], swizzle enum
    assert row[:4].tolist() == [1, 0, LP.TMA_16U4_ALIGN16B, 2]
    assert row[4:6].tolist() == [1024, 2 * 512] and row[9] == 512 and row[13:15].tolist() == [128, 128]
    assert row[18] == 3  # CU_TENSOR_MAP_SWIZZLE_128B
    assert all(a.dtype == np.int64 for k, a in attrs.items() if k != "cubin")


def test_launch_sequence_encoding_and_remap():
    """Several plans in one call: per-kernel launch words and counts in order, arguments and maps
    concatenated (a map argument indexes its own plan's maps), by-value arguments at their offset in
    one blob, and each plan's operands placed by `remap`."""
    c = B.sm100_mgrouped_config("mxfp4", "contig", 512, 1024, 2, 148)
    first = B.plan(c, "/a.cubin", m=256, n=512, k=1024)
    second = LP.LaunchPlan("k2", "/b.cubin", 7, 64, 1, 0,
                           (LP.KernelArg(LP.ARG_PTR, 1, offset=32), LP.KernelArg(LP.ARG_BYTES, data=b"abc"),
                            LP.KernelArg(LP.ARG_TMAP, 0), LP.NULL),
                           (LP.TensorMap(0, LP.TMA_UINT8, (128, 8), (128,), (128, 8), 0),),
                           programmatic=True, grid_yz=(3, 2)).remap((6, 4))
    assert [a.value for a in second.args[:1]] == [4] and second.tmaps[0].operand == 6
    attrs = LP.sequence_attributes((first, second))
    assert attrs["cubin"].split("\n") == ["/a.cubin", "/b.cubin"]
    assert attrs["launch"].reshape(2, 8)[1].tolist() == [7, 64, 1, 0, 0, 1, 3, 2]
    assert attrs["counts"].tolist() == [10, 5, 4, 1]
    args = attrs["args"].reshape(-1, 3)
    assert args.shape[0] == 14
    assert args[10].tolist() == [LP.ARG_PTR, 4, 32]
    assert args[11].tolist() == [LP.ARG_BYTES, 48, 3]  # after the first plan's 48-byte struct
    assert args[12].tolist() == [LP.ARG_TMAP, 0, 0]
    assert attrs["blob"].tobytes()[48:51] == b"abc"
    assert attrs["tmaps"].reshape(-1, LP.TMAP_WORDS)[5, 0] == 6
    with pytest.raises(ValueError, match="operand 2 has no place"):
        LP.LaunchPlan("k", "/x", 1, 32, 1, 0, (LP.KernelArg(LP.ARG_PTR, 2),), ()).remap((0, 1))
    with pytest.raises(ValueError, match="grid_yz"):
        LP.LaunchPlan("k", "/x", 1, 32, 1, 0, (), (), grid_yz=(0, 1)).check()
    with pytest.raises(ValueError, match="newline"):
        LP.sequence_attributes((LP.LaunchPlan("k", "/x\ny", 1, 32, 1, 0, (), ()),))


def _nbytes(*shapes_dtypes):
    """Operand sizes in bytes, written from the ops' documented operand shapes (not from the plans)."""
    return tuple(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in shapes_dtypes)


def _plans_with_operand_bytes():
    """(plan, operand bytes) for every plan builder, at odd sizes (M % 4 != 0 where allowed)."""
    f8, f32, i32, bf, i8 = jnp.float8_e4m3fn, np.float32, np.int32, jnp.bfloat16, np.int8
    g, n, k, m_pad, m_cap, m = 3, 320, 640, 256, 384, 203
    out = []
    c = G.sm90_gemm_config(_p("fp8_block", "masked", m_pad, n, k, g, em=40), 132)
    out.append((FP8.plan(c, "/x", m=m_pad, n=n, k=k),
                _nbytes(((g, m_pad, k), f8), ((g, n, k), f8), ((g, k // 128, m_pad), f32),
                        ((g, 3, k // 128), f32), ((g,), i32), ((g, m_pad, n), bf))))
    c = G.sm90_gemm_config(_p("fp8_block", "contig", m_cap, n, k, g), 132)
    out.append((FP8.plan(c, "/x", m=m_cap, n=n, k=k),
                _nbytes(((m_cap, k), f8), ((g, n, k), f8), ((k // 128, m_cap), f32),
                        ((g, 3, k // 128), f32), ((m_cap,), i32), ((m_cap, n), bf))))
    c = G.sm90_gemm_config(_p("fp8_block", "normal", m, n, k, 1), 132)
    out.append((FP8.plan(c, "/x", m=m, n=n, k=k),
                _nbytes(((m, k), f8), ((n, k), f8), ((k // 128, 204), f32), ((3, k // 128), f32), ((m, n), bf))))
    for kind, rows, lhs, d in (("masked", m_pad, (g, m_pad, k), (g, m_pad, n)),
                               ("contig", m_cap, (m_cap, k), (m_cap, n))):
        c = G.sm90_gemm_config(_p("bf16", kind, rows, n, k, g), 132)
        out.append((BF16.plan(c, "/x", m=rows, n=n, k=k),
                    _nbytes((lhs, bf), ((g, n, k), bf), ((lhs[0],), i32), (d, bf))))
    c = G.sm90_gemm_config(_p("bf16", "normal", m, n, k, 1, cd="f32"), 132)
    out.append((BF16.plan(c, "/x", m=m, n=n, k=k),
                _nbytes(((m, k), bf), ((n, k), bf), ((m, n), f32))))
    for splits in (1, 3):
        c = PN.sm90_prenorm_config(24, k, splits)
        out.append((PN.sm90_prenorm_plan(c, "/x", m=m),
                    _nbytes(((m, k), bf), ((24, k), f32), ((splits, m, 24), f32), ((splits, m), f32))))
    for recipe, gka, gkb in (("fp8_block", 128, 128), ("mxfp8", 32, 32), ("mxfp4", 128, 32)):
        rhs = ((g, n, k // 2), i8) if recipe == "mxfp4" else ((g, n, k), f8)
        for kind, rows, lhs, d, sa in (("masked", m_pad, (g, m_pad, k), (g, m_pad, n), (g,)),
                                       ("contig", m_cap, (m_cap, k), (m_cap, n), ())):
            c = B.sm100_mgrouped_config(recipe, kind, n, k, g, 148)
            out.append((B.plan(c, "/x", m=rows, n=n, k=k),
                        _nbytes((lhs, f8), rhs, ((*sa, -(-k // (4 * gka)), rows), i32),
                                ((g, -(-k // (4 * gkb)), n), i32), ((lhs[0],), i32), (d, bf))))
    return out


def test_every_tensor_map_fits_its_operand_exactly():
    for plan, nbytes in _plans_with_operand_bytes():
        plan.check_operands(nbytes)
        for t in plan.tmaps:  # the maps cover the whole operand: no row or scale column is left out
            assert t.extent_bytes() == nbytes[t.operand], (plan.kernel, t)


def test_a_tensor_map_larger_than_its_operand_is_refused():
    for plan, nbytes in _plans_with_operand_bytes():
        for t in plan.tmaps:
            short = list(nbytes)
            short[t.operand] -= 1
            with pytest.raises(ValueError, match=rf"spans {t.extent_bytes()} bytes past offset {t.offset}, "
                                                 rf"operand {t.operand} holds"):
                plan.check_operands(tuple(short))
    plan, nbytes = _plans_with_operand_bytes()[0]
    with pytest.raises(ValueError, match="refers to operand 5 of 5"):
        plan.check_operands(nbytes[:5])


def test_launch_refuses_a_plan_larger_than_its_buffers_at_trace_time():
    from custom_calls.native import launch

    c = G.sm90_gemm_config(_p("bf16", "masked", 256, 256, 512, 2, em=8), 132)
    plan = BF16.plan(c, "/x", m=256, n=256, k=512)
    with pytest.raises(ValueError, match="tensor map 0 .* operand 0 holds"):  # lhs has 128 rows per group, not 256
        launch.launch(plan, [jnp.zeros((2, 128, 512), jnp.bfloat16), jnp.zeros((2, 256, 512), jnp.bfloat16),
                             jnp.zeros((2,), jnp.int32)], [jax.ShapeDtypeStruct((2, 256, 256), jnp.bfloat16)])


@pytest.fixture
def captured_launch(monkeypatch):
    """Runs the ops up to the launch on any machine: environment accepted, 132 SMs, and _run
    replaced by a recorder returning NaN outputs."""
    calls = []

    def fake_run(kern, arch, inputs, outputs, settings):
        calls.append((kern, [np.asarray(x) for x in inputs]))
        return [jnp.full(o.shape, jnp.nan, o.dtype) for o in outputs]

    monkeypatch.setattr(ops, "_environment_reason", lambda arch, settings: None)
    monkeypatch.setattr(ops, "_num_sms", lambda settings: 132)
    monkeypatch.setattr(ops, "_run", fake_run)
    return calls


def test_contig_expert_ids_reach_the_kernel_canonical(captured_launch):
    # The FP8 kernel offsets its raw B-scale pointer by a block's first id (an id >= G would read
    # past rhs_scale) and takes the whole block's expert from it: every block that is not one id in
    # [0, G) followed by -1 padding reaches the kernel as all -1 (custom_calls/contracts.py).
    g, m_cap, n, k = 3, 768, 128, 256
    rng = np.random.default_rng(0)
    ids = np.full(m_cap, -1, np.int32)
    ids[0:128] = 1  # full block
    ids[128:140] = 2  # expert then padding
    ids[256:300] = 0
    ids[290] = 2  # two experts in a block
    ids[384:400] = g  # no such expert
    ids[512:520] = -7  # padding spelled < -1
    ids[640:650] = rng.integers(-4, g + 4, 10)
    ids[640] = 1 << 30
    lhs = jnp.asarray(rng.standard_normal((m_cap, k)), jnp.float8_e4m3fn)
    rhs = jnp.asarray(rng.standard_normal((g, n, k)), jnp.float8_e4m3fn)
    ops.m_grouped_gemm_contig(lhs, rhs, jnp.asarray(ids), lhs_scale=jnp.ones((k // 128, m_cap), jnp.float32),
                              rhs_scale=jnp.ones((g, 1, k // 128), jnp.float32), recipe="fp8_block", arch=90)
    (_, inputs), = captured_launch
    want = np.full(m_cap, -1, np.int32)
    want[0:128], want[128:140] = 1, 2
    assert np.array_equal(inputs[4], want)


def test_masked_counts_reach_the_kernel_clamped_to_m_pad(captured_launch):
    g, m_pad, n, k = 4, 128, 128, 128
    counts = np.array([-5, 0, 77, 129], np.int32)
    ops.m_grouped_gemm_masked(jnp.ones((g, m_pad, k), jnp.bfloat16), jnp.ones((g, n, k), jnp.bfloat16),
                              jnp.asarray(counts), expected_m=16, recipe="bf16", arch=90)
    (_, inputs), = captured_launch
    assert inputs[2].tolist() == [0, 0, 77, 128]


@pytest.mark.parametrize("expected_m", [0, 5, 100, 4096])
def test_warmup_compiles_the_kernel_the_masked_op_launches(captured_launch, expected_m):
    from custom_calls.deep_gemm.warmup import GemmShape, kernel_for

    g, m_pad, n, k = 8, 512, 1024, 512
    ops.m_grouped_gemm_masked(jnp.ones((g, m_pad, k), jnp.bfloat16), jnp.ones((g, n, k), jnp.bfloat16),
                              jnp.full((g,), 3, jnp.int32), expected_m=expected_m, recipe="bf16", arch=90)
    ((name, src, _), _), = captured_launch
    assert kernel_for(GemmShape("masked", m_pad, n, k, g, "bf16", expected_m=expected_m), 90, 132) == (name, src)


# --- argument checks (trace time, no GPU needed) ------------------------------------------------

def _fp8(shape):
    return jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn)


def _f32(shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _i32(shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def _bf(shape):
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16)


def _contig(lhs, rhs, m, ls=None, rs=None, **kw):
    kw.setdefault("recipe", "fp8_block")
    kw.setdefault("arch", 90)
    f = lambda *a: ops.m_grouped_gemm_contig(*a[:3], lhs_scale=a[3], rhs_scale=a[4], **kw)  # noqa: E731
    return jax.eval_shape(f, lhs, rhs, m, ls, rs)


def _good_contig(m=256, n=256, k=512, g=2):
    return _fp8((m, k)), _fp8((g, n, k)), _i32((m,)), _f32((k // 128, m)), _f32((g, n // 128, k // 128))


def test_contig_m_cap_not_multiple_of_128():
    a, b, m, ls, rs = _good_contig()
    with pytest.raises(ValueError, match="alignment: expected a positive int dividing M_cap=200"):
        _contig(_fp8((200, 512)), b, _i32((200,)), _f32((4, 200)), rs)


def test_contig_k_not_multiple_of_block():
    with pytest.raises(ValueError, match=r"K must be a positive multiple of 128.*got 320"):
        _contig(_fp8((256, 320)), _fp8((2, 256, 320)), _i32((256,)), _f32((3, 256)), _f32((2, 2, 3)))


def test_contig_n_not_multiple_of_64():
    with pytest.raises(ValueError, match="N must be a positive multiple of 64, got 200"):
        _contig(_fp8((256, 512)), _fp8((2, 200, 512)), _i32((256,)), _f32((4, 256)), _f32((2, 2, 4)))


def test_contig_wrong_scale_layout():
    a, b, m, ls, rs = _good_contig()
    with pytest.raises(ValueError, match=r"lhs_scale: expected shape \(4, 256\) .*got \(256, 4\)"):
        _contig(a, b, m, _f32((256, 4)), rs)  # K-major instead of the MN-major image
    with pytest.raises(ValueError, match="rhs_scale: expected shape"):
        _contig(a, b, m, ls, _f32((2, 4, 2)))


def test_contig_wrong_scale_dtype():
    a, b, m, ls, rs = _good_contig()
    with pytest.raises(TypeError, match="lhs_scale: expected dtype float32, got int32"):
        _contig(a, b, m, _i32(ls.shape), rs)


def test_contig_wrong_operand_dtype():
    a, b, m, ls, rs = _good_contig()
    with pytest.raises(TypeError, match="rhs: expected dtype"):
        _contig(a, _bf(b.shape), m, ls, rs)
    with pytest.raises(TypeError, match="m_indices"):
        _contig(a, b, jax.ShapeDtypeStruct((256,), jnp.int64) if jax.config.x64_enabled else _f32((256,)), ls, rs)


def test_bf16_recipe_rejects_scales():
    a, b, m, ls, rs = _good_contig()
    with pytest.raises(ValueError, match="takes no scales"):
        _contig(_bf(a.shape), _bf(b.shape), m, ls, rs, recipe="bf16")


def test_mxfp8_on_arch_90_is_refused():
    with pytest.raises(ValueError, match=r"recipe 'mxfp8': GEMM formats exist for arch \(100,\), got arch 90"):
        _contig(_fp8((256, 512)), _fp8((2, 256, 512)), _i32((256,)), _i32((4, 256)), _i32((2, 4, 256)),
                recipe="mxfp8")


def test_unknown_arch_and_alignment():
    a, b, m, ls, rs = _good_contig()
    with pytest.raises(ValueError, match=r"arch: expected one of \(90, 100\), got 80"):
        _contig(a, b, m, ls, rs, arch=80)
    with pytest.raises(ValueError, match=r"alignment must be 128.*got 64"):
        _contig(a, b, m, ls, rs, alignment=64)


def test_other_backend_name_is_refused():
    a, b, m, ls, rs = _good_contig()
    with pytest.raises(ValueError, match="backend: this module implements 'deep_gemm'"):
        _contig(a, b, m, ls, rs, backend="reference")


def test_masked_m_pad_not_multiple_of_128():
    with pytest.raises(ValueError, match=r"m_pad \(axis 1\) must be a multiple of 128, got shape \(2, 100, 256\)"):
        jax.eval_shape(lambda a, b, mm: ops.m_grouped_gemm_masked(a, b, mm, expected_m=8, recipe="bf16", arch=90),
                       _bf((2, 100, 256)), _bf((2, 128, 256)), _i32((2,)))


def test_masked_bad_expected_m_and_groups():
    f = lambda em: lambda a, b, mm: ops.m_grouped_gemm_masked(a, b, mm, expected_m=em, recipe="bf16", arch=90)  # noqa
    with pytest.raises(ValueError, match="expected_m"):
        jax.eval_shape(f(-1), _bf((2, 128, 256)), _bf((2, 128, 256)), _i32((2,)))
    with pytest.raises(ValueError, match="expected 2 groups"):
        jax.eval_shape(f(4), _bf((2, 128, 256)), _bf((3, 128, 256)), _i32((2,)))
    with pytest.raises(ValueError, match="masked_m: expected shape"):
        jax.eval_shape(f(4), _bf((2, 128, 256)), _bf((2, 128, 256)), _i32((3,)))


def test_dense_and_prenorm_checks():
    with pytest.raises(ValueError, match=r"a_scale: expected shape \(2, 204\)"):
        jax.eval_shape(lambda a, b, s, t: ops.gemm_nt_fp8(a, b, a_scale=s, b_scale=t),
                       _fp8((203, 256)), _fp8((128, 256)), _f32((2, 203)), _f32((1, 2)))
    with pytest.raises(ValueError, match="n <= 32"):
        jax.eval_shape(lambda x, w: ops.tf32_prenorm_gemm(x, w), _bf((64, 256)), _f32((40, 256)))
    with pytest.raises(TypeError, match="fn: expected dtype"):
        jax.eval_shape(lambda x, w: ops.tf32_prenorm_gemm(x, w), _bf((64, 256)), _bf((24, 256)))


@pytest.mark.skipif(any(d.platform == "gpu" for d in jax.devices()), reason="CPU-only behaviour")
def test_valid_call_without_gpu_names_the_missing_device():
    with pytest.raises(ValueError, match="no CUDA device"):
        _contig(*_good_contig())
    ok, reason = ops.supports_m_grouped_gemm_contig(m_cap=256, n=256, k=512, num_groups=2,
                                                    recipe="fp8_block", arch=90)
    assert not ok and "no CUDA device" in reason


def test_missing_compiler_is_reported(monkeypatch):
    monkeypatch.setenv("MOE_JAX_NVCC", "/nonexistent/nvcc")
    ok, reason = ops.supports_m_grouped_gemm_contig(m_cap=256, n=256, k=512, num_groups=2,
                                                    recipe="fp8_block", arch=90)
    assert not ok and "MOE_JAX_NVCC=/nonexistent/nvcc" in reason
    with pytest.raises(ValueError, match="no CUDA compiler"):
        _contig(*_good_contig())


def test_import_is_lazy_and_registers():
    code = textwrap.dedent("""
        import sys, custom_calls
        assert "custom_calls.deep_gemm" not in sys.modules
        import custom_calls.deep_gemm
        gpu = [m for m in sys.modules if m.startswith(("cuda", "jax_triton", "triton", "torch"))]
        assert not gpu, gpu
        assert "custom_calls.triton" not in sys.modules  # the family imports the native launcher only
        assert "deep_gemm" in custom_calls.backends("m_grouped_gemm_contig")
        assert "deep_gemm" in custom_calls.backends("m_grouped_gemm_masked")
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


# --- compilation, disk cache, FFI launcher --------------------------------------------------------

_WARM = textwrap.dedent("""
    import json, sys
    from custom_calls.deep_gemm.warmup import GemmShape as S, warmup
    shapes = [S(**s) for s in json.loads(sys.argv[1])]
    res = warmup(shapes, arch=int(sys.argv[2]), num_sms=int(sys.argv[3]), progress=False)
    print(json.dumps([[c.name, c.compiled, round(c.seconds, 2), str(c.path)] for c in res]))
""")


def _warm_proc(shapes, arch, sms, cache):
    env = dict(os.environ, MOE_JAX_CACHE_DIR=str(cache))
    return subprocess.Popen([sys.executable, "-c", _WARM, json.dumps(shapes), str(arch), str(sms)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(p):
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
@needs_nvcc
def test_compile_sm90_and_sm100_kernels_cache_across_processes(tmp_path):
    sm90 = [dict(kind="contig", rows=512, n=256, k=256, num_groups=2),  # FP8 1D2D
            dict(kind="masked", rows=128, n=256, k=256, num_groups=2, recipe="bf16", expected_m=16)]
    sm100 = [dict(kind="contig", rows=512, n=256, k=512, num_groups=2, recipe=r) for r in ("fp8_block", "mxfp8")]
    sm100.append(dict(kind="masked", rows=128, n=256, k=512, num_groups=2, recipe="mxfp4", expected_m=16))
    # Two processes race for the same sm_90a kernels: each kernel is compiled exactly once.
    p1, p2 = _warm_proc(sm90, 90, 132, tmp_path), _warm_proc(sm90, 90, 132, tmp_path)
    r1, r2 = _result(p1), _result(p2)
    assert len(r1) == len(r2) == 2
    for name in {r[0] for r in r1}:
        flags = [r[1] for r in r1 + r2 if r[0] == name]
        assert sorted(flags) == [False, True], f"{name} compiled {flags.count(True)} times"
    r3 = _result(_warm_proc(sm100, 100, 148, tmp_path))
    assert len(r3) == 3 and all(r[1] for r in r3)
    # A later process finds everything in the cache.
    again = _result(_warm_proc(sm90, 90, 132, tmp_path)) + _result(_warm_proc(sm100, 100, 148, tmp_path))
    assert not any(r[1] for r in again)
    for name, _, _, path in r1 + r3:
        data = Path(path).read_bytes()
        assert data[:4] == b"\x7fELF" and len(data) > 10_000
        meta = json.loads((Path(path).parent / "meta.json").read_text())
        assert meta["arch"] in (90, 100)
    entries = list((tmp_path / "cubin").iterdir())
    assert len(entries) == 5 and not list((tmp_path / "tmp").iterdir())


@needs_nvcc
def test_cache_key_covers_source_arch_and_flags(monkeypatch):
    from custom_calls.native import compiler

    c = G.sm90_gemm_config(_p("bf16", "normal", 128, 256, 256, 1), 132)
    src = c.family.source(c, 256, 256)
    k = compiler.cache_key(src, 90)
    assert k != compiler.cache_key(src + " ", 90) and k != compiler.cache_key(src, 100)
    monkeypatch.setattr(compiler, "NVCC_FLAGS", compiler.NVCC_FLAGS + ("--use_fast_math",))
    assert k != compiler.cache_key(src, 90)


def test_nvcc_failure_is_reported(tmp_path, monkeypatch):
    from custom_calls.native import compiler

    if not _has_toolchain():
        pytest.skip("needs nvcc")
    monkeypatch.setenv("MOE_JAX_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="nvcc failed"):
        compiler.compile_cubin("broken", "this is not C++;\n", 90)
    assert not (tmp_path / "cubin").exists() or not list((tmp_path / "cubin").iterdir())


@pytest.mark.slow
@needs_nvcc
def test_ffi_launcher_builds_with_shared_libstdcxx(tmp_path, monkeypatch):
    from custom_calls.native import launch

    monkeypatch.setenv("MOE_JAX_CACHE_DIR", str(tmp_path))
    lib = launch.build_handler()
    assert lib.is_file() and launch.build_handler() == lib  # second call: cache hit
    handle = ctypes.CDLL(str(lib))
    assert handle.MoeJaxDeepGemmLaunch
    ldd = subprocess.run(["ldd", str(lib)], capture_output=True, text=True).stdout
    assert re.search(r"libstdc\+\+\.so\.6 => /", ldd), ldd
    assert "libcuda" not in ldd  # the driver is opened at run time


def test_bench_cli_has_gemm_subcommand(capsys):
    from moe_jax.bench.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["gemm", "--help"])
    assert e.value.code == 0 and "--markdown" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2  # a subcommand is required


def test_sm100_needs_opt_in_on_sm100_devices(monkeypatch):
    monkeypatch.setattr(ops, "detected_device", lambda: ("gpu", 100, 148))
    ok, reason = ops.supports_m_grouped_gemm_contig(m_cap=256, n=256, k=512, num_groups=2, recipe="mxfp4",
                                                    arch=100)
    assert not ok and "not been run on SM100 hardware" in reason and "allow_unverified_sm100=True" in reason
    assert "MOE_JAX_DEEP_GEMM_SM100=1" in reason
    assert ops.supports_m_grouped_gemm_contig(m_cap=256, n=256, k=512, num_groups=2, recipe="mxfp4", arch=100,
                                              settings=KernelSettings(allow_unverified_sm100=True)) == (True, "")
    monkeypatch.setenv("MOE_JAX_DEEP_GEMM_SM100", "1")  # the default of the setting
    assert ops.supports_m_grouped_gemm_contig(m_cap=256, n=256, k=512, num_groups=2, recipe="mxfp4",
                                              arch=100) == (True, "")
    ok, reason = ops.supports_m_grouped_gemm_contig(m_cap=256, n=256, k=512, num_groups=2, recipe="fp8_block",
                                                    arch=90)
    assert not ok and "compute capability 10.0" in reason


def test_sm90_device_refuses_arch_100_naming_capability(monkeypatch):
    monkeypatch.setattr(ops, "detected_device", lambda: ("gpu", 90, 132))
    ok, reason = ops.supports_m_grouped_gemm_masked(m_pad=128, n=256, k=512, num_groups=2, recipe="mxfp8",
                                                    arch=100, expected_m=8)
    assert not ok and "compute capability 9.0" in reason and "not been run on SM100" in reason
