"""/tokenize and /detokenize in vLLM's shape: a prompt's ids are the ones a completion reads, a
chat's are the ones a chat completion reads (its usage.prompt_tokens), ids decode back to the text;
bad bodies are a 400 naming the field, and the API key guards them as it guards /v1/*."""

from __future__ import annotations

import json

import httpx
import pytest

from .test_server import Live

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]


def post(live, path: str, body: dict, **kw) -> httpx.Response:
    """`body` as JSON with \\u escapes (a lone surrogate is sent as the escape a client would send)."""
    return httpx.post(f"{live.url}{path}", content=json.dumps(body), timeout=30,
                      headers={"content-type": "application/json", **kw.pop("headers", {})}, **kw)


def test_prompt_ids_are_what_a_completion_reads(live):
    r = post(live, "/tokenize", {"model": "tiny", "prompt": "hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == live.app.state.serve_loop.llm.max_seq_len
    assert len(r["token_strs"]) == r["count"] and all(isinstance(s, str) for s in r["token_strs"])
    done = post(live, "/v1/completions", {"model": "tiny", "prompt": "hello world", "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == r["count"]
    assert post(live, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "hello world"}
    assert post(live, "/tokenize", {"prompt": "hello world"}).json()["token_strs"] is None


def test_chat_ids_are_what_a_chat_completion_reads(live):
    r = post(live, "/tokenize", {"messages": CHAT}).json()
    done = post(live, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 1}).json()
    assert r["count"] == done["usage"]["prompt_tokens"]
    text = post(live, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"]
    assert "be brief" in text and "def add(a, b):" in text
    bare = post(live, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["count"] < r["count"] and r["tokens"][:bare["count"]] == bare["tokens"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi", "name": "\udfff"}]}, "messages[0].name"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens[1]"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_bodies_are_a_400_naming_the_field(live, path, body, param):
    r = post(live, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_wrong_model_and_api_key(engine_dirs):
    with Live(engine_dirs["qwen3_5_mtp3"], api_key="k") as server:
        assert post(server, "/tokenize", {"prompt": "x"}).status_code == 401
        key = {"authorization": "Bearer k"}
        assert post(server, "/tokenize", {"prompt": "x"}, headers=key).status_code == 200
        assert post(server, "/detokenize", {"tokens": [1]}, headers=key).status_code == 200
        assert post(server, "/tokenize", {"prompt": "x", "model": "other"}, headers=key).status_code == 404
