"""The computed bytes-per-layer table: its ingredients against independent counts, and against the
buffers the implementation really hands to its collectives (read from the lowered HLO)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from moe_jax import MoEConfig
from moe_jax.parallel._compat import shard_map
from moe_jax.parallel.bytes import layer_traffic, main, remote_ranks_per_token, row_bytes
from moe_jax.parallel.ep_common import EPGroup, send_quant_for
from moe_jax.parallel.ep_normal import ep_moe_normal

V3 = MoEConfig.deepseek_v3()


def test_row_bytes_by_hand():
    # DeepSeek-V3: 7168 FP8 values + 56 f32 scales + 8 int32 ids + 8 f32 weights
    assert row_bytes(7168, 8, fp8=True, routing=True) == 7168 + 56 * 4 + 64 == 7456
    assert row_bytes(7168, 8, fp8=False, routing=False) == 14336
    assert row_bytes(200, 2, fp8=True, routing=False) == 200 + 2 * 4  # a partial last group


def test_remote_ranks_matches_monte_carlo():
    rng = np.random.default_rng(0)
    for e, k, n in ((256, 8, 8), (16, 4, 8), (64, 6, 4)):
        ids = np.argsort(rng.random((20000, e)), axis=1)[:, :k]  # k distinct experts, uniform
        ranks = ids // (e // n)
        remote = np.array([len(set(r) - {0}) for r in ranks])  # seen from rank 0
        assert abs(remote.mean() - remote_ranks_per_token(e, k, n)) < 0.03, (e, k, n)


def test_table_relations():
    rows = {(t.pattern, t.mode, t.wire): t.bytes_per_gpu for t in layer_traffic(V3, 8, 4096)}
    h, n, tok = 7168, 8, 4096
    r = remote_ranks_per_token(256, 8, 8)
    assert np.isclose(rows[("tp", "-", "-")], 2 * 7 / 8 * tok * h * 4)  # ring all-reduce of f32
    fp8 = rows[("dp_ep", "normal (ragged)", "fp8")]
    bf16 = rows[("dp_ep", "normal (ragged)", "bf16")]
    # FP8 rows + scales: about half the bf16 dispatch bytes (the return trip is bf16 in both)
    disp_fp8 = fp8 - tok * r * 2 * h - n * 8
    disp_bf16 = bf16 - tok * r * 2 * h - n * 8
    assert 0.5 < disp_fp8 / disp_bf16 < 0.53
    # the dense equivalent moves every slot: (n - 1) rows per token instead of r
    dense = rows[("dp_ep", "normal (dense)", "fp8")]
    assert np.isclose(dense / (fp8 - n * 8), 7 / r)
    # attention-TP x EP: 1/n of the tokens in EP, plus the all-gather of bf16 results
    tp_ep = rows[("tp_ep", "normal (ragged)", "fp8")]
    assert np.isclose(tp_ep, (fp8 - n * 8) / n + n * 8 + 7 * (tok / n) * 2 * h)
    # low latency: fixed by the capacity, whatever the batch
    dec = {(t.pattern, t.mode, t.wire): t for t in layer_traffic(V3, 8, 128)}
    assert np.isclose(dec[("dp_ep", "low_latency C=128", "fp8")].bytes_per_gpu,
                      rows[("dp_ep", "low_latency C=128", "fp8")])
    notes = {(t.pattern, t.mode, t.wire): t.note for t in layer_traffic(V3, 8, 4096)}
    assert "drops" in notes[("dp_ep", "low_latency C=128", "fp8")]  # 4096 tokens > C = 128
    assert not dec[("dp_ep", "low_latency C=128", "fp8")].note


@pytest.mark.parametrize("recipe", ["fp8_block", "mxfp8"])
def test_model_matches_the_buffers_in_the_lowered_hlo(recipe):
    """The dense normal-mode all-to-all carries n * M rows of row_bytes each (uint8), with the
    recipe's activation group (128, or 32 for mxfp8) on the wire."""
    n, m, e, k, h = 8, 5, 16, 4, 256
    mesh = Mesh(np.array(jax.devices()[:n]), ("ep",))
    group = EPGroup(("ep",), n, e)
    quant = send_quant_for(recipe, 90 if recipe == "fp8_block" else 100)

    def body(x, ids, w):
        fn = lambda xr, i, ww: xr.astype(jnp.float32)  # noqa: E731
        return ep_moe_normal(x, ids, w, group, fn, impl="dense", quant=quant,
                             combine_dtype=jnp.bfloat16)[0]

    x = jax.ShapeDtypeStruct((n * m, h), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((n * m, k), jnp.int32)
    w = jax.ShapeDtypeStruct((n * m, k), jnp.float32)
    text = jax.jit(shard_map(body, mesh, (P("ep"),) * 3, P("ep"))).lower(x, ids, w).as_text()
    shapes = re.findall(r"stablehlo\.all_to_all.*?->\s*tensor<([0-9x]+)x(ui8|bf16)>", text)
    rb = h + 4 * (h // quant.group_size) + 8 * k  # FP8 values, f32 scales, ids, weights
    assert sorted(shapes) == sorted([(f"{n * m}x{rb}", "ui8"), (f"{n * m}x{h}", "bf16")])
    # the table's rows use the same row size: dense normal mode sends (n - 1) * M of them + returns
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=128, recipe=recipe)
    dense = {t.wire: t.bytes_per_gpu for t in layer_traffic(cfg, n, m)
             if t.pattern == "dp_ep" and t.mode == "normal (dense)"}
    assert dense["fp8"] == (n - 1) * m * (rb + 2 * h)


def test_cli_prints_every_pattern(capsys):
    main(["--ranks", "8", "--prefill", "4096", "--decode", "128"])
    out = capsys.readouterr().out
    for p in ("| tp |", "| dp_tp |", "| cp |", "| dp_ep |", "| tp_ep |"):
        assert p in out
    assert "prefill 4096 tok/GPU" in out and "decode 128 tok/GPU" in out
