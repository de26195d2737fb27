"""What an engine dir costs to build and to load, each measured in a fresh child process.

    .venv/bin/python bench/load_and_build.py [--model models/tandem-tiny-code] [--weights float,int8]
                                             [--batches 1,8] [--workdir DIR] [--reuse] [--loads 2]

For a checkpoint (a folder, or a tiny/bench kind such as qwen3_5_150m written on the fly) and each
weight format: the build's wall time and peak RSS (the child's ru_maxrss), the engine dir's bytes;
then, each in a fresh process: the time to read every file of the engine dir once (the "read
their weights" baseline; the page cache cannot be dropped here, so reads are warm, and so are the
loads after them), `LLM(engine_dir)`, the first token of a 32-token prompt, and RSS after. Load
ratios are (LLM + first token) / read. The first load after a build also hashes every file
(engines/integrity.py), so `--loads 2` reports it apart from later ones. --reuse keeps an
engine dir already in the workdir instead of rebuilding it.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_MIB = 2**20


def _rss() -> dict:
    """Current and peak RSS of this process in MiB, and its CPU seconds so far (user + system: on a
    shared machine they move less than wall time does)."""
    status = Path("/proc/self/status").read_text()
    current = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"rss_mib": current / 1024, "peak_rss_mib": usage.ru_maxrss / 1024,
            "cpu_seconds": usage.ru_utime + usage.ru_stime}


def child_build(model: str, out: str, weights: str, batches: str) -> dict:
    from bench.checkpoints import build
    from tandem.engines import builder  # noqa: F401  (imported before the clock starts)

    start = time.perf_counter()
    built = build(model, out, weights=weights, batch_sizes=tuple(int(b) for b in batches.split(",")), max_seq_len=1024)
    return {"seconds": time.perf_counter() - start, "bytes": built.size_bytes, **_rss()}


def child_read(engine_dir: str) -> dict:
    start, total = time.perf_counter(), 0
    for path in sorted(Path(engine_dir).iterdir()):
        if path.is_file():
            with open(path, "rb", buffering=0) as f:
                while chunk := f.read(16 * _MIB):
                    total += len(chunk)
    return {"seconds": time.perf_counter() - start, "bytes": total, **_rss()}


def child_load(engine_dir: str) -> dict:
    import numpy as np

    from tandem.pipeline.llm import LLM
    from tandem.pipeline.sampling_params import SamplingParams

    start, cpu = time.perf_counter(), _rss()["cpu_seconds"]
    llm = LLM(engine_dir)
    constructed = time.perf_counter() - start
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, llm.desc.vocab_size, 32)]
    llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    first = time.perf_counter() - start
    opened = len(llm.runner.runner.sessions) if hasattr(llm.runner, "runner") else None
    after = _rss()
    return {"construct_seconds": constructed, "first_token_seconds": first, "hashed": len(llm.verification.hashed),
            "sessions": opened, **after, "load_cpu_seconds": after["cpu_seconds"] - cpu}


def _in_child(*args: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"child {args[0]} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tandem-tiny-code", help="checkpoint folder or tiny/bench kind")
    parser.add_argument("--weights", default="float,int8")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--reuse", action="store_true", help="keep engine dirs already built in the workdir")
    parser.add_argument("--loads", type=int, default=2, help="loads per engine dir (the first one hashes the files)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        print(json.dumps({"build": child_build, "read": child_read, "load": child_load}[kind](*rest)))
        return {}
    from bench.checkpoints import checkpoint, workdir
    from bench.common import machine

    work = workdir(args.workdir, prefix="tandem-load-")
    src = checkpoint(args.model, work)
    ckpt_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    print(f"machine: {machine()}; {src.name}: checkpoint {ckpt_bytes / _MIB:.0f} MiB; batches {args.batches}; "
          "reads and loads are warm (page cache)")
    figures = {"checkpoint_mib": ckpt_bytes / _MIB, "formats": {}}
    for fmt in args.weights.split(","):
        out = work / f"{src.name}-{fmt}"
        figures["formats"][fmt] = got = {"loads": []}
        if args.reuse and (out / "manifest.json").exists():
            print(f"\n{fmt}: reusing {out}")
        else:
            b = got["build"] = _in_child("build", str(src), str(out), fmt, args.batches)
            print(f"\n{fmt}: build {b['seconds']:.1f} s (CPU {b['cpu_seconds']:.1f} s), "
                  f"peak RSS {b['peak_rss_mib']:.0f} MiB "
                  f"({b['peak_rss_mib'] * _MIB / ckpt_bytes:.1f}x checkpoint), engine dir {b['bytes'] / _MIB:.0f} MiB")
        r = got["read"] = _in_child("read", str(out))
        print(f"  read every file: {r['seconds'] * 1e3:.0f} ms ({r['bytes'] / _MIB:.0f} MiB, "
              f"{r['bytes'] / _MIB / r['seconds']:.0f} MiB/s)")
        for i in range(args.loads):
            load = _in_child("load", str(out))
            got["loads"].append(load)
            print(f"  load {i + 1}: LLM() {load['construct_seconds'] * 1e3:.0f} ms (hashed {load['hashed']} files), "
                  f"first token at {load['first_token_seconds'] * 1e3:.0f} ms, "
                  f"CPU {load['load_cpu_seconds'] * 1e3:.0f} ms "
                  f"({load['sessions']} sessions open), "
                  f"{load['first_token_seconds'] / r['seconds']:.1f}x read; RSS {load['rss_mib']:.0f} MiB "
                  f"(peak {load['peak_rss_mib']:.0f})")
    return figures


if __name__ == "__main__":
    main()
