"""The contract: speculative decoding reproduces plain greedy decoding token for token, whatever
the drafts (always wrong, always right, random, the real MTP heads), for batches of 1-8 with
staggered arrivals and different prompt lengths, chained and reused heads, and under preemption."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams

from ..pipeline_fixtures import GREEDY, install_drafter, run

PROMPTS = [[5, 17, 33, 200, 7], [9, 120, 77, 301, 15, 2, 88, 91, 14, 250, 3], [44], [3, 250, 8, 160, 21, 6, 7],
           [300, 12, 12, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [77, 78], [101, 5, 9]]


@pytest.fixture(scope="module")
def plain(engine_dirs):
    off = SamplingParams(max_tokens=24, ignore_eos=True, speculative=False)
    return {kind: run(path, PROMPTS, off)[0] for kind, path in engine_dirs.items()}


@pytest.mark.parametrize("kind", ["qwen3_5_mtp3", "qwen3_next"])
@pytest.mark.parametrize("drafter", ["wrong", "oracle", "random", "prefix:1", "prefix:2", "heads"])
def test_speculative_equals_plain_greedy(engine_dirs, plain, monkeypatch, kind, drafter):
    if drafter != "heads":
        install_drafter(monkeypatch, drafter, {f"r{i}": out for i, out in plain[kind].items()})
    outputs, llm = run(engine_dirs[kind], PROMPTS, stagger=2)
    assert outputs == plain[kind]
    metrics = [s.metrics for s in llm.test_sequences]
    if drafter == "wrong":
        assert sum(m.accepted for m in metrics) == 0 and sum(m.rounds for m in metrics) > 0
    if drafter == "oracle":
        assert sum(m.accepted for m in metrics) == sum(m.drafted for m in metrics) > 0


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_batches_with_staggered_arrivals(engine_dirs, plain, batch):
    outputs, _ = run(engine_dirs["qwen3_5_mtp3"], PROMPTS[:batch], stagger=3)
    assert outputs == {i: plain["qwen3_5_mtp3"][i] for i in range(batch)}


@pytest.mark.parametrize("mode", ["chained", "reused"])
def test_chained_and_reused_heads(engine_dirs, plain, mode):
    outputs, _ = run(engine_dirs["qwen3_5_mtp3"], PROMPTS, config=RuntimeConfig(mtp_mode=mode))
    assert outputs == plain["qwen3_5_mtp3"]


def test_oracle_drafts_are_all_accepted(engine_dirs, plain, monkeypatch):
    install_drafter(monkeypatch, "oracle", {f"r{i}": out for i, out in plain["qwen3_5_mtp3"].items()})
    llm = LLM(engine_dirs["qwen3_5_mtp3"])
    seq = llm.add_request(PROMPTS[1], GREEDY, request_id="r1")
    while seq.finish_reason is None:
        llm.step()
    m = seq.metrics
    assert m.accepted == m.drafted and m.accept_length > 3.5  # k = 3: 4 tokens per round but the last


def test_under_preemption(engine_dirs, plain):
    # a budget of a few pages forces sequences out and back in (recomputed from their tokens)
    config = RuntimeConfig(memory_budget_bytes=230_000, max_num_seqs=8)
    outputs, llm = run(engine_dirs["qwen3_5_mtp3"], PROMPTS, config=config)
    assert outputs == plain["qwen3_5_mtp3"]
    assert sum(s.metrics.preemptions for s in llm.test_sequences) > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_sampling_is_reproducible_per_seed(engine_dirs, seed):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.95, seed=seed, ignore_eos=True)
    a, _ = run(engine_dirs["qwen3_next"], PROMPTS[:4], params)
    b, _ = run(engine_dirs["qwen3_next"], PROMPTS[:4], params)
    assert a == b
    assert np.mean([len(v) for v in a.values()]) == 16
