"""The DeepGEMM kernel cache under real conditions, without a GPU: two processes compiling the same
kernel (and building the FFI launcher) at once; a truncated or overwritten cached cubin or launcher
library is rebuilt, never returned; a read-only or full cache directory and a missing or too-old
nvcc give errors that name MOE_JAX_CACHE_DIR / MOE_JAX_NVCC.

Real compilers throughout (nvcc 13 compiling a tiny sm_90a kernel, g++ building the launcher);
read-only and full directories are real tmpfs mounts (root), or a chmod-ed folder for read-only
when not root."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import multiprocessing
import os
import subprocess
from pathlib import Path

import pytest

from custom_calls.native import compiler
from custom_calls.native import launch, toolchain
from test_deep_gemm_host import needs_nvcc

TINY = 'extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }\n'


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _assert_valid_entry(artifact: Path) -> None:
    data = artifact.read_bytes()
    meta = json.loads((artifact.parent / "meta.json").read_text())
    assert data[:4] == b"\x7fELF" and meta["size"] == len(data)
    assert meta["sha256"] == hashlib.sha256(data).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MOE_JAX_CACHE_DIR", str(root))
    compiler.clear_memory_cache()
    yield root
    compiler.clear_memory_cache()


# --- two processes at once --------------------------------------------------------------------

def _race(root: str, barrier) -> dict:
    """In a fresh process: compile TINY, then build the launcher, each right after a barrier."""
    os.environ["MOE_JAX_CACHE_DIR"] = root
    barrier.wait()
    cubin = compiler.compile_cubin("tiny", TINY, 90)
    barrier.wait()
    lib = launch.build_handler()
    return dict(compiled=cubin.compiled, cubin=str(cubin.path), cubin_sha=_sha(cubin.path),
                lib=str(lib), lib_sha=_sha(lib), symbol=bool(ctypes.CDLL(str(lib)).MoeJaxDeepGemmLaunch))


@pytest.mark.slow
@needs_nvcc
def test_two_processes_build_the_same_kernel_and_launcher_at_once(cache):
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that runs jax threads
    barrier = ctx.Manager().Barrier(2)
    with ctx.Pool(2) as pool:
        r1, r2 = pool.starmap(_race, [(str(cache), barrier)] * 2, chunksize=1)
    assert sorted([r1["compiled"], r2["compiled"]]) == [False, True]  # one compile, one cache hit
    assert r1["cubin"] == r2["cubin"] and r1["cubin_sha"] == r2["cubin_sha"]
    assert r1["lib"] == r2["lib"] and r1["lib_sha"] == r2["lib_sha"] and r1["symbol"] and r2["symbol"]
    _assert_valid_entry(Path(r1["cubin"]))
    _assert_valid_entry(Path(r1["lib"]))
    assert len(list((cache / "cubin").iterdir())) == 1 and len(list((cache / "ffi").iterdir())) == 1
    assert not list((cache / "tmp").iterdir())  # no half-built entry or compiler temporary left


# --- corrupt entries --------------------------------------------------------------------------

def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip_a_byte(p: Path) -> None:  # same size, ELF magic intact
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def _empty_with_matching_meta(p: Path) -> None:  # the record agrees, but it is no ELF file
    p.write_bytes(b"")
    meta = p.parent / "meta.json"
    meta.write_text(json.dumps(dict(json.loads(meta.read_text()), size=0,
                                    sha256=hashlib.sha256(b"").hexdigest())))


def _drop_meta(p: Path) -> None:
    (p.parent / "meta.json").unlink()


@needs_nvcc
@pytest.mark.parametrize("corrupt", [_truncate, _flip_a_byte, _empty_with_matching_meta, _drop_meta])
def test_corrupt_cubin_is_rebuilt_not_returned(cache, corrupt):
    first = compiler.compile_cubin("tiny", TINY, 90)
    good = first.path.read_bytes()
    corrupt(first.path)
    compiler.clear_memory_cache()  # as a new process would see the disk
    again = compiler.compile_cubin("tiny", TINY, 90)
    assert again.compiled and again.path == first.path
    _assert_valid_entry(again.path)
    assert again.path.read_bytes() == good  # nvcc output is deterministic
    assert not compiler.compile_cubin("tiny", TINY, 90).compiled
    assert not list((cache / "tmp").iterdir())


@pytest.mark.slow
@needs_nvcc
def test_truncated_launcher_library_is_rebuilt_not_loaded(cache):
    lib = launch.build_handler()
    good = lib.read_bytes()
    _truncate(lib)
    assert launch.build_handler() == lib
    _assert_valid_entry(lib)
    assert lib.read_bytes() == good
    assert ctypes.CDLL(str(lib)).MoeJaxDeepGemmLaunch


# --- a cache that cannot be written -----------------------------------------------------------

@contextlib.contextmanager
def _tmpfs(path: Path, options: str):
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def _read_only_dir(path: Path):
    """A real read-only folder: a read-only tmpfs as root (root ignores permission bits), else chmod."""
    if os.geteuid() == 0:
        with _tmpfs(path, "size=1m,ro") as p:
            yield p
        return
    path.mkdir(parents=True)
    path.chmod(0o555)
    try:
        yield path
    finally:
        path.chmod(0o755)


@needs_nvcc
def test_read_only_cache_dir_is_a_clear_error(tmp_path, monkeypatch):
    compiler.clear_memory_cache()
    with _read_only_dir(tmp_path / "ro") as ro:
        root = ro / "cache"
        monkeypatch.setenv("MOE_JAX_CACHE_DIR", str(root))
        for build in (lambda: compiler.compile_cubin("tiny", TINY, 90), launch.build_handler):
            with pytest.raises(toolchain.ToolchainError) as e:
                build()
            msg = str(e.value)
            assert f"MOE_JAX_CACHE_DIR={root} cannot be written" in msg, msg
            assert "set MOE_JAX_CACHE_DIR to a writable directory" in msg, msg
            assert "Read-only file system" in msg or "Permission denied" in msg, msg


@needs_nvcc
def test_read_only_cache_still_serves_its_valid_entries(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("remounting a tmpfs read-only needs root")
    with _tmpfs(tmp_path / "shared", "size=8m") as mnt:
        monkeypatch.setenv("MOE_JAX_CACHE_DIR", str(mnt))
        compiler.clear_memory_cache()
        built = compiler.compile_cubin("tiny", TINY, 90)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        compiler.clear_memory_cache()
        again = compiler.compile_cubin("tiny", TINY, 90)
        assert not again.compiled and again.path == built.path
        compiler.clear_memory_cache()


@pytest.mark.slow
@needs_nvcc
def test_full_cache_dir_is_a_clear_error(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("a full filesystem is made with a small tmpfs mount, which needs root")
    compiler.clear_memory_cache()
    with _tmpfs(tmp_path / "full", "size=32m") as mnt:  # room for nvcc's temporaries
        root = mnt / "cache"
        monkeypatch.setenv("MOE_JAX_CACHE_DIR", str(root))
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):  # take every free block
            while os.write(fd, b"\0" * 65536):
                pass
        os.close(fd)
        for build in (lambda: compiler.compile_cubin("tiny", TINY, 90), launch.build_handler):
            with pytest.raises(toolchain.ToolchainError) as e:
                build()
            msg = str(e.value)
            assert f"MOE_JAX_CACHE_DIR={root} cannot be written" in msg and "No space left on device" in msg, msg
        assert not list((root / "tmp").iterdir()) and not list((root / "cubin").iterdir())
        # with space again the same cache works
        (mnt / "filler").unlink()
        assert compiler.compile_cubin("tiny", TINY, 90).compiled
    compiler.clear_memory_cache()


# --- nvcc -------------------------------------------------------------------------------------

def _fake_nvcc(folder: Path, release: str | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    nvcc = folder / "nvcc"
    said = f"Cuda compilation tools, release {release}, V{release}.1" if release else "not a CUDA compiler"
    nvcc.write_text(f"#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\necho '{said}'\n")
    nvcc.chmod(0o755)
    return nvcc


@pytest.fixture
def no_nvcc(tmp_path, monkeypatch) -> Path:
    """An environment where no nvcc is found; returns an empty folder that is PATH."""
    for var in ("MOE_JAX_NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    empty = tmp_path / "path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(toolchain, "DEFAULT_CUDA_HOMES", (tmp_path / "no-cuda",))
    return empty


def test_missing_nvcc_names_moe_jax_nvcc(no_nvcc, monkeypatch):
    with pytest.raises(toolchain.ToolchainError, match=r"nvcc not found in .* or PATH .*install a CUDA toolkit "
                                                       r"with nvcc >= 12\.9 or set MOE_JAX_NVCC"):
        toolchain.find_nvcc()
    monkeypatch.setenv("MOE_JAX_NVCC", str(no_nvcc / "nvcc"))
    with pytest.raises(toolchain.ToolchainError, match="MOE_JAX_NVCC=.*/nvcc is not an executable file"):
        toolchain.find_nvcc()


def test_too_old_nvcc_names_moe_jax_nvcc(no_nvcc, tmp_path, monkeypatch):
    old = _fake_nvcc(tmp_path / "cuda-12.4" / "bin", "12.4")
    monkeypatch.setenv("MOE_JAX_NVCC", str(old))
    with pytest.raises(toolchain.ToolchainError, match=rf"MOE_JAX_NVCC={old}: CUDA 12\.4 is too old \(DeepGEMM "
                                                       r"0\.2\.5's templates need nvcc >= 12\.9\); point "
                                                       r"MOE_JAX_NVCC at"):
        toolchain.find_nvcc()
    with pytest.raises(toolchain.ToolchainError, match="CUDA 12.4 is too old"):  # the user's path
        compiler.compile_cubin("tiny", TINY, 90)
    monkeypatch.setenv("MOE_JAX_NVCC", str(_fake_nvcc(tmp_path / "other", None)))
    with pytest.raises(toolchain.ToolchainError, match="reports no CUDA release"):
        toolchain.find_nvcc()
    # searched, not named: a too-old toolkit is passed over for a newer one, and reported if alone
    monkeypatch.delenv("MOE_JAX_NVCC")
    monkeypatch.setenv("CUDA_HOME", str(old.parent.parent))
    with pytest.raises(toolchain.ToolchainError, match=rf"no usable CUDA compiler \({old}: CUDA 12\.4 is too "
                                                       r"old .*set MOE_JAX_NVCC to its nvcc"):
        toolchain.find_nvcc()
    new = _fake_nvcc(no_nvcc, "13.0")
    assert toolchain.find_nvcc() == new
