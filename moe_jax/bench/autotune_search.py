"""The autotuner's search: SM90 grouped-GEMM configs timed on the device, the winners written to the
tuned-config cache the library reads (``custom_calls/deep_gemm/autotune.py``, mode "cached").
Used by ``python -m moe_jax.bench.tune``; ``warmup_tuned`` tunes a warm-up's shapes first.

The candidates are legal configs (``sm90_gemm.sm90_candidates``) of the problem's family. Phase 1
times up to ``max_tiles`` tiles, each with the most stages that fit and the largest D swizzle: the
heuristic's, the other multicast choices and block heights around it, its BLOCK_N neighbours, then
the best by the heuristic's traffic model (``phase1_candidates``); phase 2 times fewer stages and
the other D swizzles of the ``refine_tiles`` fastest tiles beside the heuristic and the phase-1
winner. Every candidate's output is compared with the heuristic's on the same inputs first: any
tiling computes the same products in the same k order, so they must agree within the bf16 rounding
of the output (one unit in the last place), else the candidate is dropped. Times are GPU kernel
durations from one profiler trace per phase, the candidates of a shape interleaved round by round (a
clock change under the power cap then hits all of them alike); masked shapes are timed on two
``masked_m`` patterns (every group at expected_m, and a multinomial draw of the same total, as
routing produces) and ranked by the sum. The heuristic stays unless the winner is faster by more
than ``min_gain`` in each of ``confirm_rounds`` further traces of the two.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import functools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from custom_calls.deep_gemm import autotune
from custom_calls.native import compiler
from custom_calls.deep_gemm.autotune import TunedEntry, TuningKey, TuningPolicy
from custom_calls.deep_gemm.families import gemm_problem
from custom_calls.deep_gemm.family import GemmProblem
from custom_calls.deep_gemm.sm90_gemm import (SM90_CLUSTERS, Sm90GemmConfig, sm90_build_config, sm90_config_reason,
                                              sm90_gemm_config, sm90_model_cost, sm90_swizzle_cd_choices,
                                              sm90_tile_configs)
from custom_calls.deep_gemm.warmup import GemmShape, warmup
from custom_calls.native import toolchain
from custom_calls.settings import KernelSettings, resolve_settings

ARCH = 90  # the tuner covers the families with SM90 tiling
_MIN_TUNED_STAGES = 3  # phase 2 tries fewer stages, but not below the heuristic's own floor


@dataclasses.dataclass(frozen=True)
class SearchPolicy:
    """How the search runs (see the module docstring)."""

    min_gain: float = 0.01  # a tuned config must beat the heuristic by more than this, every round
    max_tiles: int = 16  # phase-1 tiles per shape (the heuristic's included)
    refine_tiles: int = 2  # phase 2 varies stages and D swizzle of this many fastest tiles
    iters: int = 8  # timed launches per candidate (and masked_m pattern) per trace
    confirm_rounds: int = 2
    retune: bool = False  # search even when the cache holds an entry
    device_kind: str | None = None  # None: the first GPU's (jax Device.device_kind)

    def __post_init__(self) -> None:
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"SearchPolicy.min_gain must be in [0, 1), got {self.min_gain}")
        for name in ("max_tiles", "iters", "confirm_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"SearchPolicy.{name} must be >= 1, got {getattr(self, name)}")
        if self.refine_tiles < 0:
            raise ValueError(f"SearchPolicy.refine_tiles must be >= 0, got {self.refine_tiles}")


def problem_label(problem: GemmProblem) -> str:
    p = problem
    if p.gemm_kind == "contig":
        return f"{p.family.name} contig M={p.m} G={p.num_groups} N={p.n} K={p.k}"
    return (f"{p.family.name} masked G={p.num_groups} m_pad={p.m} expected_m={p.expected_m} "
            f"N={p.n} K={p.k}")


def config_label(cfg: Sm90GemmConfig) -> str:
    """Short text of a config: tile, multicast (A or B), stages, D swizzle."""
    mc = "mcA" if cfg.cluster_n > 1 else "mcB" if cfg.cluster_m > 1 else "mc-"
    return f"{cfg.block_m}x{cfg.block_n} {mc} s{cfg.num_stages} sw{cfg.swizzle_cd}"


def tuning_problems(shapes: Iterable[GemmShape]) -> list[GemmProblem]:
    """The distinct problems of the grouped shapes the tuner covers (families with SM90 tiling)."""
    found = []
    for s in shapes:
        if s.kind in ("contig", "masked"):
            p = gemm_problem(s.kind, s.rows, s.n, s.k, s.num_groups, s.recipe, ARCH, s.expected_m)
            if p.family.sm90 is not None and p not in found:
                found.append(p)
    return found


def bench_problems(plan: Sequence[tuple[str, tuple]], bf16_contig: Sequence[tuple] = ()) -> list[GemmProblem]:
    """The problems of ``python -m moe_jax.bench gemm``'s DeepGEMM shapes: ("contig", (G, rows per
    group, N, K)) and ("masked", (G, m_pad, expected_m, N, K)) in FP8 (recipe fp8_block), and the
    contig shapes listed in ``bf16_contig`` in BF16 too."""
    out = []
    for what, shp in plan:
        if what == "contig":
            g, rows, n, k = shp
            out += [gemm_problem("contig", g * rows, n, k, g, recipe, ARCH)
                    for recipe in ("fp8_block",) + (("bf16",) if shp in bf16_contig else ())]
        else:
            g, m_pad, em, n, k = shp
            out.append(gemm_problem("masked", m_pad, n, k, g, "fp8_block", ARCH, em))
    return out


# --- candidate selection (pure) -----------------------------------------------------------------

def phase1_candidates(problem: GemmProblem, num_sms: int, max_tiles: int) -> list[Sm90GemmConfig]:
    """Tiles to time first (at most ``max_tiles``), each with the most stages that fit and the
    largest D swizzle, in this order: the heuristic's tile; at its BLOCK_M, the best tile of every
    cluster choice (no multicast, multicast of A, of B); the best tile at half and at twice its
    BLOCK_M; its BLOCK_M and cluster with the four (masked: six) BLOCK_N nearest its own; then the
    rest by the heuristic's traffic model."""
    p = problem
    heur = sm90_gemm_config(p, num_sms)
    tiles = sm90_tile_configs(p, num_sms)

    def cost(c: Sm90GemmConfig) -> tuple[int, int, int, int]:
        # the model prices clusters it deems useless at "infinity"; rank those by their unclustered cost
        flat = dataclasses.replace(c, cluster_m=1, cluster_n=1)
        return sm90_model_cost(c, p), sm90_model_cost(flat, p), c.block_m, c.block_n

    ranked = sorted(tiles, key=cost)
    same_bm = [c for c in ranked if c.block_m == heur.block_m]
    picks = [heur]
    picks += [next((c for c in same_bm if (c.cluster_m, c.cluster_n) == cl), None) for cl in SM90_CLUSTERS]
    picks += [next((c for c in ranked if c.block_m == bm), None) for bm in (heur.block_m // 2, heur.block_m * 2)]
    same_tile = [c for c in same_bm if (c.cluster_m, c.cluster_n) == (heur.cluster_m, heur.cluster_n)]
    near = 6 if p.gemm_kind == "masked" else 4  # memory-bound masked GEMMs: BLOCK_N sets the load balance
    picks += sorted(same_tile, key=lambda c: (abs(c.block_n - heur.block_n), c.block_n))[1:1 + near]
    picks += ranked
    chosen: list[Sm90GemmConfig] = []
    for c in picks:
        if c is not None and c not in chosen:
            chosen.append(c)
    return chosen[:max_tiles]


def refine_candidates(problem: GemmProblem, num_sms: int, parents: Sequence[Sm90GemmConfig]
                      ) -> list[Sm90GemmConfig]:
    """Pipeline variants of ``parents``: one and two stages fewer (not below 3) at their swizzle, and
    every other legal D swizzle at their stage count. All legal; parents excluded."""
    out = []
    p = problem
    for par in parents:
        variants = [dataclasses.replace(par, num_stages=s) for s in (par.num_stages - 1, par.num_stages - 2)
                    if s >= _MIN_TUNED_STAGES]
        variants += [dataclasses.replace(par, swizzle_cd=z)
                     for z in sm90_swizzle_cd_choices(par.family, par.cd_dtype, par.block_n) if z != par.swizzle_cd]
        for v in variants:
            v = sm90_build_config(v.family, v.gemm_kind, v.cd_dtype, v.num_groups, num_sms, p.k, v.block_m,
                                  v.block_n, v.cluster_m, v.cluster_n, v.num_stages, v.swizzle_cd)
            if sm90_config_reason(v, p.m, p.n, p.k) is None and v not in out and v not in parents:
                out.append(v)
    return out


# --- on the device ------------------------------------------------------------------------------

@dataclasses.dataclass
class TuneReport:
    """One shape's search: what ran, how fast (kernel µs; masked: per masked_m pattern), the decision."""

    problem: GemmProblem
    key: TuningKey
    entry: TunedEntry
    times_us: dict[str, dict[str, float]]  # config label -> pattern -> median µs (last trace it ran in)
    rejected: dict[str, str]  # config label -> why it was not timed (compile error, output mismatch)
    patterns: dict[str, list[int]]  # masked_m per pattern (contig: rows per group)
    path: Path | None = None
    confirm_us: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (heuristic, best) per round


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def kernel_source(problem: GemmProblem, cfg: Sm90GemmConfig) -> tuple[str, str]:
    """(name, source) of ``cfg`` for ``problem``, as the op would compile it."""
    fam = problem.family
    return fam.kernel_name(cfg, problem), fam.source(cfg, problem.n, problem.k)


def compile_all(jobs: Sequence[tuple[str, str]], arch: int, workers: int | None = None) -> dict[str, Path | Exception]:
    """Compile (or find in the disk cache) every (name, source) for ``arch`` in parallel; source ->
    cubin path or the error. Identical sources (the same instantiation for several shapes) compile once."""
    unique = {src: name for name, src in jobs}
    workers = workers or max(1, min(len(unique), os.cpu_count() or 1))
    out: dict[str, Path | Exception] = {}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futs = {pool.submit(compiler.compile_cubin, name, src, arch): src for src, name in unique.items()}
        for f in concurrent.futures.as_completed(futs):
            try:
                out[futs[f]] = f.result().path
            except Exception as e:  # one candidate's compile error must not stop the search
                out[futs[f]] = e
    return out


class _Case:
    """A problem's inputs on the device, its masked_m patterns and the heuristic's output."""

    def __init__(self, problem: GemmProblem, seed: int, weights: dict) -> None:
        import jax
        import jax.numpy as jnp

        p = self.problem = problem
        fmt = p.fmt
        g, m, n, k = p.num_groups, p.m, p.n, p.k
        k_a, k_sa, k_b, k_sb = jax.random.split(jax.random.key(seed), 4)
        masked = p.gemm_kind == "masked"
        lhs = jax.random.normal(k_a, (g, m, k) if masked else (m, k), jnp.bfloat16)
        wkey = (p.family.name, g, n, k)
        if wkey not in weights:  # shapes with the same weights share one copy
            rhs = jax.random.normal(k_b, (g, n, k), jnp.bfloat16)
            if fmt.is_quantized:
                rhs_scale = jax.random.uniform(k_sb, fmt.rhs_scale_shape(g, n, k), jnp.float32, 0.5, 1.0) * 2.0 ** -6
                weights[wkey] = (rhs.astype(fmt.rhs_dtypes[0]), rhs_scale)
            else:
                weights[wkey] = (rhs, None)
        rhs, rhs_scale = weights[wkey]
        if fmt.is_quantized:
            sa_shape = ((g,) if masked else ()) + fmt.lhs_scale_shape(m, k)
            lhs_scale = jax.random.uniform(k_sa, sa_shape, jnp.float32, 0.5, 1.0) * 2.0 ** -6
            self.inputs = [lhs.astype(fmt.lhs_dtypes[0]), rhs, lhs_scale, rhs_scale]
        else:
            self.inputs = [lhs, rhs]
        self.out = jax.ShapeDtypeStruct((g, m, n) if masked else (m, n), jnp.bfloat16)
        self.layouts: dict[str, Any] = {}
        self.valid: dict[str, Any] = {}
        self.patterns: dict[str, list[int]] = {}
        self._add_patterns(seed)
        self.ref: dict[str, Any] = {}

    def _add_patterns(self, seed: int) -> None:
        import numpy as np

        p = self.problem
        g, m = p.num_groups, p.m
        if p.gemm_kind == "contig":
            per = (m // g) // 128 * 128  # equal 128-aligned segments, the rest padding
            if per == 0:
                raise ValueError(f"{problem_label(p)}: fewer than 128 rows per group, no segment to time")
            ids = np.full(m, -1, np.int32)
            ids[:g * per] = np.repeat(np.arange(g, dtype=np.int32), per)
            self._add("segments", ids, (ids >= 0)[:, None], [int(per)] * g)
            return
        rng = np.random.default_rng(seed)
        uniform = np.full(g, p.expected_m, np.int32)
        routed = np.minimum(rng.multinomial(p.expected_m * g, np.full(g, 1.0 / g)), m).astype(np.int32)
        for name, mm in (("uniform", uniform), ("routed", routed)):
            self._add(name, mm, (np.arange(m)[None, :] < mm[:, None])[..., None], mm.tolist())

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
        plan = p.family.plan(cfg, str(cubin), m=p.m, n=p.n, k=p.k)
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
    needles = tuple(sorted({case.problem.family.symbol for case, _ in blocks}))
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


class _Search:
    """One search over the problems ``todo`` (indices into ``problems``): the phases of the module
    docstring, the compiled candidates per problem and their times."""

    def __init__(self, problems: Sequence[GemmProblem], todo: list[int], num_sms: int, policy: SearchPolicy,
                 workers: int | None, log: Callable[[str], None]) -> None:
        self.problems, self.todo, self.num_sms, self.policy, self.workers, self.log = (
            problems, todo, num_sms, policy, workers, log)
        self.weights: dict = {}
        self.cases = {i: _Case(problems[i], seed=i, weights=self.weights) for i in todo}
        self.heur = {i: sm90_gemm_config(problems[i], num_sms) for i in todo}
        self.rejected: dict[int, dict[str, str]] = {i: {} for i in todo}
        self.fns: dict[int, dict[str, Callable]] = {i: {} for i in todo}
        self.cfg_of: dict[int, dict[str, Sm90GemmConfig]] = {i: {} for i in todo}
        self.times: dict[int, dict[str, dict[str, float]]] = {i: {} for i in todo}

    def prepare(self, cands: dict[int, list[Sm90GemmConfig]]) -> None:
        """Compile every candidate, then check its output against the heuristic's (listed first
        where it is compiled again: it is the reference)."""
        jobs = {(i, c): kernel_source(self.problems[i], c) for i, cs in cands.items() for c in cs}
        self.log(f"  tuning: compiling {len(set(s for _, s in jobs.values()))} kernels")
        cubins = compile_all(list(jobs.values()), ARCH, self.workers)
        for (i, c), (_, src) in jobs.items():
            if isinstance(cubins[src], Exception):
                if c == self.heur[i]:
                    raise RuntimeError(f"tune: the heuristic's kernel for {problem_label(self.problems[i])} failed "
                                       f"to compile: {cubins[src]}")
                self.rejected[i][config_label(c)] = f"compile: {str(cubins[src])[-300:]}"
        ok = [(i, c, cubins[src]) for (i, c), (_, src) in jobs.items() if not isinstance(cubins[src], Exception)]
        lowered = [self.cases[i].lower(c, path) for i, c, path in ok]  # tracing stays on this thread
        with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            execs = list(pool.map(lambda low: low.compile(), lowered))
        for (i, c, _), fn in zip(ok, execs):
            self._verify(i, c, fn)

    def _verify(self, i: int, c: Sm90GemmConfig, fn: Callable) -> None:
        lab, case = config_label(c), self.cases[i]
        agree = _agreement_fn()
        for pat in case.layouts:
            out = case.call(fn, pat)
            if c == self.heur[i]:
                case.ref[pat] = out
                continue
            bad, same, total = (int(x) for x in agree(out, case.ref[pat], case.valid[pat]))
            if bad:
                self.rejected[i][lab] = (f"output differs from the heuristic's beyond bf16 rounding in {bad} of "
                                         f"{total} elements ({pat})")
                return
        self.fns[i][lab], self.cfg_of[i][lab] = fn, c

    def phase1(self) -> dict[int, list[str]]:
        """Times the phase-1 tiles; their labels per problem, fastest first."""
        self.prepare({i: phase1_candidates(self.problems[i], self.num_sms, self.policy.max_tiles) for i in self.todo})
        self.log(f"  tuning: phase 1, {sum(len(f) for f in self.fns.values())} configs of {len(self.todo)} shapes")
        times1 = dict(zip(self.todo, _measure([(self.cases[i], self.fns[i]) for i in self.todo], self.policy.iters)))
        for i in self.todo:
            self.times[i].update(times1[i])
        return {i: sorted(times1[i], key=lambda lab, i=i: _objective(times1[i][lab])) for i in self.todo}

    def phase2(self, ranked: dict[int, list[str]]) -> dict[int, str]:
        """Times stages and D swizzle of the fastest tiles beside the phase-1 best and the
        heuristic; the winner's label per problem."""
        todo, heur = self.todo, self.heur
        parents = {i: [self.cfg_of[i][lab] for lab in ranked[i][:self.policy.refine_tiles]] for i in todo}
        p2 = {i: [c for c in refine_candidates(self.problems[i], self.num_sms, parents[i])
                  if config_label(c) not in self.fns[i]] for i in todo}
        if not (self.policy.refine_tiles and any(p2.values())):
            return {i: ranked[i][0] for i in todo}
        self.prepare({i: [heur[i]] + p2[i] for i in todo})
        blocks = {}
        for i in todo:
            labs = {config_label(heur[i]), ranked[i][0]} | {config_label(c) for c in p2[i]}
            blocks[i] = {lab: self.fns[i][lab] for lab in labs if lab in self.fns[i]}
        self.log(f"  tuning: phase 2, {sum(len(b) for b in blocks.values())} configs")
        winners = {}
        for i, t in zip(todo, _measure([(self.cases[i], blocks[i]) for i in todo], self.policy.iters)):
            self.times[i].update(t)
            winners[i] = min(t, key=lambda lab, i=i: _objective(self.times[i][lab]))
        return winners

    def confirm(self, winners: dict[int, str]) -> dict[int, list[tuple[float, float]]]:
        """(heuristic, winner) objective per confirmation trace, for the problems the heuristic lost."""
        rounds: dict[int, list[tuple[float, float]]] = {i: [] for i in self.todo}
        contest = [i for i in self.todo if winners[i] != config_label(self.heur[i])]
        for _ in range(self.policy.confirm_rounds if contest else 0):
            hl = {i: config_label(self.heur[i]) for i in contest}
            pairs = [(self.cases[i], {hl[i]: self.fns[i][hl[i]], winners[i]: self.fns[i][winners[i]]})
                     for i in contest]
            for i, t in zip(contest, _measure(pairs, self.policy.iters)):
                rounds[i].append((_objective(t[hl[i]]), _objective(t[winners[i]])))
        return rounds

    def decide(self, i: int, key: TuningKey, winner: str, rounds: list[tuple[float, float]], created: str
               ) -> TuneReport:
        """Store problem ``i``'s decision: the winner if it beat the heuristic by more than
        min_gain in every round, else the heuristic."""
        h = self.heur[i]
        won = bool(rounds) and all(w < hh * (1 - self.policy.min_gain) for hh, w in rounds)
        cfg = self.cfg_of[i][winner] if won else h
        hl = config_label(h)
        h_us = tuple(hh for hh, _ in rounds) or (_objective(self.times[i][hl]),)
        c_us = tuple(w for _, w in rounds) if won else h_us
        entry = TunedEntry(config=cfg, heuristic=h, tuned=won, heuristic_us=h_us, config_us=c_us,
                           num_candidates=len(self.fns[i]), created=created)
        path = autotune.store_entry(key, entry)
        self.log(f"  tuning: {problem_label(self.problems[i])}: "
                 f"{'tuned ' + config_label(cfg) if won else 'heuristic kept'} ({hl}: {h_us[0]:.1f} us, best "
                 f"{winner}: {_objective(self.times[i][winner]):.1f} us)")
        return TuneReport(self.problems[i], key, entry, self.times[i], self.rejected[i], self.cases[i].patterns, path,
                          rounds)


def tune(problems: Sequence[GemmProblem], *, num_sms: int | None = None, policy: SearchPolicy = SearchPolicy(),
         workers: int | None = None, log: Callable[[str], None] = _log) -> list[TuneReport]:
    """Search the best config of every problem on the first GPU and write the cache (see the module
    docstring). Problems with a cached entry are skipped unless ``policy.retune``; their report
    carries the cached entry and no times. Returns one report per problem, in order."""
    _, arch, det_sms = toolchain.detected_device()
    if arch is None or arch // 10 != ARCH // 10:
        raise ValueError(f"tune: needs an SM90 GPU visible to jax (detected arch {arch})")
    num_sms = num_sms or det_sms
    device_kind = policy.device_kind or autotune.detected_device_kind()
    keys = [autotune.tuning_key(p, num_sms, device_kind) for p in problems]
    reports: dict[int, TuneReport] = {}
    todo = []
    for i, (p, key) in enumerate(zip(problems, keys)):
        entry = None if policy.retune else autotune.load_entry(key)
        if entry is not None:
            reports[i] = TuneReport(p, key, entry, {}, {}, {}, key.path())
        else:
            todo.append(i)
    if todo:
        search = _Search(problems, todo, num_sms, policy, workers, log)
        winners = search.phase2(search.phase1())
        rounds = search.confirm(winners)
        created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        for i in todo:
            reports[i] = search.decide(i, keys[i], winners[i], rounds[i], created)
    return [reports[i] for i in range(len(problems))]


def compare_cached(problems: Sequence[GemmProblem], *, num_sms: int | None = None, iters: int = 10,
                   device_kind: str | None = None) -> list[dict]:
    """For the problems whose cache entry holds a tuned config, time it beside the heuristic now
    (kernel µs per masked_m pattern, one trace); one dict per such problem, [] when none is cached."""
    num_sms = num_sms or toolchain.detected_device()[2]
    device_kind = device_kind or autotune.detected_device_kind()
    found = []
    for p in problems:
        entry = autotune.load_entry(autotune.tuning_key(p, num_sms, device_kind))
        if entry is not None and entry.tuned:
            found.append((p, entry))
    if not found:
        return []
    pairs = [(p, sm90_gemm_config(p, num_sms), e.config) for p, e in found]  # today's heuristic
    jobs = [kernel_source(p, c) for p, h, t in pairs for c in (h, t)]
    cubins = compile_all(jobs, ARCH)
    for _, src in jobs:
        if isinstance(cubins[src], Exception):
            raise cubins[src]
    weights: dict = {}
    blocks = []
    for seed, (p, h, t) in enumerate(pairs):
        case = _Case(p, seed=seed, weights=weights)
        blocks.append((case, {name: case.launcher(c, cubins[kernel_source(p, c)[1]])
                              for name, c in (("heuristic", h), ("tuned", t))}))
    rows = []
    for (p, h, c), (case, _), t in zip(pairs, blocks, _measure(blocks, iters)):
        rows.append({"problem": problem_label(p), "heuristic": config_label(h), "tuned": config_label(c),
                     "heuristic_us": t["heuristic"], "tuned_us": t["tuned"],
                     "gain": _objective(t["heuristic"]) / _objective(t["tuned"]) - 1.0, "patterns": case.patterns})
    return rows


def warmup_tuned(shapes: Iterable[GemmShape], *, num_sms: int | None = None, policy: SearchPolicy = SearchPolicy(),
                 settings: KernelSettings | None = None, **warmup_args: Any) -> list[compiler.Cubin]:
    """Tune the grouped SM90 shapes the cache lacks (minutes), then compile every shape's kernel for
    SM90 with the tuned configs (`custom_calls.deep_gemm.warmup`, mode "cached"), so the first traced
    call finds them compiled. warmup_args: the rest of `warmup`'s keywords (workers, progress)."""
    shapes = list(shapes)
    num_sms = num_sms or resolve_settings(settings).num_sms or toolchain.detected_device()[2]
    problems = tuning_problems(shapes)
    if problems:
        tune(problems, num_sms=num_sms, policy=policy)
    cached = TuningPolicy(mode="cached", device_kind=policy.device_kind)
    return warmup(shapes, arch=ARCH, num_sms=num_sms, tuning=cached, settings=settings, **warmup_args)
