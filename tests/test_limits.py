"""Size limits of one call, checked at trace time before any backend is resolved
(custom_calls/limits.py, moe_jax/validate.py): the int32 index extents (routes M * k, buffer rows)
and the temporary-memory estimate against MAX_TEMPORARY_BYTES. Everything runs through
`jax.eval_shape` on `jax.ShapeDtypeStruct`s: nothing of the sizes named here is allocated."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import custom_calls as cc
import moe_jax as mj
from custom_calls.limits import INDEX_LIMIT
from moe_jax import validate

BIG = 2**28  # with top-8: 2**31 routes, one past the int32 limit
SDS = jax.ShapeDtypeStruct


def _small():
    cfg = mj.MoEConfig(num_experts=8, top_k=8, hidden_size=64, intermediate_size=32, n_shared_experts=1)
    return cfg, mj.prepare_params(mj.init_params(jax.random.key(0), cfg), cfg)


def _v3():
    cfg = mj.MoEConfig.deepseek_v3()
    return cfg, jax.eval_shape(lambda: mj.prepare_params(mj.init_params(jax.random.key(0), cfg), cfg))


def _index_error(m: int) -> str:
    return rf"x: {m} tokens exceed the int32 index limit {INDEX_LIMIT}: routes \(M \* top_k\) = {m * 8}.*" \
           r"split the batch into chunks of at most \d+ tokens"


@pytest.mark.parametrize("backend", ["reference", "triton", "deep_gemm", "auto"])
def test_route_count_past_int32_names_count_limit_and_chunk(backend):
    """The check runs before any stage is resolved: on this CPU machine "triton" and "deep_gemm"
    would otherwise fail on the platform; here the size error comes first."""
    cfg, params = _small()
    x = SDS((BIG, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=_index_error(BIG)):
        jax.eval_shape(lambda x: mj.moe_forward(x, params, cfg, backend=backend), x)
    with pytest.raises(ValueError, match=_index_error(BIG)):
        jax.eval_shape(lambda x: mj.routed_experts(x, jnp.zeros((BIG, 8), jnp.int32), jnp.zeros((BIG, 8)),
                                                   params, cfg, backend=backend), x)


def test_every_layer_entry_point_checks():
    cfg, params = _small()
    x = SDS((2, BIG // 2, 64), jnp.bfloat16)  # leading dims multiply
    with pytest.raises(ValueError, match=_index_error(BIG)):
        jax.eval_shape(lambda x: mj.route(x, params, cfg), x)
    with pytest.raises(ValueError, match=rf"x: {BIG} tokens need an estimated [\d.]+ GiB of temporaries.*"
                                         r"MAX_TEMPORARY_BYTES = 64 GiB.*split the batch into chunks"):
        jax.eval_shape(lambda x: mj.shared_experts(x, params, cfg), x)


def test_the_suggested_chunk_passes_both_limits():
    cfg, params = _small()
    with pytest.raises(ValueError) as e:
        jax.eval_shape(lambda x: mj.moe_forward(x, params, cfg), SDS((BIG, 64), jnp.bfloat16))
    chunk = int(re.search(r"chunks of at most (\d+) tokens", str(e.value)).group(1))
    assert chunk == validate.max_tokens_per_call(cfg) and 0 < chunk < BIG
    validate.check_call_size(chunk, cfg)
    with pytest.raises(ValueError):
        validate.check_call_size(chunk + 1, cfg)


def test_ops_check_their_int32_extents():
    ids = SDS((BIG, 8), jnp.int32)
    with pytest.raises(ValueError, match=rf"topk_ids: {BIG} tokens exceed the int32 index limit.*"
                                         r"routes \(M \* top_k\) = 2147483648"):
        jax.eval_shape(lambda i: cc.dispatch_map_contig(i, num_local_experts=8, alignment=128), ids)
    with pytest.raises(ValueError,
                       match=r"masked rows \(E_local \* m_pad\) = 2147483648.*no count of tokens fits"):
        jax.eval_shape(lambda i: cc.dispatch_map_masked(i, num_local_experts=2**15, m_pad=2**16),
                       SDS((4, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"e_flat: 2147483648 routes exceed the int32 index limit.*"
                                         r"chunks of at most 2147483647 routes"):
        jax.eval_shape(lambda e: cc.rank_within_expert(e, num_experts=8), SDS((2**31,), jnp.int32))
    x = SDS((BIG, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=rf"x: {BIG} tokens exceed the int32 index limit"):
        jax.eval_shape(lambda x, s: cc.permute_contig(x, s, num_rows=1024, recipe="bf16", arch=90), x, ids)
    with pytest.raises(ValueError, match=rf"src2dst: {BIG} tokens exceed the int32 index limit"):
        jax.eval_shape(lambda d, s, w: cc.unpermute(d, s, w), SDS((1024, 128), jnp.bfloat16), ids,
                       SDS((BIG, 8), jnp.float32))


def test_full_v3_memory_bound():
    cfg, params = _v3()
    fwd = lambda x, p: mj.moe_forward(x, p, cfg)  # noqa: E731
    for m in (16384, 65536):  # prefill sizes pass (3.7 and 13.2 GiB by the estimate)
        assert jax.eval_shape(fwd, SDS((m, 7168), jnp.bfloat16), params).shape == (m, 7168)
    assert round(validate.temporary_bytes(16384, cfg) / 2**30, 1) == 3.7
    assert round(validate.temporary_bytes(65536, cfg) / 2**30, 1) == 13.2
    want = (r"x: 1048576 tokens need an estimated 203.5 GiB of temporaries \(contig layout: 8421120 grouped "
            r"rows, H=7168\), above MAX_TEMPORARY_BYTES = 64 GiB \(moe_jax.validate\); split the batch into "
            r"chunks of at most 327983 tokens")
    for backend in ("reference", "triton", "deep_gemm"):
        with pytest.raises(ValueError, match=want):
            jax.eval_shape(lambda x, p: mj.moe_forward(x, p, cfg, backend=backend),
                           SDS((2**20, 7168), jnp.bfloat16), params)


def test_memory_bound_is_a_setting_read_at_trace_time(monkeypatch):
    cfg, params = _small()
    x = SDS((4096, 64), jnp.bfloat16)
    assert jax.eval_shape(lambda x: mj.moe_forward(x, params, cfg), x).shape == (4096, 64)
    monkeypatch.setattr(validate, "MAX_TEMPORARY_BYTES", validate.temporary_bytes(1024, cfg))
    with pytest.raises(ValueError, match=r"x: 4096 tokens need .* chunks of at most 1024 tokens"):
        jax.eval_shape(lambda x: mj.moe_forward(x, params, cfg), x)


def test_deep_gemm_on_cpu_fails_on_the_platform_below_the_limits():
    """The converse of the backend test above: within the limits, deep_gemm on a CPU reaches its
    platform check (so the limit check indeed ran first there)."""
    if jax.default_backend() != "cpu":
        pytest.skip("a GPU machine runs deep_gemm")
    cfg = mj.MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=128, recipe="fp8_block")
    params = mj.prepare_params(mj.init_params(jax.random.key(0), cfg), cfg)
    with pytest.raises(ValueError) as e:
        jax.eval_shape(lambda x: mj.moe_forward(x, params, cfg, backend="deep_gemm"),
                       SDS((64, 128), jnp.bfloat16))
    assert "int32 index limit" not in str(e.value) and "temporaries" not in str(e.value)
