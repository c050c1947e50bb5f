"""Multi-host: the same sharded program under `jax.distributed` with 2 CPU processes on 127.0.0.1
(gloo collectives, 2 devices each: one 4-device mesh across processes) must give the result of
one process driving 4 local devices, bit for bit: DP x EP (normal) and DP-attention x TP-MoE."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "multihost.py"
TOKENS_PER_DEVICE = 6
PATTERNS = ("dp_ep-normal", "dp_tp")  # EP all-to-alls and a TP gather/reduce-scatter across processes


def _example():
    spec = importlib.util.spec_from_file_location("multihost_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    out = tmp_path / "multi.npz"
    # XLA_FLAGS stays: the processes compile as this one does (tests/conftest.py); the example sets their
    # device count
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--local", "2", "--devices-per-process", "2",
                           "--tokens-per-device", str(TOKENS_PER_DEVICE), "--timeout", "150",
                           "--patterns", ",".join(PATTERNS),
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"OK: {len(PATTERNS)} patterns over 2 processes agree" in proc.stdout, proc.stdout[-3000:]
    multi = np.load(out)
    ex = _example()
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    config, params, x, lengths = ex.build_inputs(4, TOKENS_PER_DEVICE)
    np.testing.assert_array_equal(multi["x"], x)  # both sides built the same inputs
    single = ex.run_patterns(mesh, config, params, x, lengths, PATTERNS)
    assert set(PATTERNS) <= set(multi.files)
    for name, y in single.items():
        y = np.asarray(y, np.float32)
        assert np.isfinite(y).all() and np.abs(y).max() > 0
        np.testing.assert_array_equal(multi[name], y, err_msg=name)
