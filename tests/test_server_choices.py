"""`n` choices and `best_of` candidates through the HTTP API, asked for with the openai client:
seeded choices differ from each other and come back the same on a repeat, greedy choices are all
the greedy answer, best_of returns the candidates with the highest summed logprob, usage bills
every candidate, and a stream labels each chunk with its choice's index."""

from __future__ import annotations

import httpx
import pytest

from tandem.pipeline.llm import LLM, EngineConfig
from tandem.pipeline.sampling_params import SamplingParams
from tandem.server.responses import INT64, candidate_params

from .test_server import Live

PROMPT = [9, 120, 77, 301, 15, 2, 88]


@pytest.fixture(scope="module")
def live(engine_dirs):
    with Live(engine_dirs["qwen3_5_mtp3"], max_queued=8) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_seeded_choices_differ_and_repeat(client):
    ask = dict(model="tiny", prompt=PROMPT, max_tokens=12, n=3, seed=1234, temperature=1.0,
               extra_body={"ignore_eos": True})
    first, again = client.completions.create(**ask), client.completions.create(**ask)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) == 3                                  # three draws, not one answer three times
    assert [c.text for c in again.choices] == texts              # and each reproducible from the seed
    assert first.usage.completion_tokens == 36 and first.usage.prompt_tokens == len(PROMPT)


def test_greedy_choices_are_the_greedy_answer(client, engine_dirs):
    plain = LLM(engine_dirs["qwen3_5_mtp3"], EngineConfig(speculative=False))
    want = plain.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, n=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [want.text] * 2


def test_best_of_returns_the_most_likely_candidates(client, live):
    checked = 0
    for seed in range(7, 12):
        ask = dict(model="tiny", prompt=PROMPT, max_tokens=8, seed=seed, temperature=1.0,
                   extra_body={"ignore_eos": True})
        every = client.completions.create(n=4, logprobs=0, **ask)      # the same four candidates, all returned
        score = {c.text: sum(c.logprobs.token_logprobs) for c in every.choices}
        ranked = sorted(score, key=score.get, reverse=True)[:2]
        best = client.completions.create(n=2, best_of=4, **ask)
        assert [c.text for c in best.choices] == ranked
        assert best.choices[0].logprobs is None                          # ranked by logprobs nobody asked to see
        assert best.usage.completion_tokens == 32                        # every candidate is billed
        checked += ranked != [c.text for c in every.choices[:2]]       # (a seed whose first two are not the best)
    assert checked
    refused = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "n": 2,
                                                              "best_of": 4, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "best_of"


def test_streamed_choices_carry_their_index(client):
    ask = dict(model="tiny", messages=[{"role": "user", "content": "def f(x):"}], max_completion_tokens=6,
               n=3, seed=5, temperature=1.0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**ask)
    texts, finish = ["", "", ""], [None] * 3
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ask):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 18
    assert texts == [c.message.content for c in whole.choices]
    assert finish == ["length"] * 3


def test_too_many_candidates_refused(live):
    for body, field in (({"n": 9}, "n"), ({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 9}, "best_of")):
        r = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": "x", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}) \
        .status_code == 200


def test_candidate_seeds_wrap_into_int64():
    params = SamplingParams(seed=INT64 - 2)
    seeds = [p.seed for p in candidate_params(params, 3, 3)]
    assert seeds == [INT64 - 2, INT64 - 1, -INT64]
    assert all(p.logprobs == 0 for p in candidate_params(SamplingParams(), 1, 2))   # best_of ranks by them
