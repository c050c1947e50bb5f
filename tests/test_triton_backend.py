"""The "triton" backend on a machine without a GPU: registration, import hygiene, trace-time
rejection of the masked clamp/SiTU constraints, and compilation of every kernel for sm_90 and
sm_100 (Triton compiles offline; `triton` needed, `jax_triton` not)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from custom_calls.activation import ActivationSpec

backends = importlib.import_module("custom_calls.backends")

OPS = ("permute_contig", "permute_masked", "activation_quant_contig", "activation_quant_masked", "unpermute",
       "rank_within_expert", "route_topk", "dispatch_map_contig", "dispatch_map_masked")


def test_importing_custom_calls_imports_no_gpu_dependency():
    code = ("import sys, custom_calls, custom_calls.triton; "
            "bad = [m for m in ('jax_triton', 'triton') if m in sys.modules]; "
            "assert not bad, bad; print('clean')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr[-2000:]


def test_every_op_has_a_triton_implementation():
    import custom_calls.triton  # noqa: F401  (registers)

    for op in OPS:
        assert "triton" in backends.backends(op), op


def test_explicit_triton_on_cpu_is_an_error_naming_the_platform():
    with pytest.raises(ValueError, match=r"platform.*'cpu'"):
        backends.resolve("unpermute", "triton", platform="cpu", num_rows=8, hidden=16, num_tokens=4,
                         top_k=2, out_dtype=jnp.dtype(jnp.bfloat16))


def test_auto_on_cpu_is_the_reference():
    impl = backends.resolve("permute_contig", "auto", platform="cpu", num_tokens=4, hidden=256, top_k=2,
                            num_rows=128, recipe="fp8_block", arch=90, dtype=jnp.bfloat16)
    assert impl.backend == "reference"


def test_dispatch_with_triton_ranking_on_cpu_is_an_error_naming_the_platform():
    from moe_jax.dispatch import dispatch_contig

    if jax.default_backend() == "cpu":  # on a GPU machine the Triton backend runs this call
        with pytest.raises(ValueError, match=r"dispatch_map_contig.*platform is 'cpu'"):
            dispatch_contig(jnp.zeros((4, 2), jnp.int32), num_local_experts=2, alignment=8, backend="triton")
    from custom_calls.triton import supports_dispatch_map_contig, supports_dispatch_map_masked

    assert supports_dispatch_map_contig(num_routes=4096 * 8, num_experts=32, alignment=128) == (True, "")
    ok, reason = supports_dispatch_map_masked(num_routes=8, num_experts=1025, m_pad=128)
    assert not ok and "num_experts: at most 1024 local experts, got 1025" in reason
    ok, reason = supports_dispatch_map_masked(num_routes=2**20, num_experts=1024, m_pad=2**21)
    assert not ok and "rows of the grouped layout: expected fewer than 2**31 (int32 row indices), got 2147483648" \
        in reason
    ok, reason = supports_dispatch_map_contig(num_routes=2**31, num_experts=8, alignment=128)
    assert not ok and "num_routes: expected fewer than 2**31 routes (M * top_k), got 2147483648" in reason
    from custom_calls.triton import supports_rank_within_expert

    ok, reason = supports_rank_within_expert(num_routes=8, num_experts=1024)
    assert not ok and "num_experts: at most 1023 local experts, got 1024" in reason
    ok, reason = supports_rank_within_expert(num_routes=16384 * 128 + 1, num_experts=32)
    assert not ok and "num_routes: at most 2097152 routes (M * top_k) for 32 local experts, got 2097153" in reason


def test_environment_names_the_missing_gpu():
    from custom_calls.triton import environment

    assert "cpu" in environment("cpu")


def _masked_static(num_groups, m_pad, two_i, act, recipe="fp8_block"):
    return dict(num_groups=num_groups, m_pad=m_pad, two_i=two_i, act=act, recipe=recipe, arch=90,
                dtype=jnp.bfloat16)


CLAMP = ActivationSpec(kind="silu", swiglu_limit=7.0)
SITU = ActivationSpec(kind="situ", situ_beta=2.0, situ_linear_beta=3.0)
KEEP = ActivationSpec(kind="silu", keep_fp32=True)


@pytest.mark.parametrize("act", [CLAMP, SITU, KEEP], ids=["clamp", "situ", "keep_fp32"])
def test_masked_constraint_n_mod_4(act):
    with pytest.raises(ValueError, match=r"N % 4 == 0 violated: N = m_pad = 130"):
        backends.resolve("activation_quant_masked", "triton", platform="gpu", **_masked_static(4, 130, 4096, act))


@pytest.mark.parametrize("act", [CLAMP, SITU, KEEP], ids=["clamp", "situ", "keep_fp32"])
def test_masked_constraint_g_mod_4(act):
    # I = 768: G = 6 groups of 128
    with pytest.raises(ValueError, match=r"G % 4 == 0 violated: G = I / group = 768 / 128 = 6"):
        backends.resolve("activation_quant_masked", "triton", platform="gpu", **_masked_static(4, 256, 1536, act))


@pytest.mark.parametrize("act", [CLAMP, SITU, KEEP], ids=["clamp", "situ", "keep_fp32"])
def test_masked_constraint_d_div_8_ge_e(act):
    # I = 512: D // 8 = 64 < E = 65
    with pytest.raises(ValueError, match=r"D // 8 >= E violated: D = I = 512, D // 8 = 64 < E = 65"):
        backends.resolve("activation_quant_masked", "triton", platform="gpu", **_masked_static(65, 256, 1024, act))


def test_masked_constraint_i_not_multiple_of_group():
    with pytest.raises(ValueError, match=r"G % 4 == 0 violated: G = I / group = 600 / 128"):
        backends.resolve("activation_quant_masked", "triton", platform="gpu", **_masked_static(4, 256, 1200, CLAMP))


@pytest.mark.parametrize("act", [ActivationSpec(kind="silu"), ActivationSpec(kind="swiglu_oai", swiglu_limit=7.0,
                                                                             gemm1_alpha=1.702)],
                         ids=["silu", "swiglu_oai"])
def test_unconstrained_masked_kernels_accept_odd_shapes(act):
    from custom_calls.triton import activation_masked_constraints

    assert activation_masked_constraints(**{k: v for k, v in _masked_static(65, 130, 1200, act).items()
                                            if k not in ("arch", "dtype")}) == ""


def test_route_topk_rejects_what_it_cannot_serve():
    from custom_calls.triton.support import route_topk_reason

    assert route_topk_reason(256, 8, "sigmoid", 8, 4) == ""
    assert route_topk_reason(96, 8, "sigmoid", 3, 2) == ""  # any n_group dividing E
    assert route_topk_reason(160, 6, "softmax", 5, 3) == ""
    assert "n_group: expected a divisor of num_experts = 96, got 5" in route_topk_reason(96, 8, "sigmoid", 5, 2)
    assert "num_experts" in route_topk_reason(2048, 8, "softmax", 1, 1)
    assert "scoring" in route_topk_reason(64, 8, "relu", 1, 1)
    assert "topk_group" in route_topk_reason(64, 8, "sigmoid", 8, 9)


def test_constraints_hold_at_the_deepseek_shapes():
    from custom_calls.triton import activation_masked_constraints

    for act in (CLAMP, SITU, KEEP):
        assert activation_masked_constraints(num_groups=32, m_pad=256, two_i=4096, act=act, recipe="fp8_block") == ""


# ------------------------------------------------------------------ offline compilation


def _compile(kernel, pointers: dict, constexprs: dict, arch: int, num_warps: int = 4, num_stages: int = 1):
    """The kernel compiled as the native launcher compiles it (`native.compile_triton`: 16-byte
    aligned pointers, so the loads vectorize as on the GPU)."""
    pytest.importorskip("triton")
    from custom_calls.triton.native import compile_triton

    return compile_triton(kernel, pointers, constexprs, num_warps=num_warps, num_stages=num_stages, arch=arch)


def _resources(compiled) -> dict:
    """Registers and stack bytes of a compiled kernel, read with the cuobjdump Triton ships."""
    import os
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    assert m, out
    return dict(reg=int(m.group(1)), stack=int(m.group(2)))


def _lean(compiled) -> None:
    """No spills and a register count that leaves room for several programs per SM: these kernels
    are memory-bound and need many loads in flight (a 255-register version ran at 1/3 of copy speed)."""
    res = _resources(compiled)
    assert res["stack"] == 0 and res["reg"] <= 96, res


def _vector_loads(ptx: str) -> int:
    return len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.", ptx))


@pytest.mark.parametrize("arch", [90, 100])
def test_kernels_compile_for_sm90_and_sm100(arch):
    pytest.importorskip("triton")
    from custom_calls.triton.activation_kernel import act_quant_kernel, kernel_config
    from custom_calls.triton.permute_kernel import row_source_kernel, scale_image_kernel, scatter_quant_kernel
    from custom_calls.triton.quant_kernel import per_token_group_quant_kernel
    from custom_calls.triton.unpermute_kernel import weighted_gather_kernel

    ue8m0 = arch == 100
    img = "*i32" if ue8m0 else "*fp32"
    rows, h, inter = 1152, 7168, 2048
    c = _compile(per_token_group_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "img_ptr": img},
                 dict(MN=rows, K=h, G=56, IMG_LD=rows, IMG_SLAB=56 * rows, GROUP=128, UE8M0=ue8m0,
                      BLOCK_M=4, GROUPS=8, ROW_BLOCKS=rows // 4, CHUNKS_FASTEST=True), arch)
    assert _vector_loads(c.asm["ptx"]) > 0 and "e4m3x2" in c.asm["ptx"] and c.asm["cubin"]
    _lean(c)
    for zero_fill in (True, False):  # contig; masked, writing the row sources
        c = _compile(scatter_quant_kernel, {"x_ptr": "*bf16", "src2dst_ptr": "*i32", "src1_ptr": "*i32",
                                            "lhs_ptr": "*fp8e4nv", "sf_ptr": "*fp32", "src1_out_ptr": "*i32"},
                     dict(M=256, H=h, TOPK=8, TOPK_P2=8, R=rows, G=56, GROUP=128, QUANT=True, UE8M0=ue8m0, GROUPS=8,
                          TOKENS=4, ZERO_FILL=zero_fill, ZERO_ROWS=64, ZERO_SUB=4, CHUNKS_FASTEST=True,
                          ROW_SOURCE_OUT=not zero_fill), arch)
        assert _vector_loads(c.asm["ptx"]) > 0 and "e4m3x2" in c.asm["ptx"] and c.asm["cubin"]
        _lean(c)
    c = _compile(scale_image_kernel, {"src1_ptr": "*i32", "sf_ptr": "*fp32", "img_ptr": img},
                 dict(MN=rows, G=56, IMG_LD=rows, IMG_SLAB=56 * rows, UE8M0=ue8m0, ROWS=128, GROUPS=8,
                      ROW_BLOCKS=rows // 128), arch)
    _lean(c)
    _lean(_compile(row_source_kernel, {"src2dst_ptr": "*i32", "src1_ptr": "*i32"},
                   dict(N=32768, TOPK=8, R=rows, BLOCK=1024), arch))
    cfg = kernel_config(inter, "fp8_block", ActivationSpec(kind="silu", swiglu_limit=7.0))
    c = _compile(act_quant_kernel, {"y_ptr": "*bf16", "masked_m_ptr": "*i32", "a_ptr": "*fp8e4nv", "img_ptr": img},
                 dict(MN=256, I=inter, G=16, IMG_LD=256, IMG_SLAB=16 * 256, UE8M0=ue8m0, MASKED=True,
                      ROW_BLOCKS=32 * 256 // cfg["BLOCK_M"], CHUNKS_FASTEST=True, **cfg), arch)
    assert _vector_loads(c.asm["ptx"]) > 0 and "e4m3x2" in c.asm["ptx"] and c.asm["cubin"]
    _lean(c)
    for addend in (False, True):  # the shared expert's output added in the same pass
        c = _compile(weighted_gather_kernel, {"d_ptr": "*bf16", "src2dst_ptr": "*i32", "w_ptr": "*fp32",
                                              "add_ptr": "*bf16", "out_ptr": "*bf16"},
                     dict(R=rows, H=h, TOPK=8, SCALE=2.5, BLOCK_H=1024, HAS_ADDEND=addend), arch)
        assert _vector_loads(c.asm["ptx"]) >= 8 + addend and c.asm["cubin"]  # the 8 route rows in flight at once
        _lean(c)
    from custom_calls.triton.dispatch_kernel import chunk_count_kernel, chunk_offsets_kernel, chunk_rank_kernel

    _lean(_compile(chunk_count_kernel, {"e_ptr": "*i32", "counts_ptr": "*i32"}, dict(R=32768, E_PAD=64, CHUNK=128), arch))
    _lean(_compile(chunk_offsets_kernel, {"counts_ptr": "*i32", "offs_ptr": "*i32", "totals_ptr": "*i32"},
                   dict(NC=256, NC_PAD=256, E_PAD=64), arch))
    _lean(_compile(chunk_rank_kernel, {"e_ptr": "*i32", "offs_ptr": "*i32", "rank_ptr": "*i32"},
                   dict(R=32768, E_PAD=64, CHUNK=128), arch))
    from custom_calls.triton.routing_kernel import route_topk_kernel

    route_ptrs = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i32", "w_ptr": "*fp32"}
    v3 = dict(E=256, TOPK=8, K_PAD=8, SCORING=1, HAS_BIAS=True, N_GROUP=8, NG_PAD=8, GS_PAD=32, TOPK_GROUP=4,
              RENORM=True)
    # decode tiling (one token, one warp) and 3 groups of 32 padded to 4: no spills either
    for const, warps in ((dict(M=128, BLOCK_T=1, **v3), 1),
                         (dict(v3, M=100, E=96, N_GROUP=3, NG_PAD=4, GS_PAD=32, TOPK_GROUP=2, BLOCK_T=2), 1)):
        assert _resources(_compile(route_topk_kernel, route_ptrs, const, arch, warps))["stack"] == 0
    from custom_calls.triton.dispatch_map_kernel import map_contig_kernel, map_hist_kernel, map_masked_kernel

    map_ptrs = {"ids_ptr": "*i32", "off_ptr": "*i32", "hist_ptr": "*i32", "dst_ptr": "*i32"}
    # the heuristic tilings at prefill (4096 tokens, two launches) and decode (128 tokens, one launch of 8)
    prefill = dict(R=32768, E=32, E_PAD=32, SUB=128, SUBS=2, NC=128, HB=128, ONE_LAUNCH=False)
    decode = dict(R=1024, E=32, E_PAD=32, SUB=128, SUBS=1, NC=8, HB=8, ONE_LAUNCH=True)
    _lean(_compile(map_hist_kernel, {"ids_ptr": "*i32", "off_ptr": "*i32", "hist_ptr": "*i32"},
                   {k: prefill[k] for k in ("R", "E", "E_PAD", "SUB", "SUBS")}, arch, 8))
    # no spills; at prefill (128 chunks, about one per SM) two 8-warp programs fit per SM (<= 128
    # registers); at decode 8 programs of 4 warps are far from filling the GPU
    for const, warps, max_reg in ((prefill, 8, 128), (decode, 4, 255)):
        for c in (_compile(map_contig_kernel, dict(map_ptrs, mind_ptr="*i32", nrows_ptr="*i32", counts_ptr="*i32"),
                           dict(const, ALIGN=128, CAP=36864, ROWS_PER_PROGRAM=384, ROW_BLOCK=128), arch, warps),
                  _compile(map_masked_kernel, dict(map_ptrs, masked_m_ptr="*i32", dropped_ptr="*i32"),
                           dict(const, M_PAD=256, DROPPED_ROW=32 * 256), arch, warps)):
            res = _resources(c)
            assert res["stack"] == 0 and res["reg"] <= max_reg, res
    c = _compile(route_topk_kernel, route_ptrs, dict(M=4096, BLOCK_T=8, **v3), arch)
    assert _resources(c)["stack"] == 0


def test_w4a8_column_order_keeps_the_producers_loads_vectorized():
    """The producers of W4A8 activations (lhs stored in the W4A8 column order, `layouts.w4a8`) load
    contiguous columns and reorder the tile in registers: as many vector loads as in column order, no
    spill, few registers. At V4's shapes (H 4096, I 2048: whole 128-column blocks)."""
    from custom_calls.triton.activation_kernel import act_quant_kernel, kernel_config
    from custom_calls.triton.permute_kernel import scatter_quant_kernel
    from custom_calls.triton.quant_kernel import per_token_group_quant_kernel

    rows, h, inter = 1152, 4096, 2048
    cfg = kernel_config(inter, "fp8_block", CLAMP)
    kernels = [
        (per_token_group_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "img_ptr": "*fp32"},
         dict(MN=rows, K=h, G=32, IMG_LD=rows, IMG_SLAB=32 * rows, GROUP=128, UE8M0=False, BLOCK_M=4, GROUPS=8,
              ROW_BLOCKS=rows // 4, CHUNKS_FASTEST=True)),
        (scatter_quant_kernel, {"x_ptr": "*bf16", "src2dst_ptr": "*i32", "src1_ptr": "*i32", "lhs_ptr": "*fp8e4nv",
                                "sf_ptr": "*fp32", "src1_out_ptr": "*i32"},
         dict(M=256, H=h, TOPK=6, TOPK_P2=8, R=rows, G=32, GROUP=128, QUANT=True, UE8M0=False, GROUPS=8, TOKENS=4,
              ZERO_FILL=True, ZERO_ROWS=64, ZERO_SUB=4, CHUNKS_FASTEST=True, ROW_SOURCE_OUT=False)),
        (act_quant_kernel, {"y_ptr": "*bf16", "masked_m_ptr": "*i32", "a_ptr": "*fp8e4nv", "img_ptr": "*fp32"},
         dict(MN=rows, I=inter, G=16, IMG_LD=rows, IMG_SLAB=16 * rows, UE8M0=False, MASKED=False,
              ROW_BLOCKS=rows // cfg["BLOCK_M"], CHUNKS_FASTEST=True, **cfg)),
    ]
    for kernel, pointers, constexprs in kernels:
        natural = _compile(kernel, pointers, dict(constexprs, W4A8_ORDER=False), 90)
        ordered = _compile(kernel, pointers, dict(constexprs, W4A8_ORDER=True), 90)
        assert _vector_loads(ordered.asm["ptx"]) == _vector_loads(natural.asm["ptx"]) > 0, kernel.__name__
        _lean(ordered)


def test_w4a8_expand_kernel_compiles_for_sm90():
    """The W4A8 -> FP8 expansion compiles for sm_90a with the GEMMs' byte permutes (prmt), 16-byte stores
    of the widened tile, no spills, in both of its forms."""
    from custom_calls.triton.w4a8_expand_kernel import TILE, w4a8_expand_kernel

    # the contig op's form (W4A8 column order) and the fused layout's (column order, w13's rows interleaved)
    for extra in (dict(COLUMNS=False, GATE_UP=0), dict(COLUMNS=True, GATE_UP=8)):
        sig = {"w_ptr": "*i8", "sw_ptr": "*i32", "out_ptr": "*fp8e4nv", "sf_ptr": "*fp32"}
        c = _compile(w4a8_expand_kernel, sig, dict(N=4096, K=4096, TILE_N=TILE, PRMT=True, **extra), 90)
        ptx = c.asm["ptx"]
        assert "prmt.b32" in ptx and re.search(r"st\.global(?:\.\w+)*\.v4\.", ptx) and c.asm["cubin"], extra
        assert _resources(c)["stack"] == 0, extra


def test_fused_input_kernel_compiles_for_sm90():
    """The fused MoE kernel's input stage (SM90 only, as the kernel it feeds) at the layer's prefill
    and decode tilings: vector loads, e4m3 conversions, 64-bit id stores, the early trigger for a
    programmatically launched fused kernel, no spills."""
    pytest.importorskip("triton")
    from custom_calls.triton.fused_input_kernel import AMAX_FLOOR, fused_input_kernel, heuristic_config
    from layouts import FusedMoEBuffer

    from custom_calls.triton.fused_input_kernel import _NO_ROUTE

    # with the routing epilogue: DeepSeek-V3's grouped sigmoid top-k over 256 experts, 28 partials
    v3 = dict(ROUTE=True, SPLITS=28, E_ROUTE=256, SCORING=1, HAS_BIAS=True, N_GROUP=8, NG_PAD=8, GS_PAD=32,
              TOPK_GROUP=4, RENORM=True)
    for m, route, own in ((128, _NO_ROUTE, False), (4096, _NO_ROUTE, False), (128, v3, False), (128, v3, True),
                          (4096, dict(v3, SPLITS=5), False)):
        buf = FusedMoEBuffer(max_tokens=m, hidden=7168, intermediate=2048, num_experts=32, top_k=8,
                             block_m=64 if m == 128 else 128)
        r, cfg = buf.regions, heuristic_config(m)
        ids_type = "*fp32" if route["ROUTE"] else "*i32"
        c = _compile(fused_input_kernel, {"x_ptr": "*bf16", "ids_ptr": ids_type, "w_ptr": "*fp32", "bias_ptr": "*fp32",
                                          "offset_ptr": "*i32", "buf_ptr": "*u8"},
                     dict(M=m, H=7168, TOPK=8, TOPK_P2=8, E=32, RSF=2.5, FLOOR=AMAX_FLOOR,
                          WORKSPACE_OFF=r["workspace"][0], WORKSPACE_WORDS=r["workspace"][1] // 4,
                          TOKENS_OFF=r["input_tokens"][0], SCALES_OFF=r["input_scales"][0],
                          IDS_OFF=r["input_topk_ids"][0], WEIGHTS_OFF=r["input_topk_weights"][0],
                          BLOCK_M=cfg.block_m, GROUPS=cfg.tile // 128, ROW_BLOCKS=-(-m // cfg.block_m),
                          CHUNKS_FASTEST=cfg.chunks_fastest, ZERO_BLOCK=cfg.zero_block, ROUTE_PROGRAMS=own,
                          TRIGGER=True, **route),
                     90, cfg.num_warps)
        ptx = c.asm["ptx"]
        assert _vector_loads(ptx) > 0 and "e4m3x2" in ptx and re.search(r"st\.global(?:\.\w+)*\.b64", ptx), m
        # the fused kernel's programmatic launch may start once every program has begun
        assert "griddepcontrol.launch_dependents" in ptx
        _lean(c)


def test_router_kernel_compiles_for_sm90_on_tensor_cores():
    """The router GEMM's partials at the decode and prefill tilings: bf16 wgmma/mma (not the fp32
    copies the interpreter runs), loads pipelined through asynchronous copies, no spills."""
    pytest.importorskip("triton")
    from custom_calls.triton.router_kernel import heuristic_config, router_partials_kernel

    for m, e in ((128, 32), (512, 32), (4096, 32), (16384, 32), (128, 256), (4096, 256)):
        cfg = heuristic_config(m, 7168, e)
        c = _compile(router_partials_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32"},
                     dict(M=m, H=7168, E=e, SPLIT_K=cfg.split_k, BLOCK_M=cfg.block_m, BLOCK_E=cfg.block_e,
                          BLOCK_K=cfg.block_k, FP32_DOT=False), 90, cfg.num_warps, cfg.num_stages)
        ptx = c.asm["ptx"]
        assert re.search(r"(wgmma\.mma_async|mma\.sync)\S*\.bf16", ptx), (m, e)
        assert "cp.async" in ptx, (m, e)  # the pipelined loads
        assert c.metadata.shared <= 227 * 1024, (m, e, c.metadata.shared)  # an SM90 block's limit
        if cfg.block_m == 128:  # prefill: a tensor-core tile, not a memory-bound stream
            res = _resources(c)
            assert res["stack"] == 0 and res["reg"] <= 128, (m, e, res)
        else:
            _lean(c)


def test_native_launch_refuses_bad_input(tmp_path, monkeypatch):
    """custom_calls.triton.native names what it cannot take: an operand dtype without a Triton
    pointer type, a grid of no or more than three extents, a call whose operand places do not
    match its operands, constexprs that leave a kernel parameter unset."""
    pytest.importorskip("triton")
    import jax
    import jax.numpy as jnp

    from custom_calls.triton import native
    from custom_calls.triton.router_kernel import router_call, router_partials_kernel

    monkeypatch.setenv("MOE_JAX_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"operand 1: expected a dtype in .*got bool"):
        native.pointer_types([jnp.bfloat16, jnp.bool_])
    cubin = native.TritonCubin("/k.cubin", "k", 4, 0)
    for grid in ((), (1, 1, 1, 1), (4, 0)):
        with pytest.raises(ValueError, match="grid: expected 1 to 3 positive extents"):
            native.kernel_plan(cubin, grid=grid, num_operands=2)
    plan = native.kernel_plan(cubin, grid=(5, 3), num_operands=2, programmatic=True)
    assert (plan.grid, plan.grid_yz, plan.block, plan.programmatic) == (5, (3, 1), 128, True)
    call = router_call(jax.ShapeDtypeStruct((16, 256), jnp.bfloat16), jax.ShapeDtypeStruct((8, 256), jnp.bfloat16))
    with pytest.raises(ValueError, match="moe_router_partials: expected 3 operand places, got 2"):
        native.kernel_plan_for(call, arch=90, operands=(0, 1))
    with pytest.raises(ValueError, match=r"router_partials_kernel: expected a value for each parameter after its 3 "
                       r"array operands.*missing \['BLOCK_E', 'BLOCK_K', 'BLOCK_M', 'FP32_DOT', 'SPLIT_K', 'TRIGGER', "
                       r"'WAIT'\], not parameters there \[\]"):
        native.compile_kernel(router_partials_kernel, dtypes=[jnp.bfloat16] * 2 + [jnp.float32], num_warps=4,
                              arch=90, M=16, H=256, E=8)
    with pytest.raises(ValueError, match="router_partials_kernel: expected at most 13 array operands, got 14"):
        native.compile_kernel(router_partials_kernel, dtypes=[jnp.float32] * 14, num_warps=4, arch=90)
