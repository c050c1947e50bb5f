"""Trace-time checks of the layer's inputs against the config: clear ValueError/TypeError naming
the argument, the expected and the actual value. Sizes that may be shards (E_local, I_local) are
read from the parameter shapes and checked to be consistent with the config."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from custom_calls._checks import FLOATS, WEIGHT_GROUP, ceil_div, check_dtype, check_shape, round_up
from layouts import get_recipe
from moe_jax.config import ARCHS, RECIPES, MoEConfig
from moe_jax.params import MoEParams

_VALUE_DTYPE = {"fp8_block": jnp.float8_e4m3fn, "mxfp8": jnp.float8_e4m3fn, "mxfp4": jnp.int8}


def check_x(x: jax.Array, config: MoEConfig) -> None:
    """x: (M, H) float."""
    if x.ndim != 2:
        raise ValueError(f"x: expected rank 2 (M, H={config.hidden_size}), got shape {tuple(x.shape)}")
    if x.shape[1] != config.hidden_size:
        raise ValueError(f"x: expected hidden size {config.hidden_size}, got shape {tuple(x.shape)}")
    if x.shape[0] < 1:
        raise ValueError(f"x: expected at least one token, got shape {tuple(x.shape)}")
    check_dtype("x", x, FLOATS)


def expert_sizes(params: MoEParams, config: MoEConfig) -> tuple[int, int]:
    """(E_local, I_local) held by `params`, validated against `config`."""
    e_loc = params.w13.shape[0]
    if not 1 <= e_loc <= config.num_experts:
        raise ValueError(f"params.w13: expected 1..{config.num_experts} experts on axis 0, got "
                         f"shape {tuple(params.w13.shape)}")
    i_loc = params.local_intermediate_size
    i = config.intermediate_size
    if i_loc < 1 or i % i_loc:
        raise ValueError(f"params.w2: intermediate size {i_loc} (last axis of shape "
                         f"{tuple(params.w2.shape)}) must divide config.intermediate_size={i}")
    if config.recipe != "bf16" and i_loc % 128:
        raise ValueError(f"params.w2: intermediate size {i_loc} must be a multiple of 128 for "
                         f"recipe {config.recipe!r}")
    return e_loc, i_loc


def check_params(params: MoEParams, config: MoEConfig) -> tuple[int, int]:
    """Validate shapes/dtypes of every field for `config`; returns (E_local, I_local)."""
    if not isinstance(params, MoEParams):
        raise TypeError(f"params: expected MoEParams, got {type(params).__name__}")
    e, h = config.num_experts, config.hidden_size
    check_shape("params.gate_weight", params.gate_weight, (e, h))
    check_dtype("params.gate_weight", params.gate_weight, FLOATS)
    if config.use_correction_bias:
        check_shape("params.e_score_correction_bias", params.e_score_correction_bias, (e,))
    elif params.e_score_correction_bias is not None:
        raise ValueError("params.e_score_correction_bias is set but config.use_correction_bias is False")
    e_loc, i_loc = expert_sizes(params, config)
    if params.is_prepared:
        if params.gemm_arch not in ARCHS or params.gemm_recipe not in RECIPES:
            raise ValueError(f"params: expected gemm_recipe in {RECIPES} and gemm_arch in {ARCHS}, "
                             f"got ({params.gemm_recipe!r}, {params.gemm_arch!r})")
        expect = get_recipe(config.recipe).gemm_recipe(params.gemm_arch).name
        if params.gemm_recipe != expect:
            raise ValueError(f"params: prepared as {params.gemm_recipe!r} for arch {params.gemm_arch}, "
                             f"but config.recipe={config.recipe!r} needs {expect!r}")
        _check_expert_weights(params, params.gemm_recipe, e_loc, i_loc, h, prepared_arch=params.gemm_arch)
    else:
        _check_expert_weights(params, config.recipe, e_loc, i_loc, h, prepared_arch=None)
    if config.n_shared_experts:
        check_shared(params, config)
    elif params.shared_w13 is not None or params.shared_w2 is not None:
        raise ValueError("params.shared_w13/shared_w2 are set but config.n_shared_experts is 0")
    if config.hash_routing:
        if params.tid2eid is None:
            raise ValueError("params.tid2eid: config.hash_routing is True but tid2eid is None")
        check_shape("params.tid2eid", params.tid2eid, (config.vocab_size, config.top_k))
        check_dtype("params.tid2eid", params.tid2eid, (jnp.int32,))
    elif params.tid2eid is not None:  # route() would ignore it: the config is the wrong one
        raise ValueError(f"params.tid2eid: expected None for a layer with config.hash_routing=False, "
                         f"got an array of shape {tuple(params.tid2eid.shape)}")
    return e_loc, i_loc


def check_shared(params: MoEParams, config: MoEConfig) -> int:
    """shared_w13 (2*I_s, H), shared_w2 (H, I_s) with I_s dividing I*n_shared (a tensor-parallel
    shard, or the whole when the shared expert is replicated); returns I_s."""
    h, full = config.hidden_size, config.shared_intermediate_size
    w13, w2 = params.shared_w13, params.shared_w2
    if w13 is None or w2 is None:
        raise ValueError("params.shared_w13/shared_w2: required when config.n_shared_experts > 0, got None")
    if w2.ndim != 2 or w2.shape[0] != h or w2.shape[1] < 1 or full % w2.shape[1]:
        raise ValueError(f"params.shared_w2: expected shape ({h}, I_s) with I_s dividing "
                         f"{full} (I * n_shared_experts), got {tuple(w2.shape)}")
    i_s = w2.shape[1]
    check_shape("params.shared_w13", w13, (2 * i_s, h))
    check_dtype("params.shared_w13", w13, FLOATS)
    check_dtype("params.shared_w2", w2, FLOATS)
    return i_s


def _check_expert_weights(params, recipe, e_loc, i_loc, h, prepared_arch):
    packed = recipe == "mxfp4"
    k13 = h // 2 if packed else h
    k2 = i_loc // 2 if packed else i_loc
    check_shape("params.w13", params.w13, (e_loc, 2 * i_loc, k13))
    check_shape("params.w2", params.w2, (e_loc, h, k2))
    if recipe == "bf16":
        check_dtype("params.w13", params.w13, FLOATS)
        check_dtype("params.w2", params.w2, FLOATS)
        return
    check_dtype("params.w13", params.w13, (_VALUE_DTYPE[recipe],))
    check_dtype("params.w2", params.w2, (_VALUE_DTYPE[recipe],))
    for name, n, k in (("w13", 2 * i_loc, h), ("w2", h, i_loc)):
        sf = getattr(params, f"{name}_scale")
        if prepared_arch == 100:
            gk = WEIGHT_GROUP[recipe]
            check_shape(f"params.{name}_scale", sf, (e_loc, ceil_div(ceil_div(k, gk), 4), round_up(n, 4)))
            check_dtype(f"params.{name}_scale", sf, (jnp.int32,))
        elif recipe == "fp8_block":
            check_shape(f"params.{name}_scale", sf, (e_loc, ceil_div(n, 128), ceil_div(k, 128)))
            check_dtype(f"params.{name}_scale", sf, (jnp.float32,))
        else:
            check_shape(f"params.{name}_scale", sf, (e_loc, n, k // 32))
            check_dtype(f"params.{name}_scale", sf, (jnp.float32,))
