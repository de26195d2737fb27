"""Where a decode step's time goes: per graph kind, per op type, per layer (ONNX Runtime's
profiler) and in the host loop between engine calls.

    .venv/bin/python bench/where_time_goes.py ENGINE_DIR [--batch 1 8] [--tokens 64] [--spec|--no-spec]
                                              [--width W] [--prompt-len 32] [--top 15] [--json OUT.json]
                                              [--no-kernel-times]

Loads the engine dir twice. Plain sessions first: per batch size a warm-up request, then `--tokens`
decode steps timed, then as many again under cProfile (which slows Python: host µs per step come
from the untraced window). Then with every session under ONNX Runtime's profiler (its per-node cost
multiplies engine time, so it only gives shares): a warm-up and `--tokens` steps whose node events
make the op and layer tables. Prints, per batch size:
  (a) per graph kind (engine file): calls, total ms, ms per call, unprofiled;
  (b) per op type the share of node time; inlined function bodies (`_inlfunc_<Op>_`) and the
      lowered ai.tandem ops (`.../<Op>/lowered/...`) count under `<Op> (body)`;
  (c) per layer (`layers.N` in the exporter's scopes, export/builder.py) the share of node time;
      nodes without a scope (inlined bodies) count for the layer of the node run before them;
  (d) the host loop: wall per step - engine time per step = host µs per step, the host work alone
      (engine calls replayed: each returns its binding's last outputs without running, best of 5
      windows; free of the engine's noise), the engine's phase timers, and cProfile's top
      functions per step by cumulative and by own time;
  (e) (printed after (a)) tandem's CPU kernels timed by their own clocks in the unprofiled window
      (TANDEM_CPU_KERNEL_TIMES, plugins/cpu/kernel_times.cc; `--no-kernel-times` leaves them off; none
      for a dir whose library predates them): per op calls and µs per step, µs per call, and the gap
      before each call (ONNX Runtime's executor and its own nodes since the
      previous kernel). ONNX Runtime's profiler adds about 10 µs to each node it times, so (b) and (c)
      overstate small nodes; (e) does not (two clock reads per call).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine  # noqa: E402
from tandem.engines.backends import onnxruntime_backend  # noqa: E402
from tandem.pipeline.llm import LLM, RuntimeConfig  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402
from tandem.plugins import cpu_kernels  # noqa: E402

_LAYER = re.compile(r"layers\.(\d+)")
_INLINED = re.compile(r"_inlfunc_([A-Za-z0-9]+)_")
_LOWERED = re.compile(r"/([A-Za-z0-9]+)/lowered/")


# ---- the profile json -> tables ----------------------------------------------------------------
def op_group(name: str, op_type: str) -> str:
    """The op type, or `<Op> (body)` for a node of an inlined function or a lowered ai.tandem op."""
    m = _INLINED.search(name) or _LOWERED.search(name)
    return f"{m.group(1)} (body)" if m else op_type


def scope_group(name: str) -> str | None:
    """`layers.N`, else the first scope that is not `model` (embed_tokens, norm, lm_head, ...);
    None for nodes without a scope (inlined function bodies)."""
    m = _LAYER.search(name)
    if _INLINED.search(name):
        return None
    if m:
        return f"layers.{int(m.group(1)):02d}"
    parts = [p for p in name.split("/") if p and p != "model"]
    return parts[0] if len(parts) > 1 else None


def read_events(path: Path, start_ns: int, window: tuple[int, int]) -> dict:
    """Runs and node times (µs) of one session's profile inside the wall-clock window (time_ns).

    Event `ts` is µs since the session's profiling start (start_ns, on time.time_ns's clock)."""
    try:
        events = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: cannot read ONNX Runtime's profile ({e}); rerun the bench") from e
    lo, hi = (window[0] - start_ns) / 1e3, (window[1] - start_ns) / 1e3
    runs, run_us, nodes = 0, 0.0, []
    for e in sorted(events, key=lambda e: e.get("ts", 0)):
        if e.get("ph") != "X" or not lo <= e["ts"] <= hi:
            continue
        if e.get("cat") == "Session" and e["name"] == "model_run":
            runs += 1
            run_us += e["dur"]
        elif e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            nodes.append((e["name"][: -len("_kernel_time")], e["args"].get("op_name", "?"), e["dur"]))
    return {"runs": runs, "run_us": run_us, "nodes": nodes}


def tables(per_file: dict[str, dict]) -> dict:
    """(a) per engine file, (b) per op group, (c) per layer, from read_events results."""
    graphs = {Path(f).stem: {"calls": r["runs"], "total_ms": r["run_us"] / 1e3,
                             "ms_per_call": r["run_us"] / 1e3 / r["runs"]}
              for f, r in sorted(per_file.items()) if r["runs"]}
    ops: dict[str, float] = defaultdict(float)
    layers: dict[str, float] = defaultdict(float)
    for r in per_file.values():
        current = "(unscoped)"
        for name, op_type, dur in r["nodes"]:
            ops[op_group(name, op_type)] += dur
            current = scope_group(name) or current  # an inlined body runs right after its caller's nodes
            layers[current] += dur
    total = sum(ops.values()) or 1.0
    share = lambda d: {k: {"ms": v / 1e3, "share": v / total}  # noqa: E731
                       for k, v in sorted(d.items(), key=lambda kv: -kv[1])}
    return {"graphs": graphs, "ops": share(ops), "layers": share(layers), "node_ms": total / 1e3}


# ---- the run ----------------------------------------------------------------------------------
def _decode(llm: LLM, batch: int, steps: int, prompt_len: int, rng) -> list:
    """Requests that will still be decoding after `steps` more steps, past their prefill."""
    vocab = llm.desc.vocab_size
    params = SamplingParams(max_tokens=steps * 8 + 8, ignore_eos=True)  # a spec round emits up to k + 1
    seqs = [llm.add_request([int(t) for t in rng.integers(0, vocab, prompt_len)], params) for _ in range(batch)]
    while any(s.num_generated == 0 for s in seqs):
        llm.step()
    return seqs


def _finish(llm: LLM, seqs) -> None:
    """Run the requests to their end (frees their pages for the next batch size)."""
    while any(s.finish_reason is None for s in seqs):
        llm.step()


def _timed_capture(backend) -> tuple[dict[str, list], dict]:
    """Engine file -> [calls, seconds], by wrapping the backend runner's run of each binding (the
    wrapper sits inside ModelRunner's engine timer, so host time is unchanged). The second dict
    switches replay on: a call then returns the binding's last outputs without running it, so a
    step costs only its host work (timed without the engine's noise)."""
    per_file: dict[str, list] = defaultdict(lambda: [0, 0.0])
    plain, stems, replay, last = backend.capture, {}, {"on": False}, {}

    def capture(binding):
        # sessions open on first use, so a binding's file is looked up on its first run (then kept:
        # this wrapper's own cost counts as host time)
        if id(binding) not in stems:
            file = next(f for f, s in backend.sessions.items() if s is binding.sess)
            stems[id(binding)] = (binding, Path(file).stem)
        run, acc = plain(binding), per_file[stems[id(binding)][1]]

        def timed():
            if replay["on"] and id(binding) in last:
                return last[id(binding)]
            t = time.perf_counter()
            out = last[id(binding)] = run()
            acc[0] += 1
            acc[1] += time.perf_counter() - t
            return out
        return timed
    backend.capture = capture
    return per_file, replay


def host_alone(llm: LLM, batch: int, steps: int, prompt_len: int, replay: dict, windows: int = 5) -> float:
    """Host µs per step with every engine call replayed (its last outputs, no run): the best of
    `windows` windows of steps / windows steps. Replayed outputs repeat the same tokens; the host work per
    step is the same as with real outputs (the same commits, fills, sampling and detokenizing)."""
    rng = np.random.default_rng(batch)
    seqs = _decode(llm, batch, steps, prompt_len, rng)
    best, per_window = float("inf"), max(1, steps // windows)
    replay["on"] = True
    try:
        for _ in range(windows):
            t = time.perf_counter()
            for _ in range(per_window):
                llm.round_loop.step()
            best = min(best, (time.perf_counter() - t) / per_window * 1e6)
    finally:
        replay["on"] = False
    _finish(llm, seqs)
    return best


def host_loop(llm: LLM, batch: int, steps: int, prompt_len: int, top: int, per_file: dict, replay: dict) -> dict:
    """Unprofiled: wall, engine and host time per step, per graph kind, phases, then cProfile,
    then the host work alone (engine calls replayed)."""
    rng = np.random.default_rng(batch)
    runner, engine = llm.runner, llm.round_loop
    _finish(llm, _decode(llm, batch, 4, prompt_len, rng))  # warm-up: binds this batch's buckets
    seqs = _decode(llm, batch, steps, prompt_len, rng)
    tokens0 = sum(s.num_generated for s in seqs)
    engine_s0, phases0 = runner.engine_seconds, dict(engine.stats.phase_seconds)
    files0 = {f: list(v) for f, v in per_file.items()}
    library = runner.runner.host_kernels
    try:
        if library is not None:
            cpu_kernels.kernel_times(library, reset=True)
    except AttributeError:          # an engine dir built before the timers: no table (e)
        library = None
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - t0
    kernels = kernel_table(cpu_kernels.kernel_times(library), steps) if library is not None else {}
    tokens = sum(s.num_generated for s in seqs) - tokens0
    engine_s = runner.engine_seconds - engine_s0
    phases = {k: (v - phases0.get(k, 0.0)) / steps * 1e6 for k, v in engine.stats.phase_seconds.items()
              if v - phases0.get(k, 0.0) > 0}
    graphs = {}
    for f, (n, sec) in sorted(per_file.items()):
        n0, sec0 = files0.get(f, [0, 0.0])
        if n > n0:
            graphs[f] = {"calls": n - n0, "total_ms": (sec - sec0) * 1e3, "ms_per_call": (sec - sec0) * 1e3 / (n - n0)}
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    _finish(llm, seqs)
    alone = host_alone(llm, batch, steps, prompt_len, replay)
    functions = [{"function": f"{Path(f).name}:{line}({fn})", "calls_per_step": nc / steps,
                  "tottime_us_per_step": tt / steps * 1e6, "cumtime_us_per_step": ct / steps * 1e6}
                 for (f, line, fn), (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()]
    by_self = [fn for fn in sorted(functions, key=lambda fn: -fn["tottime_us_per_step"])
               if "run_with_iobinding" not in fn["function"]][:top]  # the host's own work, engine call left out
    functions = sorted(functions, key=lambda fn: -fn["cumtime_us_per_step"])[:top]
    return {"graphs": graphs, "kernels": kernels, "host": {
        "wall_us_per_step": wall / steps * 1e6, "engine_us_per_step": engine_s / steps * 1e6,
        "host_us_per_step": (wall - engine_s) / steps * 1e6, "host_share": 1 - engine_s / wall,
        "host_alone_us_per_step": alone,
        "tokens_per_step": tokens / steps, "tok_s": tokens / wall, "phase_us_per_step": phases,
        "cprofile_top": functions, "cprofile_self": by_self}}


def kernel_table(times: dict, steps: int) -> dict:
    """(e) from tandem's kernel timers over `steps` steps: per op calls and µs per step, µs per
    call, and the gap before each call (ONNX Runtime's executor and its own nodes since the previous
    kernel), largest first."""
    table = {op: {"calls_per_step": t["calls"] / steps, "us_per_step": t["busy_us"] / steps,
                  "us_per_call": t["busy_us"] / t["calls"], "gap_us_per_call": t["gap_us"] / max(t["gaps"], 1)}
             for op, t in times.items() if t["calls"]}
    return dict(sorted(table.items(), key=lambda kv: -kv[1]["us_per_step"]))


def profiled_window(llm: LLM, batch: int, steps: int, prompt_len: int) -> tuple[int, int]:
    """The time_ns window of `steps` decode steps (after a warm-up) for the ORT profile tables."""
    rng = np.random.default_rng(batch)
    _finish(llm, _decode(llm, batch, 4, prompt_len, rng))
    seqs = _decode(llm, batch, steps, prompt_len, rng)
    start = time.time_ns()
    for _ in range(steps):
        llm.round_loop.step()
    window = (start, time.time_ns())
    _finish(llm, seqs)
    return window


def run(engine_dir: Path, batches: list[int], steps: int, spec: bool, prompt_len: int, top: int,
        threads: int | None, width: int | None = None) -> dict:
    """Two loads of the engine dir: plain sessions for the timings, profiled ones for the op
    and layer tables (the profiler's per-node cost would swamp the timings). width: every round
    at this verify width (k = width - 1, adaptive width off); None: the engine's policy."""
    fixed = dict(spec_k=width - 1, adaptive_width=False) if width else {}
    config = RuntimeConfig(speculative=spec, threads=threads, memory_budget_bytes=1 << 30,
                          max_num_seqs=max(batches), **fixed)
    t = time.perf_counter()
    llm = LLM(engine_dir, config)
    report = {"engine_dir": str(engine_dir), "machine": machine(), "spec": spec, "width": width, "steps": steps,
              "prompt_len": prompt_len, "load_s": time.perf_counter() - t, "batches": {}}
    per_file, replay = _timed_capture(llm.runner.runner)
    timings = {b: host_loop(llm, b, steps, prompt_len, top, per_file, replay) for b in batches}
    del llm
    prefix = tempfile.mkdtemp(prefix="tandem-ortprof-") + "/"
    profiled = functools.partial(onnxruntime_backend.Runner, profile_prefix=prefix)
    with mock.patch.object(onnxruntime_backend, "Runner", profiled):  # LLM builds its backend Runner inside
        llm = LLM(engine_dir, config)
    backend = llm.runner.runner
    windows = {b: profiled_window(llm, b, steps, prompt_len) for b in batches}
    starts = {f: s.get_profiling_start_time_ns() for f, s in backend.sessions.items()}  # those opened
    files = backend.end_profiling()
    for b in batches:
        per_session = {f: read_events(p, starts[f], windows[b]) for f, p in files.items()}
        t = tables(per_session)
        report["batches"][b] = {"graphs": timings[b]["graphs"], "kernels": timings[b]["kernels"],
                                "ops": t["ops"], "layers": t["layers"],
                                "node_ms": t["node_ms"], "profiled_graphs": t["graphs"], "host": timings[b]["host"]}
    return report


# ---- printing ---------------------------------------------------------------------------------
def show(report: dict, top: int) -> None:
    width = f" at width {report['width']}" if report.get("width") else ""
    print(f"{report['engine_dir']}: {report['machine']}; speculative {report['spec']}{width}, {report['steps']} steps, "
          f"prompt {report['prompt_len']}, loaded in {report['load_s']:.1f} s (plain sessions)")
    for b, r in report["batches"].items():
        h = r["host"]
        print(f"\n== batch {b}: {h['tok_s']:.0f} tok/s, {h['tokens_per_step']:.2f} tokens/step, "
              f"wall {h['wall_us_per_step']:.0f} µs/step = engine {h['engine_us_per_step']:.0f} + "
              f"host {h['host_us_per_step']:.0f} µs (host share {h['host_share']:.0%}); host work alone "
              f"(engine calls replayed, best of 5) {h['host_alone_us_per_step']:.0f} µs/step")
        print("(a) graph kind (unprofiled) calls   total ms   ms/call")
        for f, g in r["graphs"].items():
            print(f"    {f:<24}{g['calls']:>6} {g['total_ms']:>10.2f} {g['ms_per_call']:>9.3f}")
        if r["kernels"]:
            print("(e) tandem's kernels (unprofiled, their own timers)   calls/step   µs/call   µs/step   "
                  "gap before (µs/call)")
            for op, k in r["kernels"].items():
                print(f"    {op:<24}{k['calls_per_step']:>26.1f} {k['us_per_call']:>9.1f} {k['us_per_step']:>9.0f} "
                      f"{k['gap_us_per_call']:>10.1f}")
        for title, key in (("(b) op type", "ops"), ("(c) layer", "layers")):
            print(f"{title:<28}    ms    share   (of {r['node_ms']:.1f} ms node time, profiled)")
            for k, v in list(r[key].items())[:top]:
                print(f"    {k:<24}{v['ms']:>8.2f} {v['share']:>7.1%}")
        print("(d) host: phase timers (µs/step, engine calls included): "
              + ", ".join(f"{k} {v:.0f}" for k, v in h["phase_us_per_step"].items()))
        for title, key in (("by cumulative", "cprofile_top"), ("by own time, engine call left out", "cprofile_self")):
            print(f"    cProfile {title}, µs/step (inflated by cProfile): calls, tottime, cumtime")
            for fn in h[key]:
                print(f"    {fn['function'][:58]:<58}{fn['calls_per_step']:>7.1f} {fn['tottime_us_per_step']:>8.0f} "
                      f"{fn['cumtime_us_per_step']:>8.0f}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64, help="decode steps timed per batch size")
    parser.add_argument("--spec", action=argparse.BooleanOptionalAction, default=False,
                        help="speculative rounds with the heads' own drafts (default: plain decoding)")
    parser.add_argument("--width", type=int, default=None,
                        help="with --spec: every round at this verify width (k = width - 1, adaptive width off)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--top", type=int, default=15, help="rows of the op, layer and cProfile tables")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the tables here")
    parser.add_argument("--kernel-times", action=argparse.BooleanOptionalAction, default=True,
                        help="table (e): tandem's kernels timed by their own clocks (two clock reads a call)")
    args = parser.parse_args(argv)
    if args.kernel_times:
        os.environ[cpu_kernels.TIMES_ENV] = "1"     # read when the process first runs a kernel
    if not (args.engine_dir / "manifest.json").exists():
        raise SystemExit(f"{args.engine_dir}: no manifest.json; build one with `tandem build-engines MODEL_DIR "
                         f"--out {args.engine_dir}`")
    if args.tokens < 1 or min(args.batch) < 1:
        raise SystemExit("--tokens and --batch must be at least 1")
    if args.width is not None and (not args.spec or args.width < 2):
        raise SystemExit("--width needs --spec and a width of at least 2 (width 1 is plain decoding: --no-spec)")
    report = run(args.engine_dir, args.batch, args.tokens, args.spec, args.prompt_len, args.top, args.threads,
                 args.width)
    show(report, args.top)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.json}")
    return report


if __name__ == "__main__":
    main()
