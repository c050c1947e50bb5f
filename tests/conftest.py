"""Test setup shared by every suite.

* Eight host CPU devices, so the shard_map suites can build 1x8, 2x4 and 4x2 meshes. This must be
  set before jax is imported anywhere, hence at the top of this file.
* ``gpu``-marked tests are skipped unless jax sees a CUDA device.
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


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (no CUDA jax backend here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
