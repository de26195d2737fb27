"""vLLM's logits processors (penalties, logit_bias, min_tokens, bad_words, allowed_token_ids, min_p):
each changes the output as vLLM documents it, the host's arithmetic equals a dense reference, and
speculative decoding equals plain decoding with the same processors, token for token, whatever the drafts."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.logits_processors import Processors, apply_edits
from tandem.pipeline.sampling_params import SamplingParams

from ..pipeline_fixtures import install_drafter, run

KIND = "qwen3_5_mtp3"
VOCAB = 384
PROMPTS = [[9, 120, 77, 301, 15, 2, 88], [5, 17, 33, 200, 7], [44, 44, 44], [3, 250, 8, 160, 21, 6, 7]]
BASE = SamplingParams(max_tokens=20, ignore_eos=True)
CASES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=1.2),
    "repetition": dict(repetition_penalty=1.8),
    "negative penalties": dict(frequency_penalty=-1.0, presence_penalty=0.5, repetition_penalty=0.7),
    "logit_bias": dict(logit_bias=((5, 30.0), (6, -100.0))),
    "allowed_token_ids": dict(allowed_token_ids=tuple(range(100, 140))),
    "min_tokens": dict(min_tokens=12, ignore_eos=False, stop_token_ids=(301,)),
    "everything": dict(presence_penalty=0.4, repetition_penalty=1.3, logit_bias=((7, 2.5),),
                       allowed_token_ids=tuple(range(0, 300, 2))),
}


def _reference(logits: np.ndarray, prompt: list[int], output: list[int], p: SamplingParams) -> np.ndarray:
    """vLLM's processors over the whole vocabulary, one at a time (sampler.py apply_penalties & co)."""
    x = logits.astype(np.float32).copy()
    for t, b in p.logit_bias:
        x[t] += np.float32(b)
    seen = np.zeros(len(x), bool)
    seen[prompt + output] = True
    x = np.where(seen & (x > 0), x / np.float32(p.repetition_penalty),
                 np.where(seen, x * np.float32(p.repetition_penalty), x)).astype(np.float32)
    counts = np.bincount(output, minlength=len(x)).astype(np.float32)
    return x - (np.float32(p.frequency_penalty) * counts + np.float32(p.presence_penalty) * (counts > 0))


@pytest.mark.parametrize("seed", range(5))
def test_edits_equal_the_dense_reference(seed):
    rng = np.random.default_rng(seed)
    p = SamplingParams(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
                       repetition_penalty=rng.uniform(0.3, 2), logit_bias=((3, 4.0), (11, -7.5)))
    prompt, output = rng.integers(0, VOCAB, 20).tolist(), rng.integers(0, VOCAB, 30).tolist()
    drafts = rng.integers(0, VOCAB, 3).tolist()
    proc = Processors(p, prompt, VOCAB, frozenset(), [])
    proc.sync(output[:10])
    proc.sync(output)      # counts follow the committed output in steps
    logits = rng.normal(0, 3, VOCAB).astype(np.float32)
    for i in range(len(drafts) + 1):     # verify row i: the drafts before it count as output
        got = apply_edits(logits, *proc.row_edits(drafts[:i]))
        want = _reference(logits, prompt, output + drafts[:i], p)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def test_masks_ban_what_they_name():
    p = SamplingParams(allowed_token_ids=(1, 2, 3, 40, 41), min_tokens=3)
    proc = Processors(p, [0], 64, frozenset({2}), [[40], [7, 8, 41]])
    row = np.full(2, -1, np.int32)
    proc.mask_row(row, [7], [8])        # output ends in 7 8: bad word 7 8 41 bans 41
    allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
    assert allowed.tolist() == [1, 3]    # 2: a stop id before min_tokens; 40: a bad word; 41: its word's end
    row = np.full(2, -1, np.int32)
    proc.mask_row(row, [7, 1, 1], [])
    assert np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist() == [1, 2, 3, 41]


@pytest.fixture(scope="module")
def outputs(engine_dirs):
    """Per case: plain outputs with the processors, and without any."""
    plain = LLM(engine_dirs[KIND], RuntimeConfig(speculative=False))
    ids = lambda p: [r.token_ids for r in plain.generate(PROMPTS, p)]  # noqa: E731
    return {"none": ids(BASE), **{name: ids(replace(BASE, **kw)) for name, kw in CASES.items()}}


@pytest.mark.parametrize("case", CASES)
def test_each_processor_changes_the_output_as_documented(outputs, case):
    out, kw = outputs[case], CASES[case]
    assert out != outputs["none"]
    flat = [t for o in out for t in o]
    if case == "allowed_token_ids":
        assert set(flat) <= set(kw["allowed_token_ids"])
    if case == "logit_bias":
        assert 6 not in flat and flat.count(5) > len(flat) // 2
    if case == "min_tokens":
        assert all(len(o) >= 12 and 301 not in o[:12] for o in out)
    if case in ("presence", "frequency", "repetition"):   # fewer repeats than without the penalty
        repeats = lambda outs: sum(len(o) - len(set(o)) for o in outs)  # noqa: E731
        assert repeats(out) < repeats(outputs["none"])


@pytest.mark.parametrize("drafter", ["oracle", "wrong", "random", "prefix:1"])
@pytest.mark.parametrize("batch", [1, 4])
def test_speculative_equals_plain_with_processors(engine_dirs, outputs, monkeypatch, drafter, batch):
    for case, kw in CASES.items():
        plain = outputs[case][:batch]
        install_drafter(monkeypatch, drafter, {f"r{i}": o for i, o in enumerate(plain)}, vocab=VOCAB)
        got, llm = run(engine_dirs[KIND], PROMPTS[:batch], replace(BASE, **kw), RuntimeConfig(adaptive_width=False),
                       stagger=2 if batch > 1 else 0)
        assert [got[i] for i in range(batch)] == plain, case
        seqs = llm.test_sequences
        assert sum(s.metrics.rounds for s in seqs) > 0, case       # verify rounds ran
        # processors alone ride the unified round (one call a round: its verify applies masks and edits)
        assert any(name.startswith("round_") for name in llm.runner.calls), case
        if drafter == "oracle":    # the processed target accepts the processed tokens: the edits are in the graph
            assert all(s.metrics.accepted == s.metrics.drafted > 0 for s in seqs), case


def test_bad_words_are_never_generated(engine_dirs):
    llm = LLM(engine_dirs[KIND])
    free = llm.generate(PROMPTS, BASE)
    tok = llm.tokenizer
    words = sorted({tok.decode([t]) for r in free for t in r.token_ids[:6] if tok.decode([t]).strip()})
    banned = tuple(words[:3])
    out = llm.generate(PROMPTS, replace(BASE, bad_words=banned))
    ids = {tuple(w) for w in llm.bad_word_ids(replace(BASE, bad_words=banned))}
    assert [r.token_ids for r in out] != [r.token_ids for r in free]
    for r in out:
        for w in ids:
            assert not any(tuple(r.token_ids[i : i + len(w)]) == w for i in range(len(r.token_ids)))
    plain = LLM(engine_dirs[KIND], RuntimeConfig(speculative=False)).generate(PROMPTS, replace(BASE, bad_words=banned))
    assert [r.token_ids for r in plain] == [r.token_ids for r in out]


def test_filters_that_leave_no_token_are_refused_naming_the_field(engine_dirs):
    """allowed_token_ids all banned by bad_words, or only stop ids while min_tokens bans them: no token
    could be generated (the engine would take a forbidden one: an EOS that ends the answer at once)."""
    llm = LLM(engine_dirs[KIND])
    tok = llm.tokenizer
    word = next(w for w in (tok.decode([t]) for t in range(3, VOCAB)) if w.strip() and w == w.lstrip()
                and len(tok.encode(w, add_special_tokens=False).ids) == 1)
    single = tok.encode(word, add_special_tokens=False).ids[0]
    with pytest.raises(ValueError, match="allowed_token_ids: every id is banned by bad_words") as e:
        llm.add_request(PROMPTS[0], replace(BASE, allowed_token_ids=(single,), bad_words=(word,)))
    assert e.value.param == "allowed_token_ids"
    stop = replace(BASE, allowed_token_ids=(301, 7), stop_token_ids=(301, 7), min_tokens=3)
    with pytest.raises(ValueError, match=r"min_tokens \(3\) bans EOS and the stop ids") as e:
        llm.add_request(PROMPTS[0], stop)
    assert e.value.param == "min_tokens"
    ok = llm.generate([PROMPTS[0]], replace(stop, allowed_token_ids=(301, 7, 9)))[0]   # 9 is left
    assert ok.token_ids[:3] == [9, 9, 9]


@pytest.mark.parametrize("speculative", [True, False])
def test_filters_that_leave_no_token_after_a_prefix_refuse_the_request_there(engine_dirs, speculative):
    """allowed_token_ids (a) with the bad word "aaa": a, a, then nothing is allowed (a multi-token bad
    word bans a after "aa"). Refused at position 2 naming both, with speculation as without (there a
    verify's second row: the round takes a token in it, and the engine's output step refuses it);
    before, the engine took token 0 there."""
    llm = LLM(engine_dirs[KIND], RuntimeConfig(adaptive_width=False))
    tok = llm.tokenizer
    a = next(t for t in range(3, VOCAB) if tok.decode([t]).strip() and tok.decode([t]) == tok.decode([t]).lstrip()
             and tok.encode(tok.decode([t]) * 3, add_special_tokens=False).ids == [t, t, t])
    params = replace(BASE, allowed_token_ids=(a,), bad_words=(tok.decode([a]) * 3,), speculative=speculative)
    with pytest.raises(ValueError, match="position 2 no token is allowed by allowed_token_ids and bad_words") as e:
        llm.generate([PROMPTS[0]], params)
    assert e.value.param == "allowed_token_ids"
    ok = llm.generate([PROMPTS[1]], replace(params, allowed_token_ids=(a, 9)))[0].token_ids    # 9 is left
    assert len(ok) == BASE.max_tokens and set(ok) <= {a, 9} and (a, a, a) not in set(zip(ok, ok[1:], ok[2:]))


@pytest.mark.parametrize("drafter", ["oracle", "random"])
def test_sampled_with_min_p_and_penalties_speculative_equals_plain(engine_dirs, monkeypatch, drafter):
    p = SamplingParams(max_tokens=20, temperature=1.0, min_p=0.2, presence_penalty=0.8, seed=77, ignore_eos=True)
    plain = LLM(engine_dirs[KIND], RuntimeConfig(speculative=False))
    want = [r.token_ids for r in plain.generate(PROMPTS, p)]
    no_min_p = [r.token_ids for r in plain.generate(PROMPTS, replace(p, min_p=0.0))]
    assert want != no_min_p
    install_drafter(monkeypatch, drafter, {f"r{i}": o for i, o in enumerate(want)}, vocab=VOCAB)
    got, llm = run(engine_dirs[KIND], PROMPTS, p, RuntimeConfig(adaptive_width=False))
    assert [got[i] for i in range(len(PROMPTS))] == want
    if drafter == "oracle":
        assert all(s.metrics.accepted == s.metrics.drafted > 0 for s in llm.test_sequences)


def test_the_heads_draft_under_the_edits_in_multi_call_rounds(engine_dirs):
    """A bias that makes one token every answer: the heads draft under the same edits (multi-call
    rounds: the re-anchor's head 0 and each draft step), so every draft is that token and accepted;
    drafting ignorant of the bias would propose the heads' own argmax and be rejected."""
    p = replace(BASE, logit_bias=((77, 60.0),))
    llm = LLM(engine_dirs[KIND], RuntimeConfig(adaptive_width=False, spec_k=3, round="multi"))
    out = llm.generate(PROMPTS[:2], p)
    assert all(set(r.token_ids) == {77} for r in out)
    assert all(r.metrics.drafted > 0 and r.metrics.accepted == r.metrics.drafted for r in out)
