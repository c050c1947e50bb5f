"""Runs a test's script on the CPU under Triton's interpreter, in a subprocess: TRITON_INTERPRET must
be set before triton is imported, so a test that drives the Triton backend through the layer or the
ops does it in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_under_interpreter(script: str, timeout: float = 600) -> dict:
    """Runs `script` (python source printing one JSON object as its last `{`-line) with
    TRITON_INTERPRET=1 on the CPU, the checkout on its path; returns that object. Skips the test
    when triton is absent."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1])
