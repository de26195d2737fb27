"""Several greedy tokens per engine step against one, on one engine dir, alternated in one process.

    .venv/bin/python bench/decode_steps.py ENGINE_DIR [--burst N] [--batch 1 8] [--tokens 128]
                                           [--rounds 5] [--prompt-len 32] [--threads N] [--json OUT.json]

Two ways to take several tokens per engine step (the Python step of the pipeline): without
`--burst`, ENGINE_DIR must be built with `tandem build-engines --decode-steps N` and
`RuntimeConfig(decode_steps=None)` runs its multi-step decode graph (N greedy tokens per call);
with `--burst N`, `RuntimeConfig(decode_burst=N)` runs up to N target steps back to back per engine
step (pipeline/decode_burst.py; `--burst-ms` its time budget). The baseline opens the same dir with
one token per engine step (`decode_steps=1, decode_burst=1`). Speculation is off in both. Per
batch size it warms both up, then alternates one timed generation of each
per round (`--batch` requests of `--tokens` greedy tokens, random `--prompt-len`-token prompts,
prefill excluded: decode tokens over the time from the last first token to the last finish) and
reports per mode the median decode tokens/s, the host share of a step (engine dir's
RoundStats: wall time outside engine calls), the host µs per token, and the ratio of the
medians. Both modes must emit the same tokens (checked every round): a multi-step call or a burst
is n plain greedy steps, not an approximation of them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ helpers
from bench.common import decode_speed, interleaved, machine, medians  # noqa: E402
from bench.report import write_json  # noqa: E402
from tandem.pipeline.llm import LLM, RuntimeConfig  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402


def timed_generation(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float, float, list]:
    """(decode tokens/s, host share, host µs per token, the token ids) of one batch generation."""
    stats = llm.round_loop.stats
    wall, engine = stats.round_seconds, stats.engine_seconds
    results = llm.generate(prompts, params)
    wall, engine = stats.round_seconds - wall, stats.engine_seconds - engine
    host = wall - engine
    made = sum(len(r.token_ids) for r in results) / len(results)
    return (decode_speed(results), host / wall if wall else 0.0, 1e6 * host / max(1.0, made),
            [r.token_ids for r in results])


def compare(engine_dir: Path, batch: int, tokens: int, rounds: int, prompt_len: int, threads: int | None,
            burst: int | None, burst_ms: float, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> dict:
    rng = np.random.default_rng(batch)
    modes = {}
    several = {"decode_steps": 1, "decode_burst": burst, "decode_burst_ms": burst_ms} if burst else \
        {"decode_steps": None, "decode_burst": 1}
    for label, fields in (("multi-step", several), ("one per call", {"decode_steps": 1, "decode_burst": 1})):
        llm = LLM(engine_dir, RuntimeConfig(speculative=False, threads=threads, memory_budget_bytes=1 << 30, **fields))
        if label == "multi-step" and llm.round_loop.decode is None:
            raise SystemExit(f"{engine_dir} has no multi-step decode graph: build it with "
                             "`tandem build-engines MODEL --out DIR --decode-steps 4`, or pass --burst N")
        modes[label] = llm
    vocab = modes["multi-step"].desc.vocab_size
    prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(batch)]
    # sampled: each prompt its seed, so both modes draw the same tokens (sampling depends on seed and position)
    params = [SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=temperature, top_k=top_k, top_p=top_p,
                             seed=i) for i in range(batch)]
    for llm in modes.values():           # warm-up: sessions open, bindings made
        llm.generate(prompts, params)

    def same_tokens(this: dict) -> None:
        if this["multi-step"][3] != this["one per call"][3]:
            raise SystemExit(f"batch {batch}: the multi-step decode emitted other tokens than one per call")

    got = interleaved({label: lambda _, llm=llm: timed_generation(llm, prompts, params)
                       for label, llm in modes.items()}, rounds, each_pass=same_tokens)
    decode = modes["multi-step"].round_loop.decode
    report = {"batch": batch, "steps": decode.steps, "mode": "burst" if burst else "graph"}
    if burst:    # how many target steps a burst ran, on average (its time budget may end it early)
        report["steps_per_burst"] = decode.calls / max(1, decode.bursts)
    for label, runs in got.items():
        speed, share, host_us = medians(runs, 0, 1, 2)
        report[label] = {"tokens_per_s": speed, "host_share": share, "host_us_per_token": host_us,
                         "runs": [round(r[0], 1) for r in runs]}
    report["speedup"] = report["multi-step"]["tokens_per_s"] / report["one per call"]["tokens_per_s"]
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--burst", type=int, default=None, help="a burst of N target steps per engine step instead of "
                        "the dir's multi-step decode graph")
    parser.add_argument("--burst-ms", type=float, default=4.0, help="a burst's time budget")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampled requests (seeded), with --burst; 0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="the sampled requests' top-k (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="the sampled requests' top-p (1: off)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.temperature and not args.burst:
        parser.error("--temperature needs --burst N: a multi-step decode graph takes greedy rows only")
    what = (f"sampled (temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p})" if args.temperature
            else "greedy")
    print(f"{machine()}; {args.engine_dir}, {args.tokens} {what} tokens, {args.rounds} rounds alternated")
    reports = []
    for batch in args.batch:
        r = compare(args.engine_dir, batch, args.tokens, args.rounds, args.prompt_len, args.threads, args.burst,
                    args.burst_ms, args.temperature, args.top_k, args.top_p)
        reports.append(r)
        for label in ("one per call", "multi-step"):
            m = r[label]
            print(f"  batch {batch}, {label if label != 'multi-step' else r['mode']:>12} "
                  f"({r['steps'] if label == 'multi-step' else 1} a step): "
                  f"{m['tokens_per_s']:8.1f} tok/s, host {m['host_share']:.0%} of a step, "
                  f"{m['host_us_per_token']:.0f} µs a token  (runs {m['runs']})")
        extra = f", {r['steps_per_burst']:.1f} target steps a burst" if "steps_per_burst" in r else ""
        print(f"  batch {batch}: {r['mode']} / one per call = {r['speedup']:.2f}x, same tokens{extra}")
    if args.json:
        write_json(args.json, reports)
    return {"batches": reports}


if __name__ == "__main__":
    main()
