"""The SM90 fused MoE kernel's configuration (custom_calls/deep_gemm/heuristics.py): the choice
rule, the reasons for refusals, and, with nvcc and the sgl-deep-gemm headers, that the kernel's own
shared-memory constant equals ``sm90_fused_moe_smem_bytes`` (a copy of the kernel header with one
inserted static_assert), that the chosen configs compile, and that the kernel refuses what the
reason refuses."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess

import numpy as np
import pytest

import layouts as L
from custom_calls.deep_gemm import heuristics as H

SMEM_CAPACITY = 232448
# DeepSeek-V3-like layer on one H200: prefill (4096 tokens) and decode (128 tokens)
MODEL = dict(hidden=7168, intermediate=2048, num_experts=32, top_k=8, num_sms=132)


def _config(**kw):
    return H.sm90_fused_moe_config(**(MODEL | kw))


def _smem(cfg, **kw) -> int:
    c = dataclasses.replace(cfg, **kw)
    return H.sm90_fused_moe_smem_bytes(
        max_tokens=c.max_tokens, hidden=c.hidden, intermediate=c.intermediate, num_experts=c.num_experts,
        top_k=c.top_k, block_m=c.block_m, num_stages=c.num_stages, num_sms=c.num_sms, half_l2_cd=c.half_l2_cd)


# --- the choice rule ---------------------------------------------------------------------------

def test_model_configs():
    # Stage counts and shared-memory totals read from the kernel's own constants (its SMEM_* constexprs).
    p = _config(max_tokens=4096)
    assert (p.block_m, p.num_stages, p.smem_bytes) == (128, 3, 197968)
    assert p.reuse_accum_as_final and p.half_l2_cd
    d = _config(max_tokens=128)
    assert (d.block_m, d.num_stages, d.smem_bytes) == (64, 4, 213312)
    assert d.reuse_accum_as_final and not d.half_l2_cd
    for c in (p, d):
        assert (c.block_n, c.block_k, c.experts_per_wave, c.num_threads, c.grid) == (256, 128, 32, 384, 132)
        assert (c.num_dispatch_threads, c.num_non_epilogue_threads, c.num_epilogue_threads) == (64, 64, 256)
        assert c.fast_math and c.l2_arrival_counter and not c.l2_epilogue_full_sync and c.activation_clamp is None
    assert (p.pool_tokens, p.padded_sf_tokens, d.pool_tokens, d.padded_sf_tokens) == (36864, 36864, 5120, 10240)


@pytest.mark.parametrize("max_tokens,top_k,num_experts,block_m", [
    (255, 8, 32, 64), (256, 8, 32, 128),  # 63.75 and 64 expected routes per expert
    (1, 8, 32, 64), (4096, 8, 32, 128), (8, 8, 1 << 10, 64), (60, 1, 1, 64), (64, 1, 1, 128),
    (2044, 8, 256, 64), (2048, 8, 256, 128),
])
def test_block_m_rule(max_tokens, top_k, num_experts, block_m):
    c = _config(max_tokens=max_tokens, top_k=top_k, num_experts=num_experts)
    assert c.block_m == block_m
    # BLOCK_M 128 takes the reuse-accumulator path and the two-pass L2 staging
    assert c.half_l2_cd == (block_m == 128) and c.reuse_accum_as_final


SHAPES = [dict(max_tokens=t, hidden=h, intermediate=i, num_experts=e, top_k=k, num_sms=s)
          for t, h, i, e, k, s in [(4096, 7168, 2048, 32, 8, 132), (128, 7168, 2048, 32, 8, 132),
                                   (8, 512, 512, 8, 2, 2), (1024, 4096, 1536, 64, 6, 78), (16, 2048, 768, 128, 8, 114),
                                   (32768, 7168, 2048, 256, 8, 132), (4, 12288, 4096, 16, 4, 132),
                                   (8, 1024, 512, 2048, 8, 132)]]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_stages_are_the_most_that_fit(shape):
    c = H.sm90_fused_moe_config(**shape)
    k_blocks = min(c.hidden, c.intermediate) // 128
    assert 2 <= c.num_stages < k_blocks
    assert c.smem_bytes <= SMEM_CAPACITY
    more = dataclasses.replace(c, num_stages=c.num_stages + 1)
    assert more.smem_bytes > SMEM_CAPACITY or more.num_stages >= k_blocks
    # one stage = an A tile, a B tile, the A scales and two barriers
    assert more.smem_bytes - c.smem_bytes == c.block_m * 128 + 256 * 128 + c.block_m * 4 + 16
    assert c.buffer == L.FusedMoEBuffer(c.max_tokens, c.hidden, c.intermediate, c.num_experts, c.top_k, c.block_m)
    assert H.sm90_fused_moe_reason(**shape) is None


def test_stages_stay_below_the_k_blocks():
    # I = 512: 4 k-blocks in GEMM2, so at most 3 stages even where 4 would fit (decode shared memory)
    c = _config(max_tokens=128, intermediate=512)
    assert c.block_m == 64 and c.num_stages == 3 and _smem(c, num_stages=4) <= SMEM_CAPACITY


def test_config_is_frozen_and_hashable():
    a, b = _config(max_tokens=128), _config(max_tokens=128)
    assert a == b and hash(a) == hash(b) and a != _config(max_tokens=4096)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_stages = 2
    c = H.sm90_fused_moe_config(**(MODEL | dict(max_tokens=np.int64(128), hidden=np.int32(7168))))
    assert c == a and type(c.max_tokens) is int and type(c.hidden) is int


@pytest.mark.parametrize("clamp,stored", [
    (None, None), (math.inf, None), (7, 7.0), (7.0, 7.0), (0.1, float(np.float32(0.1))), (np.float32(3.5), 3.5),
    (1e39, None),  # beyond float32: the kernel's value is infinity
])
def test_activation_clamp(clamp, stored):
    c = _config(max_tokens=128, activation_clamp=clamp)
    assert c.activation_clamp == stored and (stored is None or type(c.activation_clamp) is float)


@pytest.mark.parametrize("clamp", [0, -1.0, math.nan, -math.inf, True, "7"])
def test_activation_clamp_errors(clamp):
    message = f"activation_clamp: expected None or a positive float, got {clamp!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        _config(max_tokens=128, activation_clamp=clamp)


# --- reasons -----------------------------------------------------------------------------------

BAD = [
    (dict(num_sms=131), ["num_sms:", "even number >= 2", "131"]),
    (dict(num_sms=0), ["num_sms:", "positive int", "0"]),
    (dict(max_tokens=True), ["max_tokens:", "positive int", "True"]),
    (dict(hidden=7168.0), ["hidden:", "positive int", "7168.0"]),
    (dict(hidden=6912), ["hidden:", "multiple of 512", "6912"]),
    (dict(hidden=7000), ["hidden:", "multiple of 512", "7000"]),
    (dict(intermediate=1920), ["intermediate:", "multiple of 256", "1920"]),
    (dict(intermediate=256), ["intermediate:", "more than 2 k-blocks", "intermediate=256 (2 k-blocks)"]),
    (dict(top_k=33, num_experts=64), ["top_k:", "at most 32", "33"]),
    (dict(top_k=9, num_experts=8), ["top_k:", "at most num_experts = 8", "9"]),
    (dict(max_tokens=7, top_k=6), ["max_tokens:", "multiple of 4", "7 * 6 = 42"]),
    (dict(max_tokens=1 << 20), ["max_tokens", "shared memory <= 232448 bytes at 2 stages", "max_tokens=1048576"]),
    (dict(num_experts=1 << 16, max_tokens=4096), ["max_tokens, num_experts:", "29 bits", "num_experts=65536"]),
    (dict(max_tokens=1 << 28), ["max_tokens, num_experts, top_k:", "num_experts * max_tokens < 2**32",
                                "8589934592"]),
    (dict(hidden=32768), ["hidden:", "combine staging", "hidden=32768"]),
    (dict(hidden=13824), ["hidden:", "multiple of 512 bytes", "hidden=13824 (6912 bytes)"]),
]


@pytest.mark.parametrize("kwargs,parts", BAD, ids=[str(k) for k, _ in BAD])
def test_reasons_name_argument_expected_and_actual(kwargs, parts):
    args = MODEL | dict(max_tokens=4096) | kwargs
    reason = H.sm90_fused_moe_reason(**args)
    assert reason is not None
    for part in parts:
        assert part in reason, (part, reason)
    with pytest.raises(ValueError, match=re.escape(reason)):
        H.sm90_fused_moe_config(**args)


def test_good_shapes_have_no_reason():
    for t in (4, 8, 128, 4096, 32768):
        assert H.sm90_fused_moe_reason(**MODEL, max_tokens=t) is None
    assert H.sm90_fused_moe_reason(hidden=512, intermediate=512, num_experts=1, top_k=1, max_tokens=4,
                                   num_sms=2) is None


# --- against the kernel ------------------------------------------------------------------------

_HEADER = "sm90_fp8_mega_moe.cuh"
_ANCHOR = '"SM90 MegaMoE smem layout overflows (pull pending list)");'
_PROBE = ("    static_assert(::DgSmemCheck<SMEM_PULL_PENDING_OFFSET + SMEM_PULL_PENDING_SIZE, ::DgExpectedSmem<"
          "kNumMaxTokensPerRank, kHidden, kIntermediateHidden, kNumExperts, kNumTopk, BLOCK_M, kNumStages, kNumSMs, "
          "kHalfL2CD>::value>::ok, \"shared-memory probe\");\n")


def _toolchain():
    from custom_calls.deep_gemm import toolchain

    try:
        return toolchain.find_nvcc(), toolchain.deep_gemm_include_dir()
    except toolchain.ToolchainError as e:
        pytest.skip(f"needs nvcc and the sgl-deep-gemm headers: {e}")


def _flags() -> list[str]:
    from custom_calls.deep_gemm.compiler import NVCC_FLAGS

    return ["--gpu-architecture=sm_90a", *NVCC_FLAGS]


def _kernel_parameter_names(inc) -> list[str]:
    """The kernel's template parameter names, in order (read from the header)."""
    text = (inc / "deep_gemm" / "impls" / _HEADER).read_text()
    end = text.index("sm90_fp8_mega_moe_impl(void* y")
    block = text[text.rindex("template <", 0, end):end]
    block = re.sub(r"//[^\n]*", "", block)
    return re.findall(r"\b(?:uint32_t|bool|float)\s+(\w+)", block)


def _template_args(c) -> list[tuple[str, str]]:
    """All 36 explicit template arguments of the instantiation ``c`` stands for (name, C++ text)."""
    def b(v):
        return "true" if v else "false"

    clamp = ("cute::numeric_limits<float>::infinity()" if c.activation_clamp is None
             else float(np.float32(c.activation_clamp)).hex() + "f")
    buf = c.buffer
    return [
        ("kNumMaxTokensPerRank", c.max_tokens), ("kHidden", c.hidden), ("kIntermediateHidden", c.intermediate),
        ("kNumExperts", c.num_experts), ("kNumTopk", c.top_k), ("kNumExpertsPerWave", c.experts_per_wave),
        ("BLOCK_M", c.block_m), ("BLOCK_N", c.block_n), ("BLOCK_K", c.block_k),
        ("kNumMaxPoolTokens", buf.pool_tokens), ("kNumPaddedSFPoolTokens", buf.padded_sf_tokens),
        ("kNumRingTokens", buf.pool_tokens), ("kNumStages", c.num_stages),
        ("kNumDispatchThreads", c.num_dispatch_threads), ("kNumNonEpilogueThreads", c.num_non_epilogue_threads),
        ("kNumEpilogueThreads", c.num_epilogue_threads), ("kNumSMs", c.num_sms), ("kNumRanks", 1),
        ("kActivationClamp", clamp), ("kFastMath", b(c.fast_math)), ("kEpilogueRegisterBudget", 0),
        ("kReuseAccumAsFinal", b(c.reuse_accum_as_final)), ("kL2ArrivalCounter", b(c.l2_arrival_counter)),
        ("kL2EpilogueRequiresFullSync", b(c.l2_epilogue_full_sync)), ("kHalfL2CD", b(c.half_l2_cd)),
        ("kClusterSize", 1), ("kMulticastOnB", "false"), ("kL2LagUnits", 0), ("kL2CDPasses", 0), ("kTrace", "false"),
        ("kTraceEpi", "false"), ("kL2StageMode", 0), ("kPDL", "false"), ("kEarlyCombineMode", 0),
        ("kPullPublishBatch", 1), ("kPullEagerPublish", "false"),
    ]


def _instantiation(c) -> str:
    args = ",\n        ".join(f"{v} /* {n} */" for n, v in _template_args(c))
    return f"reinterpret_cast<void*>(&deep_gemm::sm90_fp8_mega_moe_impl<\n        {args}>)"


def _unit(configs, prelude: str = "") -> str:
    ptrs = ",\n    ".join(_instantiation(c) for c in configs)
    return (f"{prelude}\n#include <deep_gemm/impls/{_HEADER}>\n\n"
            f"static void* __instantiate_kernels[] = {{\n    {ptrs}\n}};\n")


def _nvcc(nvcc, cwd, *args):
    return subprocess.run([str(nvcc), *map(str, args)], cwd=cwd, capture_output=True, text=True)


def test_template_arguments_follow_the_kernel(tmp_path):
    _, inc = _toolchain()
    names = _kernel_parameter_names(inc)
    assert [n for n, _ in _template_args(_config(max_tokens=128))] == names[:36]
    # the rest are derived from these (shapes, warp counts)
    assert names[36:] == ["L1_SHAPE_N", "L1_SHAPE_K", "L2_SHAPE_N", "L2_SHAPE_K", "kNumDispatchWarps",
                          "kNumMMANonEpilogueWarps", "kNumEpilogueWarps", "kNumEpilogueWarpgroups", "kNumThreads",
                          "kNumTokensPerWarp", "kNumExpertsPerRank"]


def _probe_configs():
    p, d = _config(max_tokens=4096), _config(max_tokens=128)
    out = [p, d, dataclasses.replace(p, num_stages=2), dataclasses.replace(d, num_stages=2),
           # the per-expert routing counts outgrow the tile table: they size that region
           H.sm90_fused_moe_config(max_tokens=8, hidden=1024, intermediate=512, num_experts=2048, top_k=8,
                                   num_sms=132)]
    # hidden 1024, intermediate 256, 8 experts, top-4: 2 k-blocks in GEMM2, which the config refuses (it
    # keeps more k-blocks than stages); built by hand, with the full L2 epilogue sync such a kernel needs
    for t in (1, 64, 512):
        bm = 64 if t * 4 < 64 * 8 else 128
        c = dataclasses.replace(d, max_tokens=t, hidden=1024, intermediate=256, num_experts=8, top_k=4,
                                experts_per_wave=8, block_m=bm, half_l2_cd=bm == 128, l2_epilogue_full_sync=True)
        stages = max(s for s in range(2, 16) if _smem(c, num_stages=s) <= SMEM_CAPACITY)
        out.append(dataclasses.replace(c, num_stages=stages))
    return out


def _probe_source(configs, expected) -> str:
    specs = "\n".join(
        f"template <> struct DgExpectedSmem<{c.max_tokens}, {c.hidden}, {c.intermediate}, {c.num_experts}, {c.top_k}, "
        f"{c.block_m}, {c.num_stages}, {c.num_sms}, {'true' if c.half_l2_cd else 'false'}> "
        f"{{ static constexpr uint32_t value = {e}; }};" for c, e in zip(configs, expected))
    prelude = ("#include <cstdint>\n"
               "template <uint32_t kKernel, uint32_t kOurs> struct DgSmemCheck {\n"
               "    static_assert(kKernel == kOurs, \"the kernel's dynamic shared memory differs from "
               "sm90_fused_moe_smem_bytes\");\n"
               "    static constexpr bool ok = true;\n};\n"
               "template <uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, bool>\n"
               "struct DgExpectedSmem;\n" + specs)
    return _unit(configs, prelude)


def _probe_header(tmp_path, inc):
    """A copy of the kernel header, searched first, with the shared-memory static_assert inserted."""
    text = (inc / "deep_gemm" / "impls" / _HEADER).read_text()
    assert text.count(_ANCHOR) == 1
    at = text.index(_ANCHOR) + len(_ANCHOR) + 1
    probe_inc = tmp_path / "probe_inc"
    (probe_inc / "deep_gemm" / "impls").mkdir(parents=True)
    (probe_inc / "deep_gemm" / "impls" / _HEADER).write_text(text[:at] + _PROBE + text[at:])
    return probe_inc


def test_smem_matches_the_kernel(tmp_path):
    nvcc, inc = _toolchain()
    probe_inc = _probe_header(tmp_path, inc)
    configs = _probe_configs()
    (tmp_path / "probe.cu").write_text(_probe_source(configs, [c.smem_bytes for c in configs]))
    r = _nvcc(nvcc, tmp_path, "probe.cu", "-ptx", "-o", "probe.ptx", *_flags(), "-I", probe_inc, "-I", inc)
    assert r.returncode == 0, r.stderr[-6000:]
    ptx = (tmp_path / "probe.ptx").read_text()
    assert ptx.count(".entry _ZN9deep_gemm22sm90_fp8_mega_moe_impl") == len(configs)


def test_smem_probe_catches_a_difference(tmp_path):
    nvcc, inc = _toolchain()
    probe_inc = _probe_header(tmp_path, inc)
    c = _config(max_tokens=128)
    (tmp_path / "probe.cu").write_text(_probe_source([c], [c.smem_bytes + 16]))
    r = _nvcc(nvcc, tmp_path, "probe.cu", "-ptx", "-o", "probe.ptx", *_flags(), "-I", probe_inc, "-I", inc)
    assert r.returncode != 0 and "differs from sm90_fused_moe_smem_bytes" in r.stderr, r.stderr[-3000:]


def test_chosen_configs_compile(tmp_path):
    nvcc, inc = _toolchain()
    configs = [_config(max_tokens=4096), _config(max_tokens=128, activation_clamp=7.0)]
    (tmp_path / "kernel.cu").write_text(_unit(configs))
    r = _nvcc(nvcc, tmp_path, "kernel.cu", "--cubin", "-o", "kernel.cubin", *_flags(), "-I", inc)
    assert r.returncode == 0, r.stderr[-6000:]
    data = (tmp_path / "kernel.cubin").read_bytes()
    assert data[:4] == b"\x7fELF" and data.count(b"_ZN9deep_gemm22sm90_fp8_mega_moe_impl") >= len(configs)


@pytest.mark.parametrize("change,message", [
    (dict(intermediate=1920), "L1 N block count must be even"),
    (dict(num_sms=131), "Number of SMs must be even"),
    (dict(hidden=13824), "Combine chunk must be a multiple of 32 16-byte elements"),
], ids=["intermediate", "num_sms", "hidden"])
def test_the_kernel_refuses_what_the_reason_refuses(tmp_path, change, message):
    nvcc, inc = _toolchain()
    assert H.sm90_fused_moe_reason(**(MODEL | dict(max_tokens=4096) | change)) is not None
    c = dataclasses.replace(_config(max_tokens=4096), **change)
    (tmp_path / "kernel.cu").write_text(_unit([c]))
    r = _nvcc(nvcc, tmp_path, "kernel.cu", "-ptx", "-o", "kernel.ptx", *_flags(), "-I", inc)
    assert r.returncode != 0 and message in r.stderr, r.stderr[-3000:]

