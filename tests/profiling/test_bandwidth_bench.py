"""bench/bandwidth_bound.py's decode timing: tokens/s is tokens over time, whatever an engine step
takes. A decode burst takes several tokens per step; counting steps as tokens made the int8 / int4
dirs (which burst, their steps being cheap) look 1.7x slower than they were on an AMD EPYC."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from tandem.bench import bandwidth_bound
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.plugins import cpu_kernels


class _Probe:
    def bound(self) -> tuple[float, float]:
        return 1.0, 1.0


def test_decode_steps_counts_tokens_not_engine_steps(engine_dirs, monkeypatch):
    """With a clock that advances one second per engine step, tokens/s must be the decode tokens over
    the decode steps, and each segment's seconds per token its steps over its tokens."""
    clock = [0.0]
    monkeypatch.setattr(bandwidth_bound, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    llm = LLM(engine_dirs["qwen3_5_mtp3"], RuntimeConfig(speculative=False, decode_burst=4))
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
    assert sum(seg.seconds_per_token for seg in segments) < len(segments)      # < 1 s (one step) per token


def test_kernel_shares_count_only_the_segments(engine_dirs, monkeypatch):
    """The kernels' busy time is read around each segment, so the GEMVs between segments (tandem's
    kernels too) are left out: with matmuls busy 0.5 s and other kernels 0.25 s per engine step (of
    1 s) and 100 s per GEMV, the matmuls take 50% of decode time, the other kernels 25%, and the
    matmuls stream the weight bytes at bytes per step / 0.5 s."""
    clock, busy = [0.0], [0.0, 0.0]
    monkeypatch.setattr(bandwidth_bound, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(bandwidth_bound, "_busy", lambda kernels: (busy[0], busy[1]))
    llm = LLM(engine_dirs["qwen3_5_mtp3"], RuntimeConfig(speculative=False, decode_burst=1))
    step = llm.step

    def timed_step():
        out = step()
        clock[0] += 1.0
        busy[0] += 0.5
        busy[1] += 0.25
        return out

    class GemvBusy(_Probe):
        def bound(self):
            busy[0] += 100.0
            return 2.0, 1.0

    monkeypatch.setattr(llm, "step", timed_step)
    speed, segments = bandwidth_bound.decode_steps(llm, 12, GemvBusy(), segment=4, kernels=Path("lib.so"))
    assert speed == pytest.approx(1.0)                      # a token a step: decode_burst=1
    assert [seg.matmul_per_token for seg in segments] == pytest.approx([0.5] * len(segments))
    assert [seg.other_per_token for seg in segments] == pytest.approx([0.25] * len(segments))
    # 4 bytes a token over 0.5 s of matmul: 8 bytes/s, 4x the bound of 2
    assert bandwidth_bound.shares(segments, 4.0) == "50% | 25% | 400%"


def test_kernel_shares_without_timed_matmuls_are_dashes():
    seg = bandwidth_bound.Segment(1.0, 2.0, 1.0, 0.0, 0.0)
    assert bandwidth_bound.shares([seg, seg], 4.0) == "- | - | -"


def test_no_timers_without_the_switch(engine_dirs, monkeypatch):
    """The timers are read only where they were switched on before the first kernel: off, the
    shares are left out instead of reading zeros."""
    monkeypatch.delenv(cpu_kernels.TIMES_ENV, raising=False)
    llm = LLM(engine_dirs["qwen3_5_mtp3"], RuntimeConfig(speculative=False))
    assert bandwidth_bound.timers_of(llm) is None
