"""A round's grammar masks, each computed once: the heads' draft steps consume the drafts as they
come and keep each state's mask, the verify rows and the re-anchor reuse them, and a draft
position's masks for every row of a batch are computed together (pipeline/grammar.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.pipeline import grammar as grammar_module
from tandem.pipeline.grammar import GrammarSpec, fill_masks
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams

from .test_structured_outputs import CODE_PROMPTS, SCHEMAS, grammars, shipped  # noqa: F401 (fixtures)

K = 3


def _states(grammars, tok_ids):  # noqa: F811
    """Matchers of the nested schema at several prefixes of a valid answer."""
    spec = GrammarSpec.json_schema(SCHEMAS["nested"])
    out = []
    for n in range(1, len(tok_ids), 3):
        m = grammars.matcher(spec)
        m.sync(tok_ids[:n])
        out.append(m)
    return out


@pytest.fixture
def answer(grammars):  # noqa: F811
    text = '{"user": {"id": 12, "tags": ["ab", "cd"]}, "kind": "add", "score": -3}'
    return grammars.tokenizer.tokenize_str(text)


def test_a_batch_filled_together_equals_each_alone(grammars, answer, monkeypatch):  # noqa: F811
    """fill_masks in the calling thread and over llguidance's thread pool (forced here: this machine
    has too few cores for it to be chosen) give each matcher the mask it computes alone."""
    alone = [m.mask().copy() for m in _states(grammars, answer)]
    for cores in (10**6, 1):            # never parallel; always parallel
        monkeypatch.setattr(grammar_module, "PARALLEL_MIN_CORES", cores)
        grammar_module._executor.cache_clear()
        batch = _states(grammars, answer)
        assert all(m.missing_mask() for m in batch)
        fill_masks(batch)
        assert not any(m.missing_mask() for m in batch)
        assert all((m.mask() == want).all() for m, want in zip(batch, alone))
    grammar_module._executor.cache_clear()


def test_a_round_computes_each_mask_once(shipped, monkeypatch):  # noqa: F811
    """k = 3, multi-call rounds under a nested schema: at most k + 1 masks a round for each row (the
    states after 0..k drafts), where masking each draft step and each verify row anew took 2k + 3."""
    computed = []
    keep = grammar_module.Matcher.keep_mask
    monkeypatch.setattr(grammar_module.Matcher, "keep_mask", lambda self, row: (computed.append(1), keep(self, row)))
    llm = LLM(shipped, RuntimeConfig(adaptive_width=False, prefix_cache=False))
    g = GrammarSpec.json_schema(SCHEMAS["nested"])
    plain = llm.generate(CODE_PROMPTS[:2], SamplingParams(max_tokens=48, grammar=g, speculative=False))
    computed.clear()
    out = llm.generate(CODE_PROMPTS[:2], SamplingParams(max_tokens=48, grammar=g, k=K))
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    rounds = sum(r.metrics.rounds for r in out)
    assert rounds > 4 and len(computed) <= (K + 1) * rounds + 2 * len(out), (len(computed), rounds)
    assert np.mean([r.metrics.accepted for r in out]) > 0
