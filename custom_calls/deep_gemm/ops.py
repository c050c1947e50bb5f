"""DeepGEMM GEMMs as jit-able ops: grouped contiguous / masked (FP8 1D2D and BF16 on SM90; FP8/FP4
1D1D on SM100), dense FP8 / BF16 ``gemm_nt`` and the TF32 prenorm GEMM.

At trace time an op checks its operands, decides the kernel family from the GEMM format
(families.py), lets the family pick and generate the instantiation (its module: config, source,
launch plan), compiles it once (compiler.py, disk-cached) and emits one XLA custom call of the
native launcher (`custom_calls.native.launch`). Each op has a ``supports_*`` twin returning
``(ok, reason)``; an op that cannot run raises ValueError with that reason. The registry gets the
grouped GEMMs' shape rules (``static_supports_*``), this machine's ``environment`` check, and the
unchecked implementations (``contig_impl``, ``masked_impl``) that trust what ``resolve`` accepted;
``m_grouped_gemm_*`` here are the checked forms for direct callers. Operand formats:
``layouts.gemm_format(recipe, arch)``.

Output contracts:
* contig: the kernels take a block's expert from its first row's id. ``m_indices`` reaches them
  canonicalized (``custom_calls.contracts.canonical_m_indices``: a block that is not one expert id
  in [0, G) followed by -1 padding is all -1), so no id >= G is ever read (the FP8 kernel offsets
  its raw B-scale pointer by it) and every backend treats a broken block as padding. Rows whose id
  is -1 are computed from lhs's rows there (or stored as zeros by the FP8 kernel when a whole
  64-row slice starts with -1); with zero lhs padding rows, which the permute op guarantees, they
  come out 0 (NaN where the block's expert has a non-finite weight scale). No extra pass zeroes them.
* masked: rows >= masked_m[g] are unspecified. ``masked_m`` reaches the kernel clamped to [0, m_pad]
  (``custom_calls.contracts.canonical_masked_m``), so an out-of-range count can never make the
  kernel touch another group's slab.
* SM100 (arch 100): instantiations are generated and compiled for sm_100a and their launch geometry
  is unit-tested, but this project has not run them on SM100 hardware; on an SM100 device they run
  only with ``KernelSettings(allow_unverified_sm100=True)`` (default: $MOE_JAX_DEEP_GEMM_SM100=1).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from custom_calls.contracts import canonical_m_indices, canonical_masked_m
from custom_calls.grouped_gemm import check_contig, check_masked
from custom_calls.native import toolchain
from custom_calls.native.launch import launch
from custom_calls.native.toolchain import detected_device
from custom_calls.settings import KernelSettings, resolve_settings
from layouts import GemmFormat, SUPPORTED_ARCHS, gemm_format
from layouts.checks import check_dtype, check_rank, check_shape, check_static_int

from custom_calls.native import compiler

from . import autotune
from .families import FAMILIES, family_for, gemm_problem, unserved_reason
from .family import CONTIG_ALIGNMENT, Kernel, instantiate
from .sm90_prenorm import ARCH as PRENORM_ARCH, prenorm_kernel, sm90_prenorm_config

BACKEND = "deep_gemm"
SM100_NOTE = "arch 100 kernels are compiled for sm_100a but have not been run on SM100 hardware by this project"


# --- environment --------------------------------------------------------------------------------

def _environment_reason(arch: int, settings: KernelSettings) -> str | None:
    """Why the DeepGEMM kernels cannot run here for ``arch`` under ``settings``; None when they can."""
    if arch not in SUPPORTED_ARCHS:
        return f"arch: expected one of {SUPPORTED_ARCHS}, got {arch!r}"
    try:
        toolchain.deep_gemm_include_dir()
        toolchain.find_nvcc()
    except toolchain.ToolchainError as e:
        return str(e)
    platform, detected, sms = detected_device()
    if detected is None:
        return f"no CUDA device (jax platform {platform!r}); the DeepGEMM kernels need an SM90 GPU"
    if detected // 10 != arch // 10:
        extra = f"; {SM100_NOTE}" if arch == 100 else ""
        return (f"arch {arch} requested but the detected device has compute capability "
                f"{detected // 10}.{detected % 10}{extra}")
    if not (settings.num_sms or sms):
        return "the device does not report its SM count (set KernelSettings.num_sms or $MOE_JAX_NUM_SMS)"
    if arch // 10 == 10 and not settings.allow_unverified_sm100:
        return (f"{SM100_NOTE}; KernelSettings(allow_unverified_sm100=True) (default: "
                "$MOE_JAX_DEEP_GEMM_SM100=1) runs them anyway")
    return None


def environment(platform: str, *, arch: int, settings: KernelSettings | None = None, **_static: Any) -> str:
    """The registry's environment check of backend 'deep_gemm': "" when its kernels can run here
    for ``arch`` (compiler, kernel sources, a device of that family), else why not."""
    return _environment_reason(arch, resolve_settings(settings)) or ""


def _num_sms(settings: KernelSettings) -> int:
    """The SM count the kernels are planned for: the setting's, else the device's."""
    return settings.num_sms or detected_device()[2]


def _check_backend(backend: str | None) -> None:
    if backend not in (None, BACKEND):
        raise ValueError(f"backend: this module implements {BACKEND!r}, got {backend!r} "
                         "(use custom_calls.m_grouped_gemm_* to choose a backend)")


def _raise_unless(ok_reason: tuple[bool, str]) -> None:
    ok, reason = ok_reason
    if not ok:
        raise ValueError(f"backend 'deep_gemm' cannot run this GEMM: {reason}")


# --- static shape rules (shared by supports_* and the ops) -----------------------------------

def _cd_dtype(out_dtype: Any) -> str:
    """The family option naming ``out_dtype`` (anything not bf16 is checked as f32)."""
    return "bf16" if jnp.dtype(out_dtype) == jnp.bfloat16 else "f32"


def _bf16_dtypes_reason(fmt: GemmFormat, lhs_dtype: Any, rhs_dtype: Any) -> str | None:
    if fmt.is_quantized:
        return None
    for name, dt in (("lhs", lhs_dtype), ("rhs", rhs_dtype)):  # the BF16 kernel reads bfloat16 operands only
        if dt is not None and jnp.dtype(dt) != jnp.bfloat16:
            return f"{name}: the BF16 kernel needs dtype bfloat16, got {jnp.dtype(dt).name}"
    return None


def _grouped_reason(kind: str, rows: int, n: int, k: int, num_groups: int, recipe: str, arch: int,
                    alignment: int = CONTIG_ALIGNMENT, lhs_dtype: Any = None, rhs_dtype: Any = None) -> str | None:
    try:
        fmt = gemm_format(recipe, arch)
    except ValueError as e:
        return str(e)
    family = family_for(fmt)
    if family is None:
        return unserved_reason(fmt)
    reason = _bf16_dtypes_reason(fmt, lhs_dtype, rhs_dtype)
    if reason:
        return reason
    if kind == "contig" and alignment != CONTIG_ALIGNMENT:
        return f"alignment must be {CONTIG_ALIGNMENT} (the kernels' BLOCK_M), got {alignment}"
    if kind == "contig" and rows % CONTIG_ALIGNMENT:
        return f"M_cap must be a multiple of {CONTIG_ALIGNMENT}, got {rows}"
    if kind == "masked" and rows % 128:
        return f"m_pad must be a multiple of 128, got {rows}"
    if num_groups < 1:
        return f"num_groups must be >= 1, got {num_groups}"
    if n <= 0 or n % 64:
        return f"N must be a positive multiple of 64, got {n}"
    if k <= 0 or k % family.block_k:
        return f"K must be a positive multiple of {family.block_k} for recipe {recipe!r}, got {k}"
    return None


def _answer(reason: str | None) -> tuple[bool, str]:
    return (reason is None, reason or "")


def static_supports_contig(*, m_cap: int, n: int, k: int, num_groups: int, recipe: str, arch: int,
                           alignment: int = CONTIG_ALIGNMENT, lhs_dtype: Any = None, rhs_dtype: Any = None,
                           settings: KernelSettings | None = None) -> tuple[bool, str]:
    """The contig GEMM's shape rules alone (the registry asks `environment` separately)."""
    del settings  # no shape rule depends on it
    return _answer(_grouped_reason("contig", m_cap, n, k, num_groups, recipe, arch, alignment, lhs_dtype, rhs_dtype))


def static_supports_masked(*, num_groups: int, m_pad: int, n: int, k: int, expected_m: int, recipe: str,
                           arch: int, lhs_dtype: Any = None, rhs_dtype: Any = None,
                           settings: KernelSettings | None = None) -> tuple[bool, str]:
    """The masked GEMM's shape rules alone (the registry asks `environment` separately)."""
    del settings, expected_m  # no shape rule depends on them
    return _answer(_grouped_reason("masked", m_pad, n, k, num_groups, recipe, arch, lhs_dtype=lhs_dtype,
                                   rhs_dtype=rhs_dtype))


def supports_m_grouped_gemm_contig(*, m_cap: int, n: int, k: int, num_groups: int, recipe: str, arch: int,
                                   alignment: int = CONTIG_ALIGNMENT, lhs_dtype: Any = None,
                                   rhs_dtype: Any = None, settings: KernelSettings | None = None) -> tuple[bool, str]:
    """(ok, reason) for ``m_grouped_gemm_contig`` with these static arguments on this machine."""
    ok, reason = static_supports_contig(m_cap=m_cap, n=n, k=k, num_groups=num_groups, recipe=recipe, arch=arch,
                                        alignment=alignment, lhs_dtype=lhs_dtype, rhs_dtype=rhs_dtype)
    return (ok, reason) if not ok else _answer(_environment_reason(arch, resolve_settings(settings)))


def supports_m_grouped_gemm_masked(*, m_pad: int, n: int, k: int, num_groups: int, recipe: str, arch: int,
                                   expected_m: int = 1, lhs_dtype: Any = None,
                                   rhs_dtype: Any = None, settings: KernelSettings | None = None) -> tuple[bool, str]:
    """(ok, reason) for ``m_grouped_gemm_masked`` with these static arguments on this machine."""
    ok, reason = static_supports_masked(num_groups=num_groups, m_pad=m_pad, n=n, k=k, expected_m=expected_m,
                                        recipe=recipe, arch=arch, lhs_dtype=lhs_dtype, rhs_dtype=rhs_dtype)
    return (ok, reason) if not ok else _answer(_environment_reason(arch, resolve_settings(settings)))


def _dense_reason(n: int, k: int, recipe: str, arch: int, out_dtype: Any = jnp.bfloat16,
                  lhs_dtype: Any = None, rhs_dtype: Any = None) -> str | None:
    try:
        fmt = gemm_format(recipe, arch)
    except ValueError as e:
        return str(e)
    family = family_for(fmt)
    if family is None or not family.dense:
        dense = ", ".join(f"{f.name} ({'/'.join(f.recipes)} on arch {'/'.join(map(str, f.archs))})"
                          for f in FAMILIES if f.dense)
        return f"dense GEMMs are wired for the kernel families {dense} only, got {fmt.describe()}"
    if fmt.is_quantized and fmt.weight_block != (128, 128):
        return f"the dense FP8 kernel reads 128x128 weight blocks, got {fmt.describe()}"
    reason = _bf16_dtypes_reason(fmt, lhs_dtype, rhs_dtype)
    if reason:
        return reason
    if n <= 0 or n % 64:
        return f"N must be a positive multiple of 64, got {n}"
    if k <= 0 or k % family.block_k:
        return f"K must be a positive multiple of {family.block_k}, got {k}"
    if _cd_dtype(out_dtype) not in family.cd_dtypes:
        return (f"the {family.name} kernel writes {' or '.join(family.cd_dtypes)} only, got "
                f"out_dtype={jnp.dtype(out_dtype).name}")
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"out_dtype must be bf16 or f32, got {jnp.dtype(out_dtype).name}"
    return None


def static_supports_gemm_nt(*, m: int, n: int, k: int, recipe: str, arch: int, lhs_dtype: Any = None,
                            rhs_dtype: Any = None, settings: KernelSettings | None = None) -> tuple[bool, str]:
    """The dense GEMM's shape rules alone, for the registry's op ``gemm_nt`` (bf16 output)."""
    del m, settings  # any row count; no shape rule depends on the settings
    return _answer(_dense_reason(n, k, recipe, arch, lhs_dtype=lhs_dtype, rhs_dtype=rhs_dtype))


def supports_gemm_nt(*, n: int, k: int, recipe: str, arch: int, out_dtype: Any = jnp.bfloat16,
                     settings: KernelSettings | None = None, **_unused: Any) -> tuple[bool, str]:
    """(ok, reason) for the dense ``gemm_nt_fp8`` (recipe 'fp8_block') / ``gemm_nt_bf16`` ('bf16')."""
    return _answer(_dense_reason(n, k, recipe, arch, out_dtype)
                   or _environment_reason(arch, resolve_settings(settings)))


def supports_tf32_prenorm_gemm(*, n: int, k: int, num_splits: int = 1, arch: int = 90,
                               settings: KernelSettings | None = None, **_unused: Any) -> tuple[bool, str]:
    """(ok, reason) for ``tf32_prenorm_gemm`` with these static arguments on this machine (an SM90
    kernel by nature: arch defaults to 90, anything else is refused)."""
    reason = None
    if arch != PRENORM_ARCH:
        reason = f"the prenorm GEMM is wired for arch {PRENORM_ARCH} only, got {arch}"
    else:
        try:
            sm90_prenorm_config(n, k, num_splits)
        except ValueError as e:
            reason = str(e)
    reason = reason or _environment_reason(arch, resolve_settings(settings))
    return (reason is None, reason or "")


# --- kernel selection (also used by warmup) -----------------------------------------------------

def grouped_kernel(kind: str, rows: int, n: int, k: int, num_groups: int, recipe: str, arch: int,
                   num_sms: int, expected_m: int | None = None, tuning: autotune.TuningPolicy | None = None) -> Kernel:
    """(name, source, plan_fn) for a grouped GEMM; plan_fn(cubin_path) -> LaunchPlan.

    expected_m (masked only; None = rows) is clamped to [1, rows] (`families.gemm_problem`), so the
    op and the warm-up pick the same tile for the same hint. tuning: how SM90 picks its config
    (None: DeepGEMM's heuristic; the ops pass `KernelSettings.gemm_tuning`; see autotune.py).
    """
    return instantiate(gemm_problem(kind, rows, n, k, num_groups, recipe, arch, expected_m), num_sms, tuning)


def dense_kernel(m: int, n: int, k: int, recipe: str, arch: int, out_dtype: Any, num_sms: int) -> Kernel:
    """(name, source, plan_fn) for a dense GEMM (a: (m, k), b: (n, k) -> (m, n) out_dtype); always
    the heuristic's config (tuned configs cover the grouped GEMMs)."""
    return instantiate(gemm_problem("normal", m, n, k, 1, recipe, arch, cd_dtype=_cd_dtype(out_dtype)), num_sms)


def _tuning(settings: KernelSettings) -> autotune.TuningPolicy:
    return autotune.TuningPolicy(mode=settings.gemm_tuning)


def _run(kernel, arch: int, inputs, outputs, settings: KernelSettings):
    name, src, plan_fn = kernel
    cubin = compiler.compile_cubin(name, src, arch)
    return launch(plan_fn(str(cubin.path)), inputs, outputs, command_buffer=settings.command_buffer)


# --- the grouped GEMMs ----------------------------------------------------------------------

def _operands(lhs, rhs, lhs_scale, rhs_scale, layout_arr):
    if lhs_scale is None:
        return [lhs, rhs, layout_arr]
    return [lhs, rhs, lhs_scale, rhs_scale, layout_arr]


def contig_impl(lhs: jax.Array, rhs: jax.Array, m_indices: jax.Array, *, lhs_scale: jax.Array | None,
                rhs_scale: jax.Array | None, recipe: str, arch: int, alignment: int,
                settings: KernelSettings) -> jax.Array:
    """The registered contig GEMM: operands already checked and accepted by ``resolve``, m_indices
    canonicalized (``canonical_m_indices``)."""
    m_cap, k = lhs.shape
    g, n = rhs.shape[:2]
    if m_cap == 0:
        return jnp.zeros((0, n), jnp.bfloat16)
    kern = grouped_kernel("contig", m_cap, n, k, g, recipe, arch, _num_sms(settings), tuning=_tuning(settings))
    (out,) = _run(kern, arch, _operands(lhs, rhs, lhs_scale, rhs_scale, m_indices),
                  [jax.ShapeDtypeStruct((m_cap, n), jnp.bfloat16)], settings)
    return out


def masked_impl(lhs: jax.Array, rhs: jax.Array, masked_m: jax.Array, *, expected_m: int,
                lhs_scale: jax.Array | None, rhs_scale: jax.Array | None, recipe: str, arch: int,
                settings: KernelSettings) -> jax.Array:
    """The registered masked GEMM: operands already checked and accepted by ``resolve``, masked_m
    clamped to [0, m_pad] (``canonical_masked_m``)."""
    g, m_pad, k = lhs.shape
    n = rhs.shape[1]
    if m_pad == 0:
        return jnp.zeros((g, 0, n), jnp.bfloat16)
    kern = grouped_kernel("masked", m_pad, n, k, g, recipe, arch, _num_sms(settings), expected_m=expected_m,
                          tuning=_tuning(settings))
    (out,) = _run(kern, arch, _operands(lhs, rhs, lhs_scale, rhs_scale, masked_m),
                  [jax.ShapeDtypeStruct((g, m_pad, n), jnp.bfloat16)], settings)
    return out


def m_grouped_gemm_contig(lhs: jax.Array, rhs: jax.Array, m_indices: jax.Array, *,
                          lhs_scale: jax.Array | None = None, rhs_scale: jax.Array | None = None,
                          recipe: str, arch: int, alignment: int = CONTIG_ALIGNMENT,
                          backend: str | None = None, settings: KernelSettings | None = None) -> jax.Array:
    """Contiguous grouped GEMM D[r] = lhs[r] · rhs[m_indices[r]]ᵀ on DeepGEMM's kernels (checked form).

    lhs: (M_cap, K) e4m3 | bf16, M_cap % 128 == 0, every expert segment starting at a multiple of 128;
    rhs: (G, N, K) e4m3 | bf16 [(G, N, K//2) int8 e2m1 pairs for mxfp4]; m_indices: (M_cap,) int32,
    -1 = padding (canonicalized as ``custom_calls.m_grouped_gemm_contig`` does); scales as
    ``layouts.gemm_format(recipe, arch)`` states -> (M_cap, N) bf16. settings: `KernelSettings`
    (None: the environment's defaults when traced).
    """
    _check_backend(backend)
    settings = resolve_settings(settings)
    fmt = gemm_format(recipe, arch)
    m_cap, k, g, n = check_contig(lhs, rhs, m_indices, lhs_scale, rhs_scale, fmt, alignment)
    _raise_unless(supports_m_grouped_gemm_contig(m_cap=m_cap, n=n, k=k, num_groups=g, recipe=recipe,
                                                 arch=arch, alignment=alignment, lhs_dtype=lhs.dtype,
                                                 rhs_dtype=rhs.dtype, settings=settings))
    return contig_impl(lhs, rhs, canonical_m_indices(m_indices, g, alignment), lhs_scale=lhs_scale,
                       rhs_scale=rhs_scale, recipe=recipe, arch=arch, alignment=alignment, settings=settings)


def m_grouped_gemm_masked(lhs: jax.Array, rhs: jax.Array, masked_m: jax.Array, *, expected_m: int,
                          lhs_scale: jax.Array | None = None, rhs_scale: jax.Array | None = None,
                          recipe: str, arch: int, backend: str | None = None,
                          settings: KernelSettings | None = None) -> jax.Array:
    """Masked grouped GEMM D[g, r] = lhs[g, r] · rhs[g]ᵀ for r < masked_m[g] on DeepGEMM's kernels
    (checked form).

    lhs: (G, m_pad, K) e4m3 | bf16, m_pad % 128 == 0; rhs: (G, N, K); masked_m: (G,) int32 (clamped to
    [0, m_pad]); expected_m: static hint for the tile choice -> (G, m_pad, N) bf16, rows >= masked_m[g]
    unspecified. settings: as for the contig GEMM.
    """
    _check_backend(backend)
    settings = resolve_settings(settings)
    fmt = gemm_format(recipe, arch)
    g, m_pad, k, n = check_masked(lhs, rhs, masked_m, expected_m, lhs_scale, rhs_scale, fmt)
    _raise_unless(supports_m_grouped_gemm_masked(m_pad=m_pad, n=n, k=k, num_groups=g, recipe=recipe,
                                                 arch=arch, expected_m=expected_m, lhs_dtype=lhs.dtype,
                                                 rhs_dtype=rhs.dtype, settings=settings))
    return masked_impl(lhs, rhs, canonical_masked_m(masked_m, m_pad), expected_m=expected_m,
                       lhs_scale=lhs_scale, rhs_scale=rhs_scale, recipe=recipe, arch=arch, settings=settings)


def _nt_operands(a: jax.Array, b: jax.Array, a_dtype, b_dtype, names: tuple[str, str] = ("a", "b")
                 ) -> tuple[int, int, int]:
    """Checks a: (M, K) a_dtype and b: (N, K) b_dtype (argument names ``names``); returns (M, N, K)."""
    an, bn = names
    check_rank(an, a, 2, "(M, K)")
    check_rank(bn, b, 2, "(N, K)")
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k:
        raise ValueError(f"{bn}: expected shape (N, {k}) to match {an} {tuple(a.shape)}, got {tuple(b.shape)}")
    check_dtype(an, a, (a_dtype,))
    check_dtype(bn, b, (b_dtype,))
    return m, n, k


def gemm_nt_fp8(a: jax.Array, b: jax.Array, *, a_scale: jax.Array, b_scale: jax.Array,
                arch: int = 90, settings: KernelSettings | None = None) -> jax.Array:
    """Dense D = A·Bᵀ with block FP8 operands (the shared expert's GEMMs). SM90 by nature (no other
    family has a dense kernel): arch defaults to 90, anything else is refused.

    a: (M, K) e4m3; a_scale: (ceil(K/128), align(M,4)) f32 MN-major TMA-aligned image of the 1x128
    scales; b: (N, K) e4m3; b_scale: (ceil(N/128), ceil(K/128)) f32 128x128 block scales -> (M, N) bf16.
    """
    m, n, k = _nt_operands(a, b, jnp.float8_e4m3fn, jnp.float8_e4m3fn)
    settings = resolve_settings(settings)
    fmt = gemm_format("fp8_block", arch)
    check_shape("a_scale", a_scale, fmt.lhs_scale_shape(m, k))
    check_dtype("a_scale", a_scale, (fmt.scale_dtype,))
    check_shape("b_scale", b_scale, fmt.rhs_scale_shape(1, n, k)[1:])
    check_dtype("b_scale", b_scale, (fmt.scale_dtype,))
    _raise_unless(supports_gemm_nt(n=n, k=k, recipe="fp8_block", arch=arch, settings=settings))
    if m == 0:
        return jnp.zeros((0, n), jnp.bfloat16)
    kern = dense_kernel(m, n, k, "fp8_block", arch, jnp.bfloat16, _num_sms(settings))
    (out,) = _run(kern, arch, [a, b, a_scale, b_scale], [jax.ShapeDtypeStruct((m, n), jnp.bfloat16)], settings)
    return out


def dense_impl(lhs: jax.Array, rhs: jax.Array, *, lhs_scale: jax.Array | None, rhs_scale: jax.Array | None,
               recipe: str, arch: int, settings: KernelSettings) -> jax.Array:
    """The registered dense GEMM (op ``gemm_nt``): operands already checked and accepted by ``resolve``."""
    m, n = lhs.shape[0], rhs.shape[0]
    if m == 0:
        return jnp.zeros((0, n), jnp.bfloat16)
    kern = dense_kernel(m, n, rhs.shape[1], recipe, arch, jnp.bfloat16, _num_sms(settings))
    operands = [lhs, rhs] if lhs_scale is None else [lhs, rhs, lhs_scale, rhs_scale]
    (out,) = _run(kern, arch, operands, [jax.ShapeDtypeStruct((m, n), jnp.bfloat16)], settings)
    return out


def gemm_nt_bf16(a: jax.Array, b: jax.Array, *, out_dtype: Any = jnp.bfloat16, arch: int = 90,
                 settings: KernelSettings | None = None) -> jax.Array:
    """Dense D = A·Bᵀ in bf16. a: (M, K) bf16; b: (N, K) bf16 -> (M, N) out_dtype (bf16 or f32).
    SM90 by nature (no other family has a dense kernel): arch defaults to 90, anything else is refused."""
    m, n, k = _nt_operands(a, b, jnp.bfloat16, jnp.bfloat16)
    settings = resolve_settings(settings)
    _raise_unless(supports_gemm_nt(n=n, k=k, recipe="bf16", arch=arch, out_dtype=out_dtype, settings=settings))
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    kern = dense_kernel(m, n, k, "bf16", arch, out_dtype, _num_sms(settings))
    (out,) = _run(kern, arch, [a, b], [jax.ShapeDtypeStruct((m, n), out_dtype)], settings)
    return out


def tf32_prenorm_gemm(x: jax.Array, fn: jax.Array, *, num_splits: int = 1, arch: int = 90,
                      settings: KernelSettings | None = None) -> tuple[jax.Array, jax.Array]:
    """x·fnᵀ in TF32 plus the per-row sum of squares of x (the hyper-connection pre-norm GEMM).

    x: (M, K) bf16; fn: (N, K) f32, N <= 32, N % 8 == 0, K % 64 == 0 -> ((M, N) f32, (M,) f32).
    num_splits > 1 splits K across CTAs (for small M); the partial results are summed here. An SM90
    kernel by nature: arch defaults to 90, anything else is refused.
    """
    m, n, k = _nt_operands(x, fn, jnp.bfloat16, jnp.float32, names=("x", "fn"))
    check_static_int("num_splits", num_splits, 1)
    settings = resolve_settings(settings)
    _raise_unless(supports_tf32_prenorm_gemm(n=n, k=k, num_splits=num_splits, arch=arch, settings=settings))
    if m == 0:
        return jnp.zeros((0, n), jnp.float32), jnp.zeros((0,), jnp.float32)
    kern = prenorm_kernel(m, n, k, num_splits)
    d, sq = _run(kern, arch, [x, fn], [jax.ShapeDtypeStruct((num_splits, m, n), jnp.float32),
                                       jax.ShapeDtypeStruct((num_splits, m), jnp.float32)], settings)
    return d.sum(0), sq.sum(0)
