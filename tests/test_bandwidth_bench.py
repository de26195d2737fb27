"""bench/bandwidth_bound.py's decode timing: tokens/s is tokens over time, whatever an engine step
takes. A decode burst takes several tokens per step; counting steps as tokens made the int8 / int4
dirs (which burst, their steps being cheap) look 1.7x slower than they were on an AMD EPYC."""

from __future__ import annotations

import types

import pytest

from tandem.bench import bandwidth_bound
from tandem.pipeline.llm import LLM, EngineConfig


class _Probe:
    def bound(self) -> tuple[float, float]:
        return 1.0, 1.0


def test_decode_steps_counts_tokens_not_engine_steps(engine_dirs, monkeypatch):
    """With a clock that advances one second per engine step, tokens/s must be the decode tokens over
    the decode steps, and each segment's seconds per token its steps over its tokens."""
    clock = [0.0]
    monkeypatch.setattr(bandwidth_bound, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    llm = LLM(engine_dirs["qwen3_5_mtp3"], EngineConfig(speculative=False, decode_burst=4))
    seqs, per_step = [], []
    add_request, step = llm.add_request, llm.step

    def add(*args, **kwargs):
        seqs.append(add_request(*args, **kwargs))
        return seqs[-1]

    def timed_step():
        before = seqs[0].num_generated
        out = step()
        clock[0] += 1.0
        if before:                      # the prefill's step (first token) is not timed
            per_step.append(seqs[0].num_generated - before)
        return out

    monkeypatch.setattr(llm, "add_request", add)
    monkeypatch.setattr(llm, "step", timed_step)
    speed, segments = bandwidth_bound.decode_steps(llm, 24, _Probe(), segment=4)
    # (the prefill's step may take a decode token too: not timed)
    assert sum(per_step) >= 20 and len(per_step) < sum(per_step) / 2     # the premise: bursts, several a step
    assert speed == pytest.approx(sum(per_step) / len(per_step))
    assert sum(seconds for seconds, _, _ in segments) < len(segments)      # < 1 s (one step) per token
