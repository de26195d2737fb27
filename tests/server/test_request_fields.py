"""Every request field is honoured or refused: unknown fields and values out of range are a 400
naming the field (unless the server allows extra fields), and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from .test_server import Live

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


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
    (CHAT, _chat(logprobs=True, top_logprobs=21), "top_logprobs", "above the maximum, 20"),
    (COMPLETIONS, _body(logprobs=21), "logprobs", "above the maximum, 20"),
    (COMPLETIONS, _body(prompt_logprobs=-1), "prompt_logprobs", "below the minimum, 0"),
    (COMPLETIONS, _body(presence_penalty=2.5), "presence_penalty", "above the maximum, 2"),
    (COMPLETIONS, _body(frequency_penalty=-3), "frequency_penalty", "below the minimum, -2"),
    (COMPLETIONS, _body(repetition_penalty=0), "repetition_penalty", "must be more than 0"),
    (COMPLETIONS, _body(min_p=1.5), "min_p", "above the maximum, 1"),
    (COMPLETIONS, _body(min_tokens=-1), "min_tokens", "below the minimum, 0"),
    (COMPLETIONS, _body(n=0), "n", "below the minimum, 1"),
    (COMPLETIONS, _body(best_of=0), "best_of", "below the minimum, 1"),
    (COMPLETIONS, _body(top_k=-2), "top_k", "below the minimum, -1"),
    (COMPLETIONS, _body(suffix="tail"), "suffix", "not supported"),
    (COMPLETIONS, _body(logit_bias={"5": "high"}), "logit_bias.5", "number"),
    (COMPLETIONS, _body(logit_bias={"5": 101}), "logit_bias", "[-100, 100]"),
    (COMPLETIONS, _body(logit_bias={"abc": 1}), "logit_bias", "not a token id"),
    (COMPLETIONS, _body(logit_bias={"384": 1}), "logit_bias", "outside the vocabulary [0, 384)"),
    (CHAT, _chat(allowed_token_ids=[3, 9999]), "allowed_token_ids", "outside the vocabulary"),
    (COMPLETIONS, _body(allowed_token_ids=[]), "allowed_token_ids", "at least 1"),
    (COMPLETIONS, _body(bad_words=[" "]), "bad_words[0]", "empty"),
    (COMPLETIONS, _body(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=2), "min_tokens", "bans EOS"),
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


# malformed bodies of every kind pydantic can refuse, and what the message must quote or say
MALFORMED = [
    (COMPLETIONS, _body(max_tokens="ten"), 'max_tokens: "ten" is not an integer; send a whole number'),
    (COMPLETIONS, _body(max_tokens=2.5), "max_tokens: 2.5 is not an integer; send a whole number"),
    (COMPLETIONS, _body(temperature="hot"), 'temperature: "hot" is not a number; send a number'),
    (COMPLETIONS, _body(stream="yes"), 'stream: "yes" is not true or false; send true or false'),
    (COMPLETIONS, _body(n=0), "n: 0 is below the minimum, 1; send a value of at least 1"),
    (COMPLETIONS, _body(top_p=1.5), "top_p: 1.5 is above the maximum, 1; send a value of at most 1"),
    (CHAT, _chat(messages="hello"), 'messages: "hello" is not a list; send a JSON array'),
    (CHAT, _chat(messages=[]), "messages: it holds 0 item(s), fewer than 1; send at least 1"),
    (CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]),
     'messages[0].role: "wizard" is not one of "system", "user", "assistant", "tool" or "developer"; send one of them'),
    (CHAT, _chat(tools=[{"type": "function"}]), "tools[0].function: this field is required but missing; add it"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "NaN, which is not a JSON number"),
]
PYTHON_WORDS = ("Input should", "Value error", "Error:", "<class", "Field required", "NoneType", "Traceback")


def test_every_malformed_body_is_told_what_was_wrong_and_what_to_send(live):
    with httpx.Client(base_url=live.url, timeout=30) as h:
        for path, body, says in MALFORMED:
            r = h.post(path, content=body, headers={"content-type": "application/json"})
            message = r.json()["error"]["message"]
            assert r.status_code == 400 and says in message, (body, message)
            assert not any(w in message for w in PYTHON_WORDS), message


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


HONOURED = [dict(presence_penalty=1.5), dict(frequency_penalty=1.2), dict(repetition_penalty=1.8),
            dict(logit_bias={"5": 30}), dict(allowed_token_ids=list(range(100, 140))), dict(min_tokens=6),
            dict(bad_words=None), dict(temperature=1.0, min_p=0.3, seed=3)]


@pytest.mark.parametrize("fields", HONOURED, ids=lambda f: next(iter(f)))
def test_sampling_fields_change_the_answer_as_offline(live, fields):
    """The server's answer equals the offline pipeline's with the same settings, and differs from the
    answer without the field on at least one of the prompts."""
    from tandem.pipeline.sampling_params import SamplingParams

    if "bad_words" in fields:    # ban a word the model writes without the ban (one that is its own token)
        tok = LLM_plain(live).tokenizer
        first = LLM_plain(live).generate([[9, 120, 77, 301, 15, 2, 88]], SamplingParams(max_tokens=20))[0]
        fields = {"bad_words": [next(tok.decode([t]) for t in first.token_ids
                                     if tok.decode([t]).strip() and tok.encode(tok.decode([t])).ids == [t])]}
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in fields.items()}
    if "logit_bias" in kw:
        kw["logit_bias"] = tuple((int(k), v) for k, v in kw["logit_bias"].items())
    base = {"temperature": 0.0, "ignore_eos": "min_tokens" not in fields, "max_tokens": 20}
    changed = False
    for prompt in ([9, 120, 77, 301, 15, 2, 88], [5, 17, 33, 200, 7], [44, 44, 44]):
        r = httpx.post(f"{live.url}{COMPLETIONS}", json={"model": "tiny", "prompt": prompt, **base, **fields},
                       timeout=60).json()
        offline = LLM_plain(live).generate([prompt], SamplingParams(**{**base, **kw}))[0].text
        sampling = {k: v for k, v in kw.items() if k in ("temperature", "seed")}
        without = LLM_plain(live).generate([prompt], SamplingParams(**{**base, **sampling}))[0].text
        assert r["choices"][0]["text"] == offline
        changed |= offline != without
    assert changed


def LLM_plain(live):  # noqa: N802 - a plain-decoding twin of the server's pipeline, made once
    from tandem.pipeline.llm import LLM, RuntimeConfig

    if not hasattr(live, "plain_twin"):
        live.plain_twin = LLM(live.app.state.serve_loop.llm.engine_dir, RuntimeConfig(speculative=False))
    return live.plain_twin


def test_skip_special_tokens_false_writes_them(live):
    """An end token forced by logit_bias (ignore_eos: it does not stop the answer) is in the text with
    skip_special_tokens false and left out by default; echo of a token-id prompt follows the same flag."""
    llm = live.app.state.serve_loop.llm
    eos = llm.desc.eos_token_ids[0]
    written = llm.tokenizer.decode([eos], skip_special_tokens=False)
    assert written
    body = {"model": "tiny", "prompt": [5, eos, 7], "max_tokens": 3, "ignore_eos": True, "temperature": 0,
            "logit_bias": {str(eos): 100}, "echo": True}
    texts = {}
    for skip in (True, False):
        r = httpx.post(f"{live.url}{COMPLETIONS}", json={**body, "skip_special_tokens": skip}, timeout=60)
        assert r.status_code == 200, r.text
        texts[skip] = r.json()["choices"][0]["text"]
    prompt_text = llm.tokenizer.decode([5, eos, 7], skip_special_tokens=False)
    assert texts[False] == prompt_text + written * 3
    assert texts[True] == llm.tokenizer.decode([5, 7]) and written not in texts[True]
