"""Timing of jitted device work, shared by the benchmark tools: wall clock (`time_op`; `time_stream`
adds the marginal cost per call of a steady stream) and GPU kernel time read from a profiler trace
(`trace_kernels`, `device_time`)."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

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


def xla_copy_bandwidth(n: int) -> float:
    """Bytes/s (read + write) of an XLA elementwise pass over n float32 values (the f32 pass is the
    fastest XLA copy measured on the H200, so a roofline built on it is not flattered)."""
    import jax.numpy as jnp

    x = [jax.random.normal(jax.random.PRNGKey(i), (n,), jnp.float32) for i in range(2)]
    return 2 * x[0].size * 4 / time_op(lambda a: -a, [(a,) for a in x], chain=3)


@dataclasses.dataclass(frozen=True)
class StreamTime:
    """A steady stream timed at two lengths (seconds). per_call: wall time per call of the shorter
    stream, `time_op`'s figure (the stream's fixed costs shared by its calls); marginal: what one
    more call adds to a running stream (the slope between the two lengths); fixed: the rest of the
    shorter stream's time, paid once per stream whatever its length (the host's dispatch of the
    first program before its first kernel, the GPU waiting while the host launches the first small
    kernels, the final sync)."""

    per_call: float
    marginal: float
    fixed: float


def stream_fit(short_s: float, short_calls: int, long_s: float, long_calls: int) -> StreamTime:
    """Fit time = fixed + calls * marginal through two streams' wall times (s) and call counts."""
    if not 0 < short_calls < long_calls:
        raise ValueError(f"calls: expected 0 < short < long, got {short_calls} and {long_calls}")
    marginal = (long_s - short_s) / (long_calls - short_calls)
    return StreamTime(per_call=short_s / short_calls, marginal=marginal, fixed=short_s - short_calls * marginal)


def time_stream(fn: Callable, arg_sets: list[tuple], rounds: int = 5, chain: int = 8,
                long_factor: int = 3) -> StreamTime:
    """`time_op`'s steady stream (`chain` dispatches over the argument sets, one sync) and one
    `long_factor` times as long, alternating, median of `rounds` each; `stream_fit` of the two.
    Each stream keeps only its last result alive (the long stream's results would not fit beside a
    large layer's intermediates otherwise)."""
    if long_factor < 2:
        raise ValueError(f"long_factor: expected >= 2, got {long_factor}")
    many = _over_sets(fn)
    jax.block_until_ready(many(arg_sets))
    times: dict[int, list[float]] = {chain: [], chain * long_factor: []}
    for _ in range(rounds):
        for n, walls in times.items():
            t0 = time.perf_counter()
            for _ in range(n):  # only the last result is kept: the programs run in order on one stream
                out = many(arg_sets)
            jax.block_until_ready(out)
            del out
            walls.append(time.perf_counter() - t0)
    calls = {n: n * len(arg_sets) for n in times}
    (short, ts), (long, tl) = times.items()
    return stream_fit(statistics.median(ts), calls[short], statistics.median(tl), calls[long])


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
