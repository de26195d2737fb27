"""Plain decoding of two engine dirs, interleaved in one process: which one decodes faster, robust
to a machine whose memory speed moves by 1.5x within minutes.

    .venv/bin/python bench/decode_ab.py DIR_A DIR_B [--rounds 10] [--tokens 64]

Both dirs are loaded with speculation off and warmed up; then each round decodes `--tokens` greedy
tokens at batch 1 (32-token random prompt, prefill excluded) with A and with B, in alternating
order, and the ratio B / A of that round is kept. Prints the median tokens/s of each and the median
and range of the per-round ratios (> 1: B faster). bench/engine_ab.py compares one graph call by
call; this compares whole decode steps as the pipeline runs them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bandwidth_bound import decode_speed  # noqa: E402
from bench.common import interleaved, machine, summary  # noqa: E402
from tandem.pipeline.llm import LLM, RuntimeConfig  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir_a", type=Path)
    parser.add_argument("dir_b", type=Path)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    llms = [LLM(d, RuntimeConfig(speculative=False)) for d in (args.dir_a, args.dir_b)]
    for llm in llms:
        decode_speed(llm, 8)                         # warm-up: sessions, bindings
    got = interleaved({"A": lambda _: decode_speed(llms[0], args.tokens),
                       "B": lambda _: decode_speed(llms[1], args.tokens)}, args.rounds, alternate=True)
    speeds = [got["A"], got["B"]]
    ratios = [b / a for a, b in zip(*speeds)]
    print(f"{machine()}; plain decoding, batch 1, {args.tokens} tokens, {args.rounds} interleaved rounds")
    print(f"  A = {args.dir_a}: {statistics.median(speeds[0]):.1f} tok/s")
    print(f"  B = {args.dir_b}: {statistics.median(speeds[1]):.1f} tok/s")
    print(f"  B / A per round: median {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})")
    return {"a": str(args.dir_a), "b": str(args.dir_b), "tokens": args.tokens,
            "a_tokens_per_s": summary(speeds[0]), "b_tokens_per_s": summary(speeds[1]), "b_over_a": summary(ratios)}


if __name__ == "__main__":
    main()
