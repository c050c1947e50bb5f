"""nvcc compilation of generated kernel sources into the on-disk cubin cache.

Cache entry (``toolchain.cached_artifact``): ``<root>/cubin/<name>.<key>/{kernel.cu, kernel.cubin,
meta.json}``, where key hashes the source, every ``deep_gemm/`` header it reaches, the sgl-deep-gemm
version, the full ``nvcc --version`` text, the flags and the arch. Concurrent processes (local
ranks) wait for one compile; a cubin that does not match its recorded size and sha256 is rebuilt.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import threading
import time
from pathlib import Path

from custom_calls.native import toolchain
from layouts.archs import check_arch

NVCC_FLAGS: tuple[str, ...] = (
    "-O3", "--compiler-options=-O3", "--ptxas-options=--register-usage-level=10",
    "-std=c++20", "--compiler-options=-fPIC", "--compiler-options=-fconcepts",
    "--expt-relaxed-constexpr", "--expt-extended-lambda",
    "--diag-suppress=39,161,174,177,186,940",
    "--compiler-options=-Wno-deprecated-declarations,-Wno-abi",
)

_INCLUDE_RE = re.compile(r'#include\s*[<"](deep_gemm/[^>"]+)[>"]')
_memo: dict[str, "Cubin"] = {}
_memo_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Cubin:
    """A compiled kernel on disk."""

    name: str
    key: str
    path: Path
    compiled: bool  # True when this call ran nvcc, False when found in the cache
    seconds: float


@functools.cache
def _header_digest(include_dir: str, rel: str) -> str:
    """sha256 over a header and, recursively, every deep_gemm/ header it includes (sorted, deduplicated)."""
    seen: set[str] = set()
    todo = [rel]
    h = hashlib.sha256()
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen.add(cur)
        p = Path(include_dir) / cur
        if not p.is_file():
            continue
        text = p.read_bytes()
        todo.extend(m.group(1) for m in _INCLUDE_RE.finditer(text.decode("utf-8", "replace")))
    for cur in sorted(seen):
        p = Path(include_dir) / cur
        h.update(cur.encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest() if p.is_file() else b"missing")
    return h.hexdigest()


def nvcc_arch(arch: int) -> str:
    """nvcc's target for ``arch`` (a key of `layouts.ARCHS`): the arch-specific features the
    kernels use (wgmma, tcgen05) need the "a" variant, sm_90a / sm_100a."""
    return f"sm_{check_arch(arch)}a"


def cache_key(source: str, arch: int, nvcc: Path | None = None) -> str:
    """Hex key of everything that changes the cubin (the include folder's location does not)."""
    target = nvcc_arch(arch)
    nvcc = nvcc or toolchain.find_nvcc()
    inc = toolchain.deep_gemm_include_dir()
    h = hashlib.sha256()
    for part in (source, toolchain.nvcc_version(str(nvcc)), " ".join(NVCC_FLAGS), target,
                 (inc.parent / "VERSION").read_text() if (inc.parent / "VERSION").is_file() else "",
                 *(_header_digest(str(inc), m) for m in _INCLUDE_RE.findall(source))):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part.encode())
    return h.hexdigest()[:32]


def _compile(source: str, arch: int, nvcc: Path, out_dir: Path) -> None:
    (out_dir / "kernel.cu").write_text(source)
    cmd = [str(nvcc), str(out_dir / "kernel.cu"), "--cubin", "--output-file", str(out_dir / "kernel.cubin"),
           f"--gpu-architecture={nvcc_arch(arch)}", *NVCC_FLAGS,
           "--include-path", str(toolchain.deep_gemm_include_dir())]
    toolchain.run_compiler(cmd, "nvcc", out_dir)


def compile_cubin(name: str, source: str, arch: int) -> Cubin:
    """Return the cubin of ``source`` for ``arch`` (`nvcc_arch`: 90 → sm_90a, 100 → sm_100a),
    compiling at most once across threads and processes."""
    nvcc = toolchain.find_nvcc()
    key = cache_key(source, arch, nvcc)
    with _memo_lock:
        hit = _memo.get(key)
    if hit is not None:
        return dataclasses.replace(hit, compiled=False, seconds=0.0)
    t0 = time.perf_counter()

    def build(out_dir: Path) -> dict:
        _compile(source, arch, nvcc, out_dir)
        return {"name": name, "key": key, "arch": arch, "flags": list(NVCC_FLAGS),
                "nvcc": toolchain.nvcc_version(str(nvcc)).strip().splitlines()[-1],
                "seconds": round(time.perf_counter() - t0, 3)}

    path, compiled = toolchain.cached_artifact("cubin", name, key, "kernel.cubin", build)
    result = Cubin(name=name, key=key, path=path, compiled=compiled, seconds=time.perf_counter() - t0)
    with _memo_lock:
        _memo[key] = result
    return result


def clear_memory_cache() -> None:
    """Forget in-process lookups (the disk cache stays); used by tests of the disk cache."""
    with _memo_lock:
        _memo.clear()
