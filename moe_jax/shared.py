"""The shared experts' dense MLP: bf16, or FP8 through the dense FP8 GEMM.

bf16 shared experts (`MoEParams.shared_recipe == "bf16"`): bf16 operands, fp32 products and
accumulation, bf16 rounding between the stages like the routed bf16 path (XLA dots on bf16
operands with fp32 accumulation).

FP8 shared experts ("fp8_block": e4m3 weights with 128x128 block scales), as the routed FP8 path
runs its GEMMs:
    x (M, H) --permute_contig with every token in place (the routed path's 1x128 quantization)-->
      e4m3 + scale image --gemm_nt(shared_w13)--> gateup (M, 2I_s) bf16
      --activation_quant_contig (the routed experts' activation, clamps included, and the 1x128
        quantization of GEMM2's input)--> e4m3 + scale image --gemm_nt(shared_w2)--> (M, H) bf16
`custom_calls.gemm_nt` is the dense GEMM op: its reference dequantizes both operands and multiplies
in fp32 (the emulation the CPU runs); on SM90 the registry resolves it to DeepGEMM's dense FP8
kernel. Activation groups and scale images are those of `layouts.gemm_format("fp8_block", arch)`.

With `config.fuse_shared_experts` the shared experts run inside the routed grouped GEMMs instead
(moe_jax/layer.py); nothing here runs then.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from custom_calls import KernelSettings, activation_quant_contig, gated_activation, gemm_nt, permute_contig
from layouts import store_as
from moe_jax.config import MoEConfig
from moe_jax.params import SHARED_FP8, MoEParams, prepare_shared


def shared_mlp(x: jax.Array, params: MoEParams, config: MoEConfig, *, out_dtype, gemm_backend=None,
               act_backend=None, permute_backend=None, settings: KernelSettings | None = None) -> jax.Array:
    """The shared-expert MLP on checked inputs: x (M, H) float -> (M, H) out_dtype (None: as the
    MLP computes it, bf16 for FP8 weights, f32 for bf16 ones); zeros without a shared expert (or
    with the shared experts fused into the routed ones; out_dtype required then). FP8 shared weights in
    checkpoint form are brought to the GEMM form of config.gemm_arch here (prepare once instead:
    `prepare_params`). gemm_backend / act_backend / permute_backend: backend names of the dense
    GEMMs, the activation + quantization between them and the input quantization (FP8 only);
    settings: the dense GEMMs' `custom_calls.KernelSettings` (None: the environment's)."""
    if not config.n_shared_experts or params.fused_shared:
        return jnp.zeros(x.shape, out_dtype)
    if params.shared_recipe != SHARED_FP8:
        out = _bf16_mlp(x, params.shared_w13, params.shared_w2, config)
    else:
        arch = params.gemm_arch if params.is_prepared else config.gemm_arch
        p = params if params.is_prepared else params.replace(**prepare_shared(params, arch))
        out = fp8_mlp(x, p.shared_w13, p.shared_w13_scale, p.shared_w2, p.shared_w2_scale, config, arch=arch,
                      gemm_backend=gemm_backend, act_backend=act_backend, permute_backend=permute_backend,
                      settings=settings)
    return out if out_dtype is None else out.astype(out_dtype)


def _bf16_mlp(x, w13, w2, config: MoEConfig) -> jax.Array:
    """x (M, H), w13 (2I_s, H), w2 (H, I_s) float -> (M, H) f32. Operands rounded to bf16 (x, the
    activation) multiply with fp32 accumulation: with bf16 weights on bf16 operands (a bf16 x bf16
    product is exact in fp32, so only the summation order can differ from an fp32 GEMM, at the
    tensor-core rate), other weight dtypes in fp32 at HIGHEST precision."""
    def dot(spec, a_bf16, w):
        if w.dtype == jnp.bfloat16:
            return jnp.einsum(spec, a_bf16, w, preferred_element_type=jnp.float32)
        return jnp.einsum(spec, a_bf16.astype(jnp.float32), w.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)

    gateup = store_as(dot("mh,nh->mn", x.astype(jnp.bfloat16), w13), jnp.bfloat16)
    a = gated_activation(gateup, config.activation).astype(jnp.bfloat16)
    return dot("mi,hi->mh", a, w2)


def fp8_mlp(x: jax.Array, w13: jax.Array, w13_scale: jax.Array, w2: jax.Array, w2_scale: jax.Array,
            config: MoEConfig, *, arch: int, gemm_backend=None, act_backend=None,
            permute_backend=None, settings: KernelSettings | None = None) -> jax.Array:
    """x (M, H) float; w13 (2I_s, H) e4m3, w2 (H, I_s) e4m3 with their GEMM-form scales for `arch`
    -> (M, H) bf16 (module docstring for the stages)."""
    m = x.shape[0]
    in_place = jnp.arange(m, dtype=jnp.int32)[:, None]  # token t -> row t: quantization only
    q, q_scale = permute_contig(x, in_place, num_rows=m, recipe=SHARED_FP8, arch=arch, backend=permute_backend,
                                assume_canonical=True)
    gateup = gemm_nt(q, w13, lhs_scale=q_scale, rhs_scale=w13_scale, recipe=SHARED_FP8, arch=arch,
                     backend=gemm_backend, settings=settings)
    a, a_scale = activation_quant_contig(gateup, act=config.activation, recipe=SHARED_FP8, arch=arch,
                                         backend=act_backend)
    return gemm_nt(a, w2, lhs_scale=a_scale, rhs_scale=w2_scale, recipe=SHARED_FP8, arch=arch,
                   backend=gemm_backend, settings=settings)
