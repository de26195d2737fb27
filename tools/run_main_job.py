"""The README's main job (`make run`): build the shipped model's engines (a no-op after the first
time) and tune them for this machine (`tandem profile`, once per build), start the OpenAI-compatible
server on 127.0.0.1, send one streamed sample request, print the answer and the accept length, then
keep serving until Ctrl-C (`--once`: stop after the sample).

Uses only the runtime dependencies (no torch); the sample request goes through urllib.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "tandem-tiny-code"
SAMPLE = 'import os\n\n\ndef list_python_files(root):\n    """Return the .py files under root."""\n'


def post_stream(url: str, body: dict):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def wait_ready(url: str, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.2)
    raise SystemExit("the server did not become ready in time")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--engines", default=str(ROOT / ".cache" / "engines" / "tandem-tiny-code"))
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--once", action="store_true", help="stop the server after the sample request")
    args = parser.parse_args()
    tandem = Path(sys.executable).parent / "tandem"
    Path(args.engines).parent.mkdir(parents=True, exist_ok=True)
    build = [str(tandem), "build-engines", args.model, "--out", args.engines, "--batch-sizes", "1,2,4,8",
             "--spec-k", "3", "--max-seq-len", "2048"]
    if subprocess.call(build) != 0:
        return 1
    if not (Path(args.engines) / "runtime_settings.json").exists():
        # once per build (a rebuilt engine dir has none): this machine's round costs and widths per batch
        # size, so the adaptive width starts from them (rounds that cannot pay, batch 8 on this model,
        # decode plain from a process's first request)
        print("tuning verify widths and round costs for this machine (tandem profile, once per build)", flush=True)
        report = ROOT / ".cache" / "profile" / Path(args.engines).name
        if subprocess.call([str(tandem), "profile", args.engines, "--out", str(report), "--quiet"]) != 0:
            print("tandem profile failed (see above); serving with the engine dir's default widths", flush=True)
    name = "tandem-tiny-code"
    server = subprocess.Popen([str(tandem), "serve", args.engines, "--port", str(args.port), "--model-name", name])
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(url, server)
        print(f"\nsample request (streamed, greedy) to {url}/v1/completions:\n{SAMPLE}", end="", flush=True)
        usage = None
        body = {"model": name, "prompt": SAMPLE, "max_tokens": 96, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        for chunk in post_stream(f"{url}/v1/completions", body):
            if chunk.get("choices"):
                print(chunk["choices"][0]["text"], end="", flush=True)
            if chunk.get("usage"):
                usage = chunk["usage"]
        spec = usage.get("speculative", {}) if usage else {}
        print(f"\n\n[{usage['completion_tokens']} tokens, accept length {spec.get('accept_length', 0):.2f} "
              f"tokens per verify step over {spec.get('verify_steps', 0)} steps]")
        example = json.dumps({"model": name, "messages": [{"role": "user", "content": "def add(a, b):"}],
                              "max_tokens": 64})
        if args.once:
            print("\n--once: stopping the server.")
        else:
            print(f"\nThe server keeps running on {url} (OpenAI API). Try:\n"
                  f"  curl {url}/v1/chat/completions -H 'content-type: application/json' -d '{example}'\n"
                  f"  curl {url}/metrics\nCtrl-C stops it.")
            server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
