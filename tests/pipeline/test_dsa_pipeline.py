"""DeepSeek-V3.2 / GLM-5 end to end: engines built by `build_engines` from the tiny checkpoints
(indexer top 8, prompts past it), run by `LLM`.

Held to transformers: plain greedy tokens and logits. Held to plain greedy: speculative decoding
with the NextN head and with test-double drafters, batches 1-8 staggered, unified and multi-call
rounds, under preemption. A round that accepts n drafts commits the same latent and indexer-key
rows as n + 1 plain decode steps."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tandem.checkpoint.families.deepseek_dsa.reference import NextNReference, load_target
from tandem.checkpoint.mla_specs import INDEX_KEYS, LATENT
from tandem.engines.builder import build_engines
from tandem.engines.options import BuildOptions
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.round_loop import RoundLoop
from tandem.pipeline.sampling_params import SamplingParams

from ..pipeline_fixtures import (
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
transformers = pytest.importorskip("transformers")

OPTIONS = BuildOptions(batch_sizes=(1, 8), spec_k=2, prefill_chunk=8, max_seq_len=128, page_size=4, index_share=True)
PROMPTS = [[5, 17, 33, 200, 7, 90, 12, 14, 150, 61, 8, 9, 30, 41], [9, 120, 77], [44],
           [3, 250, 8, 160, 21, 6, 7, 99, 100, 101, 102], [300, 12, 12, 12], list(range(1, 19)), [77, 78],
           [101, 5, 9, 11, 13]]
PLAIN = SamplingParams(max_tokens=20, ignore_eos=True, speculative=False)
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def dsa(tmp_path_factory):
    """kind -> (checkpoint folder, engine dir); "no_share": deepseek_v32 built with index share off."""
    root = tmp_path_factory.mktemp("dsa_engines")
    out = tiny_engines(root, ("deepseek_v32", "glm_moe_dsa"), OPTIONS)
    build_engines(root / "deepseek_v32", root / "no_share.engines", replace(OPTIONS, index_share=False),
                  show_progress=False)
    out["no_share"] = (root / "deepseek_v32", root / "no_share.engines")
    return out


@pytest.fixture(scope="module")
def plain(dsa):
    return run(dsa["deepseek_v32"][1], PROMPTS, PLAIN)[0]


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_plain_greedy_tokens_and_logits_equal_transformers(dsa, kind, monkeypatch):
    folder, engines = dsa[kind]
    torch.set_num_threads(1)
    target = load_target(folder)
    logits = record_logits(monkeypatch)
    prompt = PROMPTS[0]                                    # 14 tokens > top-k 8, and 24 more generated
    out = LLM(engines).generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, speculative=False))[0]
    with torch.no_grad():
        want = target.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
    assert out.token_ids == want.sequences[0, len(prompt):].tolist()
    np.testing.assert_allclose(np.stack(logits), torch.cat(want.logits).numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind,round_kind,share", [("deepseek_v32", "unified", True), ("no_share", "unified", False),
                                                   ("glm_moe_dsa", "multi", False)])
def test_drafts_of_every_round_equal_the_nextn_reference(dsa, monkeypatch, kind, round_kind, share):
    """k = 2 drafts per round from the one NextN layer (its own latent and indexer caches, own head),
    on every round of generations that pass top-k: == the torch reference's full recomputation.
    Index share (the unified round's default: drafts a round graph made; the first round after a
    prefill drafts with head calls, which score every step) and the multi-call rounds."""
    folder, engines = dsa[kind]
    torch.set_num_threads(1)
    nextn = NextNReference(load_target(folder), folder)
    from_round = []     # per recorded round: were its drafts past d_1 made by a unified round graph?
    real = RoundLoop._draft

    def draft(self, seqs):
        ahead = [bool(x.ahead) for x in seqs]
        out = real(self, seqs)
        from_round.extend(a for a, x in zip(ahead, seqs) if out[x.request_id])   # (as record_drafts keeps them)
        return out

    monkeypatch.setattr(RoundLoop, "_draft", draft)
    rounds = record_drafts(monkeypatch)
    LLM(engines, RuntimeConfig(round=round_kind, adaptive_width=False)).generate(
        [PROMPTS[0], PROMPTS[3]], SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(rounds) >= 6 and all(len(d) == round_drafts(t, [PROMPTS[0], PROMPTS[3]], 12, 2) for t, d in rounds)
    assert any(from_round) == (round_kind == "unified")
    for (tokens, drafts), shared in zip(rounds, from_round, strict=True):
        want = nextn.drafts(tokens[:-1], len(drafts), index_share=share and shared)
        assert want == (tokens[-1], drafts), len(tokens)


@pytest.mark.parametrize("drafter,round_kind,engines", [
    ("wrong", "unified", "deepseek_v32"), ("oracle", "unified", "deepseek_v32"), ("prefix:1", "multi", "deepseek_v32"),
    ("heads", "unified", "deepseek_v32"), ("heads", "multi", "deepseek_v32"), ("heads", "unified", "no_share")])
def test_speculative_equals_plain_greedy(dsa, plain, monkeypatch, drafter, round_kind, engines):
    if drafter != "heads":
        install_drafter(monkeypatch, drafter, {f"r{i}": out for i, out in plain.items()})
    outputs, llm = run(dsa[engines][1], PROMPTS, GREEDY, RuntimeConfig(round=round_kind), stagger=2)
    assert outputs == plain
    metrics = [s.metrics for s in llm.test_sequences]
    assert sum(m.rounds for m in metrics) > 0
    if drafter == "oracle":
        assert sum(m.accepted for m in metrics) == sum(m.drafted for m in metrics) > 0


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_batches_staggered(dsa, plain, batch):
    outputs, _ = run(dsa["deepseek_v32"][1], PROMPTS[:batch], GREEDY, stagger=3)
    assert outputs == {i: plain[i] for i in range(batch)}


def test_glm_speculative_equals_plain(dsa):
    engines = dsa["glm_moe_dsa"][1]
    assert run(engines, PROMPTS, GREEDY, stagger=2)[0] == run(engines, PROMPTS, PLAIN)[0]


def test_under_preemption(dsa, plain):
    config = RuntimeConfig(memory_budget_bytes=80_000, max_num_seqs=8)
    outputs, llm = run(dsa["deepseek_v32"][1], PROMPTS, GREEDY, config)
    assert outputs == plain
    assert sum(s.metrics.preemptions for s in llm.test_sequences) > 0


@pytest.mark.parametrize("n_right", [0, 1, 2])
def test_commit_of_n_accepted_equals_n_plus_one_decode_steps(dsa, plain, monkeypatch, n_right):
    """After a round that accepts n drafts, every trunk layer's latent and indexer-key rows equal
    those n + 1 plain decode steps write, and the NextN layer's own latent and indexer-key rows
    equal those a fresh prefill of the same tokens writes (incremental re-anchoring == recomputation)."""
    engines = dsa["deepseek_v32"][1]
    prompt = PROMPTS[3]
    spec, seq, base, other = after_one_round(monkeypatch, engines, prompt, plain[3], n_right)
    page = spec.page_size
    for layer in base.runner.trunk_kv:
        assert set(base.pools.paged[layer]) == {LATENT, INDEX_KEYS}
        for name in (LATENT, INDEX_KEYS):
            for pos in range(seq.committed):
                a = spec.pools.paged[layer][name][seq.table.groups[None].pages[pos // page], pos % page]
                b = base.pools.paged[layer][name][other.table.groups[None].pages[pos // page], pos % page]
                np.testing.assert_allclose(a, b, atol=1e-5)

    fresh = LLM(engines)   # prefill only (a step would decode right after the last chunk)
    again = fresh.add_request(seq.tokens[:-1], SamplingParams(max_tokens=2, ignore_eos=True), request_id="y")
    fresh.scheduler.admit()
    while again.committed < seq.committed:
        fresh.round_loop._prefill(fresh.scheduler.prefill_batch())
    assert again.head_committed == seq.head_committed > len(prompt)
    assert set(spec.pools.paged["mtp0"]) == {LATENT, INDEX_KEYS}
    for name in (LATENT, INDEX_KEYS):
        for pos in range(seq.head_committed):
            a = spec.pools.paged["mtp0"][name][seq.table.groups[None].pages[pos // page], pos % page]
            b = fresh.pools.paged["mtp0"][name][again.table.groups[None].pages[pos // page], pos % page]
            np.testing.assert_allclose(a, b, atol=1e-5)
