"""What logits processors and logprobs cost under speculation: tokens/s with penalties and logprobs
on against off, in one process, on the same engine dir.

    .venv/bin/python bench/processors_logprobs.py ENGINE_DIR [--batch 1 4] [--tokens 64] [--passes 5]

For each batch size, `batch` code prompts are generated greedily with max_tokens `--tokens`
(ignore_eos) in three setups, speculation on (the engine's default width policy): plain requests;
the same with presence 0.5, frequency 0.5 and repetition 1.1 penalties; and those penalties plus
logprobs with the 5 most likely alternatives. The setups run round robin, `--passes` times each;
medians of tokens/s and accept length are printed with each setup's ratio to the plain one
(the goal: >= 0.9).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ helpers
from bench.common import machine, wait_for_engines  # noqa: E402
from tandem.pipeline.llm import LLM  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["def fibonacci(n):\n    ", "import os\n\n\ndef list_files(root):\n    ", "class Stack:\n    def ",
           "# parse the config\nimport json\n", "def add(a, b):\n    ", "for i in range(10):\n    ",
           "def main():\n    args = ", "with open(path) as f:\n    "]
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}
SETUPS = {"plain": {}, "penalties": PENALTIES, "penalties + logprobs": {**PENALTIES, "logprobs": 5}}


def run_once(llm: LLM, batch: int, tokens: int, fields: dict) -> tuple[float, float]:
    """(tokens/s, accept length) of one batch."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, **fields)
    t = time.perf_counter()
    out = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(batch)], params)
    wall = time.perf_counter() - t
    rounds = sum(o.metrics.rounds for o in out)
    accept = (sum(o.metrics.accepted for o in out) + rounds) / rounds if rounds else 1.0
    return sum(len(o.token_ids) for o in out) / wall, accept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine_dir")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(args.engine_dir)
    wait_for_engines(llm)
    print(f"{machine()}; {args.engine_dir}; {args.tokens} tokens, medians of {args.passes} round-robin passes")
    print("batch | setup | tokens/s | ratio to plain | accept length")
    for batch in args.batch:
        for fields in SETUPS.values():      # warm: sessions open at every width the setups use
            run_once(llm, batch, 16, fields)
        got = {name: [] for name in SETUPS}
        for _ in range(args.passes):
            for name, fields in SETUPS.items():
                got[name].append(run_once(llm, batch, args.tokens, fields))
        plain = statistics.median(r[0] for r in got["plain"])
        for name, runs in got.items():
            tps, accept = (statistics.median(r[i] for r in runs) for i in range(2))
            print(f"{batch} | {name} | {tps:.1f} | {tps / plain:.2f}x | {accept:.2f}")


if __name__ == "__main__":
    main()
