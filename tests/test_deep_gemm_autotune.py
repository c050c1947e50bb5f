"""The tuned-config cache of the SM90 grouped GEMMs and the command-buffer launcher.

Without a GPU: the legal configs (against the templates' shared-memory layout and static asserts,
restated here from the 0.2.5 headers), the cache (key, round trip, corrupt files), the policy hook
in the ops and warmup, and the launcher's two FFI targets and their traits. On an SM90 GPU
(``gpu`` marker): launches captured in XLA command buffers against plain launches while buffer
addresses change. The search that fills the cache: tests/test_bench_autotune_search.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from custom_calls.deep_gemm import autotune as A, families, ops, sm90_gemm as G
from custom_calls.deep_gemm.family import GemmProblem
from custom_calls.deep_gemm.sm90_bf16 import FAMILY as BF16
from custom_calls.deep_gemm.sm90_fp8_1d2d import FAMILY as FP8
from custom_calls.native import launch
from custom_calls.settings import KernelSettings
from layouts import gemm_format
from test_deep_gemm_host import needs_nvcc

CAP = 232448
DEVICE = "NVIDIA H200"


def _p(recipe: str, kind: str, m: int, n: int, k: int, g: int, em: int | None = None) -> GemmProblem:
    """A grouped SM90 problem in ``recipe`` (expected_m: masked only)."""
    return families.gemm_problem(kind, m, n, k, g, recipe, 90, em)


def _id(p: GemmProblem) -> str:
    return f"{p.family.name}-{p.gemm_kind}-m{p.m}-n{p.n}-k{p.k}-g{p.num_groups}-em{p.expected_m}"


PROBLEMS = [
    _p("fp8_block", "contig", 32 * 1024, 4096, 7168, 32),
    _p("fp8_block", "contig", 8 * 4096, 7168, 2048, 8),
    _p("fp8_block", "masked", 256, 4096, 7168, 32, 32),
    _p("fp8_block", "masked", 512, 7168, 2048, 32, 128),
    _p("bf16", "contig", 32 * 1024, 4096, 7168, 32),
    _p("bf16", "masked", 256, 1536, 512, 6, 7),
]


# --- the templates' own rules, restated independently -------------------------------------------

def kernel_smem(c: G.Sm90GemmConfig, k: int) -> int:
    """Shared memory the kernel itself lays out (sm90_fp8_gemm_1d2d.cuh / sm90_bf16_gemm.cuh)."""
    barriers = 2 * c.num_stages * 8
    if c.family is FP8:
        d = -(-c.block_m * c.block_n * 2 // 1024) * 1024
        sfa = -(-c.block_m * 4 // 128) * 128
        sfb = -(-(-(-k // 128)) * (1 if 128 % c.block_n == 0 else 2) * 4 // 8) * 8
        return d + c.num_stages * (c.block_m * 128 + c.block_n * 128 + sfa) + sfb + barriers
    d = -(-c.block_m * c.block_n * 2 // 1024) * 1024
    return d + c.num_stages * (c.block_m * 64 * 2 + c.block_n * 64 * 2) + barriers


def static_asserts_hold(c: G.Sm90GemmConfig, m: int, n: int) -> None:
    bk = 128 if c.family is FP8 else 64
    assert c.block_k == bk
    assert c.block_m % 64 == 0 or c.block_m < 64
    assert c.block_m >= 64 or c.num_math_threads == 128
    assert c.num_math_threads == (128 if c.block_m <= 64 else 256) and c.num_tma_threads == 128
    if c.family is FP8:
        assert -(-c.block_n // 128) == 1 or math.gcd(c.block_n, 128) == c.block_n - 128
    atom = c.block_n if c.swizzle_cd == 0 else c.swizzle_cd // 2
    assert c.block_n % atom == 0 and c.block_n // atom <= 32 and atom % 8 == 0
    if c.family is BF16:
        assert c.swizzle_cd > 0  # the bf16 store path asserts a swizzle
    assert c.cluster in (1, 2) and c.num_sms % c.cluster == 0
    wgmma_a = 64 * bk  # the kernels' WGMMA padding check counts fp8 bytes for both kernels
    assert wgmma_a <= c.block_m * bk * (1 if c.family is FP8 else 2) + \
        c.block_n * bk * (1 if c.family is FP8 else 2) * c.num_stages
    if c.gemm_kind == "contig":
        assert 128 % c.block_m == 0
    if c.gemm_kind == "masked":
        assert m % c.block_m == 0 and (-(-n // c.block_n)) % c.cluster == 0


@pytest.mark.parametrize("p", PROBLEMS, ids=_id)
def test_every_candidate_is_legal_and_the_heuristic_is_one(p):
    cands = G.sm90_candidates(p, 132)
    assert len(cands) == len(set(cands)) > 100
    for c in cands:
        assert G.sm90_config_reason(c, p.m, p.n, p.k) is None
        static_asserts_hold(c, p.m, p.n)
        assert kernel_smem(c, p.k) <= c.smem_bytes <= CAP
        assert c.smem_bytes == G.sm90_smem_bytes(c.family, c.cd_dtype, p.k, c.block_m, c.block_n, c.num_stages)
    assert G.sm90_gemm_config(p, 132) in cands


def test_candidates_span_tiles_multicast_stages_and_swizzles():
    p = PROBLEMS[0]
    cands = G.sm90_candidates(p, 132)
    assert {(c.cluster_m, c.cluster_n) for c in cands} == {(1, 1), (1, 2), (2, 1)}
    assert {c.block_m for c in cands} == {16, 32, 64, 128}  # contig blocks never straddle 128-row segments
    assert {c.swizzle_cd for c in cands} == {0, 32, 64, 128}
    tile = [c for c in cands if (c.block_m, c.block_n, c.cluster_m, c.cluster_n, c.swizzle_cd) == (128, 128, 1, 1, 128)]
    most = G.sm90_max_stages(FP8, "bf16", p.k, 128, 128)
    assert sorted(c.num_stages for c in tile) == list(range(2, most + 1))
    assert all(c.block_n <= 192 for c in cands)  # larger FP8 tiles spill
    # masked with an odd number of N blocks: no cluster (the paired CTAs must stay in one group)
    odd = _p("fp8_block", "masked", 256, 3 * 128, 512, 4, 16)
    assert all(c.cluster == 1 or (-(-odd.n // c.block_n)) % 2 == 0 for c in G.sm90_candidates(odd, 132))
    assert any(c.cluster == 2 for c in G.sm90_candidates(odd, 132))


def test_config_reason_names_each_illegal_field():
    p = PROBLEMS[2]
    good = G.sm90_gemm_config(p, 132)
    assert G.sm90_config_reason(good, p.m, p.n, p.k) is None
    bad = {
        "BLOCK_N 176": dataclasses.replace(good, block_n=176),
        "num_stages": dataclasses.replace(good, num_stages=good.num_stages + 1),
        "fields inconsistent": dataclasses.replace(good, smem_bytes=good.smem_bytes + 1024),
        "swizzle_cd": dataclasses.replace(good, swizzle_cd=16),
        "N blocks": dataclasses.replace(good, block_n=112, cluster_n=2),  # ceil(4096/112) = 37 blocks
        "cluster": dataclasses.replace(good, cluster_m=2, cluster_n=2),
    }
    for words, cfg in bad.items():
        reason = G.sm90_config_reason(cfg, p.m, p.n, p.k)
        assert reason and words in reason, (words, reason)
    tall = G.sm90_build_config(FP8, "masked", "bf16", 32, 132, 7168, 256, 128, 1, 1)
    assert G.sm90_config_reason(tall, 512, 4096, 7168) is None
    assert "does not divide m_pad" in G.sm90_config_reason(tall, 384, 4096, 7168)
    tiny = G.sm90_build_config(FP8, "masked", "bf16", 32, 132, 7168, 16, 16, 1, 1, 2, 32)
    assert "WGMMA" in G.sm90_config_reason(tiny, 256, 4096, 7168)
    contig = dataclasses.replace(G.sm90_gemm_config(PROBLEMS[0], 132), block_m=256, block_n=128, num_math_threads=256)
    assert "straddle" in G.sm90_config_reason(contig, 32768, 4096, 7168)


def test_problem_and_policy_validation():
    with pytest.raises(ValueError, match="expected_m"):
        GemmProblem(FP8, gemm_format("fp8_block", 90), "masked", 256, 512, 512, 4, 0)
    with pytest.raises(ValueError, match="expected_m"):
        GemmProblem(FP8, gemm_format("fp8_block", 90), "contig", 256, 512, 512, 4, 16)
    with pytest.raises(ValueError, match="does not serve"):
        GemmProblem(FP8, gemm_format("bf16", 90), "contig", 256, 512, 512, 4)
    with pytest.raises(ValueError, match="mode"):
        A.TuningPolicy(mode="fast")
    with pytest.raises(ValueError, match="searching is moe_jax.bench.autotune_search"):
        A.TuningPolicy(mode="search")
    assert _p("fp8_block", "masked", 256, 512, 512, 4, 1000).expected_m == 256
    assert _p("bf16", "masked", 256, 512, 512, 4, 0).expected_m == 1


# --- the cache ----------------------------------------------------------------------------------

def _entry(p: GemmProblem, cfg: G.Sm90GemmConfig) -> A.TunedEntry:
    return A.TunedEntry(config=cfg, heuristic=G.sm90_gemm_config(p, 132), tuned=cfg != G.sm90_gemm_config(p, 132),
                        heuristic_us=(100.0, 101.0), config_us=(90.0, 91.0), num_candidates=20, created="now")


def _other(p: GemmProblem) -> G.Sm90GemmConfig:
    """A legal config other than the heuristic's: another tile of the same BLOCK_M."""
    heur = G.sm90_gemm_config(p, 132)
    return next(c for c in G.sm90_tile_configs(p, 132) if c.block_m == heur.block_m and c != heur)


@needs_nvcc
def test_key_covers_every_field_and_round_trips(cache):
    p = PROBLEMS[2]
    key = A.tuning_key(p, 132, DEVICE)
    variants = [A.tuning_key(dataclasses.replace(p, expected_m=31), 132, DEVICE),
                A.tuning_key(dataclasses.replace(p, m=512), 132, DEVICE),
                A.tuning_key(dataclasses.replace(p, n=2048), 132, DEVICE),
                A.tuning_key(dataclasses.replace(p, num_groups=16), 132, DEVICE),
                A.tuning_key(dataclasses.replace(p, family=BF16, fmt=gemm_format("bf16", 90)), 132, DEVICE),
                A.tuning_key(p, 114, DEVICE), A.tuning_key(p, 132, "NVIDIA H100 80GB HBM3"),
                dataclasses.replace(key, template="0.2.6+0"), dataclasses.replace(key, nvcc="V12.9"),
                dataclasses.replace(key, schema=A.SCHEMA + 1)]
    assert len({v.path() for v in variants + [key]}) == len(variants) + 1
    assert key.path().parent == cache / "tuned"
    assert A.load_entry(key) is None
    entry = _entry(p, _other(p))
    path = A.store_entry(key, entry)
    A.clear_memory_cache()
    assert A.load_entry(key) == entry and json.loads(path.read_text())["key"]["device_kind"] == DEVICE
    assert not list((cache / "tuned").glob("*.json.*"))  # no temporary file left behind
    with pytest.raises(ValueError, match="device_kind"):
        A.tuning_key(p, 132, None)


@needs_nvcc
@pytest.mark.parametrize("corruption", ["not json", "truncated", "other key", "illegal config", "missing field",
                                        "a list"])
def test_corrupt_cache_file_is_ignored_with_a_warning(cache, corruption):
    p = PROBLEMS[2]
    key = A.tuning_key(p, 132, DEVICE)
    path = A.store_entry(key, _entry(p, _other(p)))
    d = json.loads(path.read_text())
    if corruption == "not json":
        path.write_text("{{{")
    elif corruption == "truncated":
        path.write_text(path.read_text()[:100])
    elif corruption == "other key":
        d["key"]["problem"]["n"] = 1024
        path.write_text(json.dumps(d))
    elif corruption == "illegal config":
        d["config"]["num_stages"] = 40
        path.write_text(json.dumps(d))
    elif corruption == "missing field":
        del d["config"]["block_n"]
        path.write_text(json.dumps(d))
    else:
        path.write_text("[1, 2]")
    A.clear_memory_cache()
    with pytest.warns(RuntimeWarning, match="ignoring the tuned-config cache file"):
        assert A.load_entry(key) is None
    # the op path falls back to the heuristic (and says so, once)
    A.clear_memory_cache()
    with pytest.warns(RuntimeWarning, match="ignoring"):
        cfg = A.sm90_config(p, 132, A.TuningPolicy(mode="cached", device_kind=DEVICE))
    assert cfg == G.sm90_gemm_config(p, 132)


@needs_nvcc
def test_policy_modes_pick_the_config(cache):
    p = PROBLEMS[3]
    heur, other = G.sm90_gemm_config(p, 132), _other(p)
    cached = A.TuningPolicy(mode="cached", device_kind=DEVICE)
    assert A.sm90_config(p, 132, cached) == heur  # nothing cached yet
    A.store_entry(A.tuning_key(p, 132, DEVICE), _entry(p, other))
    assert A.sm90_config(p, 132, cached) == other
    assert A.sm90_config(p, 132, A.TuningPolicy(mode="off")) == heur
    assert A.sm90_config(p, 132, A.TuningPolicy(mode="cached", device_kind="NVIDIA H100")) == heur
    # an entry that kept the heuristic yields today's heuristic
    A.store_entry(A.tuning_key(p, 132, DEVICE), _entry(p, heur))
    assert A.sm90_config(p, 132, cached) == heur


@pytest.fixture
def captured_launch(monkeypatch):
    """The ops up to the launch on any machine (132 SMs, an H200), _run recording the kernel."""
    calls = []

    def fake_run(kern, arch, inputs, outputs, settings):
        calls.append(kern)
        return [jnp.zeros(o.shape, o.dtype) for o in outputs]

    monkeypatch.setattr(ops, "_environment_reason", lambda arch, settings: None)
    monkeypatch.setattr(ops, "_num_sms", lambda settings: settings.num_sms or 132)
    monkeypatch.setattr(ops, "_run", fake_run)
    monkeypatch.setattr(A, "detected_device_kind", lambda: DEVICE)
    return calls


@needs_nvcc
def test_ops_and_warmup_use_the_tuned_config_when_enabled(cache, captured_launch, monkeypatch):
    from custom_calls.deep_gemm.warmup import GemmShape, kernel_for

    g, m_pad, n, k, em = 6, 256, 1536, 512, 7
    p = families.gemm_problem("masked", m_pad, n, k, g, "bf16", 90, em)
    assert p == PROBLEMS[5]
    other = _other(p)
    A.store_entry(A.tuning_key(p, 132, DEVICE), _entry(p, other))

    def op(mode):
        ops.m_grouped_gemm_masked(jnp.ones((g, m_pad, k), jnp.bfloat16), jnp.ones((g, n, k), jnp.bfloat16),
                                  jnp.full((g,), 3, jnp.int32), expected_m=em, recipe="bf16", arch=90,
                                  settings=KernelSettings(gemm_tuning=mode))
        return captured_launch.pop()

    shape = GemmShape("masked", m_pad, n, k, g, "bf16", expected_m=em)
    for mode, want in (("off", G.sm90_gemm_config(p, 132)), ("cached", other)):
        name, src, plan_fn = op(mode)
        assert src == want.family.source(want, n, k)
        assert plan_fn("/x.cubin").smem == want.smem_bytes
        assert kernel_for(shape, 90, 132, A.TuningPolicy(mode=mode)) == (name, src)  # warmup compiles it too
    heur = G.sm90_gemm_config(p, 132)
    assert kernel_for(shape, 90, 132, A.TuningPolicy(mode="off"))[1] == heur.family.source(heur, n, k)


# --- the command-buffer launcher ------------------------------------------------------------------

def test_command_buffer_option_selects_the_target(monkeypatch):
    p = PROBLEMS[5]
    cfg = G.sm90_gemm_config(p, 132)

    def plan():
        return p.family.plan(cfg, "/x.cubin", m=p.m, n=p.n, k=p.k)

    targets = []

    def fake_ffi_call(target, outs, **kw):
        targets.append(target)
        return lambda *a, **attrs: [jnp.zeros(o.shape, o.dtype) for o in outs]

    monkeypatch.setattr(launch, "register", lambda: None)
    monkeypatch.setattr(jax.ffi, "ffi_call", fake_ffi_call)
    ins = [jnp.zeros((p.num_groups, p.m, p.k), jnp.bfloat16), jnp.zeros((p.num_groups, p.n, p.k), jnp.bfloat16),
           jnp.zeros((p.num_groups,), jnp.int32)]
    outs = [jax.ShapeDtypeStruct((p.num_groups, p.m, p.n), jnp.bfloat16)]
    for flag in (False, True):
        launch.launch(plan(), ins, outs, command_buffer=flag)
    launch.launch(plan(), ins, outs)
    assert targets == [launch.FFI_TARGET, launch.FFI_TARGET_CMD_BUFFER, launch.FFI_TARGET]


_TRAITS = textwrap.dedent("""
    #include <dlfcn.h>
    #include <cstdio>
    #include "xla/ffi/api/c_api.h"
    // Asks a handler for its metadata, as XLA does when it registers one.
    int main(int argc, char** argv) {
      void* lib = dlopen(argv[1], RTLD_NOW);
      if (!lib) { std::printf("dlopen failed\\n"); return 1; }
      for (int i = 2; i < argc; ++i) {
        auto fn = reinterpret_cast<XLA_FFI_Handler*>(dlsym(lib, argv[i]));
        if (!fn) { std::printf("%s missing\\n", argv[i]); return 1; }
        XLA_FFI_Metadata metadata = {XLA_FFI_Metadata_STRUCT_SIZE};
        XLA_FFI_Metadata_Extension ext = {{XLA_FFI_Metadata_Extension_STRUCT_SIZE, XLA_FFI_Extension_Metadata,
                                           nullptr}, &metadata};
        XLA_FFI_CallFrame frame = {};
        frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
        frame.extension_start = &ext.extension_base;
        if (fn(&frame) != nullptr) { std::printf("%s: metadata call failed\\n", argv[i]); return 1; }
        std::printf("%s %u\\n", argv[i], metadata.traits);
      }
      return 0;
    }
""")


@pytest.mark.slow
@needs_nvcc
def test_launcher_exports_a_plain_and_a_command_buffer_handler(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_JAX_CACHE_DIR", str(tmp_path))
    lib = launch.build_handler()
    src = tmp_path / "traits.cc"
    src.write_text(_TRAITS)
    exe = tmp_path / "traits"
    subprocess.run([launch.find_cxx(), "-std=c++17", f"-I{jax.ffi.include_dir()}", str(src), "-o", str(exe), "-ldl"],
                   check=True, capture_output=True)
    out = subprocess.run([str(exe), str(lib), "MoeJaxDeepGemmLaunch", "MoeJaxDeepGemmLaunchCmdBuffer"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    traits = dict(line.split() for line in out.stdout.splitlines())
    assert traits == {"MoeJaxDeepGemmLaunch": "0", "MoeJaxDeepGemmLaunchCmdBuffer": "1"}  # kCmdBufferCompatible


# --- on the GPU -----------------------------------------------------------------------------------

def _custom_calls_in_command_buffers(thunk_sequence: str) -> int:
    """Custom-call thunks nested under a kCommandBuffer thunk in XLA's thunk-sequence dump (a
    command buffer's thunks are the indented lines after its own)."""
    count, inside = 0, False
    for line in thunk_sequence.splitlines():
        entry = line.strip()
        if not entry:
            continue
        nested = line[:1].isspace()
        if not nested:
            inside = "kCommandBuffer" in entry
        elif inside and "kCustomCall" in entry:
            count += 1
    return count


def test_thunk_dump_reader_counts_only_captured_custom_calls():
    """The reader of XLA's thunk-sequence dump, on the dump's layout as XLA 0.11 writes it (one H200
    run): thunks nested under a kCommandBuffer line are indented; top-level ones are not captured."""
    captured = ("000: kCommandBuffer [source | sink] \n"
                "    001: kCustomKernel [source       | next=003 (2)] loop_clamp_fusion grid: [1, 1, 1]\n"
                "    003: kCustomCall   [prev=002 (1) | sink        ] kCustomCall\n"
                "    004: kCustomCall   [prev=002 (2) | sink        ] kCustomCall\n")
    plain = ("001: kCustomKernel [source       | next=003 (2)] loop_clamp_fusion grid: [1, 1, 1]\n"
             "003: kCustomCall   [prev=002 (1) | sink        ] kCustomCall\n")
    assert _custom_calls_in_command_buffers(captured) == 2
    assert _custom_calls_in_command_buffers(plain) == 0
    assert _custom_calls_in_command_buffers(captured + plain) == 2


@pytest.mark.gpu
def test_command_buffer_launches_match_plain_ones_as_addresses_change(monkeypatch, tmp_path):
    """Six grouped GEMMs in one program, recorded in an XLA command buffer (CUDA graph), called with
    changing inputs (new buffer addresses each call) and repeated ones: bit-identical to the plain
    launches every time. XLA forms command buffers on its thunk sequence, after the HLO: the
    capture is read from the thunk sequence XLA dumps."""
    import custom_calls.deep_gemm as dg

    g, m_pad, n, k = 4, 128, 256, 512
    rng = np.random.default_rng(0)

    def f(a, w, mm, settings):
        outs = []
        for i in range(6):
            outs.append(dg.m_grouped_gemm_masked(a * (i + 1), w, mm, expected_m=64, recipe="bf16", arch=90,
                                                 settings=settings))
        return outs

    compiled, captured = {}, {}
    for flag in ("0", "1"):
        settings = KernelSettings(command_buffer=flag == "1")
        sample = (jnp.zeros((g, m_pad, k), jnp.bfloat16), jnp.zeros((g, n, k), jnp.bfloat16),
                  jnp.zeros((g,), jnp.int32))
        dump = tmp_path / f"dump{flag}"
        opts = {"xla_gpu_graph_min_graph_size": 1, "xla_dump_to": str(dump)}
        # the settings are a static argument: each is its own trace and program
        compiled[flag] = jax.jit(f, static_argnames="settings", compiler_options=opts).lower(
            *sample, settings=settings).compile()
        (thunks,) = dump.glob("*thunk_sequence_after_thunk_passes.txt")
        captured[flag] = _custom_calls_in_command_buffers(thunks.read_text())
    text = compiled["1"].as_text()
    assert launch.FFI_TARGET_CMD_BUFFER in text and launch.FFI_TARGET_CMD_BUFFER not in compiled["0"].as_text()
    assert captured == {"0": 0, "1": 6}, captured
    w = jnp.asarray(rng.standard_normal((g, n, k)), jnp.bfloat16)
    mm = jnp.asarray([5, 128, 0, 77], jnp.int32)
    inputs = [jnp.asarray(rng.standard_normal((g, m_pad, k)), jnp.bfloat16) for _ in range(3)]
    for a in inputs + inputs[:1] * 3 + inputs[::-1]:
        plain = compiled["0"](a, w, mm)
        graph = compiled["1"](a, w, mm)
        for x, y in zip(plain, graph):
            xv, yv = np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32))
            for gi, rows in enumerate(np.asarray(mm)):
                np.testing.assert_array_equal(xv[gi, :rows], yv[gi, :rows])
