"""`MoEParams`: the layer's weights as a pytree, `init_params`, their validation against a config
(`check_params`), and the load-time conversion `prepare_params` from checkpoint form to the form
the grouped GEMMs consume (`layouts.weight_paths`).

Checkpoint form, by recipe (E experts, I intermediate, H hidden):
    bf16       w13 (E, 2I, H) bf16, w2 (E, H, I) bf16, no scales
    fp8_block  w13 e4m3, w13_scale (E, ceil(2I/128), ceil(H/128)) f32 (128x128 blocks); w2 alike
    mxfp8      w13 e4m3, w13_scale (E, 2I, H/32) f32 powers of two; w2 alike
    mxfp4      w13 (E, 2I, H/2) int8 (two e2m1 per byte), w13_scale (E, 2I, H/32) f32 powers of two
w13 rows 0..I-1 are the gate projection, I..2I-1 the up projection. The router `gate_weight (E, H)`,
`e_score_correction_bias (E,)` and `tid2eid (vocab, top_k) int32` are not quantized.

The shared expert: `shared_w13 (2*I_s, H)` / `shared_w2 (H, I_s)` (I_s = I * n_shared_experts, gate
rows then up rows), either bf16 (no scales; the layer runs it as a dense bf16 MLP) or FP8 with
128x128 block scales (`shared_recipe` "fp8_block"): e4m3 values with `shared_w13_scale
(ceil(2*I_s/128), ceil(H/128))` / `shared_w2_scale (ceil(H/128), ceil(I_s/128))` f32 in checkpoint
form and the rhs scale of `layouts.gemm_format("fp8_block", arch)` (without its group axis) in GEMM
form (the same blocks on arch 90; UE8M0 packed on arch 100), run through the dense GEMM
`custom_calls.gemm_nt` (moe_jax/shared.py).

GEMM form (after `prepare_params(params, config)`): the rhs operands of
`get_recipe(config.recipe).gemm_format(arch)` (`layouts.gemm_format`):
    bf16                 unchanged
    fp8_block, arch 90   unchanged (rhs_scale is the checkpoint's block scale)
    fp8_block, arch 100  UE8M0 requant (path C), scales packed MN-major (E, ceil(K/512), align(N,4)) int32
    mxfp8, arch 100      scales packed MN-major (E, ceil(K/128), align(N,4)) int32 (path D)
    mxfp4, arch 100      values stay int8-packed; scales packed MN-major (path A)
    mxfp4, arch 90       FP4 -> FP8 dequant to fp8_block (path B); the GEMMs then run fp8_block/90;
                         with config.mxfp4_sm90_form "w4a8": kept 4-bit (path E, `layouts.w4a8`),
                         the GEMMs run mxfp4/90 (backend "w4a8": CUDA kernels, both layouts)
`params.gemm_recipe` / `params.gemm_arch` (static pytree metadata) say which form the params are in
(None: checkpoint form).

Shared-expert fusion (`config.fuse_shared_experts`): `prepare_params` appends the n_shared_experts
shared experts (each of the routed intermediate size) to w13/w2 as experts E_local..E_local+n_s-1
in GEMM form, sets the shared fields to None and records `fused_shared = n_s` (static metadata).
Done once at load time because concatenating at call time would copy every expert weight on every
call. It needs the shared expert in the routed GEMM recipe (else ValueError).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

import layouts
from layouts import (FLOAT_DTYPES, FUSED_GATE_UP_GRAN, deinterleave_gate_up, gemm_format, get_recipe,
                     interleave_gate_up)
from layouts.checks import ceil_div, check_dtype, check_shape
from moe_jax.config import QUANT_SIZE_MULTIPLE, MoEConfig
from moe_jax.random_init import SHARED_FP8, SHARED_RECIPES, draw_params

E4M3 = jnp.dtype(jnp.float8_e4m3fn)


@dataclass(frozen=True)
class MoEParams:
    gate_weight: jax.Array
    w13: jax.Array
    w2: jax.Array
    e_score_correction_bias: jax.Array | None = None
    w13_scale: jax.Array | None = None
    w2_scale: jax.Array | None = None
    shared_w13: jax.Array | None = None
    shared_w2: jax.Array | None = None
    tid2eid: jax.Array | None = None
    shared_w13_scale: jax.Array | None = None
    shared_w2_scale: jax.Array | None = None
    gemm_recipe: str | None = field(default=None, metadata=dict(static=True))
    gemm_arch: int | None = field(default=None, metadata=dict(static=True))
    fused_shared: int = field(default=0, metadata=dict(static=True))
    # 0: w13 rows [gate; up]; 8: interleaved in groups of 8 (layouts.interleave_gate_up), the form
    # the fused layout's kernel reads, made by prepare_params for MoEConfig(layout="fused")
    w13_interleave: int = field(default=0, metadata=dict(static=True))

    @property
    def is_prepared(self) -> bool:
        return self.gemm_recipe is not None

    @property
    def kept_4bit(self) -> bool:
        """GEMM-form expert weights kept 4-bit for GEMMs that widen them (the W4A8 form of mxfp4 on
        arch 90, `layouts.w4a8`): values (E, N, K/2) int8 and one int32 scale word per row and 128 columns."""
        return self.is_prepared and self.gemm_arch in get_recipe(self.gemm_recipe).kept_4bit_on

    @property
    def num_local_experts(self) -> int:
        """Routed experts held (the fused shared experts appended to w13 not counted)."""
        return int(self.w13.shape[0]) - self.fused_shared

    @property
    def shared_recipe(self) -> str | None:
        """Recipe of the (unfused) shared expert: "fp8_block" for e4m3 values, "bf16" for float
        values, None without one."""
        if self.shared_w13 is None:
            return None
        return SHARED_FP8 if self.shared_w13.dtype == E4M3 else "bf16"

    @property
    def local_intermediate_size(self) -> int:
        """I held by these params (I/tp under tensor-parallel experts), from w2's last axis."""
        i = int(self.w2.shape[-1])
        # mxfp4 checkpoint/GEMM form packs two values per byte along K
        packed = self.w2.dtype == jnp.int8
        return 2 * i if packed else i

    @property
    def scales_packed(self) -> bool:
        """GEMM-form scales that are packed UE8M0 images (E, K-packs, align(N, 4)): no N axis."""
        return self.is_prepared and self.w13_scale is not None and gemm_format(self.gemm_recipe, self.gemm_arch).ue8m0

    def replace(self, **kw) -> "MoEParams":
        return dataclasses.replace(self, **kw)


jax.tree_util.register_dataclass(
    MoEParams,
    data_fields=["gate_weight", "w13", "w2", "e_score_correction_bias", "w13_scale", "w2_scale",
                 "shared_w13", "shared_w2", "tid2eid", "shared_w13_scale", "shared_w2_scale"],
    meta_fields=["gemm_recipe", "gemm_arch", "fused_shared", "w13_interleave"],
)


def init_params(key: jax.Array, config: MoEConfig, *, num_local_experts: int | None = None,
                tp_size: int = 1, shared_recipe: str = "bf16") -> MoEParams:
    """Random parameters in checkpoint form for `config` (any recipe).

    w13 (E_local, 2I, H) ~ N(0, 1/H) and w2 (E_local, H, I) ~ N(0, 1/I), quantized to `config.recipe`;
    gate_weight (E, H) ~ N(0, 1/H) f32 (cast it to bf16, as DeepSeek's checkpoints store the router,
    for the bf16 router GEMM); e_score_correction_bias (E,) ~ N(0, 0.1) f32 when
    `config.use_correction_bias`; when `n_shared_experts > 0` the shared expert shared_w13
    (2*I_s, H) ~ N(0, 1/H) and shared_w2 (H, I_s) ~ N(0, 1/I_s) bf16; when `config.hash_routing` a
    random tid2eid (vocab, top_k) int32 of distinct experts per token (a uniformly random ordered
    top_k-subset of E). `num_local_experts` / `tp_size` make a shard's shapes directly (E_local
    experts, I/tp). `shared_recipe`: "bf16" or "fp8_block" (the same bf16 draws quantized to e4m3
    with 128x128 block scales, checkpoint form).

    Memory (moe_jax/random_init.py): one jitted program, traceable under jit and eval_shape. The routed experts, then the
    shared expert, are drawn in chunks of expert slices (rows of w13 and w2 together, whole scale
    blocks: `_expert_slices`), each chunk drawn in f32 and quantized at once, gathered in a staging
    buffer and written into the preallocated result (fori_loops over one compiled chunk); tid2eid
    in chunks of tokens. A chunk's f32 draw is at most 256 MiB and 1/40 of the result's bytes, the
    staging buffer twice that in the result's dtypes, so the temporaries stay under a fifth of the
    result (peak <= 1.25x the result's bytes; measured 1.16x for V3), unless the smallest chunk (128
    rows of w13 and of w2 for fp8_block) is large against the whole result, as with a few small
    experts. Every index is a per-axis int32 far below 2**31. XLA:CPU writes float8 / bf16 into a
    buffer through a converted copy of all of it, so large fp8 inits are slow there (~6 s for 25 MB).

    Determinism: the values depend on `key` and the shapes only, not on the chunking nor on the
    recipes (which quantize the same draws): slice u of the routed experts (slice u % g of expert
    u // g, g = gcd(2I, H)) is drawn from fold_in(k_experts, u), so a shard's experts
    (num_local_experts=E_local, same tp_size) are the first E_local experts of the full draw, and
    the other fields do not depend on E_local. tp_size changes I and with it every expert's values.
    """
    if shared_recipe not in SHARED_RECIPES:
        raise ValueError(f"shared_recipe: expected one of {SHARED_RECIPES}, got {shared_recipe!r}")
    e = config.num_experts
    e_loc = e if num_local_experts is None else num_local_experts
    if not isinstance(e_loc, int) or not 1 <= e_loc <= e:
        raise ValueError(f"num_local_experts: expected an int in [1, {e}] (config.num_experts), "
                         f"got {num_local_experts!r}")
    if config.intermediate_size % tp_size:
        raise ValueError(f"tp_size={tp_size} must divide intermediate_size={config.intermediate_size}")
    return MoEParams(**draw_params(key, config, e_loc, tp_size, shared_recipe, None))


@functools.partial(jax.jit, static_argnums=(2, 3, 4))  # one compiled conversion, not op-by-op
def _prepare_weight(w: jax.Array, sf: jax.Array | None, recipe: str, arch: int, keep_4bit: bool = False):
    """One expert weight (E, N, K[/2]) from checkpoint form to GEMM form (load-time paths A-E)."""
    if not get_recipe(recipe).is_quantized:
        return w, None
    return layouts.prepare_expert_weights(w, sf, recipe=recipe, arch=arch, keep_4bit=keep_4bit)


def prepare_params(params: MoEParams, config: MoEConfig, arch: int | None = None) -> MoEParams:
    """Convert checkpoint-form expert weights to the GEMM form of (config.recipe, arch) — once, at
    load time. arch None -> `config.gemm_arch`. Already prepared params for the same arch are
    returned unchanged, but for the w13 row order of config.layout (`MoEParams.w13_interleave`:
    interleaved for "fused", [gate; up] otherwise); prepared params for another arch raise
    ValueError."""
    arch = config.gemm_arch if arch is None else arch
    rec = get_recipe(config.recipe)
    if arch not in rec.supported_archs:
        raise ValueError(f"arch: recipe {config.recipe!r} runs on arch {tuple(sorted(rec.supported_archs))}, "
                         f"got {arch!r}")
    if params.is_prepared:
        if params.gemm_arch != arch:
            raise ValueError(f"params: already prepared for arch {params.gemm_arch}, asked for arch {arch}")
        return _gate_up_order(params, config)
    check_params(params, config)
    gr = config.gemm_recipe_on(arch)
    keep_4bit = gr == rec.name and arch in rec.kept_4bit_on  # W4A8
    w13, s13 = _prepare_weight(params.w13, params.w13_scale, config.recipe, arch, keep_4bit)
    w2, s2 = _prepare_weight(params.w2, params.w2_scale, config.recipe, arch, keep_4bit)
    out = _gate_up_order(params.replace(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2, gemm_recipe=gr,
                                        gemm_arch=arch), config)
    if config.n_shared_experts and config.fuse_shared_experts:
        return _fuse_shared(out, params, config, arch)
    if config.n_shared_experts:
        return out.replace(**prepare_shared(params, arch))
    return out


def _gate_up_order(params: MoEParams, config: MoEConfig) -> MoEParams:
    """Prepared params with the w13 row order of config.layout: interleaved for "fused" only (the
    fused kernel's order; the scales stay [gate; up]), except weights kept 4-bit, which stay [gate; up]:
    the fused layout widens them into its order at each call (moe_jax/layer.py)."""
    want = FUSED_GATE_UP_GRAN if config.layout == "fused" and not params.kept_4bit else 0
    if params.w13_interleave == want:
        return params
    w13 = interleave_gate_up(params.w13) if want else deinterleave_gate_up(params.w13, params.w13_interleave)
    return params.replace(w13=w13, w13_interleave=want)


def prepare_shared(params: MoEParams, arch: int) -> dict:
    """The shared-expert fields of checkpoint-form `params` in GEMM form for `arch`, as a dict of
    MoEParams fields: bf16 unchanged, fp8_block through the load-time path of the routed fp8_block
    weights (a no-op on arch 90; the UE8M0 requantization on arch 100)."""
    names = ("shared_w13", "shared_w2")
    if params.shared_recipe != SHARED_FP8:
        return {n: getattr(params, n) for n in names}
    out = {}
    for n in names:
        w, sf = _prepare_weight(getattr(params, n)[None], getattr(params, f"{n}_scale")[None], SHARED_FP8, arch)
        out[n], out[f"{n}_scale"] = w[0], sf[0]
    return out


def _split_shared(params: MoEParams, n_s: int) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array | None]:
    """Checkpoint-form shared expert (I_s = n_s * I) as n_s experts of the routed shape:
    w13 (n_s, 2I, H), w2 (n_s, H, I) and their (n_s, blocks...) scales (I a multiple of the 128-row
    block when quantized, so the blocks split cleanly)."""
    w13, w2 = params.shared_w13, params.shared_w2
    s13, s2 = params.shared_w13_scale, params.shared_w2_scale

    def rows(a):  # (2*n_s*r, c) gate rows then up rows -> (n_s, 2r, c): expert j's gate then up rows
        gate, up = jnp.split(a, 2, axis=0)
        return jnp.concatenate([gate.reshape(n_s, -1, a.shape[1]), up.reshape(n_s, -1, a.shape[1])], axis=1)

    def cols(a):  # (h, n_s*c) -> (n_s, h, c)
        return a.reshape(a.shape[0], n_s, -1).transpose(1, 0, 2)

    return rows(w13), None if s13 is None else rows(s13), cols(w2), None if s2 is None else cols(s2)


def _fuse_shared(out: MoEParams, params: MoEParams, config: MoEConfig, arch: int) -> MoEParams:
    """GEMM-form `out` with checkpoint-form params' shared experts appended as experts
    E_local..E_local+n_s-1 (module docstring)."""
    n_s = config.n_shared_experts
    shared = params.shared_recipe
    if shared != out.gemm_recipe:
        raise ValueError(f"config.fuse_shared_experts: the shared expert must use the routed experts' GEMM "
                         f"recipe {out.gemm_recipe!r} (arch {arch}), got a {shared!r} shared expert "
                         f"(params.shared_w13 dtype {params.shared_w13.dtype.name})")
    i_loc = out.local_intermediate_size
    i_s = int(params.shared_w2.shape[1])
    if i_s != n_s * i_loc:
        raise ValueError(f"config.fuse_shared_experts: the shared intermediate size must be n_shared_experts "
                         f"x the routed one ({n_s} x {i_loc} = {n_s * i_loc}), got params.shared_w2 shape "
                         f"{tuple(params.shared_w2.shape)}")
    w13, s13, w2, s2 = _split_shared(params, n_s)
    w13, s13 = _prepare_weight(w13.astype(out.w13.dtype) if s13 is None else w13, s13, shared, arch)
    w2, s2 = _prepare_weight(w2.astype(out.w2.dtype) if s2 is None else w2, s2, shared, arch)

    def cat(a, b):
        return None if a is None else jnp.concatenate([a, b], axis=0)

    return out.replace(w13=cat(out.w13, w13), w13_scale=cat(out.w13_scale, s13), w2=cat(out.w2, w2),
                       w2_scale=cat(out.w2_scale, s2), shared_w13=None, shared_w2=None,
                       shared_w13_scale=None, shared_w2_scale=None, fused_shared=n_s)


# -- validation against a config ------------------------------------------------------------------

def expert_sizes(params: MoEParams, config: MoEConfig) -> tuple[int, int]:
    """(E_local, I_local) held by `params`, validated against `config`."""
    e_loc = params.num_local_experts
    if not 1 <= e_loc <= config.num_experts:
        fused = f" plus {params.fused_shared} fused shared" if params.fused_shared else ""
        raise ValueError(f"params.w13: expected 1..{config.num_experts} experts{fused} on axis 0, got "
                         f"shape {tuple(params.w13.shape)}")
    i_loc = params.local_intermediate_size
    i = config.intermediate_size
    if i_loc < 1 or i % i_loc:
        raise ValueError(f"params.w2: intermediate size {i_loc} (last axis of shape "
                         f"{tuple(params.w2.shape)}) must divide config.intermediate_size={i}")
    if get_recipe(config.recipe).is_quantized and i_loc % QUANT_SIZE_MULTIPLE:
        raise ValueError(f"params.w2: intermediate size {i_loc} must be a multiple of "
                         f"{QUANT_SIZE_MULTIPLE} for recipe {config.recipe!r}")
    return e_loc, i_loc


def check_params(params: MoEParams, config: MoEConfig) -> tuple[int, int]:
    """Validate shapes/dtypes of every field for `config`; returns (E_local, I_local)."""
    if not isinstance(params, MoEParams):
        raise TypeError(f"params: expected MoEParams, got {type(params).__name__}")
    e, h = config.num_experts, config.hidden_size
    check_shape("params.gate_weight", params.gate_weight, (e, h))
    check_dtype("params.gate_weight", params.gate_weight, FLOAT_DTYPES)
    if config.use_correction_bias:
        check_shape("params.e_score_correction_bias", params.e_score_correction_bias, (e,),
                    "config.use_correction_bias")
    elif params.e_score_correction_bias is not None:
        raise ValueError(f"params.e_score_correction_bias: expected None for config.use_correction_bias=False, "
                         f"got shape {tuple(params.e_score_correction_bias.shape)}")
    e_loc, i_loc = expert_sizes(params, config)
    if params.is_prepared:
        try:
            expect = config.gemm_recipe_on(params.gemm_arch)
        except ValueError as exc:
            raise ValueError(f"params: prepared as ({params.gemm_recipe!r}, arch {params.gemm_arch!r}), "
                             f"which config.recipe={config.recipe!r} cannot use: {exc}") from None
        if params.gemm_recipe != expect:
            raise ValueError(f"params: prepared as {params.gemm_recipe!r} for arch {params.gemm_arch}, "
                             f"but config.recipe={config.recipe!r} needs {expect!r}")
        _check_gemm_form(params, e_loc + params.fused_shared, i_loc, h)  # fused shared experts appended
    else:
        _check_checkpoint_form(params, config.recipe, e_loc, i_loc, h)
    _check_fusion(params, config)
    if config.n_shared_experts and not params.fused_shared:
        check_shared(params, config)
    elif any(getattr(params, n) is not None for n in SHARED_FIELDS):
        why = "fused shared experts" if params.fused_shared else "config.n_shared_experts=0"
        raise ValueError(f"params.shared_w13/shared_w2 (and scales): expected None for {why}, got arrays")
    if config.hash_routing:
        if params.tid2eid is None:
            raise ValueError("params.tid2eid: required when config.hash_routing is True, got None")
        check_shape("params.tid2eid", params.tid2eid, (config.vocab_size, config.top_k))
        check_dtype("params.tid2eid", params.tid2eid, (jnp.int32,))
    elif params.tid2eid is not None:  # route() would ignore it: the config is the wrong one
        raise ValueError(f"params.tid2eid: expected None for a layer with config.hash_routing=False, "
                         f"got an array of shape {tuple(params.tid2eid.shape)}")
    return e_loc, i_loc


SHARED_FIELDS = ("shared_w13", "shared_w2", "shared_w13_scale", "shared_w2_scale")


def _check_fusion(params: MoEParams, config: MoEConfig) -> None:
    """Prepared params are fused exactly when the config asks for it (checkpoint form: never)."""
    want = config.n_shared_experts if config.fuse_shared_experts and params.is_prepared else 0
    if params.fused_shared != want:
        raise ValueError(f"params.fused_shared: expected {want} (config.fuse_shared_experts="
                         f"{config.fuse_shared_experts}, n_shared_experts={config.n_shared_experts}, "
                         f"{'prepared' if params.is_prepared else 'checkpoint form'}), got {params.fused_shared}; "
                         "prepare checkpoint-form params with this config")


def check_shared(params: MoEParams, config: MoEConfig) -> int:
    """shared_w13 (2*I_s, H), shared_w2 (H, I_s) with I_s dividing I*n_shared (a tensor-parallel
    shard, or the whole when the shared expert is replicated); bf16 (any float dtype, no scales) or
    e4m3 with block scales, checkpoint form or the GEMM form of `params.gemm_arch` (module
    docstring); returns I_s."""
    h, full = config.hidden_size, config.shared_intermediate_size
    w13, w2 = params.shared_w13, params.shared_w2
    if w13 is None or w2 is None:
        raise ValueError("params.shared_w13/shared_w2: required when config.n_shared_experts > 0, got None")
    if w2.ndim != 2 or w2.shape[0] != h or w2.shape[1] < 1 or full % w2.shape[1]:
        raise ValueError(f"params.shared_w2: expected shape ({h}, I_s) with I_s dividing "
                         f"{full} (I * n_shared_experts), got {tuple(w2.shape)}")
    i_s = w2.shape[1]
    check_shape("params.shared_w13", w13, (2 * i_s, h))
    if params.shared_recipe != SHARED_FP8:
        check_dtype("params.shared_w13", w13, FLOAT_DTYPES)
        check_dtype("params.shared_w2", w2, FLOAT_DTYPES)
        for name in ("shared_w13_scale", "shared_w2_scale"):
            if getattr(params, name) is not None:
                raise ValueError(f"params.{name}: expected None for a bf16 shared expert "
                                 f"(params.shared_w13 dtype {w13.dtype.name}), got an array")
        return i_s
    check_dtype("params.shared_w2", w2, (E4M3,))
    for name, n, k in (("shared_w13", 2 * i_s, h), ("shared_w2", h, i_s)):
        shape, dtype, form = shared_scale_form(n, k, params.gemm_arch if params.is_prepared else None)
        check_shape(f"params.{name}_scale", getattr(params, f"{name}_scale"), shape, form)
        check_dtype(f"params.{name}_scale", getattr(params, f"{name}_scale"), (dtype,))
    return i_s


def shared_scale_form(n: int, k: int, arch: int | None) -> tuple[tuple[int, ...], jnp.dtype, str]:
    """(shape, dtype, description) of an fp8_block shared weight's scale for (N, K) values:
    checkpoint form (arch None) or the GEMM form of `arch`."""
    if arch is None:
        return (ceil_div(n, 128), ceil_div(k, 128)), jnp.dtype(jnp.float32), "128x128 block scales, checkpoint form"
    fmt = gemm_format(SHARED_FP8, arch)
    return fmt.rhs_scale_shape(1, n, k)[1:], fmt.scale_dtype, f"GEMM form of {fmt.describe()}"


def _check_expert(name: str, values, scale, value_shape, value_dtypes, scale_shape, scale_dtype) -> None:
    check_shape(f"params.{name}", values, value_shape)
    check_dtype(f"params.{name}", values, value_dtypes)
    if scale_shape is None:
        return
    check_shape(f"params.{name}_scale", scale, scale_shape)
    check_dtype(f"params.{name}_scale", scale, (scale_dtype,))


def _projections(e_loc: int, i_loc: int, h: int):
    """(name, N, K) of the two expert weights."""
    return (("w13", 2 * i_loc, h), ("w2", h, i_loc))


def _check_checkpoint_form(params, recipe, e_loc, i_loc, h) -> None:
    rec = get_recipe(recipe)
    for name, n, k in _projections(e_loc, i_loc, h):
        _check_expert(name, getattr(params, name), getattr(params, f"{name}_scale"),
                      (e_loc, n, k // rec.weight_k_pack), rec.value_dtypes,
                      rec.checkpoint_scale_shape(e_loc, n, k), jnp.float32)


def _check_gemm_form(params, e_loc, i_loc, h) -> None:
    fmt = gemm_format(params.gemm_recipe, params.gemm_arch)
    for name, n, k in _projections(e_loc, i_loc, h):
        _check_expert(name, getattr(params, name), getattr(params, f"{name}_scale"),
                      (e_loc, n, fmt.rhs_width(k)), fmt.rhs_dtypes, fmt.rhs_scale_shape(e_loc, n, k),
                      fmt.rhs_scale_dtype)
