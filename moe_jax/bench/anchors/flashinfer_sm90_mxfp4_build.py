"""FlashInfer's SM90 CUTLASS fused-MoE JIT module built with only its MXFP4 kernels (anchor helper).

Used by ``flashinfer_mxfp4.py --mxfp4-only`` (this folder; never imported by moe_jax). Written against
flashinfer-python 0.7.2.post1, which it changes at run time only (no FlashInfer file is modified).

Why: FlashInfer compiles its SM90 fused-MoE module from 248 nvcc units (220 generated CUTLASS kernel
files holding 1738 launchers, plus 28 fixed sources), about 7 CPU-hours, and its generator takes no
option that narrows them. The anchor's two modes reach 242 of those launchers: both runners dispatch
through ``sm90_dispatch_moe_mixed_dtype_gemm_to_cutlass``, whose autotuner candidates are the 29
grouped weight-only tiles x 4 cluster shapes with one mainloop schedule per tile (cooperative where the
tile supports it, else ping-pong) for

* ``w4a16``: bf16 activations x MXFP4 weights -> bf16, scales applied after the MMA;
* ``humming`` (the anchor's ``w4a8``): e4m3 activations x MXFP4 weights -> bf16, E8M0 scales applied
  before the MMA, plus its 10 single-warp-group small-K launchers.

Those are 31 generated files; with the 16 fixed sources the two runners need and one file of stubs,
48 units, about a fifth of the build.

`install` swaps FlashInfer's kernel list for that subset while the module's build spec is generated,
gives the module a name of its own (its own cache directory), drops the 12 fixed
``moe_gemm_kernels_<act>_<weight>.cu`` sources of other type pairs (they take the address of launchers
that are no longer compiled, which would fail when the library is opened), and adds a source of
throwing stubs for every MXFP4 launcher the dispatch names but that is not compiled (the other
schedule of each tile, cluster shapes left out): a tactic that reaches one raises, and FlashInfer's
autotuner skips tactics that raise. The launchers of other type pairs that stay undefined are reached
only through direct calls, which the dynamic loader binds lazily (tvm-ffi opens modules with
RTLD_LAZY; ``-Wl,-z,lazy`` is added to the link); the full upstream module already relies on that.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from itertools import product

ALL_CLUSTERS = ((1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1))
MODES = ("w4a16", "humming")
MODULE_NAME = "fused_moe_90_mxfp4only"

# fixed sources of type pairs the two runners do not use
OTHER_PAIR_SOURCES = frozenset(f"moe_gemm_kernels_{pair}.cu" for pair in (
    "fp8_uint4", "fp8_fp8", "fp4_fp4", "fp32_fp32", "fp16_uint8", "fp16_uint4", "fp16_fp16", "fp16_fp4",
    "bf16_uint8", "bf16_uint4", "bf16_fp8", "bf16_bf16"))

# the 29 grouped weight-only tiles FlashInfer's SM90 heuristic enumerates (M, N, K)
TILES = tuple([(64, n, k) for n in (16, 32, 64, 128) for k in (128, 256, 512)]
              + [(128, n, k) for n in (16, 32, 64, 128) for k in (128, 256, 512)]
              + [(128, 256, 128), (128, 256, 256), (256, 128, 128), (256, 128, 256), (256, 256, 128)])


def cooperative(tile: tuple[int, int, int]) -> bool:
    """Whether FlashInfer's SM90 heuristic schedules this tile cooperatively (else ping-pong)."""
    m, n, k = tile
    if m == 128:
        return k in (128, 256, 512) if n in (16, 32, 64) else k in (128, 256)
    if m == 256:
        return k in (128, 256) if n == 128 else k == 128
    return False


def _mode(op, gen) -> str | None:
    """'w4a16' / 'humming' for the bf16-output MXFP4 grouped launchers of the two runners, else None."""
    if not (op.gemm_kind == gen.GemmKind.Grouped and op.arch == 90 and op.weight_type is gen.e2m1
            and op.output_type == gen.DataType.bf16):
        return None
    if op.act_type == gen.DataType.bf16 and op.mixed_input_scale_mode == "post_mma":
        return "w4a16"
    if op.act_type == gen.DataType.e4m3 and op.mixed_input_scale_mode == "pre_mma_e8m0":
        return "humming"
    return None


def _compiled(op, gen, modes, clusters) -> bool:
    """Whether launcher `op` is one the autotuner can pick for `modes` within `clusters`."""
    mode = _mode(op, gen)
    if mode not in modes:
        return False
    if op.sm90_mixed_input_kernel_type != "warp_specialized":
        return mode == "humming"  # the small-K single-warp-group launchers (cluster 1x1x1)
    if tuple(op.cga_shape) not in clusters:
        return False
    want = (gen.KernelScheduleType.TmaWarpSpecializedCooperative if cooperative(tuple(op.cta_shape))
            else gen.KernelScheduleType.TmaWarpSpecializedPingpong)
    return op.mainloop_schedule == want


def _dispatched(gen, modes) -> list:
    """Every warp-specialized launcher the mixed-input dispatch names for `modes`: each tile x 4
    clusters x ping-pong, and cooperative where the tile's M is at least 128."""
    ops = []
    for mode, act, scale_mode in (("w4a16", gen.DataType.bf16, "post_mma"),
                                  ("humming", gen.DataType.e4m3, "pre_mma_e8m0")):
        if mode not in modes:
            continue
        for tile, cga in product(TILES, ALL_CLUSTERS):
            schedules = [gen.KernelScheduleType.TmaWarpSpecializedPingpong]
            if tile[0] >= 128:
                schedules.append(gen.KernelScheduleType.TmaWarpSpecializedCooperative)
            for schedule in schedules:
                ops.append(gen.TrtLlm_GemmLauncher(
                    gen.GemmKind.Grouped, 90, act, gen.e2m1, gen.DataType.ue8m0, gen.DataType.bf16,
                    gen.DataType.bf16, gen.TrtLlm_QuantOp.finegrained_scale_only,
                    gen.TrtLlm_EpilogueTag.epilogue_op_default, tile, [0, 0, 0], 0, cga, schedule,
                    gen.EpilogueScheduleType.TmaWarpSpecializedCooperative, mixed_input_scale_mode=scale_mode))
    return ops


def _stub_source(gen, ops) -> str:
    """Explicit specializations that throw, one per launcher in `ops`, from FlashInfer's own
    instantiation text of each."""
    body = []
    for op in ops:
        inst = gen.instantiate_operation(op).strip()
        if not (inst.startswith("template void ") and inst.endswith(");")):
            raise RuntimeError(f"unexpected instantiation text from FlashInfer's generator: {inst[:120]!r}")
        body.append("template <> void " + inst[len("template void "):-2]
                    + ") {\n  TLLM_THROW(\"MXFP4-only FlashInfer build: tactic not compiled\");\n}\n")
    includes = ("cutlass/gemm/dispatch_policy.hpp", "cutlass/epilogue/dispatch_policy.hpp",
                "cutlass_extensions/epilogue_helpers.h", "cutlass_extensions/gemm_configs.h",
                "tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/moe_gemm_tma_ws_mixed_input_launcher.h",
                "tensorrt_llm/common/assert.h")
    return ("// Throwing stubs for the MXFP4 launchers an MXFP4-only build leaves out\n"
            + "".join(f'#include "{h}"\n' for h in includes)
            + "namespace tensorrt_llm {\nnamespace kernels {\nnamespace cutlass_kernels_oss {\n"
            + "using SafeFP4 = tensorrt_llm::kernels::cutlass_kernels::Fp4Type;\n\n" + "\n".join(body)
            + "}  // namespace cutlass_kernels_oss\n}  // namespace kernels\n}  // namespace tensorrt_llm\n")


def _write_if_changed(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def install(*, modes: tuple[str, ...] = MODES, clusters: tuple = ALL_CLUSTERS, prebuilt: bool = False) -> str:
    """Make FlashInfer build (or load) its SM90 fused-MoE module with only the MXFP4 kernels of `modes`
    (a subset of MODES) in `clusters` (a subset of ALL_CLUSTERS; the others become throwing stubs).
    Call after ``import flashinfer.fused_moe`` and before the module is first requested. prebuilt:
    load ``<module>.so`` where FlashInfer keeps it without running its build (a module built elsewhere
    with the same FlashInfer; a missing file still builds). Returns the module's name."""
    import flashinfer.fused_moe.core as core
    import flashinfer.jit.env as jit_env
    import flashinfer.jit.fused_moe as jit_fused_moe
    import flashinfer.jit.gemm.cutlass.generate_kernels as gen

    clusters = tuple(tuple(c) for c in clusters)
    if not modes or not set(modes) <= set(MODES):
        raise ValueError(f"modes: expected a non-empty subset of {MODES}, got {modes!r}")
    modes = tuple(m for m in MODES if m in modes)
    if not clusters or not set(clusters) <= set(ALL_CLUSTERS):
        raise ValueError(f"clusters: expected a subset of {ALL_CLUSTERS}, got {clusters!r}")
    name = MODULE_NAME + ("" if modes == MODES else "_" + modes[0])
    if set(clusters) != set(ALL_CLUSTERS):
        name += "_c" + "_".join("%dx%d" % c[:2] for c in sorted(clusters))

    current = core.gen_cutlass_fused_moe_sm90_module
    upstream = getattr(current, "upstream", current)  # installing twice wraps FlashInfer's function once
    upstream_sm90_ops, upstream_sm80_ops = gen.generate_sm90_operations, gen.generate_sm80_operations

    def sm90_ops(is_arch_enabled):
        return [op for op in upstream_sm90_ops(is_arch_enabled) if _compiled(op, gen, modes, clusters)]

    @functools.wraps(upstream)
    def gen_module(use_fast_build: bool = False):
        gen_root = jit_env.FLASHINFER_GEN_SRC_DIR
        gen.generate_sm90_operations, gen.generate_sm80_operations = sm90_ops, lambda is_arch_enabled: []
        # a generated-source directory per module: the generator deletes the files it did not write
        jit_env.FLASHINFER_GEN_SRC_DIR = gen_root / name
        try:
            spec = upstream(use_fast_build)
        finally:
            jit_env.FLASHINFER_GEN_SRC_DIR = gen_root
            gen.generate_sm90_operations, gen.generate_sm80_operations = upstream_sm90_ops, upstream_sm80_ops
        compiled = {repr(op) for op in sm90_ops(True)}
        stubbed = [op for op in _dispatched(gen, modes) if repr(op) not in compiled]
        sources = [s for s in spec.sources if os.path.basename(str(s)) not in OTHER_PAIR_SOURCES]
        if stubbed:
            stub = gen_root / name / "mxfp4_launcher_stubs.cu"
            _write_if_changed(stub, _stub_source(gen, stubbed))
            sources.append(stub)
        spec = dataclasses.replace(spec, name=name, sources=sources,
                                   extra_ldflags=list(spec.extra_ldflags or []) + ["-Wl,-z,lazy"])
        if prebuilt and spec.jit_library_path.exists():
            spec.build = lambda *args, **kwargs: None
        return spec

    gen_module.upstream = upstream
    core.gen_cutlass_fused_moe_sm90_module = gen_module
    jit_fused_moe.gen_cutlass_fused_moe_sm90_module = gen_module
    core.get_cutlass_fused_moe_module.cache_clear()
    return name
