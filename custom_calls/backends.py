"""Backend registry: one op name, several implementations behind the same signature.

Implementations register `(op, backend, supports_fn, impl_fn)`. `supports_fn(**static) -> (ok,
reason)` sees the op's static arguments (shapes, dtypes, recipe, arch, ...) plus `platform`
(`jax.default_backend()` at resolve time). `resolve(op, backend, **static)`:
  * an explicit name -> that implementation, or ValueError carrying its reason;
  * "auto" -> the first accelerated implementation whose package is available on this platform
    and whose supports_fn says ok, else "reference";
  * None -> the default set by `use_backend` ("reference" unless changed).

Accelerated packages register lazily: `register_lazy(backend, module, platforms)` names a module
that is imported only when that backend is first resolved on one of `platforms` (e.g. "gpu"); the
module registers its ops on import. Importing `custom_calls` imports no GPU dependency and probes
no device. Resolution happens at trace time: under `jax.jit` pass backends explicitly (a changed
`use_backend` default does not retrace an already compiled function).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

REFERENCE = "reference"
AUTO = "auto"

SupportsFn = Callable[..., tuple[bool, str]]


@dataclass(frozen=True)
class Implementation:
    op: str
    backend: str
    supports: SupportsFn
    impl: Callable


_IMPLS: dict[str, dict[str, Implementation]] = {}
_LAZY: dict[str, tuple[str, tuple[str, ...]]] = {}
_PLATFORMS: dict[str, tuple[str, ...]] = {}  # backend -> platforms it runs on (absent: any)
_LAZY_ERRORS: dict[str, str] = {}
_LOCK = threading.Lock()
_DEFAULT = threading.local()
_RECORDING = threading.local()  # .logs: the lists of the active `record_resolutions` blocks


def _always(**_static) -> tuple[bool, str]:
    return True, ""


def register(op: str, backend: str, impl: Callable, supports: SupportsFn | None = None) -> None:
    """Register `impl` as `backend`'s implementation of `op` (replacing an earlier one)."""
    if backend == AUTO:
        raise ValueError(f"backend: {AUTO!r} is reserved for selection, not a registrable name")
    with _LOCK:
        _IMPLS.setdefault(op, {})[backend] = Implementation(op, backend, supports or _always, impl)


def register_lazy(backend: str, module: str, platforms: tuple[str, ...] = ("gpu",)) -> None:
    """Declare that importing `module` registers `backend`'s implementations; the import happens
    on first resolution on one of `platforms`."""
    with _LOCK:
        _LAZY[backend] = (module, tuple(platforms))
        _PLATFORMS[backend] = tuple(platforms)


def _current_platform() -> str:
    import jax

    return jax.default_backend()


def _load(backend: str) -> str | None:
    """Import a lazily registered backend; returns an error text when it cannot be loaded."""
    if backend not in _LAZY:
        return None
    if backend in _LAZY_ERRORS:
        return _LAZY_ERRORS[backend]
    module, _ = _LAZY[backend]
    try:
        importlib.import_module(module)
    except Exception as exc:  # the reason travels to the user; never a silent fallback
        _LAZY_ERRORS[backend] = f"importing {module} failed: {type(exc).__name__}: {exc}"
        return _LAZY_ERRORS[backend]
    with _LOCK:
        del _LAZY[backend]
    return None


def backends(op: str) -> list[str]:
    """Names of the implementations of `op` registered so far (lazy ones not yet loaded excluded)."""
    return list(_IMPLS.get(op, {}))


def get_default_backend() -> str:
    return getattr(_DEFAULT, "name", REFERENCE)


@contextlib.contextmanager
def record_resolutions() -> Iterator[list[tuple[str, str]]]:
    """Within the block, every `resolve` appends (op, backend of the implementation it returned) to
    the yielded list: trace a function inside it to learn what each op resolved to ("auto" falls
    back to "reference" where no accelerated implementation can run). jit caches skip resolution
    for traces they already hold: trace under `jax.disable_jit()`."""
    log: list[tuple[str, str]] = []
    _RECORDING.logs = (*getattr(_RECORDING, "logs", ()), log)
    try:
        yield log
    finally:
        _RECORDING.logs = tuple(x for x in _RECORDING.logs if x is not log)


def _returned(op: str, impl: Implementation) -> Implementation:
    """`resolve`'s answer, noted in every active `record_resolutions` log."""
    for log in getattr(_RECORDING, "logs", ()):
        log.append((op, impl.backend))
    return impl


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Within the block, ops called with backend=None use `name` ("reference", "auto", ...)."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected a backend name (str), got {type(name).__name__}")
    prev = get_default_backend()
    _DEFAULT.name = name
    try:
        yield name
    finally:
        _DEFAULT.name = prev


def resolve(op: str, backend: str | None = None, **static) -> Implementation:
    """Pick the implementation of `op` for `backend` given the op's static arguments."""
    if backend is None:
        backend = get_default_backend()
    platform = static.pop("platform", None) or _current_platform()
    if backend == AUTO:
        for name, (_, platforms) in list(_LAZY.items()):
            if platform in platforms:
                _load(name)
        for name, impl in _IMPLS.get(op, {}).items():
            # a package imported directly (not through the registry) is registered but may still
            # not run here: its platforms are checked before its supports_fn is asked
            if name == REFERENCE or platform not in _PLATFORMS.get(name, (platform,)):
                continue
            ok, _ = impl.supports(platform=platform, **static)
            if ok:
                return _returned(op, impl)
        backend = REFERENCE
    platforms = _PLATFORMS.get(backend)
    if platforms is not None and platform not in platforms:
        raise ValueError(f"backend {backend!r} for op {op!r}: runs on platform(s) {platforms}, "
                         f"current platform is {platform!r}")
    if backend in _LAZY:
        err = _load(backend)
        if err is not None:
            raise ValueError(f"backend {backend!r} for op {op!r} is unavailable: {err}")
    impl = _IMPLS.get(op, {}).get(backend)
    if impl is None:
        known = sorted(set(_IMPLS.get(op, {})) | set(_LAZY) | {AUTO})
        raise ValueError(f"backend {backend!r}: no implementation of op {op!r} (known: {known})")
    ok, reason = impl.supports(platform=platform, **static)
    if not ok:
        raise ValueError(f"backend {backend!r} cannot run op {op!r}: {reason}")
    return _returned(op, impl)


# Accelerated packages: imported only when chosen on a GPU.
register_lazy("deep_gemm", "custom_calls.deep_gemm", platforms=("gpu",))
register_lazy("triton", "custom_calls.triton", platforms=("gpu",))
