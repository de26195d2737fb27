"""Every request field is honoured or refused: unknown fields and values out of range are a 400
naming the field (unless the server allows extra fields), and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from .test_server import Live

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def live(engine_dirs):
    with Live(engine_dirs["qwen3_5_mtp3"]) as server:
        yield server


def _body(**fields) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2, **fields}).encode()


def _chat(**fields) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                       **fields}).encode()


# (path, body, the field the error must name, a piece of its message)
REFUSED = [
    (COMPLETIONS, _body(frobnicate=1), "frobnicate", "not a field"),
    (CHAT, _chat(frobnicate={"a": 1}), "frobnicate", "not a field"),
    (CHAT, json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi", "colour": "red"}]}).encode(),
     "messages[0].colour", "not a field"),
    (COMPLETIONS, _body(stream=True, stream_options={"include_usage": True, "extra": 1}), "stream_options.extra",
     "not a field"),
    (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f", "bogus": 1}}]), "tools[0].function.bogus",
     "not a field"),
    (CHAT, _chat(logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal to 20"),
    (COMPLETIONS, _body(logprobs=21), "logprobs", "less than or equal to 20"),
    (COMPLETIONS, _body(prompt_logprobs=-1), "prompt_logprobs", "greater than or equal to 0"),
    (COMPLETIONS, _body(presence_penalty=2.5), "presence_penalty", "less than or equal to 2"),
    (COMPLETIONS, _body(frequency_penalty=-3), "frequency_penalty", "greater than or equal to -2"),
    (COMPLETIONS, _body(repetition_penalty=0), "repetition_penalty", "greater than 0"),
    (COMPLETIONS, _body(min_p=1.5), "min_p", "less than or equal to 1"),
    (COMPLETIONS, _body(min_tokens=-1), "min_tokens", "greater than or equal to 0"),
    (COMPLETIONS, _body(n=0), "n", "greater than or equal to 1"),
    (COMPLETIONS, _body(best_of=0), "best_of", "greater than or equal to 1"),
    (COMPLETIONS, _body(top_k=-2), "top_k", "greater than or equal to -1"),
    (COMPLETIONS, _body(suffix="tail"), "suffix", "not supported"),
    (COMPLETIONS, _body(logit_bias={"5": "high"}), "logit_bias.5", "number"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', None, "NaN"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "x", "top_p": Infinity}', None, "Infinity"),
    (COMPLETIONS, '{"model": "tiny", "prompt": "x"}'.encode("utf-16"), None, "not UTF-8"),
    (CHAT, _chat(top_logprobs=2), "top_logprobs", "needs logprobs"),
    (CHAT, _chat(messages=[{"role": "assistant", "tool_calls": "abc"}]), "messages[0].tool_calls", "list"),
    (CHAT, _chat(messages=[{"role": "assistant", "tool_calls": [1, 2]}]), "messages[0].tool_calls[0]", ""),
    (CHAT, _chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c"}]}]), "messages[0].tool_calls[0].function",
     "required"),
    (CHAT, _chat(messages=[{"role": "user", "content": "x", "name": "a\ud800"}]), "messages[0].name",
     "not valid Unicode"),
]


def test_unknown_and_out_of_range_fields_are_400s_naming_the_field(live):
    failures = []
    with httpx.Client(base_url=live.url, timeout=30) as h:
        for path, body, field, piece in REFUSED:
            r = h.post(path, content=body, headers={"content-type": "application/json"})
            err = r.json().get("error", {})
            if r.status_code != 400 or err.get("param") != field or piece not in err.get("message", ""):
                failures.append(f"{body[:90]!r}: {r.status_code} {r.text[:240]}")
        ok = h.post(COMPLETIONS, content=_body(max_tokens=3, ignore_eos=True),
                    headers={"content-type": "application/json"})
    assert len(REFUSED) >= 20
    assert not failures, "\n".join(failures)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3   # still serving


def test_allow_extra_fields_accepts_and_ignores_them(engine_dirs):
    with Live(engine_dirs["qwen3_5_mtp3"], allow_extra_fields=True) as server:
        r = httpx.post(f"{server.url}{COMPLETIONS}", content=_body(frobnicate=1, max_tokens=3, ignore_eos=True),
                       headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_max_completion_tokens_wins_over_max_tokens(live):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
            "max_completion_tokens": 4, "ignore_eos": True}
    r = httpx.post(f"{live.url}{CHAT}", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    del body["max_tokens"]
    r = httpx.post(f"{live.url}{CHAT}", json=body, timeout=30)
    assert r.json()["usage"]["completion_tokens"] == 4
