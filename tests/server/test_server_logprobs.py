"""Logprobs through the HTTP API, asked for with the openai client: chat's `logprobs`/`top_logprobs`,
completions' `logprobs` N with `echo`, vLLM's `prompt_logprobs`, streamed or not; and
`include_stop_str_in_output`. The numbers are the offline pipeline's, in OpenAI's shapes."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.pipeline.sampling_params import SamplingParams

PROMPT = [9, 120, 77, 301, 15, 2, 88]
EXTRA = {"ignore_eos": True, "temperature": 0.0}   # (the server samples at temperature 1 by default)


def test_chat_logprobs_in_openai_shape_streamed_or_not(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "def f(x):"}],
                                       max_completion_tokens=10, logprobs=True, top_logprobs=3, temperature=0,
                                       extra_body=EXTRA)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 10
    text = b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace")
    assert text == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
    streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "def f(x):"}],
                                              max_completion_tokens=10, logprobs=True, top_logprobs=3, stream=True,
                                              temperature=0, extra_body=EXTRA)
    pieces = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in pieces] == [e.token for e in content]    # (verify rows or steps: equal to 1e-4)
    np.testing.assert_allclose([e.logprob for e in pieces], [e.logprob for e in content], atol=1e-4)


def test_completion_logprobs_with_echo(client, plain):
    want = plain.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=2))[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, logprobs=2, echo=True, extra_body=EXTRA)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT) + 8
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None      # nothing scores the first token
    got = np.array(lp.token_logprobs[1:], dtype=float)
    np.testing.assert_allclose(got, [e.logprob for e in want.prompt_logprobs + want.logprobs], atol=1e-4)
    assert r.choices[0].text == plain.tokenizer.decode(PROMPT) + want.text
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])

    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, logprobs=2, echo=True,
                                         stream=True, extra_body=EXTRA)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == r.choices[0].text
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_prompt_logprobs_in_vllm_shape(client, plain):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 1})
    scored = r.choices[0].model_extra["prompt_logprobs"]
    assert len(scored) == len(PROMPT) and scored[0] is None
    want = plain.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=1))[0].prompt_logprobs
    for entry, token, w in zip(scored[1:], PROMPT[1:], want):
        assert str(token) in entry and entry[str(token)]["logprob"] == pytest.approx(w.logprob, abs=1e-4)
        assert entry[str(token)]["rank"] == w.rank
        assert min(e["rank"] for e in entry.values()) == 1


def test_include_stop_str_in_output(client, plain):
    free = plain.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    cut = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, stop=[stop], extra_body=EXTRA)
    kept = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, stop=[stop],
                                     extra_body={**EXTRA, "include_stop_str_in_output": True})
    head = free[: free.index(stop)]
    assert cut.choices[0].text == head and cut.choices[0].finish_reason == "stop"
    assert kept.choices[0].text == head + stop and kept.choices[0].finish_reason == "stop"
