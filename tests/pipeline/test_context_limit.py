"""The context length is max_seq_len: prompt + max_tokens may fill it exactly, speculative or not
(a round that would write past the block table's end drafts less or steps plainly), and one token
more is refused saying what the limit is and how to raise it."""

from __future__ import annotations

import pytest

from tandem.pipeline.llm import LLM, RequestError, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams

from ..pipeline_fixtures import OPTIONS


@pytest.fixture(scope="module")
def llms(engine_dirs):
    # spec_k fixed: drafting stays on whatever the random heads' acceptance (no adaptive verdict)
    return {spec: LLM(engine_dirs["qwen3_5_mtp3"], RuntimeConfig(speculative=spec, spec_k=3 if spec else None))
            for spec in (True, False)}


def _prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 300 + 5 for i in range(n)]


def test_a_request_may_fill_max_seq_len_exactly_and_speculative_greedy_stays_exact(llms):
    prompt = _prompt(OPTIONS.max_seq_len - 12)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    spec, plain = (llms[s].generate([prompt], params)[0] for s in (True, False))
    assert spec.token_ids == plain.token_ids and len(spec.token_ids) == 12 and spec.finish_reason == "length"
    assert spec.metrics.rounds > 0


def test_sampled_rounds_at_the_end_of_the_table_finish_every_token(llms):
    prompt = _prompt(OPTIONS.max_seq_len - 9)
    for seed in range(3):
        params = SamplingParams(max_tokens=9, temperature=1.0, seed=seed, ignore_eos=True)
        out = llms[True].generate([prompt], params)[0]
        assert len(out.token_ids) == 9 and out.finish_reason == "length"
        again = llms[True].generate([prompt], params)[0]
        assert again.token_ids == out.token_ids   # (seeded: the same draws again)


def test_one_token_more_is_refused_naming_the_limit(llms):
    prompt = _prompt(OPTIONS.max_seq_len - 12)
    with pytest.raises(RequestError) as info:
        llms[True].add_request(prompt, SamplingParams(max_tokens=13))
    msg = str(info.value)
    assert f"prompt ({len(prompt)} tokens) + max_tokens (13) = {OPTIONS.max_seq_len + 1} tokens" in msg
    assert f"more than the context length of {OPTIONS.max_seq_len} (the engines' --max-seq-len)" in msg
    assert "rebuild the engines with a larger --max-seq-len" in msg
