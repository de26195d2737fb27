"""RSS over thousands of requests, offline (LLM.generate) and through a live server.

    .venv/bin/python bench/memory.py [--engines DIR] [--requests 5000] [--every 500] [--concurrency 4]
                                     [--modes offline,server] [--workdir DIR]

Each mode measures a process of its own. Offline: a child process calls `LLM.generate` once per
request and reads its own /proc/self/statm. Server: a child process runs
`tandem.server.serve.build` under uvicorn on 127.0.0.1; this process sends the requests from
`--concurrency` threads over one httpx client (half of them streamed) and reads the child's
/proc/PID/statm. Prompts are distinct code-like texts, so the tokenizer sees new words
throughout. Prints RSS every `--every` requests after a warm-up of `--every` requests, and the
growth per request. Without --engines, a tiny random-weight engine dir is built in the workdir.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkpoints import tiny_engines, workdir  # noqa: E402
from bench.common import machine  # noqa: E402

_PAGE = os.sysconf("SC_PAGE_SIZE")
MAX_TOKENS = 16


def rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


def prompt(i: int) -> str:
    return f"def step_{i}(values, k={i % 97}):\n    total = 0\n    for v in values:\n        total += v * k\n"


class Report:
    """Prints one line per `every` requests after the warm-up; keeps the first and last RSS."""

    def __init__(self, mode: str, every: int):
        self.mode, self.every = mode, every
        self.base: tuple[int, float] | None = None
        self.last: tuple[int, float] | None = None

    def at(self, done: int, rss: float, extra: str = "") -> None:
        if done % self.every:
            return
        if self.base is None:
            self.base = (done, rss)
        self.last = (done, rss)
        print(f"  {self.mode:7} {done:6d} requests  RSS {rss:8.1f} MiB  (+{rss - self.base[1]:6.1f} since "
              f"{self.base[0]}){extra}", flush=True)

    def summary(self) -> dict:
        (n0, r0), (n1, r1) = self.base, self.last
        per = (r1 - r0) * 1024 / (n1 - n0) if n1 > n0 else 0.0
        print(f"  {self.mode}: {r0:.1f} -> {r1:.1f} MiB over requests {n0}..{n1}: {per:+.2f} KiB per request",
              flush=True)
        return {"requests": [n0, n1], "rss_mib": [r0, r1], "kib_per_request": per}


def offline(engine_dir: str, requests: int, every: int, answer=None) -> dict:
    """(In a process of its own.) `answer`: a queue the summary is put on at the end."""
    from tandem.pipeline.llm import LLM
    from tandem.pipeline.sampling_params import SamplingParams

    llm = LLM(engine_dir)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    report = Report("offline", every)
    for i in range(1, requests + 1):
        llm.generate([prompt(i)], params)
        if i % every == 0:
            report.at(i, rss_mib(), f"  pages ever used {llm.pages.ever_used}")
    summary = report.summary()
    if answer is not None:
        answer.put(summary)
    return summary


def _serve(engine_dir: str, port: int) -> None:
    import uvicorn

    from tandem.server.serve import build

    uvicorn.run(build(engine_dir), host="127.0.0.1", port=port, log_level="warning")


def server(engine_dir: str, requests: int, every: int, concurrency: int) -> dict:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = mp.get_context("spawn").Process(target=_serve, args=(engine_dir, port), daemon=True)
    child.start()
    url = f"http://127.0.0.1:{port}"
    try:
        model = _wait_ready(url, child)
        report = Report("server", every)

        def one(i: int, client: httpx.Client) -> None:
            body = {"model": model, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, "stream": i % 2 == 0}
            if body["stream"]:
                with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                    r.raise_for_status()
                    for _ in r.iter_lines():
                        pass
            else:
                client.post(f"{url}/v1/completions", json=body).raise_for_status()

        with httpx.Client(timeout=60) as client, ThreadPoolExecutor(concurrency) as pool:
            for start in range(1, requests + 1, every):   # a bounded loop: one block of requests at a time
                block = range(start, min(start + every, requests + 1))
                list(pool.map(lambda i: one(i, client), block))
                report.at(block[-1], rss_mib(child.pid))
        return report.summary()
    finally:
        child.terminate()
        child.join(10)


def _wait_ready(url: str, child: mp.Process) -> str:
    import httpx

    for _ in range(600):
        if not child.is_alive():
            raise SystemExit(f"the server process exited with {child.exitcode}")
        try:
            r = httpx.get(f"{url}/ready", timeout=1)
            if r.status_code == 200:
                return r.json()["model"]
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit("the server did not become ready within 60 s")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=None, help="engine dir (default: build a tiny one in the workdir)")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--modes", default="offline,server")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    if args.requests < 2 * args.every or args.every < 1:
        parser.error("--requests must cover at least two --every blocks (the first is the warm-up)")
    engines = args.engines or str(tiny_engines(workdir(args.workdir)))
    print(f"machine: {machine()}; engines {engines}; {args.requests} requests of {MAX_TOKENS} tokens, RSS every "
          f"{args.every} (the first block is the warm-up)", flush=True)
    figures = {}
    for mode in args.modes.split(","):
        if mode == "offline":   # in a process of its own: only the pipeline's memory is counted
            spawn = mp.get_context("spawn")
            answer = spawn.SimpleQueue()
            p = spawn.Process(target=offline, args=(engines, args.requests, args.every, answer))
            p.start()
            p.join()
            if p.exitcode:
                raise SystemExit(f"offline failed (exit code {p.exitcode})")
            figures[mode] = answer.get()
        elif mode == "server":
            figures[mode] = server(engines, args.requests, args.every, args.concurrency)
        else:
            parser.error(f"unknown mode {mode!r}: offline or server")
    return figures


if __name__ == "__main__":
    main()
