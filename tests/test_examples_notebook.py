"""The examples on CPU. examples/deepseek_layer.ipynb: stored without outputs, and runs top to bottom
(nbclient, kernel python3) within the 3-minute budget, drawing every plot and the recipe table.
examples/quickstart.py: every layer agrees with its float64 NumPy evaluation and the run ends with
OK; a layer that computes something else is reported and fails the run. examples/multihost.py
without flags prints its usage with a runnable command."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOK = EXAMPLES / "deepseek_layer.ipynb"
BUDGET_S = 180


def _read():
    nbformat = pytest.importorskip("nbformat")
    return nbformat.read(NOTEBOOK, as_version=4)


def test_notebook_is_stored_without_outputs():
    nb = _read()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "no code cells"
    for c in code:
        assert c.outputs == [] and c.execution_count is None, c.source[:80]
    assert nb.metadata["kernelspec"]["name"] == "python3"


@pytest.mark.slow
def test_notebook_executes_on_cpu(tmp_path):
    pytest.importorskip("nbclient")
    pytest.importorskip("matplotlib")
    from nbclient import NotebookClient

    nb = _read()
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=BUDGET_S, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    elapsed = time.perf_counter() - t0
    assert elapsed < BUDGET_S, f"notebook took {elapsed:.0f} s (budget {BUDGET_S} s)"

    def text(c):
        return "".join(o.get("text", "") for o in c.outputs if o.output_type == "stream")

    code = [c for c in nb.cells if c.cell_type == "code"]
    for c in code:
        assert not [o for o in c.outputs if o.output_type == "error"], c.source[:80]
        if "plt.show()" in c.source:
            assert any("image/png" in o.get("data", {}) for o in c.outputs), f"no figure from: {c.source[:80]}"
    out = "\n".join(text(c) for c in code)
    m = re.search(r"imbalance \(max / mean load\): ([\d.]+) without bias, ([\d.]+) with the tuned bias", out)
    assert m and float(m.group(2)) < float(m.group(1)), out[-2000:]
    table = [ln for ln in out.splitlines() if re.match(r"(bf16|fp8_block|mxfp8|mxfp4)\s+(90|100)\s", ln)]
    assert len(table) == 8, out[-2000:]
    for ln in table:  # every relative error is a finite number below 1
        w_err, o_err = (float(v) for v in ln.split()[-2:])
        assert 0 < w_err < 1 and 0 < o_err < 1, ln


def _env() -> dict:
    root = str(EXAMPLES.parent)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))


@pytest.mark.slow
def test_quickstart_agrees_with_numpy_and_says_ok():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")], capture_output=True, text=True,
                          timeout=300, env=_env(), cwd=EXAMPLES.parent)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert out.rstrip().splitlines()[-1] == "OK: 3 layers agree with float64 NumPy", out[-2000:]
    checks = re.findall(r"max \|y - y_np\| / max \|y_np\| = (\S+) \(tolerance (\S+)\) (\w+)", out)
    assert len(checks) == 3, out
    for err, tol, verdict in checks:
        assert verdict == "ok" and 0 < float(err) <= float(tol), (err, tol, verdict)
    assert out.count("NumPy routes 64 of 64 tokens to the same experts") == 3, out
    assert out.count("arch 90: the GEMMs use the scale formats of Hopper GPUs") == 3, out
    assert len(out.splitlines()) < 40  # short: no per-expert histograms


@pytest.mark.slow
def test_quickstart_reports_a_layer_that_disagrees(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("quickstart", EXAMPLES / "quickstart.py")
    quickstart = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    spec.loader.exec_module(quickstart)
    forward = quickstart.mj.moe_forward

    def scaled_wrong(x, params, config, **kw):  # the routed output 25 % too large
        wrong = dataclasses.replace(config, routed_scaling_factor=1.25 * config.routed_scaling_factor)
        return forward(x, params, wrong, **kw)

    monkeypatch.setattr(quickstart.mj, "moe_forward", scaled_wrong)
    config = quickstart.MoEConfig.deepseek_v3().scaled(num_experts=16, hidden_size=256, intermediate_size=128)
    assert not quickstart.run("wrong layer", config, tokens=16, backend="reference", repeats=1)
    assert re.search(r"\(tolerance 6\.2e-02\) DISAGREES", capsys.readouterr().out)


def test_multihost_without_flags_prints_usage():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "multihost.py")], capture_output=True, text=True,
                          timeout=60, env=_env())
    assert proc.returncode == 2, proc.stderr
    assert "usage: multihost.py" in proc.stderr and "examples/multihost.py --local 2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_notebook_extra_covers_its_imports_and_a_runner():
    """`pip install -e ".[notebook]"` (README) gives every package the notebook imports and a Jupyter
    that runs it: each third-party import is a base dependency or in the extra."""
    import json
    import tomllib

    project = tomllib.loads((EXAMPLES.parent / "pyproject.toml").read_text())["project"]
    name = lambda req: re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0].lower()  # noqa: E731
    have = {name(r) for r in project["dependencies"] + project["optional-dependencies"]["notebook"]}
    assert "jupyterlab" in have  # brings `jupyter lab` and `jupyter nbconvert --execute`
    nb = json.loads(NOTEBOOK.read_text())
    source = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    imported = set(re.findall(r"^\s*(?:from|import)\s+(\w+)", source, re.M))
    ours = {"layouts", "custom_calls", "moe_jax"}
    third_party = {m for m in imported - ours if m not in sys.stdlib_module_names}
    assert third_party and third_party <= have, (third_party, have)
