"""Timing helpers for bench/ scripts: median and p90 over repeated runs after warm-up."""

from __future__ import annotations

import platform
import time

import numpy as np


def timeit(fn, warmup: int = 3, runs: int = 20) -> tuple[float, float]:
    """(median ms, p90 ms) of fn() after `warmup` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e3)
    return float(np.median(samples)), float(np.percentile(samples, 90))


def machine() -> str:
    import os

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"
