"""Test setup shared by every suite.

* Eight host CPU devices, so the shard_map suites can build 1x8, 2x4 and 4x2 meshes. This must be
  set before jax is imported anywhere, hence at the top of this file.
* ``gpu``-marked tests are skipped unless jax sees a CUDA device.
* ``slow``-marked tests (interpreter sweeps, long property runs, packaging builds) are deselected
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

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
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


def pytest_collection_modifyitems(config, items):
    for item in items:
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker(pytest.mark.property)
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
