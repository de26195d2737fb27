"""Step-3.5 end to end: engines built by `build_engines` from the tiny checkpoint, run by `LLM`.

Held to transformers: plain greedy tokens and logits (past the window of 8), the chained NextN
drafts of every round (each head's own lm head: the torch NextN reference; heads tied to lm_head:
transformers' own `generate(use_mtp=True)` rounds), speculative == plain for every drafter, batch,
mode and under preemption, incremental head anchoring == a fresh prefill, and window pages bounded
over a long generation."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams

from ..pipeline_fixtures import (
    OPTIONS,
    after_one_round,
    install_drafter,
    record_drafts,
    record_logits,
    round_drafts,
    run,
    tiny_engines,
)

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
ref = pytest.importorskip("tandem.checkpoint.families.step3p5.reference")

WINDOW = 8
PROMPTS = [[5, 17, 33, 200, 7, 90, 12, 14, 150, 61, 8, 9, 30, 41], [9, 120, 77], [44],
           [3, 250, 8, 160, 21, 6, 7, 99, 100, 101, 102], [300, 12, 12, 12], list(range(1, 19)), [77, 78],
           [101, 5, 9, 11, 13]]
PLAIN = SamplingParams(max_tokens=24, ignore_eos=True, speculative=False)


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    """kind -> (checkpoint folder, engine dir) for the own-heads and tied-heads tiny checkpoints."""
    return tiny_engines(tmp_path_factory.mktemp("step3p5"), ("step3p5", "step3p5_tied_heads"), OPTIONS)


@pytest.fixture(scope="module")
def target(step):
    torch.set_num_threads(1)
    return ref.load_target(step["step3p5"][0])


@pytest.fixture(scope="module")
def plain(step):
    return run(step["step3p5"][1], PROMPTS, PLAIN)[0]


def test_plain_greedy_tokens_and_logits_equal_transformers_past_the_window(step, target, monkeypatch):
    logits = record_logits(monkeypatch)
    prompt = PROMPTS[0]                        # 14 tokens > window 8
    llm = LLM(step["step3p5"][1])
    out = llm.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True, speculative=False))[0]
    expected = ref.greedy(target, prompt, 32)
    assert out.token_ids == expected.tokens
    np.testing.assert_allclose(np.stack(logits), expected.logits.numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_drafts_of_every_round_equal_the_nextn_reference_with_own_heads(step, target, monkeypatch, k):
    """Chained k: head j's rows pair with head j-1's hidden (previous-head anchoring), each head
    with its own final norm and lm head, on every round of a generation that passes the window."""
    folder, engines = step["step3p5"]
    nextn = ref.NextNReference(target, folder)
    rounds = record_drafts(monkeypatch)
    llm = LLM(engines, RuntimeConfig(spec_k=k))
    max_tokens = 20 if k == 3 else 10
    llm.generate([PROMPTS[0], PROMPTS[3]], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert len(rounds) >= 6
    for tokens, drafts in rounds:
        expected = nextn.drafts(tokens[:-1], len(drafts), own_head=True)
        assert expected.next_token == tokens[-1]
        assert drafts == expected.tokens, (len(tokens), drafts, expected.tokens)
    assert all(len(d) == round_drafts(t, [PROMPTS[0], PROMPTS[3]], max_tokens, k) for t, d in rounds)


def test_drafts_equal_transformers_generate_use_mtp_rounds(step, monkeypatch):
    """Heads whose own lm head is a copy of lm_head: tandem's drafts == the drafts transformers makes
    itself in generate(use_mtp=True), round for round, and the outputs agree."""
    folder, engines = step["step3p5_tied_heads"]
    target = ref.load_target(folder)
    mtp = ref.load_mtp_model(target, folder)
    tokens, theirs = ref.mtp_generate(target, mtp, PROMPTS[0], 24)
    rounds = record_drafts(monkeypatch)
    out = LLM(engines, RuntimeConfig(spec_k=3)).generate([PROMPTS[0]], SamplingParams(max_tokens=24, ignore_eos=True))
    assert out[0].token_ids == tokens
    ours = {tuple(t): d for t, d in rounds}
    common = [r for r in theirs if tuple(r.committed) in ours]
    assert len(common) >= len(theirs) - 1 >= 4      # transformers' last round may be cut by max_new_tokens
    for r in common:   # (where its budget is short, a round of ours drafts fewer)
        drafts = ours[tuple(r.committed)]
        assert drafts == r.drafts[: len(drafts)] and len(drafts) == round_drafts(r.committed, [PROMPTS[0]], 24, 3)


@pytest.mark.parametrize("drafter", ["wrong", "oracle", "random", "prefix:1", "prefix:2", "heads"])
def test_speculative_equals_plain_greedy(step, plain, monkeypatch, drafter):
    if drafter != "heads":
        install_drafter(monkeypatch, drafter, {f"r{i}": out for i, out in plain.items()})
    outputs, llm = run(step["step3p5"][1], PROMPTS, stagger=2)
    assert outputs == plain
    if drafter == "oracle":
        metrics = [s.metrics for s in llm.test_sequences]
        assert sum(m.accepted for m in metrics) == sum(m.drafted for m in metrics) > 0


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("mode", ["chained", "reused"])
def test_batches_staggered_and_both_head_modes(step, plain, batch, mode):
    outputs, _ = run(step["step3p5"][1], PROMPTS[:batch], config=RuntimeConfig(mtp_mode=mode), stagger=3)
    assert outputs == {i: plain[i] for i in range(batch)}


def test_under_preemption(step, plain):
    # 18 full-attention pages (the window group's take rows in flight: bursts of 8 steps at most)
    config = RuntimeConfig(memory_budget_bytes=300_000, max_num_seqs=8, decode_burst=8)
    outputs, llm = run(step["step3p5"][1], PROMPTS, config=config)
    assert outputs == plain
    assert sum(s.metrics.preemptions for s in llm.test_sequences) > 0


def _head_rows(llm: LLM, seq, head: int, positions: range) -> np.ndarray:
    pools = llm.pools.paged[f"mtp{head}"]
    tables = seq.table.groups
    rows = []
    for p in positions:
        table = tables[llm.desc.mtp.layers[head].mixer.window].pages
        rows.append(np.concatenate([pools[name][table[p // llm.page_size], p % llm.page_size].ravel()
                                    for name in sorted(pools)]))
    return np.stack(rows)


@pytest.mark.parametrize("n_right", [0, 1, 3])
def test_commit_of_n_accepted_equals_n_plus_one_decode_steps_and_a_fresh_prefill(step, plain, monkeypatch, n_right):
    """After a round that accepts n drafts: the target's K/V rows equal n+1 plain decode steps', and
    every head's committed rows (head j lagging by j) equal those a fresh prefill of the same tokens
    writes: incremental previous-head anchoring == full recomputation."""
    engines = step["step3p5"][1]
    prompt = PROMPTS[3]
    spec, seq, base, other = after_one_round(monkeypatch, engines, prompt, plain[3], n_right)
    page = spec.page_size
    for layer in base.runner.trunk_kv:
        window = base.desc.layers[layer].mixer.window
        first = max(0, seq.committed - (window or seq.committed))   # rows a window layer still holds
        for pos in range(first, seq.committed):
            a = spec.pools.paged[layer]["key"][seq.table.groups[window].pages[pos // page], pos % page]
            b = base.pools.paged[layer]["key"][other.table.groups[window].pages[pos // page], pos % page]
            np.testing.assert_allclose(a, b, atol=1e-5)

    fresh = LLM(engines)   # prefill only (a step would decode right after the last chunk)
    again = fresh.add_request(seq.tokens[:-1], SamplingParams(max_tokens=2, ignore_eos=True), request_id="y")
    fresh.scheduler.admit()
    while again.committed < seq.committed:
        fresh.round_loop._prefill(fresh.scheduler.prefill_batch())
    assert again.head_committed == seq.head_committed and again.tokens == seq.tokens
    for j in range(spec.mtp_layers):
        rows = range(0, seq.head_committed - j)
        np.testing.assert_allclose(_head_rows(spec, seq, j, rows), _head_rows(fresh, again, j, rows), atol=1e-5)
        np.testing.assert_allclose(seq.carries[j], again.carries[j], atol=1e-5)


def test_window_pages_stay_bounded_over_a_long_generation(step, target):
    """300 tokens with a window of 8: the window group's pages held stay at their bound at every step
    while the full group's grow with the length, and the output still equals transformers'."""
    llm = LLM(step["step3p5"][1], RuntimeConfig(max_num_seqs=1))
    seq = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=300, ignore_eos=True), request_id="long")
    page = llm.page_size
    most = full = 0
    while seq.finish_reason is None:
        llm.step()
        if seq.finish_reason is None:
            held = seq.table.held()
            most, full = max(most, held[WINDOW]), max(full, held[None])
    # window + rows in flight (k+1 = 4, a prefill chunk of 8 or a decode burst's steps) + heads' lag (3),
    # plus a partial page
    bound = -(-(WINDOW + max(OPTIONS.prefill_chunk, llm.config.decode_burst) + 3) // page) + 1
    # (the full group's last count comes a step before the end: up to a burst's tokens earlier)
    assert 0 < most <= bound and full >= (len(PROMPTS[0]) + 299 - llm.config.decode_burst) // page
    assert seq.table.held().get(None, 0) == 0                     # finished: everything went back
    assert seq.output_ids() == ref.greedy(target, PROMPTS[0], 300).tokens
