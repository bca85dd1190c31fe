"""Shared helpers for side-by-side benchmarks."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved_times(fns: dict[str, Callable[[], None]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run each function ``repeats`` times in alternating order (A B B A ...), after ``warmup``
    rounds, so drifting machine load hits every contender alike. Returns wall times per name."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t)
    return times


def median_ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    """Median over repeats of the per-repeat ratio num/den (pairs measured back to back)."""
    return statistics.median(a / b for a, b in zip(times[num], times[den]))
