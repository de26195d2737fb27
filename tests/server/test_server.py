"""The HTTP server against a live uvicorn on 127.0.0.1, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from tandem.pipeline.llm import LLM
from tandem.pipeline.sampling_params import SamplingParams
from tandem.server.app import ServerSettings
from tandem.server.chat_template import ChatTemplate
from tandem.server.serve import build, uvicorn_config

openai = pytest.importorskip("openai")

PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):", "class Cache:"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, tries: int = 300, pause: float = 0.1) -> None:
    """Poll /ready of a server started in another thread or process until it answers 200."""
    for _ in range(tries):
        try:
            if httpx.get(f"{url}/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(pause)


class Live:
    def __init__(self, engine_dir, **settings):
        self.app = build(engine_dir, ServerSettings(model_name="tiny", **settings))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(self.app, "127.0.0.1", self.port))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)

    def metrics(self) -> dict:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics").text
        return {s.name + json.dumps(s.labels, sort_keys=True) if s.labels else s.name: s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture(scope="module")
def offline(engine_dirs):
    llm = LLM(engine_dirs["qwen3_5_mtp3"])
    template = ChatTemplate.from_engine_dir(engine_dirs["qwen3_5_mtp3"])

    def run(prompt, max_tokens=16, chat=False):
        if chat:
            prompt = template.render([{"role": "user", "content": prompt}])
        return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]

    return run


def client(live, **kw):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def test_completions_match_offline_greedy(live, offline):
    c = client(live)
    for prompt in PROMPTS[:2]:
        ref = offline(prompt)
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == len(ref.token_ids) == 16
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        streamed = c.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(streamed)
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
        assert chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices


def test_chat_matches_offline_greedy(live, offline):
    c = client(live)
    ref = offline("hello", chat=True)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=16,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=16,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == ref.text


def test_stream_interval_merges_outputs_and_an_unstreamed_request_gets_one(engine_dirs, offline, monkeypatch):
    """--stream-interval N: after the first output with a token (sent at once: the time to first token), a
    streamed request's outputs are merged until they hold N tokens; a request that is not streamed
    is handed its final output only. The text is the same either way."""
    from tandem.pipeline.outputs import StepOutput
    from tandem.server import serve_loop

    sent, real = [], serve_loop._send
    monkeypatch.setattr(serve_loop, "_send", lambda req, item: (sent.append((req.id, item)), real(req, item))[1])
    ref = offline(PROMPTS[0], max_tokens=32)
    with Live(engine_dirs["qwen3_5_mtp3"], stream_interval=8) as live:
        c = client(live)
        r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=32, temperature=0,
                                 extra_body={"ignore_eos": True})
        streamed = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=32, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
        text = "".join(ch.choices[0].text for ch in streamed if ch.choices)
    assert r.choices[0].text == ref.text and text == ref.text
    by_request: dict[str, list] = {}
    for rid, item in sent:
        if isinstance(item, StepOutput):
            by_request.setdefault(rid, []).append(item)
    unstreamed, streamed_outputs = by_request.values()
    assert len(unstreamed) == 1 and unstreamed[0].finished and len(unstreamed[0].token_ids) == 32
    tokens = [len(o.token_ids) for o in streamed_outputs]
    assert sum(tokens) == 32 and streamed_outputs[-1].finished and len(tokens) >= 3
    # the first output with a token at once (a prefill and a round: at most 1 + k + 1 = 5 tokens), then 8 or more
    assert 0 < tokens[0] < 8 and all(n >= 8 for n in tokens[1:-1]), tokens


def test_32_concurrent_streams_each_match_offline(live, offline):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(32)]
    expected = {p: offline(p, max_tokens=10).text for p in prompts}

    async def one(c, prompt):
        stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
        return prompt, "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def main():
        c = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(c, p) for p in prompts))

    results = asyncio.run(main())
    assert len(results) == 32 and all(text == expected[p] for p, text in results)


def test_disconnect_mid_stream_frees_the_pages(live):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as h, h.stream("POST", f"{live.url}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # one chunk, then hang up
    for _ in range(100):
        m = live.metrics()
        if m["tandem_kv_pages_in_use"] == 0 and m["tandem_running_requests"] == 0:
            break
        time.sleep(0.05)
    assert m["tandem_kv_pages_in_use"] == 0 and m["tandem_running_requests"] == 0
    assert m['tandem_kv_pages_in_use_by_group{"group": "full"}'] == 0
    assert m['tandem_requests_total{"status": "aborted"}'] >= 1
    r = client(live).completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4


BAD = [
    ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": 7}, 400, "prompt"),
    ({"model": "nope", "prompt": "x"}, 404, "model 'nope' does not exist"),
    ({"model": "tiny", "prompt": "x", "n": 2, "best_of": 1}, 400, "best_of=1 must be >= n=2"),
    ({"model": "tiny", "prompt": "x " * 2000, "max_tokens": 8}, 400, "more than the context length of"),
    ({"model": "tiny", "prompt": "x", "temperature": 9}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "spec_k": 7}, 400, "needs verify width"),
]


@pytest.mark.parametrize("body,status,message", BAD)
def test_bad_inputs(live, body, status, message):
    r = httpx.post(f"{live.url}/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"] + str(err.get("param")) and err["type"]


def test_malformed_json_and_chat_errors(live):
    r = httpx.post(f"{live.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{live.url}/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert r.status_code == 400
    r = httpx.post(f"{live.url}/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "wizard"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]


def test_health_ready_models_and_metrics_move(live):
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{live.url}/ready").status_code == 200
    models = client(live).models.list()
    assert [x.id for x in models.data] == ["tiny"]
    before = live.metrics()
    client(live).completions.create(model="tiny", prompt="a", max_tokens=5, extra_body={"ignore_eos": True})
    after = live.metrics()
    assert after["tandem_generation_tokens_total"] >= before.get("tandem_generation_tokens_total", 0) + 5
    length = 'tandem_requests_total{"status": "length"}'
    assert after[length] > before.get(length, 0)
    assert after["tandem_time_to_first_token_seconds_count"] > before["tandem_time_to_first_token_seconds_count"]
    assert "tandem_spec_accept_length_count" in after and "tandem_queue_depth" in after


def test_api_key_body_limit_and_backpressure(engine_dirs):
    with Live(engine_dirs["qwen3_5_mtp3"], api_key="s3cret", max_body_bytes=2000, max_queued=0) as server:
        with pytest.raises(openai.AuthenticationError):
            client(server).completions.create(model="tiny", prompt="x", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            client(server, api_key="wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x" * 5000},
                       headers={"authorization": "Bearer s3cret"})
        assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x"},
                       headers={"authorization": "Bearer s3cret"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert httpx.get(f"{server.url}/health").status_code == 200  # health needs no key


def test_a_transient_engine_error_fails_nobody(live, offline, monkeypatch):
    """A step that raises once: the request is recomputed alone, passes, and completes as if
    nothing happened (a fault that persists is isolated: tests/server/test_server_reliability.py)."""
    llm = live.app.state.serve_loop.llm
    real = llm.step
    calls = {"n": 0}

    def broken():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected engine failure")
        return real()

    monkeypatch.setattr(llm, "step", broken)
    r = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4,
                                                       "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and calls["n"] > 1
    assert r.json()["choices"][0]["text"] == offline("x", max_tokens=4).text
    ok = client(live).completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 4


def test_sigterm_drains_in_flight_requests_then_exits(engine_dirs):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    port = _free_port()
    tandem = Path(sys.executable).parent / "tandem"
    proc = subprocess.Popen([str(tandem), "serve", str(engine_dirs["qwen3_5_mtp3"]), "--port", str(port),
                             "--model-name", "tiny"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url)
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 300, "stream": True, "ignore_eos": True}
        lines = []
        with httpx.Client(timeout=60) as h, h.stream("POST", f"{url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    if not lines:
                        proc.send_signal(signal.SIGTERM)  # mid-stream
                    lines.append(line)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][5:])["choices"][0]["finish_reason"] == "length"
        # uvicorn exits after the drain by re-raising the signal (status -SIGTERM), as servers do
        assert proc.wait(30) in (0, -signal.SIGTERM)
        # an engine dir `tandem profile` has not tuned: the server says how to tune it
        assert "has no runtime_settings.json" in proc.stdout.read()
    finally:
        proc.kill()


def test_vllm_named_metrics_follow_the_requests(live):
    """The vllm: series a vLLM dashboard reads move with the work done, spec_decode counts included."""
    def series(name: str, **labels) -> float:
        return live.metrics().get(f"vllm:{name}" + json.dumps({"model_name": "tiny", **labels}, sort_keys=True), 0.0)

    names = ("generation_tokens_total", "prompt_tokens_total", "time_to_first_token_seconds_count",
             "e2e_request_latency_seconds_count", "spec_decode_num_drafts_total",
             "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total")
    before = {k: series(k) for k in names}
    done = series("request_success_total", finished_reason="length")
    r = client(live).completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True, "spec_k": 2})
    spec = r.usage.model_extra["speculative"]
    moved = {k: series(k) - before[k] for k in names}
    assert moved["generation_tokens_total"] == 12 and moved["prompt_tokens_total"] == 3
    assert moved["time_to_first_token_seconds_count"] == moved["e2e_request_latency_seconds_count"] == 1
    assert series("request_success_total", finished_reason="length") == done + 1
    drafts = moved["spec_decode_num_drafts_total"]
    assert drafts == spec["verify_steps"] > 0 and moved["spec_decode_num_draft_tokens_total"] >= drafts
    accepted = moved["spec_decode_num_accepted_tokens_total"]
    assert accepted == pytest.approx((spec["accept_length"] - 1) * drafts, abs=0.01 * drafts)
    now = live.metrics()
    per_pos = sum(v for k, v in now.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == series("spec_decode_num_accepted_tokens_total")
    assert 0.0 <= series("kv_cache_usage_perc") <= 1.0 and any(k.startswith("vllm:num_requests_running") for k in now)
