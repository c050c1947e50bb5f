"""Gated activation fused with the quantization of GEMM2's input (stage 4 of docs/ARCHITECTURE.md), contig and masked
(varlen) forms, every variant:

    silu        silu(gate) * up; with swiglu_limit l: up clamped to [-l, l], gate clamped above at l
    swiglu_oai  gate * sigmoid(alpha * gate) * (up + 1), alpha = gemm1_alpha, same clamps
    situ        beta_s * tanh(gate / beta_s) * sigmoid(gate) * beta_l * tanh(up / beta_l)
                (the seed's formula prints tan; its reference code uses tanh, which we follow)

gate = first half of the 2I columns, up = second half. Math in fp32; the result is rounded to bf16
before quantization (as the default fused kernels do) unless `keep_fp32` (silu only, FP8 weights),
which quantizes the fp32 value. Quantization: the lhs format of `layouts.gemm_format(recipe, arch)`
with K = I (GEMM2's A recipe recomputed for K = I), in its column order (`GemmFormat.lhs_order`: the
W4A8 order for mxfp4 on arch 90, which GEMM2 is then told with `lhs_order="w4a8"`).
Every variant, SiTU included, quantizes with the already rounded-up UE8M0 scale on arch 100. The
seed's SiTU Triton kernel instead quantizes with the exact amax/448 scale and rounds the scale up
afterwards, which inflates the dequantized values by the rounding factor (up to 2x); we do not
reproduce that.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from layouts import FLOAT_DTYPES, GemmFormat, gemm_format, store_as
from layouts.checks import check_dtype, check_rank, check_shape
from custom_calls import contracts
from custom_calls.backends import declare_op, resolve

OP_CONTIG = "activation_quant_contig"
OP_MASKED = "activation_quant_masked"
KINDS = ("silu", "swiglu_oai", "situ")


@dataclass(frozen=True)
class ActivationSpec:
    """Static description of the gated activation (hashable; a static jit argument)."""

    kind: str = "silu"
    swiglu_limit: float | None = None
    gemm1_alpha: float | None = None
    situ_beta: float = 1.0
    situ_linear_beta: float = 1.0
    keep_fp32: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")
        if (self.kind == "swiglu_oai") != (self.gemm1_alpha is not None):
            raise ValueError(f"gemm1_alpha: required by (and only by) kind='swiglu_oai', got "
                             f"kind={self.kind!r}, gemm1_alpha={self.gemm1_alpha!r}")
        if self.kind == "situ" and self.swiglu_limit is not None:
            raise ValueError("swiglu_limit: does not apply to kind='situ'")
        if self.keep_fp32 and self.kind != "silu":
            raise ValueError(f"keep_fp32: only for kind='silu', got kind={self.kind!r}")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit: expected None or > 0, got {self.swiglu_limit!r}")
        for name in ("situ_beta", "situ_linear_beta"):  # divisors of the tanh arguments
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)!r}")


def gated_activation(gateup: jax.Array, act: ActivationSpec) -> jax.Array:
    """gateup: (..., 2I) float -> (..., I) f32."""
    x = gateup.astype(jnp.float32)
    i = x.shape[-1] // 2
    gate, up = x[..., :i], x[..., i:]
    if act.kind == "situ":
        bs, bl = act.situ_beta, act.situ_linear_beta
        return bs * jnp.tanh(gate / bs) * jax.nn.sigmoid(gate) * (bl * jnp.tanh(up / bl))
    if act.swiglu_limit is not None:
        lim = act.swiglu_limit
        gate = jnp.minimum(gate, lim)
        up = jnp.clip(up, -lim, lim)
    if act.kind == "swiglu_oai":
        return gate * jax.nn.sigmoid(act.gemm1_alpha * gate) * (up + 1.0)
    return jax.nn.silu(gate) * up


def _act_quant(gateup, act: ActivationSpec, recipe: str, arch: int):
    y = gated_activation(gateup, act)
    if not act.keep_fp32:
        y = store_as(y, jnp.bfloat16)
    return gemm_format(recipe, arch).quantize_lhs(y)


def _contig_reference(gateup, *, act, recipe, arch):
    return _act_quant(gateup, act, recipe, arch)


def _masked_reference(gateup, masked_m, *, act, recipe, arch):
    # rows past masked_m are never read by the GEMM; the reference zeroes them before quantizing
    valid = jnp.arange(gateup.shape[1])[None, :, None] < masked_m[:, None, None]
    return _act_quant(jnp.where(valid, gateup, 0), act, recipe, arch)


declare_op(OP_CONTIG, stage="activation", static_args=("rows", "two_i", "act", "recipe", "arch", "dtype"),
           reference=jax.jit(_contig_reference, static_argnames=("act", "recipe", "arch")))
declare_op(OP_MASKED, stage="activation",
           static_args=("num_groups", "m_pad", "two_i", "act", "recipe", "arch", "dtype"),
           reference=jax.jit(_masked_reference, static_argnames=("act", "recipe", "arch")))


def keep_fp32_allowed(fmt: GemmFormat) -> bool:
    """`keep_fp32` quantizes SiLU*up from fp32: only for FP8 expert weights (e4m3 values)."""
    return fmt.is_quantized and fmt.rhs_k_pack == 1


def _check(gateup, act, recipe, arch) -> GemmFormat:
    if not isinstance(act, ActivationSpec):
        raise TypeError(f"act: expected ActivationSpec, got {type(act).__name__}")
    fmt = gemm_format(recipe, arch)
    check_dtype("gateup", gateup, FLOAT_DTYPES)
    two_i = gateup.shape[-1]
    if two_i % 2:
        raise ValueError(f"gateup: last axis must be even (gate | up), got shape {tuple(gateup.shape)}")
    if act.keep_fp32 and not keep_fp32_allowed(fmt):
        raise ValueError(f"act.keep_fp32: only for FP8 expert weights (fp8_block, mxfp8), got recipe {recipe!r}")
    return fmt


def activation_quant_contig(gateup: jax.Array, *, act: ActivationSpec, recipe: str, arch: int,
                            backend: str | None = None) -> tuple[jax.Array, jax.Array | None]:
    """gateup: (rows, 2I) bf16 -> (a (rows, I) bf16 | e4m3, a_scale image | None), formats as
    `act_quant.quantize_activation` for (recipe, arch)."""
    check_rank("gateup", gateup, 2, "(rows, 2I)")
    _check(gateup, act, recipe, arch)
    rows, two_i = gateup.shape
    impl = resolve(OP_CONTIG, backend, rows=rows, two_i=two_i, act=act, recipe=recipe, arch=arch,
                   dtype=gateup.dtype)
    return impl.impl(gateup, act=act, recipe=recipe, arch=arch)


def activation_quant_masked(gateup: jax.Array, masked_m: jax.Array, *, act: ActivationSpec,
                            recipe: str, arch: int, backend: str | None = None,
                            debug_checks: bool = False,
                            assume_canonical: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """Varlen form: gateup (G, m_pad, 2I) bf16, masked_m (G,) int32 (clamped to [0, m_pad] for
    every backend) -> (a (G, m_pad, I), a_scale (G, ...) image | None). Only rows < masked_m[g]
    are defined (the reference zeroes the rest). debug_checks: report masked_m outside
    [0, m_pad] (`contracts.checked`). assume_canonical: masked_m is already in [0, m_pad] (the
    dispatcher's is), the clamp is skipped."""
    check_rank("gateup", gateup, 3, "(G, m_pad, 2I)")
    _check(gateup, act, recipe, arch)
    g, m_pad, two_i = gateup.shape
    check_shape("masked_m", masked_m, (g,))
    check_dtype("masked_m", masked_m, (jnp.int32,))
    if debug_checks:
        contracts.check_masked_m(masked_m, m_pad)
    if not assume_canonical:
        masked_m = contracts.canonical_masked_m(masked_m, m_pad)
    impl = resolve(OP_MASKED, backend, num_groups=g, m_pad=m_pad, two_i=two_i, act=act,
                   recipe=recipe, arch=arch, dtype=gateup.dtype)
    return impl.impl(gateup, masked_m, act=act, recipe=recipe, arch=arch)
