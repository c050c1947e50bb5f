"""The SM90 fused MoE kernel's configuration (custom_calls/deep_gemm/fused_moe_config.py): the choice
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
from custom_calls.deep_gemm import fused_moe_config as H

SMEM_CAPACITY = 232448
# DeepSeek-V3-like layer on one H200: prefill (4096 tokens) and decode (128 tokens)
MODEL = dict(hidden=7168, intermediate=2048, num_experts=32, top_k=8, num_sms=132)


def _config(**kw):
    return H.sm90_fused_moe_config(**(MODEL | kw))


def _smem(cfg, **kw) -> int:
    c = dataclasses.replace(cfg, **kw)
    return H.sm90_fused_moe_smem_bytes(
        max_tokens=c.max_tokens, hidden=c.hidden, intermediate=c.intermediate, num_experts=c.num_experts,
        top_k=c.top_k, block_m=c.block_m, num_stages=c.num_stages, num_sms=c.num_sms, half_l2_cd=c.half_l2_cd,
        num_dispatch_threads=c.num_dispatch_threads, l2_cd_passes=c.l2_cd_passes)


# --- the choice rule ---------------------------------------------------------------------------

def _options(c) -> tuple:
    return (c.cluster_size, c.l2_cd_passes, c.l2_stage_mode)


DEFAULT_OPTIONS = (1, 0, 0)


def test_model_configs():
    # Stage counts and shared-memory totals read from the kernel's own constants (its SMEM_* constexprs).
    p = _config(max_tokens=4096)  # four row passes of the L2 staging free room for a 4th stage; 1024
    # expected routes per expert: 2-CTA clusters
    assert (p.block_m, p.num_stages, p.smem_bytes, _options(p)) == (128, 4, 231264, (2, 4, 4))
    assert p.half_l2_cd
    d = _config(max_tokens=128)  # 32 expected routes per expert: 2-CTA clusters
    assert (d.block_m, d.num_stages, d.smem_bytes, _options(d)) == (64, 4, 213312, (2, 0, 0))
    assert not d.half_l2_cd
    # the template's defaults
    p0, d0 = _config(max_tokens=4096, schedule_options=False), _config(max_tokens=128, schedule_options=False)
    assert (p0.block_m, p0.num_stages, p0.smem_bytes, _options(p0)) == (128, 3, 197968, DEFAULT_OPTIONS)
    assert (d0.block_m, d0.num_stages, d0.smem_bytes, _options(d0)) == (64, 4, 213312, DEFAULT_OPTIONS)
    for c in (p, d, p0, d0):
        assert (c.block_n, c.block_k, c.experts_per_wave, c.num_threads, c.grid) == (256, 128, 32, 384, 132)
        assert (c.num_dispatch_threads, c.num_non_epilogue_threads, c.num_epilogue_threads) == (64, 64, 256)
        assert c.activation_clamp is None and not c.pdl and not c.trace
    assert (p.pool_tokens, p.padded_sf_tokens, d.pool_tokens, d.padded_sf_tokens) == (36864, 36864, 5120, 10240)


@pytest.mark.parametrize("max_tokens,top_k,num_experts,block_m", [
    (255, 8, 32, 64), (256, 8, 32, 128),  # 63.75 and 64 expected routes per expert
    (1, 8, 32, 64), (4096, 8, 32, 128), (8, 8, 1 << 10, 64), (60, 1, 1, 64), (64, 1, 1, 128),
    (2044, 8, 256, 64), (2048, 8, 256, 128),
])
def test_block_m_rule(max_tokens, top_k, num_experts, block_m):
    c = _config(max_tokens=max_tokens, top_k=top_k, num_experts=num_experts)
    assert c.block_m == block_m
    # BLOCK_M 128 takes the row-pass L2 staging (kHalfL2CD stays set: the kernel's own choice of
    # passes, which l2_cd_passes overrides)
    assert c.half_l2_cd == (block_m == 128)
    assert (c.l2_cd_passes, c.l2_stage_mode) == ((4, 4) if block_m == 128 else (0, 0))


@pytest.mark.parametrize("max_tokens,top_k,num_experts,cluster", [
    (128, 8, 32, 2), (127, 8, 32, 1), (124, 8, 32, 1),  # 32 and 31.75 / 31 expected routes per expert
    (32, 8, 32, 1), (255, 8, 32, 2),
    # BLOCK_M 128: clusters from 128 expected routes per expert while 4 stages fit
    (256, 8, 32, 1), (511, 8, 32, 1), (512, 8, 32, 2), (4096, 8, 32, 2), (8192, 8, 32, 2),
    (16384, 8, 32, 1),  # 3 stages
    (1024, 8, 256, 2), (1020, 8, 256, 1),
])
def test_cluster_rule(max_tokens, top_k, num_experts, cluster):
    c = _config(max_tokens=max_tokens, top_k=top_k, num_experts=num_experts)
    assert c.cluster_size == cluster
    if c.block_m == 128 and c.max_tokens * c.top_k >= 128 * c.num_experts:
        # clusters exactly where they keep 4 stages
        assert (cluster == 2) == (H.sm90_fused_moe_max_stages(dataclasses.replace(c, cluster_size=2)) >= 4)


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
          "kHalfL2CD, kClusterSize, kL2CDPasses, "
          "kL2StageMode, kNumDispatchThreads, kNumNonEpilogueThreads>::value>::ok, \"shared-memory probe\");\n")


def _toolchain():
    from custom_calls.native import toolchain

    try:
        return toolchain.find_nvcc(), toolchain.deep_gemm_include_dir()
    except toolchain.ToolchainError as e:
        pytest.skip(f"needs nvcc and the sgl-deep-gemm headers: {e}")


def _flags() -> list[str]:
    from custom_calls.native.compiler import NVCC_FLAGS

    return ["--gpu-architecture=sm_90a", *NVCC_FLAGS]


def _kernel_parameter_names(inc) -> list[str]:
    """The kernel's template parameter names, in order (read from the header)."""
    text = (inc / "deep_gemm" / "impls" / _HEADER).read_text()
    end = text.index("sm90_fp8_mega_moe_impl(void* y")
    block = text[text.rindex("template <", 0, end):end]
    block = re.sub(r"//[^\n]*", "", block)
    return re.findall(r"\b(?:uint32_t|bool|float)\s+(\w+)", block)


def _template_args(c) -> list[tuple[str, str]]:
    """All 36 explicit template arguments of the instantiation ``c`` stands for (name, C++ text):
    the config's, and the values the library always uses for the rest (those of `codegen`), but
    the full L2 epilogue sync for a hand-built config whose stages are not below both GEMMs'
    k-block counts (the rule keeps them below, which spares the sync)."""
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
        ("kActivationClamp", clamp), ("kFastMath", "true"), ("kEpilogueRegisterBudget", 0),
        ("kReuseAccumAsFinal", "true"), ("kL2ArrivalCounter", "true"),
        ("kL2EpilogueRequiresFullSync", b(c.num_stages >= min(c.hidden, c.intermediate) // c.block_k)),
        ("kHalfL2CD", b(c.half_l2_cd)), ("kClusterSize", c.cluster_size), ("kMulticastOnB", b(c.cluster_size == 2)),
        ("kL2LagUnits", 0), ("kL2CDPasses", c.l2_cd_passes), ("kTrace", b(c.trace)), ("kTraceEpi", "false"),
        ("kL2StageMode", c.l2_stage_mode), ("kPDL", b(c.pdl)), ("kEarlyCombineMode", 0),
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
    p0, d0 = _config(max_tokens=4096, schedule_options=False), _config(max_tokens=128, schedule_options=False)
    # every option that changes the layout (staging passes), and one that does not (pdl)
    options = [dataclasses.replace(d0, l2_cd_passes=2),
               dataclasses.replace(p0, l2_cd_passes=4, l2_stage_mode=2, num_stages=3),
               dataclasses.replace(d, pdl=True),
               # more dispatch warps (a send buffer each) and loader warps
               dataclasses.replace(d, num_dispatch_threads=128, num_non_epilogue_threads=128),
               dataclasses.replace(d0, num_dispatch_threads=192, num_stages=3)]
    out = [p, d, p0, d0, *options, dataclasses.replace(p, num_stages=2), dataclasses.replace(d, num_stages=2),
           # the per-expert routing counts outgrow the tile table: they size that region
           H.sm90_fused_moe_config(max_tokens=8, hidden=1024, intermediate=512, num_experts=2048, top_k=8,
                                   num_sms=132)]
    # hidden 1024, intermediate 256, 8 experts, top-4: 2 k-blocks in GEMM2, which the config refuses (it
    # keeps more k-blocks than stages); built by hand, with the full L2 epilogue sync such a kernel needs
    # (`_template_args`)
    for t in (1, 64, 512):
        bm = 64 if t * 4 < 64 * 8 else 128
        c = dataclasses.replace(d0, max_tokens=t, hidden=1024, intermediate=256, num_experts=8, top_k=4,
                                experts_per_wave=8, block_m=bm, half_l2_cd=bm == 128)
        stages = max(s for s in range(2, 16) if _smem(c, num_stages=s) <= SMEM_CAPACITY)
        out.append(dataclasses.replace(c, num_stages=stages))
    return out


def _probe_source(configs, expected) -> str:
    def b(v):
        return "true" if v else "false"

    # one specialization per key: configs that differ only in what the layout does not depend on
    # (e.g. pdl) share it, with one expected size
    keys = {}
    for c, e in zip(configs, expected):
        key = (f"{c.max_tokens}, {c.hidden}, {c.intermediate}, {c.num_experts}, {c.top_k}, {c.block_m}, "
               f"{c.num_stages}, {c.num_sms}, {b(c.half_l2_cd)}, {c.cluster_size}, {c.l2_cd_passes}, "
               f"{c.l2_stage_mode}, {c.num_dispatch_threads}, {c.num_non_epilogue_threads}")
        assert keys.setdefault(key, e) == e, (key, keys[key], e)
    specs = "\n".join(f"template <> struct DgExpectedSmem<{key}> {{ static constexpr uint32_t value = {e}; }};"
                       for key, e in keys.items())
    prelude = ("#include <cstdint>\n"
               "template <uint32_t kKernel, uint32_t kOurs> struct DgSmemCheck {\n"
               "    static_assert(kKernel == kOurs, \"the kernel's dynamic shared memory differs from "
               "sm90_fused_moe_smem_bytes\");\n"
               "    static constexpr bool ok = true;\n};\n"
               "template <uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, bool,\n"
               "          uint32_t, uint32_t, uint32_t, uint32_t, uint32_t>\n"
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


@pytest.mark.slow
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


# DeepSeek-V4-Flash on one H200 (its MXFP4 experts as fp8_block after loading): a 32-expert slice
# and all 256 experts, top-6, H 4096, I 2048, swiglu_limit 10
V4_MODELS = [dict(hidden=4096, intermediate=2048, num_experts=e, top_k=6, num_sms=132) for e in (32, 256)]


@pytest.mark.parametrize("model", V4_MODELS, ids=["v4-slice", "v4-256"])
def test_deepseek_v4_shapes_have_configs(model):
    for t in (8, 32, 128, 512, 4096, 16384):  # the op's token capacities (powers of two, at least 8)
        assert H.sm90_fused_moe_reason(**model, max_tokens=t) is None, t
        c = H.sm90_fused_moe_config(**model, max_tokens=t, activation_clamp=10.0)
        assert c.smem_bytes <= SMEM_CAPACITY and H.sm90_fused_moe_options_reason(c) is None, (t, c)


@pytest.mark.slow
def test_chosen_configs_compile(tmp_path):
    nvcc, inc = _toolchain()
    # the rule's two BLOCK_Ms, and BLOCK_M 64 with four dispatch and four loader warps (512 threads:
    # registers for its math warpgroups still fit, unlike BLOCK_M 128's); DeepSeek-V4's shapes
    configs = [_config(max_tokens=4096), _config(max_tokens=128, activation_clamp=7.0),
               dataclasses.replace(_config(max_tokens=128), num_dispatch_threads=128, num_non_epilogue_threads=128),
               H.sm90_fused_moe_config(**V4_MODELS[0], max_tokens=4096, activation_clamp=10.0),
               H.sm90_fused_moe_config(**V4_MODELS[1], max_tokens=128, activation_clamp=10.0)]
    assert all(H.sm90_fused_moe_options_reason(c) is None for c in configs)
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



# --- schedule options --------------------------------------------------------------------------

def _d0():
    return _config(max_tokens=128, schedule_options=False)


OPTION_BAD = [
    (dict(cluster_size=3), ["cluster_size:", "1 or 2", "3"]),
    (dict(cluster_size=True), ["cluster_size:", "1 or 2", "True"]),
    (dict(l2_cd_passes=3), ["l2_cd_passes:", "one of (0, 1, 2, 4)", "3"]),
    (dict(l2_cd_passes=4), ["l2_cd_passes:", "64 or 128", "(32 columns per pass)"]),
    (dict(l2_stage_mode=1), ["l2_stage_mode:", "0, 2 or 4", "1"]),
    (dict(pdl=1), ["pdl:", "a bool", "1"]),
    (dict(num_dispatch_threads=128), ["num_dispatch_threads:", "multiple of 128", "128"]),
    (dict(num_dispatch_threads=96), ["num_dispatch_threads:", "a multiple of 64", "96"]),
    (dict(num_non_epilogue_threads=96), ["num_non_epilogue_threads:", "64 or 128", "96"]),
    (dict(block_m=128, half_l2_cd=True, num_dispatch_threads=192),
     ["num_dispatch_threads, num_non_epilogue_threads:", "block_m 128", "192 + 64"]),
    (dict(l2_cd_passes=4, l2_stage_mode=4), ["l2_stage_mode:", "64x256", "tile 64x256"]),
    (dict(num_stages=16), ["num_stages:", "[2, 15]", "16"]),
    (dict(num_stages=1), ["num_stages:", "[2, 15]", "1"]),
    (dict(num_stages=5), ["num_stages:", "<= 232448 bytes", "5 stages"]),
]


@pytest.mark.parametrize("change,parts", OPTION_BAD, ids=[str(c) for c, _ in OPTION_BAD])
def test_option_reasons_name_argument_expected_and_actual(change, parts):
    reason = H.sm90_fused_moe_options_reason(dataclasses.replace(_d0(), **change))
    assert reason is not None
    for part in parts:
        assert part in reason, (part, reason)


def test_rule_configs_and_candidates_are_legal_unique_and_start_with_the_rule():
    from custom_calls.deep_gemm.fused_moe import config_label
    from moe_jax.bench.fused import sm90_fused_moe_candidates

    for t in (32, 128, 512, 4096):
        base = _config(max_tokens=t)
        assert H.sm90_fused_moe_options_reason(base) is None
        for full in (False, True):
            cands = sm90_fused_moe_candidates(base, full=full)
            labels = [config_label(c) for c in cands]
            assert cands[0] == base and len(set(labels)) == len(labels) == len(set(cands))
            assert all(H.sm90_fused_moe_options_reason(c) is None for c in cands)
            # the template's defaults at this BLOCK_M and both BLOCK_Ms are there
            assert _config(max_tokens=t, schedule_options=False) in cands
            assert {c.block_m for c in cands} == {64, 128}
            # each candidate has the most stages its options leave room for (the last: one fewer)
            for c in cands[:-1]:
                more = dataclasses.replace(c, num_stages=c.num_stages + 1)
                assert H.sm90_fused_moe_options_reason(more) is not None, config_label(c)
        singles = sm90_fused_moe_candidates(base)
        assert {c.pdl for c in singles} == {False, True} and {c.cluster_size for c in singles} == {1, 2}
        # the L2 staging: the kernel's own passes, two or four column passes, four row passes (both modes)
        assert {(c.l2_cd_passes, c.l2_stage_mode) for c in singles} == {(0, 0), (2, 0), (4, 0), (4, 2), (4, 4)}
        # more dispatch warps at BLOCK_M 64 only (512 threads leave BLOCK_M 128's math too few registers)
        warps = {(c.block_m, c.num_dispatch_threads, c.num_non_epilogue_threads) for c in singles}
        assert warps == {(64, 64, 64), (128, 64, 64), (64, 128, 128), (64, 192, 64)}
        # ``full`` adds the pairs of options (e.g. four dispatch warps with programmatic launch)
        pairs = sm90_fused_moe_candidates(base, full=True)
        assert set(singles) < set(pairs)
        assert not any(c.pdl and c.num_dispatch_threads == 128 for c in singles)
        assert any(c.pdl and c.num_dispatch_threads == 128 for c in pairs)


def test_source_writes_the_template_arguments():
    """`codegen.sm90_fused_moe_source` passes the config's values and the fixed ones the library
    always uses (the template's defaults after kHalfL2CD), in the kernel's order."""
    from custom_calls.deep_gemm.codegen import sm90_fused_moe_source
    from custom_calls.deep_gemm.fused_moe import config_label

    configs = [_config(max_tokens=4096), _config(max_tokens=128, activation_clamp=7.0), _d0(),
               dataclasses.replace(_config(max_tokens=128), num_dispatch_threads=128, num_non_epilogue_threads=128,
                                   pdl=True, trace=True)]
    for c in configs:
        src = sm90_fused_moe_source(c)
        body = src[src.index("sm90_fp8_mega_moe_impl<") + len("sm90_fp8_mega_moe_impl<"):src.index(">);")]
        args = [a.strip() for a in body.split(",")]
        assert args == [str(v) for _, v in _template_args(c)], config_label(c)


def _small_slot():
    """BLOCK_M 128 with a 128-byte weight-scale slot per math warpgroup (H 2048, I 512)."""
    return H.sm90_fused_moe_config(max_tokens=256, hidden=2048, intermediate=512, num_experts=16, top_k=6,
                                   num_sms=132)


def test_a_small_weight_scale_slot_takes_row_passes_without_stmatrix():
    c = _small_slot()
    assert c.block_m == 128 and (c.l2_cd_passes, c.l2_stage_mode) == (4, 2)
    reason = H.sm90_fused_moe_options_reason(dataclasses.replace(c, l2_stage_mode=4))
    assert "l2_stage_mode:" in reason and "2, not 4" in reason and "4 with a 128-byte slot" in reason


def test_the_kernel_refuses_the_options_the_reason_refuses(tmp_path):
    nvcc, inc = _toolchain()
    bad = [dataclasses.replace(_d0(), l2_cd_passes=4), dataclasses.replace(_d0(), l2_cd_passes=4, l2_stage_mode=4),
           dataclasses.replace(_small_slot(), l2_stage_mode=4)]
    assert all(H.sm90_fused_moe_options_reason(c) for c in bad)
    (tmp_path / "kernel.cu").write_text(_unit(bad))
    r = _nvcc(nvcc, tmp_path, "kernel.cu", "-ptx", "-o", "kernel.ptx", *_flags(), "-I", inc)
    assert r.returncode != 0
    for message in ("Scatter vector width must match cols_per_lane", "L2 row-pass staging assumes the 64x256",
                    "stmatrix junk rows need a 256 B weight-SF scratch slot"):
        assert message in r.stderr, r.stderr[-3000:]
