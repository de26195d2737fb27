"""Logprobs are the target's raw distribution at each emitted position: the same numbers whether the
tokens came from plain decoding or from verify rounds (to 1e-4, whatever the drafts), the same as
scoring the finished text again as a prompt (prompt_logprobs), and unshaped by the processors."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams

from ..pipeline_fixtures import install_drafter, run

KIND = "qwen3_5_mtp3"
VOCAB = 384
PROMPTS = [[9, 120, 77, 301, 15, 2, 88], [5, 17, 33, 200, 7], [44, 44, 44], [3, 250, 8, 160, 21, 6, 7]]
TOP = 5
BASE = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=TOP)


def _close(got, want, what: str) -> None:
    assert [e.token for e in got] == [e.token for e in want], what
    np.testing.assert_allclose([e.logprob for e in got], [e.logprob for e in want], atol=1e-4, err_msg=what)
    for g, w in zip(got, want):
        assert [t for t, _ in g.top] == [t for t, _ in w.top], what
        np.testing.assert_allclose([lp for _, lp in g.top], [lp for _, lp in w.top], atol=1e-4, err_msg=what)


@pytest.fixture(scope="module")
def plain(engine_dirs):
    return LLM(engine_dirs[KIND], RuntimeConfig(speculative=False)).generate(PROMPTS, BASE)


def test_plain_logprobs_are_a_distribution_ranked(plain):
    for r in plain:
        assert len(r.logprobs) == len(r.token_ids) == BASE.max_tokens
        for e, t in zip(r.logprobs, r.token_ids):
            assert e.token == t and len(e.top) == TOP
            assert e.top[0] == (t, pytest.approx(e.logprob))           # greedy: the emitted token is the top one
            lps = [lp for _, lp in e.top]
            assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
            assert sum(np.exp(lps)) <= 1 + 1e-5


@pytest.mark.parametrize("drafter", ["oracle", "wrong", "random", "prefix:1"])
@pytest.mark.parametrize("batch", [1, 4])
def test_speculative_logprobs_equal_plain(engine_dirs, plain, monkeypatch, drafter, batch):
    want = plain[:batch]
    install_drafter(monkeypatch, drafter, {f"r{i}": r.token_ids for i, r in enumerate(want)}, vocab=VOCAB)
    got, llm = run(engine_dirs[KIND], PROMPTS[:batch], BASE, RuntimeConfig(adaptive_width=False),
                   stagger=2 if batch > 1 else 0)
    seqs = sorted(llm.test_sequences, key=lambda s: s.request_id)
    assert sum(s.metrics.rounds for s in seqs) > 0
    for s, w in zip(seqs, want):
        assert s.output_ids() == w.token_ids
        _close(s.logprobs, w.logprobs, f"{drafter} {s.request_id}")


def test_prompt_logprobs_score_the_text_as_generation_did(engine_dirs, plain):
    """Teacher forcing: prompt+output sent back as a prompt scores each output token as it was
    scored when generated (prefill chunks against decode steps and verify rows)."""
    llm = LLM(engine_dirs[KIND])
    rescored = llm.generate([p + r.token_ids for p, r in zip(PROMPTS, plain)],
                            SamplingParams(max_tokens=1, prompt_logprobs=TOP))
    for p, r, again in zip(PROMPTS, plain, rescored):
        assert len(again.prompt_logprobs) == len(p) + len(r.token_ids) - 1    # every prompt token but the first
        tail = again.prompt_logprobs[len(p) - 1 :]
        _close(tail, r.logprobs, "rescored")
        assert all(e.rank == 1 for e in tail)       # greedy outputs: each was the most likely token


def test_logprobs_are_raw_not_processed(engine_dirs):
    """vLLM's default (raw) mode: a logit_bias changes which tokens come out, not their reported logprob."""
    llm = LLM(engine_dirs[KIND])
    biased = llm.generate(PROMPTS, replace(BASE, logit_bias=((5, 3.0), (7, 2.0)), repetition_penalty=1.3))
    rescored = llm.generate([p + r.token_ids for p, r in zip(PROMPTS, biased)],
                            SamplingParams(max_tokens=1, prompt_logprobs=0))
    for p, r, again in zip(PROMPTS, biased, rescored):
        want = again.prompt_logprobs[len(p) - 1 :]
        np.testing.assert_allclose([e.logprob for e in r.logprobs], [e.logprob for e in want], atol=1e-4)


def test_no_logprobs_unless_asked(engine_dirs):
    r = LLM(engine_dirs[KIND]).generate(PROMPTS[:1], replace(BASE, logprobs=None))[0]
    assert r.logprobs is None and r.prompt_logprobs is None
