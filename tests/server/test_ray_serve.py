"""tandem on Ray Serve (server/ray_app.py): two replicas of the tiny engines on a local Ray instance
started here, driven over HTTP through the gateway. One Ray instance for the module (~20 s to start
Ray and load both replicas, never a cluster already running here); the failover test kills a replica
and is the last to use Ray."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.server.app import ServerSettings

from .test_server import Live

ray = pytest.importorskip("ray", reason="Ray Serve is not installed: pip install 'tandem[ray]' (the test extra has it)")
serve = pytest.importorskip("ray.serve")
from tandem.server.ray_app import APP_NAME, REPLICA_HEADER, RETRIED_HEADER, Scaling, application  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# tokens of a "long" request: 1-3 s on a replica (the tiny engines decode 1,000-2,500 tokens/s), so the
# tests act while it runs; the module's engines are built for it (ray_dir: max_seq_len 4096)
LONG = 3000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_dir(tiny_root, tmp_path_factory):
    """The tiny qwen3_5_mtp3 engines with room for LONG tokens (the shared ones stop at 512)."""
    from tandem.engines.builder import build_engines

    from ..pipeline_fixtures import OPTIONS
    path = tmp_path_factory.mktemp("ray") / "qwen3_5_mtp3"
    options = dataclasses.replace(OPTIONS, batch_sizes=(1, 2, 4), max_seq_len=4096, page_size=16)
    build_engines(tiny_root / "qwen3_5_mtp3", path, options, show_progress=False)
    return path


@pytest.fixture(scope="module")
def ray_url(ray_dir):
    term = signal.getsignal(signal.SIGTERM)    # ray.init installs its own
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="warning")
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = application(ray_dir, ServerSettings(model_name="tiny"), scaling=Scaling(replicas=2))
        serve.run(app, name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        ray.shutdown()   # stops Serve with the instance
        signal.signal(signal.SIGTERM, term)


@pytest.fixture(scope="module")
def single(ray_dir):
    """The single-process server on the same engine dir (tandem serve without --ray): prompts, n ->
    the texts it answers, one request after the other."""
    with Live(ray_dir) as server:
        def texts(prompts: list[str], n: int) -> list[str]:
            out = [httpx.post(f"{server.url}/v1/completions", json=body(p, n), timeout=60) for p in prompts]
            assert all(r.status_code == 200 for r in out), [r.text for r in out]
            return [r.json()["choices"][0]["text"] for r in out]
        yield texts


def body(prompt: str, n: int, stream: bool = False) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def sse_text(lines: list[str]) -> tuple[str, dict | None]:
    """(text of a completion stream, its error event if it ended with one)."""
    text, error = [], None
    for line in lines:
        data = json.loads(line[len("data: "):]) if line.startswith("data: {") else None
        if data and "error" in data:
            error = data["error"]
        elif data:
            text.append(data["choices"][0]["text"])
    return "".join(text), error


def requests_by_replica(url: str) -> dict[str, float]:
    """Finished requests per replica, from /metrics/replicas (tandem_requests_total)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics/replicas").text):
        for s in fam.samples:
            if s.name == "tandem_requests_total":
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0) + s.value
    return out


def wait_for_counts(url: str, before: dict[str, float], total: int, timeout: float = 10) -> dict[str, float]:
    """Per-replica counts since `before`, once they add up to `total` (replicas push every 0.5 s)."""
    for _ in range(int(timeout / 0.1)):
        now = requests_by_replica(url)
        delta = {r: v - before.get(r, 0) for r, v in now.items() if v - before.get(r, 0)}
        if sum(delta.values()) >= total:
            return delta
        time.sleep(0.1)
    raise AssertionError(f"per-replica counters never reached {total}: {delta}")


class Stream(threading.Thread):
    """A streamed completion read in a thread: its replica (header), its lines, when it ended."""

    def __init__(self, url: str, prompt: str, n: int):
        super().__init__(daemon=True)
        self.url, self.request = url, body(prompt, n, stream=True)
        self.replica, self.lines, self.started = None, [], threading.Event()

    def run(self):
        with httpx.stream("POST", f"{self.url}/v1/completions", json=self.request, timeout=60) as r:
            self.replica = r.headers[REPLICA_HEADER]
            self.started.set()
            self.lines.extend(line for line in r.iter_lines() if line)

    def begin(self) -> Stream:
        self.start()
        assert self.started.wait(30), "the stream never started"
        while not self.lines:          # a first token: the request is running on its replica
            time.sleep(0.01)
        return self


def test_two_replicas_match_the_single_process_server_and_share_the_load(ray_url, single):
    prompts = [f"def f{i}(x):" if i % 2 else f"The number {i} is" for i in range(16)]
    refs = single(prompts, 16)
    before = requests_by_replica(ray_url)

    async def one(client: httpx.AsyncClient, i: int):
        stream = i % 2 == 0
        if not stream:
            r = await client.post("/v1/completions", json=body(prompts[i], 16))
            assert r.status_code == 200, r.text
            return r.headers[REPLICA_HEADER], r.json()["choices"][0]["text"]
        async with client.stream("POST", "/v1/completions", json=body(prompts[i], 16, stream=True)) as r:
            lines = [line async for line in r.aiter_lines() if line]
            return r.headers[REPLICA_HEADER], sse_text(lines)[0]

    async def all16():
        async with httpx.AsyncClient(base_url=ray_url, timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(all16())
    assert [text for _, text in results] == refs                   # token for token, every request
    served = wait_for_counts(ray_url, before, 16)
    assert len(served) == 2 and sum(served.values()) == 16, served   # both replicas served requests
    assert {replica for replica, _ in results} == set(served)


def test_new_requests_go_to_the_replica_not_busy_with_a_long_one(ray_url):
    before = requests_by_replica(ray_url)
    long = Stream(ray_url, "a long one", LONG).begin()
    shorts = []
    while len(long.lines) < LONG // 2 and len(shorts) < 6:   # well before the long request ends
        r = httpx.post(f"{ray_url}/v1/completions", json=body("short", 2), timeout=30)
        assert r.status_code == 200, r.text
        shorts.append(r.headers[REPLICA_HEADER])
    long.join(30)
    assert len(shorts) >= 2, "the long request ended too soon to route short ones beside it"
    assert long.replica not in shorts, (long.replica, shorts)
    served = wait_for_counts(ray_url, before, 1 + len(shorts))
    assert served == {long.replica: 1, shorts[0]: len(shorts)}, served   # from the replicas' own counters


def test_a_client_that_hangs_up_mid_stream_frees_its_sequence_on_the_replica(ray_url):
    def aggregate() -> dict:
        text = httpx.get(f"{ray_url}/metrics").text
        return {s.name + json.dumps(s.labels, sort_keys=True): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    aborted = 'tandem_requests_total{"status": "aborted"}'
    before = aggregate().get(aborted, 0)
    with httpx.stream("POST", f"{ray_url}/v1/completions", json=body("hang up", LONG, stream=True), timeout=30) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
    # the proxy cancels the gateway, the gateway its call to the replica, the replica's app sees a disconnect
    for _ in range(100):
        now = aggregate()
        if now.get(aborted, 0) == before + 1 and now["tandem_kv_pages_in_use{}"] == 0:
            break
        time.sleep(0.1)
    assert now.get(aborted, 0) == before + 1 and now["tandem_kv_pages_in_use{}"] == 0, now
    assert now["tandem_running_requests{}"] == 0


def test_errors_and_limits_are_those_of_the_single_process_server(ray_url):
    url = f"{ray_url}/v1/completions"
    r = httpx.post(url, json={**body("x", 2), "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(url, json={**body("x", 2), "stream": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"

    def chunks():   # 2 MiB without content-length: the gateway forwards 1 MiB + 1 byte, the replica answers
        yield b'{"model": "tiny", "max_tokens": 2, "prompt": "'
        for _ in range(32):
            yield b"x" * (64 << 10)
        yield b'"}'

    r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
    assert httpx.get(f"{ray_url}/v1/models").json()["data"][0]["id"] == "tiny"


def test_a_killed_replica_fails_its_streams_clearly_and_is_replaced(ray_url, single):
    first = Stream(ray_url, "stream 0", LONG).begin()
    second = Stream(ray_url, "stream 1", LONG).begin()
    assert first.replica != second.replica           # the least loaded replica takes the next request
    waiting: dict = {}
    plain = threading.Thread(target=lambda: waiting.update(
        r=httpx.post(f"{ray_url}/v1/completions", json=body("not streamed", LONG), timeout=60)), daemon=True)
    plain.start()
    time.sleep(0.3)                                   # routed: one replica now holds two requests
    third = Stream(ray_url, "stream 2", LONG).begin()
    victim = first.replica if third.replica == second.replica else second.replica
    doomed = first if first.replica == victim else second
    assert not doomed.lines[-1].endswith("[DONE]"), "the victim's stream ended before the kill"

    actor = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#TandemEngine#{victim}", namespace="serve")
    os.kill(ray.get(actor.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)
    killed = time.monotonic()
    for t in (first, second, third, plain):
        t.join(60)

    text, error = sse_text(doomed.lines)
    assert error is not None and error["code"] == 503 and "replica" in error["message"], doomed.lines[-3:]
    assert doomed.lines[-1] == "data: [DONE]"
    refs = single(["stream 0", "stream 1", "stream 2", "not streamed"], LONG)
    for stream, ref in zip((first, second, third), refs):
        if stream is not doomed:                      # the other replica's streams are untouched
            assert sse_text(stream.lines) == (ref, None)
    r = waiting["r"]                                  # died on the victim before sending anything: retried
    assert r.status_code == 200 and r.headers.get(RETRIED_HEADER) == "1", (r.status_code, r.headers)
    assert r.json()["choices"][0]["text"] == refs[3]

    while True:                                       # Ray replaces the replica
        engine = serve.status().applications[APP_NAME].deployments["TandemEngine"]
        replicas = engine_replicas()
        if victim not in replicas and len(replicas) == 2 and engine.replica_states.get("RUNNING") == 2:
            break
        assert time.monotonic() - killed < 60, (engine, replicas)
        time.sleep(0.2)

    ref = single(["after"], 48)[0]

    async def four():   # in flight together: two on each replica (long enough that none ends before all are sent)
        async with httpx.AsyncClient(base_url=ray_url, timeout=30) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body("after", 48)) for _ in range(4)))

    served = set()
    for _ in range(5):      # the routers learn of the replacement from Serve's controller, within seconds
        after = asyncio.run(four())
        assert all(r.status_code == 200 and r.json()["choices"][0]["text"] == ref for r in after)
        served |= {r.headers[REPLICA_HEADER] for r in after}
        if served == replicas:
            break
        time.sleep(1.0)
    assert served == replicas   # the replacement serves too


def engine_replicas() -> set[str]:
    """Ids of the engine replicas alive now (their actors' names end with them)."""
    prefix = f"SERVE_REPLICA::{APP_NAME}#TandemEngine#"
    return {a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


# ---- without a Ray instance (milliseconds) ---------------------------------------------------
def test_ranking_puts_fewest_sequences_first_then_most_free_pages():
    from tandem.server.ray_routing import load_of, rank_by_load

    loads = {"busy": load_of({"running": 3, "waiting": 1, "kv_pages_free": 90}, None),
             "idle": load_of({"running": 0, "waiting": 0, "kv_pages_free": 100}, None),
             "long_contexts": load_of({"running": 0, "waiting": 0, "kv_pages_free": 10}, None),
             "new": load_of(None, None),                          # not reported yet: empty
             "twin": load_of({"running": 0, "waiting": 0, "kv_pages_free": 100}, None)}
    assert rank_by_load(loads) == [["new"], ["idle", "twin"], ["long_contexts"], ["busy"]]
    # requests in flight (Serve's cache) count instead of the report, which lags behind them
    assert load_of({"running": 5, "kv_pages_free": 7}, 1).sequences == 1
    assert rank_by_load({"a": load_of({"running": 0}, 2), "b": load_of({"running": 4}, 0)}) == [["b"], ["a"]]


def test_metrics_merge_sums_per_name_and_keeps_replicas_apart():
    from tandem.server.metrics import merged_exposition

    def text(requests: int, rate: float) -> str:
        return ("# TYPE tandem_requests_total counter\n"
                f'tandem_requests_total{{status="stop"}} {requests}\n'
                "# TYPE tandem_spec_acceptance_rate gauge\n"
                f'tandem_spec_acceptance_rate{{position="1"}} {rate}\n')

    def samples(exposition: str) -> dict:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(exposition) for s in fam.samples}

    texts = {"r1": text(3, 0.5), "r2": text(5, 0.7)}
    assert samples(merged_exposition(texts, per_replica=False)) == {
        ("tandem_requests_total", (("status", "stop"),)): 8,
        ("tandem_spec_acceptance_rate", (("position", "1"),)): pytest.approx(0.6)}
    per_replica = samples(merged_exposition(texts, per_replica=True))
    assert per_replica[("tandem_requests_total", (("replica", "r2"), ("status", "stop")))] == 5
    assert len(per_replica) == 4


def test_bad_ray_options_are_refused_with_the_fix():
    from tandem.server.ray_app import build

    with pytest.raises(ValueError, match="both --min-replicas and --max-replicas"):
        Scaling(min_replicas=1)
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        Scaling(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="engine_dir=ENGINE_DIR"):
        build({"replicas": "2"})
    with pytest.raises(ValueError, match="unknown argument.*replica_count"):
        build({"engine_dir": "x", "replica_count": "2"})


def test_cli_refuses_ray_flags_without_ray_and_mixed_scaling(capsys):
    from tandem.cli import main

    assert main(["serve", "engines", "--replicas", "2"]) == 1
    assert "--replicas only apply with --ray" in capsys.readouterr().err
    assert main(["serve", "engines", "--ray", "--replicas", "2", "--min-replicas", "1", "--max-replicas", "2"]) == 1
    assert "not both" in capsys.readouterr().err
