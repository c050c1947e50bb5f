"""Where the kernel sources, the CUDA compiler and the on-disk cache live, and how a cache entry is
built and trusted.

Nothing here imports the ``deep_gemm`` package (its torch extension cannot load beside our jax/torch
versions): the wheel is only a folder of CUDA templates, found through its import spec.

Cache entry: ``<root>/<kind>/<name>.<key>/{<artifact>, meta.json, ...}``. An entry is built in
``<root>/tmp/<random>`` under a per-key ``flock`` (concurrent processes wait for one build instead of
repeating it) and published by an atomic directory rename, so a reader sees a complete entry or
none. ``meta.json`` records the artifact's size and sha256; an entry whose artifact is not an ELF
file of that size and hash (truncated, overwritten, from an older layout) is never returned: it is
moved aside and rebuilt. A cache that cannot be written gives a ToolchainError naming
``MOE_JAX_CACHE_DIR``; a read-only cache that already holds valid entries still serves them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Sequence

from custom_calls.settings import ToolchainLocations

# The kernels' template parameter lists differ between DeepGEMM releases; the code generator is
# written against this one.
SGL_DEEP_GEMM_VERSION = "0.2.5"
# Its templates use CUDA 12.9 features (nvcc >= 12.9 is what its own JIT requires).
MIN_NVCC_RELEASE = (12, 9)
# Toolkits searched after $CUDA_HOME / $CUDA_PATH and before PATH.
DEFAULT_CUDA_HOMES: tuple[Path, ...] = (Path("/usr/local/cuda"),)
ELF_MAGIC = b"\x7fELF"
MANIFEST = "meta.json"
# errno values that mean "this directory cannot take the entry", not "the build is wrong"
_CACHE_WRITE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
                                 errno.ENOTDIR})
_CACHE_WRITE_MESSAGES = ("No space left on device", "Read-only file system", "Disk quota exceeded")


class ToolchainError(RuntimeError):
    """A required build tool or source package is missing, or the kernel cache cannot be written."""


@functools.cache
def deep_gemm_include_dir() -> Path:
    """The ``include/`` folder of the installed sgl-deep-gemm wheel (holds deep_gemm/, cute/, cutlass/)."""
    spec = importlib.util.find_spec("deep_gemm")
    if spec is None or not spec.submodule_search_locations:
        raise ToolchainError(
            "sgl-deep-gemm is not installed: the DeepGEMM kernels need its CUDA templates "
            f"(pip install sgl-deep-gemm=={SGL_DEEP_GEMM_VERSION}, the 'gpu' extra)")
    pkg = Path(list(spec.submodule_search_locations)[0])
    inc = pkg / "include"
    if not (inc / "deep_gemm").is_dir():
        raise ToolchainError(f"sgl-deep-gemm at {pkg} has no include/deep_gemm folder")
    version_file = pkg / "VERSION"
    if version_file.is_file():
        found = version_file.read_text().strip()
        if not found.startswith(SGL_DEEP_GEMM_VERSION):
            raise ToolchainError(
                f"sgl-deep-gemm {found} found at {pkg}; the code generator targets {SGL_DEEP_GEMM_VERSION}")
    return inc


def find_nvcc() -> Path:
    """nvcc >= 12.9 from $MOE_JAX_NVCC (exclusively, when set), else the first new enough one in
    $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin, PATH."""
    where = ToolchainLocations.from_environment()
    explicit = where.nvcc
    if explicit:
        # An explicit choice is never silently replaced by another compiler.
        if not (Path(explicit).is_file() and os.access(explicit, os.X_OK)):
            raise ToolchainError(f"no CUDA compiler: MOE_JAX_NVCC={explicit} is not an executable file")
        problem = _nvcc_problem(explicit)
        if problem:
            raise ToolchainError(f"MOE_JAX_NVCC={explicit}: {problem}; point MOE_JAX_NVCC at the nvcc of "
                                 f"a CUDA toolkit >= {_release(MIN_NVCC_RELEASE)}")
        return Path(explicit)
    candidates = [home / "bin" / "nvcc" for home in where.cuda_homes]
    candidates += [home / "bin" / "nvcc" for home in DEFAULT_CUDA_HOMES]
    which = shutil.which("nvcc")
    if which:
        candidates.append(Path(which))
    rejected = []
    for c in dict.fromkeys(candidates):
        if c.is_file() and os.access(c, os.X_OK):
            problem = _nvcc_problem(str(c))
            if not problem:
                return c
            rejected.append(f"{c}: {problem}")
    need = f"nvcc >= {_release(MIN_NVCC_RELEASE)}"
    if rejected:
        raise ToolchainError(f"no usable CUDA compiler ({'; '.join(rejected)}): install a CUDA toolkit with "
                             f"{need} or set MOE_JAX_NVCC to its nvcc")
    raise ToolchainError(
        f"no CUDA compiler: nvcc not found in $CUDA_HOME/bin, $CUDA_PATH/bin, "
        f"{', '.join(str(h / 'bin') for h in DEFAULT_CUDA_HOMES)} or PATH (the DeepGEMM kernels are "
        f"compiled on first use): install a CUDA toolkit with {need} or set MOE_JAX_NVCC to its nvcc")


def _release(version: tuple[int, int]) -> str:
    return ".".join(map(str, version))


def nvcc_release(nvcc: str) -> tuple[int, int] | None:
    """(major, minor) of the CUDA release ``nvcc --version`` reports; None if it reports none."""
    m = re.search(r"release (\d+)\.(\d+)", nvcc_version(nvcc))
    return (int(m.group(1)), int(m.group(2))) if m else None


def _nvcc_problem(nvcc: str) -> str | None:
    """Why ``nvcc`` cannot compile the kernels (too old, not an nvcc); None when it can."""
    try:
        release = nvcc_release(nvcc)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"'nvcc --version' failed ({e})"
    if release is None:
        return "'nvcc --version' reports no CUDA release"
    if release < MIN_NVCC_RELEASE:
        return (f"CUDA {_release(release)} is too old (DeepGEMM {SGL_DEEP_GEMM_VERSION}'s templates need "
                f"nvcc >= {_release(MIN_NVCC_RELEASE)})")
    return None


@functools.cache
def nvcc_version(nvcc: str) -> str:
    """Full ``nvcc --version`` text (part of every cache key)."""
    return subprocess.run([nvcc, "--version"], check=True, capture_output=True, text=True).stdout


def cuda_include_dir(nvcc: Path) -> Path:
    """The toolkit's include folder (holds cuda.h), next to nvcc."""
    inc = nvcc.resolve().parent.parent / "include"
    if not (inc / "cuda.h").is_file():
        for alt in (home / "include" for home in DEFAULT_CUDA_HOMES):
            if (alt / "cuda.h").is_file():
                return alt
        raise ToolchainError(f"cuda.h not found next to {nvcc} ({inc})")
    return inc


def cache_root() -> Path:
    """$MOE_JAX_CACHE_DIR, else ~/.cache/moe_jax/deep_gemm."""
    env = ToolchainLocations.from_environment().cache_dir
    return Path(env) if env else Path.home() / ".cache" / "moe_jax" / "deep_gemm"


def cache_write_error(root: Path, detail: str) -> ToolchainError:
    """The error for a kernel cache that cannot take a new entry (read-only, full, not a folder)."""
    where = (f"MOE_JAX_CACHE_DIR={root}" if ToolchainLocations.from_environment().cache_dir
             else f"{root} (the default; MOE_JAX_CACHE_DIR is not set)")
    return ToolchainError(f"the kernel cache {where} cannot be written ({detail}): set MOE_JAX_CACHE_DIR "
                          f"to a writable directory with free space")


@contextlib.contextmanager
def _cache_writes(root: Path) -> Iterator[None]:
    try:
        yield
    except OSError as e:  # a write without a file name (a full disk) or one under the cache
        if e.errno in _CACHE_WRITE_ERRNOS and (e.filename is None or str(e.filename).startswith(str(root))):
            detail = e.strerror if e.filename is None else f"{e.strerror}: {e.filename}"
            raise cache_write_error(root, detail) from e
        raise


def run_compiler(cmd: Sequence[str], what: str, build_dir: Path) -> None:
    """Run a compiler whose outputs go to ``build_dir`` (an entry being built, in the cache's tmp/
    folder, which also takes the compiler's temporary files, so a full disk is the cache's). Raises
    RuntimeError "<what> failed" with the command and the end of its stderr, or the cache error."""
    env = dict(os.environ, TMPDIR=str(build_dir.parent))
    proc = subprocess.run(list(cmd), cwd=build_dir, env=env, capture_output=True, text=True)
    if proc.returncode == 0:
        return
    for msg in _CACHE_WRITE_MESSAGES:
        if msg in proc.stderr:
            raise cache_write_error(build_dir.parent.parent, f"{Path(cmd[0]).name}: {msg}")
    raise RuntimeError(f"{what} failed ({proc.returncode}):\n{' '.join(cmd)}\n{proc.stderr[-6000:]}")


def _verified(entry: Path, artifact: str) -> bool:
    """``entry/artifact`` is an ELF file with the size and sha256 that ``entry/meta.json`` records."""
    try:
        meta = json.loads((entry / MANIFEST).read_text())
        data = (entry / artifact).read_bytes()
    except (OSError, ValueError):
        return False
    return (isinstance(meta, dict) and data[:4] == ELF_MAGIC and meta.get("size") == len(data)
            and meta.get("sha256") == hashlib.sha256(data).hexdigest())


def cached_artifact(kind: str, name: str, key: str, artifact: str,
                    build: Callable[[Path], dict]) -> tuple[Path, bool]:
    """``(<root>/<kind>/<name>.<key>/<artifact>, built)``: the verified entry when there is one, else
    (under the key's lock, re-checked) ``build(tmp)`` writes ``tmp/<artifact>`` and returns more
    fields for meta.json, an invalid entry is moved aside and the new one published."""
    root = cache_root()
    entry = root / kind / f"{name}.{key}"
    if _verified(entry, artifact):
        return entry / artifact, False
    with _cache_writes(root):
        for folder in ("locks", "tmp", kind):
            (root / folder).mkdir(parents=True, exist_ok=True)
        lock = open(root / "locks" / f"{kind}.{key}.lock", "a")
    with lock:  # the flock is released when the file closes
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _verified(entry, artifact):  # another process published it while we waited
            return entry / artifact, False
        with _cache_writes(root):
            tmp = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=root / "tmp"))
            try:
                fields = build(tmp)
                data = (tmp / artifact).read_bytes()
                if data[:4] != ELF_MAGIC:
                    raise RuntimeError(f"building {tmp / artifact} produced no ELF file")
                (tmp / MANIFEST).write_text(json.dumps(
                    {**fields, "artifact": artifact, "size": len(data),
                     "sha256": hashlib.sha256(data).hexdigest()}, indent=1))
                if entry.exists() or entry.is_symlink():  # invalid: out of the way first (atomic)
                    stale = tmp / "stale"
                    os.rename(entry, stale)
                    shutil.rmtree(stale) if stale.is_dir() and not stale.is_symlink() else stale.unlink()
                os.rename(tmp, entry)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return entry / artifact, True


@functools.cache
def detected_device() -> tuple[str, int | None, int | None]:
    """(platform, arch, num_sms) of the first jax device; arch = 10·major + minor (9.0 → 90)."""
    import jax

    try:
        devs = jax.devices("gpu")
    except RuntimeError:
        return jax.default_backend(), None, None
    d = devs[0]
    cc = getattr(d, "compute_capability", None)
    arch = None
    if cc:
        major, minor = (int(x) for x in str(cc).split(".")[:2])
        arch = 10 * major + minor
    sms = getattr(d, "core_count", None)  # KernelSettings.num_sms overrides it where the kernels are planned
    return "gpu", arch, int(sms) if sms else None
