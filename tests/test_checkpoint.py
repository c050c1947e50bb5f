"""Checkpoint loading: synthetic DeepSeek-style safetensors files written here (own writer, plus the
safetensors library's), loaded back; checkpoint form compared bit-exactly with what was written,
forward compared with a float64 numpy model of the layer built from the written tensors."""

from __future__ import annotations

import json
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moe_jax import MoEConfig, moe_forward
from moe_jax.checkpoint import (CheckpointError, SafetensorsCheckpoint, load_moe_params,
                                read_safetensors_header)

E, H, I, K_TOP, M = 6, 256, 128, 2, 29
P = "model.layers.3.mlp."
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
_NAMES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float16): "F16",
          np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64",
          np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}


def write_st(path, tensors: dict) -> None:
    """Minimal safetensors writer: 8-byte LE header length, JSON header, raw little-endian data.
    A value may be (array, dtype_name) to force a name (e.g. F8_E8M0 for uint8 bytes)."""
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        a, dt = a if isinstance(a, tuple) else (a, _NAMES[np.asarray(a).dtype])
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dt, "shape": list(np.shape(a)), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def config(recipe="fp8_block", **kw) -> MoEConfig:
    base = dict(num_experts=E, top_k=K_TOP, hidden_size=H, intermediate_size=I, n_shared_experts=1,
                scoring="sigmoid", use_correction_bias=True, routed_scaling_factor=2.5, recipe=recipe)
    base.update(kw)
    return MoEConfig(**base)


def rng(seed):
    return np.random.default_rng(seed)


def raw_weights(seed):
    """Float weights per expert (N, K) in HF orientation, plus router and shared expert."""
    r = rng(seed)
    w = {}
    for e in range(E):
        w[f"experts.{e}.gate_proj"] = r.normal(0, H**-0.5, (I, H))
        w[f"experts.{e}.up_proj"] = r.normal(0, H**-0.5, (I, H))
        w[f"experts.{e}.down_proj"] = r.normal(0, I**-0.5, (H, I))
    w["shared_experts.gate_proj"] = r.normal(0, H**-0.5, (I, H))
    w["shared_experts.up_proj"] = r.normal(0, H**-0.5, (I, H))
    w["shared_experts.down_proj"] = r.normal(0, I**-0.5, (H, I))
    return w


# -- numpy quantizers and dequantizers (the test's own formats) ----------------------------------

def np_fp8_block(w):
    n, k = w.shape
    s = np.abs(w.reshape(n // 128, 128, k // 128, 128)).max(axis=(1, 3)) / 448.0
    q = (w / np.repeat(np.repeat(s, 128, 0), 128, 1)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    return q, s.astype(np.float32)


def np_deq_block(q, s):
    return q.astype(np.float64) * np.repeat(np.repeat(s.astype(np.float64), 128, 0), 128, 1)


def np_mx_scale(w, top):  # power-of-two scale, rounded up, per 32 values along K
    n, k = w.shape
    amax = np.maximum(np.abs(w.reshape(n, k // 32, 32)).max(-1), 1e-4)
    return 2.0 ** np.ceil(np.log2(amax / top))


def np_mxfp4(w):
    s = np_mx_scale(w, 6.0)
    y = w / np.repeat(s, 32, 1)
    code = np.abs(E2M1[None, None, :] - np.abs(y)[..., None]).argmin(-1).astype(np.uint8)
    code |= ((y < 0) & (code != 0)).astype(np.uint8) << 3
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).view(np.int8)
    return packed, s


def np_deq_mxfp4(packed, s):
    b = packed.view(np.uint8)
    codes = np.stack([b & 0xF, b >> 4], -1).reshape(b.shape[0], -1)
    v = np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7]
    return v * np.repeat(s.astype(np.float64), 32, 1)


def np_mxfp8(w):
    s = np_mx_scale(w, 448.0)
    q = (w / np.repeat(s, 32, 1)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    return q, s


def e8m0_bytes(s):
    return (np.log2(s).astype(np.int64) + 127).astype(np.uint8)


def build(fmt: str, seed=0, *, scale_kind="F8_E8M0", shared_fmt=None):
    """HF-named tensors of one layer in `fmt`, and the float64 dequantized weights (the model)."""
    raw = raw_weights(seed)
    r = rng(seed + 100)
    t, deq = {}, {}
    t[P + "gate.weight"] = r.normal(0, H**-0.5, (E, H)).astype(ml_dtypes.bfloat16)
    t[P + "gate.e_score_correction_bias"] = r.normal(0, 0.1, (E,)).astype(np.float32)
    for name, w in raw.items():
        f = shared_fmt if (shared_fmt and name.startswith("shared")) else fmt
        key = P + name
        if f == "bf16":
            q = w.astype(np.float32)
            t[key + ".weight"], deq[name] = q, q.astype(np.float64)
        elif f == "fp8_block":
            q, s = np_fp8_block(w)
            t[key + ".weight"], t[key + ".weight_scale_inv"] = q, s
            deq[name] = np_deq_block(q, s)
        elif f == "fp8_per_tensor":
            s = np.float32(np.abs(w).max() / 448.0 * r.uniform(1, 2))
            q = (w / s).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
            t[key + ".weight"], t[key + ".weight_scale"] = q, np.array([s], np.float32)
            deq[name] = q.astype(np.float64) * np.float64(s)
        elif f in ("mxfp4", "mxfp8"):
            q, s = np_mxfp4(w) if f == "mxfp4" else np_mxfp8(w)
            t[key + ".weight"] = q
            if scale_kind == "F32":
                t[key + ".weight_scale"] = s.astype(np.float32)
            else:
                t[key + ".weight_scale"] = (e8m0_bytes(s), scale_kind)
            deq[name] = np_deq_mxfp4(q, s) if f == "mxfp4" else q.astype(np.float64) * np.repeat(s, 32, 1)
    return t, deq


def np_layer(x, t, deq, cfg):
    """Float64 model: sigmoid scores + bias (selection only), top-k, renormalize, silu-gated experts,
    x routed_scaling_factor, + shared expert. Returns (y, selection margin per row)."""
    xf = x.astype(np.float64)
    logits = xf @ t[P + "gate.weight"].astype(np.float64).T
    scores = 1 / (1 + np.exp(-logits))
    sel = scores + t[P + "gate.e_score_correction_bias"].astype(np.float64)
    order = np.argsort(-sel, axis=1)
    ids = order[:, :cfg.top_k]
    srt = np.take_along_axis(sel, order, 1)
    margin = srt[:, cfg.top_k - 1] - srt[:, cfg.top_k]
    w = np.take_along_axis(scores, ids, 1)
    w /= w.sum(1, keepdims=True)

    def mlp(g, u, d, v):
        a = v @ deq[g].T
        b = v @ deq[u].T
        return (a / (1 + np.exp(-a)) * b) @ deq[d].T

    y = np.zeros_like(xf)
    for m in range(x.shape[0]):
        for j, e in enumerate(ids[m]):
            y[m] += w[m, j] * mlp(f"experts.{e}.gate_proj", f"experts.{e}.up_proj", f"experts.{e}.down_proj", xf[m])
    y *= cfg.routed_scaling_factor
    y += mlp("shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj", xf)
    return y, margin


def x_input(seed=7):
    return jnp.asarray(rng(seed).normal(0, 1, (M, H)), jnp.bfloat16)


def check_forward(params, cfg, t, deq, tol):
    x = x_input()
    y = np.asarray(jax.jit(moe_forward, static_argnames=("config",))(x, params, config=cfg), np.float64)
    assert np.isfinite(y).all()
    ref, margin = np_layer(np.asarray(x.astype(jnp.float32)), t, deq, cfg)
    ok = margin > 1e-3  # rows whose expert choice is not a near-tie
    assert ok.sum() >= M - 3
    err = np.linalg.norm(y[ok] - ref[ok], axis=1) / np.linalg.norm(ref[ok], axis=1)
    assert err.max() < tol, err


def save(tmp_path, t, name="model.safetensors"):
    p = tmp_path / name
    write_st(p, t)
    return p


# -- reader --------------------------------------------------------------------------------------

def test_reader_matches_safetensors_library(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    r = rng(1)
    tensors = {"a": r.normal(size=(3, 5)).astype(ml_dtypes.bfloat16), "b": r.normal(size=(7,)).astype(np.float32),
               "c": r.integers(-128, 127, (4, 3)).astype(np.int8), "d": r.integers(0, 255, (2, 9)).astype(np.uint8),
               "e": r.normal(size=(2, 2, 3)).astype(np.float16)}
    save_file(tensors, str(tmp_path / "lib.safetensors"), metadata={"format": "np"})
    ck = SafetensorsCheckpoint(tmp_path / "lib.safetensors")
    assert sorted(ck.keys()) == sorted(tensors)
    with safe_open(str(tmp_path / "lib.safetensors"), framework="numpy") as f:
        for k in tensors:
            got = ck.read(k)
            assert got.dtype == tensors[k].dtype and got.shape == tensors[k].shape
            np.testing.assert_array_equal(got.view(np.uint8), f.get_tensor(k).view(np.uint8))
            np.testing.assert_array_equal(got.view(np.uint8), tensors[k].view(np.uint8))


def test_reader_fp8_and_e8m0_bits(tmp_path):
    r = rng(2)
    q = r.normal(0, 50, (5, 6)).astype(ml_dtypes.float8_e4m3fn)
    b = r.integers(1, 254, (5, 2)).astype(np.uint8)
    write_st(tmp_path / "f.safetensors", {"q": q, "b": (b, "F8_E8M0")})
    ck = SafetensorsCheckpoint(tmp_path / "f.safetensors")
    assert ck.read("q").dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(ck.read("q").view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(ck.read("b"), b)
    assert not ck.read("q").flags.writeable


def test_reader_bad_files(tmp_path):
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="shorter than its 8-byte header"):
        read_safetensors_header(tmp_path / "short.safetensors")
    (tmp_path / "big.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(ValueError, match="header length 1000000 exceeds the file size"):
        read_safetensors_header(tmp_path / "big.safetensors")
    (tmp_path / "json.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_safetensors_header(tmp_path / "json.safetensors")
    h = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    (tmp_path / "range.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + bytes(12))
    with pytest.raises(ValueError, match=r"tensor 'a' \(F32 \[4\]\) has byte range \[0, 12\) \(expected 16"):
        read_safetensors_header(tmp_path / "range.safetensors")
    with pytest.raises(ValueError, match="neither a safetensors file nor a directory"):
        SafetensorsCheckpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        SafetensorsCheckpoint(tmp_path / "empty")
    write_st(tmp_path / "d1.safetensors", {"x": np.ones(2, np.float32)})
    write_st(tmp_path / "d2.safetensors", {"x": np.ones(2, np.float32)})
    with pytest.raises(ValueError, match="tensor 'x' appears in both"):
        SafetensorsCheckpoint([tmp_path / "d1.safetensors", tmp_path / "d2.safetensors"])


# -- round trips ---------------------------------------------------------------------------------

def test_fp8_block_checkpoint_form_is_bit_exact_and_forward_matches(tmp_path):
    t, deq = build("fp8_block", seed=3)
    cfg = config("fp8_block")
    p = load_moe_params(save(tmp_path, t), cfg, layer=3, prepare=False)
    assert p.gemm_recipe is None and p.w13.shape == (E, 2 * I, H) and p.w2.shape == (E, H, I)
    for e in range(E):
        g, u, d = (t[f"{P}experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down"))
        np.testing.assert_array_equal(np.asarray(p.w13[e]).view(np.uint8), np.concatenate([g, u]).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(p.w2[e]).view(np.uint8), d.view(np.uint8))
        gs, us, ds = (t[f"{P}experts.{e}.{n}_proj.weight_scale_inv"] for n in ("gate", "up", "down"))
        np.testing.assert_array_equal(np.asarray(p.w13_scale[e]), np.concatenate([gs, us]))
        np.testing.assert_array_equal(np.asarray(p.w2_scale[e]), ds)
    np.testing.assert_array_equal(np.asarray(p.gate_weight), t[P + "gate.weight"].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(p.e_score_correction_bias), t[P + "gate.e_score_correction_bias"])
    # shared expert: kept FP8 as it ships (e4m3 bytes and block scales, gate rows then up rows)
    sg, su, sd = (t[f"{P}shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down"))
    np.testing.assert_array_equal(np.asarray(p.shared_w13).view(np.uint8), np.concatenate([sg, su]).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(p.shared_w2).view(np.uint8), sd.view(np.uint8))
    sgs, sus, sds = (t[f"{P}shared_experts.{n}_proj.weight_scale_inv"] for n in ("gate", "up", "down"))
    np.testing.assert_array_equal(np.asarray(p.shared_w13_scale), np.concatenate([sgs, sus]))
    np.testing.assert_array_equal(np.asarray(p.shared_w2_scale), sds)
    # ... or dequantized to bf16 on request
    p16 = load_moe_params(save(tmp_path, t), cfg, layer=3, prepare=False, shared_fp8=False)
    assert p16.shared_w13_scale is None and p16.shared_w2_scale is None
    sh = np.concatenate([deq["shared_experts.gate_proj"], deq["shared_experts.up_proj"]])
    np.testing.assert_array_equal(np.asarray(p16.shared_w13.astype(jnp.float32)),
                                  sh.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32))
    for arch in (90, 100):
        c = config("fp8_block", arch=arch)
        q = load_moe_params(save(tmp_path, t), c, layer=3, arch=arch)
        assert (q.gemm_recipe, q.gemm_arch) == ("fp8_block", arch)
        # the model has unquantized activations; the layer quantizes them for the routed and (FP8,
        # as shipped) the shared GEMMs: ~4 % per GEMM, worst rows near 8 %
        check_forward(q, c, t, deq, tol=0.1)


def test_fp8_per_tensor_expands_each_projection(tmp_path):
    t, _ = build("fp8_per_tensor", seed=4)
    cfg = config("fp8_block")
    p = load_moe_params(save(tmp_path, t), cfg, layer=3, prepare=False)
    for e in range(E):
        gs, us, ds = (float(t[f"{P}experts.{e}.{n}_proj.weight_scale"][0]) for n in ("gate", "up", "down"))
        s13 = np.asarray(p.w13_scale[e])
        assert s13.shape == (2 * I // 128, H // 128)
        assert (s13[: I // 128] == np.float32(gs)).all() and (s13[I // 128:] == np.float32(us)).all()
        assert (np.asarray(p.w2_scale[e]) == np.float32(ds)).all()
        np.testing.assert_array_equal(np.asarray(p.w13[e]).view(np.uint8), np.concatenate(
            [t[f"{P}experts.{e}.{n}_proj.weight"] for n in ("gate", "up")]).view(np.uint8))


@pytest.mark.parametrize("scale_kind", ["F8_E8M0", "U8", "F32"])
def test_mxfp4_checkpoint_form_exact(tmp_path, scale_kind):
    t, _ = build("mxfp4", seed=5, scale_kind=scale_kind)
    p = load_moe_params(save(tmp_path, t), config("mxfp4"), layer=3, prepare=False)
    assert p.w13.dtype == jnp.int8 and p.w13.shape == (E, 2 * I, H // 2)
    e = E - 1
    g, u = t[f"{P}experts.{e}.gate_proj.weight"], t[f"{P}experts.{e}.up_proj.weight"]
    np.testing.assert_array_equal(np.asarray(p.w13[e]), np.concatenate([g, u]))
    s_model = np.log2(np.asarray(p.w13_scale[e], np.float64))  # exponents of the loaded scales
    ref = np.concatenate([np_mx_scale(raw_weights(5)[f"experts.{e}.{n}_proj"], 6.0) for n in ("gate", "up")])
    np.testing.assert_array_equal(s_model, np.log2(ref))


@pytest.mark.parametrize("arch", [90, 100])
def test_mxfp4_forward_both_paths(tmp_path, arch):
    t, deq = build("mxfp4", seed=6, shared_fmt="mxfp4")
    cfg = config("mxfp4", arch=arch)
    p = load_moe_params(save(tmp_path, t), cfg, layer=3, arch=arch)
    assert p.gemm_recipe == ("fp8_block" if arch == 90 else "mxfp4")
    check_forward(p, cfg, t, deq, tol=0.08)


def test_mxfp8_from_mxfp8_and_from_bf16(tmp_path):
    cfg = config("mxfp8")
    t, deq = build("mxfp8", seed=8, shared_fmt="fp8_block")
    check_forward(load_moe_params(save(tmp_path, t), cfg, layer=3, arch=100), cfg, t, deq, tol=0.08)
    t, _ = build("bf16", seed=9)
    p = load_moe_params(save(tmp_path, t, "b.safetensors"), cfg, layer=3, prepare=False)
    assert p.w13.dtype == jnp.float8_e4m3fn and p.w13_scale.shape == (E, 2 * I, H // 32)
    # quantized at load (SPEC §2.1 D): power-of-two scales, each value within e4m3 rounding
    s = np.asarray(p.w13_scale[2], np.float64)
    assert (np.frexp(s)[0] == 0.5).all()
    w = np.concatenate([t[f"{P}experts.2.{n}_proj.weight"] for n in ("gate", "up")])
    w = w.astype(ml_dtypes.bfloat16).astype(np.float64)  # F32 tensors are read as bf16 values
    q = np.asarray(p.w13[2].astype(jnp.float32), np.float64) * np.repeat(s, 32, 1)
    assert (np.abs(q - w) <= 2.0**-4 * np.abs(w) + 2.0**-9 * np.repeat(s, 32, 1)).all()
    amax = np.abs(w).reshape(2 * I, H // 32, 32).max(-1)
    assert (amax / s <= 448).all() and (amax / s > 224).all()  # smallest power of two that fits


def test_bf16_with_library_writer_and_index_directory(tmp_path):
    from safetensors.numpy import save_file

    t, deq = build("bf16", seed=10)
    t = {k: v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 and "bias" not in k else v for k, v in t.items()}
    deq = {k: v.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64) for k, v in deq.items()}
    names = sorted(t)
    d = tmp_path / "ckpt"
    d.mkdir()
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, ns in parts.items():
        save_file({n: t[n] for n in ns}, str(d / f))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in parts.items() for n in ns}}))
    (d / "unrelated.safetensors").write_bytes(b"not read: the index names the files")
    cfg = config("bf16")
    p = load_moe_params(d, cfg, layer=3)
    assert p.w13.dtype == jnp.bfloat16
    check_forward(p, cfg, t, deq, tol=0.03)


def test_expert_range_loads_only_local_experts(tmp_path):
    t, _ = build("fp8_block", seed=11)
    path = save(tmp_path, t)
    for e in (1, 3):  # the experts outside the range may be absent altogether
        for n in ("gate", "up", "down"):
            del t[f"{P}experts.{e}.{n}_proj.weight"]
    write_st(path, t)
    cfg = config("fp8_block")
    p = load_moe_params(path, cfg, layer=3, expert_range=(4, 6), prepare=False)
    assert p.w13.shape[0] == 2 and p.gate_weight.shape == (E, H)
    for j, e in enumerate((4, 5)):
        np.testing.assert_array_equal(np.asarray(p.w2[j]).view(np.uint8),
                                      t[f"{P}experts.{e}.down_proj.weight"].view(np.uint8))
    with pytest.raises(CheckpointError) as ei:
        load_moe_params(path, cfg, layer=3, expert_range=(0, 4))
    msg = str(ei.value)
    assert "6 problem(s)" in msg
    for e in (1, 3):
        for n in ("gate", "up", "down"):
            assert f"missing {P}experts.{e}.{n}_proj.weight" in msg


# -- bad input -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_tensors():
    return build("fp8_block", seed=12)[0]


def _load_err(tmp_path, t, cfg=None, **kw):
    write_st(tmp_path / "bad.safetensors", t)
    with pytest.raises(CheckpointError) as ei:
        load_moe_params(tmp_path / "bad.safetensors", cfg or config("fp8_block"), layer=3, **kw)
    return str(ei.value)


def test_every_missing_and_misshaped_tensor_is_listed(tmp_path, fp8_tensors):
    t = dict(fp8_tensors)
    del t[P + "experts.2.up_proj.weight"]
    del t[P + "experts.5.down_proj.weight_scale_inv"]
    del t[P + "gate.e_score_correction_bias"]
    t[P + "experts.0.gate_proj.weight"] = t[P + "experts.0.gate_proj.weight"][:, :128]
    t[P + "gate.weight"] = t[P + "gate.weight"][:, :100]
    msg = _load_err(tmp_path, t)
    assert "5 problem(s)" in msg
    assert f"missing {P}experts.2.up_proj.weight" in msg
    assert f"missing {P}experts.5.down_proj.weight_scale_inv" in msg
    assert f"missing {P}gate.e_score_correction_bias" in msg
    assert f"{P}experts.0.gate_proj.weight: expected shape (128, 256), got (128, 128)" in msg
    assert f"{P}gate.weight: expected shape (6, 256), got (6, 100)" in msg


def test_misshaped_scale_and_wrong_dtypes(tmp_path, fp8_tensors):
    t = dict(fp8_tensors)
    t[P + "experts.1.gate_proj.weight_scale_inv"] = np.ones((3, 2), np.float32)
    t[P + "experts.3.down_proj.weight"] = t[P + "experts.3.down_proj.weight"].view(np.uint8).astype(np.int32)
    t[P + "experts.4.up_proj.weight_scale_inv"] = t[P + "experts.4.up_proj.weight_scale_inv"].astype(np.float16)
    t[P + "gate.e_score_correction_bias"] = np.ones(E, np.int32)
    msg = _load_err(tmp_path, t)
    assert "4 problem(s)" in msg
    assert "experts.1.gate_proj.weight_scale_inv: expected shape (1, 2) (128x128 blocks)" in msg
    assert "experts.3.down_proj.weight: dtype I32 is not an accepted expert weight dtype" in msg
    assert "experts.4.up_proj.weight_scale_inv: expected dtype in ('F32', 'BF16', 'F8_E8M0') for format fp8_block, got F16" in msg
    assert "gate.e_score_correction_bias: expected dtype in" in msg


def test_mixed_formats_rejected(tmp_path, fp8_tensors):
    t = dict(fp8_tensors)
    del t[P + "experts.2.gate_proj.weight_scale_inv"]
    t[P + "experts.2.gate_proj.weight"] = np.ones((I, H), np.float32)
    msg = _load_err(tmp_path, t)
    assert "experts.2.gate_proj.weight: format bf16 (weight F32, scale None) differs from fp8_block" in msg


def test_recipe_the_checkpoint_cannot_provide(tmp_path, fp8_tensors):
    msg = _load_err(tmp_path, fp8_tensors, cfg=config("mxfp4"))
    assert "recipe 'mxfp4' cannot be loaded from fp8_block expert weights (it loads from ('mxfp4',))" in msg
    msg = _load_err(tmp_path, fp8_tensors, cfg=config("bf16"))
    assert "recipe 'bf16' cannot be loaded from fp8_block" in msg


def test_target_arch_that_cannot_run_the_recipe(tmp_path, fp8_tensors):
    write_st(tmp_path / "a.safetensors", fp8_tensors)
    with pytest.raises(ValueError, match=r"arch: target arch 90 cannot run recipe 'mxfp8' \(runs on \(100,\)\)"):
        load_moe_params(tmp_path / "a.safetensors", config("mxfp8"), layer=3, arch=90)
    with pytest.raises(ValueError, match="arch: target arch 80 cannot run recipe 'fp8_block'"):
        load_moe_params(tmp_path / "a.safetensors", config("fp8_block"), layer=3, arch=80)
    with pytest.raises(ValueError, match=r"arch: 100 disagrees with config.gemm_arch=90 \(set MoEConfig.arch=100\)"):
        load_moe_params(tmp_path / "a.safetensors", config("fp8_block"), layer=3, arch=100)


def test_config_and_checkpoint_routing_disagree(tmp_path, fp8_tensors):
    msg = _load_err(tmp_path, fp8_tensors, cfg=config("fp8_block", use_correction_bias=False))
    assert "gate.e_score_correction_bias: present, but config.use_correction_bias is False" in msg
    cfg = config("fp8_block", hash_routing=True, use_correction_bias=False, vocab_size=50)
    msg = _load_err(tmp_path, fp8_tensors, cfg=cfg)
    assert f"missing {P}gate.tid2eid" in msg
    t = dict(fp8_tensors)
    t[P + "gate.tid2eid"] = np.zeros((50, K_TOP), np.int32) + np.arange(K_TOP, dtype=np.int32)
    msg = _load_err(tmp_path, t)
    assert f"{P}gate.tid2eid: present (a hash-routed layer), but config.hash_routing is False" in msg


def test_hash_routing_table_loaded(tmp_path, fp8_tensors):
    t = dict(fp8_tensors)
    tid = rng(13).integers(0, E, (50, K_TOP)).astype(np.int64)
    t[P + "gate.tid2eid"] = tid.astype(np.int32)
    write_st(tmp_path / "h.safetensors", t)
    cfg = config("fp8_block", hash_routing=True, use_correction_bias=False, vocab_size=50)
    p = load_moe_params(tmp_path / "h.safetensors", cfg, layer=3, prepare=False)
    np.testing.assert_array_equal(np.asarray(p.tid2eid), tid)


@pytest.mark.parametrize("bad", [0, 255])
def test_invalid_e8m0_scale_bytes(tmp_path, bad):
    t, _ = build("mxfp4", seed=14)
    b, kind = t[P + "experts.1.down_proj.weight_scale"]
    b = b.copy()
    b[3, 1] = bad
    t[P + "experts.1.down_proj.weight_scale"] = (b, kind)
    msg = _load_err(tmp_path, t, cfg=config("mxfp4"))
    assert "experts.1.down_proj.weight_scale: 1 scale byte(s) are 0 or 255" in msg


def test_non_power_of_two_mx_scales(tmp_path):
    t, _ = build("mxfp4", seed=15, scale_kind="F32")
    s = t[P + "experts.0.up_proj.weight_scale"].copy()
    s[0, 0] *= 1.5
    t[P + "experts.0.up_proj.weight_scale"] = s
    msg = _load_err(tmp_path, t, cfg=config("mxfp4"))
    assert "experts.0.up_proj.weight_scale: 1 F32 scale(s) are not positive powers of two" in msg


def test_bad_arguments(tmp_path, fp8_tensors):
    write_st(tmp_path / "a.safetensors", fp8_tensors)
    f, cfg = tmp_path / "a.safetensors", config("fp8_block")
    with pytest.raises(ValueError, match=r"expert_range: expected \(start, stop\) with 0 <= start < stop "
                                         r"<= num_experts=6, got \(4, 7\)"):
        load_moe_params(f, cfg, layer=3, expert_range=(4, 7))
    with pytest.raises(ValueError, match="expert_range"):
        load_moe_params(f, cfg, layer=3, expert_range=(2, 2))
    with pytest.raises(ValueError, match="layer/prefix: give exactly one"):
        load_moe_params(f, cfg, layer=3, prefix=P)
    with pytest.raises(ValueError, match="layer: expected a non-negative int, got -1"):
        load_moe_params(f, cfg, layer=-1)
    with pytest.raises(TypeError, match="config: expected MoEConfig"):
        load_moe_params(f, {"recipe": "fp8_block"}, layer=3)
    with pytest.raises(CheckpointError, match=r"no tensor of layer 4 under any known naming "
                                              r"\(model.layers.4.mlp., layers.4.ffn., model.layers.4.ffn.\); "
                                              r"the files hold layers 3"):
        load_moe_params(f, cfg, layer=4)
    p = load_moe_params(f, cfg, prefix=P, prepare=False)  # explicit prefix, same tensors
    assert p.w13.shape == (E, 2 * I, H)


def test_scale_value_problems_are_listed_with_every_other_problem(tmp_path):
    """Invalid MX scale values of several experts and of the shared expert, plus a missing tensor:
    one CheckpointError lists them all, before any weight is stacked."""
    t, _ = build("mxfp4", seed=16, shared_fmt="mxfp4")
    for name, (r, c) in (("experts.0.gate_proj", (1, 2)), ("experts.4.down_proj", (5, 0)),
                         ("shared_experts.up_proj", (0, 7))):
        b, kind = t[P + name + ".weight_scale"]
        b = b.copy()
        b[r, c] = 255
        t[P + name + ".weight_scale"] = (b, kind)
    del t[P + "experts.2.up_proj.weight"]
    msg = _load_err(tmp_path, t, cfg=config("mxfp4"))
    assert "4 problem(s)" in msg, msg
    for name in ("experts.0.gate_proj", "experts.4.down_proj", "shared_experts.up_proj"):
        assert f"{P}{name}.weight_scale: 1 scale byte(s) are 0 or 255" in msg
    assert f"missing {P}experts.2.up_proj.weight" in msg


def test_hash_table_with_ids_outside_the_experts(tmp_path, fp8_tensors):
    t = dict(fp8_tensors)
    tid = rng(17).integers(0, E, (50, K_TOP)).astype(np.int32)
    tid[3, 1], tid[9, 0] = E, -1  # routing would gather past the experts / drop the route
    t[P + "gate.tid2eid"] = tid
    msg = _load_err(tmp_path, t, cfg=config("fp8_block", hash_routing=True, use_correction_bias=False, vocab_size=50))
    assert "1 problem(s)" in msg
    assert f"{P}gate.tid2eid: 2 expert id(s) outside [0, {E}) (values -1..{E})" in msg


def test_index_or_list_naming_a_missing_file(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    write_st(d / "a.safetensors", {"x": np.ones(2, np.float32)})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}))
    with pytest.raises(ValueError, match=r"names file\(s\) that do not exist: \[.*b.safetensors'\]"):
        SafetensorsCheckpoint(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="is not an index with a 'weight_map'"):
        SafetensorsCheckpoint(d)
    with pytest.raises(ValueError, match=r"path: no such safetensors file\(s\): \[.*nope.safetensors'\]"):
        SafetensorsCheckpoint([d / "a.safetensors", d / "nope.safetensors"])


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_per_tensor"])
def test_fp8_scales_that_are_not_positive_finite(tmp_path, fmt):
    t, _ = build(fmt, seed=18)
    suffix = ".weight_scale_inv" if fmt == "fp8_block" else ".weight_scale"
    for name, v in (("experts.1.up_proj", 0.0), ("experts.5.down_proj", np.nan)):
        sc = t[P + name + suffix].copy()
        sc.reshape(-1)[0] = v
        t[P + name + suffix] = sc
    msg = _load_err(tmp_path, t)
    assert "2 problem(s)" in msg, msg
    for name in ("experts.1.up_proj", "experts.5.down_proj"):
        assert f"{P}{name}{suffix}: 1 F32 scale(s) are not positive finite numbers" in msg
