"""The official `openai` client with every request parameter tandem takes, at once, against a live
server drafting with its MTP heads: the client parses every answer into its types, and the answer is
the offline plain-decoding pipeline's with the same settings (text, token count, logprobs to 1e-4),
streamed or not. Parameters that change the answer are each tested on their own in
test_request_fields.py, test_server_logprobs.py and test_server_choices.py."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.pipeline.sampling_params import SamplingParams
from tandem.server.chat_template import ChatTemplate

openai = pytest.importorskip("openai")
PROMPT = [9, 120, 77, 301, 15, 2, 88]
# vLLM's extension fields, as a vLLM user sends them through the client's extra_body
VLLM_FIELDS = {"top_k": 50, "min_p": 0.0, "repetition_penalty": 1.3, "min_tokens": 4, "stop_token_ids": [3],
               "include_stop_str_in_output": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
               "bad_words": ["zzzz"], "allowed_token_ids": list(range(0, 300)), "ignore_eos": True, "spec_k": 3}
OFFLINE = dict(top_k=50, repetition_penalty=1.3, min_tokens=4, stop_token_ids=(3,), bad_words=("zzzz",),
               allowed_token_ids=tuple(range(0, 300)), ignore_eos=True, presence_penalty=0.4, frequency_penalty=0.6,
               logit_bias=((17, 3.0), (33, -5.0)), stop=("\n\n\n",))


def _same_logprobs(got: list[float], want) -> None:
    np.testing.assert_allclose(got, [w.logprob for w in want], atol=1e-4)


def test_completions_with_every_parameter(client, plain):
    want = plain.generate([PROMPT], SamplingParams(max_tokens=12, logprobs=2, prompt_logprobs=2, seed=7,
                                                   **OFFLINE))[0]
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, top_p=1.0, seed=7, n=1, best_of=1,
              stop=["\n\n\n"], presence_penalty=0.4, frequency_penalty=0.6, logit_bias={"17": 3, "33": -5},
              logprobs=2, echo=True, user="test-user", extra_body={**VLLM_FIELDS, "prompt_logprobs": 2})
    r = client.completions.create(**kw)
    choice = r.choices[0]
    assert choice.text == plain.tokenizer.decode(PROMPT) + want.text
    assert r.usage.completion_tokens == len(want.token_ids) and r.usage.prompt_tokens == len(PROMPT)
    assert choice.logprobs.token_logprobs[0] is None
    _same_logprobs(choice.logprobs.token_logprobs[1:], want.prompt_logprobs + want.logprobs)
    assert all(t < 300 for t in want.token_ids) and len(want.token_ids) == 12
    streamed = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    assert streamed[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_with_every_parameter(client, plain, engine_dirs):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def f(x):"}]
    prompt = ChatTemplate.from_engine_dir(engine_dirs["qwen3_5_mtp3"]).render(messages)
    want = plain.generate([prompt], SamplingParams(max_tokens=10, logprobs=3, seed=11, **OFFLINE))[0]
    kw = dict(model="tiny", messages=messages, max_completion_tokens=10, max_tokens=99, temperature=0, top_p=1.0,
              seed=11, n=1, stop=["\n\n\n"], presence_penalty=0.4, frequency_penalty=0.6,
              logit_bias={"17": 3, "33": -5}, logprobs=True, top_logprobs=3, user="test-user",
              parallel_tool_calls=True, response_format={"type": "text"},
              extra_body={**VLLM_FIELDS, "add_generation_prompt": True, "chat_template_kwargs": {}})
    r = client.chat.completions.create(**kw)
    msg, content = r.choices[0].message, r.choices[0].logprobs.content
    assert msg.content == want.text and r.usage.completion_tokens == len(want.token_ids) == 10
    _same_logprobs([e.logprob for e in content], want.logprobs)
    assert all(len(e.top_logprobs) == 3 for e in content)
    streamed = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == msg.content
    _same_logprobs([e.logprob for c in streamed if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content], want.logprobs)
    assert streamed[-1].usage.completion_tokens == 10


def test_sampled_choices_are_reproducible_through_the_client(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.9, top_p=0.9, seed=5, n=3,
              extra_body={"ignore_eos": True, "min_p": 0.05})
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1 and [c.index for c in first.choices] == [0, 1, 2]
    best = client.completions.create(**{**kw, "n": 1, "best_of": 3})
    assert best.usage.completion_tokens == 24 and len(best.choices) == 1
