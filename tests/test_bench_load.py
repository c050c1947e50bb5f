"""`python -m moe_jax.bench load` at its scaled size: the written layers are real checkpoints (an
index, a config.json, the V3 and V4 namings) that load without a hand-written config, every load
row is measured in a child process, and the files are removed afterwards."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from moe_jax import layer_kinds
from moe_jax.bench.load import families, write_layer
from moe_jax.checkpoint import load_moe_layer


def test_written_layers_load_from_their_config(tmp_path):
    for fam in families(small=True):
        d = tmp_path / fam.fmt
        total = write_layer(fam, d, shard_bytes=1 << 17)  # several shards
        shards = sorted(d.glob("*.safetensors"))
        assert len(shards) > 1 and total == sum(f.stat().st_size for f in shards)
        index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
        assert {d / f for f in index.values()} == set(shards)
        assert layer_kinds(d)[fam.layer] == "moe"
        config, p = load_moe_layer(d, layer=fam.layer, prepare=False)
        assert config.recipe == fam.fmt and config.num_experts == fam.experts == p.w13.shape[0]
        assert p.w13.shape[1:] == (2 * fam.inter, fam.hidden // (2 if fam.fmt == "mxfp4" else 1))
        assert np.isfinite(np.asarray(p.w13_scale)).all() and np.isfinite(np.asarray(p.shared_w13, np.float32)).all()


@pytest.mark.slow
def test_small_run_measures_every_load_and_cleans_up(tmp_path):
    out, d = tmp_path / "rows.json", tmp_path / "d"
    proc = subprocess.run([sys.executable, "-m", "moe_jax.bench", "load", "--small", "--dir", str(d),
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["layer"], r["experts"]) for r in rows] == [("V3 FP8", 16), ("V3 FP8", 8), ("V4 MXFP4", 16),
                                                          ("V4 MXFP4", 8)]
    for r in rows:
        assert r["seconds"] > 0 and r["loaded_gb"] > 0 and r["peak_rss_gb"] >= r["base_rss_gb"] > 0
        assert r["judged"] is False and r["ok"] is True  # at --small sizes the ratio is not judged
    assert rows[1]["loaded_gb"] < rows[0]["loaded_gb"]  # the EP slice reads fewer experts
    assert "| V4 MXFP4 | 8 |" in proc.stdout
    assert not any(d.iterdir())  # the written layers are gone
