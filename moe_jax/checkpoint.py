"""Loading one MoE layer from safetensors files named like DeepSeek-V3/V4 checkpoints, with the
load-time weight paths (layouts/weight_paths.py) applied once, for the target GPU family.

    config, params = load_moe_layer("/ckpt/DeepSeek-V4", layer=5, arch=100)   # config from config.json
    params = load_moe_params("/ckpt/DeepSeek-V3", config, layer=3, arch=90)
    params = load_moe_params(files, config, layer=3, expert_range=(32, 64))   # EP rank 1 of 8

Tensor namings, detected from the tensor names (the index's weight map, else the headers);
`prefix=` overrides the prefix (the leaf names are then detected under it):

    naming   prefix                      router bias                   projections gate / up / down
    v3       model.layers.{L}.mlp.       gate.e_score_correction_bias  gate_proj / up_proj / down_proj
    v4       layers.{L}.ffn.             gate.bias                     w1 / w3 / w2
    v4_hf    model.layers.{L}.ffn.       gate.bias                     w1 / w3 / w2

Leaves under the prefix (E experts, H hidden, I = config.intermediate_size, I_s = I * n_shared_experts):

    gate.weight                          (E, H)  float                 router
    <router bias>                        (E,)    float                 iff config.use_correction_bias
    gate.tid2eid                         (vocab, top_k) int            iff config.hash_routing (no bias)
    experts.{e}.<gate|up>.weight         (I, H)  \\  values, one of the formats below
    experts.{e}.<down>.weight            (H, I)  /
    shared_experts.<gate|up>.weight (I_s, H), shared_experts.<down>.weight (H, I_s)
                                                                       iff config.n_shared_experts

A scale tensor is named `<weight name without .weight>` + `.weight_scale_inv`, `.weight_scale` or
`.scale`. Accepted formats, per projection of shape (N, K) (every routed expert of a layer in one):

    format          .weight                 scale: shape, dtype
    bf16            BF16 | F16 | F32 (N, K) none
    fp8_block       F8_E4M3 (N, K)          (ceil(N/128), ceil(K/128)): F32 | BF16 | F8_E8M0
    fp8_per_tensor  F8_E4M3 (N, K)          () or (1,): F32 | BF16
    mxfp8           F8_E4M3 (N, K)          (N, ceil(K/32)): F8_E8M0 | U8 | F32 | BF16 (powers of two)
    mxfp4           I8 | U8 (N, K/2)        (N, ceil(K/32)): F8_E8M0 | U8 | F32 | BF16 (powers of two)
                    (two e2m1 codes per byte, element 2j in the low nibble)

F8_E8M0 (UE8M0) is one exponent byte per scale, value 2^(b-127); bytes 0 and 255 (NaN) are refused.
F32/BF16 block and per-tensor scales must be positive finite numbers. Power-of-two block scales
(e.g. E8M0 ones) stay exact through dequantization and the arch-100 requantization (path C).

Which checkpoint format serves which `config.recipe` (anything else is an error, not a conversion):

    bf16 <- bf16;  fp8_block <- fp8_block, fp8_per_tensor (expanded to 128x128 pseudo blocks);
    mxfp8 <- mxfp8, bf16 (quantized here, weight path D);  mxfp4 <- mxfp4

The shared expert may come in any of the five formats. One stored as FP8 with 128x128 block (or
per-tensor, expanded to pseudo blocks) scales stays FP8, as it ships, and runs through the dense
FP8 GEMM (moe_jax/shared.py), when its intermediate size is a multiple of 128; any other is
dequantized to bf16 (a dense bf16 MLP). `shared_fp8=True` requires FP8, `False` always dequantizes.
The returned `MoEParams` is in GEMM form for `arch` (`prepare=True`) or in
checkpoint form (`prepare=False`, e.g. to shard before preparing).

The config: a checkpoint directory's `config.json` (moe_jax/hf_config.py) gives the layer's
`MoEConfig` when none is passed, says which layers are MoE / hash-MoE / dense, and an explicit
config that disagrees with it is an error naming the field and quoting the file (or, for a key it
lacks, the model_type's default that was assumed).

Reading: with a `model.safetensors.index.json` the tensor names come from its weight map and a
shard's header is read only when one of its tensors is needed; the safetensors header (8-byte
little-endian length, then JSON) is parsed here; numpy cannot name FP8 dtypes, so
`safetensors.safe_open(framework="numpy")` (0.8) refuses F8_E4M3/F8_E8M0 tensors — ml_dtypes
supplies them. The loader reads with pread (no file pages stay mapped in the process;
`SafetensorsCheckpoint.read` offers read-only memory-mapped views): each expert tensor is copied
once, straight from the file into a preallocated, 64-byte aligned stacked host buffer
(E_local, N, K) that jax on the CPU adopts without a copy, so the layer's experts are never held
twice on the host (`python -m moe_jax.bench load` measures the peak). Every tensor name, dtype and
shape is checked from the headers, and the small tensors whose values can be invalid (scales,
tid2eid) are checked, before any weight is stacked; all problems are reported together in one
`CheckpointError` (the first 20 listed, then a count), and nothing is returned half-loaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from layouts import get_recipe
from layouts.checks import ceil_div
from moe_jax import hf_config
from moe_jax.config import MoEConfig
from moe_jax.params import MoEParams

CHECKPOINT_FORMATS = ("bf16", "fp8_block", "fp8_per_tensor", "mxfp8", "mxfp4")
# config.recipe -> checkpoint formats it can be loaded from
RECIPE_SOURCES = {"bf16": ("bf16",), "fp8_block": ("fp8_block", "fp8_per_tensor"),
                  "mxfp8": ("mxfp8", "bf16"), "mxfp4": ("mxfp4",)}
INDEX_FILE = "model.safetensors.index.json"
MAX_LISTED = 20  # problems listed in a CheckpointError's message; the rest are counted

BLOCK = 128  # fp8_block weight block: 128x128 values share one scale
MX_GROUP = 32  # MXFP8 / MXFP4 scale group along K
HOST_ALIGN = 64  # stacked host buffers: jax's CPU client adopts 64-byte aligned arrays without a copy

_ST_DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16), "U16": np.dtype(np.uint16), "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32), "I64": np.dtype(np.int64), "U64": np.dtype(np.uint64),
    "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(np.uint8),  # exponent bytes; kept raw, converted by _scale_to_f32 / layouts
}
_FLOAT = ("BF16", "F16", "F32")
_INT = ("I8", "U8", "I16", "I32", "I64")
_E8M0 = ("U8", "F8_E8M0")
_SCALE_FLOAT = ("F32", "BF16")
_PROJ = ("gate_proj", "up_proj", "down_proj")
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".scale")


@dataclass(frozen=True)
class Naming:
    """How a checkpoint names one MoE layer's tensors (module docstring table)."""

    name: str
    prefix: str  # with {layer}
    bias: str  # router correction bias leaf
    gate: str  # projection leaves
    up: str
    down: str

    def proj(self, p: str) -> str:
        return {"gate_proj": self.gate, "up_proj": self.up, "down_proj": self.down}[p]


NAMINGS = {
    "v3": Naming("v3", "model.layers.{layer}.mlp.", "gate.e_score_correction_bias",
                 "gate_proj", "up_proj", "down_proj"),
    "v4": Naming("v4", "layers.{layer}.ffn.", "gate.bias", "w1", "w3", "w2"),
    "v4_hf": Naming("v4_hf", "model.layers.{layer}.ffn.", "gate.bias", "w1", "w3", "w2"),
}
DEFAULT_PREFIX = NAMINGS["v3"].prefix
_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
_MOE_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(?:mlp|ffn)\.gate\.weight$")


class CheckpointError(ValueError):
    """A checkpoint that cannot provide what was asked; `problems` lists every reason (the
    message lists the first MAX_LISTED and counts the rest)."""

    def __init__(self, where: str, problems: Sequence[str]):
        self.problems = list(problems)
        shown = self.problems[:MAX_LISTED]
        more = len(self.problems) - len(shown)
        lines = "\n  ".join(shown + ([f"... and {more} more"] if more else []))
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
    for a malformed header, a file shorter than its header says ("truncated"), or an entry whose
    byte range disagrees with its dtype and shape or ends past the end of the file ("truncated")."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file, or truncated (shorter than its 8-byte "
                             f"header length)")
        (n,) = struct.unpack("<Q", raw)
        size = path.stat().st_size
        if n > size - 8:
            raise ValueError(f"{path}: truncated or not a safetensors file: header length {n} exceeds "
                             f"the file size {size}")
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
            if e - b != want or b < 0:
                raise ValueError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) has byte range "
                                 f"[{b}, {e}) (expected {want} bytes)")
            if base + e > size:
                raise ValueError(f"{path}: truncated: tensor {name!r} ({dtype} {list(shape)}) ends at "
                                 f"byte {base + e}, the file has {size} bytes")
        out[name] = TensorInfo(path, dtype, shape, base + b, base + e)
    return out


class SafetensorsCheckpoint:
    """All tensors of a checkpoint: one .safetensors file, a list of files, or a directory (its
    `model.safetensors.index.json` weight map if present, else every *.safetensors file in it).
    With an index, a shard's header is parsed only when one of its tensors is first looked at;
    otherwise every header is parsed here. `read` returns read-only memory-mapped views."""

    def __init__(self, path: str | os.PathLike | Sequence[str | os.PathLike]):
        self._headers: dict[Path, dict[str, TensorInfo]] = {}
        self._where: dict[str, Path] = {}  # tensor name -> file
        self.directory: Path | None = None  # where config.json is looked for
        weight_map = None
        if isinstance(path, (str, os.PathLike)):
            p = Path(path)
            if p.is_dir():
                self.directory = p
                index = p / INDEX_FILE
                if index.exists():
                    try:
                        weight_map = json.loads(index.read_text())["weight_map"]
                        self._where = {str(k): p / v for k, v in weight_map.items()}
                    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                        raise ValueError(f"path: {index} is not an index with a 'weight_map' of "
                                         f"tensor name -> file ({type(exc).__name__}: {exc})") from None
                    files = sorted(set(self._where.values()))
                    absent = [str(f) for f in files if not f.is_file()]
                    if absent:
                        raise ValueError(f"path: {index} names file(s) that do not exist: {absent}")
                else:
                    files = sorted(p.glob("*.safetensors"))
                if not files:
                    raise ValueError(f"path: no *.safetensors files in directory {p}")
            elif p.is_file():
                files = [p]
                self.directory = p.parent
            else:
                raise ValueError(f"path: {p} is neither a safetensors file nor a directory")
        else:
            files = [Path(f) for f in path]
            if not files:
                raise ValueError("path: expected at least one safetensors file, got an empty list")
            absent = [str(f) for f in files if not f.is_file()]
            if absent:
                raise ValueError(f"path: no such safetensors file(s): {absent}")
            self.directory = files[0].parent
        self.files = files
        if weight_map is None:
            for f in files:
                for name in self._header(f):
                    if name in self._where:
                        raise ValueError(f"checkpoint: tensor {name!r} appears in both "
                                         f"{self._where[name]} and {f}")
                    self._where[name] = f
        self._maps: dict[Path, np.memmap] = {}

    def _header(self, f: Path) -> dict[str, TensorInfo]:
        h = self._headers.get(f)
        if h is None:
            h = self._headers[f] = read_safetensors_header(f)
        return h

    @property
    def headers_read(self) -> int:
        """How many files' headers have been parsed so far."""
        return len(self._headers)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def info(self, name: str) -> TensorInfo:
        f = self._where[name]
        h = self._header(f)
        if name not in h:
            raise ValueError(f"checkpoint: {INDEX_FILE} places tensor {name!r} in {f}, whose header "
                             f"does not have it")
        return h[name]

    def read(self, name: str) -> np.ndarray:
        """A read-only view (no copy) of tensor `name` with its numpy/ml_dtypes dtype."""
        info = self.info(name)
        if info.dtype not in _ST_DTYPES:
            raise TypeError(f"checkpoint: tensor {name!r} has dtype {info.dtype}, which this loader "
                            f"does not read (readable: {sorted(_ST_DTYPES)})")
        mm = self._maps.get(info.file)
        if mm is None:
            mm = self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        return mm[info.begin:info.end].view(_ST_DTYPES[info.dtype]).reshape(info.shape)

    def read_into(self, name: str, out: np.ndarray) -> None:
        """Copy tensor `name` into the C-contiguous array `out` (its shape; a dtype of the same bytes,
        or a float dtype the values are cast to). Same-byte tensors go from the file straight into
        `out` (pread: no memory map, so the file's pages never count in this process's RSS)."""
        info = self.info(name)
        src = _ST_DTYPES.get(info.dtype)
        if src is None or tuple(out.shape) != info.shape:
            raise ValueError(f"checkpoint: cannot read {name!r} ({info.dtype} {list(info.shape)}) into "
                             f"{out.dtype} {list(out.shape)}")
        same_bytes = src == out.dtype or (src.kind in "iu" and out.dtype.kind in "iu"
                                          and src.itemsize == out.dtype.itemsize == 1)
        if not (same_bytes and out.flags.c_contiguous):
            out[...] = self.read(name)  # a cast (F16/F32 -> bf16) through the memory map
            return
        view = memoryview(out.reshape(-1).view(np.uint8))
        fd = os.open(info.file, os.O_RDONLY)
        try:
            done, size = 0, info.end - info.begin
            while done < size:
                got = os.preadv(fd, [view[done:]], info.begin + done)
                if got <= 0:
                    raise ValueError(f"{info.file}: truncated: tensor {name!r} ends at byte {info.end}, "
                                     f"reading stopped at {info.begin + done}")
                done += got
        finally:
            os.close(fd)

    def read_copy(self, name: str) -> np.ndarray:
        """Tensor `name` as a new array (read with pread: no file pages stay mapped in this process)."""
        info = self.info(name)
        if info.dtype not in _ST_DTYPES:
            raise TypeError(f"checkpoint: tensor {name!r} has dtype {info.dtype}, which this loader "
                            f"does not read (readable: {sorted(_ST_DTYPES)})")
        out = np.empty(info.shape, _ST_DTYPES[info.dtype])
        self.read_into(name, out)
        return out

    def layers(self) -> tuple[list[int], list[int]]:
        """(layer indices with any tensor, layer indices with a MoE router `gate.weight`)."""
        held, moe = set(), set()
        for name in self._where:
            m = _LAYER_RE.match(name)
            if m:
                held.add(int(m.group(1)))
                if _MOE_RE.match(name):
                    moe.add(int(m.group(1)))
        return sorted(held), sorted(moe)


def detect_naming(ckpt: SafetensorsCheckpoint, *, layer: int | None = None, prefix: str | None = None,
                  kinds: tuple[str, ...] | None = None) -> tuple[Naming, str]:
    """(naming, prefix) of layer `layer`, or of the tensors under an explicit `prefix` (its leaf
    names decide v3 vs v4 leaves). Raises CheckpointError when no naming has tensors for the layer
    (listing the layers the files hold, and config.json's layer `kinds` when given) or more than
    one has."""
    if prefix is not None:
        under = [k[len(prefix):] for k in ckpt.keys() if k.startswith(prefix)]
        v4 = any(k == "gate.bias" or re.match(r"(shared_experts|experts\.\d+)\.w[123]\.", k) for k in under)
        return (NAMINGS["v4"] if v4 else NAMINGS["v3"]), prefix
    hits = []
    for naming in NAMINGS.values():
        p = naming.prefix.format(layer=layer)
        if any(k.startswith(p) for k in ckpt.keys()):
            hits.append((naming, p))
    if len(hits) == 1:
        return hits[0]
    held, moe = ckpt.layers()
    tried = ", ".join(n.prefix.format(layer=layer) for n in NAMINGS.values())
    if not hits:
        raise CheckpointError(f"checkpoint layer {layer}", [
            f"no tensor of layer {layer} under any known naming ({tried}); the files hold layers "
            f"{hf_config.format_ranges(held)}, with a MoE router (gate.weight) in layers {hf_config.format_ranges(moe)}"
            + (f"; config.json's layers: {hf_config.describe_kinds(kinds)}" if kinds else "")])
    raise CheckpointError(f"checkpoint layer {layer}", [
        f"tensors of layer {layer} under more than one naming ({', '.join(p for _, p in hits)}); "
        f"pass prefix= to pick one"])


# -- planning: which tensors, which format, every problem found from the headers ----------------

@dataclass(frozen=True)
class _ProjPlan:
    weight: str
    scale: str | None


@dataclass
class _Plan:
    fmt: str | None = None
    scale_dtype: str | None = None  # the scale's dtype kind: "E8M0" (F8_E8M0 / U8 bytes), "F32", "BF16"
    weight_dtype: str | None = None
    experts: list = dataclasses.field(default_factory=list)  # [e_local][proj] -> _ProjPlan
    shared: dict = dataclasses.field(default_factory=dict)  # proj -> (fmt, _ProjPlan)


def _scale_kind(dtype: str) -> str:
    return "E8M0" if dtype in _E8M0 else dtype


def _scale_name(ckpt: SafetensorsCheckpoint, w: str) -> str | None:
    base = w[: -len(".weight")]
    for suffix in _SCALE_SUFFIXES:
        if base + suffix in ckpt:
            return base + suffix
    return None


def _scale_to_f32(s: np.ndarray) -> np.ndarray:
    """Scale values (E8M0 bytes, BF16 or F32) as f32 on the host; exact (a byte b is 2^(b-127),
    bits b << 23; bf16 widens exactly). Bytes 0 and 255 are refused before this is called."""
    if s.dtype == np.uint8:
        return (s.astype(np.uint32) << 23).view(np.float32)
    return s.astype(np.float32)


def _scale_value_problem(ckpt: SafetensorsCheckpoint, name: str, pow2: bool, problems: list[str]) -> bool:
    """Appends the problem with the values of scale tensor `name`, if any: E8M0 bytes 0 (2^-127,
    below fp32's normal range) and 255 (NaN); F32/BF16 scales that are not positive finite, or
    (`pow2`: MX formats, whose GEMMs read UE8M0) not powers of two."""
    s, dt = ckpt.read_copy(name), ckpt.info(name).dtype
    if s.dtype == np.uint8:
        bad = int(np.count_nonzero((s == 0) | (s == 255)))
        msg = (f"{name}: {bad} scale byte(s) are 0 or 255 (E8M0 2^-127 / NaN are not usable scales; "
               f"values {int(s.min())}..{int(s.max())})")
    elif pow2:
        mant, _ = np.frexp(s.astype(np.float32))
        bad = int(np.count_nonzero(~((mant == 0.5) & np.isfinite(s))))
        msg = f"{name}: {bad} {dt} scale(s) are not positive powers of two (MX formats need UE8M0 scales)"
    else:
        bad = int(np.count_nonzero(~(np.isfinite(s) & (s > 0))))
        msg = f"{name}: {bad} {dt} scale(s) are not positive finite numbers"
    if bad:
        problems.append(msg)
    return bool(bad)


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
    base = w[: -len(".weight")]
    scale_names = " or ".join(base + s for s in _SCALE_SUFFIXES)

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
        if sinfo is None:
            problems.append(f"missing {scale_names} for F8_E4M3 weight {w}")
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
        allowed = {"mxfp8": _E8M0 + _SCALE_FLOAT, "fp8_block": _SCALE_FLOAT + ("F8_E8M0",),
                   "fp8_per_tensor": _SCALE_FLOAT}[fmt]
        if sinfo.dtype not in allowed:
            problems.append(f"{sname}: expected dtype in {allowed} for format {fmt}, got {sinfo.dtype}")
            return None
        if _scale_value_problem(ckpt, sname, fmt == "mxfp8", problems):
            return None
        return fmt, _ProjPlan(w, sname)
    if info.dtype in ("I8", "U8"):
        if k % 2 or info.shape != (n, k // 2):
            bad_shape(w, info.shape, (n, k // 2), " (MXFP4: two e2m1 codes per byte)")
            return None
        groups = (n, ceil_div(k, MX_GROUP))
        if sinfo is None:
            problems.append(f"missing {scale_names} for MXFP4 weight {w}")
            return None
        if sinfo.shape != groups:
            bad_shape(sname, sinfo.shape, groups, " (MXFP4: one scale per 32 values along K)")
            return None
        if sinfo.dtype not in _E8M0 + _SCALE_FLOAT:
            problems.append(f"{sname}: expected dtype F8_E8M0, U8, F32 or BF16 (MXFP4 scales), got {sinfo.dtype}")
            return None
        if _scale_value_problem(ckpt, sname, True, problems):
            return None
        return "mxfp4", _ProjPlan(w, sname)
    problems.append(f"{w}: dtype {info.dtype} is not an accepted expert weight dtype "
                    f"(BF16/F16/F32, F8_E4M3, or I8/U8 packed e2m1)")
    return None


def _proj_shapes(h: int, i: int) -> dict[str, tuple[int, int]]:
    return {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def _plan(ckpt, config, naming: Naming, prefix, expert_range, problems) -> _Plan:
    plan = _Plan()
    h, i = config.hidden_size, config.intermediate_size
    shapes = _proj_shapes(h, i)
    seen: dict[str, str] = {}  # first tensor that fixed the format / dtypes
    for e in range(*expert_range):
        row = {}
        for proj in _PROJ:
            w = f"{prefix}experts.{e}.{naming.proj(proj)}.weight"
            got = _classify(ckpt, w, *shapes[proj], problems)
            if got is None:
                continue
            fmt, pp = got
            sdt = _scale_kind(ckpt.info(pp.scale).dtype) if pp.scale else None
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
            got = _classify(ckpt, f"{prefix}shared_experts.{naming.proj(proj)}.weight", *shp, problems)
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

def _aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """np.empty, HOST_ALIGN-byte aligned (jax.device_put on the CPU then adopts it without a copy)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + HOST_ALIGN, np.uint8)
    off = (-raw.ctypes.data) % HOST_ALIGN
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def _stack_experts(ckpt, plan: _Plan, config: MoEConfig, naming: Naming, which: str):
    """Stacked checkpoint-form values (E_loc, N, Kv) and scale (or None) for "w13" or "w2"; every
    scale becomes f32 here, exactly, one expert at a time (no whole-layer byte copy beside it)."""
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
    values = _aligned_empty((e_loc, n, kv), wdt)
    if fmt == "bf16":
        scale = None
    elif fmt == "fp8_block":
        scale = np.empty((e_loc, ceil_div(n, BLOCK), ceil_div(k, BLOCK)), np.float32)
    elif fmt == "fp8_per_tensor":
        scale = np.empty((e_loc, len(projs)), np.float32)
    else:
        scale = _aligned_empty((e_loc, n, ceil_div(k, MX_GROUP)), np.float32)
    for e, row in enumerate(plan.experts):
        r0 = 0
        for j, proj in enumerate(projs):
            pp = row[proj]
            rows = ckpt.info(pp.weight).shape[0]
            ckpt.read_into(pp.weight, values[e, r0:r0 + rows])  # the one host copy (F16/F32 -> bf16 cast)
            if fmt == "fp8_block":
                rb = rows // BLOCK  # quantized recipes: I is a multiple of 128, blocks do not straddle
                scale[e, r0 // BLOCK:r0 // BLOCK + rb] = _scale_to_f32(ckpt.read_copy(pp.scale))
            elif fmt == "fp8_per_tensor":
                scale[e, j] = _scale_to_f32(ckpt.read_copy(pp.scale)).reshape(())
            elif fmt in ("mxfp8", "mxfp4"):  # values checked by _classify
                scale[e, r0:r0 + rows] = _scale_to_f32(ckpt.read_copy(pp.scale))
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
    return v, jax.device_put(scale)


def _read_shared_projection(ckpt: SafetensorsCheckpoint, fmt: str, pp: _ProjPlan
                            ) -> tuple[np.ndarray, np.ndarray | None, str]:
    """One shared-expert projection as stored: (values (N, Kv) — int8 packed e2m1 for mxfp4 —,
    scale as exact f32 (None for bf16), checkpoint format). Host copies, never views of a file
    map (jax may alias host memory)."""
    w = ckpt.read_copy(pp.weight)
    if fmt == "mxfp4":
        w = w.view(np.int8)
    s = None if pp.scale is None else _scale_to_f32(ckpt.read_copy(pp.scale))
    return w, s, fmt


def _dequantize_shared(values: np.ndarray, scale: np.ndarray | None, fmt: str, n: int, k: int):
    """A `_read_shared_projection` result -> (N, K) bf16 jax array."""
    import jax.numpy as jnp

    import layouts

    if fmt == "bf16":
        return jnp.asarray(values).astype(jnp.bfloat16)
    w, s = jnp.asarray(values), jnp.asarray(scale)
    if fmt == "mxfp4":
        return layouts.dequantize_mxfp4(w, s, MX_GROUP, jnp.bfloat16)
    if fmt == "mxfp8":
        return layouts.dequantize_fp8_per_token_group(w, s, MX_GROUP, jnp.bfloat16)
    if fmt == "fp8_per_tensor":
        s = layouts.expand_per_tensor_scale(s.reshape(()), n, k, BLOCK)
    return layouts.dequantize_fp8_per_block(w, s, BLOCK, jnp.bfloat16)


def _fp8_shared(ckpt, plan: "_Plan", h: int, i_s: int, required: bool) -> dict:
    """An fp8_block / fp8_per_tensor shared expert kept as FP8: {shared_w13 (2*I_s, H) e4m3,
    shared_w13_scale (2*I_s/128, ceil(H/128)) f32, shared_w2 (H, I_s) e4m3, shared_w2_scale} in
    checkpoint form (MoEParams fields). {} when its projections are not all FP8 with block scales
    or I_s is not a multiple of 128 (gate and up blocks would share scale rows once stacked),
    unless `required`, which makes those an error."""
    import jax.numpy as jnp

    import layouts

    fmts = {p: plan.shared[p][0] for p in _proj_shapes(h, i_s)}
    if not all(f in ("fp8_block", "fp8_per_tensor") for f in fmts.values()):
        if required:
            raise ValueError(f"shared_fp8=True: the shared expert is stored as {sorted(set(fmts.values()))}, "
                             "not FP8 with block or per-tensor scales")
        return {}
    if i_s % BLOCK:
        if required:
            raise ValueError(f"shared_fp8=True: the shared intermediate size must be a multiple of {BLOCK}, "
                             f"got {i_s}")
        return {}
    out = {}
    for p, (n, k) in _proj_shapes(h, i_s).items():
        values, scale, fmt = _read_shared_projection(ckpt, *plan.shared[p])
        s = jnp.asarray(scale)
        if fmt == "fp8_per_tensor":
            s = layouts.expand_per_tensor_scale(s.reshape(()), n, k, BLOCK)
        out[p] = (jnp.asarray(values), s)
    (g, gs), (u, us), (d, ds) = (out[p] for p in ("gate_proj", "up_proj", "down_proj"))
    return dict(shared_w13=jnp.concatenate([g, u]), shared_w13_scale=jnp.concatenate([gs, us]),
                shared_w2=d, shared_w2_scale=ds)


def read_checkpoint_config(ckpt: SafetensorsCheckpoint) -> dict | None:
    """The checkpoint directory's config.json as a dict, or None when there is none."""
    if ckpt.directory is None or not (ckpt.directory / hf_config.CONFIG_FILE).is_file():
        return None
    return hf_config.read_config_json(ckpt.directory)


def _layer_config(ckpt, config, layer, arch, cfg_json) -> tuple[MoEConfig, dict | None]:
    """(the layer's MoEConfig, sources): `config` checked against config.json (sources None), or
    built from it (sources: `hf_config.resolve_layer`'s, which keys were stated or assumed)."""
    where = f"checkpoint layer {layer}"
    if cfg_json is None:
        if config is None:
            raise ValueError(f"config: the checkpoint has no {hf_config.CONFIG_FILE} beside its files "
                             f"(looked in {ckpt.directory}); pass a MoEConfig")
        return config, None
    if layer is None:  # prefix= names the tensors; config.json cannot say which layer they are
        if config is None:
            raise ValueError("config: required with prefix= (config.json describes layers by number; "
                             "or pass layer= instead)")
        return config, None
    kinds = hf_config.layer_kinds(cfg_json)
    if layer >= len(kinds) or kinds[layer] == "dense":
        held, moe = ckpt.layers()
        what = "a dense layer" if layer < len(kinds) else f"not a layer of this model ({len(kinds)} layers)"
        raise CheckpointError(where, [
            f"layer {layer} is {what}; config.json's layers: {hf_config.describe_kinds(kinds)}; the files "
            f"hold layers {hf_config.format_ranges(held)}, MoE routers in {hf_config.format_ranges(moe)}"])
    kwargs, sources = hf_config.resolve_layer(cfg_json, layer)
    if config is None:
        return MoEConfig(**kwargs, arch=arch), sources
    bad = hf_config.disagreements(config, kwargs, sources)
    if bad:
        raise CheckpointError(where, bad)
    return config, None


def load_moe_layer(checkpoint: str | os.PathLike | Sequence | SafetensorsCheckpoint, *,
                   layer: int | None = None, config: MoEConfig | None = None, arch: int | None = None,
                   expert_range: tuple[int, int] | None = None, prefix: str | None = None,
                   prepare: bool = True, shared_fp8: bool | None = None) -> tuple[MoEConfig, MoEParams]:
    """(config, params) of MoE layer `layer`: the config from the checkpoint directory's
    config.json when `config` is None (`arch` then sets MoEConfig.arch), else `config` checked
    against it. Arguments and errors as in `load_moe_params`."""
    if config is not None and not isinstance(config, MoEConfig):
        raise TypeError(f"config: expected MoEConfig or None, got {type(config).__name__}")
    if (layer is None) == (prefix is None):
        raise ValueError(f"layer/prefix: give exactly one, got layer={layer!r}, prefix={prefix!r}")
    if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool) or layer < 0):
        raise ValueError(f"layer: expected a non-negative int, got {layer!r}")
    ckpt = checkpoint if isinstance(checkpoint, SafetensorsCheckpoint) else SafetensorsCheckpoint(checkpoint)
    cfg_json = read_checkpoint_config(ckpt)
    config, json_sources = _layer_config(ckpt, config, layer, arch, cfg_json)
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
    kinds = hf_config.layer_kinds(cfg_json) if cfg_json is not None else None
    naming, prefix = detect_naming(ckpt, layer=layer, prefix=prefix, kinds=kinds)
    where = f"checkpoint layer prefix {prefix!r} ({naming.name} naming)"

    if layer is not None and f"{prefix}gate.weight" not in ckpt:  # e.g. a dense layer's MLP: say so
        held, moe = ckpt.layers()
        raise CheckpointError(where, [
            f"missing {prefix}gate.weight: layer {layer} has no MoE router in the files (a dense layer?); "
            f"MoE routers are in layers {hf_config.format_ranges(moe)}"
            + (f"; config.json's layers: {hf_config.describe_kinds(kinds)}" if kinds else "")])
    problems: list[str] = []
    h = config.hidden_size
    _check_small(ckpt, f"{prefix}gate.weight", (e, h), _FLOAT, problems, required=True)
    bias = f"{prefix}{naming.bias}"
    tid = f"{prefix}gate.tid2eid"
    if config.hash_routing:  # routed by tid2eid: a correction bias is neither needed nor read
        if config.use_correction_bias:
            problems.append("config.use_correction_bias=True on a hash-routed layer: hash layers route "
                            "by tid2eid and have no correction bias (set use_correction_bias=False; "
                            "MoEConfig.deepseek_v4(hash_routing=True) and from_pretrained do)")
        n_before = len(problems)
        _check_small(ckpt, tid, (config.vocab_size, config.top_k), _INT, problems, required=True)
        if len(problems) == n_before:  # well-formed: its ids must name experts (routing gathers them)
            ids = ckpt.read_copy(tid)
            bad = int(np.count_nonzero((ids < 0) | (ids >= e)))
            if bad:
                problems.append(f"{tid}: {bad} expert id(s) outside [0, {e}) (values "
                                f"{int(ids.min())}..{int(ids.max())})")
    else:
        _check_small(ckpt, bias, (e,), _FLOAT, problems, required=config.use_correction_bias)
        if not config.use_correction_bias and bias in ckpt:
            if json_sources is None:
                problems.append(f"{bias}: present, but config.use_correction_bias is False (routing would "
                                "silently differ from the model's)")
            else:  # the config came from config.json: say how it decided, and what would fix it
                said = hf_config.describe("use_correction_bias", False, json_sources)
                problems.append(f"{bias}: present, but config.json routes layer {layer} without a correction "
                                f"bias (use_correction_bias: {said}); routing would silently differ from the "
                                "model's (a model routed with this bias has topk_method 'noaux_tc')")
        if tid in ckpt:
            problems.append(f"{tid}: present (a hash-routed layer), but config.hash_routing is False")
    plan = _plan(ckpt, config, naming, prefix, expert_range, problems)
    if plan.fmt is not None and plan.fmt not in RECIPE_SOURCES[config.recipe]:
        problems.append(f"recipe {config.recipe!r} cannot be loaded from {plan.fmt} expert weights "
                        f"(it loads from {RECIPE_SOURCES[config.recipe]})")
    if problems:
        raise CheckpointError(where, problems)

    import jax.numpy as jnp

    from moe_jax.params import check_params
    from moe_jax.params import prepare_params

    i = config.intermediate_size
    w13, s13 = _to_checkpoint_form(*_stack_experts(ckpt, plan, config, naming, "w13"), plan.fmt,
                                   config.recipe, (i, i), h)
    w2, s2 = _to_checkpoint_form(*_stack_experts(ckpt, plan, config, naming, "w2"), plan.fmt,
                                 config.recipe, (h,), i)
    shared_w13 = shared_w2 = None
    shared_fp8_parts = {}
    if config.n_shared_experts:
        i_s = config.shared_intermediate_size
        shared_fp8_parts = ({} if shared_fp8 is False
                            else _fp8_shared(ckpt, plan, h, i_s, required=shared_fp8 is True))
        if not shared_fp8_parts:
            g, u, d = (_dequantize_shared(*_read_shared_projection(ckpt, *plan.shared[p]), *shp)
                       for p, shp in _proj_shapes(h, i_s).items())
            shared_w13, shared_w2 = jnp.concatenate([g, u], axis=0), d
    use_bias = config.use_correction_bias and not config.hash_routing
    params = MoEParams(
        gate_weight=jnp.asarray(np.array(ckpt.read_copy(f"{prefix}gate.weight"), np.float32)),
        w13=w13, w2=w2, w13_scale=s13, w2_scale=s2,
        e_score_correction_bias=jnp.asarray(np.array(ckpt.read_copy(bias), np.float32)) if use_bias else None,
        **(shared_fp8_parts or dict(shared_w13=shared_w13, shared_w2=shared_w2)),
        tid2eid=jnp.asarray(np.array(ckpt.read_copy(tid), np.int32)) if config.hash_routing else None,
    )
    check_params(params, config)
    return config, (prepare_params(params, config, arch) if prepare else params)


def load_moe_params(checkpoint: str | os.PathLike | Sequence | SafetensorsCheckpoint,
                    config: MoEConfig | None = None, *, layer: int | None = None, arch: int | None = None,
                    expert_range: tuple[int, int] | None = None, prefix: str | None = None,
                    prepare: bool = True, shared_fp8: bool | None = None) -> MoEParams:
    """The MoE layer `layer` of a DeepSeek-V3/V4 safetensors checkpoint as `MoEParams`.

    checkpoint: file, list of files, directory, or an open `SafetensorsCheckpoint`.
    config: the layer's MoEConfig; None -> built from the checkpoint directory's config.json
    (`load_moe_layer` returns it too); given -> checked against config.json when there is one.
    layer / prefix: give one; the tensor naming (v3, v4, v4_hf) is detected, prefix overrides it.
    arch: target GPU family 90 | 100 (None -> config.gemm_arch; must equal it); it picks the load-time path
    (weight paths, layouts/weight_paths.py: fp8_block on 100 -> UE8M0 requant C; mxfp4 on 90 -> FP4->FP8 B, on 100 -> A;
    mxfp8 -> D). expert_range: (start, stop) global expert ids held by this rank (EP); only those
    experts are read; the router, bias and shared expert are whole.
    prepare: True -> GEMM form for `arch` (`prepare_params`); False -> checkpoint form.
    shared_fp8: None (default) keeps a shared expert stored as FP8 with block (or per-tensor) scales
    in FP8, as it ships, when its intermediate size is a multiple of 128, and dequantizes any other
    to bf16; True requires FP8 (an error otherwise); False always dequantizes to bf16.
    Returns MoEParams with w13 (E_local, 2I, K[/2]), w2 (E_local, H, I[/2]) and scales; the router
    weight and correction bias in f32, the shared expert in bf16 or FP8 (shared_fp8), tid2eid in int32.
    Raises CheckpointError (a ValueError) listing every missing, mis-shaped or mis-typed tensor,
    a format the recipe cannot be loaded from, invalid scale values, a layer that is dense or not in
    the files (with the layer kinds and the layers held), or a config field config.json contradicts;
    ValueError for a target arch that cannot run the recipe or a bad expert_range.
    """
    if config is not None and not isinstance(config, MoEConfig):
        raise TypeError(f"config: expected MoEConfig or None, got {type(config).__name__}")
    return load_moe_layer(checkpoint, layer=layer, config=config, arch=arch, expert_range=expert_range,
                          prefix=prefix, prepare=prepare, shared_fp8=shared_fp8)[1]
