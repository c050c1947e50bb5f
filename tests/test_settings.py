"""`custom_calls.KernelSettings`: the environment gives its defaults (read in one module), a setting
is a static argument, so changing one changes the compiled program, and the README documents the
same variables as `ENVIRONMENT`."""

from __future__ import annotations

import ast
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from custom_calls import ENVIRONMENT, KernelSettings
from custom_calls.settings import ToolchainLocations, resolve_settings

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_defaults_from_an_empty_environment():
    assert KernelSettings.from_environment({}) == KernelSettings()
    assert KernelSettings() == KernelSettings(gemm_tuning="off", command_buffer=False, allow_unverified_sm100=False,
                                              num_sms=None, w4a8_prefill="auto")
    # set but empty is unset
    empty = {v.name: "" for v in ENVIRONMENT}
    assert KernelSettings.from_environment(empty) == KernelSettings()
    assert ToolchainLocations.from_environment(empty) == ToolchainLocations()


def test_each_variable_sets_its_field():
    env = {"MOE_JAX_GEMM_TUNING": "cached", "MOE_JAX_DEEP_GEMM_COMMAND_BUFFER": "1",
           "MOE_JAX_DEEP_GEMM_SM100": "1", "MOE_JAX_NUM_SMS": "78", "MOE_JAX_W4A8_PREFILL": "expand"}
    assert KernelSettings.from_environment(env) == KernelSettings("cached", True, True, 78, "expand")
    where = ToolchainLocations.from_environment({"MOE_JAX_NVCC": "/x/nvcc", "CUDA_HOME": "/cuda", "CUDA_PATH": "/p",
                                                 "MOE_JAX_CXX": "/usr/bin/c++", "MOE_JAX_CACHE_DIR": "/c"})
    assert where == ToolchainLocations("/x/nvcc", (pathlib.Path("/cuda"), pathlib.Path("/p")), "/usr/bin/c++", "/c")


@pytest.mark.parametrize("name,value,match", [
    ("MOE_JAX_GEMM_TUNING", "on", r"\$MOE_JAX_GEMM_TUNING: expected one of \('off', 'cached'\), got 'on'"),
    ("MOE_JAX_GEMM_TUNING", "search", r"got 'search' \(searching is `python -m moe_jax.bench.tune`\)"),
    ("MOE_JAX_DEEP_GEMM_COMMAND_BUFFER", "yes", r"\$MOE_JAX_DEEP_GEMM_COMMAND_BUFFER: expected '0' or '1', got 'yes'"),
    ("MOE_JAX_DEEP_GEMM_SM100", "true", r"\$MOE_JAX_DEEP_GEMM_SM100: expected '0' or '1', got 'true'"),
    ("MOE_JAX_NUM_SMS", "0", r"\$MOE_JAX_NUM_SMS: expected a positive integer, got '0'"),
    ("MOE_JAX_NUM_SMS", "132.0", r"\$MOE_JAX_NUM_SMS: expected a positive integer, got '132.0'"),
    ("MOE_JAX_W4A8_PREFILL", "fp8",
     r"\$MOE_JAX_W4A8_PREFILL: expected one of \('auto', 'kernel', 'expand'\), got 'fp8'"),
])
def test_a_bad_variable_is_named_with_the_expected_and_the_actual_value(name, value, match):
    with pytest.raises(ValueError, match=match):
        KernelSettings.from_environment({name: value})


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"gemm_tuning": "search"}, ValueError, r"KernelSettings.gemm_tuning: expected one of \('off', 'cached'\)"),
    ({"command_buffer": 1}, TypeError, "KernelSettings.command_buffer: expected a bool, got 1"),
    ({"allow_unverified_sm100": "1"}, TypeError, "KernelSettings.allow_unverified_sm100: expected a bool"),
    ({"num_sms": 0}, ValueError, "KernelSettings.num_sms: expected None or an int >= 1, got 0"),
    ({"num_sms": True}, ValueError, "KernelSettings.num_sms: expected None or an int >= 1, got True"),
    ({"w4a8_prefill": "widen"}, ValueError,
     r"KernelSettings.w4a8_prefill: expected one of \('auto', 'kernel', 'expand'\), got 'widen'"),
])
def test_bad_fields_are_refused(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        KernelSettings(**kwargs)


def test_settings_are_frozen_hashable_and_resolved_from_the_environment_for_none(monkeypatch):
    s = KernelSettings(num_sms=66)
    assert hash(s) == hash(KernelSettings(num_sms=66)) and s != KernelSettings()
    with pytest.raises(AttributeError):
        s.num_sms = 1  # type: ignore[misc]
    monkeypatch.setenv("MOE_JAX_NUM_SMS", "12")
    assert resolve_settings(None) == KernelSettings(num_sms=12)
    assert resolve_settings(s) is s
    with pytest.raises(TypeError, match="settings: expected a custom_calls.KernelSettings or None, got dict"):
        resolve_settings({"num_sms": 12})


def _readme_environment_rows() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `([A-Z_0-9]+)` \| (.+) \|$", section, flags=re.M))


def test_the_readme_table_is_the_environment_table():
    assert _readme_environment_rows() == {v.name: v.effect for v in ENVIRONMENT}


def _reads_environment(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv") for a in node.names):
            return True
    return False


def test_only_three_library_modules_touch_the_environment():
    """The settings module (defaults), the toolchain (passes the environment on to nvcc) and Triton's
    own interpreter switch; everything else takes settings as arguments."""
    touching = sorted(str(p.relative_to(ROOT)) for pkg in ("layouts", "custom_calls", "moe_jax")
                      for p in (ROOT / pkg).rglob("*.py") if _reads_environment(ast.parse(p.read_text())))
    assert touching == ["custom_calls/native/toolchain.py", "custom_calls/settings.py",
                        "custom_calls/triton/interpret.py"]


@pytest.fixture
def lowered_gemm(monkeypatch):
    """The DeepGEMM masked GEMM lowered on any machine: environment accepted, a device of 132 SMs,
    compilation replaced by a fake cubin path. Returns (function, count of its traces)."""
    from custom_calls.deep_gemm import ops
    from custom_calls.native import compiler
    from custom_calls.native import launch

    class FakeCubin:
        path = "/nonexistent/kernel.cubin"

    monkeypatch.setattr(ops, "_environment_reason", lambda arch, settings: None)
    monkeypatch.setattr(ops, "detected_device", lambda: ("gpu", 90, 132))
    monkeypatch.setattr(compiler, "compile_cubin", lambda name, src, arch: FakeCubin())
    monkeypatch.setattr(launch, "register", lambda: None)
    traces = []

    def gemm(a, w, masked_m, settings):
        traces.append(settings)
        return ops.m_grouped_gemm_masked(a, w, masked_m, expected_m=64, recipe="bf16", arch=90, settings=settings)

    return jax.jit(gemm, static_argnames="settings"), traces


def test_a_changed_setting_is_a_new_trace_and_program(lowered_gemm):
    fn, traces = lowered_gemm
    args = (jax.ShapeDtypeStruct((4, 128, 512), jnp.bfloat16), jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((4,), jnp.int32))
    text = {}
    for s in (KernelSettings(), KernelSettings(command_buffer=True), KernelSettings(num_sms=66),
              KernelSettings(num_sms=66)):
        text[s] = fn.lower(*args, settings=s).as_text()
    assert len(traces) == 3  # an equal settings object is the same static argument: no retrace
    plain, captured, fewer_sms = (text[KernelSettings()], text[KernelSettings(command_buffer=True)],
                                  text[KernelSettings(num_sms=66)])
    assert "moe_jax_deep_gemm_launch_cmd_buffer" in captured and "moe_jax_deep_gemm_launch_cmd_buffer" not in plain
    assert "moe_jax_deep_gemm_launch" in plain
    assert fewer_sms != plain  # the persistent grid follows the SM count the kernel is planned for
    grid = re.compile(r"launch = dense<\[(\d+),")  # the launch vector starts with the grid
    assert grid.search(plain) and grid.search(fewer_sms)
    assert int(grid.search(fewer_sms).group(1)) <= 66 < int(grid.search(plain).group(1)) <= 132


def test_the_layer_passes_its_settings_to_the_kernels(monkeypatch):
    """moe_forward hands its settings to every op that launches native kernels (here recorded at
    the registry's resolution of the grouped GEMMs, on the reference backend)."""
    import importlib

    from moe_jax import MoEConfig, init_params, moe_forward

    seen = []
    resolve = importlib.import_module("custom_calls.backends").resolve

    def recording(op, backend=None, **static):
        if "settings" in static:
            seen.append((op, static["settings"]))
        return resolve(op, backend, **static)

    monkeypatch.setattr("custom_calls.grouped_gemm.resolve", recording)
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128, recipe="fp8_block")
    params = init_params(jax.random.key(0), config)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 128)), jnp.bfloat16)
    settings = KernelSettings(gemm_tuning="cached", num_sms=78)
    jax.jit(moe_forward, static_argnames=("config", "settings")).lower(x, params, config, settings=settings)
    assert seen and {s for _, s in seen} == {settings}, seen
    assert {op for op, _ in seen} == {"m_grouped_gemm_contig"} or {op for op, _ in seen} == {"m_grouped_gemm_masked"}


def test_the_flax_module_keeps_its_settings(monkeypatch):
    pytest.importorskip("flax")
    from flax import nnx

    import moe_jax.nn as mnn
    from moe_jax import MoEConfig

    seen = []
    monkeypatch.setattr(mnn, "moe_forward", lambda *a, **k: seen.append(k["settings"]) or a[0])
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128)
    settings = KernelSettings(command_buffer=True)
    layer = mnn.MoE(config, rngs=nnx.Rngs(0), settings=settings)
    layer(jnp.zeros((2, 128), jnp.bfloat16))
    monkeypatch.setenv("MOE_JAX_NUM_SMS", "7")  # read once, when a module without settings is built
    default = mnn.MoE(config, rngs=nnx.Rngs(0))
    monkeypatch.delenv("MOE_JAX_NUM_SMS")
    default(jnp.zeros((2, 128), jnp.bfloat16))
    assert seen == [settings, KernelSettings(num_sms=7)]
