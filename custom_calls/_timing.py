"""Wall-clock timing of jitted device work, shared by the benchmark tools."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax


def time_op(fn: Callable, arg_sets: list[tuple], rounds: int = 5, chain: int = 4) -> float:
    """Seconds per call of fn: a jitted function runs fn over the argument sets; `chain` such calls
    are dispatched back to back (the host runs ahead, so dispatch and sync costs overlap the GPU),
    then one sync; median over `rounds`."""
    many = jax.jit(lambda sets: [fn(*s) for s in sets])
    jax.block_until_ready(many(arg_sets))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = [many(arg_sets) for _ in range(chain)]
        jax.block_until_ready(outs)
        del outs
        times.append((time.perf_counter() - t0) / (chain * len(arg_sets)))
    return statistics.median(times)
