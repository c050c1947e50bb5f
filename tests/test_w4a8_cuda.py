"""The CUDA W4A8 masked kernel on the CPU: a numpy model of its data movement (the weight fragments it
widens, the token bytes it stages in the wgmma's shared-memory layout and the MMA over both) against
the float64 model; its configs, launch plans and checks; and nvcc compiling it for sm_90a without
spills. The kernel itself runs in
tests/test_w4a8_cuda_gpu.py."""

from __future__ import annotations

import re
import subprocess

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from custom_calls.cuda import w4a8_gemm as cw
from layouts.scale_layout import from_mn_major_tma_aligned
from layouts.w4a8 import E4M3_TABLES, mxfp4_to_w4a8
from test_deep_gemm_host import needs_nvcc
from test_w4a8_gemm import _model, _operands


def _prmt(a: np.ndarray, b: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """PTX prmt.b32 (default mode, selector bit 3 clear): byte i of the result is byte sel[4i:4i+3] of b:a."""
    pool = np.stack([(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)], -1)
    out = np.zeros(np.broadcast(a, b, sel).shape, np.uint32)
    for i in range(4):
        pick = (sel >> (4 * i)) & 7
        byte = np.take_along_axis(pool, np.broadcast_to(pick, out.shape)[..., None].astype(np.int64), -1)[..., 0]
        out |= byte << (8 * i)
    return out


def _e4m3(byte_words: np.ndarray) -> np.ndarray:
    """(..., W) uint32 words of 4 e4m3 bytes -> (..., 4W) float64."""
    b = byte_words.astype("<u4").view(np.uint8)
    return b.view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _swizzle128(addr: np.ndarray) -> np.ndarray:
    """The 128-byte swizzle of shared-memory addresses (TMA writes it, the wgmma descriptor reads it): the
    16-byte chunk within each 128-byte row XOR the row's index within its 1024-byte atom."""
    return addr ^ (((addr >> 7) & 7) << 4)


def _kernel_model(a, sa, values, scales, masked_m, token_tiles):
    """What the kernel computes, following its data movement: per 128-column K block, TMA copies the
    block's token rows (stored in the W4A8 column order) into the ring slot with the 128-byte swizzle,
    and the wgmma reads k32 step s of token t through its descriptor (start + 32 s, rows of 128 bytes,
    SBO 1024) at the same swizzle; thread column c widens word 4c + s of each row (k32 step s) with its
    32-group's table into a0|a1 (k = 4c..4c+3: even columns) and a2|a3 (k = 16 + 4c..: odd). The MMA
    sums over the wgmma's k = 0..31 of each step. Rows >= masked_m are NaN."""
    g_count, m_pad, k = a.shape
    n = values.shape[1]
    kb_count, tokens = k // 128, 8 * token_tiles
    a_bytes = np.asarray(a).view(np.uint8)  # (G, M, K), the W4A8 column order
    w_words = np.asarray(values).view(np.uint8).reshape(g_count, n, k // 8, 4).astype(np.uint32)
    w_words = (w_words << (8 * np.arange(4, dtype=np.uint32))).sum(-1, dtype=np.uint32)  # (G, N, K/8)
    s_words = np.asarray(scales).view(np.uint32)
    token_scales = np.asarray(from_mn_major_tma_aligned(sa, m_pad)).astype(np.float64)  # (G, M, K/128)
    tables = E4M3_TABLES.view("<u4").reshape(-1, 2).astype(np.uint32)
    out = np.full((g_count, m_pad, n), np.nan)
    t_idx, x_idx = np.meshgrid(np.arange(tokens), np.arange(128), indexing="ij")
    for g in range(g_count):
        for mb in range(0, int(masked_m[g]), tokens):
            live = mb + np.arange(tokens) < masked_m[g]
            m = np.minimum(mb + np.arange(tokens), m_pad - 1)  # the box's rows (those past m_pad: not written out)
            acc = np.zeros((n, tokens))
            for kb in range(kb_count):
                smem = np.zeros(tokens * 128, np.uint8)
                smem[_swizzle128(128 * t_idx + x_idx)] = a_bytes[g, m, kb * 128:(kb + 1) * 128]  # the TMA copy
                sw = s_words[g, :, kb]
                block_scale = np.ldexp(1.0, (sw & 0xFF).astype(np.int64) - 127)
                part = np.zeros((n, tokens))
                for s in range(4):
                    kk, tt = np.meshgrid(np.arange(32), np.arange(tokens))
                    addr = 1024 * (tt // 8) + 128 * (tt % 8) + 32 * s + kk  # the descriptor's K-major rows
                    b_mat = smem[_swizzle128(addr)].view(ml_dtypes.float8_e4m3fn).astype(np.float64)  # (tokens, 32)
                    a_mat = np.zeros((n, 32))
                    for c in range(4):
                        word = w_words[g, :, kb * 16 + 4 * c + s]
                        lo, hi = tables[(sw >> (8 + 5 * c)) & 31].T
                        even = _prmt(lo, hi, word & 0x7777) | (word & 0x80808080)
                        odd = _prmt(lo, hi, (word >> 16) & 0x7777) | ((word << 4) & 0x80808080)
                        a_mat[:, 4 * c:4 * c + 4] = _e4m3(even[:, None])
                        a_mat[:, 16 + 4 * c:20 + 4 * c] = _e4m3(odd[:, None])
                    part += a_mat @ b_mat.T
                acc += part * block_scale[:, None] * token_scales[g, m, kb][None, :]
            rows = np.flatnonzero(live)
            out[g, mb + rows] = acc[:, rows].T
    return out


@pytest.mark.parametrize("token_tiles,m_pad,n,k", [(4, 128, 72, 256), (3, 128, 40, 384), (1, 128, 24, 128)])
def test_kernel_model_matches_the_float64_model(token_tiles, m_pad, n, k):
    """The permutations the kernel relies on (weights widened per thread column, tokens in the W4A8 column
    order copied with the swizzle the descriptor reads) compute the GEMM: within fp32 accumulation of the
    float64 model, on random codes across 12 exponents."""
    codes, sf32, packed, a, sa = _operands(token_tiles * 7 + n, g=2, m_pad=m_pad, n=n, k=k)
    values, scales = mxfp4_to_w4a8(packed, jnp.asarray(sf32))
    masked_m = np.array([37, 8 * token_tiles])
    got = _kernel_model(a, sa, values, scales, masked_m, token_tiles)
    want, mag = _model(codes, sf32, a, sa)
    valid = np.arange(m_pad)[None, :] < masked_m[:, None]
    assert np.isnan(got[~valid]).all() and np.isfinite(got[valid]).all()
    err = np.abs(got - want)[valid]
    assert (err <= 1e-5 * mag[valid] + 1e-30).all(), err.max()


def test_config_checks_name_the_field():
    with pytest.raises(ValueError, match=r"W4A8CudaConfig.token_tiles: expected an int in \[1, 8\], got 9"):
        cw.W4A8CudaConfig(token_tiles=9)
    with pytest.raises(ValueError, match=r"W4A8CudaConfig.stages: expected an int in \[2, 8\], got 1"):
        cw.W4A8CudaConfig(stages=1)
    with pytest.raises(ValueError, match=r"W4A8CudaConfig.warpgroups: expected an int in \[1, 4\], got True"):
        cw.W4A8CudaConfig(warpgroups=True)
    with pytest.raises(ValueError, match=r"k: the W4A8 kernel needs a multiple of 128, got 200"):
        cw.source(cw.W4A8CudaConfig(), n=64, k=200, m_pad=128)


def test_heuristic_covers_one_and_a_half_times_the_expected_rows_up_to_32():
    assert [cw.heuristic_config(m).token_tiles for m in (1, 5, 6, 10, 11, 24, 500)] == [1, 1, 2, 2, 4, 4, 4]


def test_launch_plan_geometry():
    from custom_calls.native.launch_plan import ARG_PTR, ARG_TMAP

    cfg = cw.W4A8CudaConfig(token_tiles=3, warpgroups=2, stages=2)
    g, m_pad, n, k = 7, 100, 200, 384
    plan = cw.plan(cfg, "/x.cubin", g=g, m_pad=m_pad, n=n, k=k)
    assert (plan.grid, plan.grid_yz) == (2, (5, 7))  # ceil(200 / 128) row blocks, ceil(100 / 24) token blocks
    assert plan.block == 256 and plan.cluster == 1
    # two slots of 24 tokens x 128 B + 128 rows x 64 B + 96 B of scales (-> 128), each rounded to 1024, + 1024
    assert plan.smem == cw.smem_bytes(cfg) == 2 * 12288 + 1024
    assert [(a.kind, a.value) for a in plan.args] == [(ARG_TMAP, 0), (ARG_TMAP, 1), (ARG_TMAP, 2),
                                                      (ARG_PTR, 3), (ARG_PTR, 4), (ARG_PTR, 5)]
    tokens, scales, weights = plan.tmaps
    assert (tokens.operand, tokens.dims, tokens.box, tokens.swizzle) == (0, (k, g * m_pad), (128, 24), 128)
    assert (scales.operand, scales.dims, scales.box, scales.strides) == (1, (100, g * 3), (24, 1), (400,))
    assert (weights.operand, weights.dims, weights.box, weights.swizzle) == (2, (k // 2, g * n), (64, 128), 0)
    plan.check()
    # the maps span exactly the operands: lhs, lhs_scale, rhs, rhs_scale, masked_m, D
    plan.check_operands((g * m_pad * k, g * 3 * 100 * 4, g * n * k // 2, g * n * 3 * 4, 4 * g, 2 * g * m_pad * n))
    # the largest tiling the config allows still fits an SM90 block's shared memory
    assert cw.smem_bytes(cw.W4A8CudaConfig(token_tiles=8, warpgroups=4, stages=8)) <= cw.MAX_SMEM
    with pytest.raises(ValueError, match=r"m_pad 600000 / 8 rows per block = 75000 token blocks"):
        cw.grid(cw.W4A8CudaConfig(token_tiles=1), g=2, m_pad=600_000, n=64)


@needs_nvcc
def test_kernel_table_words_are_the_layout_tables(tmp_path):
    """The kernel's `table_words` (the e4m3 tables as arithmetic, not a lookup) equals
    `layouts.w4a8.table_words` for every index the scale words can hold: the kernel's translation unit
    compiled by nvcc with a host `main` that prints them. (The numpy model above widens with the
    layout's tables; this closes the gap to the kernel's own.)"""
    from custom_calls.native.toolchain import find_nvcc
    from layouts.w4a8 import NUM_TABLES, table_words

    src = cw.source(cw.W4A8CudaConfig(), n=64, k=128, m_pad=32) + (
        "\n#include <cstdio>\nint main() {\n  for (uint32_t i = 0; i < %d; ++i) {\n    uint32_t lo, hi;\n"
        "    moe_jax_w4a8::table_words(i, lo, hi);\n    std::printf(\"%%u %%u\\n\", lo, hi);\n  }\n}\n" % NUM_TABLES)
    (tmp_path / "tables.cu").write_text(src)
    exe = tmp_path / "tables"
    build = subprocess.run([str(find_nvcc()), str(tmp_path / "tables.cu"), "-o", str(exe),
                            "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    got = np.array([[int(v) for v in line.split()] for line in out.splitlines()], np.uint32)
    np.testing.assert_array_equal(got, table_words())


def _resources(cubin) -> dict:
    import os
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = subprocess.run([tool, "--dump-resource-usage", str(cubin)], capture_output=True, text=True).stdout
    reg, stack = re.search(r"REG:(\d+) STACK:(\d+)", out).groups()
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True).stdout
    return {"reg": int(reg), "stack": int(stack), "wgmma": sass.count("QGMMA"), "hmma": sass.count("HMMA")}


@needs_nvcc
@pytest.mark.parametrize("cfg", [cw.W4A8CudaConfig(), cw.W4A8CudaConfig(token_tiles=8, stages=2, min_blocks=2),
                                 cw.W4A8CudaConfig(token_tiles=2, warpgroups=2, stages=3, min_blocks=3)])
def test_compiles_for_sm90a_without_spills(cfg, tmp_path, monkeypatch):
    """nvcc compiles each tiling for sm_90a: FP8 wgmma (QGMMA; no HMMA emulation), no local memory, within
    the register bound of `min_blocks` blocks per SM."""
    from custom_calls.native.compiler import compile_cubin

    monkeypatch.setenv("MOE_JAX_CACHE_DIR", str(tmp_path))
    src = cw.source(cfg, n=4096, k=4096, m_pad=256)
    res = _resources(compile_cubin(cw.kernel_name(cfg, n=4096, k=4096, m_pad=256), src, 90).path)
    assert res["stack"] == 0 and res["wgmma"] > 0 and res["hmma"] == 0, res
    assert res["reg"] * 128 * cfg.warpgroups * cfg.min_blocks <= 65536, res
