"""Backend registry: one op name, several implementations behind the same signature.

The registry is the single source of truth about ops and backends:

* `declare_op(name, static_args=..., reference=..., stage=...)` declares an op once: its name, the
  static keywords every resolution passes (shapes, dtypes, recipe, arch, ...), its pure-JAX
  reference (registered as backend "reference") and the layer stage it implements.
* `register(op, backend, impl, supports)` adds an implementation. `supports(**static) -> (ok,
  reason)` answers from the static arguments alone (shapes, dtypes, recipe); whether the backend
  can run on this machine at all (platform, packages, device) is the backend's `environment`
  check, declared once per backend with `register_lazy` / `set_environment`.
* `resolve(op, backend, **static)` checks the static keywords against the declaration (unknown or
  missing ones are a TypeError), then:
    - an explicit name -> that implementation, or ValueError carrying the reason it cannot run;
    - "auto" -> the first backend of `auto_order()` that is available here and whose supports
      says ok, else "reference";
    - None -> the default set by `use_backend` ("reference" unless changed).
  `supports` runs here, once; a registered implementation trusts the call that `resolve`
  accepted (the public op functions check their inputs before resolving).
* `backend_stages(backend)` is the set of layer stages a backend implements, from its registered
  ops; `static_supports(...)` answers the shape question without the environment (e.g. whether
  the masked activation kernel could serve a layout, also on a machine without a GPU).

Derivatives: every registered (non-reference) implementation is wrapped once, in `register`, in a
`jax.custom_jvp` with its values unchanged; when a derivative (jax.grad, vjp, jvp, linearize)
reaches one of its array inputs, the wrapper raises `NoGradientError` naming the op, its stage and
the backend, and pointing to backend="reference" (whose ops are all differentiable) or
`jax.lax.stop_gradient`. Without it the error would come from JAX and name no op ("The FFI call
to ... cannot be differentiated", jax_triton's call without a differentiation rule, "Pure callbacks
do not support JVP" under Triton's interpreter). The wrapper lowers to the same program (a
custom_jvp call is inlined) and is seen only by derivatives.

Accelerated packages register lazily: `register_lazy(backend, module, platforms)` names a module
imported when the backend is first needed (resolution on one of `platforms`, or a stage/static
query); the module registers its ops on import. Importing `custom_calls` imports no GPU dependency
and probes no device. Resolution happens at trace time: under `jax.jit` pass backends explicitly
(a changed `use_backend` default does not retrace an already compiled function).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

import jax
from jax.custom_derivatives import SymbolicZero, zero_from_primal

REFERENCE = "reference"
AUTO = "auto"
# The order in which "auto" tries accelerated backends; backends registered later and not listed
# here are tried after these, in registration order.
AUTO_ORDER = ("deep_gemm", "triton", "w4a8")

SupportsFn = Callable[..., tuple[bool, str]]
EnvironmentFn = Callable[..., str]


@dataclass(frozen=True)
class OpSpec:
    """An op: its name, the static keywords of its resolution, its layer stage (None: not a
    stage of the layer) and its pure-JAX reference."""

    name: str
    static_args: frozenset
    stage: str | None
    reference: Callable


@dataclass(frozen=True)
class Implementation:
    op: str
    backend: str
    supports: SupportsFn
    impl: Callable


@dataclass
class _Backend:
    module: str | None = None  # imported on first need; registers the backend's ops
    platforms: tuple[str, ...] | None = None  # None: any platform
    environment: EnvironmentFn | None = None  # (platform, *, op, **static) -> "" or why it cannot run here
    load_error: str | None = None


_OPS: dict[str, OpSpec] = {}
_IMPLS: dict[str, dict[str, Implementation]] = {}
_BACKENDS: dict[str, _Backend] = {}
_LOCK = threading.RLock()
_DEFAULT = threading.local()
_RECORDING = threading.local()  # .logs: the lists of the active `record_resolutions` blocks


def _always(**_static) -> tuple[bool, str]:
    return True, ""


def declare_op(name: str, *, static_args: tuple[str, ...], reference: Callable,
               stage: str | None = None) -> OpSpec:
    """Declare op `name` once, with its reference implementation (backend "reference")."""
    with _LOCK:
        if name in _OPS:
            raise ValueError(f"op: {name!r} is already declared")
        spec = OpSpec(name, frozenset(static_args), stage, reference)
        _OPS[name] = spec
        _IMPLS.setdefault(name, {})[REFERENCE] = Implementation(name, REFERENCE, _always, reference)
    return spec


def op_spec(op: str) -> OpSpec:
    if op not in _OPS:
        raise ValueError(f"op: expected one of {sorted(_OPS)}, got {op!r}")
    return _OPS[op]


def register(op: str, backend: str, impl: Callable, supports: SupportsFn | None = None) -> None:
    """Register `impl` as `backend`'s implementation of the declared op `op` (replacing an earlier
    one). `supports(**static) -> (ok, reason)` sees the op's declared static keywords. `impl`
    returns arrays (a pytree of them); it is stored wrapped by `without_derivative`."""
    if backend in (AUTO, REFERENCE):
        raise ValueError(f"backend: {backend!r} is reserved, not a registrable name")
    op_spec(op)
    with _LOCK:
        _BACKENDS.setdefault(backend, _Backend())
        wrapped = without_derivative(op, backend, impl)
        _IMPLS[op][backend] = Implementation(op, backend, supports or _always, wrapped)


class SplitArrays(NamedTuple):
    """`split_arrays`' answer: `where` the indices of the array leaves among the flattened leaves of
    (args, kwargs), `arrays` those leaves, `run(*arrays)` fn called with them and every other leaf
    (static values) as given, `static_key` what run depends on besides the arrays (the tree, where,
    each static leaf with its type; hashable where the static leaves are)."""
    where: tuple[int, ...]
    arrays: list
    run: Callable
    static_key: tuple


def split_arrays(fn: Callable, args: tuple, kwargs: dict, is_array: Callable[[object], bool]) -> SplitArrays:
    """(args, kwargs) split into array leaves and the rest (`SplitArrays`). For wrappers whose
    transform must see only the array arguments. run holds the static leaves only, so a wrapper may
    keep it (one compiled program per static_key) without keeping the arrays of the call alive."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    where = tuple(i for i, leaf in enumerate(leaves) if is_array(leaf))
    statics = tuple(None if i in where else leaf for i, leaf in enumerate(leaves))

    def run(*arrays):
        full = list(statics)
        for i, a in zip(where, arrays):
            full[i] = a
        a, kw = jax.tree_util.tree_unflatten(tree, full)
        return fn(*a, **kw)

    # the type beside each value: 2, 2.0 and True are equal and hash alike but trace differently
    static_key = (tree, where, tuple((type(leaf), leaf) for leaf in statics))
    return SplitArrays(where, [leaves[i] for i in where], run, static_key)


class NoGradientError(NotImplementedError):
    """A derivative (jax.grad, vjp, jvp) reached an accelerated implementation, which has none."""


def without_derivative(op: str, backend: str, impl: Callable) -> Callable:
    """`impl` with the same values, whose derivative raises `NoGradientError` (module docstring).

    The jax.Array leaves of the call's arguments (positional and keyword) become the inputs of a
    `jax.custom_jvp`; every other leaf (static keywords, None, numpy constants) reaches `impl` as
    given. A derivative that moves only integer inputs (float0 tangents) gives zero tangents; a
    call without any jax.Array calls `impl` directly."""

    @functools.wraps(impl)
    def call(*args, **kwargs):
        where, arrays, run, _ = split_arrays(impl, args, kwargs, lambda leaf: isinstance(leaf, jax.Array))
        if not where:
            return impl(*args, **kwargs)

        def jvp(primals, tangents):
            moved = [k for k, t in enumerate(tangents)
                     if type(t) is not SymbolicZero and t.dtype != jax.dtypes.float0]
            if not moved:
                out = run(*primals)
                return out, zero_from_primal(out, symbolic_zeros=True)
            moved = [where[k] for k in moved]
            raise NoGradientError(_no_gradient_message(op, backend, impl, args, kwargs, moved))

        fn = jax.custom_jvp(run)
        fn.defjvp(jvp, symbolic_zeros=True)
        return fn(*arrays)

    call.without_derivative = (op, backend)
    return call


def _no_gradient_message(op: str, backend: str, impl: Callable, args: tuple, kwargs: dict,
                         moved: list[int]) -> str:
    """The error of a derivative reaching leaves `moved` (indices into the flattened (args, kwargs))."""
    try:
        params = inspect.signature(impl).parameters.values()
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):  # no signature to read
        positional = []
    paths = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
    names = []
    for i in moved:
        (top, key, *rest), _ = paths[i]
        if top.idx == 0:  # a positional argument: its parameter's name where the signature has one
            name = positional[key.idx] if key.idx < len(positional) else f"argument {key.idx}"
        else:
            name = key.key
        names.append(name + jax.tree_util.keystr(tuple(rest)))
    stage = op_spec(op).stage
    where = f"op {op!r}" + (f" (stage {stage!r})" if stage else "")
    alone = f"; a {{stage: backend}} dict with {stage!r}: 'reference' moves this stage alone" if stage else ""
    return (f"{where} ran on backend {backend!r}, which has no derivative for it (its kernel is an XLA "
            f"custom call), and a derivative (jax.grad / vjp / jvp) reached its input(s) {', '.join(names)}. "
            f"Differentiate on backend='reference' instead, where every op is differentiable "
            f"(moe_forward(..., backend='reference'){alone}), or apply jax.lax.stop_gradient to those "
            f"inputs if no gradient should flow through this op.")


def register_lazy(backend: str, module: str, platforms: tuple[str, ...] = ("gpu",)) -> None:
    """Declare that importing `module` registers `backend`'s implementations and that the backend
    runs only on `platforms`."""
    with _LOCK:
        b = _BACKENDS.setdefault(backend, _Backend())
        b.module, b.platforms = module, tuple(platforms)


def set_environment(backend: str, environment: EnvironmentFn) -> None:
    """`environment(platform, *, op, **static) -> reason` ("" when `backend` can run here): packages,
    device, compiler. `op` is the op being resolved (None when the backend is asked as a whole, by
    `unavailable_reason`), for a backend whose ops need different tools. Asked before any of the
    backend's `supports`."""
    with _LOCK:
        _BACKENDS.setdefault(backend, _Backend()).environment = environment


def _load(backend: str) -> str | None:
    """Import a lazily registered backend; returns an error text when it cannot be loaded."""
    b = _BACKENDS.get(backend)
    if b is None or b.module is None:
        return None
    if b.load_error is None:
        try:
            importlib.import_module(b.module)
        except Exception as exc:  # the reason travels to the user; never a silent fallback
            b.load_error = f"importing {b.module} failed: {type(exc).__name__}: {exc}"
        else:
            b.load_error = ""
    return b.load_error or None


def _current_platform() -> str:
    import jax

    return jax.default_backend()


def auto_order() -> tuple[str, ...]:
    """Accelerated backends in the order "auto" tries them."""
    rest = [b for b in _BACKENDS if b not in AUTO_ORDER]
    return tuple(b for b in AUTO_ORDER if b in _BACKENDS) + tuple(rest)


def backends(op: str) -> list[str]:
    """Names of the implementations of `op` (lazily registered backends are loaded first)."""
    op_spec(op)
    for name in list(_BACKENDS):
        _load(name)
    return list(_IMPLS[op])


def backend_stages(backend: str) -> frozenset:
    """Layer stages (`OpSpec.stage`) `backend` implements, from its registered ops."""
    if backend == REFERENCE:
        return frozenset(s.stage for s in _OPS.values() if s.stage)
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {sorted({REFERENCE, AUTO, *_BACKENDS})}, got {backend!r}")
    err = _load(backend)
    if err is not None:
        raise ValueError(f"backend {backend!r} is unavailable: {err}")
    return frozenset(_OPS[op].stage for op, impls in _IMPLS.items() if backend in impls and _OPS[op].stage)


def known_backends() -> tuple[str, ...]:
    """Every backend name a caller may pass: "reference", "auto" and the registered ones."""
    return (REFERENCE, AUTO, *_BACKENDS)


def get_default_backend() -> str:
    return getattr(_DEFAULT, "name", REFERENCE)


@contextlib.contextmanager
def record_resolutions() -> Iterator[list[tuple[str, str]]]:
    """Within the block, every `resolve` appends (op, backend of the implementation it returned) to
    the yielded list: trace a function inside it to learn what each op resolved to ("auto" falls
    back to "reference" where no accelerated implementation can run). A trace jax already holds
    (jit caches) skips the ops' resolution: clear them first (`jax.clear_caches()`)."""
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


def _check_static(spec: OpSpec, static: dict) -> None:
    given = set(static)
    unknown, missing = given - spec.static_args, spec.static_args - given
    if unknown or missing:
        parts = ([f"unknown {sorted(unknown)}"] if unknown else []) + ([f"missing {sorted(missing)}"] if missing else [])
        raise TypeError(f"static arguments of op {spec.name!r}: expected {sorted(spec.static_args)}, "
                        f"got {' and '.join(parts)}")


def _platform_reason(backend: str, platform: str) -> str:
    """Why `backend` cannot even be considered on `platform` (wrong platform, failed import)."""
    b = _BACKENDS[backend]
    if b.platforms is not None and platform not in b.platforms:
        return f"runs on platform(s) {b.platforms}, current platform is {platform!r}"
    err = _load(backend)
    return f"is unavailable: {err}" if err is not None else ""


def _environment_reason(backend: str, platform: str, static: dict, op: str | None = None) -> str:
    env = _BACKENDS[backend].environment
    return env(platform, op=op, **static) if env is not None else ""


def unavailable_reason(backend: str, *, platform: str | None = None, **static) -> str:
    """Why `backend` cannot run on this machine at all ("" when it can): its platforms, import and
    environment check (`static` as the environment check needs it, e.g. `arch`)."""
    if backend == REFERENCE:
        return ""
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {known_backends()}, got {backend!r}")
    platform = platform or _current_platform()
    return _platform_reason(backend, platform) or _environment_reason(backend, platform, static)


def _lookup(op: str, backend: str) -> Implementation:
    impl = _IMPLS[op].get(backend)
    if impl is None:
        raise ValueError(f"backend {backend!r}: no implementation of op {op!r} "
                         f"(known: {sorted({*_IMPLS[op], AUTO})})")
    return impl


def resolve(op: str, backend: str | None = None, **static) -> Implementation:
    """Pick the implementation of `op` for `backend` given the op's static arguments (all of the
    declared ones; `platform=` overrides `jax.default_backend()`)."""
    spec = op_spec(op)
    platform = static.pop("platform", None) or _current_platform()
    _check_static(spec, static)
    if backend is None:
        backend = get_default_backend()
    if backend == AUTO:
        for name in auto_order():
            if _platform_reason(name, platform):
                continue
            impl = _IMPLS[op].get(name)
            if (impl is not None and impl.supports(**static)[0]
                    and not _environment_reason(name, platform, static, op)):
                return _returned(op, impl)
        backend = REFERENCE
    if backend == REFERENCE:
        return _returned(op, _IMPLS[op][REFERENCE])
    if backend not in _BACKENDS:
        raise ValueError(f"backend {backend!r}: no implementation of op {op!r} (known: "
                         f"{sorted({*_IMPLS[op], *_BACKENDS, AUTO})})")
    reason = _platform_reason(backend, platform)
    if reason:
        raise ValueError(f"backend {backend!r} for op {op!r}: {reason}")
    impl = _lookup(op, backend)
    ok, reason = impl.supports(**static)  # what the call asks for first, then whether this machine can
    reason = reason if not ok else _environment_reason(backend, platform, static, op)
    if reason:
        raise ValueError(f"backend {backend!r} cannot run op {op!r}: {reason}")
    return _returned(op, impl)


def static_supports(op: str, backend: str, **static) -> tuple[bool, str]:
    """(ok, reason) of `backend`'s implementation of `op` for these static arguments, without the
    environment check (platform, packages, device). "auto" asks the first accelerated backend of
    `auto_order()` that implements the op; "reference" and "auto" without one are always ok."""
    spec = op_spec(op)
    _check_static(spec, static)
    if backend == AUTO:
        backend = next((b for b in auto_order() if _load(b) is None and b in _IMPLS[op]), REFERENCE)
    if backend == REFERENCE:
        return True, ""
    if backend not in _BACKENDS or _load(backend) is not None or backend not in _IMPLS[op]:
        return False, f"backend {backend!r} has no implementation of op {op!r}"
    return _IMPLS[op][backend].supports(**static)


# Accelerated packages: imported when first needed (never at `import custom_calls`).
# the GEMMs of custom_calls.deep_gemm and the fused MoE ops, its kernel composed with Triton kernels
register_lazy("deep_gemm", "custom_calls.fused_moe_sm90", platforms=("gpu",))
# the CPU only under Triton's interpreter (its environment check says which)
register_lazy("triton", "custom_calls.triton", platforms=("gpu", "cpu"))
register_lazy("w4a8", "custom_calls.w4a8_backend", platforms=("gpu", "cpu"))
