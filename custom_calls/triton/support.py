"""What the Triton backend can run, answered at trace time without importing triton or jax_triton.

`environment(platform)` says whether the backend can run on this machine at all (a CUDA GPU with
FP8 conversions, the triton and jax_triton packages); the registry asks it once per resolution.
Every `supports_*` takes the op's declared static arguments (as `custom_calls.backends.resolve`
passes them) and returns (ok, reason) from them alone. The reason names the argument or the
missing piece, so an explicit `backend="triton"` that cannot run fails with it.
"""

from __future__ import annotations

import importlib.util

import jax.numpy as jnp

from custom_calls.dispatch_map import contig_capacity
from custom_calls.route_topk import SCORINGS as _SCORING_NAMES
from custom_calls.triton.launch import missing_dependencies
from layouts import FLOAT_DTYPES, ceil_div, get_recipe

SCORINGS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}  # routing epilogue: the kernel's code per scoring
assert set(SCORINGS) == set(_SCORING_NAMES), "a scoring of route_topk has no kernel code"
MAX_EXPERTS = 1024  # routing epilogue: one program holds whole expert rows
MAX_RANK_EXPERTS = 1023  # dispatch ranking: a chunk's one-hot matrix has next_pow2(E + 1) columns
MAX_RANK_CHUNKS = 16384  # dispatch ranking: one program scans the counts of every chunk
MAX_MAP_EXPERTS = 1024  # dispatch maps: a sub-block's one-hot matrix has next_pow2(E) columns
INT32_LIMIT = 2**31  # dispatch maps: routes, rows and slab rows are int32 indices in the kernels
MIN_CAPABILITY = (8, 9)  # e4m3 conversions in hardware (Ada / Hopper and newer)


def environment(platform: str, **_static) -> str:
    """The registry's environment check of backend 'triton': "" when it can run here, else why not.
    Under Triton's interpreter (TRITON_INTERPRET=1, `custom_calls.triton.interpret`) the CPU runs
    the kernels too (slowly; for tests and debugging)."""
    from custom_calls.triton.interpret import interpreting

    if platform == "cpu" and interpreting():
        return "" if importlib.util.find_spec("triton") is not None else "missing Python package triton"
    if platform != "gpu":
        return (f"needs a CUDA GPU, current platform is {platform!r} (TRITON_INTERPRET=1 runs the kernels "
                f"on the CPU in Triton's interpreter, for tests)")
    missing = missing_dependencies()
    if missing:
        return f"missing Python package(s) {missing} (pip install 'moe-jax[gpu]')"
    import jax

    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError as exc:
        return f"no GPU device visible to jax ({exc})"
    cc = getattr(dev, "compute_capability", None)
    if cc is None:
        return f"needs an NVIDIA GPU (CUDA compute capability), got device {dev.device_kind!r}"
    major, minor = (int(v) for v in str(cc).split(".")[:2])
    if (major, minor) < MIN_CAPABILITY:
        return (f"needs compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (FP8 e4m3 "
                f"conversions), device {dev.device_kind!r} has {cc}")
    return ""


def _dtype_reason(name: str, dtype) -> str:
    if dtype is not None and jnp.dtype(dtype) not in FLOAT_DTYPES:
        return f"{name}: expected dtype in (bfloat16, float16, float32), got {jnp.dtype(dtype).name}"
    return ""


def _answer(*reasons: str) -> tuple[bool, str]:
    for r in reasons:
        if r:
            return False, r
    return True, ""


def activation_masked_constraints(*, num_groups: int, m_pad: int, two_i: int, act, recipe: str) -> str:
    """The hard constraints of the masked clamp / SiTU / keep_fp32 act+quant kernel (the same as
    SGLang's masked kernel): N % 4 == 0 (N = m_pad, rows per slab), G % 4 == 0 (G = I / group, scale
    groups per row), D // 8 >= E (D = I, E = num_groups: one thread per 8 columns reads each slab's
    masked_m).
    Returns "" when they hold or do not apply (bf16 recipe; plain silu or swiglu_oai), else the
    violated constraint with its values."""
    constrained = act.kind == "situ" or act.keep_fp32 or (act.kind == "silu" and act.swiglu_limit is not None)
    group = get_recipe(recipe).act_group_size
    if group is None or not constrained:
        return ""
    inter = two_i // 2
    g = ceil_div(inter, group)
    what = f"masked {act.kind} act+quant kernel (swiglu_limit={act.swiglu_limit}, keep_fp32={act.keep_fp32})"
    if m_pad % 4:
        return f"{what}: constraint N % 4 == 0 violated: N = m_pad = {m_pad}"
    if inter % group or g % 4:
        return (f"{what}: constraint G % 4 == 0 violated: G = I / group = {inter} / "
                f"{group} = {inter / group:g}")
    if inter // 8 < num_groups:
        return f"{what}: constraint D // 8 >= E violated: D = I = {inter}, D // 8 = {inter // 8} < E = {num_groups}"
    return ""


def supports_permute_contig(*, dtype, **_static) -> tuple[bool, str]:
    return _answer(_dtype_reason("x", dtype))


def supports_permute_masked(*, dtype, **_static) -> tuple[bool, str]:
    return _answer(_dtype_reason("x", dtype))


def supports_activation_contig(*, dtype, **_static) -> tuple[bool, str]:
    return _answer(_dtype_reason("gateup", dtype))


def supports_activation_masked(*, num_groups: int, m_pad: int, two_i: int, act, recipe: str, dtype,
                               **_static) -> tuple[bool, str]:
    return _answer(activation_masked_constraints(num_groups=num_groups, m_pad=m_pad, two_i=two_i,
                                                 act=act, recipe=recipe),
                   _dtype_reason("gateup", dtype))


def supports_unpermute(**_static) -> tuple[bool, str]:
    return True, ""


def supports_w4a8_masked(*, k: int, recipe: str, arch: int, **_static) -> tuple[bool, str]:
    """Backend "w4a8": recipe mxfp4 on arch 90 in its 4-bit form (`layouts.w4a8`), K a multiple of 128
    (one block scale word per 128 columns)."""
    if (recipe, arch) != ("mxfp4", 90):
        return False, (f"the w4a8 backend runs the W4A8 kernels only (recipe 'mxfp4' on arch 90, weights kept "
                       f"4-bit); got recipe {recipe!r} on arch {arch} (the DeepGEMM backend runs it)")
    return _answer(f"k: the W4A8 kernel needs K a multiple of 128, got {k}" if k % 128 else "")


def supports_w4a8_contig(*, k: int, recipe: str, arch: int, alignment: int, **_static) -> tuple[bool, str]:
    """As `supports_w4a8_masked`, and row blocks of 64 or 128 (the kernel's token tile divides them)."""
    ok, reason = supports_w4a8_masked(k=k, recipe=recipe, arch=arch)
    if ok and alignment % 64:
        return False, f"alignment: the W4A8 contig kernel needs a multiple of 64, got {alignment}"
    return ok, reason


def rank_chunk_size(num_experts: int) -> int:
    """Routes per program of the dispatch ranking kernels for E = num_experts: a power of two in
    [16, 1024] with CHUNK x next_pow2(E + 1) <= 8192 where possible (the one-hot matrix)."""
    e_pad = 1 << num_experts.bit_length()  # next power of two above num_experts
    return max(16, min(1024, 1 << max(0, (8192 // e_pad).bit_length() - 1)))


def supports_rank_within_expert(*, num_routes: int, num_experts: int) -> tuple[bool, str]:
    reason = ""
    if num_experts > MAX_RANK_EXPERTS:
        reason = f"num_experts: at most {MAX_RANK_EXPERTS} local experts, got {num_experts}"
    elif num_routes > MAX_RANK_CHUNKS * rank_chunk_size(num_experts):
        reason = (f"num_routes: at most {MAX_RANK_CHUNKS * rank_chunk_size(num_experts)} routes (M * top_k) "
                  f"for {num_experts} local experts, got {num_routes}")
    return _answer(reason)


def supports_route_topk(*, num_experts: int, top_k: int, scoring: str, n_group: int,
                        topk_group: int) -> tuple[bool, str]:
    return _answer(route_topk_reason(num_experts, top_k, scoring, n_group, topk_group))


def _next_pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


def route_row_width(num_experts: int, n_group: int = 1) -> int:
    """Register columns of one token's row in the routing epilogue: n_group groups of E / n_group
    experts, each padded to a power of two, the group count padded to a power of two (no padding
    for DeepSeek-V3's 8 x 32; E alone rounded up to a power of two without groups)."""
    g = max(1, n_group)
    return _next_pow2(g) * _next_pow2(num_experts // g)


def route_topk_reason(num_experts: int, top_k: int, scoring: str, n_group: int, topk_group: int) -> str:
    """Why the Triton routing epilogue (`route_topk`) cannot serve these routing settings, "" when it
    can. Any n_group dividing E: with E <= MAX_EXPERTS a token's padded row (`route_row_width`, a
    product of two powers of two below 2 x n_group and 2 x E / n_group) has at most 2048 columns."""
    if scoring not in SCORINGS:
        return f"scoring: expected one of {tuple(SCORINGS)}, got {scoring!r}"
    if not 1 <= num_experts <= MAX_EXPERTS:
        return f"num_experts: expected 1..{MAX_EXPERTS}, got {num_experts}"
    if not 1 <= top_k <= num_experts:
        return f"top_k: expected 1..{num_experts}, got {top_k}"
    if n_group > 1:
        if num_experts % n_group:
            return f"n_group: expected a divisor of num_experts = {num_experts}, got {n_group}"
        if not 1 <= topk_group <= n_group:
            return f"topk_group: expected 1..{n_group}, got {topk_group}"
    return ""


def dispatch_map_reason(num_routes: int, num_experts: int, num_rows: int = 0) -> str:
    """Why the Triton dispatch-map kernels (`custom_calls.triton.dispatch_map_kernel`) cannot serve
    these sizes, "" when they can: at most MAX_MAP_EXPERTS local experts; routes and the rows of
    the grouped layout (num_rows: contig capacity or E_local x m_pad) are int32 indices."""
    if num_experts > MAX_MAP_EXPERTS:
        return f"num_experts: at most {MAX_MAP_EXPERTS} local experts, got {num_experts}"
    if num_routes >= INT32_LIMIT:
        return f"num_routes: expected fewer than 2**31 routes (M * top_k), got {num_routes}"
    if num_rows >= INT32_LIMIT:
        return f"rows of the grouped layout: expected fewer than 2**31 (int32 row indices), got {num_rows}"
    return ""


def supports_dispatch_map_contig(*, num_routes: int, num_experts: int, alignment: int) -> tuple[bool, str]:
    # the capacity depends on M * k = num_routes only
    return _answer(dispatch_map_reason(num_routes, num_experts, contig_capacity(num_routes, 1, num_experts, alignment)))


def supports_dispatch_map_masked(*, num_routes: int, num_experts: int, m_pad: int) -> tuple[bool, str]:
    return _answer(dispatch_map_reason(num_routes, num_experts, num_experts * m_pad))
