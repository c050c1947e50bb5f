"""GPU kernel events from a jax.profiler trace: what the benchmarks and the GEMM autotuner time."""

from __future__ import annotations

import glob
import tempfile
from typing import Any, Callable


def gpu_kernel_events(run: Callable[[], Any]) -> list[tuple[str, int, int]]:
    """(name, start_ns, duration_ns) of every GPU kernel and memset launched while `run()` executes
    (it must block until its work is done), from the per-stream lines of a jax.profiler trace (the
    other lines repeat the same kernels). RuntimeError when the profiler wrote no trace."""
    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        if not files:
            raise RuntimeError("the profiler wrote no trace")
        data = ProfileData.from_file(files[0])
    return [(ev.name, ev.start_ns, ev.duration_ns)
            for plane in data.planes if plane.name.startswith("/device:GPU")
            for line in plane.lines if "Stream" in line.name
            for ev in line.events]
