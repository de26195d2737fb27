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


def wait_for_engines(llm) -> None:
    """Block until the sessions LLM() opens in the background are open (ONNX Runtime CPU runner), so a
    timed window does not share the cores with them."""
    sessions = getattr(getattr(llm.runner, "runner", None), "sessions", None)
    for file in list(getattr(sessions, "_pending", {})):
        sessions[file]


def acceptance_per_position(results, k: int, where: str) -> tuple[float, list[float], int]:
    """Speculative GenerationResults -> (accept length, draft i's acceptance given drafts 1..i-1
    were, rounds). Every round must have drafted k (fixed spec_k, adaptive width off, p_min 0):
    otherwise the per-position figures mean nothing, and this says so naming `where`."""
    import numpy as np

    drafted, accepted = np.zeros(k), np.zeros(k)
    for r in results:
        d, a = r.metrics.drafted_per_position, r.metrics.accepted_per_position
        drafted[: len(d)] += d
        accepted[: len(a)] += a
    rounds = sum(r.metrics.rounds for r in results)
    if not (drafted == rounds).all():
        raise RuntimeError(f"{where}: drafts per position {drafted.tolist()} over {rounds} rounds; the figures "
                           f"assume every round drafts {k} (fixed spec_k, adaptive width off, p_min 0)")
    # accepted_per_position[i] counts rounds with >= i+1 drafts accepted
    given = accepted / np.concatenate([[rounds], accepted[:-1]]).clip(min=1)
    return (sum(r.metrics.accepted for r in results) + rounds) / rounds, given.tolist(), rounds
