"""Autotuning of the SM90 grouped GEMMs (contig and masked; FP8 1D2D and BF16).

Opt-in and static. A frozen ``TuningPolicy`` says what the ops and ``warmup`` use:

* ``mode="off"`` (the default): DeepGEMM's heuristic (``heuristics.sm90_gemm_config``);
* ``"cached"``: the config tuned earlier for the same key (below) when the cache holds one, else the
  heuristic;
* ``"search"``: as ``"cached"``, and ``warmup`` (or ``tune``) times the candidates on the device for
  keys the cache lacks. The ops never search while a jitted function is traced unless
  ``search_in_trace`` is set: compiling and timing a dozen kernels per shape takes minutes, and the
  ops run at trace time; without it they warn once per key and use the heuristic.

The ops use ``TuningPolicy(mode=KernelSettings.gemm_tuning)`` ("off" or "cached";
``custom_calls.settings``); searching is ``warmup(..., tuning=TuningPolicy(mode="search"))`` or
``python -m moe_jax.bench.tune``.

Search (GPU): the candidates are legal configs (``heuristics.sm90_candidates``). Phase 1 times up
to ``max_tiles`` tiles, each with the most stages that fit and the largest D swizzle: the heuristic's,
the other multicast choices and block heights around it, its BLOCK_N neighbours, then the best by the
heuristic's traffic model (``phase1_candidates``); phase 2 times fewer stages and the other D
swizzles of the ``refine_tiles`` fastest tiles beside the heuristic and the phase-1 winner. Every
candidate's output is compared with the heuristic's on the same inputs first: any tiling computes
the same products in the same k order, so they must agree within the bf16 rounding of the output
(one unit in the last place), else the candidate is dropped. Times are GPU
kernel durations from one profiler trace per phase, the candidates of a shape interleaved round by
round (a clock change under the power cap then hits all of them alike); masked shapes are timed on
two ``masked_m`` patterns (every group at expected_m, and a multinomial draw of the same total, as
routing produces) and ranked by the sum. The heuristic stays unless the winner is faster by more than
``min_gain`` in each of ``confirm_rounds`` further traces of the two.

Cache: one JSON file per key in ``<cache root>/tuned/`` beside the cubins (the root is
``$MOE_JAX_CACHE_DIR`` or ``~/.cache/moe_jax/deep_gemm``). The key holds everything that determines
the kernel and its speed: kernel, GEMM kind, output dtype, m (M_cap or m_pad), N, K, groups,
expected_m (masked), num_sms, device kind, template version (the sgl-deep-gemm version and a hash
of its ``deep_gemm/`` headers), nvcc version and this module's schema. A file that cannot be read,
does not match its key or holds a config that is not legal for the shape is ignored with a
warning (a search replaces it); a stored config is never trusted without ``sm90_config_reason``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import functools
import hashlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from custom_calls.native import toolchain

from . import codegen, compiler, plans
from .heuristics import (SM90_CLUSTERS, Sm90GemmConfig, align, ceil_div, sm90_build_config, sm90_candidates,
                         sm90_config_reason, sm90_gemm_config, sm90_model_cost, sm90_swizzle_cd_choices,
                         sm90_tile_configs)

TUNING_MODES = ("off", "cached", "search")
SCHEMA = 1
_KERNEL_NAMES = {"fp8_1d2d": "sm90_fp8_gemm_1d2d", "bf16": "sm90_bf16_gemm"}
_MIN_TUNED_STAGES = 3  # phase 2 tries fewer stages, but not below the heuristic's own floor


@dataclasses.dataclass(frozen=True)
class TuningPolicy:
    """How the grouped SM90 GEMMs choose their config (see the module docstring)."""

    mode: Literal["off", "cached", "search"] = "off"
    min_gain: float = 0.01  # a tuned config must beat the heuristic by more than this, every round
    max_tiles: int = 16  # phase-1 tiles per shape (the heuristic's included)
    refine_tiles: int = 2  # phase 2 varies stages and D swizzle of this many fastest tiles
    iters: int = 8  # timed launches per candidate (and masked_m pattern) per trace
    confirm_rounds: int = 2
    retune: bool = False  # search even when the cache holds an entry
    search_in_trace: bool = False  # let the ops search while a function is traced
    device_kind: str | None = None  # None: the first GPU's (jax Device.device_kind)

    def __post_init__(self) -> None:
        if self.mode not in TUNING_MODES:
            raise ValueError(f"TuningPolicy.mode must be one of {TUNING_MODES}, got {self.mode!r}")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"TuningPolicy.min_gain must be in [0, 1), got {self.min_gain}")
        for name in ("max_tiles", "iters", "confirm_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"TuningPolicy.{name} must be >= 1, got {getattr(self, name)}")
        if self.refine_tiles < 0:
            raise ValueError(f"TuningPolicy.refine_tiles must be >= 0, got {self.refine_tiles}")


@dataclasses.dataclass(frozen=True)
class Sm90Problem:
    """One grouped SM90 GEMM shape. m: M_cap (contig) or m_pad (masked); expected_m: masked only,
    the rows per group the kernel is tuned for (ops clamp it to [1, m_pad])."""

    kernel: Literal["fp8_1d2d", "bf16"]
    gemm_kind: Literal["contig", "masked"]
    m: int
    n: int
    k: int
    num_groups: int
    expected_m: int | None = None
    cd_dtype: Literal["bf16"] = "bf16"

    def __post_init__(self) -> None:
        if self.kernel not in _KERNEL_NAMES:
            raise ValueError(f"kernel must be one of {sorted(_KERNEL_NAMES)}, got {self.kernel!r}")
        if self.gemm_kind not in ("contig", "masked"):
            raise ValueError(f"gemm_kind: tuning covers 'contig' and 'masked', got {self.gemm_kind!r}")
        if min(self.m, self.n, self.k, self.num_groups) <= 0:
            raise ValueError(f"m, n, k, num_groups must be > 0, got {self}")
        if self.gemm_kind == "masked" and not (isinstance(self.expected_m, int) and 1 <= self.expected_m <= self.m):
            raise ValueError(f"expected_m: masked needs an int in [1, m_pad={self.m}], got {self.expected_m!r}")
        if self.gemm_kind == "contig" and self.expected_m is not None:
            raise ValueError(f"expected_m: only masked GEMMs take it, got {self.expected_m!r}")
        if self.cd_dtype != "bf16":
            raise ValueError(f"cd_dtype: the grouped GEMMs write bf16, got {self.cd_dtype!r}")

    def heuristic(self, num_sms: int) -> Sm90GemmConfig:
        return sm90_gemm_config(self.kernel, self.gemm_kind, self.m, self.n, self.k, self.num_groups, num_sms,
                                cd_dtype=self.cd_dtype, expected_m=self.expected_m)

    def candidates(self, num_sms: int) -> list[Sm90GemmConfig]:
        return sm90_candidates(self.kernel, self.gemm_kind, self.m, self.n, self.k, self.num_groups, num_sms,
                               cd_dtype=self.cd_dtype)

    @property
    def label(self) -> str:
        if self.gemm_kind == "contig":
            return f"{self.kernel} contig M={self.m} G={self.num_groups} N={self.n} K={self.k}"
        return (f"{self.kernel} masked G={self.num_groups} m_pad={self.m} expected_m={self.expected_m} "
                f"N={self.n} K={self.k}")


def grouped_problem(kind: str, rows: int, n: int, k: int, num_groups: int, kernel: str,
                    expected_m: int | None = None) -> Sm90Problem:
    """The problem of an SM90 grouped GEMM op call on ``kernel`` ('fp8_1d2d' or 'bf16'); expected_m
    (masked; None = rows) is clamped to [1, rows] as the op clamps it."""
    em = None
    if kind == "masked":
        em = rows if expected_m is None else max(1, min(expected_m, rows))
    return Sm90Problem(kernel, kind, rows, n, k, num_groups, em)


def config_label(cfg: Sm90GemmConfig) -> str:
    """Short text of a config: tile, multicast (A or B), stages, D swizzle."""
    mc = "mcA" if cfg.cluster_n > 1 else "mcB" if cfg.cluster_m > 1 else "mc-"
    return f"{cfg.block_m}x{cfg.block_n} {mc} s{cfg.num_stages} sw{cfg.swizzle_cd}"


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


@dataclasses.dataclass(frozen=True)
class TuningKey:
    problem: Sm90Problem
    num_sms: int
    device_kind: str
    template: str
    nvcc: str
    schema: int = SCHEMA

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["problem"] = dataclasses.asdict(self.problem)
        return d

    def path(self, root: Path | None = None) -> Path:
        root = toolchain.cache_root() if root is None else root
        digest = hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:24]
        p = self.problem
        return root / "tuned" / f"{p.kernel}_{p.gemm_kind}_n{p.n}_k{p.k}_g{p.num_groups}.{digest}.json"


def tuning_key(problem: Sm90Problem, num_sms: int, device_kind: str | None) -> TuningKey:
    if not device_kind:
        raise ValueError("device_kind: tuned configs are per device kind and no GPU is visible; set "
                         "TuningPolicy(device_kind=...) (e.g. 'NVIDIA H200') to use them elsewhere")
    return TuningKey(problem=problem, num_sms=num_sms, device_kind=device_kind, template=template_version(),
                     nvcc=_nvcc_version())


# --- the cache ----------------------------------------------------------------------------------

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
        d = dataclasses.asdict(self)
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
        d = json.loads(path.read_text())
        if d.get("schema") != SCHEMA or d.get("key") != key.as_dict():
            raise ValueError("the file belongs to another key or schema")
        cfg, heur = Sm90GemmConfig(**d["config"]), Sm90GemmConfig(**d["heuristic"])
        p = key.problem
        for c in (cfg, heur):
            reason = sm90_config_reason(c, p.m, p.n, p.k)
            if reason is None and (c.kernel, c.gemm_kind, c.num_groups, c.num_sms, c.cd_dtype) != (
                    p.kernel, p.gemm_kind, p.num_groups, key.num_sms, p.cd_dtype):
                reason = "the config is for another kernel, kind, group count or SM count"
            if reason:
                raise ValueError(f"illegal config: {reason}")
        entry = TunedEntry(config=cfg, heuristic=heur, tuned=bool(d["tuned"]),
                           heuristic_us=tuple(map(float, d["heuristic_us"])),
                           config_us=tuple(map(float, d["config_us"])),
                           num_candidates=int(d["num_candidates"]), created=str(d["created"]))
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


# --- the hook used by the ops and warmup --------------------------------------------------------

def sm90_config(problem: Sm90Problem, num_sms: int, policy: TuningPolicy | None = None) -> Sm90GemmConfig:
    """The config the op uses for ``problem`` under ``policy`` (None: the heuristic's).

    Called at trace time: searches only with ``policy.search_in_trace`` (see the module docstring).
    """
    if policy is None or policy.mode == "off":
        return problem.heuristic(num_sms)
    key = tuning_key(problem, num_sms, policy.device_kind or detected_device_kind())
    entry = None if policy.retune else load_entry(key)
    if entry is not None:  # the heuristic itself when it was not beaten (today's heuristic, if it changed)
        return entry.config if entry.tuned else problem.heuristic(num_sms)
    if policy.mode == "search":
        if policy.search_in_trace:
            import jax

            with jax.ensure_compile_time_eval():  # run the search now, not as part of the traced program
                (report,) = tune([problem], num_sms=num_sms, policy=policy)
            return report.entry.config
        _warn_once("no-search", key, f"no tuned config cached for {problem.label}; the ops do not search while "
                   "tracing (TuningPolicy.search_in_trace), so the heuristic runs: tune first with "
                   "warmup(shapes, tuning=TuningPolicy(mode='search')) or python -m moe_jax.bench.tune")
    return problem.heuristic(num_sms)


# --- candidate selection (pure) -----------------------------------------------------------------

def phase1_candidates(problem: Sm90Problem, num_sms: int, max_tiles: int) -> list[Sm90GemmConfig]:
    """Tiles to time first (at most ``max_tiles``), each with the most stages that fit and the
    largest D swizzle, in this order: the heuristic's tile; at its BLOCK_M, the best tile of every
    cluster choice (no multicast, multicast of A, of B); the best tile at half and at twice its
    BLOCK_M; its BLOCK_M and cluster with the four (masked: six) BLOCK_N nearest its own; then the
    rest by the heuristic's traffic model."""
    p = problem
    heur = problem.heuristic(num_sms)
    tiles = sm90_tile_configs(p.kernel, p.gemm_kind, p.m, p.n, p.k, p.num_groups, num_sms, cd_dtype=p.cd_dtype)

    def cost(c: Sm90GemmConfig) -> tuple[int, int, int, int]:
        # the model prices clusters it deems useless at "infinity"; rank those by their unclustered cost
        flat = dataclasses.replace(c, cluster_m=1, cluster_n=1)
        return (sm90_model_cost(c, p.m, p.n, p.k, p.expected_m), sm90_model_cost(flat, p.m, p.n, p.k, p.expected_m),
                c.block_m, c.block_n)

    ranked = sorted(tiles, key=cost)
    same_bm = [c for c in ranked if c.block_m == heur.block_m]
    picks = [heur]
    picks += [next((c for c in same_bm if (c.cluster_m, c.cluster_n) == cl), None) for cl in SM90_CLUSTERS]
    picks += [next((c for c in ranked if c.block_m == bm), None) for bm in (heur.block_m // 2, heur.block_m * 2)]
    family = [c for c in same_bm if (c.cluster_m, c.cluster_n) == (heur.cluster_m, heur.cluster_n)]
    near = 6 if p.gemm_kind == "masked" else 4  # memory-bound masked GEMMs: BLOCK_N sets the load balance
    picks += sorted(family, key=lambda c: (abs(c.block_n - heur.block_n), c.block_n))[1:1 + near]
    picks += ranked
    chosen: list[Sm90GemmConfig] = []
    for c in picks:
        if c is not None and c not in chosen:
            chosen.append(c)
    return chosen[:max_tiles]


def refine_candidates(problem: Sm90Problem, num_sms: int, parents: Sequence[Sm90GemmConfig]
                      ) -> list[Sm90GemmConfig]:
    """Pipeline variants of ``parents``: one and two stages fewer (not below 3) at their swizzle, and
    every other legal D swizzle at their stage count. All legal; parents excluded."""
    out = []
    p = problem
    for par in parents:
        variants = [dataclasses.replace(par, num_stages=s) for s in (par.num_stages - 1, par.num_stages - 2)
                    if s >= _MIN_TUNED_STAGES]
        variants += [dataclasses.replace(par, swizzle_cd=z)
                     for z in sm90_swizzle_cd_choices(par.kernel, par.cd_dtype, par.block_n) if z != par.swizzle_cd]
        for v in variants:
            v = sm90_build_config(v.kernel, v.gemm_kind, v.cd_dtype, v.num_groups, num_sms, p.k, v.block_m,
                                  v.block_n, v.cluster_m, v.cluster_n, v.num_stages, v.swizzle_cd)
            if sm90_config_reason(v, p.m, p.n, p.k) is None and v not in out and v not in parents:
                out.append(v)
    return out


# --- search on the device -----------------------------------------------------------------------

@dataclasses.dataclass
class TuneReport:
    """One shape's search: what ran, how fast (kernel µs; masked: per masked_m pattern), the decision."""

    problem: Sm90Problem
    key: TuningKey
    entry: TunedEntry
    times_us: dict[str, dict[str, float]]  # config label -> pattern -> median µs (last trace it ran in)
    rejected: dict[str, str]  # config label -> why it was not timed (compile error, output mismatch)
    patterns: dict[str, list[int]]  # masked_m per pattern (contig: rows per group)
    path: Path | None = None
    confirm_us: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (heuristic, best) per round


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _kernel_source(problem: Sm90Problem, cfg: Sm90GemmConfig) -> tuple[str, str]:
    p = problem
    name = f"sm90_{cfg.kernel}_{cfg.gemm_kind}_n{p.n}_k{p.k}_g{p.num_groups}_{cfg.block_m}x{cfg.block_n}"
    return name, codegen.sm90_gemm_source(cfg, problem.n, problem.k)


def compile_all(jobs: Sequence[tuple[str, str]], workers: int | None = None) -> dict[str, Path | Exception]:
    """Compile (or find in the disk cache) every (name, source) in parallel; source -> cubin path or the error.
    Identical sources (the same instantiation for several shapes) compile once."""
    unique = {src: name for name, src in jobs}
    workers = workers or max(1, min(len(unique), os.cpu_count() or 1))
    out: dict[str, Path | Exception] = {}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futs = {pool.submit(compiler.compile_cubin, name, src, 90): src for src, name in unique.items()}
        for f in concurrent.futures.as_completed(futs):
            try:
                out[futs[f]] = f.result().path
            except Exception as e:  # one candidate's compile error must not stop the search
                out[futs[f]] = e
    return out


class _Case:
    """A problem's inputs on the device, its masked_m patterns and the heuristic's output."""

    def __init__(self, problem: Sm90Problem, seed: int, weights: dict) -> None:
        import jax
        import jax.numpy as jnp
        import numpy as np

        p = self.problem = problem
        g, m, n, k = p.num_groups, p.m, p.n, p.k
        key = jax.random.key(seed)
        k_a, k_sa, k_b, k_sb = jax.random.split(key, 4)
        fp8 = p.kernel == "fp8_1d2d"
        a_shape = (g, m, k) if p.gemm_kind == "masked" else (m, k)
        lhs = jax.random.normal(k_a, a_shape, jnp.bfloat16)
        wkey = (p.kernel, g, n, k)
        if wkey not in weights:  # shapes with the same weights share one copy
            rhs = jax.random.normal(k_b, (g, n, k), jnp.bfloat16)
            rhs_scale = (jax.random.uniform(k_sb, (g, ceil_div(n, 128), ceil_div(k, 128)), jnp.float32, 0.5, 1.0)
                         * 2.0 ** -6)
            weights[wkey] = (rhs.astype(jnp.float8_e4m3fn), rhs_scale) if fp8 else (rhs, None)
        rhs, rhs_scale = weights[wkey]
        if fp8:
            sa_shape = ((g,) if p.gemm_kind == "masked" else ()) + (ceil_div(k, 128), align(m, 4))
            lhs_scale = jax.random.uniform(k_sa, sa_shape, jnp.float32, 0.5, 1.0) * 2.0 ** -6
            self.inputs = [lhs.astype(jnp.float8_e4m3fn), rhs, lhs_scale, rhs_scale]
        else:
            self.inputs = [lhs, rhs]
        out_shape = (g, m, n) if p.gemm_kind == "masked" else (m, n)
        self.out = jax.ShapeDtypeStruct(out_shape, jnp.bfloat16)
        self.layouts: dict[str, Any] = {}
        self.valid: dict[str, Any] = {}
        self.patterns: dict[str, list[int]] = {}
        if p.gemm_kind == "contig":
            per = (m // g) // 128 * 128  # equal 128-aligned segments, the rest padding
            if per == 0:
                raise ValueError(f"{p.label}: fewer than 128 rows per group, no segment to time")
            ids = np.full(m, -1, np.int32)
            ids[:g * per] = np.repeat(np.arange(g, dtype=np.int32), per)
            self._add("segments", ids, (ids >= 0)[:, None], [int(per)] * g)
        else:
            rng = np.random.default_rng(seed)
            uniform = np.full(g, p.expected_m, np.int32)
            routed = np.minimum(rng.multinomial(p.expected_m * g, np.full(g, 1.0 / g)), m).astype(np.int32)
            for name, mm in (("uniform", uniform), ("routed", routed)):
                self._add(name, mm, (np.arange(m)[None, :] < mm[:, None])[..., None], mm.tolist())
        self.ref: dict[str, Any] = {}

    def _add(self, name, layout, valid, pattern) -> None:
        import jax.numpy as jnp

        self.layouts[name] = jnp.asarray(layout)
        self.valid[name] = jnp.asarray(valid)
        self.patterns[name] = pattern

    def lower(self, cfg: Sm90GemmConfig, cubin: Path):
        """The lowered XLA program launching ``cfg`` on this case's operands (compile() it to run)."""
        import jax

        from custom_calls.native.launch import launch

        p = self.problem
        builder = plans.sm90_fp8_plan if cfg.kernel == "fp8_1d2d" else plans.sm90_bf16_plan
        plan = builder(cfg, str(cubin), m=p.m, n=p.n, k=p.k, num_groups=p.num_groups)
        out = self.out
        fn = jax.jit(lambda *ops: launch(plan, list(ops), [out])[0])
        return fn.lower(*self.inputs, next(iter(self.layouts.values())))

    def launcher(self, cfg: Sm90GemmConfig, cubin: Path) -> Callable:
        return self.lower(cfg, cubin).compile()

    def call(self, fn: Callable, pattern: str):
        return fn(*self.inputs, self.layouts[pattern])


@functools.cache
def _agreement_fn():
    import jax
    import jax.numpy as jnp

    @jax.jit
    def agree(out, ref, valid):
        """(elements off by more than one bf16 ulp or not finite, elements bit-equal, valid elements)."""
        o, r = out.astype(jnp.float32), ref.astype(jnp.float32)
        ulp = jnp.maximum(jnp.abs(o), jnp.abs(r)) * 2.0 ** -7
        bad = valid & ((jnp.abs(o - r) > ulp) | ~jnp.isfinite(o))
        same = valid & (out == ref)
        return bad.sum(), same.sum(), jnp.broadcast_to(valid, o.shape).sum()

    return agree


class TraceMismatch(RuntimeError):
    """The profiler trace did not hold one kernel per launch."""


def trace_kernel_durations(calls: Sequence[Callable[[], Any]], needles: Sequence[str], *,
                           sync_every: int = 16, per_call: int = 1) -> list[float]:
    """Run ``calls`` in order under the jax profiler, each launching exactly ``per_call`` kernels whose
    name contains one of ``needles`` (others are ignored); their durations in seconds, in launch order."""
    import jax

    from custom_calls.profiling import gpu_kernel_events

    def run():
        pending = []
        for c in calls:
            pending.append(c())
            if len(pending) >= sync_every:
                jax.block_until_ready(pending)
                pending = []
        jax.block_until_ready(pending)

    try:
        found = gpu_kernel_events(run)
    except RuntimeError as e:  # no trace at all
        raise TraceMismatch(str(e)) from e
    events = {(start, dur) for name, start, dur in found if any(nd in name for nd in needles)}
    if len(events) != per_call * len(calls):
        raise TraceMismatch(f"the trace holds {len(events)} kernels named {'/'.join(needles)} for "
                            f"{len(calls)} calls of {per_call}")
    return [dur / 1e9 for _, dur in sorted(events)]


def _measure(blocks: Sequence[tuple[_Case, dict[str, Callable]]], iters: int) -> list[dict[str, dict[str, float]]]:
    """Kernel time per (case, candidate label, pattern): median over ``iters`` interleaved rounds.
    One trace for all blocks; if its kernels cannot be matched to the launches, one trace per block."""
    import jax

    def calls_of(case, fns):
        seq = [(lab, pat) for _ in range(iters) for lab in fns for pat in case.layouts]
        return seq, [functools.partial(case.call, fns[lab], pat) for lab, pat in seq]

    def medians(seq, durs):
        acc: dict[str, dict[str, list[float]]] = {}
        for (lab, pat), t in zip(seq, durs):
            acc.setdefault(lab, {}).setdefault(pat, []).append(t)
        return {lab: {pat: statistics.median(ts) * 1e6 for pat, ts in d.items()} for lab, d in acc.items()}

    parts = [calls_of(case, fns) for case, fns in blocks]
    needles = tuple(_KERNEL_NAMES.values())
    # ~50 ms of launches before the trace bring the clock up from idle
    case0, fns0 = blocks[0]
    first, pat0 = next(iter(fns0.values())), next(iter(case0.layouts))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.05:
        jax.block_until_ready([case0.call(first, pat0) for _ in range(4)])
    try:
        durs = trace_kernel_durations([c for _, calls in parts for c in calls], needles)
        out, i = [], 0
        for seq, calls in parts:
            out.append(medians(seq, durs[i:i + len(calls)]))
            i += len(calls)
        return out
    except TraceMismatch as e:
        _log(f"  tuning: {e}; timing each shape in its own trace")
        return [medians(seq, trace_kernel_durations(calls, needles)) for seq, calls in parts]


def _objective(times: dict[str, float]) -> float:
    return sum(times.values())


def tune(problems: Sequence[Sm90Problem], *, num_sms: int | None = None,
         policy: TuningPolicy = TuningPolicy(mode="search"), workers: int | None = None,
         log: Callable[[str], None] = _log) -> list[TuneReport]:
    """Search the best config of every problem on the first GPU and write the cache (see the module
    docstring). Problems with a cached entry are skipped unless ``policy.retune``; their report
    carries the cached entry and no times. Returns one report per problem, in order."""
    from custom_calls.native.toolchain import detected_device

    if policy.mode != "search":
        raise ValueError(f"tune: policy.mode must be 'search', got {policy.mode!r}")
    _, arch, det_sms = detected_device()
    if arch is None or arch // 10 != 9:
        raise ValueError(f"tune: needs an SM90 GPU visible to jax (detected arch {arch})")
    num_sms = num_sms or det_sms
    device_kind = policy.device_kind or detected_device_kind()
    keys = [tuning_key(p, num_sms, device_kind) for p in problems]
    reports: dict[int, TuneReport] = {}
    todo = []
    for i, (p, key) in enumerate(zip(problems, keys)):
        entry = None if policy.retune else load_entry(key)
        if entry is not None:
            reports[i] = TuneReport(p, key, entry, {}, {}, {}, key.path())
        else:
            todo.append(i)
    if not todo:
        return [reports[i] for i in range(len(problems))]

    weights: dict = {}
    cases = {i: _Case(problems[i], seed=i, weights=weights) for i in todo}
    heur = {i: problems[i].heuristic(num_sms) for i in todo}
    rejected: dict[int, dict[str, str]] = {i: {} for i in todo}
    fns: dict[int, dict[str, Callable]] = {i: {} for i in todo}
    cfg_of: dict[int, dict[str, Sm90GemmConfig]] = {i: {} for i in todo}

    def prepare(cands: dict[int, list[Sm90GemmConfig]]) -> None:
        """Compile every candidate, then check its output against the heuristic's."""
        jobs = {(i, c): _kernel_source(problems[i], c) for i, cs in cands.items() for c in cs}
        log(f"  tuning: compiling {len(set(s for _, s in jobs.values()))} kernels")
        cubins = compile_all(list(jobs.values()), workers)
        for (i, c), (_, src) in jobs.items():
            if isinstance(cubins[src], Exception):
                if c == heur[i]:
                    raise RuntimeError(f"tune: the heuristic's kernel for {problems[i].label} failed to "
                                       f"compile: {cubins[src]}")
                rejected[i][config_label(c)] = f"compile: {str(cubins[src])[-300:]}"
        ok = [(i, c, cubins[src]) for (i, c), (_, src) in jobs.items() if not isinstance(cubins[src], Exception)]
        lowered = [cases[i].lower(c, path) for i, c, path in ok]  # tracing stays on this thread
        with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            execs = list(pool.map(lambda low: low.compile(), lowered))
        agree = _agreement_fn()
        for (i, c, _), fn in zip(ok, execs):
            lab, case = config_label(c), cases[i]
            for pat in case.layouts:
                out = case.call(fn, pat)
                if c == heur[i]:
                    case.ref[pat] = out
                    continue
                bad, same, total = (int(x) for x in agree(out, case.ref[pat], case.valid[pat]))
                if bad:
                    rejected[i][lab] = (f"output differs from the heuristic's beyond bf16 rounding in {bad} of "
                                        f"{total} elements ({pat})")
                    break
            else:
                fns[i][lab], cfg_of[i][lab] = fn, c

    # phase 1: tiles
    p1 = {i: phase1_candidates(problems[i], num_sms, policy.max_tiles) for i in todo}
    prepare(p1)
    log(f"  tuning: phase 1, {sum(len(f) for f in fns.values())} configs of {len(todo)} shapes")
    times1 = dict(zip(todo, _measure([(cases[i], fns[i]) for i in todo], policy.iters)))
    times: dict[int, dict[str, dict[str, float]]] = {i: dict(times1[i]) for i in todo}

    # phase 2: stages and D swizzle of the fastest tiles, timed beside the phase-1 best and the heuristic
    def best(i, labs):
        return min(labs, key=lambda lab: _objective(times[i][lab]))

    ranked = {i: sorted(times1[i], key=lambda lab: _objective(times1[i][lab])) for i in todo}
    parents = {i: [cfg_of[i][lab] for lab in ranked[i][:policy.refine_tiles]] for i in todo}
    p2 = {i: [c for c in refine_candidates(problems[i], num_sms, parents[i]) if config_label(c) not in fns[i]]
          for i in todo}
    if policy.refine_tiles and any(p2.values()):
        prepare({i: [heur[i]] + p2[i] for i in todo})  # heuristic first: it is the reference output
        blocks = {}
        for i in todo:
            labs = {config_label(heur[i]), ranked[i][0]} | {config_label(c) for c in p2[i]}
            blocks[i] = {lab: fns[i][lab] for lab in labs if lab in fns[i]}
        log(f"  tuning: phase 2, {sum(len(b) for b in blocks.values())} configs")
        for i, t in zip(todo, _measure([(cases[i], blocks[i]) for i in todo], policy.iters)):
            times[i].update(t)
            ranked[i] = [best(i, list(t))]
    winners = {i: ranked[i][0] for i in todo}

    # confirmation: winner against heuristic, confirm_rounds traces
    rounds: dict[int, list[tuple[float, float]]] = {i: [] for i in todo}
    contest = [i for i in todo if winners[i] != config_label(heur[i])]
    for _ in range(policy.confirm_rounds if contest else 0):
        hl = {i: config_label(heur[i]) for i in contest}
        res = _measure([(cases[i], {hl[i]: fns[i][hl[i]], winners[i]: fns[i][winners[i]]}) for i in contest],
                       policy.iters)
        for i, t in zip(contest, res):
            rounds[i].append((_objective(t[hl[i]]), _objective(t[winners[i]])))
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for i in todo:
        h = heur[i]
        won = bool(rounds[i]) and all(w < hh * (1 - policy.min_gain) for hh, w in rounds[i])
        cfg = cfg_of[i][winners[i]] if won else h
        hl = config_label(h)
        h_us = tuple(hh for hh, _ in rounds[i]) or (_objective(times[i][hl]),)
        c_us = tuple(w for _, w in rounds[i]) if won else h_us
        entry = TunedEntry(config=cfg, heuristic=h, tuned=won, heuristic_us=h_us, config_us=c_us,
                           num_candidates=len(fns[i]), created=created)
        path = store_entry(keys[i], entry)
        reports[i] = TuneReport(problems[i], keys[i], entry, times[i], rejected[i], cases[i].patterns, path,
                                rounds[i])
        log(f"  tuning: {problems[i].label}: {'tuned ' + config_label(cfg) if won else 'heuristic kept'} "
            f"({hl}: {h_us[0]:.1f} us, best {winners[i]}: {_objective(times[i][winners[i]]):.1f} us)")
    cases.clear()  # frees the candidates' inputs and weights on the device
    weights.clear()
    return [reports[i] for i in range(len(problems))]


def compare_cached(problems: Sequence[Sm90Problem], *, num_sms: int | None = None, iters: int = 10,
                   device_kind: str | None = None) -> list[dict]:
    """For the problems whose cache entry holds a tuned config, time it beside the heuristic now
    (kernel µs per masked_m pattern, one trace); one dict per such problem, [] when none is cached."""
    from custom_calls.native.toolchain import detected_device

    num_sms = num_sms or detected_device()[2]
    device_kind = device_kind or detected_device_kind()
    found = []
    for p in problems:
        entry = load_entry(tuning_key(p, num_sms, device_kind))
        if entry is not None and entry.tuned:
            found.append((p, entry))
    if not found:
        return []
    pairs = [(p, p.heuristic(num_sms), e.config) for p, e in found]  # today's heuristic
    jobs = [_kernel_source(p, c) for p, h, t in pairs for c in (h, t)]
    cubins = compile_all(jobs)
    for _, src in jobs:
        if isinstance(cubins[src], Exception):
            raise cubins[src]
    weights: dict = {}
    blocks = []
    for seed, (p, h, t) in enumerate(pairs):
        case = _Case(p, seed=seed, weights=weights)
        blocks.append((case, {name: case.launcher(c, cubins[_kernel_source(p, c)[1]])
                              for name, c in (("heuristic", h), ("tuned", t))}))
    rows = []
    for (p, h, c), (case, _), t in zip(pairs, blocks, _measure(blocks, iters)):
        rows.append({"problem": p.label, "heuristic": config_label(h), "tuned": config_label(c),
                     "heuristic_us": t["heuristic"], "tuned_us": t["tuned"],
                     "gain": _objective(t["heuristic"]) / _objective(t["tuned"]) - 1.0, "patterns": case.patterns})
    return rows
