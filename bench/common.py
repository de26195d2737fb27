"""Timing helpers for bench/ scripts: median and p90 over repeated runs after warm-up."""

from __future__ import annotations


def timeit(fn, warmup: int = 3, runs: int = 20) -> tuple[float, float]:
    """(median ms, p90 ms) of fn() after `warmup` calls."""
    from tandem.profiling.measure import time_calls

    t = time_calls(fn, warmup, runs)
    return t["median_ms"], t["p90_ms"]


def machine() -> str:
    from tandem.profiling.measure import device

    d = device()
    return f"{d['name']}, {d['cores']} cores"
