"""One bad request never takes the server down: a live uvicorn on 127.0.0.1.

- every bad input of the issue, and the ones that already passed, in one table: the right 4xx in
  the OpenAI error shape, an innocent stream running alongside unaffected, the server serving after;
- a request that makes engine steps raise fails alone, innocents running with it are unchanged;
- a dead serve-loop thread: /ready and /health 503, and `tandem serve` exits 1;
- a chunked body over the limit is a 413; a non-streamed request whose client hangs up is aborted.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from tandem.pipeline.request_checks import INT64_MAX, INT64_MIN
from tandem.server.app import ServerSettings
from tandem.server.serve_loop import ServeLoop

from .test_server import PROMPTS, Live, _free_port, wait_ready

VOCAB = 384      # the tiny checkpoints' vocabulary (the tokenizer itself has 300 tokens)
MARK = VOCAB - 1  # three of these in one engine row make the injected fault fire


def _body(**fields) -> bytes:
    """A completions body as JSON; ensure_ascii keeps a lone surrogate as its \\u escape."""
    return json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2, **fields}, ensure_ascii=True).encode()


def _chat(content, **fields) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2,
                       **fields}, ensure_ascii=True).encode()


def _stream_text(url: str, prompt: str, max_tokens: int, started: threading.Event | None = None) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text = []
    with httpx.Client(timeout=60) as h, h.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
                if started is not None:
                    started.set()
    return "".join(text)


def _is_openai_error(r: httpx.Response, status: int) -> bool:
    err = r.json().get("error", {})
    return (r.headers["content-type"].startswith("application/json") and isinstance(err.get("message"), str)
            and isinstance(err.get("type"), str) and err.get("code") == status and "param" in err)


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# (name, path, body, expected status, a piece of the error message or param)
TABLE = [
    # text that is not valid Unicode: refused before it reaches the serve-loop thread
    ("surrogate in prompt", COMPLETIONS, _body(prompt="a\ud800b"), 400, "prompt is not valid Unicode"),
    ("surrogate in chat content", CHAT, _chat("a\ud800b"), 400, "messages[0].content is not valid Unicode"),
    ("surrogate in a content part", CHAT, _chat([{"type": "text", "text": "\udfff"}]), 400,
     "messages[0].content[0].text"),
    ("surrogate in stop", COMPLETIONS, _body(stop=["ok", "\ud800"]), 400, "stop[1] is not valid Unicode"),
    ("surrogate in model", COMPLETIONS, _body(model="\ud800"), 400, "model is not valid Unicode"),
    # item 2: token ids and integers the engines cannot take (used to fail every request in flight)
    ("id = vocabulary size", COMPLETIONS, _body(prompt=[VOCAB]), 400, "outside the vocabulary"),
    ("negative id", COMPLETIONS, _body(prompt=[-5000]), 400, "prompt[0]: token id -5000"),
    ("id -1 after a good one", COMPLETIONS, _body(prompt=[100, -1]), 400, "prompt[1]: token id -1"),
    ("id beyond int64", COMPLETIONS, _body(prompt=[2**64]), 400, "prompt[0]"),
    ("top_k beyond int64", COMPLETIONS, _body(top_k=INT64_MAX + 1), 400, "top_k"),
    ("seed beyond int64", COMPLETIONS, _body(seed=2**70), 400, "seed"),
    ("seed below int64", COMPLETIONS, _body(seed=INT64_MIN - 1), 400, "seed"),
    ("max_tokens beyond int64", COMPLETIONS, _body(max_tokens=2**64), 400, "max_tokens"),
    ("spec_k beyond int64", COMPLETIONS, _body(spec_k=2**64), 400, "spec_k"),
    ("n beyond int64", COMPLETIONS, _body(n=2**64), 400, "n"),
    ("empty id list", COMPLETIONS, _body(prompt=[]), 400, "prompt is empty"),
    ("bool as a token id", COMPLETIONS, _body(prompt=[True]), 400, "prompt"),
    # item 7, server parts: strict types, names, documentation endpoints
    ("stream 'yes'", COMPLETIONS, _body(stream="yes"), 400, "stream"),
    ("max_tokens true", COMPLETIONS, _body(max_tokens=True), 400, "max_tokens"),
    ("n '1'", COMPLETIONS, _body(n="1"), 400, "n"),
    ("temperature '0.5'", COMPLETIONS, _body(temperature="0.5"), 400, "temperature"),
    ("echo 1", COMPLETIONS, _body(echo=1), 400, "echo"),
    ("include_usage 'true'", COMPLETIONS, _body(stream=True, stream_options={"include_usage": "true"}), 400,
     "stream_options.include_usage"),
    ("non-ASCII model name", COMPLETIONS, _body(model="modèle-ü"), 404, "model 'modèle-ü' does not exist"),
    ("image content part", CHAT, _chat([{"type": "image_url", "image_url": {"url": "x"}}]), 400, "reads text only"),
    ("/docs off", "GET /docs", None, 404, ""),
    ("/redoc off", "GET /redoc", None, 404, ""),
    ("/openapi.json off", "GET /openapi.json", None, 404, ""),
    # malformed bodies
    ("bad JSON", COMPLETIONS, b"{not json", 400, "json"),
    ("body not an object", COMPLETIONS, b"[1, 2]", 400, "body"),
    ("unknown model", COMPLETIONS, _body(model="nope"), 404, "model 'nope' does not exist"),
    ("max_tokens 'many'", COMPLETIONS, _body(max_tokens="many"), 400, "max_tokens"),
    ("negative max_tokens", COMPLETIONS, _body(max_tokens=-3), 400, "max_tokens"),
    ("prompt a number", COMPLETIONS, _body(prompt=7), 400, "prompt"),
    ("missing prompt", COMPLETIONS, json.dumps({"model": "tiny"}).encode(), 400, "prompt"),
    ("empty text prompt", COMPLETIONS, _body(prompt=""), 400, "prompt is empty"),
    ("huge max_tokens", COMPLETIONS, _body(max_tokens=10**9), 400, "more than the context length of"),
    ("prompt too long", COMPLETIONS, _body(prompt="x " * 2000, max_tokens=8), 400, "more than the context length of"),
    ("temperature 9", COMPLETIONS, _body(temperature=9), 400, "temperature"),
    ("top_p 0", COMPLETIONS, _body(top_p=0), 400, "top_p"),
    ("spec_k 7 (no such width)", COMPLETIONS, _body(spec_k=7), 400, "needs verify width"),
    ("n above best_of", COMPLETIONS, _body(n=2, best_of=1), 400, "best_of=1 must be >= n=2"),
    ("empty messages", CHAT, json.dumps({"model": "tiny", "messages": []}).encode(), 400, "messages"),
    ("unknown role", CHAT, json.dumps({"model": "tiny", "messages": [{"role": "wizard"}]}).encode(), 400, "role"),
    ("content a number", CHAT, _chat(5), 400, "messages[0].content"),
    ("declared body over the limit", COMPLETIONS, _body(prompt="x" * (1 << 20)), 413, "exceeds the limit"),
    # item 7, sampling (fixed in SamplingParams/sampler): answered, not refused
    ("denormal temperature", COMPLETIONS, _body(temperature=5e-324, max_tokens=4, ignore_eos=True), 200, ""),
]


def _send(h: httpx.Client, path: str, body: bytes | None) -> httpx.Response:
    if path.startswith("GET "):
        return h.get(path[4:])
    return h.post(path, content=body, headers={"content-type": "application/json"})


def test_bad_input_table(live):
    innocent = PROMPTS[1]
    alone = _stream_text(live.url, innocent, 48)
    started, during = threading.Event(), {}
    thread = threading.Thread(target=lambda: during.setdefault("text", _stream_text(live.url, innocent, 48, started)))
    thread.start()
    assert started.wait(30)
    failures = []
    h = httpx.Client(base_url=live.url, timeout=30)  # one client: making one costs ~0.1 s (TLS context)
    for name, path, body, status, expect in TABLE:
        r = _send(h, path, body)
        if status == 200:
            ok = r.status_code == 200 and r.json()["choices"][0]["text"] != ""
        else:
            err = r.json().get("error", {}) if r.headers["content-type"].startswith("application/json") else {}
            ok = (r.status_code == status and _is_openai_error(r, status)
                  and expect.lower() in (err.get("message", "") + str(err.get("param"))).lower())
        if not ok:
            failures.append(f"{name}: {r.status_code} {r.text[:200]}")
    h.close()
    thread.join(60)
    print(f"\nbad-input table: {len(TABLE)} cases tried / {len(TABLE) - len(failures)} handled")
    assert not failures, "\n".join(failures)
    assert during["text"] == alone  # the innocent stream ran through the whole table unchanged
    assert httpx.get(f"{live.url}/ready").status_code == 200
    r = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3,
                                                       "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_request_that_makes_steps_raise_fails_alone(live, monkeypatch):
    llm = live.app.state.serve_loop.llm
    prompts = PROMPTS[:3]
    alone = {p: _stream_text(live.url, p, 24) for p in prompts}
    real, raised = llm.runner._call, []

    def faulty(graph, rows, fixed, commits=False):
        if any(list(r.ids).count(MARK) >= 3 for r in rows):
            raised.append(graph)
            raise RuntimeError("injected fault: marker tokens in the batch")
        return real(graph, rows, fixed, commits)

    monkeypatch.setattr(llm.runner, "_call", faulty)

    async def main():
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as h:
            async def stream(prompt, first: asyncio.Event):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                        "stream": True}
                text = []
                async with h.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            text.append(json.loads(line[6:])["choices"][0]["text"])
                            first.set()
                return "".join(text)

            async def plain(prompt):
                r = await h.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 24,
                                                          "temperature": 0, "ignore_eos": True})
                return r.json()["choices"][0]["text"]

            firsts = [asyncio.Event(), asyncio.Event()]
            innocents = [asyncio.create_task(stream(prompts[0], firsts[0])),
                         asyncio.create_task(stream(prompts[1], firsts[1])), asyncio.create_task(plain(prompts[2]))]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 30)  # decoding when it arrives
            culprit = await h.post("/v1/completions", json={"model": "tiny", "prompt": [5, MARK, MARK, MARK, 7],
                                                            "max_tokens": 8})
            return culprit, await asyncio.gather(*innocents)

    culprit, texts = asyncio.run(main())
    assert culprit.status_code == 500 and _is_openai_error(culprit, 500)
    assert culprit.json()["error"]["type"] == "server_error"
    assert "injected fault: marker tokens in the batch" in culprit.json()["error"]["message"]
    assert len(raised) >= 2  # once in the shared batch, once alone
    assert dict(zip(prompts, texts)) == alone
    for _ in range(100):
        if not llm.scheduler.has_work():
            break
        time.sleep(0.02)
    assert not llm.scheduler.has_work() and llm.pages.available == llm.pages.size - 1
    assert httpx.get(f"{live.url}/ready").status_code == 200


def test_a_chunked_body_over_the_limit_is_refused(live):
    def chunks():  # a valid JSON body of 2 MiB, sent without content-length
        yield b'{"model": "tiny", "max_tokens": 2, "prompt": "'
        for _ in range(32):
            yield b"x" * (64 << 10)
        yield b'"}'

    r = httpx.post(f"{live.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413 and _is_openai_error(r, 413) and "exceeds the limit" in r.json()["error"]["message"]
    assert httpx.get(f"{live.url}/ready").status_code == 200


def test_a_non_streamed_request_is_aborted_when_its_client_hangs_up(live, monkeypatch):
    llm = live.app.state.serve_loop.llm
    real = llm.step

    def slow():  # about 10 s for the whole request: it cannot finish by itself within the test
        time.sleep(0.05)
        return real()

    monkeypatch.setattr(llm, "step", slow)
    before = live.metrics().get('tandem_requests_total{"status": "aborted"}', 0)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "speculative": False}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{live.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    for _ in range(60):
        if not llm.scheduler.has_work():
            break
        time.sleep(0.05)
    assert not llm.scheduler.running and not llm.scheduler.waiting
    assert llm.pages.available == llm.pages.size - 1
    assert live.metrics()['tandem_requests_total{"status": "aborted"}'] == before + 1


def _die_on_the_first_request(self):
    if self._commands.qsize():
        raise RuntimeError("injected: the loop's bookkeeping is broken")
    return _REAL_ITERATE(self)


def _broken_reset(self, error):
    raise RuntimeError("injected: the reset is broken too")


_REAL_ITERATE = ServeLoop._iterate


def test_a_dead_engine_thread_is_not_ready_and_fails_requests(engine_dirs, monkeypatch):
    monkeypatch.setattr(ServeLoop, "_iterate", _die_on_the_first_request)
    monkeypatch.setattr(ServeLoop, "_reset", _broken_reset)
    with Live(engine_dirs["qwen3_5_mtp3"]) as server:
        assert httpx.get(f"{server.url}/ready").status_code == 200
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
        assert r.status_code == 500 and _is_openai_error(r, 500) and "serve-loop thread stopped" in r.text
        assert not server.app.state.serve_loop.alive()
        assert httpx.get(f"{server.url}/ready").status_code == 503
        assert httpx.get(f"{server.url}/health").status_code == 503
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
        assert r.status_code == 503 and _is_openai_error(r, 503)


def test_serve_exits_1_when_the_engine_thread_dies(engine_dirs, monkeypatch, capsys):
    from tandem.cli import main

    monkeypatch.setattr(ServeLoop, "_iterate", _die_on_the_first_request)
    monkeypatch.setattr(ServeLoop, "_reset", _broken_reset)
    port, result = _free_port(), {}
    argv = ["serve", str(engine_dirs["qwen3_5_mtp3"]), "--port", str(port), "--model-name", "tiny"]
    thread = threading.Thread(target=lambda: result.setdefault("status", main(argv)), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, pause=0.05)
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
    assert r.status_code == 500 and _is_openai_error(r, 500)
    thread.join(30)
    assert result.get("status") == 1
    assert "exiting with status 1" in capsys.readouterr().err


def test_openapi_off_by_default_and_non_ascii_names(live):
    from tandem.server.app import create_app

    llm = live.app.state.serve_loop.llm  # create_app starts nothing: the serve loop starts with the server
    on = create_app(llm, ServerSettings(model_name="tiny", openapi=True))
    assert (on.openapi_url, on.docs_url, on.redoc_url) == ("/openapi.json", "/docs", "/redoc")
    assert (live.app.openapi_url, live.app.docs_url, live.app.redoc_url) == (None, None, None)
    with pytest.raises(ValueError, match="the model name is not valid Unicode"):
        ServerSettings(model_name="bad\udcff")  # undecodable bytes on a command line arrive as such surrogates
    named = create_app(llm, ServerSettings(model_name="модель-ü"))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(named), base_url="http://t") as h:
            return await h.get("/v1/models"), await h.post("/v1/completions", content=_body(model="\ud800x"))

    models, wrong = asyncio.run(main())
    assert models.json()["data"][0]["id"] == "модель-ü"
    assert wrong.status_code == 400 and _is_openai_error(wrong, 400)
