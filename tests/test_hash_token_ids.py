"""Hash-routed layers and token ids outside the vocabulary (moe_jax/routing.py, moe_jax/validate.py):
an eager call raises naming the position and the value, checked mode reports them under jit, and
unchecked under jit the token is routed nowhere (routed output 0: the row is the shared experts'
output alone) on the reference backend, the fused layout and the Triton backend (under Triton's
interpreter, in a subprocess: TRITON_INTERPRET must be set before triton is imported)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import custom_calls as cc
import moe_jax as mj
from interpreter_script import run_under_interpreter

VOCAB = 40
BAD_IDS = [VOCAB, 10**6, -1]


def _layer(recipe="bf16", layout="auto"):
    cfg = mj.MoEConfig(num_experts=6, top_k=2, hidden_size=128, intermediate_size=128, n_shared_experts=1,
                       scoring="sqrtsoftplus", hash_routing=True, vocab_size=VOCAB, recipe=recipe,
                       layout=layout)
    params = mj.prepare_params(mj.init_params(jax.random.key(0), cfg), cfg)
    x = jax.random.normal(jax.random.key(1), (2, 3, 128), jnp.bfloat16)
    tok = jnp.asarray([[1, 7, 39], [0, 12, 5]], jnp.int32)
    return cfg, params, x, tok


@pytest.mark.parametrize("bad", BAD_IDS)
def test_eager_call_names_position_and_value(bad):
    cfg, params, x, tok = _layer()
    want = re.escape(f"token_ids: expected values in [0, vocab_size={VOCAB}), got {bad} at position (1, 2)")
    with pytest.raises(ValueError, match=want):
        mj.moe_forward(x, params, cfg, token_ids=tok.at[1, 2].set(bad))
    with pytest.raises(ValueError, match=want):
        mj.route(x, params, cfg, token_ids=np.asarray(tok.at[1, 2].set(bad)))
    with pytest.raises(ValueError, match=re.escape("position (0, 1) (1 more outside)")):
        mj.route(x, params, cfg, token_ids=tok.at[0, 1].set(bad).at[1, 0].set(bad))


@pytest.mark.parametrize("bad", BAD_IDS)
def test_checked_mode_reports_under_jit(bad):
    cfg, params, x, tok = _layer()
    fwd = jax.jit(cc.checked(lambda x, p, t: mj.moe_forward(x, p, cfg, token_ids=t, debug_checks=True),
                             throw=False))
    err, _ = fwd(x, params, tok.at[1, 2].set(bad))
    assert err.get() == f"token_ids[1, 2] = {bad} is outside [0, vocab_size={VOCAB}) (`check` failed)"
    err, _ = fwd(x, params, tok)
    assert err.get() is None
    rt = cc.checked(jax.jit(lambda x, t: mj.route(x, params, cfg, token_ids=t, debug_checks=True)))
    with pytest.raises(checkify.JaxRuntimeError, match=re.escape(f"token_ids[0, 0] = {bad} is outside")):
        rt(x, tok.at[0, 0].set(bad))


@pytest.mark.parametrize("bad", BAD_IDS)
def test_route_under_jit_drops_the_token(bad):
    cfg, params, x, tok = _layer()
    ids, w = jax.jit(lambda x, t: mj.route(x, params, cfg, token_ids=t))(x, tok.at[1, 2].set(bad))
    ref_ids, ref_w = mj.route(x, params, cfg, token_ids=tok)
    ids, w, ref_ids, ref_w = map(np.asarray, (ids, w, ref_ids, ref_w))
    assert (ids[1, 2] == -1).all() and (w[1, 2] == 0).all()
    keep = np.ones((2, 3), bool)
    keep[1, 2] = False
    np.testing.assert_array_equal(ids[keep], ref_ids[keep])
    np.testing.assert_array_equal(w[keep], ref_w[keep])


@pytest.mark.parametrize("recipe,layout", [("bf16", "contig"), ("fp8_block", "contig"),
                                           ("fp8_block", "masked"), ("fp8_block", "fused")])
def test_layer_under_jit_gives_the_shared_output_for_the_token(recipe, layout):
    cfg, params, x, tok = _layer(recipe, layout)
    fwd = jax.jit(mj.moe_forward, static_argnames=("config",))
    good = np.asarray(fwd(x, params, config=cfg, token_ids=tok), np.float32)
    shared = np.asarray(mj.shared_experts(x, params, cfg), np.float32)
    for bad in BAD_IDS:
        got = np.asarray(fwd(x, params, config=cfg, token_ids=tok.at[1, 2].set(bad)), np.float32)
        np.testing.assert_array_equal(got[1, 2], shared[1, 2])  # routed part exactly 0
        assert not np.array_equal(good[1, 2], shared[1, 2])  # which a valid id would not give
        got[1, 2] = good[1, 2]
        np.testing.assert_array_equal(got, good)  # every other token as with valid ids


# ------------------------------------------------------------------ Triton under the interpreter

TRITON_SCRIPT = r"""
import json, numpy as np, jax, jax.numpy as jnp
import moe_jax as mj
cfg = mj.MoEConfig(num_experts=6, top_k=2, hidden_size=128, intermediate_size=128, n_shared_experts=1,
                   scoring="sqrtsoftplus", hash_routing=True, vocab_size=40, recipe="fp8_block",
                   layout="contig")
params = mj.prepare_params(mj.init_params(jax.random.key(0), cfg), cfg)
x = jax.random.normal(jax.random.key(1), (2, 3, 128), jnp.bfloat16)
tok = jnp.asarray([[1, 7, 39], [0, 12, 5]], jnp.int32)
fwd = jax.jit(mj.moe_forward, static_argnames=("config", "backend"))
good = np.asarray(fwd(x, params, config=cfg, token_ids=tok, backend="triton"), np.float32)
shared = np.asarray(mj.shared_experts(x, params, cfg), np.float32)
out = {}
for bad in (40, 10**6, -1):
    got = fwd(x, params, config=cfg, token_ids=tok.at[1, 2].set(bad), backend="triton")
    got = np.asarray(got, np.float32)
    row = bool(np.array_equal(got[1, 2], shared[1, 2]))
    got[1, 2] = good[1, 2]
    out[str(bad)] = [row, bool(np.array_equal(got, good))]
out["valid_differs"] = not np.array_equal(good[1, 2], shared[1, 2])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_triton_backend_under_interpreter_drops_the_token():
    got = run_under_interpreter(TRITON_SCRIPT)
    assert got == {"40": [True, True], "1000000": [True, True], "-1": [True, True], "valid_differs": True}
