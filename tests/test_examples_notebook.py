"""examples/deepseek_layer.ipynb: stored without outputs, and runs top to bottom on CPU (nbclient,
kernel python3) within the 3-minute budget, drawing every plot and the recipe table."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "deepseek_layer.ipynb"
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
