"""Loading one MoE layer from safetensors files named like DeepSeek-V3/V4 Hugging Face checkpoints,
with the load-time weight paths (layouts/weight_paths.py) applied once, for the target GPU family.

    params = load_moe_params("/ckpt/DeepSeek-V3", config, layer=3, arch=90)
    params = load_moe_params(files, config, layer=3, expert_range=(32, 64))   # EP rank 1 of 8

Tensor names (prefix `model.layers.{layer}.mlp.`; E experts, H hidden, I = config.intermediate_size,
I_s = I * n_shared_experts):

    gate.weight                         (E, H)  float                 router
    gate.e_score_correction_bias        (E,)    float                 iff config.use_correction_bias
    gate.tid2eid                        (vocab, top_k) int            iff config.hash_routing
    experts.{e}.{gate,up}_proj.weight   (I, H)  \\  values, one of the formats below
    experts.{e}.down_proj.weight        (H, I)  /
    shared_experts.{gate,up}_proj.weight (I_s, H), shared_experts.down_proj.weight (H, I_s)
                                                                      iff config.n_shared_experts

Accepted expert formats, per projection of shape (N, K) (every expert of a layer in one format):

    format          .weight                 scale tensor (name: shape dtype)
    bf16            BF16 | F16 | F32 (N, K) none
    fp8_block       F8_E4M3 (N, K)          .weight_scale_inv: (ceil(N/128), ceil(K/128)) F32
    fp8_per_tensor  F8_E4M3 (N, K)          .weight_scale (or _inv): () or (1,) F32
    mxfp8           F8_E4M3 (N, K)          .weight_scale (or _inv): (N, K/32) U8 | F8_E8M0 | F32 (2^k)
    mxfp4           I8 | U8 (N, K/2)        .weight_scale (or _inv): (N, K/32) U8 | F8_E8M0 | F32 (2^k)
                    (two e2m1 codes per byte, element 2j in the low nibble)

Which checkpoint format serves which `config.recipe` (anything else is an error, not a conversion):

    bf16 <- bf16;  fp8_block <- fp8_block, fp8_per_tensor (expanded to 128x128 pseudo blocks);
    mxfp8 <- mxfp8, bf16 (quantized here, weight path D);  mxfp4 <- mxfp4

The shared expert may come in any of the five formats; it is dequantized to bf16 (the layer runs it
as a dense bf16 MLP), except with `shared_fp8=True`, which keeps an fp8_block (or fp8_per_tensor,
as 128x128 pseudo blocks) shared expert as e4m3 values + block scales, run through the dense FP8
GEMM (moe_jax/shared.py); its other formats are still dequantized to bf16. The returned `MoEParams` is in GEMM form for `arch` (`prepare=True`) or in
checkpoint form (`prepare=False`, e.g. to shard before preparing).

Reading: the safetensors header (8-byte little-endian length, then JSON) is parsed here and every
tensor is a read-only view of a memory map; numpy cannot name FP8 dtypes, so
`safetensors.safe_open(framework="numpy")` (0.8) refuses F8_E4M3/F8_E8M0 tensors — ml_dtypes
supplies them. Each expert tensor is copied once, straight into a preallocated stacked host buffer
(E_local, N, K): the layer's experts are never held twice on the host. Every tensor name, dtype and
shape is checked from the headers, and the small tensors whose values can be invalid (MX scales,
tid2eid) are checked, before any weight is stacked; all problems are reported together in one
`CheckpointError`, and nothing is returned half-loaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from layouts import get_recipe
from layouts.checks import ceil_div
from moe_jax.config import MoEConfig
from moe_jax.params import MoEParams

CHECKPOINT_FORMATS = ("bf16", "fp8_block", "fp8_per_tensor", "mxfp8", "mxfp4")
# config.recipe -> checkpoint formats it can be loaded from
RECIPE_SOURCES = {"bf16": ("bf16",), "fp8_block": ("fp8_block", "fp8_per_tensor"),
                  "mxfp8": ("mxfp8", "bf16"), "mxfp4": ("mxfp4",)}
DEFAULT_PREFIX = "model.layers.{layer}.mlp."
INDEX_FILE = "model.safetensors.index.json"

BLOCK = 128  # fp8_block weight block: 128x128 values share one scale
MX_GROUP = 32  # MXFP8 / MXFP4 scale group along K

_ST_DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16), "U16": np.dtype(np.uint16), "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32), "I64": np.dtype(np.int64), "U64": np.dtype(np.uint64),
    "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(np.uint8),  # exponent bytes; kept raw, converted by layouts.ue8m0_bytes_to_fp32
}
_FLOAT = ("BF16", "F16", "F32")
_INT = ("I8", "U8", "I16", "I32", "I64")
_E8M0 = ("U8", "F8_E8M0")
_PROJ = ("gate_proj", "up_proj", "down_proj")


class CheckpointError(ValueError):
    """A checkpoint that cannot provide what was asked; `problems` lists every reason."""

    def __init__(self, where: str, problems: Sequence[str]):
        self.problems = list(problems)
        lines = "\n  ".join(self.problems)
        super().__init__(f"{where}: {len(self.problems)} problem(s):\n  {lines}")


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors dtype name, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in `file`
    end: int


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Tensor table of one .safetensors file (no data read). Raises ValueError naming the file
    for a malformed header or an entry whose byte range disagrees with its dtype and shape."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        size = path.stat().st_size
        if n > size - 8:
            raise ValueError(f"{path}: header length {n} exceeds the file size {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    base = 8 + n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: malformed header entry for {name!r}: {entry!r}") from None
        if dtype in _ST_DTYPES:
            want = int(np.prod(shape, dtype=np.int64)) * _ST_DTYPES[dtype].itemsize
            if e - b != want or b < 0 or base + e > size:
                raise ValueError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) has byte range "
                                 f"[{b}, {e}) (expected {want} bytes within the file)")
        out[name] = TensorInfo(path, dtype, shape, base + b, base + e)
    return out


class SafetensorsCheckpoint:
    """All tensors of a checkpoint: one .safetensors file, a list of files, or a directory (its
    `model.safetensors.index.json` weight map if present, else every *.safetensors file in it).
    Headers are parsed once per file, lazily; `read` returns read-only memory-mapped views."""

    def __init__(self, path: str | os.PathLike | Sequence[str | os.PathLike]):
        if isinstance(path, (str, os.PathLike)):
            p = Path(path)
            if p.is_dir():
                index = p / INDEX_FILE
                if index.exists():
                    try:
                        weight_map = json.loads(index.read_text())["weight_map"]
                        files = sorted({p / f for f in weight_map.values()})
                    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                        raise ValueError(f"path: {index} is not an index with a 'weight_map' of "
                                         f"tensor name -> file ({type(exc).__name__}: {exc})") from None
                    absent = [str(f) for f in files if not f.is_file()]
                    if absent:
                        raise ValueError(f"path: {index} names file(s) that do not exist: {absent}")
                else:
                    files = sorted(p.glob("*.safetensors"))
                if not files:
                    raise ValueError(f"path: no *.safetensors files in directory {p}")
            elif p.is_file():
                files = [p]
            else:
                raise ValueError(f"path: {p} is neither a safetensors file nor a directory")
        else:
            files = [Path(f) for f in path]
            if not files:
                raise ValueError("path: expected at least one safetensors file, got an empty list")
            absent = [str(f) for f in files if not f.is_file()]
            if absent:
                raise ValueError(f"path: no such safetensors file(s): {absent}")
        self.files = files
        self._table: dict[str, TensorInfo] = {}
        for f in files:
            for name, info in read_safetensors_header(f).items():
                if name in self._table:
                    raise ValueError(f"checkpoint: tensor {name!r} appears in both "
                                     f"{self._table[name].file} and {f}")
                self._table[name] = info
        self._maps: dict[Path, np.memmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._table

    def keys(self) -> list[str]:
        return list(self._table)

    def info(self, name: str) -> TensorInfo:
        return self._table[name]

    def read(self, name: str) -> np.ndarray:
        """A read-only view (no copy) of tensor `name` with its numpy/ml_dtypes dtype."""
        info = self._table[name]
        if info.dtype not in _ST_DTYPES:
            raise TypeError(f"checkpoint: tensor {name!r} has dtype {info.dtype}, which this loader "
                            f"does not read (readable: {sorted(_ST_DTYPES)})")
        mm = self._maps.get(info.file)
        if mm is None:
            mm = self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        return mm[info.begin:info.end].view(_ST_DTYPES[info.dtype]).reshape(info.shape)


# -- planning: which tensors, which format, every problem found from the headers ----------------

@dataclass(frozen=True)
class _ProjPlan:
    weight: str
    scale: str | None


@dataclass
class _Plan:
    fmt: str | None = None
    scale_dtype: str | None = None  # mxfp8/mxfp4: "U8" (also for F8_E8M0) or "F32"
    weight_dtype: str | None = None
    experts: list = dataclasses.field(default_factory=list)  # [e_local][proj] -> _ProjPlan
    shared: dict = dataclasses.field(default_factory=dict)  # proj -> (fmt, _ProjPlan)


def _scale_name(ckpt: SafetensorsCheckpoint, w: str) -> str | None:
    base = w[: -len(".weight")]
    for suffix in (".weight_scale_inv", ".weight_scale"):
        if base + suffix in ckpt:
            return base + suffix
    return None


def _classify(ckpt: SafetensorsCheckpoint, w: str, n: int, k: int, problems: list[str]):
    """Format of projection `w` ((N, K) logical), or None after appending its problems. Scale
    values are part of a projection's validity: they are read and checked here (small tensors),
    before any weight is stacked."""
    if w not in ckpt:
        problems.append(f"missing {w}")
        return None
    info = ckpt.info(w)
    sname = _scale_name(ckpt, w)
    sinfo = ckpt.info(sname) if sname else None

    def bad_shape(name, got, want, what=""):
        problems.append(f"{name}: expected shape {tuple(want)}{what}, got {tuple(got)}")

    if info.dtype in _FLOAT:
        if info.shape != (n, k):
            bad_shape(w, info.shape, (n, k))
            return None
        if sname:
            problems.append(f"{sname}: unexpected scale for {info.dtype} weight {w}")
            return None
        return "bf16", _ProjPlan(w, None)
    if info.dtype == "F8_E4M3":
        if info.shape != (n, k):
            bad_shape(w, info.shape, (n, k))
            return None
        base = w[: -len(".weight")]
        if sinfo is None:
            problems.append(f"missing {base}.weight_scale_inv (or .weight_scale) for F8_E4M3 weight {w}")
            return None
        blocks = (ceil_div(n, BLOCK), ceil_div(k, BLOCK))
        groups = (n, ceil_div(k, MX_GROUP))
        if sinfo.shape in ((), (1,)):
            fmt = "fp8_per_tensor"
        elif sinfo.shape == blocks and sinfo.shape != groups:
            fmt = "fp8_block"
        elif sinfo.shape == groups:
            fmt = "mxfp8"
        else:
            problems.append(f"{sname}: expected shape {blocks} (128x128 blocks), {groups} (MXFP8 "
                            f"1x32 groups) or () (per tensor) for weight {w} {(n, k)}, got {sinfo.shape}")
            return None
        allowed = _E8M0 + ("F32",) if fmt == "mxfp8" else ("F32",)
        if sinfo.dtype not in allowed:
            problems.append(f"{sname}: expected dtype in {allowed} for format {fmt}, got {sinfo.dtype}")
            return None
        if fmt == "mxfp8" and _mx_scale_problem(ckpt, sname, problems):
            return None
        if fmt != "mxfp8":  # block / per-tensor scales multiply the values: 0, < 0, inf, nan are corrupt
            sc = ckpt.read(sname)
            bad = int(np.count_nonzero(~(np.isfinite(sc) & (sc > 0))))
            if bad:
                problems.append(f"{sname}: {bad} F32 scale(s) are not positive finite numbers")
                return None
        return fmt, _ProjPlan(w, sname)
    if info.dtype in ("I8", "U8"):
        if k % 2 or info.shape != (n, k // 2):
            bad_shape(w, info.shape, (n, k // 2), " (MXFP4: two e2m1 codes per byte)")
            return None
        groups = (n, ceil_div(k, MX_GROUP))
        if sinfo is None:
            problems.append(f"missing {w[:-len('.weight')]}.weight_scale for MXFP4 weight {w}")
            return None
        if sinfo.shape != groups:
            bad_shape(sname, sinfo.shape, groups, " (MXFP4: one scale per 32 values along K)")
            return None
        if sinfo.dtype not in _E8M0 + ("F32",):
            problems.append(f"{sname}: expected dtype U8, F8_E8M0 or F32 (MXFP4 scales), got {sinfo.dtype}")
            return None
        if _mx_scale_problem(ckpt, sname, problems):
            return None
        return "mxfp4", _ProjPlan(w, sname)
    problems.append(f"{w}: dtype {info.dtype} is not an accepted expert weight dtype "
                    f"(BF16/F16/F32, F8_E4M3, or I8/U8 packed e2m1)")
    return None


def _proj_shapes(h: int, i: int) -> dict[str, tuple[int, int]]:
    return {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def _plan(ckpt, config, prefix, expert_range, problems) -> _Plan:
    plan = _Plan()
    h, i = config.hidden_size, config.intermediate_size
    shapes = _proj_shapes(h, i)
    seen: dict[str, str] = {}  # first tensor that fixed the format / dtypes
    for e in range(*expert_range):
        row = {}
        for proj in _PROJ:
            w = f"{prefix}experts.{e}.{proj}.weight"
            got = _classify(ckpt, w, *shapes[proj], problems)
            if got is None:
                continue
            fmt, pp = got
            sdt = None
            if pp.scale and fmt in ("mxfp8", "mxfp4"):
                sdt = "U8" if ckpt.info(pp.scale).dtype in _E8M0 else "F32"
            wdt = ckpt.info(w).dtype
            if plan.fmt is None:
                plan.fmt, plan.scale_dtype, plan.weight_dtype = fmt, sdt, wdt
                seen["fmt"] = w
            elif (fmt, sdt, wdt) != (plan.fmt, plan.scale_dtype, plan.weight_dtype):
                problems.append(f"{w}: format {fmt} (weight {wdt}, scale {sdt}) differs from "
                                f"{plan.fmt} (weight {plan.weight_dtype}, scale {plan.scale_dtype}) "
                                f"of {seen['fmt']}; every expert of a layer must share one format")
            row[proj] = pp
        plan.experts.append(row)
    if config.n_shared_experts:
        i_s = config.shared_intermediate_size
        for proj, shp in _proj_shapes(h, i_s).items():
            got = _classify(ckpt, f"{prefix}shared_experts.{proj}.weight", *shp, problems)
            if got is not None:
                plan.shared[proj] = got
    return plan


def _check_small(ckpt, name, shape, kinds, problems, required: bool):
    if name not in ckpt:
        if required:
            problems.append(f"missing {name}")
        return
    info = ckpt.info(name)
    if info.shape != shape:
        problems.append(f"{name}: expected shape {shape}, got {info.shape}")
    if info.dtype not in kinds:
        problems.append(f"{name}: expected dtype in {kinds}, got {info.dtype}")


# -- reading --------------------------------------------------------------------------------------

def _mx_scale_problem(ckpt: SafetensorsCheckpoint, name: str, problems: list[str]) -> bool:
    """Appends the problem with the values of MX scale tensor `name` (UE8M0 bytes or F32), if any.
    Byte 0 (2^-127, below fp32's normal range) and 255 (NaN) are refused, as are F32 scales that
    are not positive powers of two (the GEMMs would silently round them)."""
    s = ckpt.read(name)
    if s.dtype == np.uint8:
        bad = int(np.count_nonzero((s == 0) | (s == 255)))
        msg = f"{name}: {bad} scale byte(s) are 0 or 255 (2^-127 / NaN are not usable UE8M0 scales)"
    else:
        mant, _ = np.frexp(s)
        bad = int(np.count_nonzero(~((mant == 0.5) & np.isfinite(s))))
        msg = f"{name}: {bad} F32 scale(s) are not positive powers of two (MX formats need UE8M0 scales)"
    if bad:
        problems.append(msg)
    return bool(bad)


def _stack_experts(ckpt, plan: _Plan, config: MoEConfig, which: str):
    """Stacked checkpoint-form values (E_loc, N, Kv) and scale (or None) for "w13" or "w2"."""
    h, i = config.hidden_size, config.intermediate_size
    e_loc = len(plan.experts)
    projs = ("gate_proj", "up_proj") if which == "w13" else ("down_proj",)
    n, k = (2 * i, h) if which == "w13" else (h, i)
    fmt = plan.fmt
    wdt = _ST_DTYPES[plan.weight_dtype]
    if fmt == "bf16":
        wdt = np.dtype(ml_dtypes.bfloat16)
    elif fmt == "mxfp4":
        wdt = np.dtype(np.int8)
    kv = k // 2 if fmt == "mxfp4" else k
    values = np.empty((e_loc, n, kv), wdt)
    if fmt == "bf16":
        scale = None
    elif fmt == "fp8_block":
        scale = np.empty((e_loc, ceil_div(n, BLOCK), ceil_div(k, BLOCK)), np.float32)
    elif fmt == "fp8_per_tensor":
        scale = np.empty((e_loc, len(projs)), np.float32)
    else:
        scale = np.empty((e_loc, n, ceil_div(k, MX_GROUP)), np.uint8 if plan.scale_dtype == "U8" else np.float32)
    for e, row in enumerate(plan.experts):
        r0 = 0
        for j, proj in enumerate(projs):
            pp = row[proj]
            w = ckpt.read(pp.weight)
            rows = w.shape[0]
            if fmt == "mxfp4":
                w = w.view(np.int8)
            values[e, r0:r0 + rows] = w  # the one host copy (casts F16/F32 -> bf16 on the way)
            if fmt == "fp8_block":
                rb = rows // BLOCK  # quantized recipes: I is a multiple of 128, blocks do not straddle
                scale[e, r0 // BLOCK:r0 // BLOCK + rb] = ckpt.read(pp.scale)
            elif fmt == "fp8_per_tensor":
                scale[e, j] = ckpt.read(pp.scale).reshape(())
            elif fmt in ("mxfp8", "mxfp4"):  # values checked by _classify
                scale[e, r0:r0 + rows] = ckpt.read(pp.scale)
            r0 += rows
    return values, scale


def _to_checkpoint_form(values, scale, fmt, recipe, n_split, k):
    """Host buffers -> jax arrays in the checkpoint form of `recipe` (MoEParams docstring)."""
    import jax
    import jax.numpy as jnp

    import layouts

    v = jax.device_put(values)
    if fmt == "bf16":
        if recipe == "mxfp8":  # weight path D: from high-precision weights
            return layouts.quantize_mxfp8(v, MX_GROUP)
        return v, None
    if fmt == "fp8_per_tensor":
        # each projection's scalar -> its own pseudo blocks (gate and up keep their own scales)
        parts = [layouts.expand_per_tensor_scale(jnp.asarray(scale[:, j]), rows, k, BLOCK)
                 for j, rows in enumerate(n_split)]
        return v, jnp.concatenate(parts, axis=1)
    s = jnp.asarray(scale)
    if s.dtype == jnp.uint8:
        s = layouts.ue8m0_bytes_to_fp32(s)
    return v, s


def _dequantize_shared(ckpt, fmt: str, pp: _ProjPlan, n: int, k: int):
    """One shared-expert projection -> (N, K) bf16 jax array."""
    import jax.numpy as jnp

    import layouts

    w = np.array(ckpt.read(pp.weight))  # a copy: jax may alias host memory, never the file map
    if fmt == "bf16":
        return jnp.asarray(w).astype(jnp.bfloat16)
    s = np.array(ckpt.read(pp.scale))
    if fmt in ("mxfp8", "mxfp4"):  # values checked by _classify
        s = layouts.ue8m0_bytes_to_fp32(jnp.asarray(s)) if s.dtype == np.uint8 else jnp.asarray(s)
        if fmt == "mxfp4":
            return layouts.dequantize_mxfp4(jnp.asarray(w.view(np.int8)), s, MX_GROUP, jnp.bfloat16)
        return layouts.dequantize_fp8_per_token_group(jnp.asarray(w), s, MX_GROUP, jnp.bfloat16)
    if fmt == "fp8_per_tensor":
        s = layouts.expand_per_tensor_scale(jnp.asarray(s.reshape(())), n, k, BLOCK)
    return layouts.dequantize_fp8_per_block(jnp.asarray(w), jnp.asarray(s), BLOCK, jnp.bfloat16)


def _fp8_shared(ckpt, plan: _Plan, h: int, i_s: int) -> dict:
    """An fp8_block / fp8_per_tensor shared expert kept as FP8: {shared_w13 (2*I_s, H) e4m3,
    shared_w13_scale (2*I_s/128, ceil(H/128)) f32, shared_w2 (H, I_s) e4m3, shared_w2_scale} in
    checkpoint form (MoEParams fields); {} when its projections are not all FP8 with block scales."""
    import jax.numpy as jnp

    import layouts

    if not all(plan.shared[p][0] in ("fp8_block", "fp8_per_tensor") for p in _proj_shapes(h, i_s)):
        return {}
    if i_s % BLOCK:  # gate and up blocks would share scale rows once stacked
        raise ValueError(f"shared_fp8: the shared intermediate size must be a multiple of {BLOCK}, got {i_s}")
    out = {}
    for p, (n, k) in _proj_shapes(h, i_s).items():
        fmt, pp = plan.shared[p]
        s = jnp.asarray(np.array(ckpt.read(pp.scale), np.float32))
        if fmt == "fp8_per_tensor":
            s = layouts.expand_per_tensor_scale(s.reshape(()), n, k, BLOCK)
        out[p] = (jnp.asarray(np.array(ckpt.read(pp.weight))), s)
    (g, gs), (u, us), (d, ds) = (out[p] for p in ("gate_proj", "up_proj", "down_proj"))
    return dict(shared_w13=jnp.concatenate([g, u]), shared_w13_scale=jnp.concatenate([gs, us]),
                shared_w2=d, shared_w2_scale=ds)


def load_moe_params(checkpoint: str | os.PathLike | Sequence | SafetensorsCheckpoint, config: MoEConfig,
                    *, layer: int | None = None, arch: int | None = None,
                    expert_range: tuple[int, int] | None = None, prefix: str | None = None,
                    prepare: bool = True, shared_fp8: bool = False) -> MoEParams:
    """The MoE layer `layer` of a DeepSeek-style safetensors checkpoint as `MoEParams`.

    checkpoint: file, list of files, directory, or an open `SafetensorsCheckpoint`.
    prefix: tensor-name prefix (default `model.layers.{layer}.mlp.`; give one of the two).
    arch: target GPU family 90 | 100 (None -> config.gemm_arch; must equal it); it picks the load-time path
    (weight paths, layouts/weight_paths.py: fp8_block on 100 -> UE8M0 requant C; mxfp4 on 90 -> FP4->FP8 B, on 100 -> A;
    mxfp8 -> D). expert_range: (start, stop) global expert ids held by this rank (EP); only those
    experts are read; the router, bias and shared expert are whole.
    prepare: True -> GEMM form for `arch` (`prepare_params`); False -> checkpoint form.
    shared_fp8: True keeps an FP8 (fp8_block / fp8_per_tensor) shared expert as FP8 (module docstring).
    Returns MoEParams with w13 (E_local, 2I, K[/2]), w2 (E_local, H, I[/2]) and scales; the router
    weight and correction bias in f32, the shared expert in bf16 (or FP8, shared_fp8), tid2eid in int32.
    Raises CheckpointError (a ValueError) listing every missing, mis-shaped or mis-typed tensor,
    a format the recipe cannot be loaded from, or invalid scale values; ValueError for a target
    arch that cannot run the recipe or a bad expert_range.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config: expected MoEConfig, got {type(config).__name__}")
    if (layer is None) == (prefix is None):
        raise ValueError(f"layer/prefix: give exactly one, got layer={layer!r}, prefix={prefix!r}")
    if prefix is None:
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise ValueError(f"layer: expected a non-negative int, got {layer!r}")
        prefix = DEFAULT_PREFIX.format(layer=layer)
    if arch is None:
        arch = config.gemm_arch
    runs_on = tuple(sorted(get_recipe(config.recipe).supported_archs))
    if arch not in runs_on:
        raise ValueError(f"arch: target arch {arch!r} cannot run recipe {config.recipe!r} "
                         f"(runs on {runs_on})")
    if arch != config.gemm_arch:  # the layer runs params in the form of config.gemm_arch
        raise ValueError(f"arch: {arch} disagrees with config.gemm_arch={config.gemm_arch} "
                         f"(set MoEConfig.arch={arch})")
    e = config.num_experts
    if expert_range is None:
        expert_range = (0, e)
    start, stop = expert_range
    if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= e):
        raise ValueError(f"expert_range: expected (start, stop) with 0 <= start < stop <= "
                         f"num_experts={e}, got {expert_range!r}")
    ckpt = checkpoint if isinstance(checkpoint, SafetensorsCheckpoint) else SafetensorsCheckpoint(checkpoint)
    where = f"checkpoint layer prefix {prefix!r}"

    problems: list[str] = []
    h = config.hidden_size
    _check_small(ckpt, f"{prefix}gate.weight", (e, h), _FLOAT, problems, required=True)
    bias = f"{prefix}gate.e_score_correction_bias"
    _check_small(ckpt, bias, (e,), _FLOAT, problems, required=config.use_correction_bias)
    if not config.use_correction_bias and bias in ckpt:
        problems.append(f"{bias}: present, but config.use_correction_bias is False (routing would "
                        "silently differ from the model's)")
    tid = f"{prefix}gate.tid2eid"
    if config.hash_routing:
        n_before = len(problems)
        _check_small(ckpt, tid, (config.vocab_size, config.top_k), _INT, problems, required=True)
        if len(problems) == n_before:  # well-formed: its ids must name experts (routing gathers them)
            ids = ckpt.read(tid)
            bad = int(np.count_nonzero((ids < 0) | (ids >= e)))
            if bad:
                problems.append(f"{tid}: {bad} expert id(s) outside [0, {e}) (values "
                                f"{int(ids.min())}..{int(ids.max())})")
    elif tid in ckpt:
        problems.append(f"{tid}: present (a hash-routed layer), but config.hash_routing is False")
    plan = _plan(ckpt, config, prefix, expert_range, problems)
    if plan.fmt is not None and plan.fmt not in RECIPE_SOURCES[config.recipe]:
        problems.append(f"recipe {config.recipe!r} cannot be loaded from {plan.fmt} expert weights "
                        f"(it loads from {RECIPE_SOURCES[config.recipe]})")
    if problems:
        raise CheckpointError(where, problems)

    import jax.numpy as jnp

    from moe_jax.params import prepare_params
    from moe_jax.params import check_params

    i = config.intermediate_size
    w13, s13 = _to_checkpoint_form(*_stack_experts(ckpt, plan, config, "w13"), plan.fmt,
                                   config.recipe, (i, i), h)
    w2, s2 = _to_checkpoint_form(*_stack_experts(ckpt, plan, config, "w2"), plan.fmt,
                                 config.recipe, (h,), i)
    shared_w13 = shared_w2 = None
    shared_fp8_parts = {}
    if config.n_shared_experts:
        i_s = config.shared_intermediate_size
        shared_fp8_parts = _fp8_shared(ckpt, plan, h, i_s) if shared_fp8 else {}
        if not shared_fp8_parts:
            g, u, d = (_dequantize_shared(ckpt, *plan.shared[p], *shp)
                       for p, shp in _proj_shapes(h, i_s).items())
            shared_w13, shared_w2 = jnp.concatenate([g, u], axis=0), d
    params = MoEParams(
        gate_weight=jnp.asarray(np.array(ckpt.read(f"{prefix}gate.weight"), np.float32)),
        w13=w13, w2=w2, w13_scale=s13, w2_scale=s2,
        e_score_correction_bias=(jnp.asarray(np.array(ckpt.read(bias), np.float32))
                                 if config.use_correction_bias else None),
        **(shared_fp8_parts or dict(shared_w13=shared_w13, shared_w2=shared_w2)),
        tid2eid=jnp.asarray(np.array(ckpt.read(tid), np.int32)) if config.hash_routing else None,
    )
    check_params(params, config)
    return prepare_params(params, config, arch) if prepare else params
