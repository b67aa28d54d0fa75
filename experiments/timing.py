"""Timing helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

__all__ = ["median_time", "compile_times", "peaks_above_start"]


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``repeats`` calls, after one untimed warm-up call (first-touch
    page faults, thread pool start)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compile_times() -> str:
    """What torch.compile spent so far in this process, per graph: each frame dynamo compiled
    (tracing, AOTAutograd and the backend's forward compile) and each backward graph compiled
    on its first backward; "" when nothing was compiled."""
    import torch

    metrics = torch._dynamo.utils.compilation_time_metrics
    frames = metrics.get("_compile.compile_inner", [])
    backward = metrics.get("backward._backward_impl", [])
    if not frames:
        return ""
    each = lambda times: ", ".join(f"{t:.2f}" for t in times)  # noqa: E731
    return (
        f"{len(frames)} forward graph(s) {each(frames)} s; "
        f"{len(backward)} backward graph(s) {each(backward)} s"
    )


def peaks_above_start(prof, count: int) -> list[int]:
    """Per measured step ``i < count`` (a ``record_function(f"measured_step_{i}")`` region of
    a ``torch.profiler.profile(profile_memory=True)`` run): the most bytes allocated above what
    was live when the step began, from the profiler's memory events."""
    events = prof.profiler.kineto_results.events()
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    peaks = []
    for i in range(count):
        mark = next(e for e in events if e.name() == f"measured_step_{i}")
        start, stop = mark.start_ns(), mark.start_ns() + mark.duration_ns()
        live = base = peak = 0
        for t, nbytes in memory:
            if t > stop:
                break
            live += nbytes
            if t < start:
                base = peak = live
            peak = max(peak, live)
        peaks.append(peak - base)
    return peaks
