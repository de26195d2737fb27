"""Multi-step decode against one token per call, on one engine dir, alternated in one process.

    .venv/bin/python bench/decode_steps.py ENGINE_DIR [--batch 1 8] [--tokens 128] [--rounds 5]
                                           [--prompt-len 32] [--threads N] [--json OUT.json]

ENGINE_DIR must be built with `tandem build-engines --decode-steps N`. The script opens it twice
with speculation off: `EngineConfig(decode_steps=None)` runs its multi-step decode graph (N greedy
tokens per call) and `decode_steps=1` the target step (one token per call, what the dir does
without the graph). Per batch size it warms both up, then alternates one timed generation of each
per round (`--batch` requests of `--tokens` greedy tokens, random `--prompt-len`-token prompts,
prefill excluded: decode tokens over the time from the last first token to the last finish) and
reports per mode the median decode tokens/s, the host share of a step (engine dir's
EngineStats: wall time outside engine calls), the host µs per token, and the ratio of the
medians. Both modes must emit the same tokens (checked every round): a multi-step call is n plain
greedy steps, not an approximation of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ helpers
from bench.common import machine  # noqa: E402
from tandem.pipeline.llm import LLM, EngineConfig  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402


def timed_generation(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float, float, list]:
    """(decode tokens/s, host share, host µs per token, the token ids) of one batch generation."""
    stats = llm.engine.stats
    wall, engine = stats.round_seconds, stats.engine_seconds
    results = llm.generate(prompts, params)
    first = max(r.metrics.first_token for r in results)
    last = max(r.metrics.finished for r in results)
    tokens = sum(len(r.token_ids) - 1 for r in results)
    wall, engine = stats.round_seconds - wall, stats.engine_seconds - engine
    host = wall - engine
    made = sum(len(r.token_ids) for r in results) / len(results)
    return (tokens / (last - first), host / wall if wall else 0.0, 1e6 * host / max(1.0, made),
            [r.token_ids for r in results])


def compare(engine_dir: Path, batch: int, tokens: int, rounds: int, prompt_len: int, threads: int | None) -> dict:
    rng = np.random.default_rng(batch)
    modes = {}
    for label, steps in (("multi-step", None), ("one per call", 1)):
        llm = LLM(engine_dir, EngineConfig(speculative=False, decode_steps=steps, threads=threads,
                                           memory_budget_bytes=1 << 30))
        if label == "multi-step" and llm.engine.decode is None:
            raise SystemExit(f"{engine_dir} has no multi-step decode graph: build it with "
                             "`tandem build-engines MODEL --out DIR --decode-steps 4`")
        modes[label] = llm
    vocab = modes["multi-step"].desc.vocab_size
    prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for llm in modes.values():           # warm-up: sessions open, bindings made
        llm.generate(prompts, params)
    got = {label: [] for label in modes}
    for _ in range(rounds):
        outputs = {}
        for label, llm in modes.items():
            speed, share, host_us, ids = timed_generation(llm, prompts, params)
            got[label].append((speed, share, host_us))
            outputs[label] = ids
        if outputs["multi-step"] != outputs["one per call"]:
            raise SystemExit(f"batch {batch}: the multi-step decode emitted other tokens than one per call")
    report = {"batch": batch, "steps": modes["multi-step"].engine.decode.steps}
    for label, runs in got.items():
        report[label] = {"tokens_per_s": statistics.median(r[0] for r in runs),
                         "host_share": statistics.median(r[1] for r in runs),
                         "host_us_per_token": statistics.median(r[2] for r in runs),
                         "runs": [round(r[0], 1) for r in runs]}
    report["speedup"] = report["multi-step"]["tokens_per_s"] / report["one per call"]["tokens_per_s"]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    print(f"{machine()}; {args.engine_dir}, {args.tokens} greedy tokens, {args.rounds} rounds alternated")
    reports = []
    for batch in args.batch:
        r = compare(args.engine_dir, batch, args.tokens, args.rounds, args.prompt_len, args.threads)
        reports.append(r)
        for label in ("one per call", "multi-step"):
            m = r[label]
            print(f"  batch {batch}, {label:>12} ({r['steps'] if label == 'multi-step' else 1} a call): "
                  f"{m['tokens_per_s']:8.1f} tok/s, host {m['host_share']:.0%} of a step, "
                  f"{m['host_us_per_token']:.0f} µs a token  (runs {m['runs']})")
        print(f"  batch {batch}: multi-step / one per call = {r['speedup']:.2f}x, same tokens")
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2) + "\n")


if __name__ == "__main__":
    main()
