"""Reading safetensors files: the header (8-byte little-endian length, then JSON) parsed here,
tensors read with pread into caller-owned buffers or as read-only memory-mapped views.

    ckpt = SafetensorsCheckpoint("/ckpt/DeepSeek-V3")     # a directory, a file or a list of files
    info = ckpt.info("model.layers.3.mlp.gate.weight")    # TensorInfo(file, dtype, shape, begin, end)
    ckpt.read_into(name, out)                             # one copy, file -> `out`

numpy cannot name FP8 dtypes, so `safetensors.safe_open(framework="numpy")` (0.8) refuses
F8_E4M3/F8_E8M0 tensors; ml_dtypes supplies them (`ST_DTYPES`). With a
`model.safetensors.index.json` the tensor names come from its weight map and a shard's header is
read only when one of its tensors is needed. Nothing here knows about MoE layers beyond
`SafetensorsCheckpoint.layers` (which layer indices the tensor names hold).
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype name -> numpy dtype of its elements
ST_DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16), "U16": np.dtype(np.uint16), "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32), "I64": np.dtype(np.int64), "U64": np.dtype(np.uint64),
    "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(np.uint8),  # exponent bytes; kept raw, converted by the checkpoint formats
}
_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
_MOE_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(?:mlp|ffn)\.gate\.weight$")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: its file, safetensors dtype name, shape and byte range [begin, end)."""

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
            dtype, (b, e) = entry["dtype"], entry["data_offsets"]
            shape = tuple(int(d) for d in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: malformed header entry for {name!r}: {entry!r}") from None
        if dtype in ST_DTYPES:
            want = int(np.prod(shape, dtype=np.int64)) * ST_DTYPES[dtype].itemsize
            if e - b != want or b < 0:
                raise ValueError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) has byte range "
                                 f"[{b}, {e}) (expected {want} bytes)")
            if base + e > size:
                raise ValueError(f"{path}: truncated: tensor {name!r} ({dtype} {list(shape)}) ends at "
                                 f"byte {base + e}, the file has {size} bytes")
        out[name] = TensorInfo(path, dtype, shape, base + b, base + e)
    return out


def _locate(path: str | os.PathLike | Sequence[str | os.PathLike]
            ) -> tuple[list[Path], Path, dict[str, Path] | None]:
    """(files, directory, tensor name -> file from the index or None) of a checkpoint path: a
    directory (its index's weight map, else every *.safetensors file in it), a file, or a list."""
    if not isinstance(path, (str, os.PathLike)):
        files = [Path(f) for f in path]
        if not files:
            raise ValueError("path: expected at least one safetensors file, got an empty list")
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"path: no such safetensors file(s): {absent}")
        return files, files[0].parent, None
    p = Path(path)
    if p.is_file():
        return [p], p.parent, None
    if not p.is_dir():
        raise ValueError(f"path: {p} is neither a safetensors file nor a directory")
    index, where = p / INDEX_FILE, None
    if index.exists():
        try:
            where = {str(k): p / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"path: {index} is not an index with a 'weight_map' of "
                             f"tensor name -> file ({type(exc).__name__}: {exc})") from None
        files = sorted(set(where.values()))
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"path: {index} names file(s) that do not exist: {absent}")
    else:
        files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ValueError(f"path: no *.safetensors files in directory {p}")
    return files, p, where


class SafetensorsCheckpoint:
    """All tensors of a checkpoint: one .safetensors file, a list of files, or a directory (its
    `model.safetensors.index.json` weight map if present, else every *.safetensors file in it).
    With an index, a shard's header is parsed only when one of its tensors is first looked at;
    otherwise every header is parsed here. `read` returns read-only memory-mapped views."""

    def __init__(self, path: str | os.PathLike | Sequence[str | os.PathLike]):
        self._headers: dict[Path, dict[str, TensorInfo]] = {}
        files, self.directory, where = _locate(path)  # directory: where config.json is looked for
        self.files = files
        self._where: dict[str, Path] = where or {}  # tensor name -> file
        if where is None:
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
        if info.dtype not in ST_DTYPES:
            raise TypeError(f"checkpoint: tensor {name!r} has dtype {info.dtype}, which this loader "
                            f"does not read (readable: {sorted(ST_DTYPES)})")
        mm = self._maps.get(info.file)
        if mm is None:
            mm = self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        return mm[info.begin:info.end].view(ST_DTYPES[info.dtype]).reshape(info.shape)

    def read_into(self, name: str, out: np.ndarray) -> None:
        """Copy tensor `name` into the C-contiguous array `out` (its shape; a dtype of the same bytes,
        or a float dtype the values are cast to). Same-byte tensors go from the file straight into
        `out` (pread: no memory map, so the file's pages never count in this process's RSS)."""
        info = self.info(name)
        src = ST_DTYPES.get(info.dtype)
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
        if info.dtype not in ST_DTYPES:
            raise TypeError(f"checkpoint: tensor {name!r} has dtype {info.dtype}, which this loader "
                            f"does not read (readable: {sorted(ST_DTYPES)})")
        out = np.empty(info.shape, ST_DTYPES[info.dtype])
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


__all__ = ["INDEX_FILE", "ST_DTYPES", "SafetensorsCheckpoint", "TensorInfo", "read_safetensors_header"]
