"""Speculative decoding gives plain decoding's tokens, text and finish reason under any mix of request
fields: grammars, stop strings and ids, ignore_eos, min_tokens, logit_bias, penalties, bad_words,
allowed_token_ids, logprobs, k and p_min, seeded sampling, several requests in one batch. hypothesis
draws the mixes (derandomized: CI runs the same ones every time); a mix the engine refuses is refused
alike both ways, naming the same field. Drawn this way it found verify rows past a complete grammar
taking any token under ignore_eos, and grammars with token filters that leave no token."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tandem.pipeline.grammar import GrammarSpec
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams

from .test_structured_outputs import CODE_PROMPTS, SCHEMAS, shipped  # noqa: F401 (a fixture)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

GRAMMARS = [GrammarSpec.json_schema(SCHEMAS["nested"]), GrammarSpec.json_schema(True),
            GrammarSpec("regex", r"[a-z_]+\(\w*\):\n    return \d+"), GrammarSpec("regex", "(yes|no)")]
OPTIONAL = {
    "grammar": st.sampled_from(GRAMMARS),
    "ignore_eos": st.booleans(),
    "stop": st.lists(st.sampled_from(["\n", "(", ")", ":", "return", " ="]), min_size=1, max_size=2).map(tuple),
    "stop_token_ids": st.lists(st.integers(3, 300), min_size=1, max_size=3).map(tuple),
    "min_tokens": st.integers(0, 40),
    "logit_bias": st.lists(st.tuples(st.integers(3, 4000), st.floats(-5, 5)), min_size=1, max_size=3).map(tuple),
    "repetition_penalty": st.sampled_from([0.9, 1.1, 1.3]),
    "frequency_penalty": st.floats(-1, 1),
    "presence_penalty": st.floats(-1, 1),
    "bad_words": st.lists(st.sampled_from(["return", "self", " =", "def"]), min_size=1, max_size=2).map(tuple),
    "allowed_token_ids": st.lists(st.integers(0, 4000), min_size=40, max_size=400).map(tuple),
    "logprobs": st.integers(0, 3),
    "k": st.integers(1, 3),
    "p_min": st.floats(0, 0.5),
    "sampled": st.tuples(st.floats(0.3, 1.2), st.integers(0, 999), st.sampled_from([1.0, 0.9, 0.5]),
                         st.sampled_from([0, 5, 50]), st.sampled_from([0.0, 0.05])),
}


@st.composite
def requests(draw) -> SamplingParams:
    fields = draw(st.fixed_dictionaries({"max_tokens": st.integers(1, 40)},
                                        optional={k: v for k, v in OPTIONAL.items()}))
    sampled = fields.pop("sampled", None)
    if sampled is not None:
        fields.update(zip(("temperature", "seed", "top_p", "top_k", "min_p"), sampled))
    return SamplingParams(**fields)


def _run(llm: LLM, prompts: list[str], params: list[SamplingParams]):
    try:
        return [(r.token_ids, r.finish_reason, r.text) for r in llm.generate(prompts, params)]
    except ValueError as e:     # refused (RequestError once it runs): generate aborts its requests
        return ("refused", getattr(e, "param", None), str(e))


@pytest.fixture(scope="module")
def llms(shipped):  # noqa: F811
    return {"fixed": LLM(shipped, RuntimeConfig(adaptive_width=False)), "adaptive": LLM(shipped)}


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(st.tuples(st.sampled_from(CODE_PROMPTS), requests()), min_size=1, max_size=3),
       policy=st.sampled_from(["fixed", "adaptive"]))
def test_speculative_equals_plain_under_any_mix_of_request_fields(llms, batch, policy):
    llm = llms[policy]
    prompts, params = [p for p, _ in batch], [r for _, r in batch]
    spec = _run(llm, prompts, params)
    plain = _run(llm, prompts, [replace(r, speculative=False) for r in params])
    assert spec == plain, params
