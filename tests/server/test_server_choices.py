"""`n` choices and `best_of` candidates through the HTTP API, asked for with the openai client:
seeded choices differ from each other and come back the same on a repeat, greedy choices are all
the greedy answer, best_of returns the candidates with the highest summed logprob, usage bills
every candidate, and a stream labels each chunk with its choice's index."""

from __future__ import annotations

import httpx
import pytest

from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams
from tandem.server.responses import INT64, candidate_params

from .test_server import Live

PROMPT = [9, 120, 77, 301, 15, 2, 88]


@pytest.fixture(scope="module")
def live(engine_dirs):
    with Live(engine_dirs["qwen3_5_mtp3"], max_queued=8) as server:
        yield server


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
    plain = LLM(engine_dirs["qwen3_5_mtp3"], RuntimeConfig(speculative=False))
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


PROMPTS = [[5, 17, 33], [9, 120, 77, 301], "def f(x):"]


def test_several_prompts_each_get_their_choices(client, plain):
    """A list of prompts (token-id lists, or strings) is answered as vLLM answers it: prompt p's n
    choices at indices p * n .. p * n + n - 1, each the prompt's own answer, echo per prompt, usage
    over every prompt; streamed the same."""
    want = [r.text for r in plain.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))]
    for prompts in (PROMPTS[:2], [PROMPTS[2], "class A:"]):
        r = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, n=2, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        lens = [len(p) if isinstance(p, list) else len(plain.tokenizer.encode(p).ids) for p in prompts]
        assert r.usage.prompt_tokens == sum(lens) and r.usage.completion_tokens == 4 * 6
        answers = [plain.generate([p], SamplingParams(max_tokens=6, ignore_eos=True))[0].text for p in prompts]
        assert [c.text for c in r.choices] == [answers[0], answers[0], answers[1], answers[1]]
    r = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=6, echo=True, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [plain.tokenizer.decode(p) + w for p, w in zip(PROMPTS[:2], want[:2])]
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=6, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts, last = {0: "", 1: ""}, None
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
        last = chunk
    assert texts == {0: want[0], 1: want[1]} and last.usage.prompt_tokens == 7
    best = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=4, n=1, best_of=2, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in best.choices] == [0, 1] and best.usage.completion_tokens == 16


@pytest.mark.parametrize("prompt", [[], [[]], [[1, 2], "x"], [1, "x"], [[1], [True]]])
def test_malformed_prompt_lists_are_400s_saying_what_a_prompt_may_be(live, prompt):
    r = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": prompt}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "a list of token-id lists" in r.json()["error"]["message"]


def test_return_token_ids_whole_and_streamed(client, plain):
    """vLLM's return_token_ids: prompt_token_ids and each choice's token_ids (completions: in the choice;
    chat: beside the choices); streamed, the prompt's with a choice's first chunk and each chunk's own
    new tokens, which join to the answer's."""
    want = plain.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    extra = {"ignore_eos": True, "return_token_ids": True}
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body=extra)
    choice = r.choices[0].model_extra
    assert choice["prompt_token_ids"] == PROMPT and choice["token_ids"] == want.token_ids
    chunks = [c.choices[0].model_extra for c in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True, extra_body=extra) if c.choices]
    assert chunks[0]["prompt_token_ids"] == PROMPT and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == want.token_ids
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                          extra_body=extra)
    ids = chat.model_extra["prompt_token_ids"]
    assert ids == plain.tokenizer.encode(plain_chat_prompt(plain, messages)).ids
    answer = chat.choices[0].model_extra["token_ids"]
    assert len(answer) == 5 and plain.tokenizer.decode(answer) == chat.choices[0].message.content
    events = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                                 stream=True, extra_body=extra))
    assert events[0].model_extra["prompt_token_ids"] == ids
    assert [t for e in events if e.choices for t in e.choices[0].model_extra.get("token_ids") or []] == answer


def plain_chat_prompt(llm, messages) -> str:
    from tandem.server.chat_template import ChatTemplate

    return ChatTemplate.from_engine_dir(llm.engine_dir).render(messages)


def test_continuous_usage_stats_on_every_chunk(client):
    """stream_options.continuous_usage_stats: every chunk carries its choice's usage so far; the counts
    grow to the final usage."""
    for chat in (False, True):
        kw = dict(model="tiny", max_tokens=12, temperature=0, stream=True,
                  stream_options={"include_usage": True, "continuous_usage_stats": True},
                  extra_body={"ignore_eos": True})
        events = list(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw) if chat
                      else client.completions.create(prompt=PROMPT, **kw))
        counts = [e.usage.completion_tokens for e in events if e.choices]
        assert all(e.usage is not None for e in events) and counts == sorted(counts)
        assert counts[-1] == events[-1].usage.completion_tokens == 12
        assert {e.usage.prompt_tokens for e in events} == {events[-1].usage.prompt_tokens}


def test_head_on_the_get_endpoints(live):
    for path in ("/health", "/ready", "/v1/models", "/metrics"):
        r = httpx.head(f"{live.url}{path}", timeout=10)
        assert r.status_code == 200 and r.content == b"", path
