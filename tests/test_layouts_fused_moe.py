"""The fused MoE kernel's device buffer and GEMM1 weight order (layouts/fused_moe.py).

The gate/up interleave is checked bit-exactly against an explicit loop. The buffer layout is checked
against the kernel headers' own layout code: a host program built with nvcc runs the slicing code
taken verbatim from sm90_fp8_mega_moe_impl and prints every offset (skipped without nvcc or the
sgl-deep-gemm headers)."""

from __future__ import annotations

import dataclasses
import re
import subprocess

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import layouts as L
from layouts.fused_moe import REGION_NAMES


# --- gate/up interleave -------------------------------------------------------------------------

def np_interleave(w: np.ndarray, gran: int) -> np.ndarray:
    """Loop model: out row 2 j gran + r = gate row j gran + r, out row (2 j + 1) gran + r = up row j gran + r."""
    i = w.shape[-2] // 2
    out = np.empty_like(w)
    for j in range(i // gran):
        for r in range(gran):
            out[..., 2 * j * gran + r, :] = w[..., j * gran + r, :]
            out[..., (2 * j + 1) * gran + r, :] = w[..., i + j * gran + r, :]
    return out


def _random(rng, shape, dtype):
    """Random bit patterns of ``dtype`` (NaNs included for the float types): compared bitwise."""
    size = np.dtype(dtype).itemsize
    raw = rng.integers(0, 256, size=(*shape, size), dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint8 if x.dtype.itemsize == 1 else f"u{x.dtype.itemsize}")


SHAPES = [((16, 4), 8), ((3, 32, 5), 8), ((2, 2, 48, 3), 8), ((12, 7), 3), ((2, 8, 1), 1), ((4, 64, 128), 16)]
DTYPES = [np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.int8, np.uint8, np.float16]


@pytest.mark.parametrize("shape,gran", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_interleave_bit_exact_numpy_and_jax(shape, gran, dtype):
    w = _random(np.random.default_rng(hash((shape, gran)) % 2**32), shape, dtype)
    want = np_interleave(w, gran)
    got_np = L.interleave_gate_up(w, gran)
    assert isinstance(got_np, np.ndarray) and got_np.dtype == w.dtype and got_np.shape == w.shape
    np.testing.assert_array_equal(_bits(got_np), _bits(want))
    got_j = L.interleave_gate_up(jnp.asarray(w), gran)
    assert isinstance(got_j, jax.Array) and got_j.dtype == w.dtype
    np.testing.assert_array_equal(_bits(got_j), _bits(want))
    jitted = jax.jit(L.interleave_gate_up, static_argnums=1)(jnp.asarray(w), gran)
    np.testing.assert_array_equal(_bits(jitted), _bits(want))
    # the inverse, both ways round
    np.testing.assert_array_equal(_bits(L.deinterleave_gate_up(got_np, gran)), _bits(w))
    np.testing.assert_array_equal(_bits(L.deinterleave_gate_up(got_j, gran)), _bits(w))
    np.testing.assert_array_equal(_bits(L.interleave_gate_up(L.deinterleave_gate_up(w, gran), gran)), _bits(w))


def test_interleave_default_gran_is_8_and_row_labels():
    # rows labelled by (gate/up, index): 2I = 32 rows, the default granularity 8
    i = 16
    w = np.concatenate([np.arange(i), 100 + np.arange(i)]).astype(np.int32)[:, None]
    got = L.interleave_gate_up(w)[:, 0].tolist()
    assert got == [*range(0, 8), *range(100, 108), *range(8, 16), *range(108, 116)]
    w2 = np.array([0, 1, 2, 3, 10, 11, 12, 13])[:, None]
    assert L.interleave_gate_up(w2, 2)[:, 0].tolist() == [0, 1, 10, 11, 2, 3, 12, 13]


def test_interleave_float8_jnp_dtype():
    w = jnp.asarray(np.arange(2 * 32 * 16).reshape(2, 32, 16) % 200, jnp.float32).astype(jnp.float8_e4m3fn)
    got = L.interleave_gate_up(w)
    assert got.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(_bits(got), _bits(np_interleave(np.asarray(w), 8)))


@pytest.mark.parametrize("fn", [L.interleave_gate_up, L.deinterleave_gate_up])
def test_interleave_errors(fn):
    with pytest.raises(ValueError, match=re.escape("w: expected axis -2 (2I rows) to be a multiple of "
                                                   "2 * gran = 16, got shape (3, 24, 4)")):
        fn(np.zeros((3, 24, 4), np.float32))
    with pytest.raises(ValueError, match=re.escape("2 * gran = 8, got shape (12, 2)")):
        fn(jnp.zeros((12, 2)), 4)
    with pytest.raises(ValueError, match=r"w: expected an array of shape \(\.\.\., 2I, K\), got \(16,\)"):
        fn(np.zeros(16))
    for gran in (0, -8, True, 2.0):
        with pytest.raises(ValueError, match=f"gran: expected a positive int, got {re.escape(repr(gran))}"):
            fn(np.zeros((16, 4)), gran)


# --- device buffer -----------------------------------------------------------------------------

# (max_tokens, hidden, intermediate, num_experts, top_k, block_m): the two model configs of the
# kernel (DeepSeek-V3-like, H 7168, I 2048, 32 experts, top-8, prefill and decode), odd token counts,
# top_k > num_experts (the pool takes min(top_k, E)), odd expert counts, many experts.
CONFIGS = [
    (4096, 7168, 2048, 32, 8, 128),
    (128, 7168, 2048, 32, 8, 64),
    (1, 1024, 256, 8, 4, 64),
    (7, 2048, 512, 16, 6, 64),
    (300, 4096, 1536, 64, 8, 128),
    (7, 512, 128, 3, 5, 128),
    (1, 512, 128, 1, 1, 128),
    (4096, 7168, 2048, 256, 8, 64),
    (513, 2560, 768, 24, 3, 128),
]


def test_known_layouts():
    # Offsets printed by the kernel headers' own layout code for the two model configs.
    p = L.FusedMoEBuffer(4096, 7168, 2048, 32, 8, 128)
    assert (p.pool_tokens, p.padded_sf_tokens, p.workspace_bytes, p.total_bytes) == (36864, 36864, 1061888, 851997696)
    assert [p.regions[n][0] for n in REGION_NAMES] == [
        0, 1061888, 30422016, 31339520, 31601664, 31732736, 295973888, 304231424, 304378880, 379876352, 382235648]
    d = L.FusedMoEBuffer(128, 7168, 2048, 32, 8, 64)
    assert (d.pool_tokens, d.padded_sf_tokens, d.workspace_bytes, d.total_bytes) == (5120, 10240, 94208, 65888256)
    assert [d.regions[n][0] for n in REGION_NAMES] == [
        0, 94208, 1011712, 1040384, 1048576, 1052672, 37752832, 40046592, 40067072, 50552832, 51208192]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_regions_are_back_to_back(cfg):
    b = L.FusedMoEBuffer(*cfg)
    t, h, i, e, k, bm = cfg
    assert tuple(b.regions) == REGION_NAMES
    end = 0
    for name in REGION_NAMES:
        offset, nbytes = b.regions[name]
        assert offset == end and nbytes > 0
        end = offset + nbytes
    assert b.total_bytes == end
    # region sizes from the documented shapes
    sizes = {n: b.regions[n][1] for n in REGION_NAMES}
    p, s = b.pool_tokens, b.padded_sf_tokens
    assert sizes["input_tokens"] == t * h and sizes["input_scales"] == t * (h // 128) * 4
    assert sizes["input_topk_ids"] == t * k * 8 and sizes["input_topk_weights"] == t * k * 4
    assert sizes["l1_tokens"] == p * h and sizes["l1_scales"] == (h // 128) * s * 4
    assert sizes["l2_tokens"] == p * i and sizes["l2_scales"] == (i // 128) * s * 4
    assert sizes["l1_topk_weights"] == p * 4 and sizes["combine"] == k * t * h * 2
    assert sizes["workspace"] % 1024 == 0 and p % 128 == 0 and p >= t * min(k, e)


def test_buffer_is_frozen_and_hashable():
    a, b = L.FusedMoEBuffer(128, 7168, 2048, 32, 8, 64), L.FusedMoEBuffer(128, 7168, 2048, 32, 8, 64)
    assert a == b and hash(a) == hash(b) and len({a, b, L.FusedMoEBuffer(128, 7168, 2048, 32, 8, 128)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.max_tokens = 1
    c = L.FusedMoEBuffer(np.int64(128), 7168, 2048, 32, 8, 64)
    assert c == a and type(c.max_tokens) is int


@pytest.mark.parametrize("kwargs,message", [
    (dict(block_m=96), "block_m: expected one of (64, 128) (the SM90 kernel's BLOCK_M), got 96"),
    (dict(hidden=7000), "hidden: expected a multiple of 512"),
    (dict(hidden=7424), "got 7424"),
    (dict(intermediate=100), "intermediate: expected a multiple of 128 (one fp32 scale per 128 channels), got 100"),
    (dict(top_k=0), "top_k: expected a positive int, got 0"),
    (dict(max_tokens=True), "max_tokens: expected a positive int, got True"),
    (dict(num_experts=2.0), "num_experts: expected a positive int, got 2.0"),
    (dict(max_tokens=2**28), "num_experts * max_tokens < 2**32"),
    (dict(max_tokens=2**29, num_experts=8), "pool_tokens + 128 < 2**32"),
])
def test_buffer_argument_errors(kwargs, message):
    args = dict(max_tokens=128, hidden=7168, intermediate=2048, num_experts=32, top_k=8, block_m=64) | kwargs
    with pytest.raises(ValueError, match=re.escape(message)):
        L.FusedMoEBuffer(**args)


# --- against the kernel headers ----------------------------------------------------------------

_START = "constexpr uint32_t SF_BLOCK_M"
_END = "const auto combine_token_buffer"
# the kernel's buffer variables, in its order, and our names for them
_KERNEL_REGIONS = [("input_token_buffer", "input_tokens"), ("input_sf_buffer", "input_scales"),
                   ("input_topk_idx_buffer", "input_topk_ids"), ("input_topk_weights_buffer", "input_topk_weights"),
                   ("l1_token_buffer", "l1_tokens"), ("l1_sf_buffer", "l1_scales"),
                   ("l1_topk_weights_buffer", "l1_topk_weights"), ("l2_token_buffer", "l2_tokens"),
                   ("l2_sf_buffer", "l2_scales"), ("combine_token_buffer", "combine")]

_PROGRAM = r"""
#include <cassert>
#include <cstdint>
#include <cstdio>
// layout::Data's constructor asserts with DG_UNIFIED_ASSERT, a device trap under nvcc: a host assert here
#define DG_DEVICE_ASSERT(cond) assert(cond)
#define DG_UNIFIED_ASSERT(cond) assert(cond)
#include <cuda_bf16.h>
#include <deep_gemm/layout/mega_moe.cuh>
#include <deep_gemm/layout/sm90_mega_moe.cuh>

using namespace deep_gemm;

// layout::SymBuffer<1>::get_base_ptr is device-only; one rank maps nothing, so a base pointer is all
struct HostSymBuffer {
    void* base;
    void* get_base_ptr() const { return base; }
};

static void print_region(const char* name, const void* base, const layout::Buffer& b) {
    const auto offset = static_cast<const uint8_t*>(b.get_base_ptr<uint8_t>()) - static_cast<const uint8_t*>(base);
    printf("%s %lld %llu\n", name, static_cast<long long>(offset), static_cast<unsigned long long>(b.get_num_bytes()));
}

template <uint32_t kNumMaxTokensPerRank, uint32_t kHidden, uint32_t kIntermediateHidden, uint32_t kNumExperts,
          uint32_t kNumTopk, uint32_t BLOCK_M, uint32_t kNumMaxPoolTokens, uint32_t kNumPaddedSFPoolTokens>
void print_layout(int index) {
    constexpr uint32_t kNumRanks = 1;
    constexpr uint32_t kNumExpertsPerRank = kNumExperts / kNumRanks;
    constexpr uint32_t kNumRingTokens = kNumMaxPoolTokens;  // the ring covers the whole pool
    constexpr uint32_t kEarlyCombineMode = 0;
    const HostSymBuffer sym_buffer{reinterpret_cast<void*>(static_cast<uintptr_t>(1) << 40)};
    // ---- sm90_fp8_mega_moe_impl's buffer slicing, verbatim ----
@SNIPPET@
    // ----
    const void* base = sym_buffer.get_base_ptr();
    printf("config %d\n", index);
    printf("pool_tokens %u\n", layout::get_num_max_pool_tokens_sm90<uint32_t>(
        kNumRanks, kNumMaxTokensPerRank, kNumTopk, kNumExpertsPerRank));
    printf("padded_sf_tokens %u\n", kNumDataPoolBlocks * SF_BLOCK_M);
    printf("workspace %lld %llu\n", static_cast<long long>(static_cast<const uint8_t*>(workspace.base) -
        static_cast<const uint8_t*>(base)), static_cast<unsigned long long>(workspace.get_num_bytes()));
@PRINTS@
}

int main() {
@CALLS@
    return 0;
}
"""


def _toolchain():
    from custom_calls.native import toolchain

    try:
        return toolchain.find_nvcc(), toolchain.deep_gemm_include_dir()
    except toolchain.ToolchainError as e:
        pytest.skip(f"needs nvcc and the sgl-deep-gemm headers: {e}")


def _kernel_slicing_code(include_dir) -> str:
    text = (include_dir / "deep_gemm" / "impls" / "sm90_fp8_mega_moe.cuh").read_text()
    start = text.index(_START)
    end = text.index(";", text.index(_END)) + 1
    return text[text.rindex("\n", 0, start) + 1:end]


@pytest.mark.slow
def test_buffer_matches_kernel_headers(tmp_path):
    nvcc, inc = _toolchain()
    buffers = [L.FusedMoEBuffer(*cfg) for cfg in CONFIGS]
    calls = "\n".join(
        f"    print_layout<{b.max_tokens}, {b.hidden}, {b.intermediate}, {b.num_experts}, {b.top_k}, {b.block_m}, "
        f"{b.pool_tokens}, {b.padded_sf_tokens}>({n});" for n, b in enumerate(buffers))
    prints = "\n".join(f'    print_region("{ours}", base, {theirs});' for theirs, ours in _KERNEL_REGIONS)
    src = (_PROGRAM.replace("@SNIPPET@", _kernel_slicing_code(inc)).replace("@PRINTS@", prints)
           .replace("@CALLS@", calls))
    (tmp_path / "layout.cu").write_text(src)
    build = subprocess.run([str(nvcc), "-x", "cu", "-std=c++20", "--expt-relaxed-constexpr", "-w",
                            "-I", str(inc), "layout.cu", "-o", "layout"],
                           cwd=tmp_path, capture_output=True, text=True)
    # a static_assert of the kernel's code failing here means our pool or scale-slot count is wrong
    assert build.returncode == 0, build.stderr[-4000:]
    out = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout

    blocks = out.split("config ")[1:]
    assert len(blocks) == len(buffers)
    for block, b in zip(blocks, buffers):
        lines = block.strip().splitlines()
        values = {ln.split()[0]: [int(v) for v in ln.split()[1:]] for ln in lines[1:]}
        assert values["pool_tokens"] == [b.pool_tokens], b
        assert values["padded_sf_tokens"] == [b.padded_sf_tokens], b
        assert values["workspace"] == [0, b.workspace_bytes], b
        for name in REGION_NAMES:
            assert values[name] == list(b.regions[name]), (b, name)
        assert len(values) == len(REGION_NAMES) + 2
