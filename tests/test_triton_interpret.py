"""The Triton kernels themselves, run on the CPU by Triton's interpreter, against numpy models.

Each case launches a kernel of `custom_calls.triton` on numpy buffers (fresh random inputs,
outputs poisoned beforehand) and checks every output element against an independent numpy /
float64 model written here. Needs `triton` (not `jax_triton`); skipped when it is absent.

Triton's interpreter is selected by TRITON_INTERPRET=1 before triton is imported, so the cases run
in a subprocess (this file executed as a script, `interpreter_script.InterpreterServer`) that each
pytest worker starts once and asks for its own cases. The interpreter's own float down-casts are not
round-to-nearest-even; the subprocess replaces them with ml_dtypes' exact casts (the GPU's cvt.rn
instructions round to nearest even).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
from interpreter_script import InterpreterServer, serve

CASES = [
    "quant_fp32_image", "quant_ue8m0_image", "quant_mxfp8_partial_group",
    "permute_contig_fp8_90", "permute_contig_fp8_100", "permute_contig_mxfp8_100", "permute_contig_bf16",
    "permute_masked_fp8_90", "permute_masked_fp8_100", "permute_masked_odd_pad_stray_90",
    "permute_masked_odd_pad_100", "quant_w4a8_order", "permute_contig_w4a8_order", "permute_masked_w4a8_order",
    "act_contig_silu_90", "act_contig_silu_limit_100", "act_contig_oai_90", "act_contig_situ_100",
    "act_contig_keep_fp32_90", "act_contig_mxfp8_100", "act_contig_bf16",
    "act_masked_silu_limit_90", "act_masked_situ_100", "act_masked_oai_100", "act_masked_count_over_m_pad",
    "act_masked_w4a8_order", "act_contig_w4a8_order",
    "unpermute_bf16", "unpermute_f32_out", "unpermute_row_past_end", "unpermute_addend", "dispatch_rank_e32", "dispatch_rank_e5",
    "dispatch_map_contig_one_launch", "dispatch_map_contig_two_launches", "dispatch_map_masked_one_launch",
    "dispatch_map_masked_two_launches",
    "route_sigmoid_grouped_bias", "route_softmax_grouped_no_bias", "route_softmax_e20",
    "route_sqrtsoftplus_bias", "route_v3_one_token_per_program", "route_groups_not_power_of_two",
    "route_ties_lower_index_wins",
    # the host entry points (custom_calls.triton.*_kernel), launches run by the interpreter: the
    # heuristic config against the models, a non-default config bit for bit against the heuristic
    "host_quant_configs", "host_permute_configs", "host_act_configs", "host_unpermute_config",
    "host_rank_config", "host_route_config", "host_dispatch_map_configs", "host_fused_input_configs",
    "router_partials", "host_fused_input_routed", "w4a8_table_words", "host_w4a8_masked", "host_w4a8_contig",
    "layer_w4a8", "w4a8_expand",
]


# ---------------------------------------------------------------- pytest side


# The default run keeps a few cases of every kernel against its model; the rest (variants, the sweeps
# over non-default configs, the two-launch forms) are the `slow` set.
FAST_CASES = {"quant_ue8m0_image", "quant_mxfp8_partial_group", "permute_contig_fp8_90", "permute_masked_fp8_100",
              "act_contig_silu_90", "act_masked_silu_limit_90", "act_contig_mxfp8_100", "unpermute_addend",
              "dispatch_rank_e5", "dispatch_map_contig_one_launch", "dispatch_map_masked_one_launch",
              "route_sigmoid_grouped_bias", "route_sqrtsoftplus_bias", "router_partials", "host_fused_input_routed",
              "w4a8_table_words", "host_w4a8_masked", "host_w4a8_contig", "permute_masked_w4a8_order",
              "act_masked_w4a8_order", "w4a8_expand"}
SLOW_CASES = set(CASES) - FAST_CASES
assert FAST_CASES <= set(CASES), FAST_CASES - set(CASES)


@pytest.fixture(scope="session")  # one subprocess per worker that runs a case of this module
def interpreter():
    server = InterpreterServer(__file__)
    yield server
    server.close()


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c
                                  for c in CASES])
def test_kernel_under_interpreter(interpreter, case):
    assert interpreter.run(case) == "ok"


def _kernel_modules():
    pytest.importorskip("triton")
    import importlib

    return {name: importlib.import_module(f"custom_calls.triton.{name}_kernel")
            for name in ("permute", "activation", "quant", "unpermute", "dispatch", "dispatch_map", "routing",
                         "fused_input")}


def test_heuristic_configs_are_the_measured_defaults():
    """The tilings the benchmark measured (BENCHMARKS.md) at the DeepSeek-V3 shapes; hashable and
    frozen, so they can be static jit arguments."""
    import dataclasses

    k = _kernel_modules()
    assert k["permute"].heuristic_config("fp8_block") == k["permute"].PermuteConfig(
        tile=1024, tokens=4, zero_rows=64, zero_sub=4, num_warps=4, chunks_fastest=True, source_block=1024,
        image_rows=128, image_groups=8)
    assert k["quant"].heuristic_config("fp8_block", 90) == k["quant"].GroupQuantConfig(1024, 4, 4, True)
    assert k["quant"].heuristic_config("mxfp8", 100) == k["quant"].GroupQuantConfig(1024, 4, 4, True)
    assert k["activation"].heuristic_config(2048, "fp8_block") == k["activation"].ActQuantConfig(1024, 4, 4, True)
    assert k["activation"].heuristic_config(160, "mxfp8") == k["activation"].ActQuantConfig(256, 16, 4, True)
    assert k["unpermute"].heuristic_config() == k["unpermute"].UnpermuteConfig(1024, 4)
    assert k["dispatch"].heuristic_config(32) == k["dispatch"].RankConfig(128, 4)
    assert k["routing"].heuristic_config(256) == k["routing"].RouteTopkConfig(8, 4)
    assert k["routing"].heuristic_config(256, 4096, 8) == k["routing"].RouteTopkConfig(8, 4)
    # decode: one token per single-warp program; in between, fewer tokens per program than at prefill
    assert k["routing"].heuristic_config(256, 128, 8) == k["routing"].RouteTopkConfig(1, 1)
    assert k["routing"].heuristic_config(256, 1024, 8) == k["routing"].RouteTopkConfig(4, 4)
    # the fused kernel's input stage: one row per program at decode, four at prefill (23.6 µs at 4096);
    # the routes in programs of their own up to 256 row blocks
    fi = k["fused_input"]
    assert fi.heuristic_config(128) == fi.FusedInputConfig(1024, 1, 4, True, 2048, True)
    assert fi.heuristic_config(512) == fi.FusedInputConfig(1024, 1, 4, True, 2048, False)
    assert fi.heuristic_config(1024) == fi.FusedInputConfig(1024, 4, 4, True, 2048, True)
    assert fi.heuristic_config(4096) == fi.FusedInputConfig(1024, 4, 4, True, 2048, False)
    # with the routing epilogue: one warp per decode row (its reductions stay in the warp)
    assert fi.heuristic_config(128, routed=True) == fi.FusedInputConfig(1024, 1, 1, True, 2048, True)
    assert fi.heuristic_config(4096, routed=True) == fi.FusedInputConfig(1024, 4, 4, True, 2048, False)
    with pytest.raises(ValueError, match="route_programs"):
        fi.FusedInputConfig(1024, 1, 4, True, 2048, 1)
    cfg = k["permute"].heuristic_config("mxfp8")
    assert hash(cfg) == hash(dataclasses.replace(cfg)) and cfg == dataclasses.replace(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tile = 2048


def test_dispatch_map_heuristic_is_one_launch_at_decode():
    """Up to 4096 routes one launch of one sub-block per program (4 warps); above, about 128 chunks
    (two launches, 8 warps)."""
    dk = _kernel_modules()["dispatch_map"]
    cfg = dk.heuristic_config(128 * 8, 32)  # decode: 128 tokens, top-8, 32 local experts
    assert cfg == dk.DispatchMapConfig(sub=128, subs=1, num_warps=4, one_launch=True)
    assert dk.heuristic_config(4096, 256) == dk.DispatchMapConfig(sub=16, subs=1, num_warps=4, one_launch=True)
    assert dk.heuristic_config(4096 * 8, 32) == dk.DispatchMapConfig(sub=128, subs=2, num_warps=8)
    assert dk.heuristic_config(16384 * 8, 32) == dk.DispatchMapConfig(sub=128, subs=8, num_warps=8)
    assert dk.heuristic_config(40, 1000) == dk.DispatchMapConfig(sub=16, subs=1, num_warps=4, one_launch=True)


def test_bad_configs_are_refused_naming_the_field():
    import dataclasses

    import jax.numpy as jnp

    from custom_calls.activation import ActivationSpec

    k = _kernel_modules()
    pk, qk, ak = k["permute"], k["quant"], k["activation"]
    with pytest.raises(ValueError, match=r"PermuteConfig\.tile: expected a power of two, got 96"):
        dataclasses.replace(pk.heuristic_config("fp8_block"), tile=96)
    with pytest.raises(ValueError, match=r"PermuteConfig\.zero_sub: expected at most zero_rows = 64, got 128"):
        dataclasses.replace(pk.heuristic_config("fp8_block"), zero_sub=128)
    with pytest.raises(ValueError, match=r"GroupQuantConfig\.num_warps: expected one of .*, got 3"):
        dataclasses.replace(qk.heuristic_config("fp8_block", 90), num_warps=3)
    with pytest.raises(ValueError, match=r"ActQuantConfig\.chunks_fastest: expected a bool, got 1"):
        dataclasses.replace(ak.heuristic_config(2048, "fp8_block"), chunks_fastest=1)
    with pytest.raises(ValueError, match=r"UnpermuteConfig\.block_h: expected a power of two, got 0"):
        k["unpermute"].UnpermuteConfig(block_h=0, num_warps=4)
    with pytest.raises(ValueError, match=r"DispatchMapConfig\.sub: expected a power of two, got 48"):
        k["dispatch_map"].DispatchMapConfig(sub=48, subs=1, num_warps=4)
    with pytest.raises(ValueError, match=r"DispatchMapConfig\.subs: expected a positive int, got 0"):
        k["dispatch_map"].DispatchMapConfig(sub=64, subs=0, num_warps=4)
    with pytest.raises(ValueError, match=r"DispatchMapConfig\.one_launch: expected a bool, got 1"):
        k["dispatch_map"].DispatchMapConfig(sub=64, subs=1, num_warps=4, one_launch=1)
    with pytest.raises(ValueError, match=r"dispatch_map: num_experts: at most 1024 local experts, got 1025"):
        k["dispatch_map"].dispatch_map_masked(jnp.zeros((4, 2), jnp.int32), jnp.int32(0), num_local_experts=1025,
                                              m_pad=128)
    with pytest.raises(ValueError, match=r"RouteTopkConfig\.block_t: expected a power of two, got True"):
        k["routing"].RouteTopkConfig(block_t=True, num_warps=4)
    # against the problem, before anything is launched
    x = jnp.ones((8, 640), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"GroupQuantConfig\.tile: expected a multiple of the scale group size 128, "
                                         r"got 64"):
        qk.quantize_activation(x, "fp8_block", 90, config=dataclasses.replace(qk.heuristic_config("fp8_block", 90),
                                                                               tile=64))
    with pytest.raises(ValueError, match=r"GroupQuantConfig\.tile: expected a multiple of 4 x 128 = 512 \(packed"):
        qk.quantize_activation(x, "fp8_block", 100, config=dataclasses.replace(qk.heuristic_config("fp8_block", 100),
                                                                                tile=256))
    gateup = jnp.ones((8, 320), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"ActQuantConfig\.tile: expected a multiple of 4 x 32 = 128"):
        ak.activation_quant_contig(gateup, act=ActivationSpec(kind="silu"), recipe="mxfp8", arch=100,
                                   config=dataclasses.replace(ak.heuristic_config(160, "mxfp8"), tile=64))
    src2dst = jnp.zeros((8, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"PermuteConfig\.image_groups: expected a multiple of 4"):
        pk.permute_contig(x, src2dst, num_rows=128, recipe="fp8_block", arch=100,
                          config=dataclasses.replace(pk.heuristic_config("fp8_block"), image_groups=2))
    with pytest.raises(ValueError, match=r"PermuteConfig\.tile: expected a multiple of the scale group size 128"):
        pk.permute_masked(x, src2dst, num_groups=2, m_pad=128, recipe="bf16", arch=90,
                          config=dataclasses.replace(pk.heuristic_config("bf16"), tile=64))
    with pytest.raises(TypeError, match="config: expected a PermuteConfig or None, got GroupQuantConfig"):
        pk.permute_contig(x, src2dst, num_rows=128, recipe="fp8_block", arch=90,
                          config=qk.heuristic_config("fp8_block", 90))
    fk = k["fused_input"]
    with pytest.raises(ValueError, match=r"FusedInputConfig\.zero_block: expected a power of two, got 100"):
        fk.FusedInputConfig(1024, 1, 4, True, zero_block=100)
    from layouts import FusedMoEBuffer

    with pytest.raises(ValueError, match=r"FusedInputConfig\.tile: expected a multiple of the scale group size 128"):
        fk.fused_input(jnp.ones((8, 512), jnp.bfloat16), src2dst, jnp.ones((8, 2), jnp.float32),
                       buffer=FusedMoEBuffer(max_tokens=8, hidden=512, intermediate=256, num_experts=4, top_k=2,
                                             block_m=64), routed_scaling_factor=1.0,
                       config=fk.FusedInputConfig(64, 1, 4, True))
    with pytest.raises(ValueError, match=r"RankConfig\.chunk: 1 routes per chunk make 20000 chunks .* at most 16384"):
        k["dispatch"].rank_within_expert(jnp.zeros((20000,), jnp.int32), num_experts=4,
                                         config=k["dispatch"].RankConfig(chunk=1, num_warps=4))


# ---------------------------------------------------------------- numpy models (no code under test)

E4M3_MAX = 448.0


def _ml():
    import ml_dtypes

    return ml_dtypes


def ceil_div(a, b):
    return -(-a // b)


def model_group_scales(x32: np.ndarray, group: int, ue8m0: bool) -> np.ndarray:
    """x32 (..., K) f32 -> sf (..., G) f32: amax floored at 1e-4, / 448 (IEEE f32 division), or
    the smallest power of two p with p * 448 >= amax (found in float64)."""
    k = x32.shape[-1]
    g = ceil_div(k, group)
    xp = np.zeros((*x32.shape[:-1], g * group), np.float32)
    xp[..., :k] = x32
    amax = np.maximum(np.abs(xp.reshape(*x32.shape[:-1], g, group)).max(-1), np.float32(1e-4))
    if not ue8m0:
        return (amax / np.float32(E4M3_MAX)).astype(np.float32)
    p = np.exp2(np.ceil(np.log2(amax.astype(np.float64) / E4M3_MAX)))
    p = np.where(p * E4M3_MAX < amax, p * 2, p)
    p = np.where((p / 2) * E4M3_MAX >= amax, p / 2, p)
    return p.astype(np.float32)


def model_quant_values(x32: np.ndarray, sf: np.ndarray, group: int) -> np.ndarray:
    """e4m3(clip(x * f32(1/sf))) (..., K) given the per-group sf (..., G)."""
    k = x32.shape[-1]
    inv = (np.float32(1.0) / sf).astype(np.float32)
    y = x32 * np.repeat(inv, group, axis=-1)[..., :k]
    return np.clip(y, -E4M3_MAX, E4M3_MAX).astype(_ml().float8_e4m3fn)


def read_image(img: np.ndarray, mn: int, g: int, ue8m0: bool) -> np.ndarray:
    """Image (..., G', LD) -> sf (..., mn, g) f32, decoded by hand (fp32 transpose, or bytes)."""
    if not ue8m0:
        return np.swapaxes(img, -1, -2)[..., :mn, :g]
    words = img.view(np.uint32)
    b = (words[..., None] >> np.array([0, 8, 16, 24], np.uint32)) & 0xFF  # (..., W, LD, 4)
    b = np.swapaxes(b, -2, -3)  # (..., LD, W, 4)
    b = b.reshape(*b.shape[:-2], -1)[..., :mn, :g]
    return (b.astype(np.uint32) << 23).view(np.float32)


def image_tail_bytes_zero(img: np.ndarray, g: int) -> bool:
    """Packed words: bytes of groups >= g are 0."""
    words = img.view(np.uint32)
    b = (words[..., None] >> np.array([0, 8, 16, 24], np.uint32)) & 0xFF
    b = np.swapaxes(b, -2, -3).reshape(*img.shape[:-2], img.shape[-1], -1)
    return bool((b[..., g:] == 0).all())


def model_activation(gateup: np.ndarray, kind: str, limit=None, alpha=None, bs=1.0, bl=1.0) -> np.ndarray:
    """gateup (..., 2I) -> (..., I) float64."""
    x = gateup.astype(np.float64)
    i = x.shape[-1] // 2
    gate, up = x[..., :i], x[..., i:]
    sig = lambda v: 1.0 / (1.0 + np.exp(-v))  # noqa: E731
    if kind == "situ":
        return bs * np.tanh(gate / bs) * sig(gate) * bl * np.tanh(up / bl)
    if limit is not None:
        gate = np.minimum(gate, limit)
        up = np.clip(up, -limit, limit)
    if kind == "swiglu_oai":
        return gate * sig(alpha * gate) * (up + 1.0)
    return gate * sig(gate) * up


# ---------------------------------------------------------------- subprocess side


class _Buf:
    """The little of torch.Tensor that Triton's interpreter touches, over a numpy array."""

    _NAMES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16", "int32": "int32",
              "float8_e4m3fn": "float8_e4m3fn", "uint8": "uint8"}

    def __init__(self, arr, dtype=None):
        self.arr = arr
        self.dtype = dtype if dtype is not None else self._NAMES[arr.dtype.name]

    def data_ptr(self):
        return self.arr.ctypes.data

    def untyped_storage(self):
        return self

    def cpu(self):
        return self

    def new_empty(self, *args, **kwargs):
        return _Buf(self.arr, self.dtype)

    def set_(self, storage, *args):
        self.arr = storage.arr
        return self

    def storage_offset(self):
        return 0

    def size(self):
        return self.arr.shape

    def stride(self):
        return self.arr.strides

    def copy_(self, other):
        pass


def _install_exact_casts():
    import triton.language as tl
    from triton.runtime import interpreter

    ml = _ml()
    types = {tl.bfloat16: ml.bfloat16, tl.float8e4nv: ml.float8_e4m3fn, tl.float16: np.float16,
             tl.float32: np.float32, tl.float64: np.float64}

    def convert(data, src, dst, rounding_mode):
        return np.asarray(data.view(types[src]).astype(types[dst]))

    interpreter._convert_float = convert


def _launch(kernel, grid, *arrays, **constexprs):
    kernel[grid](*[_Buf(a) for a in arrays], **constexprs)


def _rng(seed):
    return np.random.default_rng(seed)


def _poison(shape, dtype):
    ml = _ml()
    if np.dtype(dtype) == np.dtype(ml.float8_e4m3fn):
        return np.full(shape, 0x7F, np.uint8).view(ml.float8_e4m3fn)  # NaN
    if np.dtype(dtype) == np.dtype(np.int32):
        return np.full(shape, 0x7B7B7B7B, np.int32)
    return np.full(shape, np.nan, dtype)


def _image_shape(mn, k, group, ue8m0, lead=()):
    g = ceil_div(k, group)
    return (*lead, ceil_div(g, 4) if ue8m0 else g, ceil_div(mn, 4) * 4)


def _check_quant(q, img, x32, group, ue8m0, label):
    """q (..., mn, K) e4m3, img (..., G', LD), x32 (..., mn, K) f32 values that were quantized."""
    mn, k = x32.shape[-2:]
    g = ceil_div(k, group)
    sf = read_image(img, mn, g, ue8m0)
    want_sf = model_group_scales(x32, group, ue8m0)
    assert np.array_equal(sf, want_sf), f"{label}: scales differ at {np.argwhere(sf != want_sf)[:5]}"
    want_q = model_quant_values(x32, want_sf, group)
    got, exp = q.astype(np.float32), want_q.astype(np.float32)
    assert np.array_equal(got, exp), f"{label}: q differs at {np.argwhere(got != exp)[:5]}"
    ld = img.shape[-1]
    if ld > mn:
        assert (img[..., mn:] == 0).all(), f"{label}: image padding columns not 0"
    if ue8m0:
        assert image_tail_bytes_zero(img, g), f"{label}: packed padding bytes not 0"


def _from_w4a8_order(q):
    """(..., K) numpy, stored in the W4A8 column order -> column order (`layouts.w4a8.from_w4a8_lhs_order`)."""
    import jax.numpy as jnp

    from layouts.w4a8 import from_w4a8_lhs_order

    return np.array(from_w4a8_lhs_order(jnp.asarray(q)))


def _quant_case(seed, lead, mn, k, group, ue8m0, in_dtype, w4a8=False):
    from custom_calls.triton.quant_kernel import per_token_group_quant_kernel

    rng = _rng(seed)
    x = (rng.standard_normal((*lead, mn, k)) * rng.uniform(0.01, 50, (*lead, mn, 1))).astype(in_dtype)
    s = int(np.prod(lead)) if lead else 1
    img_shape = _image_shape(mn, k, group, ue8m0, lead)
    q = _poison(x.shape, _ml().float8_e4m3fn)
    img = _poison(img_shape, np.int32 if ue8m0 else np.float32)
    block_m, groups = 4, max(4, 256 // group)
    g = ceil_div(k, group)
    ld = img_shape[-1]
    row_blocks = s * ceil_div(ld, block_m)
    _launch(per_token_group_quant_kernel, (row_blocks * ceil_div(g, groups),), x, q, img,
            MN=mn, K=k, G=g, IMG_LD=ld, IMG_SLAB=img_shape[-2] * ld, GROUP=group, UE8M0=ue8m0,
            W4A8_ORDER=w4a8, BLOCK_M=block_m, GROUPS=groups, ROW_BLOCKS=row_blocks, CHUNKS_FASTEST=seed % 2 == 0)
    _check_quant(_from_w4a8_order(q) if w4a8 else q, img, x.astype(np.float32), group, ue8m0, "quant")


def case_quant_fp32_image():
    _quant_case(1, (2,), 37, 640, 128, False, _ml().bfloat16)


def case_quant_ue8m0_image():
    _quant_case(2, (), 29, 1152, 128, True, _ml().bfloat16)  # G = 9: a partial packed word


def case_quant_mxfp8_partial_group():
    _quant_case(3, (3,), 6, 200, 32, True, np.float32)  # K % 32 = 8


def case_quant_w4a8_order():
    _quant_case(4, (2,), 9, 448, 128, False, _ml().bfloat16, w4a8=True)  # K % 128 = 64: a partial block


def _routes(rng, m, k, e):
    """Random distinct experts per token, some routes dropped (-1)."""
    ids = np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.int32)
    ids[rng.random((m, k)) < 0.15] = -1
    return ids


def _contig_src2dst(ids, e, alignment):
    """Expert segments in expert order, each padded to `alignment`; (token, k) order inside."""
    m, k = ids.shape
    src2dst = np.full((m, k), -1, np.int32)
    row = 0
    for ex in range(e):
        for t in range(m):
            for j in range(k):
                if ids[t, j] == ex:
                    src2dst[t, j] = row
                    row += 1
        row = ceil_div(row, alignment) * alignment
    return src2dst, row


def _masked_src2dst(ids, e, m_pad):
    m, k = ids.shape
    src2dst = np.full((m, k), -1, np.int32)
    fill = np.zeros(e, int)
    for t in range(m):
        for j in range(k):
            ex = ids[t, j]
            if ex >= 0:
                src2dst[t, j] = ex * m_pad + fill[ex]
                fill[ex] += 1
    return src2dst, fill


def _inverse(src2dst, rows):
    inv = np.full(rows, -1, np.int32)
    for (t, j), r in np.ndenumerate(src2dst):
        if r >= 0:
            inv[r] = t
    return inv


def _permute_case(seed, *, masked, recipe, arch, m_pad=12, stray=False, tokens=4):
    """recipe "mxfp4" on arch 90: its W4A8 form, lhs in the W4A8 column order."""
    """
    stray: one dropped route instead points past the buffer (row R + 5); it must be dropped.
    M = 13 tokens: the last token program of `tokens` > 1 is partly past M."""
    from custom_calls.triton.permute_kernel import row_source_kernel, scale_image_kernel, scatter_quant_kernel

    ml = _ml()
    rng = _rng(seed)
    m, h, k, e = 13, 640, 3, 5  # H: 5 groups of 128 (two chunks of 4), 20 of 32 (five chunks)
    x = (rng.standard_normal((m, h)) * rng.uniform(0.1, 20, (m, 1))).astype(ml.bfloat16)
    ids = _routes(rng, m, k, e)
    if masked:
        src2dst, fill = _masked_src2dst(ids, e, m_pad)
        assert fill.max() <= m_pad
        slabs, mn = e, m_pad
    else:
        src2dst, used = _contig_src2dst(ids, e, 4)
        slabs, mn = 1, used + 6  # spare rows past the last segment; mn % 4 == 2 (image padding)
    rows = slabs * mn
    inv = _inverse(src2dst, rows)
    if stray:
        t0, j0 = np.argwhere(src2dst < 0)[0]
        src2dst[t0, j0] = rows + 5
    quant = recipe != "bf16"
    group = {"fp8_block": 128, "mxfp8": 32, "bf16": 128, "mxfp4": 128}[recipe]
    ue8m0 = arch == 100
    w4a8 = recipe == "mxfp4" and arch == 90
    g = ceil_div(h, group)
    lhs = _poison((rows, h), ml.float8_e4m3fn if quant else ml.bfloat16)
    sf = _poison((m, g) if quant else (1,), np.float32)
    src1 = np.zeros(rows, np.int32)  # the launcher zero-fills it
    # masked + quantized: the scatter kernel writes the row sources itself (ROW_SOURCE_OUT)
    src1_out = masked and quant
    if not src1_out:
        _launch(row_source_kernel, (ceil_div(m * k, 16),), src2dst, src1, N=m * k, TOPK=k, R=rows, BLOCK=16)
        assert np.array_equal(src1, inv + 1), "row_source_kernel"
    written = np.zeros(rows if src1_out else 1, np.int32)  # zeroed by the launcher
    groups, zero_rows = 4, 8
    zero_programs = 0 if masked else ceil_div(rows, zero_rows)  # masked: empty rows stay unwritten
    _launch(scatter_quant_kernel, ((zero_programs + ceil_div(m, tokens)) * ceil_div(g, groups),),
            x, src2dst, src1 if not src1_out else np.zeros(1, np.int32), lhs, sf, written, M=m, H=h, TOPK=k,
            TOPK_P2=4, R=rows, G=g, GROUP=group, QUANT=quant, UE8M0=ue8m0, W4A8_ORDER=w4a8, GROUPS=groups,
            TOKENS=tokens, ZERO_FILL=not masked, ZERO_ROWS=zero_rows, ZERO_SUB=4, CHUNKS_FASTEST=seed % 2 == 0,
            ROW_SOURCE_OUT=src1_out)
    if src1_out:
        assert np.array_equal(written, inv + 1), "scatter_quant_kernel row sources"
        src1 = written
    if quant:
        img_shape = _image_shape(mn, h, group, ue8m0, (slabs,) if masked else ())
        img = _poison(img_shape, np.int32 if ue8m0 else np.float32)
        ld, img_rows = img_shape[-1], 8
        row_blocks = slabs * ceil_div(ld, img_rows)
        _launch(scale_image_kernel, (row_blocks * ceil_div(g, groups),), src1, sf, img, MN=mn, G=g, IMG_LD=ld,
                IMG_SLAB=img_shape[-2] * ld, UE8M0=ue8m0, ROWS=img_rows, GROUPS=groups, ROW_BLOCKS=row_blocks)
    if w4a8:
        lhs = _from_w4a8_order(lhs)
    # model: each row holds its token's x, or zeros
    placed = np.zeros((rows, h), np.float32)
    for r in range(rows):
        if inv[r] >= 0:
            placed[r] = x[inv[r]].astype(np.float32)
    assert (inv >= 0).sum() == ((src2dst >= 0) & (src2dst < rows)).sum() and (inv < 0).any()
    if masked:  # rows no route lands on: never written (still poison), every other row checked below
        empty = inv < 0
        assert np.isnan(lhs[empty].astype(np.float32)).all(), "masked: an empty row was written"
        lhs = lhs.copy()
        lhs[empty] = 0
    if not quant:
        assert np.array_equal(lhs.astype(np.float32), placed)
        return
    if masked:
        _check_quant(lhs.reshape(slabs, mn, h), img, placed.reshape(slabs, mn, h), group, ue8m0, "permute")
    else:
        _check_quant(lhs, img, placed, group, ue8m0, "permute")


def case_permute_contig_fp8_90():
    _permute_case(10, masked=False, recipe="fp8_block", arch=90)


def case_permute_contig_fp8_100():
    _permute_case(11, masked=False, recipe="fp8_block", arch=100)


def case_permute_contig_mxfp8_100():
    _permute_case(12, masked=False, recipe="mxfp8", arch=100)


def case_permute_contig_bf16():
    _permute_case(13, masked=False, recipe="bf16", arch=90, tokens=1)


def case_permute_masked_fp8_90():
    _permute_case(14, masked=True, recipe="fp8_block", arch=90, tokens=2)


def case_permute_masked_fp8_100():
    _permute_case(15, masked=True, recipe="fp8_block", arch=100)


def case_permute_masked_odd_pad_stray_90():
    _permute_case(16, masked=True, recipe="fp8_block", arch=90, m_pad=14, stray=True)  # m_pad % 4 == 2


def case_permute_masked_odd_pad_100():
    _permute_case(17, masked=True, recipe="mxfp8", arch=100, m_pad=13)  # m_pad % 4 == 1


def case_permute_masked_w4a8_order():
    _permute_case(18, masked=True, recipe="mxfp4", arch=90)


def case_permute_contig_w4a8_order():
    _permute_case(19, masked=False, recipe="mxfp4", arch=90, tokens=2)



def _check_act(a, img, y64, group, ue8m0, label, rows_ok=None):
    """Tolerance check of dequantized a against the float64 model y64 (..., mn, I):
    e4m3 rounding (2^-4 relative, 2^-10 * sf absolute near 0) + bf16 rounding (2^-9) of y."""
    mn, i = y64.shape[-2:]
    g = ceil_div(i, group)
    sf = read_image(img, mn, g, ue8m0).astype(np.float64)
    amax = np.zeros((*y64.shape[:-1], g))
    for gi in range(g):
        amax[..., gi] = np.abs(y64[..., gi * group:(gi + 1) * group]).max(-1)
    want = np.maximum(amax, 1e-4) / E4M3_MAX
    if rows_ok is None:
        rows_ok = np.ones(y64.shape[:-1], bool)
    sel = rows_ok[..., None]
    if ue8m0:
        good = (sf >= want * (1 - 2**-7)) & (sf / 2 < want * (1 + 2**-7)) & (np.log2(sf) == np.round(np.log2(sf)))
    else:
        good = np.abs(sf - want) <= want * 2**-7
    assert np.where(sel, good, True).all(), f"{label}: scales off at {np.argwhere(~np.where(sel, good, True))[:5]}"
    deq = a.astype(np.float64) * np.repeat(sf, group, axis=-1)[..., :i]
    tol = 0.0705 * np.abs(y64) + np.repeat(sf, group, axis=-1)[..., :i] * 2**-9
    ok = np.abs(deq - y64) <= tol
    assert np.where(sel, ok, True).all(), f"{label}: values off at {np.argwhere(~np.where(sel, ok, True))[:5]}"


_ACT = {
    "silu": dict(kind="silu"),
    "silu_limit": dict(kind="silu", limit=7.0),
    "oai": dict(kind="swiglu_oai", limit=7.0, alpha=1.702),
    "situ": dict(kind="situ", bs=3.0, bl=5.0),
}
_KIND = {"silu": 0, "swiglu_oai": 1, "situ": 2}


def _act_case(seed, *, variant, recipe, arch, keep_fp32=False, masked=False, mn=None, counts=(5, 0, 12)):
    """counts: masked_m per slab (masked only); a count above mn covers the whole slab, no more.
    recipe "mxfp4" on arch 90: its W4A8 form, the output in the W4A8 column order."""
    from custom_calls.triton.activation_kernel import act_quant_kernel

    ml = _ml()
    rng = _rng(seed)
    spec = _ACT[variant]
    inter = 160 if recipe == "mxfp8" else 640  # 5 scale groups: two column chunks of 4 groups
    slabs, mn = (len(counts), mn or 12) if masked else (1, 19)
    gateup = (rng.standard_normal((slabs, mn, 2 * inter)) * 4).astype(ml.bfloat16)
    masked_m = np.array(counts, np.int32) if masked else np.zeros(1, np.int32)
    quant = recipe != "bf16"
    group = {"fp8_block": 128, "mxfp8": 32, "bf16": 128, "mxfp4": 128}[recipe]
    ue8m0 = arch == 100
    w4a8 = recipe == "mxfp4" and arch == 90
    g = ceil_div(inter, group)
    img_shape = _image_shape(mn, inter, group, ue8m0, (slabs,))
    img = _poison(img_shape, np.int32 if ue8m0 else np.float32) if quant else _poison((1,), np.int32)
    a = _poison((slabs, mn, inter), ml.float8_e4m3fn if quant else ml.bfloat16)
    ld = img_shape[-1]
    block_m, groups = 4, 4
    covered = mn if masked else ld
    row_blocks = slabs * ceil_div(covered, block_m)
    _launch(act_quant_kernel, (row_blocks * ceil_div(g, groups),), gateup, masked_m, a, img,
            MN=mn, I=inter, G=g, IMG_LD=ld, IMG_SLAB=img_shape[-2] * ld, GROUP=group, QUANT=quant,
            UE8M0=ue8m0, W4A8_ORDER=w4a8, MASKED=masked, KIND=_KIND[spec["kind"]], HAS_LIMIT="limit" in spec,
            LIMIT=spec.get("limit", 0.0), ALPHA=spec.get("alpha", 1.0), BETA_S=spec.get("bs", 1.0),
            BETA_L=spec.get("bl", 1.0), KEEP_FP32=keep_fp32, BLOCK_M=block_m, GROUPS=groups,
            ROW_BLOCKS=row_blocks, CHUNKS_FASTEST=seed % 2 == 0)
    y64 = model_activation(gateup, spec["kind"], spec.get("limit"), spec.get("alpha"),
                           spec.get("bs", 1.0), spec.get("bl", 1.0))
    if w4a8:
        a = _from_w4a8_order(a)
    rows_ok = (np.arange(mn)[None, :] < np.minimum(masked_m, mn)[:, None]) if masked else np.ones((1, mn), bool)
    if masked:  # rows past masked_m are never touched
        untouched = np.isnan(a.astype(np.float32)[~rows_ok]).all()
        assert untouched, "masked: rows >= masked_m were written"
        if quant:
            cols = img[..., :mn].transpose(0, 2, 1)[~rows_ok]
            assert (cols.view(np.int32) == _poison((1,), np.int32)[0]).all() or np.isnan(cols).all(), \
                "masked: scale columns of rows >= masked_m were written"
    if not quant:
        got = a.astype(np.float64)
        ok = np.abs(got - y64) <= 2**-8 * np.abs(y64) + 1e-30
        assert np.where(rows_ok[..., None], ok, True).all()
        return
    _check_act(a if masked else a[0], img if masked else img[0], y64 if masked else y64[0], group, ue8m0,
               f"act {variant}", rows_ok if masked else None)
    if not ue8m0 and not masked:
        # fp32 scales reveal what was quantized: amax = 448 * sf is a bf16 value unless keep_fp32
        amax = read_image(img[0], mn, g, False).astype(np.float64) * E4M3_MAX
        on_bf16 = np.abs(amax.astype(ml.bfloat16).astype(np.float64) - amax) <= amax * 2**-20
        assert on_bf16.mean() < 0.05 if keep_fp32 else on_bf16.all(), on_bf16.mean()


# activation cases: name -> _act_case keywords
ACT_CASES = {
    "act_contig_silu_90": dict(seed=20, variant="silu", recipe="fp8_block", arch=90),
    "act_contig_silu_limit_100": dict(seed=21, variant="silu_limit", recipe="fp8_block", arch=100),
    "act_contig_oai_90": dict(seed=22, variant="oai", recipe="fp8_block", arch=90),
    "act_contig_situ_100": dict(seed=23, variant="situ", recipe="fp8_block", arch=100),
    "act_contig_keep_fp32_90": dict(seed=24, variant="silu", recipe="fp8_block", arch=90, keep_fp32=True),
    "act_contig_mxfp8_100": dict(seed=25, variant="silu_limit", recipe="mxfp8", arch=100),
    "act_contig_bf16": dict(seed=26, variant="silu", recipe="bf16", arch=90),
    "act_masked_silu_limit_90": dict(seed=27, variant="silu_limit", recipe="fp8_block", arch=90, masked=True),
    "act_masked_situ_100": dict(seed=28, variant="situ", recipe="fp8_block", arch=100, masked=True),
    "act_masked_oai_100": dict(seed=29, variant="oai", recipe="mxfp8", arch=100, masked=True),
    # m_pad 10 is not a multiple of BLOCK_M 4: slab 0's count 40 must not spill into slab 1 (count 0)
    "act_masked_count_over_m_pad": dict(seed=32, variant="silu", recipe="fp8_block", arch=90, masked=True, mn=10,
                                        counts=(40, 0, 7, 11)),
    "act_masked_w4a8_order": dict(seed=33, variant="silu_limit", recipe="mxfp4", arch=90, masked=True),
    "act_contig_w4a8_order": dict(seed=34, variant="silu", recipe="mxfp4", arch=90),
}
for _name, _kw in ACT_CASES.items():
    globals()[f"case_{_name}"] = functools.partial(_act_case, **_kw)


def _unpermute_case(seed, out_dtype, stray=False, addend=False):
    """stray: one route points past the last row (R + 7): as in the reference, its token's row is NaN
    and the index is never loaded. addend: a bf16 (M, H) array added after the scaling."""
    from custom_calls.triton.unpermute_kernel import weighted_gather_kernel

    ml = _ml()
    rng = _rng(seed)
    m, k, rows, h, rsf = 11, 3, 40, 300, 2.5
    d = rng.standard_normal((rows, h)).astype(ml.bfloat16)
    perm = rng.permutation(rows)[: m * k].reshape(m, k).astype(np.int32)
    perm[rng.random((m, k)) < 0.2] = -1
    if stray:
        perm[3, 1] = rows + 7
    unused = np.setdiff1d(np.arange(rows), perm[(perm >= 0) & (perm < rows)])
    d[unused] = np.nan  # a row no route reads must not leak in
    w = rng.uniform(0.05, 1.0, (m, k)).astype(np.float32)
    out = _poison((m, h), out_dtype)
    add = (rng.standard_normal((m, h)) * 3).astype(ml.bfloat16) if addend else np.zeros(1, np.float32)
    _launch(weighted_gather_kernel, (m, ceil_div(h, 128)), d, perm, w, add, out, R=rows, H=h, TOPK=k, SCALE=rsf,
            BLOCK_H=128, HAS_ADDEND=addend)
    d64 = d.astype(np.float64)
    want = np.zeros((m, h))
    mag = np.zeros((m, h))
    for t in range(m):
        for j in range(k):
            if perm[t, j] >= rows:
                want[t] = np.nan
            elif perm[t, j] >= 0:
                want[t] += w[t, j] * d64[perm[t, j]]
                mag[t] += abs(w[t, j] * d64[perm[t, j]])
    want *= rsf
    mag *= rsf
    if addend:
        want += add.astype(np.float64)
        mag += np.abs(add.astype(np.float64))
    got = out.astype(np.float64)
    rel = 2**-8 if out_dtype == ml.bfloat16 else 2**-20
    nan_rows = (perm >= rows).any(1)
    assert np.isnan(got[nan_rows]).all(), "unpermute: a token with a row past d is not NaN"
    assert np.isfinite(got[~nan_rows]).all(), "unpermute: an output is NaN (unwritten or leaked)"
    assert (np.abs(got - want) <= rel * mag + 1e-6)[~nan_rows].all()


def case_unpermute_bf16():
    _unpermute_case(30, _ml().bfloat16)


def case_unpermute_f32_out():
    _unpermute_case(31, np.float32)


def case_unpermute_row_past_end():
    _unpermute_case(33, np.float32, stray=True)


def case_unpermute_addend():
    _unpermute_case(34, _ml().bfloat16, addend=True)
    _unpermute_case(35, np.float32, stray=True, addend=True)


def _dispatch_case(seed, r, e, e_pad, chunk, strays=()):
    """strays: values outside [0, e] placed at the start; not counted, never indexing out of bounds."""
    from custom_calls.triton.dispatch_kernel import chunk_count_kernel, chunk_offsets_kernel, chunk_rank_kernel

    rng = _rng(seed)
    ids = rng.integers(0, e + 1, r).astype(np.int32)  # value e: a route not held here
    ids[:len(strays)] = strays
    nc = ceil_div(r, chunk)
    counts = np.full((nc, e_pad), -7, np.int32)
    _launch(chunk_count_kernel, (nc,), ids, counts, R=r, E_PAD=e_pad, CHUNK=chunk)
    offs = np.full((nc, e_pad), -7, np.int32)
    totals = np.full(e_pad, -7, np.int32)
    _launch(chunk_offsets_kernel, (e_pad,), counts, offs, totals, NC=nc, NC_PAD=1 << (nc - 1).bit_length(),
            E_PAD=e_pad)
    np.testing.assert_array_equal(offs, np.cumsum(counts, axis=0) - counts)
    np.testing.assert_array_equal(totals, counts.sum(0))
    rank = np.full(r, -7, np.int32)
    _launch(chunk_rank_kernel, (nc,), ids, offs, rank, R=r, E_PAD=e_pad, CHUNK=chunk)
    held = (ids >= 0) & (ids < e_pad)
    want_counts = np.bincount(ids[held], minlength=e_pad)
    assert np.array_equal(counts.sum(0), want_counts)
    seen = np.zeros(e_pad, int)
    for i, ex in enumerate(ids):  # rank = routes of the same expert before this one, (token, k) order
        if not held[i]:
            assert rank[i] == -1, (i, rank[i])
            continue
        assert rank[i] == seen[ex], (i, rank[i], seen[ex])
        seen[ex] += 1


def case_dispatch_rank_e32():
    _dispatch_case(40, 1000, 32, 64, 128)  # a partial last chunk


def case_dispatch_rank_e5():
    _dispatch_case(41, 333, 5, 8, 64, strays=(-1, 8, 1 << 20))


def model_dispatch_map(ids, offset, e, alignment=None, m_pad=None, mark_dropped=False):
    """numpy model of the dispatch maps, one route at a time in (token, k) order: local expert
    id - offset when in [0, e) and id >= 0; contig rows from padded segments, masked slab rows
    (a held route past m_pad: -1, or e * m_pad with mark_dropped)."""
    flat = ids.reshape(-1).astype(np.int64)
    loc = flat - offset
    held = (flat >= 0) & (loc >= 0) & (loc < e)
    counts = np.bincount(loc[held], minlength=e)
    rank = np.zeros(flat.size, np.int64)
    seen = np.zeros(e, np.int64)
    for i in np.flatnonzero(held):
        rank[i] = seen[loc[i]]
        seen[loc[i]] += 1
    if m_pad is not None:
        dst = np.where(held, np.where(rank < m_pad, loc * m_pad + rank, e * m_pad if mark_dropped else -1), -1)
        return dst.reshape(ids.shape), np.minimum(counts, m_pad), np.maximum(counts - m_pad, 0).sum()
    r = flat.size
    n = min(e, r)
    cap = alignment * (n + (r - n) // alignment)
    padded = -(-counts // alignment) * alignment
    start = np.concatenate([[0], np.cumsum(padded)[:-1]])
    dst = np.where(held, start[np.where(held, loc, 0)] + rank, -1)
    m_indices = np.full(cap, -1, np.int64)
    for x in range(e):
        m_indices[start[x]:start[x] + counts[x]] = x
    return dst.reshape(ids.shape), m_indices, padded.sum(), counts


def _map_ids(rng, m, k, e, offset, dup=False):
    """Global ids around the local window [offset, offset + e): -1, ids below and above it; with
    dup, tokens may repeat an expert (so masked slabs can overflow)."""
    ids = rng.integers(-1, e + 2 * offset + 3, (m, k)).astype(np.int32)
    if dup:
        ids[: m // 2] = offset + rng.integers(0, 2, (m // 2, k))
    return ids


def _map_case(seed, m, k, e, offset, sub, subs, alignment=None, m_pad=None, dup=False, one_launch=False,
              mark_dropped=False):
    """One or two launches of the dispatch-map kernels on poisoned buffers; every element checked.
    one_launch: several chunks, each program counting the routes before its own; mark_dropped: a
    dropped masked route gets the row e * m_pad."""
    from custom_calls.triton import dispatch_map_kernel as dk

    rng = _rng(seed)
    ids = _map_ids(rng, m, k, e, offset, dup)
    off = np.array([offset], np.int32)
    r = m * k
    e_pad = 1 << (e - 1).bit_length()
    nc = ceil_div(r, sub * subs)
    plan = dict(R=r, E=e, E_PAD=e_pad, SUB=sub, SUBS=subs, NC=nc, HB=max(1, min(1 << (nc - 1).bit_length(),
                                                                                4096 // e_pad)),
                ONE_LAUNCH=nc == 1 or one_launch)
    hist = np.zeros(1, np.int32)
    if not plan["ONE_LAUNCH"]:
        hist = np.full((nc, e_pad), -7, np.int32)
        _launch(dk.map_hist_kernel, (nc,), ids, off, hist, **{k_: plan[k_] for k_ in ("R", "E", "E_PAD", "SUB",
                                                                                     "SUBS")})
    dst = np.full((m, k), -7, np.int32)
    if m_pad is not None:
        masked_m = np.full(e, -7, np.int32)
        dropped = np.full(1, -7, np.int32)
        _launch(dk.map_masked_kernel, (nc,), ids, off, hist, dst, masked_m, dropped, M_PAD=m_pad,
                DROPPED_ROW=e * m_pad if mark_dropped else -1, **plan)
        want = model_dispatch_map(ids, offset, e, m_pad=m_pad, mark_dropped=mark_dropped)
        if mark_dropped:
            assert (want[0] == e * m_pad).sum() == want[2] > 0  # every dropped route is marked
        got = (dst, masked_m, dropped[0])
    else:
        want = model_dispatch_map(ids, offset, e, alignment=alignment)
        cap = want[1].size
        rows_per_program = ceil_div(ceil_div(cap, nc), sub) * sub
        m_ind = np.full(cap, -7, np.int32)
        nrows = np.full(1, -7, np.int32)
        counts = np.full(e, -7, np.int32)
        _launch(dk.map_contig_kernel, (nc,), ids, off, hist, dst, m_ind, nrows, counts, ALIGN=alignment, CAP=cap,
                ROWS_PER_PROGRAM=rows_per_program, ROW_BLOCK=sub, **plan)
        got = (dst, m_ind, nrows[0], counts)
    for name, g, w in zip(("src2dst", "second", "third", "fourth"), got, want):
        assert np.array_equal(np.asarray(g), w), (name, np.argwhere(np.asarray(g) != w)[:5])
    return want


def case_dispatch_map_contig_one_launch():
    _map_case(70, 37, 6, 5, 3, sub=64, subs=4, alignment=16)  # 222 routes: one program, 4 sub-blocks
    _map_case(76, 37, 6, 5, 3, sub=32, subs=1, alignment=16, one_launch=True)  # 7 programs, each counting
    _map_case(77, 129, 8, 20, 0, sub=64, subs=2, alignment=128, one_launch=True)  # 9 chunks of 2 sub-blocks


def case_dispatch_map_contig_two_launches():
    _map_case(71, 129, 8, 20, 0, sub=64, subs=3, alignment=128)  # 6 chunks, E not a power of two
    _map_case(72, 300, 7, 33, 40, sub=32, subs=1, alignment=8)  # 66 chunks: several hist tiles


def case_dispatch_map_masked_one_launch():
    want = _map_case(73, 71, 8, 6, 2, sub=128, subs=5, m_pad=128, dup=True)  # one chunk of 568 routes
    assert want[2] > 0  # routes past m_pad dropped and counted
    want = _map_case(78, 71, 8, 6, 2, sub=64, subs=1, m_pad=96, dup=True, one_launch=True)  # 9 programs
    assert want[2] > 0
    _map_case(80, 71, 8, 6, 2, sub=128, subs=5, m_pad=128, dup=True, mark_dropped=True)  # one walk, marked
    _map_case(81, 71, 8, 6, 2, sub=64, subs=1, m_pad=96, dup=True, one_launch=True, mark_dropped=True)
    _map_case(79, 128, 8, 32, 0, sub=128, subs=1, m_pad=256, one_launch=True)  # the decode heuristic


def case_dispatch_map_masked_two_launches():
    _map_case(74, 257, 8, 32, 0, sub=256, subs=1, m_pad=384)
    want = _map_case(75, 333, 3, 7, 5, sub=16, subs=2, m_pad=128, dup=True)
    assert want[2] > 0
    _map_case(82, 333, 3, 7, 5, sub=16, subs=2, m_pad=128, dup=True, mark_dropped=True)


def model_route(logits, bias, top_k, scoring, n_group, topk_group, renorm):
    """float64 model of moe_jax.routing's expert selection (ties: lower index first)."""
    lg = logits.astype(np.float64)
    if scoring == "softmax":
        p = np.exp(lg - lg.max(1, keepdims=True))
        s = p / p.sum(1, keepdims=True)
    elif scoring == "sigmoid":
        s = 1 / (1 + np.exp(-lg))
    else:
        s = np.sqrt(np.logaddexp(lg, 0))
    sel = s + (bias.astype(np.float64) if bias is not None else 0)
    m, e = sel.shape
    if n_group > 1:
        g = sel.reshape(m, n_group, e // n_group)
        gs = np.sort(g, axis=2)[:, :, -2:].sum(2) if bias is not None else g.max(2)
        keep = np.argsort(-gs, axis=1, kind="stable")[:, :topk_group]
        mask = np.zeros((m, n_group), bool)
        np.put_along_axis(mask, keep, True, axis=1)
        sel = np.where(np.repeat(mask, e // n_group, axis=1), sel, -np.inf)
    ids = np.argsort(-sel, axis=1, kind="stable")[:, :top_k]
    w = np.take_along_axis(s, ids, axis=1)
    if renorm:
        w = w / (w.sum(1, keepdims=True) + 1e-20)
    return ids, w


def _route_case(seed, m, e, top_k, scoring, n_group, topk_group, with_bias, renorm, block_t=8, ties=False):
    """ties: every row repeats a few logits (and the bias repeats too), so equal selection and group
    scores occur; the lower expert / group id must win, as in the model."""
    from custom_calls.triton.routing_kernel import SCORINGS, route_topk_kernel

    rng = _rng(seed)
    logits = (rng.standard_normal((m, e)) * 2).astype(np.float32)
    bias = (rng.standard_normal(e) * 0.3).astype(np.float32) if with_bias else np.zeros(1, np.float32)
    if ties:  # half the experts copy another expert's logit and bias: exact ties in every row
        src = rng.integers(0, e, e // 2)
        dst = rng.permutation(e)[: e // 2]
        logits[:, dst] = logits[:, src]
        if with_bias:
            bias[dst] = bias[src]
    ng = max(1, n_group)
    ng_pad = 1 << (ng - 1).bit_length()
    gs_pad = 1 << (e // ng - 1).bit_length()
    k_pad = 1 << (top_k - 1).bit_length()
    ids = np.full((m, top_k), -7, np.int32)
    w = np.full((m, top_k), np.nan, np.float32)
    _launch(route_topk_kernel, (ceil_div(m, block_t),), logits, bias, ids, w, M=m, E=e, TOPK=top_k,
            K_PAD=k_pad, SCORING=SCORINGS[scoring], HAS_BIAS=with_bias, N_GROUP=ng, NG_PAD=ng_pad, GS_PAD=gs_pad,
            TOPK_GROUP=topk_group, RENORM=renorm, BLOCK_T=block_t)
    want_ids, want_w = model_route(logits, bias if with_bias else None, top_k, scoring, n_group, topk_group, renorm)
    assert np.array_equal(ids, want_ids), np.argwhere(ids != want_ids)[:5]
    np.testing.assert_allclose(w, want_w, rtol=2e-5, atol=1e-7)
    return logits, bias


def case_route_sigmoid_grouped_bias():
    _route_case(50, 37, 64, 8, "sigmoid", 8, 4, True, True)


def case_route_softmax_grouped_no_bias():
    _route_case(53, 29, 32, 4, "softmax", 4, 2, False, True)


def case_route_softmax_e20():
    _route_case(51, 21, 20, 6, "softmax", 1, 1, False, False)


def case_route_sqrtsoftplus_bias():
    _route_case(52, 19, 48, 6, "sqrtsoftplus", 1, 1, True, True)


def case_route_v3_one_token_per_program():
    """DeepSeek-V3's routing (256 experts, 8 groups of 32, top-4 groups, top-8, bias) at the decode
    tiling: one token per program."""
    _route_case(54, 13, 256, 8, "sigmoid", 8, 4, True, True, block_t=1)


def case_route_groups_not_power_of_two():
    """n_group = 3 of 32 experts (padded to 4 groups), 5 groups of 12 (padded to 16 each), 7 of 1."""
    _route_case(55, 23, 96, 8, "sigmoid", 3, 2, True, True)
    _route_case(56, 17, 60, 6, "softmax", 5, 3, False, True, block_t=2)
    _route_case(57, 11, 7, 2, "sigmoid", 7, 3, True, False, block_t=4)


def case_route_ties_lower_index_wins():
    lg, bias = _route_case(58, 31, 64, 8, "sigmoid", 8, 4, True, True, ties=True)
    # the ties are real: equal selection scores within rows (else this case tests nothing new)
    sel = 1 / (1 + np.exp(-lg.astype(np.float64))) + bias
    assert all(len(np.unique(row)) < row.size for row in sel)
    _route_case(59, 19, 24, 5, "softmax", 1, 1, False, True, block_t=1, ties=True)
    _route_case(60, 9, 40, 6, "sqrtsoftplus", 4, 2, False, False, ties=True)


# ---------------------------------------------------------------- host entry points and configs


LAUNCHES: list[dict] = []  # every launch of the host entry points: kernel name, num_warps, constexprs


def _record_launches():
    """Note every launch of the kernel modules' host entry points (kernel, num_warps, num_stages,
    constexprs), then make it through `launch.triton_call`, which runs the kernel in Triton's
    interpreter here (`custom_calls.triton.interpret`). Kernels described as a `launch.KernelCall`
    reach `launch.triton_call` through the module's global, the others through their own import."""
    import importlib

    from custom_calls.triton import launch

    original = launch.triton_call

    def recording(*args, kernel, out_shape, grid, num_warps=4, num_stages=1, name="", zeroed_outputs=(),
                  **constexprs):
        LAUNCHES.append(dict(kernel=kernel.fn.__name__, num_warps=num_warps, num_stages=num_stages, **constexprs))
        return original(*args, kernel=kernel, out_shape=out_shape, grid=grid, num_warps=num_warps,
                        num_stages=num_stages, name=name, zeroed_outputs=zeroed_outputs, **constexprs)

    launch.triton_call = recording
    for name in ("permute", "activation", "quant", "unpermute", "dispatch", "dispatch_map", "routing", "fused_input",
                 "router"):
        module = importlib.import_module(f"custom_calls.triton.{name}_kernel")
        if hasattr(module, "triton_call"):
            module.triton_call = recording


def _last_launch(kernel: str) -> dict:
    return [ln for ln in LAUNCHES if ln["kernel"] == kernel][-1]


def _launched_with(kernel: str, **expected):
    """The last launch of `kernel` had these num_warps / constexpr values (the config reached it)."""
    last = _last_launch(kernel)
    got = {k: last.get(k) for k in expected}
    assert got == expected, (kernel, got, expected)


def _same_bytes(a, b, label):
    """Outputs of two configs: identical bytes (None for both where there is no image)."""
    if a is None or b is None:
        assert a is None and b is None, label
        return
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (label, a.shape, b.shape, a.dtype, b.dtype)
    assert a.tobytes() == b.tobytes(), f"{label}: differs at {np.argwhere(a.view(np.uint8) != b.view(np.uint8))[:5]}"


def case_host_quant_configs():
    import dataclasses

    import jax.numpy as jnp

    from custom_calls.triton import quant_kernel as qk

    rng = _rng(60)
    for recipe, arch, k, tile in (("fp8_block", 90, 640, 128), ("fp8_block", 100, 1152, 512),
                                  ("mxfp8", 100, 200, 128)):
        group = {"fp8_block": 128, "mxfp8": 32}[recipe]
        x = (rng.standard_normal((2, 13, k)) * rng.uniform(0.01, 50, (2, 13, 1))).astype(_ml().bfloat16)
        q, img = qk.quantize_activation(jnp.asarray(x), recipe, arch)
        _check_quant(np.asarray(q), np.asarray(img), x.astype(np.float32), group, arch == 100,
                     f"quant {recipe} {arch}")
        other = dataclasses.replace(qk.heuristic_config(recipe, arch), tile=tile, block_m=2, num_warps=8,
                                    chunks_fastest=False)
        q2, img2 = qk.quantize_activation(jnp.asarray(x), recipe, arch, config=other)
        _launched_with("per_token_group_quant_kernel", num_warps=8, BLOCK_M=2, GROUPS=tile // group,
                       CHUNKS_FASTEST=False)
        _same_bytes(q, q2, f"quant {recipe} {arch} q")
        _same_bytes(img, img2, f"quant {recipe} {arch} image")


def case_host_permute_configs():
    import dataclasses

    import jax.numpy as jnp

    from custom_calls.triton import permute_kernel as pk

    ml = _ml()
    rng = _rng(61)
    m, h, k, e, m_pad = 13, 640, 3, 5, 12
    for recipe, arch, masked in (("fp8_block", 90, False), ("mxfp8", 100, False), ("fp8_block", 100, True),
                                 ("bf16", 90, False)):
        x = (rng.standard_normal((m, h)) * rng.uniform(0.1, 20, (m, 1))).astype(ml.bfloat16)
        ids = _routes(rng, m, k, e)
        if masked:
            src2dst, _ = _masked_src2dst(ids, e, m_pad)
            rows = e * m_pad
            run = lambda cfg: pk.permute_masked(jnp.asarray(x), jnp.asarray(src2dst), num_groups=e, m_pad=m_pad,  # noqa: E731
                                                recipe=recipe, arch=arch, config=cfg)
        else:
            src2dst, used = _contig_src2dst(ids, e, 4)
            rows = used + 6
            run = lambda cfg: pk.permute_contig(jnp.asarray(x), jnp.asarray(src2dst), num_rows=rows,  # noqa: E731
                                                recipe=recipe, arch=arch, config=cfg)
        lhs, img = run(None)
        inv = _inverse(src2dst, rows)
        placed = np.zeros((rows, h), np.float32)
        placed[inv >= 0] = x[inv[inv >= 0]].astype(np.float32)
        label = f"permute {recipe} {arch} {'masked' if masked else 'contig'}"
        got = np.asarray(lhs).reshape(rows, h)
        if masked:  # rows no route lands on are never written: still the interpreter's NaN fill
            assert np.isnan(got[inv < 0].astype(np.float32)).all(), label
            got = np.where((inv >= 0)[:, None], got.astype(np.float32), 0.0).astype(got.dtype)
        if recipe == "bf16":
            assert img is None and np.array_equal(got.astype(np.float32), placed), label
        else:
            group = {"fp8_block": 128, "mxfp8": 32}[recipe]
            lead = (e,) if masked else ()
            _check_quant(got.reshape(*lead, -1, h), np.asarray(img), placed.reshape(*lead, -1, h), group,
                         arch == 100, label)
        tile = 64 if recipe == "mxfp8" else 256
        other = dataclasses.replace(pk.heuristic_config(recipe), tile=tile, tokens=2, zero_rows=8, zero_sub=2,
                                    num_warps=8, chunks_fastest=False, source_block=16, image_rows=16, image_groups=4)
        start = len(LAUNCHES)
        lhs2, img2 = run(other)
        launched = [ln["kernel"] for ln in LAUNCHES[start:]]
        if masked:  # the scatter kernel writes the row sources itself
            assert "row_source_kernel" not in launched and _last_launch("scatter_quant_kernel")["ROW_SOURCE_OUT"]
        else:
            _launched_with("row_source_kernel", BLOCK=16)
        _launched_with("scatter_quant_kernel", num_warps=8, GROUPS=tile // (32 if recipe == "mxfp8" else 128),
                       TOKENS=2, ZERO_ROWS=8, ZERO_SUB=2, CHUNKS_FASTEST=False)
        if recipe != "bf16":
            _launched_with("scale_image_kernel", ROWS=16, GROUPS=4)
        _same_bytes(lhs, lhs2, f"{label} lhs")
        _same_bytes(img, img2, f"{label} image")


def case_host_act_configs():
    import dataclasses

    import jax.numpy as jnp

    from custom_calls.activation import ActivationSpec
    from custom_calls.triton import activation_kernel as ak

    ml = _ml()
    rng = _rng(62)
    specs = {"silu_limit": ActivationSpec(kind="silu", swiglu_limit=7.0),
             "situ": ActivationSpec(kind="situ", situ_beta=3.0, situ_linear_beta=5.0)}
    for variant, recipe, arch, masked in (("silu_limit", "fp8_block", 90, False), ("silu_limit", "mxfp8", 100, False),
                                          ("situ", "fp8_block", 100, True), ("silu_limit", "bf16", 90, False)):
        inter = 160 if recipe == "mxfp8" else 640
        slabs, mn = (3, 12) if masked else (1, 19)
        gateup = (rng.standard_normal((slabs, mn, 2 * inter)) * 4).astype(ml.bfloat16)
        counts = np.array([5, 0, 12], np.int32)
        act = specs[variant]
        if masked:
            run = lambda cfg: ak.activation_quant_masked(jnp.asarray(gateup), jnp.asarray(counts), act=act,  # noqa: E731
                                                         recipe=recipe, arch=arch, config=cfg)
        else:
            run = lambda cfg: ak.activation_quant_contig(jnp.asarray(gateup[0]), act=act, recipe=recipe,  # noqa: E731
                                                         arch=arch, config=cfg)
        a, img = run(None)
        spec = _ACT[variant]
        y64 = model_activation(gateup, spec["kind"], spec.get("limit"), spec.get("alpha"), spec.get("bs", 1.0),
                               spec.get("bl", 1.0))
        rows_ok = np.arange(mn)[None, :] < counts[:, None] if masked else None
        label = f"act {variant} {recipe} {arch} {'masked' if masked else 'contig'}"
        if recipe == "bf16":
            got = np.asarray(a).astype(np.float64)
            assert img is None and (np.abs(got - y64[0]) <= 2**-8 * np.abs(y64[0]) + 1e-30).all(), label
        else:
            group = {"fp8_block": 128, "mxfp8": 32}[recipe]
            _check_act(np.asarray(a), np.asarray(img), y64 if masked else y64[0], group, arch == 100, label, rows_ok)
        group = {"fp8_block": 128, "mxfp8": 32, "bf16": 128}[recipe]
        other = dataclasses.replace(ak.heuristic_config(inter, recipe), tile=group * (4 if arch == 100 else 2),
                                    block_m=2, num_warps=2, chunks_fastest=False)
        a2, img2 = run(other)
        _launched_with("act_quant_kernel", num_warps=2, BLOCK_M=2, GROUPS=4 if arch == 100 else 2,
                       CHUNKS_FASTEST=False)
        if masked:  # rows >= masked_m are unspecified: compare the defined rows and their scale columns
            sel = rows_ok
            _same_bytes(np.asarray(a)[sel], np.asarray(a2)[sel], f"{label} a")
            cols = lambda im: np.swapaxes(np.asarray(im)[..., :mn], -1, -2)[sel]  # noqa: E731
            _same_bytes(cols(img), cols(img2), f"{label} image")
        else:
            _same_bytes(a, a2, f"{label} a")
            _same_bytes(img, img2, f"{label} image")


def case_host_unpermute_config():
    import jax.numpy as jnp

    from custom_calls.triton import unpermute_kernel as uk
    from custom_calls.unpermute import unpermute as reference

    rng = _rng(63)
    m, k, rows, h = 11, 3, 40, 300
    d = rng.standard_normal((rows, h)).astype(_ml().bfloat16)
    src2dst = rng.permutation(rows)[: m * k].reshape(m, k).astype(np.int32)
    src2dst[rng.random((m, k)) < 0.2] = -1
    w = rng.uniform(0.05, 1.0, (m, k)).astype(np.float32)
    args = (jnp.asarray(d), jnp.asarray(src2dst), jnp.asarray(w))
    out = uk.unpermute(*args, routed_scaling_factor=2.5, out_dtype=jnp.float32)
    want = reference(*args, routed_scaling_factor=2.5, out_dtype=jnp.float32, backend="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)
    out2 = uk.unpermute(*args, routed_scaling_factor=2.5, out_dtype=jnp.float32,
                        config=uk.UnpermuteConfig(block_h=128, num_warps=8))
    _launched_with("weighted_gather_kernel", num_warps=8, BLOCK_H=128)
    _same_bytes(out, out2, "unpermute")
    add = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    out3 = uk.unpermute(*args, add, routed_scaling_factor=2.5, out_dtype=jnp.bfloat16)
    want3 = reference(*args, routed_scaling_factor=2.5, out_dtype=jnp.bfloat16, addend=add, backend="reference")
    _launched_with("weighted_gather_kernel", HAS_ADDEND=True)
    np.testing.assert_allclose(np.asarray(out3, np.float32), np.asarray(want3, np.float32), rtol=2**-7, atol=1e-6)


def case_host_rank_config():
    import jax.numpy as jnp

    from custom_calls.triton import dispatch_kernel as dk

    rng = _rng(64)
    r, e = 333, 5
    ids = rng.integers(0, e + 1, r).astype(np.int32)
    counts, rank = dk.rank_within_expert(jnp.asarray(ids), num_experts=e)
    assert np.array_equal(np.asarray(counts), np.bincount(ids, minlength=e + 1)[:e])
    order = np.argsort(ids, kind="stable")
    want = np.empty(r, np.int64)
    want[order] = np.arange(r) - np.searchsorted(ids[order], ids[order])
    assert np.array_equal(np.asarray(rank), want)
    counts2, rank2 = dk.rank_within_expert(jnp.asarray(ids), num_experts=e,
                                           config=dk.RankConfig(chunk=16, num_warps=2))
    _launched_with("chunk_rank_kernel", num_warps=2, CHUNK=16)
    _same_bytes(counts, counts2, "rank counts")
    _same_bytes(rank, rank2, "rank")


def case_host_route_config():
    import jax.numpy as jnp

    from custom_calls.triton import routing_kernel as rk

    rng = _rng(65)
    m, e, top_k = 37, 64, 8
    logits = (rng.standard_normal((m, e)) * 2).astype(np.float32)
    bias = (rng.standard_normal(e) * 0.3).astype(np.float32)
    kw = dict(top_k=top_k, scoring="sigmoid", n_group=8, topk_group=4, norm_topk_prob=True)
    ids, w = rk.route_topk(jnp.asarray(logits), jnp.asarray(bias), **kw)
    _launched_with("route_topk_kernel", num_warps=1, BLOCK_T=1)  # decode-sized M: one token per program
    want_ids, want_w = model_route(logits, bias, top_k, "sigmoid", 8, 4, True)
    assert np.array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=2e-5, atol=1e-7)
    from custom_calls.route_topk import route_topk as route_op  # the op's reference backend

    ref_ids, ref_w = route_op(jnp.asarray(logits), jnp.asarray(bias), **kw, backend="reference")
    assert np.array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_allclose(np.asarray(w), np.asarray(ref_w), rtol=2e-6, atol=1e-7)
    ids2, w2 = rk.route_topk(jnp.asarray(logits), jnp.asarray(bias), **kw,
                             config=rk.RouteTopkConfig(block_t=2, num_warps=8))
    _launched_with("route_topk_kernel", num_warps=8, BLOCK_T=2)
    _same_bytes(ids, ids2, "route ids")
    _same_bytes(w, w2, "route weights")


def case_host_dispatch_map_configs():
    """The host entry points: heuristic (one launch at this size, two above 4096 routes) and a
    forced tiling against the op's reference backend, bit for bit; traced expert_offset."""
    import jax
    import jax.numpy as jnp

    from custom_calls.dispatch_map import dispatch_map_contig, dispatch_map_masked
    from custom_calls.triton import dispatch_map_kernel as dk

    rng = _rng(76)
    for m, k, e, offset in ((37, 6, 5, 3), (700, 8, 20, 7)):
        ids = jnp.asarray(_map_ids(rng, m, k, e, offset))
        n_launch = 0
        for cfg in (None, dk.DispatchMapConfig(sub=32, subs=2, num_warps=2)):
            start = len(LAUNCHES)
            got_c = jax.jit(lambda i, o, c=cfg: dk.dispatch_map_contig(i, o, num_local_experts=e, alignment=64,
                                                                       config=c))(ids, jnp.int32(offset))
            if cfg is None:
                n_launch = len(LAUNCHES) - start
                assert n_launch == (1 if m * k <= dk.SINGLE_LAUNCH_ROUTES else 2), (m, k, n_launch)
            else:
                _launched_with("map_contig_kernel", num_warps=2, SUB=32, SUBS=2)
            got_m = dk.dispatch_map_masked(ids, jnp.int32(offset), num_local_experts=e, m_pad=m, config=cfg)
            want_c = dispatch_map_contig(ids, offset, num_local_experts=e, alignment=64, backend="reference")
            want_m = dispatch_map_masked(ids, offset, num_local_experts=e, m_pad=m, backend="reference")
            for g, w in zip((*got_c, *got_m), (*want_c, *want_m)):
                _same_bytes(g, w, f"dispatch map m={m} config={cfg}")
            model = model_dispatch_map(np.asarray(ids), offset, e, alignment=64)
            assert np.array_equal(np.asarray(got_c[1]), model[1]) and int(got_c[2]) == model[2]


def model_fused_input(x32, ids, weights, e, rsf):
    """numpy model of the fused kernel's input stage: (q e4m3 (M, H), sf (M, H/128) f32, ids int64,
    weights f32); scales amax floored at 1e-10 / 448 (IEEE f32), ids outside [0, e) or repeating an
    earlier slot's expert -> -1, weights * f32(rsf)."""
    m, h = x32.shape
    amax = np.maximum(np.abs(x32.reshape(m, h // 128, 128)).max(-1), np.float32(1e-10))
    sf = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    q = model_quant_values(x32, sf, 128)
    canon = np.full(ids.shape, -1, np.int64)
    for t in range(m):
        seen = set()
        for j, v in enumerate(ids[t]):
            if 0 <= v < e and v not in seen:
                canon[t, j] = v
            seen.add(int(v))
    return q, sf, canon, (weights * np.float32(rsf)).astype(np.float32)


def case_host_fused_input_configs():
    """The fused kernel's input stage (one launch: workspace zeroing, quantization, routes) on a
    0xFF-filled buffer: the four input regions against the numpy model and, bit for bit, the
    reference; the workspace zero; every other byte untouched; a second tiling gives the same bytes.
    13 tokens of a 16-token buffer, H 1536 (12 groups: a partial second chunk of 8), ids with
    repeats, -1 and ids outside [0, E)."""
    import jax.numpy as jnp

    from custom_calls.fused_moe import fused_input_reference
    from custom_calls.triton import fused_input_kernel as fk
    from layouts import FusedMoEBuffer

    ml = _ml()
    rng = _rng(80)
    m, h, e, k = 13, 1536, 6, 3
    buffer = FusedMoEBuffer(max_tokens=16, hidden=h, intermediate=256, num_experts=e, top_k=k, block_m=64)
    x = (rng.standard_normal((m, h)) * rng.uniform(0.01, 30, (m, 1))).astype(ml.bfloat16)
    x[4, 128:256] = x[4, 128:256] * 0 + ml.bfloat16(3e-12)  # a group below the amax floor
    ids = rng.integers(-1, e, (m, k)).astype(np.int32)
    ids[2] = [3, 3, 3]
    ids[5] = [e, 100, -7]
    ids[7] = [1, -1, 1]
    weights = rng.uniform(0.05, 1, (m, k)).astype(np.float32)
    rsf = 2.826  # not an f32: the kernel and the model multiply by f32(rsf)
    regions = buffer.regions
    q, sf, canon, w = model_fused_input(x.astype(np.float32), ids, weights, e, rsf)
    want = {"input_tokens": q.view(np.uint8).reshape(-1), "input_scales": sf.view(np.uint8).reshape(-1),
            "input_topk_ids": canon.view(np.uint8).reshape(-1), "input_topk_weights": w.view(np.uint8).reshape(-1)}
    ref = np.asarray(fused_input_reference(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(weights), buffer=buffer,
                                           routed_scaling_factor=rsf))
    outs = []
    for cfg in (None, fk.FusedInputConfig(tile=512, block_m=4, num_warps=2, chunks_fastest=False, zero_block=256,
                                          route_programs=False)):
        buf = np.asarray(fk.fused_input(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(weights), buffer=buffer,
                                        routed_scaling_factor=rsf, config=cfg))
        if cfg is None:
            _launched_with("fused_input_kernel", num_warps=4, BLOCK_M=1, GROUPS=8, ZERO_BLOCK=2048,
                           ROUTE_PROGRAMS=True)
        else:
            _launched_with("fused_input_kernel", num_warps=2, BLOCK_M=4, GROUPS=4, ZERO_BLOCK=256,
                           ROUTE_PROGRAMS=False)
        assert buf.shape == (buffer.total_bytes,) and buf.dtype == np.uint8
        touched = np.zeros(buf.shape, bool)
        off, n = regions["workspace"]
        assert (buf[off:off + n] == 0).all(), "workspace not zeroed"
        touched[off:off + n] = True
        for name, data in want.items():
            off = regions[name][0]
            got = buf[off:off + data.size]
            assert np.array_equal(got, data), f"{name}: differs from the model at {np.argwhere(got != data)[:5]}"
            assert np.array_equal(ref[off:off + data.size], data), f"{name}: the reference differs from the model"
            touched[off:off + data.size] = True
        assert (buf[~touched] == 0xFF).all(), f"bytes outside the input regions written: {np.argwhere(buf[~touched] != 0xFF)[:5]}"
        assert (ref[~touched] == 0).all()
        outs.append(buf)
    _same_bytes(outs[0], outs[1], "fused input configs")
    with pytest.raises(ValueError, match="x: expected 1 to 16 tokens"):
        fused_input_reference(jnp.zeros((17, h), jnp.bfloat16), jnp.zeros((17, k), jnp.int32),
                              jnp.zeros((17, k), jnp.float32), buffer=buffer, routed_scaling_factor=1.0)


def case_router_partials():
    """The router GEMM's split-K partials against a float64 model (each split's sum of exact bf16
    products: fp32 accumulation error only), the reference against the same model; H 1000 (the
    last split and its last k-step partial), E 20 in a 32-wide tile, 37 tokens (a partial row block)."""
    import jax.numpy as jnp

    from custom_calls.route_topk import router_partials_reference
    from custom_calls.triton import router_kernel as rk

    ml = _ml()
    rng = _rng(90)
    m, h, e = 37, 1000, 20
    x = rng.standard_normal((m, h)).astype(ml.bfloat16)
    gate = (rng.standard_normal((e, h)) * 0.05).astype(ml.bfloat16)
    cfg = rk.RouterConfig(block_m=16, block_e=32, block_k=64, split_k=256, num_warps=4, num_stages=2)
    got = np.asarray(rk.router_partials(jnp.asarray(x), jnp.asarray(gate), config=cfg))
    _launched_with("router_partials_kernel", num_warps=4, num_stages=2, BLOCK_M=16, BLOCK_E=32, BLOCK_K=64,
                   SPLIT_K=256)
    x64, g64 = x.astype(np.float64), gate.astype(np.float64)
    model = np.stack([x64[:, c:c + 256] @ g64[:, c:c + 256].T for c in range(0, h, 256)])
    assert got.shape == model.shape == (4, m, e) and got.dtype == np.float32 and np.isfinite(got).all()
    np.testing.assert_allclose(got, model, rtol=1e-5, atol=1e-5)
    ref = np.asarray(router_partials_reference(jnp.asarray(x), jnp.asarray(gate), split_k=256))
    np.testing.assert_allclose(ref, model, rtol=1e-5, atol=1e-5)
    # the heuristic: decode rows fill the GPU with splits (each at least 2 steps deep), prefill rows
    # with row blocks; loads pipelined 3 deep
    assert rk.heuristic_config(32, 7168, 32) == rk.RouterConfig(16, 32, 128, 256, 4, 3)
    assert rk.heuristic_config(128, 7168, 32) == rk.RouterConfig(16, 32, 128, 512, 4, 3)
    assert rk.heuristic_config(512, 7168, 32) == rk.RouterConfig(64, 32, 128, 512, 4, 3)
    assert rk.heuristic_config(4096, 7168, 32) == rk.RouterConfig(128, 32, 128, 1792, 8, 3)
    assert rk.heuristic_config(16384, 7168, 32) == rk.RouterConfig(128, 32, 128, 7168, 8, 3)
    assert rk.heuristic_config(8, 7168, 256) == rk.RouterConfig(16, 128, 128, 256, 4, 3)
    assert rk.heuristic_config(4096, 7168, 256) == rk.RouterConfig(128, 128, 128, 3584, 8, 3)
    assert rk.heuristic_config(3, 256, 20).split_k == 256  # one split of two steps: H 256
    with pytest.raises(ValueError, match="num_stages"):
        rk.RouterConfig(16, 32, 128, 256, 4, 5)


def case_host_fused_input_routed():
    """The input stage with the routing epilogue: the router logits as 3 partial sums, grouped top-k
    with a correction bias over 24 experts of which experts 6..11 are held here (expert_offset 6),
    13 tokens of a 16-token buffer; tokens, scales and ids bit for bit against the numpy model
    (the float64 routing model on the partials added in order) and the reference, the weights to
    the epilogue's float rounding; the workspace zero, nothing else written. A softmax layer
    without groups in a second tiling gives the reference's bytes too."""
    import jax.numpy as jnp

    from custom_calls.fused_moe import fused_input_routed_reference
    from custom_calls.triton import fused_input_kernel as fk
    from layouts import FusedMoEBuffer

    ml = _ml()
    rng = _rng(91)
    m, h, e_loc, e_route, k, offset, rsf = 13, 1536, 6, 24, 4, 6, 2.826
    buffer = FusedMoEBuffer(max_tokens=16, hidden=h, intermediate=256, num_experts=e_loc, top_k=k, block_m=64)
    regions = buffer.regions
    x = (rng.standard_normal((m, h)) * rng.uniform(0.01, 30, (m, 1))).astype(ml.bfloat16)
    for scoring, ng, tg, with_bias, cfg in (
            ("sigmoid", 4, 2, True, None),
            ("softmax", 1, 1, False, fk.FusedInputConfig(tile=512, block_m=4, num_warps=2, chunks_fastest=False,
                                                         zero_block=256, route_programs=False))):
        partials = (rng.standard_normal((3, m, e_route)) * 1.5).astype(np.float32)
        bias = (rng.standard_normal(e_route) * 0.3).astype(np.float32) if with_bias else None
        logits = (partials[0] + partials[1]) + partials[2]
        ids, w = model_route(logits, bias, k, scoring, ng, tg, True)
        local = ids - offset
        local[(local < 0) | (local >= e_loc)] = -1
        q, sf, canon, w = model_fused_input(x.astype(np.float32), local, w.astype(np.float32), e_loc, rsf)
        assert (canon >= 0).any() and (canon < 0).any()  # some routes held here, some not
        kw = dict(buffer=buffer, routed_scaling_factor=rsf, top_k=k, scoring=scoring, n_group=ng, topk_group=tg)
        args = (jnp.asarray(x), jnp.asarray(partials), None if bias is None else jnp.asarray(bias), jnp.int32(offset))
        buf = np.asarray(fk.fused_input_routed(*args, config=cfg, **kw))
        _launched_with("fused_input_kernel", ROUTE=True, SPLITS=3, E_ROUTE=e_route, HAS_BIAS=with_bias,
                       num_warps=1 if cfg is None else 2, ROUTE_PROGRAMS=cfg is None)
        ref = np.asarray(fused_input_routed_reference(*args, **kw))
        touched = np.zeros(buf.shape, bool)
        off, n = regions["workspace"]
        assert (buf[off:off + n] == 0).all(), "workspace not zeroed"
        touched[off:off + n] = True
        for name, data in (("input_tokens", q), ("input_scales", sf), ("input_topk_ids", canon)):
            off = regions[name][0]
            data = data.view(np.uint8).reshape(-1)
            for label, out in (("kernel", buf), ("reference", ref)):
                got = out[off:off + data.size]
                assert np.array_equal(got, data), f"{label} {name}: differs from the model at {np.argwhere(got != data)[:5]}"
            touched[off:off + data.size] = True
        off = regions["input_topk_weights"][0]
        for label, out in (("kernel", buf), ("reference", ref)):
            got = out[off:off + w.nbytes].view(np.float32).reshape(w.shape)
            np.testing.assert_allclose(got, w, rtol=2e-5, atol=1e-7, err_msg=f"{label} weights ({scoring})")
        touched[off:off + w.nbytes] = True
        assert (buf[~touched] == 0xFF).all(), f"bytes outside the input regions written ({scoring})"


def model_w4a8_masked(codes, sf32, a_q, sa_rows):
    """Float64 model of the W4A8 masked GEMM on the operands the FP4 -> FP8 path defines: e2m1 codes
    (G, N, K) times their 32-group scales sf32 (G, N, K/32), each 128 x 128 tile as e4m3 values
    RNE(v * sf32 / sf128) times its block scale sf128 = max(the tile's sf32) / 2^6 (at least 2^-126);
    activations e4m3 (G, m_pad, K, column order) times sa_rows (G, m_pad, K/128) -> (G, m_pad, N)."""
    ml = _ml()
    g, n, k = codes.shape
    v = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    nt = -(-n // 128)
    tiles = np.pad(sf32.astype(np.float64), ((0, 0), (0, nt * 128 - n), (0, 0))).reshape(g, nt, 128, k // 128, 4)
    sf128 = np.maximum(tiles.max(axis=(2, 4)) / 64, 2.0**-126)  # (G, N/128, K/128)
    sf128 = np.repeat(np.repeat(sf128, 128, axis=1)[:, :n], 128, axis=2)
    e4m3 = (v * np.repeat(sf32.astype(np.float64), 32, axis=-1) / sf128).astype(ml.float8_e4m3fn)
    w = e4m3.astype(np.float64) * sf128
    a = a_q.view(ml.float8_e4m3fn).astype(np.float64) * np.repeat(sa_rows.astype(np.float64), 128, axis=-1)
    return np.einsum("gmk,gnk->gmn", a, w), np.einsum("gmk,gnk->gmn", np.abs(a), np.abs(w))


def _w4a8_weights(rng, g, n, k):
    import jax.numpy as jnp

    from layouts.fp4 import pack_e2m1
    from layouts.w4a8 import mxfp4_to_w4a8

    codes = rng.integers(0, 16, (g, n, k), dtype=np.uint8)
    # a spread of 24 exponents: every e4m3 table (subnormal and all-zero ones included) is used
    sf32 = (2.0 ** rng.integers(-26, -2, (g, n, k // 32))).astype(np.float32)
    w, sw = mxfp4_to_w4a8(pack_e2m1(jnp.asarray(codes)), jnp.asarray(sf32))
    return codes, sf32, w, sw


def _w4a8_check(d, want, mag, valid, label):
    got, ref, bound = d[valid], want[valid], mag[valid]
    assert np.isfinite(got).all(), f"{label}: a valid row was not written"
    bad = np.abs(got - ref) > 2.0**-8 * np.abs(ref) + 1e-5 * bound
    assert not bad.any(), f"{label}: {bad.sum()} elements off the model, first {np.argwhere(bad)[:3]}"


def case_w4a8_table_words():
    """The kernels compute each e4m3 table's two words from its index: all of them equal
    `layouts.w4a8.table_words`, the RNE products."""
    global _table_words  # the interpreter resolves a kernel's callees among this module's globals
    import jax
    import jax.numpy as jnp
    import triton
    import triton.language as tl

    from custom_calls.triton.launch import triton_call
    from custom_calls.triton.w4a8_gemm_kernel import _table_words
    from layouts.w4a8 import NUM_TABLES, table_words

    @triton.jit
    def words_kernel(idx_ptr, lo_ptr, hi_ptr, N: tl.constexpr):
        idx = tl.load(idx_ptr + tl.arange(0, N))
        lo, hi = _table_words(idx)
        tl.store(lo_ptr + tl.arange(0, N), lo)
        tl.store(hi_ptr + tl.arange(0, N), hi)

    n = 32
    out = [jax.ShapeDtypeStruct((n,), jnp.int32)] * 2
    lo, hi = triton_call(jnp.arange(n, dtype=jnp.int32) % NUM_TABLES, kernel=words_kernel, out_shape=out,
                         grid=(1,), name="table_words", N=n)
    got = np.stack([np.asarray(lo), np.asarray(hi)], axis=1).view(np.uint32)
    want = table_words()[np.arange(n) % NUM_TABLES]
    np.testing.assert_array_equal(got, want)


def case_host_w4a8_contig():
    """The W4A8 contig kernel (widen="shifts"): odd N, a partial expert block, an all-padding block, an
    expert with a few rows, at 128- and 64-row tiles: expert rows against the float64 model, padding
    rows written as 0."""
    import jax.numpy as jnp

    from custom_calls.triton import w4a8_gemm_kernel as wk
    from layouts import gemm_format
    from layouts.scale_layout import from_mn_major_tma_aligned

    rng = _rng(71)
    g, n, k = 3, 200, 384
    codes, sf32, w, sw = _w4a8_weights(rng, g, n, k)
    m_indices = np.full(512, -1, np.int32)
    m_indices[:100], m_indices[128:256], m_indices[384:390] = 2, 0, 1
    x = rng.standard_normal((512, k)) * (m_indices >= 0)[:, None]
    a, sa = gemm_format("mxfp4", 90).quantize_lhs(jnp.asarray(x.astype(np.float32)))
    rows = np.asarray(from_mn_major_tma_aligned(sa, 512))
    a_plain = _from_w4a8_order(np.asarray(a).view(np.uint8))
    full, mag = model_w4a8_masked(codes, sf32, np.broadcast_to(a_plain, (g, 512, k)),
                                  np.broadcast_to(rows, (g, 512, k // 128)))
    expert = np.maximum(m_indices, 0)
    want, bound = full[expert, np.arange(512)], mag[expert, np.arange(512)]
    for cfg in (None, wk.W4A8Config(block_n=64, block_m=64, num_warps=4)):
        d = np.asarray(wk.w4a8_contig(a, sa, w, sw, jnp.asarray(m_indices), alignment=128, config=cfg,
                                      widen="shifts")).astype(np.float64)
        _w4a8_check(d, want, bound, m_indices >= 0, f"contig {cfg}")
        assert (d[m_indices < 0] == 0).all(), f"contig {cfg}: padding rows not 0"


def case_w4a8_expand():
    """The W4A8 -> FP8 expansion (widen="shifts") equals its reference bit for bit: odd N (a partial last row
    tile), every e4m3 table; and writes every element: with no zero code and one scale per group (every
    32-group 2^6 above its block scale: normal e4m3 values) no output byte is 0 or 0x80, so an unwritten
    one would show; the block scales against the float64 maximum of each tile's 32-group scales / 2^6."""
    import jax.numpy as jnp

    from custom_calls.triton.w4a8_expand_kernel import w4a8_expand
    from layouts.fp4 import E2M1_VALUES, pack_e2m1
    from layouts.w4a8 import from_w4a8_lhs_order, mxfp4_to_w4a8, w4a8_to_fp8_block_lhs_order

    rng = _rng(83)
    g, n, k = 2, 200, 384
    codes, sf32, w, sw = _w4a8_weights(rng, g, n, k)
    got_w, got_s = w4a8_expand(w, sw, widen="shifts")
    want_w, want_s = w4a8_to_fp8_block_lhs_order(w, sw)
    np.testing.assert_array_equal(np.asarray(got_w).view(np.uint8), np.asarray(want_w).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got_s), np.asarray(want_s))
    tiles = np.pad(sf32.astype(np.float64), ((0, 0), (0, 256 - n), (0, 0))).reshape(g, 2, 128, k // 128, 4)
    np.testing.assert_array_equal(np.asarray(got_s), tiles.max(axis=(2, 4)) / 2.0**6)
    codes = rng.choice(np.r_[1:8, 9:16], (g, n, k)).astype(np.uint8)
    sf = np.broadcast_to(2.0 ** rng.integers(-20, -2, (g, 1, 1)), (g, n, k // 32)).astype(np.float32)
    w, sw = mxfp4_to_w4a8(pack_e2m1(jnp.asarray(codes)), jnp.asarray(np.ascontiguousarray(sf)))
    got = np.asarray(w4a8_expand(w, sw, widen="shifts")[0]).view(np.uint8)
    assert not np.isin(got, (0, 0x80)).any()
    np.testing.assert_array_equal(got, np.asarray(w4a8_to_fp8_block_lhs_order(w, sw)[0]).view(np.uint8))
    # the fused layout's form: column order and w13's rows [gate; up] interleaved by 8 (N = 2I, I = 384),
    # against the float64 model (the e4m3 bytes decode to code value x 2^-s, rows placed by the numpy index)
    codes = rng.choice(np.r_[1:8, 9:16], (g, 768, k)).astype(np.uint8)
    sf = (2.0 ** rng.integers(-12, 0, (g, 768, k // 32))).astype(np.float32)
    w, sw = mxfp4_to_w4a8(pack_e2m1(jnp.asarray(codes)), jnp.asarray(sf))
    chunk = np.arange(768).reshape(2, 384 // 8, 8).transpose(1, 0, 2).reshape(-1)  # source row of each output row
    for order, gran in (("columns", 8), ("columns", 0), ("w4a8", 8)):
        got_w, got_s = w4a8_expand(w, sw, widen="shifts", column_order=order, gate_up_interleave=gran)
        got = np.asarray(got_w).view(np.uint8)
        assert not np.isin(got, (0, 0x80)).any(), f"{order}/{gran}: an element not written"
        src = chunk if gran else np.arange(768)
        # the block scales stay [gate; up]: an output row takes its source row's
        vals = np.asarray(got_w).astype(np.float64) * np.repeat(np.repeat(np.asarray(got_s), 128, 1)[:, src], 128, 2)
        if order == "w4a8":
            vals = np.asarray(from_w4a8_lhs_order(jnp.asarray(vals)))
        want = np.asarray(E2M1_VALUES)[codes & 7] * np.where(codes >= 8, -1.0, 1.0) * np.repeat(sf, 32, -1)
        np.testing.assert_array_equal(vals, want[:, src], err_msg=f"{order}/{gran}")


def case_layer_w4a8():
    """DeepSeek-V4's layer (scaled) with its MXFP4 experts kept 4-bit, backend "auto" (under the
    interpreter: the Triton stages and the "w4a8" GEMMs), contig and masked: within bf16 rounding of the reference layer,
    which equals the FP4 -> FP8 form bit for bit (tests/test_w4a8_gemm.py); fused: the weights widened by the Triton
    kernel."""
    import jax
    import jax.numpy as jnp

    from moe_jax import MoEConfig, init_params, moe_forward, prepare_params

    cfg = MoEConfig.deepseek_v4(num_experts=8, hidden_size=256, intermediate_size=256, top_k=4, n_shared_experts=0,
                                arch=90, mxfp4_sm90_form="w4a8")
    params = prepare_params(init_params(jax.random.key(0), cfg), cfg)
    x = jax.random.normal(jax.random.key(1), (40, 256), jnp.bfloat16)
    ref = np.asarray(moe_forward(x, params, cfg, backend="reference"), np.float64)
    for layout in ("contig", "masked"):
        got = np.asarray(moe_forward(x, params, cfg, layout=layout, backend="auto"), np.float64)
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert np.isfinite(got).all() and rel < 1e-2, (layout, rel)
    # the fused layout on the same 4-bit params: the "w4a8" backend widens them (the Triton kernel), the
    # fused op runs its reference here, so the output is the reference layer's fused output bit for bit
    from custom_calls.backends import record_resolutions

    with record_resolutions() as log:
        got = np.asarray(moe_forward(x, params, cfg, layout="fused", backend="auto"))
    assert ("widen_w4a8_weights", "w4a8") in log, log
    np.testing.assert_array_equal(got, np.asarray(moe_forward(x, params, cfg, layout="fused", backend="reference")))


def case_host_w4a8_masked():
    """The W4A8 kernel (widen="shifts": the interpreter runs no PTX) at its heuristic tiling and a
    smaller one, odd N, an empty group and one spanning several token tiles: every valid row against
    the float64 model (bf16 output rounding plus fp32 accumulation), rows past masked_m untouched."""
    import jax.numpy as jnp

    from custom_calls.triton import w4a8_gemm_kernel as wk
    from layouts import gemm_format
    from layouts.scale_layout import from_mn_major_tma_aligned

    rng = _rng(70)
    g, m_pad, n, k = 3, 128, 200, 384
    codes, sf32, w, sw = _w4a8_weights(rng, g, n, k)
    x = rng.standard_normal((g, m_pad, k)) * rng.uniform(0.1, 10, (g, m_pad, 1))
    a, sa = gemm_format("mxfp4", 90).quantize_lhs(jnp.asarray(x.astype(np.float32)))
    masked_m = np.array([5, 0, 77], np.int32)
    want, mag = model_w4a8_masked(codes, sf32, _from_w4a8_order(np.asarray(a).view(np.uint8)),
                                  np.asarray(from_mn_major_tma_aligned(sa, m_pad)))
    for cfg in (None, wk.W4A8Config(block_n=64, block_m=16, num_warps=2)):
        d = np.asarray(wk.w4a8_masked(a, sa, w, sw, jnp.asarray(masked_m), expected_m=32, config=cfg,
                                      widen="shifts")).astype(np.float64)
        valid = np.arange(m_pad)[None, :] < masked_m[:, None]
        _w4a8_check(d, want, mag, valid, f"masked {cfg}")
        assert np.isnan(d[~valid]).all(), f"{cfg}: rows past masked_m written"


def _main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _install_exact_casts()
    _record_launches()

    def run_case(name: str) -> str:
        if name not in CASES:
            raise KeyError(f"no case {name!r}")
        globals()[f"case_{name}"]()
        return "ok"

    serve(run_case)


if __name__ == "__main__":
    _main()
