"""Data formats of moe_jax, in pure jax.numpy: FP8/E2M1 quantizers, UE8M0 scales, DeepGEMM scale
layouts (memory images), recipes, the GEMM format of each (recipe, arch) pair and load-time weight
paths. Every function is jit- and vmap-able; shapes and dtypes are in each docstring."""

from layouts.archs import ARCHS, SUPPORTED_ARCHS, ArchSpec, check_arch
from layouts.checks import FLOAT_DTYPES, align, ceil_div
from layouts.fp4 import (
    E2M1_VALUES,
    decode_e2m1,
    dequantize_mxfp4,
    encode_e2m1,
    pack_e2m1,
    quantize_mxfp4,
    unpack_e2m1,
)
from layouts.fp8 import (
    FP8_E4M3_MAX,
    cast_to_e4m3,
    dequantize_fp8_per_block,
    dequantize_fp8_per_token_group,
    fp8_scale_from_amax,
    quantize_fp8_per_block,
    quantize_fp8_per_token_group,
    quantize_mxfp8,
)
from layouts.fused_moe import (
    FUSED_GATE_UP_GRAN,
    FUSED_MOE_BLOCK_MS,
    FusedMoEBuffer,
    deinterleave_gate_up,
    interleave_gate_up,
)
from layouts.rounding import store_as
from layouts.gemm_format import LHS_ORDERS, GemmFormat
from layouts.recipes import RECIPE_NAMES, QuantRecipe, gemm_format, get_recipe
from layouts.scale_layout import (
    broadcast_block_scale_to_rows,
    from_mn_major_tma_aligned,
    get_tma_aligned_size,
    pack_ue8m0_mn_major_tma_aligned,
    to_mn_major_tma_aligned,
    transform_sf_into_required_layout,
    unpack_ue8m0_mn_major_tma_aligned,
)
from layouts.ue8m0 import (
    ceil_to_ue8m0,
    e8m0_round_up_bytes,
    is_ue8m0,
    pack_ue8m0,
    ue8m0_bytes_to_fp32,
    ue8m0_scale_from_amax,
    unpack_ue8m0,
)
from layouts.weight_paths import (
    expand_per_tensor_scale,
    mxfp4_to_fp8_block,
    prepare_expert_weights,
    requant_fp8_block_ue8m0,
)

__all__ = [
    "ARCHS", "ArchSpec", "FLOAT_DTYPES", "SUPPORTED_ARCHS", "align", "ceil_div", "check_arch", "store_as",
    # recipes and GEMM formats
    "RECIPE_NAMES", "QuantRecipe", "get_recipe", "GemmFormat", "gemm_format", "LHS_ORDERS",
    # UE8M0
    "ceil_to_ue8m0", "e8m0_round_up_bytes", "is_ue8m0", "pack_ue8m0", "unpack_ue8m0",
    "ue8m0_bytes_to_fp32", "ue8m0_scale_from_amax",
    # FP8
    "FP8_E4M3_MAX", "cast_to_e4m3", "fp8_scale_from_amax",
    "quantize_fp8_per_token_group", "dequantize_fp8_per_token_group",
    "quantize_fp8_per_block", "dequantize_fp8_per_block", "quantize_mxfp8",
    # E2M1 / MXFP4
    "E2M1_VALUES", "encode_e2m1", "decode_e2m1", "pack_e2m1", "unpack_e2m1",
    "quantize_mxfp4", "dequantize_mxfp4",
    # scale layouts
    "get_tma_aligned_size", "to_mn_major_tma_aligned", "from_mn_major_tma_aligned",
    "pack_ue8m0_mn_major_tma_aligned", "unpack_ue8m0_mn_major_tma_aligned",
    "broadcast_block_scale_to_rows", "transform_sf_into_required_layout",
    # load-time weight paths
    "mxfp4_to_fp8_block", "requant_fp8_block_ue8m0", "expand_per_tensor_scale",
    "prepare_expert_weights",
    # the fused MoE kernel's device buffer and GEMM1 weight order
    "FUSED_GATE_UP_GRAN", "FUSED_MOE_BLOCK_MS", "FusedMoEBuffer", "interleave_gate_up", "deinterleave_gate_up",
]
