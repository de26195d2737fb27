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
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ helpers
from bench.common import accept_length, interleaved, machine, medians, wait_for_engines  # noqa: E402
from bench.report import print_ratios  # noqa: E402
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
    return sum(len(o.token_ids) for o in out) / wall, accept_length(out)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine_dir")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args(argv)
    llm = LLM(args.engine_dir)
    wait_for_engines(llm)
    print(f"{machine()}; {args.engine_dir}; {args.tokens} tokens, medians of {args.passes} round-robin passes")
    figures = {"tokens": args.tokens, "passes": args.passes, "batches": {}}
    for batch in args.batch:
        for fields in SETUPS.values():      # warm: sessions open at every width the setups use
            run_once(llm, batch, 16, fields)
        got = interleaved({name: lambda _, batch=batch, fields=fields: run_once(llm, batch, args.tokens, fields)
                           for name, fields in SETUPS.items()}, args.passes)
        speeds = {name: medians(runs, 0)[0] for name, runs in got.items()}
        accepts = {name: medians(runs, 1)[0] for name, runs in got.items()}
        print(f"batch {batch}: tokens/s, ratio to plain, accept length")
        ratios = print_ratios(speeds, "plain", extra={name: f"accept length {a:.2f}" for name, a in accepts.items()})
        figures["batches"][batch] = {name: {"tokens_per_s": speeds[name], "vs_plain": ratios[name],
                                     "accept_length": accepts[name]} for name in got}
    return figures


if __name__ == "__main__":
    main()
