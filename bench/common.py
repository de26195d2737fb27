"""Timing helpers for bench/ cases: median and p90 over repeated runs after warm-up, setups run in
turn pass by pass (interleaved), and the pipeline figures several cases compute alike (decode
tokens/s after the first token, accept length)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

T = TypeVar("T")


def timeit(fn, warmup: int = 3, runs: int = 20) -> tuple[float, float]:
    """(median ms, p90 ms) of fn() after `warmup` calls."""
    from tandem.profiling.measure import time_calls

    t = time_calls(fn, warmup, runs)
    return t["median_ms"], t["p90_ms"]


def p90(values: Iterable[float]) -> float:
    """The 90th percentile, interpolated between the two nearest runs (numpy's default)."""
    values = sorted(values)
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def median_p90(values: Iterable[float]) -> tuple[float, float]:
    values = list(values)
    return statistics.median(values), p90(values)


def summary(values: Iterable[float]) -> dict:
    """{"median", "p90", "min", "max", "runs"} of a list of runs."""
    values = list(values)
    median, high = median_p90(values)
    return {"median": median, "p90": high, "min": min(values), "max": max(values), "runs": values}


def interleaved(setups: Mapping[str, Callable[[int], T]], passes: int, *, warmup: int = 0, alternate: bool = False,
                each_pass: Callable[[dict[str, T]], None] | None = None) -> dict[str, list[T]]:
    """Every setup once per pass, in turn, so a noisy machine moves all of them alike: setup -> its
    `passes` results. A setup is called with the pass (0, 1, ...; -1 in the `warmup` passes first,
    whose results are dropped). alternate: odd passes run the setups in reverse order (each setup
    as often first as last). each_pass: called with each timed pass's results (a check that
    should stop the run at the first bad pass)."""
    names = list(setups)
    for _ in range(warmup):
        for name in names:
            setups[name](-1)
    got: dict[str, list[T]] = {name: [] for name in names}
    for i in range(passes):
        this = {}
        for name in (reversed(names) if alternate and i % 2 else names):
            this[name] = setups[name](i)
            got[name].append(this[name])
        if each_pass is not None:
            each_pass(this)
    return got


def medians(runs: Iterable, *fields) -> tuple[float, ...]:
    """The median of each field (an index or a key) over runs of tuples or dicts."""
    runs = list(runs)
    return tuple(statistics.median(r[f] for r in runs) for f in fields)


def decode_speed(results) -> float:
    """Decode tokens/s of one generation (GenerationResults): the tokens after each request's first
    over the time from the last first token to the last finish (prefill and first token excluded)."""
    first = max(r.metrics.first_token for r in results)
    last = max(r.metrics.finished for r in results)
    return sum(len(r.token_ids) - 1 for r in results) / (last - first)


def accept_length(results) -> float:
    """Tokens committed per verify round, (accepted + rounds) / rounds, over GenerationResults or
    sequences (anything with .metrics); 1.0 where no round drafted (plain decoding)."""
    rounds = sum(r.metrics.rounds for r in results)
    return (sum(r.metrics.accepted for r in results) + rounds) / rounds if rounds else 1.0


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
