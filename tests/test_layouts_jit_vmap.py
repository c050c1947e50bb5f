"""Every public array function of layouts runs under jit, and jit(vmap(f)) over a leading batch
equals jit(f) applied to each example (bit for bit). Eager calls are covered by the other files."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import layouts as L

B = 3
rng = np.random.default_rng(2024)


def _normal(*shape):
    return jnp.asarray(rng.normal(size=shape) * 3, jnp.float32)


def _pow2(*shape):
    return jnp.asarray(np.ldexp(1.0, rng.integers(-30, 30, size=shape)), jnp.float32)


def _fp8(*shape):
    return _normal(*shape).astype(jnp.float8_e4m3fn)


def _int8(*shape):
    return jnp.asarray(rng.integers(-128, 128, size=shape), jnp.int8)


def _uint8(*shape, hi=256):
    return jnp.asarray(rng.integers(0, hi, size=shape), jnp.uint8)


# name: (function of arrays only, batched example arrays)
CASES = {
    "ceil_to_ue8m0": (L.ceil_to_ue8m0, lambda: (_normal(B, 7),)),
    "e8m0_round_up_bytes": (L.e8m0_round_up_bytes, lambda: (_normal(B, 7),)),
    "is_ue8m0": (L.is_ue8m0, lambda: (_pow2(B, 7),)),
    "ue8m0_bytes_to_fp32": (L.ue8m0_bytes_to_fp32, lambda: (_uint8(B, 7),)),
    "ue8m0_scale_from_amax": (lambda a: L.ue8m0_scale_from_amax(a, 448.0), lambda: (jnp.abs(_normal(B, 7)),)),
    "pack_ue8m0": (functools.partial(L.pack_ue8m0, check=False), lambda: (_pow2(B, 5, 7),)),
    "unpack_ue8m0": (lambda p: L.unpack_ue8m0(p, 7), lambda: (L.pack_ue8m0(_pow2(B, 5, 7)),)),
    "cast_to_e4m3": (L.cast_to_e4m3, lambda: (_normal(B, 9) * 100,)),
    "store_as": (lambda x: L.store_as(x, jnp.bfloat16), lambda: (_normal(B, 9),)),
    "fp8_scale_from_amax": (lambda a: L.fp8_scale_from_amax(a, True), lambda: (jnp.abs(_normal(B, 7)),)),
    "quantize_fp8_per_token_group": (functools.partial(L.quantize_fp8_per_token_group, group_size=32),
                                     lambda: (_normal(B, 4, 70),)),
    "dequantize_fp8_per_token_group": (functools.partial(L.dequantize_fp8_per_token_group, group_size=32),
                                       lambda: (_fp8(B, 4, 70), _normal(B, 4, 3))),
    "quantize_fp8_per_block": (functools.partial(L.quantize_fp8_per_block, block_size=16, ue8m0=True),
                               lambda: (_normal(B, 20, 33),)),
    "dequantize_fp8_per_block": (functools.partial(L.dequantize_fp8_per_block, block_size=16),
                                 lambda: (_fp8(B, 20, 33), _normal(B, 2, 3))),
    "quantize_mxfp8": (L.quantize_mxfp8, lambda: (_normal(B, 4, 70),)),
    "encode_e2m1": (L.encode_e2m1, lambda: (_normal(B, 9),)),
    "decode_e2m1": (L.decode_e2m1, lambda: (_uint8(B, 9, hi=16),)),
    "pack_e2m1": (L.pack_e2m1, lambda: (_uint8(B, 10, hi=16),)),
    "unpack_e2m1": (L.unpack_e2m1, lambda: (_int8(B, 5),)),
    "quantize_mxfp4": (L.quantize_mxfp4, lambda: (_normal(B, 4, 70),)),
    "dequantize_mxfp4": (L.dequantize_mxfp4, lambda: (_int8(B, 4, 35), _pow2(B, 4, 3))),
    "to_mn_major_tma_aligned": (L.to_mn_major_tma_aligned, lambda: (_normal(B, 2, 9, 3),)),
    "from_mn_major_tma_aligned": (lambda i: L.from_mn_major_tma_aligned(i, 9), lambda: (_normal(B, 2, 3, 12),)),
    "pack_ue8m0_mn_major_tma_aligned": (functools.partial(L.pack_ue8m0_mn_major_tma_aligned, check=False),
                                        lambda: (_pow2(B, 2, 9, 5),)),
    "unpack_ue8m0_mn_major_tma_aligned": (lambda i: L.unpack_ue8m0_mn_major_tma_aligned(i, 9, 5),
                                          lambda: (L.pack_ue8m0_mn_major_tma_aligned(_pow2(B, 2, 9, 5)),)),
    "broadcast_block_scale_to_rows": (lambda s: L.broadcast_block_scale_to_rows(s, 200, 128),
                                      lambda: (_normal(B, 2, 3),)),
    "transform_sf_into_required_layout/90": (
        lambda s: L.transform_sf_into_required_layout(s, 9, 300, (1, 128), num_groups=2, arch=90),
        lambda: (_normal(B, 2, 9, 3),)),
    "transform_sf_into_required_layout/100": (
        lambda s: L.transform_sf_into_required_layout(s, 130, 300, (128, 128), arch=100),
        lambda: (_pow2(B, 2, 3),)),
    "mxfp4_to_fp8_block": (L.mxfp4_to_fp8_block, lambda: (_int8(B, 130, 48), _pow2(B, 130, 3))),
    "requant_fp8_block_ue8m0": (L.requant_fp8_block_ue8m0, lambda: (_fp8(B, 130, 100), _normal(B, 2, 1))),
    "expand_per_tensor_scale": (lambda s: L.expand_per_tensor_scale(s, 300, 129), lambda: (_normal(B, 4),)),
    "interleave_gate_up": (L.interleave_gate_up, lambda: (_fp8(B, 2, 32, 5),)),
    "deinterleave_gate_up": (lambda w: L.deinterleave_gate_up(w, 4), lambda: (_normal(B, 24, 3),)),
    "prepare_expert_weights/mxfp4/90": (
        lambda w, s: L.prepare_expert_weights(w, s, recipe="mxfp4", arch=90),
        lambda: (_int8(B, 2, 130, 48), _pow2(B, 2, 130, 3))),
}


def _leaves(x):
    return [np.asarray(v) for v in jax.tree_util.tree_leaves(x)]


def _same(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        assert u.dtype == v.dtype and u.shape == v.shape
        np.testing.assert_array_equal(u.view(np.uint8), v.view(np.uint8))


@pytest.mark.parametrize("name", sorted(CASES))
def test_jit_and_vmap(name):
    f, make = CASES[name]
    args = make()
    fj = jax.jit(f)
    each = [fj(*(a[i] for a in args)) for i in range(B)]
    batched = jax.jit(jax.vmap(f))(*args)
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *each)
    _same(batched, stacked)


def test_every_public_function_is_covered():
    arrays_api = {n for n in L.__all__ if callable(getattr(L, n)) and not isinstance(getattr(L, n), type)}
    arrays_api -= {"get_recipe", "gemm_format", "check_arch", "ceil_div", "align",
                   "get_tma_aligned_size"}  # static helpers
    covered = {n.split("/")[0] for n in CASES}
    assert arrays_api <= covered, arrays_api - covered
