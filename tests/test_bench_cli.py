"""The benchmark CLI (`python -m moe_jax.bench`): help, JSON and PNG output of `layer --small`, the
clear refusal of `gemm` without a GPU, and the float32 model of the layer benchmark against a
float64 per-token numpy loop."""

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from custom_calls import ActivationSpec
from moe_jax.bench import layer as bench_layer
from moe_jax.bench.__main__ import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STAGES = ["route (gate GEMM + top-k)", "dispatch", "permute+quant", "GEMM1", "activation+quant", "GEMM2",
          "unpermute"]


def _strict_json(path):
    def no_constant(name):
        raise ValueError(f"non-standard JSON constant {name}")

    with open(path) as f:
        return json.load(f, parse_constant=no_constant)


def _positive(v):
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_layer_small_reference_writes_table_json_and_png(tmp_path):
    j, p = tmp_path / "layer.json", tmp_path / "layer.png"
    proc = subprocess.run([sys.executable, "-m", "moe_jax.bench", "layer", "--small", "--backends", "reference",
                           "--json", str(j), "--plot", str(p)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the table on stdout, progress on stderr
    assert "== prefill" in proc.stdout and "== decode" in proc.stdout and "GEMM1" in proc.stdout
    assert "float32 model" in proc.stderr and "float32 model" not in proc.stdout
    data = _strict_json(j)
    assert data["backends"] == ["reference"] and _positive(data["copy_GBps"])
    by_shape = {r["shape"]: r for r in data["results"]}
    assert set(by_shape) == {"prefill", "decode"}
    for shape, layout, other in (("prefill", "contig", "masked"), ("decode", "masked", "contig")):
        res = by_shape[shape]
        assert res["layout"] == layout and res["tokens"] in (64, 16) and _positive(res["weights_GB"])
        row = res["reference"]
        assert "error" not in row, row
        for key in ("end_to_end_us", "with_routing_us", "gemms_us", "e2e_over_gemms", "temp_MB", "temp_bound_MB"):
            assert _positive(row[key]), (shape, key, row[key])
        assert list(row["stages_us"]) == STAGES and all(_positive(v) for v in row["stages_us"].values())
        assert math.isclose(row["gemms_us"], row["stages_us"]["GEMM1"] + row["stages_us"]["GEMM2"], rel_tol=1e-9)
        # fp8 activations and weights against the float32 model: a few percent, not zero, not garbage
        assert 1e-4 < row["rel_err"] < 0.1 and row["rel_err"] <= row["worst_row"] < 0.2
        assert 0 <= row[f"vs_{other}_rel"] < 1e-2
    assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000


@pytest.mark.parametrize("sub, options", [("layer", ["--json", "--plot", "--no-error", "--small", "--backends"]),
                                          ("gemm", ["--json", "--plot", "--markdown", "--quick"])])
def test_subcommand_help(capsys, sub, options):
    with pytest.raises(SystemExit) as e:
        main([sub, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and f"python -m moe_jax.bench {sub}" in out
    assert all(o in out for o in options), out


def test_top_level_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "gemm" in out and "layer" in out


def test_gemm_without_gpu_exits_with_a_message_not_a_traceback(tmp_path):
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a CUDA device is present: gemm would run")
    j = tmp_path / "gemm.json"
    proc = subprocess.run([sys.executable, "-m", "moe_jax.bench", "gemm", "--json", str(j)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == "" and not j.exists()


def test_layer_rejects_unknown_shape():
    with pytest.raises(SystemExit, match="--shapes"):
        main(["layer", "--small", "--shapes", "prefil"])


def test_gemm_plot_writes_png_from_rows(tmp_path):
    from moe_jax.bench import gemm

    def r(impl, kind, shape, tf, tfs, tb=None, tbs=None):
        return dict(impl=impl, kind=kind, shape=shape, tflops_burst=tf, tflops_sustained=tfs, tbps_burst=tb,
                    tbps_sustained=tbs)

    rows = [r("deep_gemm fp8", "contig", "contig 32x1024, N=4096, K=7168", 700.0, 650.0),
            r("ragged_dot bf16", "contig", "contig 32x1024, N=4096, K=7168", 300.0, None),
            r("deep_gemm fp8", "contig", "contig 8x4096, N=4096, K=7168", 720.0, 660.0),
            r("deep_gemm fp8", "masked", "masked G=32, m_pad=256, expected_m=32, N=4096, K=7168", 90.0, 85.0,
              3.1, 2.9)]
    p = tmp_path / "gemm.png"
    gemm.plot(str(p), rows, "test device")
    assert p.read_bytes()[:8] == PNG_MAGIC


def _np_fp32_layer(x, ids, wts, params, cfg):
    """float64 per-token loop: dequantized fp8_block weights, silu(gate) * up, weighted sum."""
    def deq(w, s):
        w = np.asarray(jnp.asarray(w, jnp.float32), np.float64)
        s = np.asarray(s, np.float64)
        _, n, k = w.shape
        return w * np.repeat(np.repeat(s, 128, axis=1), 128, axis=2)[:, :n, :k]

    w13, w2 = deq(params.w13, params.w13_scale), deq(params.w2, params.w2_scale)
    xf = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    i = cfg.intermediate_size
    out = np.zeros(xf.shape, np.float64)
    for t in range(xf.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            gu = w13[e] @ xf[t]
            gate, up = gu[:i], gu[i:]
            out[t] += wts[t, j] * (w2[e] @ (gate / (1.0 + np.exp(-gate)) * up))
    return out * cfg.routed_scaling_factor


@pytest.mark.parametrize("block, blocks_per_step", [(128, 4), (8, 1), (8, 3)])
def test_fp32_model_matches_float64_per_token_loop(block, blocks_per_step):
    from moe_jax.params import init_params, prepare_params

    cfg = bench_layer._config(small=True)
    assert cfg.activation == ActivationSpec() and cfg.recipe == "fp8_block"  # plain SiLU
    params = prepare_params(init_params(jax.random.PRNGKey(5), cfg), cfg)
    rng = np.random.default_rng(block)
    m, k, e = 37, cfg.top_k, cfg.num_experts
    x = jnp.asarray(rng.standard_normal((m, cfg.hidden_size)), jnp.bfloat16)
    # random routes, repeated experts within a token included (each route counts once)
    ids = rng.integers(0, e, (m, k)).astype(np.int32)
    ids[0] = ids[0, 0]
    wts = rng.uniform(0.05, 1.0, (m, k)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, i, w: bench_layer._fp32_model(x, i, w, params, cfg, block=block,
                                                                    blocks_per_step=blocks_per_step))(
        x, jnp.asarray(ids), jnp.asarray(wts)))
    want = _np_fp32_layer(x, ids, wts, params, cfg)
    assert got.shape == (m, cfg.hidden_size) and got.dtype == np.float32
    assert np.all(np.isfinite(got)) and np.all(np.abs(want).max(axis=1) > 0)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    row_err = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    assert row_err.max() < 1e-5
