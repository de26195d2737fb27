"""Figures of docs/ray.md, all from one run (the machine's load changes from run to run, so only
ratios within a run mean anything):
- aggregate tokens/s of concurrent greedy streams: `tandem serve --threads 1` in one process, then the
  Ray Serve application with 1 and with 2 replicas (each replica 1 CPU, 1 ONNX Runtime thread);
- time to the first token of one streamed request at a time: single process vs through the Ray
  gateway (proxy -> gateway -> replica);
- recovery: from SIGKILL of a replica's process to Ray reporting its replacement running, and how
  many requests sent meanwhile failed.

    .venv/bin/python bench/ray_serve_figures.py ENGINE_DIR [--streams 16] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.report import print_ratios  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} never became ready")


def request(prompt: str, tokens: int) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}


async def first_token_and_count(client: httpx.AsyncClient, prompt: str, tokens: int) -> tuple[float, int]:
    """(seconds to the first streamed chunk, content chunks) of one streamed completion."""
    start, first, chunks = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/completions", json=request(prompt, tokens)) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                first = first or time.perf_counter() - start
                chunks += 1
    return first, chunks


def throughput(url: str, streams: int, tokens: int) -> float:
    """Generated tokens per second over `streams` concurrent greedy streams."""
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            await first_token_and_count(client, "warm up", 8)
            start = time.perf_counter()
            await asyncio.gather(*(first_token_and_count(client, f"def f{i}(x):", tokens) for i in range(streams)))
            return streams * tokens / (time.perf_counter() - start)
    return asyncio.run(run())


def ttft(url: str, n: int = 10) -> float:
    """Median time to the first token, one request at a time."""
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            await first_token_and_count(client, "warm up", 4)
            return [(await first_token_and_count(client, f"prompt {i}", 4))[0] for i in range(n)]
    return statistics.median(asyncio.run(run()))


def single_process(engine_dir: str, streams: int, tokens: int) -> tuple[float, float]:
    port = free_port()
    tandem = Path(sys.executable).parent / "tandem"
    proc = subprocess.Popen([str(tandem), "serve", engine_dir, "--port", str(port), "--model-name", "m",
                             "--threads", "1"],   # as a replica: 1 CPU, 1 ONNX Runtime thread
                            stdout=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url)
        return throughput(url, streams, tokens), ttft(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine_dir")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(argv)
    import ray
    from ray import serve

    from tandem.server.app import ServerSettings
    from tandem.server.ray_app import APP_NAME, Scaling, application

    print(f"load average before: {os.getloadavg()}")
    single_tps, single_ttft = single_process(args.engine_dir, args.streams, args.tokens)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="warning")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = ServerSettings(model_name="m")
    figures = {}
    for n in (1, 2):
        serve.run(application(args.engine_dir, settings, scaling=Scaling(replicas=n)), name=APP_NAME, route_prefix="/")
        figures[n] = throughput(url, args.streams, args.tokens), ttft(url)

    def engine_replicas() -> set[str]:
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#TandemEngine#")}

    victim = next(iter(engine_replicas()))
    os.kill(ray.get(ray.get_actor(victim, namespace="serve").__ray_call__.remote(lambda self: os.getpid())),
            signal.SIGKILL)
    killed, sent, failed = time.monotonic(), 0, 0
    while True:   # until Ray runs a replacement; requests go on meanwhile
        r = httpx.post(f"{url}/v1/completions", json={**request("during", 4), "stream": False}, timeout=60)
        sent, failed = sent + 1, failed + (r.status_code != 200)
        engine = serve.status().applications[APP_NAME].deployments["TandemEngine"]
        replicas = engine_replicas()
        if victim not in replicas and len(replicas) == 2 and engine.replica_states.get("RUNNING") == 2:
            break
    recovery = time.monotonic() - killed
    ray.shutdown()

    print(f"load average after: {os.getloadavg()}")
    print(f"{args.streams} concurrent streams x {args.tokens} tokens, greedy:")
    speeds = {"single process": single_tps, **{f"Ray, {n} replica(s)": tps for n, (tps, _) in figures.items()}}
    ttfts = {"single process": single_ttft, **{f"Ray, {n} replica(s)": first for n, (_, first) in figures.items()}}
    print_ratios(speeds, "single process", unit="tokens/s", fmt="7.1f",
                 extra={name: f"TTFT {t * 1000:6.1f} ms ({t / single_ttft:.2f}x)" for name, t in ttfts.items()})
    print(f"  2 vs 1 replica: {figures[2][0] / figures[1][0]:.2f}x")
    print(f"recovery after SIGKILL of a replica: {recovery:.1f} s to a running replacement; "
          f"{failed} of {sent} requests sent meanwhile failed")
    return {"streams": args.streams, "tokens": args.tokens,
            "single_process": {"tokens_per_s": single_tps, "ttft_s": single_ttft},
            "ray": {n: {"tokens_per_s": tps, "ttft_s": first} for n, (tps, first) in figures.items()},
            "recovery_s": recovery, "failed": failed, "sent": sent}


if __name__ == "__main__":
    main()
