"""Tuned configs of the SM90 grouped GEMMs (contig and masked, families with SM90 tiling): the
cache the ops read.

Opt-in and static. A frozen ``TuningPolicy`` says what the ops and ``warmup`` use:

* ``mode="off"`` (the default): DeepGEMM's heuristic (``sm90_gemm.sm90_gemm_config``);
* ``"cached"``: the config tuned earlier for the same key (below) when the cache holds one, else the
  heuristic.

The ops use ``TuningPolicy(mode=KernelSettings.gemm_tuning)`` (``custom_calls.settings``). The
search that fills the cache times candidates on the device and lives with the benchmarks
(``moe_jax/bench/autotune_search.py``, ``python -m moe_jax.bench.tune``); it writes its results
with ``store_entry``.

Cache: one JSON file per key in ``<cache root>/tuned/`` beside the cubins (the root is
``$MOE_JAX_CACHE_DIR`` or ``~/.cache/moe_jax/deep_gemm``). The key holds everything that determines
the kernel and its speed: family, GEMM kind, output dtype, m (M_cap or m_pad), N, K, groups,
expected_m (masked), num_sms, device kind, template version (the sgl-deep-gemm version and a hash
of its ``deep_gemm/`` headers), nvcc version and this module's schema. A file that cannot be read,
does not match its key or holds a config that is not legal for the shape is ignored with a
warning (a search replaces it); a stored config is never trusted without ``sm90_config_reason``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Literal

from custom_calls.native import toolchain

from .family import GemmProblem, KernelFamily
from .sm90_gemm import Sm90GemmConfig, sm90_config_reason, sm90_gemm_config

TUNING_MODES = ("off", "cached")
SCHEMA = 1


@dataclasses.dataclass(frozen=True)
class TuningPolicy:
    """How the grouped SM90 GEMMs choose their config (see the module docstring).
    device_kind: the device the tuned configs are for (None: the first GPU's, jax Device.device_kind)."""

    mode: Literal["off", "cached"] = "off"
    device_kind: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in TUNING_MODES:
            raise ValueError(f"TuningPolicy.mode must be one of {TUNING_MODES}, got {self.mode!r}"
                             + (" (searching is moe_jax.bench.autotune_search)" if self.mode == "search" else ""))


# --- the cache key ------------------------------------------------------------------------------

@functools.cache
def template_version() -> str:
    """sgl-deep-gemm's VERSION and a hash over every file of its include/deep_gemm/ tree."""
    inc = toolchain.deep_gemm_include_dir()
    version = (inc.parent / "VERSION").read_text().strip() if (inc.parent / "VERSION").is_file() else "unknown"
    h = hashlib.sha256()
    for p in sorted((inc / "deep_gemm").rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(inc)).encode() + b"\0")
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return f"{version}+{h.hexdigest()[:16]}"


def _nvcc_version() -> str:
    return toolchain.nvcc_version(str(toolchain.find_nvcc())).strip().splitlines()[-1]


def detected_device_kind() -> str | None:
    """device_kind of the first GPU seen by jax (e.g. 'NVIDIA H200'), or None without one."""
    import jax

    try:
        devs = jax.devices("gpu")
    except RuntimeError:
        return None
    return str(devs[0].device_kind) if devs else None


def problem_dict(problem: GemmProblem) -> dict[str, Any]:
    """The problem as the cache key stores it (the family by name)."""
    p = problem
    return {"kernel": p.family.name, "gemm_kind": p.gemm_kind, "m": p.m, "n": p.n, "k": p.k,
            "num_groups": p.num_groups, "expected_m": p.expected_m, "cd_dtype": p.cd_dtype}


@dataclasses.dataclass(frozen=True)
class TuningKey:
    problem: GemmProblem
    num_sms: int
    device_kind: str
    template: str
    nvcc: str
    schema: int = SCHEMA

    def as_dict(self) -> dict:
        return {"problem": problem_dict(self.problem), "num_sms": self.num_sms, "device_kind": self.device_kind,
                "template": self.template, "nvcc": self.nvcc, "schema": self.schema}

    def path(self, root: Path | None = None) -> Path:
        root = toolchain.cache_root() if root is None else root
        digest = hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:24]
        p = self.problem
        return root / "tuned" / f"{p.family.name}_{p.gemm_kind}_n{p.n}_k{p.k}_g{p.num_groups}.{digest}.json"


def tuning_key(problem: GemmProblem, num_sms: int, device_kind: str | None) -> TuningKey:
    """The cache key of ``problem`` (a grouped GEMM of a family with SM90 tiling, bf16 output)."""
    if problem.family.sm90 is None or problem.gemm_kind not in ("contig", "masked") or problem.cd_dtype != "bf16":
        raise ValueError(f"tuned configs cover the grouped GEMMs (contig, masked; bf16 output) of families with "
                         f"SM90 tiling, got {problem.gemm_kind} on {problem.family.name} with {problem.cd_dtype}")
    if not device_kind:
        raise ValueError("device_kind: tuned configs are per device kind and no GPU is visible; set "
                         "TuningPolicy(device_kind=...) (e.g. 'NVIDIA H200') to use them elsewhere")
    return TuningKey(problem=problem, num_sms=num_sms, device_kind=device_kind, template=template_version(),
                     nvcc=_nvcc_version())


# --- the cache ----------------------------------------------------------------------------------

def _config_dict(cfg: Sm90GemmConfig) -> dict[str, Any]:
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "family"}
    return {"kernel": cfg.family.name, **d}


def _config_from(d: dict[str, Any], family: KernelFamily) -> Sm90GemmConfig:
    d = dict(d)
    if d.pop("kernel") != family.name:
        raise ValueError(f"the config is for another family than {family.name!r}")
    return Sm90GemmConfig(family=family, **d)


@dataclasses.dataclass(frozen=True)
class TunedEntry:
    """What a search decided for one key: ``config`` is the winner or the heuristic itself."""

    config: Sm90GemmConfig
    heuristic: Sm90GemmConfig
    tuned: bool  # config differs from the heuristic (it won every confirmation round)
    heuristic_us: tuple[float, ...]  # objective per confirmation round (kernel time, µs)
    config_us: tuple[float, ...]
    num_candidates: int
    created: str

    def to_json(self, key: TuningKey) -> str:
        d = {"config": _config_dict(self.config), "heuristic": _config_dict(self.heuristic), "tuned": self.tuned,
             "heuristic_us": list(self.heuristic_us), "config_us": list(self.config_us),
             "num_candidates": self.num_candidates, "created": self.created}
        return json.dumps({"schema": SCHEMA, "key": key.as_dict(), **d}, indent=1, sort_keys=True)


_memo: dict[TuningKey, TunedEntry | None] = {}
_memo_lock = threading.Lock()
_warned: set[tuple[str, str]] = set()


def _warn_once(what: str, key: TuningKey, msg: str) -> None:
    tag = (what, str(key.path()))
    with _memo_lock:
        if tag in _warned:
            return
        _warned.add(tag)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _parse_entry(d: Any, key: TuningKey) -> TunedEntry:
    """The entry a cache file holds for ``key``; ValueError (or a lookup error) when it does not hold one."""
    if d.get("schema") != SCHEMA or d.get("key") != key.as_dict():
        raise ValueError("the file belongs to another key or schema")
    p = key.problem
    cfg, heur = _config_from(d["config"], p.family), _config_from(d["heuristic"], p.family)
    for c in (cfg, heur):
        reason = sm90_config_reason(c, p.m, p.n, p.k)
        if reason is None and (c.gemm_kind, c.num_groups, c.num_sms, c.cd_dtype) != (
                p.gemm_kind, p.num_groups, key.num_sms, p.cd_dtype):
            reason = "the config is for another kind, group count or SM count"
        if reason:
            raise ValueError(f"illegal config: {reason}")
    return TunedEntry(config=cfg, heuristic=heur, tuned=bool(d["tuned"]),
                      heuristic_us=tuple(map(float, d["heuristic_us"])), config_us=tuple(map(float, d["config_us"])),
                      num_candidates=int(d["num_candidates"]), created=str(d["created"]))


def load_entry(key: TuningKey) -> TunedEntry | None:
    """The cached entry of ``key``; None when absent, and None with a warning when the file is
    unreadable, belongs to another key or holds a config that is not legal for the problem."""
    with _memo_lock:
        if key in _memo:
            return _memo[key]
    path = key.path()
    if not path.is_file():
        return None  # not memoized: another process may tune it later
    try:
        entry = _parse_entry(json.loads(path.read_text()), key)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        _warn_once("corrupt", key, f"ignoring the tuned-config cache file {path}: {type(e).__name__}: {e}")
        return None  # not memoized: a search may replace the file
    with _memo_lock:
        _memo[key] = entry
    return entry


def store_entry(key: TuningKey, entry: TunedEntry) -> Path:
    """Write ``entry`` atomically (temporary file + rename) and return its path."""
    path = key.path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(entry.to_json(key))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    with _memo_lock:
        _memo[key] = entry
    return path


def clear_memory_cache() -> None:
    """Forget in-process lookups and warnings (the files stay)."""
    with _memo_lock:
        _memo.clear()
        _warned.clear()


# --- the config function of the SM90 families ---------------------------------------------------

def sm90_config(problem: GemmProblem, num_sms: int, policy: TuningPolicy | None = None) -> Sm90GemmConfig:
    """The config the op uses for ``problem`` under ``policy`` (None: the heuristic's): the tuned
    one where mode "cached" finds it, else the heuristic (also when the entry kept the heuristic:
    today's, if it changed)."""
    if policy is None or policy.mode == "off":
        return sm90_gemm_config(problem, num_sms)
    entry = load_entry(tuning_key(problem, num_sms, policy.device_kind or detected_device_kind()))
    return entry.config if entry is not None and entry.tuned else sm90_gemm_config(problem, num_sms)
