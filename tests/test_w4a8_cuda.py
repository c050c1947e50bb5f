"""The CUDA W4A8 kernel (masked and contig) on the CPU: a numpy model of its data movement (the weight
fragments it widens, the token bytes TMA copies in the wgmma's shared-memory layout and the MMA over
both) against the float64 model; its configs, launch plans and checks; and nvcc compiling it for
sm_90a without spills. The kernel itself runs in tests/test_w4a8_cuda_gpu.py."""

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


TABLE_WORDS = E4M3_TABLES.view("<u4").reshape(-1, 2).astype(np.uint32)  # (lo, hi) of each table


def _tma_image(rows: np.ndarray) -> np.ndarray:
    """(R, 128) uint8 rows -> the R x 128 bytes of shared memory a TMA copy at the 128-byte swizzle writes."""
    t_idx, x_idx = np.meshgrid(np.arange(rows.shape[0]), np.arange(128), indexing="ij")
    smem = np.zeros(rows.size, np.uint8)
    smem[_swizzle128(128 * t_idx + x_idx)] = rows
    return smem


def _k_major_step(smem: np.ndarray, s: int) -> np.ndarray:
    """What a K-major wgmma descriptor over `smem` (128-byte rows in atoms of 8, SBO 1024, the 128-byte
    swizzle) reads for k32 step s, starting 32 s bytes along: (rows, 32) f64 e4m3 values."""
    kk, tt = np.meshgrid(np.arange(32), np.arange(smem.size // 128))
    addr = 1024 * (tt // 8) + 128 * (tt % 8) + 32 * s + kk
    return smem[_swizzle128(addr)].view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _widen(word, scale_word, c):
    """A W4A8 word of 32-group c, its row's scale word -> (even, odd) uint32 words of e4m3 bytes, as the
    kernels widen it (two byte permutes from the group's table and the sign bits)."""
    lo, hi = TABLE_WORDS[(scale_word >> (8 + 5 * c)) & 31].T
    even = _prmt(lo, hi, word & 0x7777) | (word & 0x80808080)
    odd = _prmt(lo, hi, (word >> 16) & 0x7777) | ((word << 4) & 0x80808080)
    return even, odd


def _block_model(a_rows, scale_rows, w_words, s_words, tokens):
    """One block as the kernel computes it, following its data movement: per 128-column K block, TMA
    copies the block's token rows (stored in the W4A8 column order) into the ring slot with the 128-byte
    swizzle, and the wgmma reads k32 step s of token t through its descriptor (start + 32 s, rows of 128
    bytes, SBO 1024) at the same swizzle; thread column c widens word 4c + s of each row (k32 step s)
    with its 32-group's table into a0|a1 (k = 4c..4c+3: even columns) and a2|a3 (k = 16 + 4c..: odd). The
    MMA sums over the wgmma's k = 0..31 of each step, the partial is promoted per K block.
    a_rows (tokens, K) uint8, scale_rows (tokens, K/128) f64, w_words (N, K/8) / s_words (N, K/128) the
    group's weight and scale words -> (N, tokens) f64."""
    k = a_rows.shape[1]
    n = w_words.shape[0]
    acc = np.zeros((n, tokens))
    for kb in range(k // 128):
        smem = _tma_image(a_rows[:, kb * 128:(kb + 1) * 128])
        sw = s_words[:, kb]
        block_scale = np.ldexp(1.0, (sw & 0xFF).astype(np.int64) - 127)
        part = np.zeros((n, tokens))
        for s in range(4):
            b_mat = _k_major_step(smem, s)  # (tokens, 32)
            a_mat = np.zeros((n, 32))
            for c in range(4):
                even, odd = _widen(w_words[:, kb * 16 + 4 * c + s], sw, c)
                a_mat[:, 4 * c:4 * c + 4] = _e4m3(even[:, None])
                a_mat[:, 16 + 4 * c:20 + 4 * c] = _e4m3(odd[:, None])
            part += a_mat @ b_mat.T
        acc += part * block_scale[:, None] * scale_rows[:, kb][None, :]
    return acc


def _words(values, scales):
    """(G, N, K/2) int8 + (G, N, K/128) int32 -> little-endian uint32 words (G, N, K/8), scale words."""
    g, n, kh = values.shape
    w = np.asarray(values).view(np.uint8).reshape(g, n, kh // 4, 4).astype(np.uint32)
    return (w << (8 * np.arange(4, dtype=np.uint32))).sum(-1, dtype=np.uint32), np.asarray(scales).view(np.uint32)


def _kernel_model(a, sa, values, scales, masked_m, token_tiles):
    """The masked kernel: blocks of 8 * token_tiles rows of each group below masked_m (`_block_model`);
    rows >= masked_m NaN."""
    g_count, m_pad, k = a.shape
    tokens = 8 * token_tiles
    a_bytes = np.asarray(a).view(np.uint8)
    w_words, s_words = _words(values, scales)
    token_scales = np.asarray(from_mn_major_tma_aligned(sa, m_pad)).astype(np.float64)  # (G, M, K/128)
    out = np.full((g_count, m_pad, values.shape[1]), np.nan)
    for g in range(g_count):
        for mb in range(0, int(masked_m[g]), tokens):
            m = np.minimum(mb + np.arange(tokens), m_pad - 1)  # the box's rows (those past m_pad: not written out)
            acc = _block_model(a_bytes[g, m], token_scales[g, m], w_words[g], s_words[g], tokens)
            rows = np.flatnonzero(mb + np.arange(tokens) < masked_m[g])
            out[g, mb + rows] = acc[:, rows].T
    return out


def _contig_kernel_model(a, sa, values, scales, m_indices, token_tiles):
    """The contig kernel: each block of 8 * token_tiles rows takes the expert of its first row; a block
    whose first row is padding (-1), and every padding row, is written 0."""
    m_cap, k = a.shape
    tokens = 8 * token_tiles
    a_bytes = np.asarray(a).view(np.uint8)
    w_words, s_words = _words(values, scales)
    token_scales = np.asarray(from_mn_major_tma_aligned(sa, m_cap)).astype(np.float64)  # (M_cap, K/128)
    out = np.zeros((m_cap, values.shape[1]))
    for mb in range(0, m_cap, tokens):
        e = int(m_indices[mb])
        if e >= 0:
            rows = mb + np.arange(tokens)
            out[rows] = _block_model(a_bytes[rows], token_scales[rows], w_words[e], s_words[e], tokens).T
    out[np.asarray(m_indices) < 0] = 0
    return out


def test_rs_contig_kernel_model_matches_the_float64_model():
    """The persistent register-operand contig kernel (w4a8_contig_rs_sm90.cuh): block b takes tiles b, b + grid,
    ... (token block major), each tile's 128 tokens and 128 weight rows per K block the masked kernel's data
    movement (`_block_model` over 128 tokens), the block scale of every row from the tile's first row's word
    (the scaling warp's); every tile once, padding rows and all-padding tiles 0, a partial last weight tile
    (N 200), grids of 1, 3 and more blocks than tiles."""
    from custom_calls.cuda import w4a8_contig_rs as rs

    n = 200
    codes, sf32, values, scales, m_indices, a, sa = _contig_case(11, n)
    a_bytes = np.asarray(a).view(np.uint8)
    w_words, s_words = _words(values, scales)
    token_scales = np.asarray(from_mn_major_tma_aligned(sa, m_indices.size)).astype(np.float64)
    m_blocks, n_tiles = m_indices.size // 128, -(-n // 128)
    for num_sms in (1, 3, 64):
        grid = rs.grid_size(rs.W4A8RsConfig(num_sms=num_sms), m_cap=m_indices.size, n=n)
        assert grid == min(num_sms, m_blocks * n_tiles)
        got, seen = np.full((m_indices.size, n), np.nan), []
        for b in range(grid):
            for tile in range(b, m_blocks * n_tiles, grid):
                seen.append(tile)
                mb, wrow0 = tile // n_tiles * 128, tile % n_tiles * 128
                rows, e = mb + np.arange(128), int(m_indices[mb])
                cols = np.arange(wrow0, min(n, wrow0 + 128))
                if e < 0:
                    got[np.ix_(rows, cols)] = 0
                    continue
                r = np.arange(128)
                ok = wrow0 + r < n
                sw = np.where(ok[:, None], s_words[e][np.minimum(wrow0 + r, n - 1)], 0).astype(np.uint32)
                sw = (sw & ~np.uint32(0xFF)) | (sw[0] & np.uint32(0xFF))  # the tile's block scale, from row 0
                ww = np.where(ok[:, None], w_words[e][np.minimum(wrow0 + r, n - 1)], 0).astype(np.uint32)
                block = _block_model(a_bytes[rows], token_scales[rows], ww, sw, 128)  # (weight rows, tokens)
                block[:, m_indices[rows] < 0] = 0
                got[np.ix_(rows, cols)] = block[:cols.size].T
        assert sorted(seen) == list(range(m_blocks * n_tiles))
        _check_contig(got, codes, sf32, a, sa, m_indices)


def test_rs_scaled_token_scales_reach_their_consumers_without_bank_conflicts():
    """The persistent kernel's scaled token scales: scaling-warp lane l writes tokens 4 l .. + 3 as two float2
    at rows c = 2 (l % 2) + {0, 1}, columns 2 (l // 2) (SCALED_LD floats a row); consumer lane c reads its row
    as 8 float4 and takes token 8 u + 2 c + b from float 2 u + b. Every token is written once, each consumer
    reads its own 32 tokens, and a quarter warp's 16-byte loads (4 rows) fall in distinct banks."""
    from custom_calls.cuda import w4a8_contig_rs as rs

    ld = rs.SCALED_LD
    cell = np.full(4 * ld, -1)
    for lane in range(32):
        for j, tok in enumerate(range(4 * lane, 4 * lane + 4)):
            idx = (2 * (lane % 2) + j // 2) * ld + 2 * (lane // 2) + j % 2
            assert cell[idx] == -1
            cell[idx] = tok
    assert sorted(cell[cell >= 0]) == list(range(128))
    for c in range(4):
        for u in range(16):
            for b in range(2):
                assert cell[c * ld + 2 * u + b] == 8 * u + 2 * c + b
    for i in range(8):
        banks = [set(range((c * ld + 4 * i) % 32, (c * ld + 4 * i) % 32 + 4)) for c in range(4)]
        assert len(set().union(*banks)) == 16


def _contig_case(seed: int, n: int):
    """3 experts of N rows, K 256, M_cap 512: segments of 100, 128 and 6 rows (rows 256..383 all padding),
    tokens zero on the padding rows -> (codes, sf32, values, scales, m_indices, a, sa)."""
    from test_w4a8_gemm import W4A8

    codes, sf32, packed, _, _ = _operands(seed, g=3, m_pad=128, n=n, k=256)
    values, scales = mxfp4_to_w4a8(packed, jnp.asarray(sf32))
    m_indices = np.full(512, -1, np.int32)
    m_indices[:100], m_indices[128:256], m_indices[384:390] = 2, 0, 1
    x = np.random.default_rng(seed + 1).standard_normal((512, 256)) * (m_indices >= 0)[:, None]
    a, sa = W4A8.quantize_lhs(jnp.asarray(x.astype(np.float32)))
    return codes, sf32, values, scales, m_indices, a, sa


def _check_contig(got, codes, sf32, a, sa, m_indices):
    """A contig kernel model's (M_cap, N) output: padding rows 0, expert rows within fp32 accumulation of
    the float64 model of their expert."""
    g, (m_cap, k) = codes.shape[0], a.shape
    full, mag = _model(codes, sf32, jnp.broadcast_to(a, (g, m_cap, k)), jnp.broadcast_to(sa, (g, *sa.shape)))
    e = np.maximum(m_indices, 0)
    want, bound = full[e, np.arange(m_cap)], mag[e, np.arange(m_cap)]
    real = m_indices >= 0
    assert (got[~real] == 0).all() and np.abs(want[real]).max() > 0
    assert (np.abs(got - want)[real] <= 1e-5 * bound[real] + 1e-30).all()


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


def test_contig_kernel_model_matches_the_float64_model():
    """The contig kernel's blocks: the expert of a block's first row, padding rows and all-padding blocks
    0, a partial last segment; the same data movement as the masked kernel."""
    codes, sf32, values, scales, m_indices, a, sa = _contig_case(5, 40)
    _check_contig(_contig_kernel_model(a, sa, values, scales, m_indices, 4), codes, sf32, a, sa, m_indices)


def test_config_checks_name_the_field():
    with pytest.raises(ValueError, match=r"W4A8CudaConfig.token_tiles: expected an int in \[1, 16\], got 17"):
        cw.W4A8CudaConfig(token_tiles=17)
    with pytest.raises(ValueError, match=r"W4A8CudaConfig.stages: expected an int in \[2, 8\], got 1"):
        cw.W4A8CudaConfig(stages=1)
    with pytest.raises(ValueError, match=r"W4A8CudaConfig.warpgroups: expected an int in \[1, 4\], got True"):
        cw.W4A8CudaConfig(warpgroups=True)
    with pytest.raises(ValueError, match=r"k: the W4A8 kernel needs a multiple of 128, got 200"):
        cw.source(cw.W4A8CudaConfig(), n=64, k=200, m_pad=128)
    # contig: a block's rows must lie in one expert's segment
    tiles = cw.CONTIG_CONFIG.token_tiles
    assert [cw.contig_config(a).token_tiles for a in (128, 64, 32, 8)] == [min(tiles, a // 8) for a in (128, 64, 32, 8)]
    lhs, sa = jnp.zeros((256, 128), jnp.float8_e4m3fn), jnp.zeros((1, 256), jnp.float32)
    rhs, rs = jnp.zeros((2, 64, 64), jnp.int8), jnp.zeros((2, 64, 1), jnp.int32)
    with pytest.raises(ValueError, match=r"config.token_tiles: a contig block's 128 rows must divide the alignment 64"):
        cw.w4a8_contig_cuda(lhs, sa, rhs, rs, jnp.zeros((256,), jnp.int32), alignment=64,
                            config=cw.W4A8CudaConfig(token_tiles=16, min_blocks=1))


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
    # a tiling past an SM90 block's shared memory is refused by name
    with pytest.raises(ValueError, match=r"W4A8CudaConfig\(token_tiles=16, warpgroups=4, stages=8\): 271360 bytes "
                                         r"of shared memory per block, at most 232448"):
        cw.plan(cw.W4A8CudaConfig(token_tiles=16, warpgroups=4, stages=8), "/x.cubin", g=1, m_pad=128, n=256, k=128)
    # contig: one slab of M_cap rows, the grid's z is 1 (the block reads its expert), weights over every expert
    m_cap = 1024
    plan = cw.plan(cw.W4A8CudaConfig(token_tiles=16, warpgroups=2, min_blocks=1), "/x.cubin", g=g, m_pad=m_cap, n=n,
                   k=k, contig=True)
    assert (plan.grid, plan.grid_yz, plan.block) == (2, (8, 1), 256)
    tokens, scales, weights = plan.tmaps
    assert (tokens.dims, tokens.box, scales.dims, scales.box) == ((k, m_cap), (128, 128), (m_cap, 3), (128, 1))
    assert (weights.dims, weights.box) == ((k // 2, g * n), (64, 128))
    plan.check_operands((m_cap * k, 3 * m_cap * 4, g * n * k // 2, g * n * 3 * 4, 4 * m_cap, 2 * m_cap * n))
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
    return {"reg": int(reg), "stack": int(stack), "wgmma": sass.count("QGMMA"), "hmma": sass.count("HMMA"),
            "setmaxreg": re.findall(r"USETMAXREG\.(\w+)\S*\s+(?:\w+,\s*)?(0x[0-9a-f]+)", sass)}


@needs_nvcc
@pytest.mark.parametrize("cfg,contig", [(cw.W4A8CudaConfig(), False),
                                        (cw.W4A8CudaConfig(token_tiles=8, stages=2, min_blocks=2), False),
                                        (cw.W4A8CudaConfig(token_tiles=2, warpgroups=2, stages=3, min_blocks=3), False),
                                        (cw.CONTIG_CONFIG, True),
                                        (cw.W4A8CudaConfig(token_tiles=16, min_blocks=2), True),
                                        (cw.W4A8CudaConfig(token_tiles=16, warpgroups=2, min_blocks=1), True)])
def test_compiles_for_sm90a_without_spills(cfg, contig, tmp_path, monkeypatch):
    """nvcc compiles each tiling of both layouts for sm_90a: FP8 wgmma (QGMMA; no HMMA emulation), no local
    memory, within the register bound of `min_blocks` blocks per SM."""
    from custom_calls.native.compiler import compile_cubin

    monkeypatch.setenv("MOE_JAX_CACHE_DIR", str(tmp_path))
    src = cw.source(cfg, n=4096, k=4096, m_pad=256, contig=contig)
    res = _resources(compile_cubin(cw.kernel_name(cfg, n=4096, k=4096, m_pad=256, contig=contig), src, 90).path)
    assert res["stack"] == 0 and res["wgmma"] > 0 and res["hmma"] == 0, res
    assert res["reg"] * 128 * cfg.warpgroups * cfg.min_blocks <= 65536, res


@needs_nvcc
@pytest.mark.parametrize("stages,ahead", [(2, True), (6, False), (6, True), (7, False)])
def test_rs_compiles_for_sm90a_without_spills(stages, ahead, tmp_path, monkeypatch):
    """The persistent register-operand contig kernel compiles for sm_90a: four RS FP8 wgmmas a K block (two K
    blocks a loop iteration when widening ahead, so eight in the code), no local memory,
    within the registers of 384 threads on one SM at launch; the producer warp group gives registers back and
    the consumers take them (setmaxnreg: 128 x 40 + 256 x 232 <= the SM's 65536)."""
    from custom_calls.cuda import w4a8_contig_rs as rs
    from custom_calls.native.compiler import compile_cubin

    monkeypatch.setenv("MOE_JAX_CACHE_DIR", str(tmp_path))
    cfg = rs.W4A8RsConfig(stages, ahead=ahead)
    res = _resources(compile_cubin(rs.kernel_name(cfg, n=4096, k=4096), rs.source(cfg, n=4096, k=4096), 90).path)
    assert res["stack"] == 0 and res["wgmma"] == (8 if ahead else 4) and res["hmma"] == 0, res
    assert res["reg"] * rs.THREADS <= 65536, res
    counts = {kind: int(n, 16) for kind, n in res["setmaxreg"]}
    assert counts == {"DEALLOC": 40, "TRY_ALLOC": 232}, res
    assert 128 * counts["DEALLOC"] + 256 * counts["TRY_ALLOC"] <= 65536


def test_rs_plan_and_checks():
    """The persistent register-operand kernel's launch: one block per SM (at most one per tile), 384 threads,
    the token blocks as its last argument, boxes of 128 tokens and 128 rows; refused by name: stages outside
    [2, 7], num_sms not positive, shared memory past the SM's, M_cap or an alignment not a multiple of 128."""
    from custom_calls.cuda import w4a8_contig_rs as rs
    from custom_calls.native.launch_plan import ARG_U32

    g, m_cap, n, k = 4, 1024, 200, 384
    plan = rs.plan(rs.W4A8RsConfig(num_sms=132), "/x.cubin", g=g, m_cap=m_cap, n=n, k=k)
    assert (plan.grid, plan.grid_yz, plan.block) == (16, (1, 1), 384)  # 8 token blocks x 2 weight tiles
    assert rs.plan(rs.W4A8RsConfig(num_sms=5), "/x.cubin", g=g, m_cap=m_cap, n=n, k=k).grid == 5
    assert (plan.args[-1].kind, plan.args[-1].value) == (ARG_U32, m_cap // 128)
    tokens, scales, weights = plan.tmaps
    assert (tokens.dims, tokens.box, tokens.swizzle) == ((k, m_cap), (128, 128), 128)
    assert (scales.dims, scales.box, weights.dims, weights.box) == ((m_cap, 3), (128, 1), (k // 2, g * n), (64, 128))
    plan.check()
    plan.check_operands((m_cap * k, 3 * m_cap * 4, g * n * k // 2, g * n * 3 * 4, 4 * m_cap, 2 * m_cap * n))
    # six slots of (16 + 8 KB + 512 B -> 25 KB), the alignment, the staging of 128 rows of 136 bf16, six
    # arrays of scaled token scales (4 rows of 36 f32)
    assert plan.smem == rs.smem_bytes(rs.W4A8RsConfig()) == 6 * 25600 + 1024 + 128 * 136 * 2 + 6 * 4 * 36 * 4
    for bad in (1, 8, True):
        with pytest.raises(ValueError, match=rf"W4A8RsConfig.stages: expected an int in \[2, 7\], got {bad!r}"):
            rs.W4A8RsConfig(bad)
    with pytest.raises(ValueError, match=r"W4A8RsConfig.num_sms: expected a positive int or None, got 0"):
        rs.W4A8RsConfig(num_sms=0)
    with pytest.raises(ValueError, match=r"M_cap: the W4A8 RS kernel takes tiles of 128 token rows, got 960"):
        rs.plan(rs.W4A8RsConfig(), "/x.cubin", g=g, m_cap=960, n=n, k=k)
    with pytest.raises(ValueError, match=r"k: the W4A8 kernel needs a multiple of 128, got 200"):
        rs.source(rs.W4A8RsConfig(), n=64, k=200)
    lhs, sa = jnp.zeros((256, 128), jnp.float8_e4m3fn), jnp.zeros((1, 256), jnp.float32)
    rhs, rsw = jnp.zeros((2, 64, 64), jnp.int8), jnp.zeros((2, 64, 1), jnp.int32)
    with pytest.raises(ValueError, match=r"alignment must be a multiple of 128, got 64"):
        rs.w4a8_contig_rs(lhs, sa, rhs, rsw, jnp.zeros((256,), jnp.int32), alignment=64)


def test_registry_contig_runs_the_form_the_settings_and_alignment_ask_for(monkeypatch):
    """On a GPU the "w4a8" backend's contig op runs, in the kernel form, the persistent kernel when the
    alignment is a multiple of its 128-row tiles and the per-block register-operand kernel otherwise; by expansion
    (`KernelSettings.w4a8_prefill`), the Triton expansion then DeepGEMM's FP8 contig GEMM on its output
    (here with every kernel replaced by a recorder and the interpreter switched off)."""
    import jax

    from custom_calls import KernelSettings, grouped_gemm, w4a8_backend
    from custom_calls.cuda import w4a8_contig_rs
    from custom_calls.triton import w4a8_expand_kernel

    calls = []
    monkeypatch.setattr(w4a8_backend, "_interpreting", lambda: False)
    monkeypatch.setattr(w4a8_contig_rs, "w4a8_contig_rs", lambda *a, alignment: calls.append(("persistent", alignment)))
    monkeypatch.setattr(cw, "w4a8_contig_cuda", lambda *a, alignment: calls.append(("per-block", alignment)))
    monkeypatch.setattr(w4a8_expand_kernel, "w4a8_expand",
                        lambda w, s, *, widen, column_order, gate_up_interleave:
                        calls.append(("expand", widen, column_order, gate_up_interleave)) or ("wide", "wide_scale"))
    monkeypatch.setattr(grouped_gemm, "m_grouped_gemm_contig",
                        lambda a, w, mi, *, rhs_scale, recipe, backend, **kw: calls.append((w, rhs_scale, recipe, backend)))
    lhs = jax.ShapeDtypeStruct((256, 128), jnp.float8_e4m3fn)
    rhs = jax.ShapeDtypeStruct((2, 64, 64), jnp.int8)
    for alignment in (128, 256, 64, 32):
        w4a8_backend.grouped_gemm_contig(lhs, rhs, None, lhs_scale=None, rhs_scale=None, recipe="mxfp4", arch=90,
                                         alignment=alignment, settings=KernelSettings())
    assert calls == [("persistent", 128), ("persistent", 256), ("per-block", 64), ("per-block", 32)]
    calls.clear()
    w4a8_backend.grouped_gemm_contig(lhs, rhs, None, lhs_scale=None, rhs_scale=None, recipe="mxfp4", arch=90,
                                     alignment=128, settings=KernelSettings(w4a8_prefill="expand"))
    assert calls == [("expand", "prmt", "w4a8", 0), ("wide", "wide_scale", "fp8_block", "deep_gemm")]
