"""Timing of jitted device work, shared by the benchmark tools: wall clock (`time_op`) and GPU
kernel time read from a profiler trace (`trace_kernels`, `device_time`)."""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable

import jax


@functools.lru_cache(maxsize=16)
def _over_sets(fn: Callable) -> Callable:
    """One jitted function running fn over a list of argument sets, shared by the timers so that
    timing the same fn by wall clock and by kernel time compiles it once."""
    return jax.jit(lambda sets: [fn(*s) for s in sets])


def time_op(fn: Callable, arg_sets: list[tuple], rounds: int = 5, chain: int = 4,
            idle_s: float = 0.0) -> float:
    """Seconds per call of fn: a jitted function runs fn over the argument sets; `chain` such calls
    are dispatched back to back (the host runs ahead, so dispatch and sync costs overlap the GPU),
    then one sync; median over `rounds`. `idle_s` > 0 sleeps before each round: with chain=1 that
    is a burst after idle (the host's dispatch start-up and the clock ramp are in the figure), with
    a long chain a steady stream, the way a serving loop calls the layer."""
    many = _over_sets(fn)
    jax.block_until_ready(many(arg_sets))
    times = []
    for _ in range(rounds):
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        outs = [many(arg_sets) for _ in range(chain)]
        jax.block_until_ready(outs)
        del outs
        times.append((time.perf_counter() - t0) / (chain * len(arg_sets)))
    return statistics.median(times)


def trace_kernels(run: Callable[[], Any]) -> dict[str, list[float]]:
    """Device durations (s) of the GPU kernels and memsets launched while `run()` executes (it must
    block until its work is done), by name, from a jax.profiler trace."""
    from custom_calls.profiling import gpu_kernel_events

    kernels: dict[str, list[float]] = {}
    for name, _, dur in gpu_kernel_events(run):
        kernels.setdefault(name, []).append(dur / 1e9)
    return kernels


def device_time(fn: Callable, arg_sets: list[tuple], rounds: int = 3) -> dict[str, float]:
    """GPU time per call of fn, per kernel name (seconds), over the same rotating argument sets
    as `time_op` (so inputs are not L2-resident): the sum of each kernel's durations divided by the
    number of calls. Host dispatch is not counted; the "total" key is the sum over kernels."""
    many = _over_sets(fn)
    jax.block_until_ready(many(arg_sets))

    def run():
        jax.block_until_ready([many(arg_sets) for _ in range(rounds)])

    calls = rounds * len(arg_sets)
    per = {name: sum(d) / calls for name, d in trace_kernels(run).items()}
    per["total"] = sum(per.values())
    return per
