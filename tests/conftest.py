"""Test setup shared by every suite.

* Eight host CPU devices, so the shard_map suites can build 1x8, 2x4 and 4x2 meshes. This must be
  set before jax is imported anywhere, hence at the top of this file. Without an NVIDIA device, also
  XLA:CPU without LLVM's expensive optimization passes (the programs are small; compiling is the time).
* ``gpu``-marked tests are skipped unless jax sees a CUDA device.
* ``slow``-marked tests (interpreter sweeps, long property runs, packaging builds, and the cases
  of a parametrized sweep past the first few, `SWEEPS`) are deselected
  unless ``--slow`` is given, and the property tests draw fewer examples (tests/run_mode.py): the
  README's test command stays a few minutes on two cores; ``.ci/run`` runs the rest as well
  (``-m "slow or property" --slow``: the slow tests, and the hypothesis tests, which get the
  ``property`` marker here, again at their full count).
* examples/ is importable: its float64 NumPy model of the layer (numpy_reference.py, which the
  quickstart checks against) is the tests' model too.
"""

import os
import sys
from pathlib import Path

# On a machine without an NVIDIA device the suites compile hundreds of small XLA:CPU programs, and
# LLVM's optimization passes are most of that time while the programs run for microseconds: skip them
# there (the README's test command: 250 s instead of 350-410 s on two cores). Every test holds at both
# levels, but values are not always the same bits across them (the last bit of a transcendental, as in
# jax.random.normal), so a subprocess compared bit for bit must get the same flags. GPU runs keep XLA's
# defaults.
_FAST_COMPILE = "" if os.path.exists("/dev/nvidia0") else (
    " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8" + _FAST_COMPILE)
# Many XLA:CPU programs are compiled again by another test, another pytest worker or a test's subprocess
# (the examples, the bench, the packaging venv). Without an NVIDIA device, JAX's persistent compilation
# cache keeps every program under .pytest_cache, shared by the workers and the subprocesses (through the
# environment) and reused by later runs. Its key covers the program, the flags and the jax version, so a
# hit is the same executable (each test still traces its own code). A GPU run compiles as before. The
# directory is one of pytest's cache directories (.pytest_cache/d/...), so `pytest --cache-clear` empties it.
if _FAST_COMPILE:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                          str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "d" / "jax_compilation_cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


def _has_cuda() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the tests marked slow (deselected by default)")


def pytest_configure(config):
    import run_mode

    run_mode.SLOW = config.getoption("--slow")


# The default run keeps the first N cases of these tests (the main recipe, layout or pattern comes
# first in every list; N = 0: the test is slow as a whole), --slow all of them. Chosen by measured
# time: what the default run keeps covers every stage, recipe family, layout and backend once.
SWEEPS = {
    "test_pattern_matches_single_device_and_collectives": 3, "test_checked_mode_reports_under_jit": 1,
    "test_layer_matches_numpy_model_every_recipe": 3, "test_fused_equals_unfused": 2,
    "test_layer_under_jit_gives_the_shared_output_for_the_token": 1, "test_jit_and_vmap": 3,
    "test_values_independent_of_chunk_size": 1, "test_m_indices_violations_are_named": 1,
    "test_fused_moe_topk_ids_violations_are_named": 1, "test_reference_matches_the_numpy_model": 2,
    "test_dense_shared_expert_is_the_unpermutes_addend": 1, "test_leading_dims_are_kept": 1,
    "test_fused_layout_is_the_fused_op_on_the_routes": 1, "test_deepseek_v4_runs_the_fused_layout_on_hopper": 1,
    "test_activation_and_scoring_variants_bf16": 2, "test_permute_quantizes_into_the_gemm_image": 2,
    "test_sharded_patterns_run_fp8_shared_expert": 1, "test_distribution": 1,
    "test_deepseek_v4_score_and_hash_routed": 1, "test_routing_ids_exact_and_weights": 3,
    "test_contig_matches_numpy": 2, "test_ep_modes_match_float64_model": 2, "test_kernels_compile_for_sm90_and_sm100": 0,
    "test_peak_memory_moderate": 1, "test_layer_without_flags_on_cpu_runs_scaled_shapes_quickly_and_honestly": 0,
    "test_params_shapes_and_prepare": 2, "test_search_inputs_match_the_launch_plans": 1,
    "test_interleave_bit_exact_numpy_and_jax": 6, "test_the_kernel_refuses_what_the_reason_refuses": 0,
    "test_widened_weights_equal_the_fp4_to_fp8_path_bit_for_bit": 3,
    "test_gpu_subcommand_without_gpu_exits_with_a_message_not_a_traceback": 1,
    "test_layer_exits_1_when_a_requested_row_failed": 0, "test_parallel_exits_1_when_a_requested_row_failed": 0,
    "test_quantized_contig_and_keep_fp32": 2, "test_dispatch_map_reference_against_numpy": 2,
    "test_route_count_past_int32_names_count_limit_and_chunk": 1, "test_corrupt_cubin_is_rebuilt_not_returned": 1,
    "test_fp8_shared_reference_matches_float64_model": 1, "test_masked_matches_numpy": 2,
    "test_fp32_model_matches_float64_per_token_loop": 1,
    "test_routed_reference_is_the_router_then_route_topk_then_fused_moe": 1,
    "test_eager_call_names_position_and_value": 1, "test_flax_module_holds_fp8_shared_expert": 1,
    "test_permute_unpermute_round_trip_identity_experts": 1, "test_reference_gradients_match_the_float32_model": 1,
    "test_fp8_gradients_depend_on_the_loss_scale_bf16_ones_do_not": 1,
    "test_layer_runs_no_index_canonicalization": 1,
    "test_layer_checked_mode_fused_layout_names_a_repeated_expert": 0,
    "test_v4_checkpoint_runs_the_fused_layout_through_the_flax_module": 0,
    "test_non_finite_weight_scales_are_named_by_expert": 0,
    "test_layer_routes_inside_the_fused_op_only_where_that_is_the_same_computation": 0,
    "test_sharded_patterns_match_single_device": 0, "test_fp8_shared_within_fp8_tolerance_of_bf16_shared": 0,
    "test_fp8_wire_follows_the_arch_prepared_params_run": 0,
}


def _mark_sweeps(items) -> None:
    seen: dict[tuple, int] = {}
    for item in items:
        name = getattr(item, "originalname", None)
        if name not in SWEEPS:
            continue
        key = (item.module.__name__, name)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > SWEEPS[name]:
            item.add_marker(pytest.mark.slow)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker(pytest.mark.property)
    _mark_sweeps(items)
    if not config.getoption("--slow"):
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (no CUDA jax backend here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty tuned-config and kernel cache of the test's own (the autotuner tests)."""
    from custom_calls.deep_gemm import autotune

    monkeypatch.setenv("MOE_JAX_CACHE_DIR", str(tmp_path))
    autotune.clear_memory_cache()
    yield tmp_path
    autotune.clear_memory_cache()


@pytest.fixture
def fused_op_choices(monkeypatch):
    """A list that records (op, backend chosen) for each fused-op call (`fused_moe`, `fused_moe_routed`)
    asked on another backend than "reference" (an op's own shape checks ask for the reference), so a test
    can tell the kernel from a fallback. Calls are recorded when traced."""
    import importlib

    ops = importlib.import_module("custom_calls.fused_moe")  # the package exports the op under this name
    chosen = []
    resolve = ops.resolve

    def recording_resolve(op, backend, **static):
        impl = resolve(op, backend, **static)
        if backend != "reference":
            chosen.append((op, impl.backend))
        return impl

    monkeypatch.setattr(ops, "resolve", recording_resolve)
    return chosen
