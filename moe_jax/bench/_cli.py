"""Helpers shared by the benchmark subcommands: progress on stderr, strict JSON output, PNG plots.

stdout carries the result table only; progress and per-row logs go to stderr. matplotlib (Agg
backend) is imported only when a plot is written.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any


def log(*parts: object) -> None:
    """A progress/log line on stderr (stdout is the table)."""
    print(*parts, file=sys.stderr, flush=True)


def cannot_run(prog: str, reason: str | None) -> bool:
    """True, after saying so on stderr ("python -m moe_jax.bench.tune: needs ..."), when ``reason``
    says the benchmark ``prog`` cannot run on this machine; the caller then exits with status 2."""
    if reason:
        log(f"python -m {prog}: {reason}")
    return bool(reason)


class Progress:
    """Steps of a warm-up (mostly JIT compiles) on stderr.

    A tqdm bar when tqdm is installed and stderr is a terminal; otherwise one plain line per step
    (readable in a log file). ``step(what)`` announces the step about to run and completes the
    previous one; ``close()`` completes the last.
    """

    def __init__(self, desc: str, total: int | None = None) -> None:
        self.desc, self.total, self.done = desc, total, 0
        self._t0 = time.perf_counter()
        self._open = False
        self._bar = None
        if sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=True)

    def _finish_step(self) -> None:
        if self._open:
            self.done += 1
            if self._bar is not None:
                self._bar.update(1)
            self._open = False

    def step(self, what: str) -> None:
        self._finish_step()
        self._open = True
        if self._bar is not None:
            self._bar.set_postfix_str(what, refresh=True)
        else:
            of = f"/{self.total}" if self.total else ""
            log(f"  [{self.desc} {self.done + 1}{of} {time.perf_counter() - self._t0:6.1f} s] {what}")

    def note(self, text: str) -> None:
        """A message that is not a step (a result line), without breaking a tqdm bar."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            log(f"  [{self.desc} {time.perf_counter() - self._t0:6.1f} s] {text}")

    def print_out(self, text: str) -> None:
        """A result line on stdout, without breaking a tqdm bar on the same terminal."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def drop(self, steps: int, why: str) -> None:
        """`steps` of the announced total will not run; the new total is announced with `why`
        (e.g. a backend that runs the same code as one already measured)."""
        if self.total:
            self.total = max(self.done, self.total - steps)
            self.note(f"{steps} steps fewer ({why}): {self.total} in all")
            if self._bar is not None:
                self._bar.total = self.total
                self._bar.refresh()

    def close(self) -> None:
        self._finish_step()
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def exit_status(failed: Sequence[str]) -> int:
    """The exit status of a benchmark run: 0 when no requested row failed, else 1, after naming the
    failed rows on stderr (a table with a FAILED row is not a successful run)."""
    if failed:
        log(f"{len(failed)} requested row(s) failed: " + "; ".join(failed))
        return 1
    return 0


def failure(exc: BaseException, limit: int = 500) -> str:
    """A failed row's "error" text: the exception's type and the first `limit` characters of its
    message (a compiler's message can run to pages)."""
    return f"{type(exc).__name__}: {str(exc)[:limit]}"


def resolved_backends(fn, *args) -> dict[str, str]:
    """{op: backend} for every op fn(*args) calls: the implementation the backend registry resolved
    it to ("auto" becomes "reference" where no accelerated implementation can run). fn is traced
    abstractly (nothing runs); jax's caches are cleared first, because a trace jax already holds
    would skip the ops' resolution. An op resolved to different backends in one trace reads "a,b".
    ValueError where an explicit backend cannot run an op."""
    import jax

    from custom_calls.backends import record_resolutions

    jax.clear_caches()
    with record_resolutions() as log:
        jax.eval_shape(fn, *args)
    if not log:
        raise RuntimeError("tracing the function resolved no op through the backend registry")
    seen: dict[str, set[str]] = {}
    for op, backend in log:
        seen.setdefault(op, set()).add(backend)
    return {op: ",".join(sorted(b)) for op, b in seen.items()}


def fallback_note(implementations: dict[str, str], platform: str) -> str:
    """What a row's backend fell back to, from its {op: resolved backend} map: every op ("auto"
    where nothing accelerated runs, e.g. on a CPU), some ops, or "" when none did."""
    on_ref = [op for op, b in implementations.items() if b == "reference"]
    if on_ref and len(on_ref) == len(implementations):
        return f"every op fell back to the reference: no accelerated implementation on {platform!r}"
    return f"reference implementation for: {', '.join(on_ref)}" if on_ref else ""


def run_untuned(fn, *args):
    """fn(*args), jitted and compiled without XLA's GEMM autotuning on GPU. For float32 references
    only (their speed is not measured): autotuning their large HIGHEST-precision dots costs minutes
    of compile time. Timed functions keep XLA's defaults."""
    import jax

    lowered = jax.jit(fn).lower(*args)
    opts = {"xla_gpu_autotune_level": 0} if jax.default_backend() == "gpu" else None
    return lowered.compile(compiler_options=opts)(*args)


def rel_errors(out, ref) -> tuple[float, float]:
    """(‖out − ref‖ / ‖ref‖ over all elements, the worst row's same ratio); out: (..., N) any float
    dtype, ref: (..., N) f32."""
    import jax.numpy as jnp

    d = out.astype(jnp.float32) - ref
    rows = jnp.linalg.norm(d, axis=-1) / jnp.maximum(jnp.linalg.norm(ref, axis=-1), 1e-30)
    return float(jnp.linalg.norm(d) / jnp.linalg.norm(ref)), float(rows.max())


def jsonable(obj: Any) -> Any:
    """obj with non-finite floats as None, tuples as lists and numpy/jax scalars as Python numbers, so
    the output is strict JSON (json.dump would write NaN, which JSON does not have)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if getattr(obj, "shape", None) == () and hasattr(obj, "item"):  # numpy / jax scalar
        return jsonable(obj.item())
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    return str(obj)


def write_json(path: str, obj: Any) -> None:
    """Strict JSON (no NaN/Infinity) of obj at path."""
    with open(path, "w") as f:
        json.dump(jsonable(obj), f, indent=1, allow_nan=False)
        f.write("\n")


def check_plot_available(path: str | None) -> None:
    """Fail before a long run, not after it, when --plot is given without matplotlib."""
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"--plot {path}: needs matplotlib (pip install matplotlib): {e}") from None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _num(v) -> float:
    return float("nan") if v is None else float(v)


def plot_panels(path: str, panels: Sequence[dict], *, title: str = "") -> None:
    """Write a PNG with one bar-chart panel per entry of ``panels``, side by side.

    Each panel: ``title``, ``ylabel``, ``groups`` (x labels, G), and either
    * ``stacks``: {segment name: G values}, drawn as one stacked bar per group, plus optional
      ``totals`` (G values, a black tick per bar: e.g. the measured end to end time), or
    * ``series``: {bar name: G values (None = not measured)}, drawn as grouped bars, plus optional
      ``markers`` {bar name: G values} drawn as dots on the bars (e.g. sustained vs burst).
    """
    plt = _pyplot()
    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=(max(6.0, 5.5 * n), 6.0), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, p in zip(axes[0], panels):
        groups = list(p["groups"])
        xs = list(range(len(groups)))
        if "stacks" in p:
            bottom = [0.0] * len(groups)
            for i, (name, vals) in enumerate(p["stacks"].items()):
                vals = [0.0 if v is None else float(v) for v in vals]
                ax.bar(xs, vals, 0.6, bottom=bottom, label=name, color=cmap(i % 10))
                bottom = [b + v for b, v in zip(bottom, vals)]
            if p.get("totals"):
                ax.scatter(xs, [_num(v) for v in p["totals"]], marker="_", s=900, color="black",
                           zorder=3, label=p.get("totals_label", "total"))
        else:
            series = p["series"]
            width = 0.8 / max(1, len(series))
            for i, (name, vals) in enumerate(series.items()):
                off = [x - 0.4 + width * (i + 0.5) for x in xs]
                ax.bar(off, [_num(v) for v in vals], width, label=name, color=cmap(i % 10))
                marks = p.get("markers", {}).get(name)
                if marks:
                    ax.scatter(off, [_num(v) for v in marks], marker="o", s=14, color="black", zorder=3)
        rotate = max(map(len, groups), default=0) > 12
        ax.set_xticks(xs)
        ax.set_xticklabels(groups, rotation=20 if rotate else 0, ha="right" if rotate else "center", fontsize=8)
        ax.set_ylabel(p.get("ylabel", ""))
        ax.set_title(p.get("title", ""), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3 if rotate else -0.1), ncol=3, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
