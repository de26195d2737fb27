"""Speculation against plain decoding on an engine dir's own heads, in the same process.

    .venv/bin/python bench/speculation_vs_plain.py ENGINE_DIR [--batch 1] [--tokens 64] [--passes 5]
                                                   [--prompts N] [--setups plain,default,k=1]
                                                   [--prompt-set code|short] [--json OUT.json]

Eight code prompts (`code`: bench/processors_logprobs.py's, each ending inside a block; `short`: eight
bare first lines such as "def fib(n):", where the model must choose how to go on), greedy, `--tokens` new tokens each
(ignore_eos). Setups: plain (speculative=False), the default (the adaptive width), and a fixed
spec_k of 1 .. the engines' k. At `--batch 1` the prompts run one request after another; at
`--batch B` B at a time. Whole requests are timed (prefill included), every setup once as warm-up,
then `--passes` passes with the setups interleaved; the median pass counts. Prints tokens/s, the
ratio to plain and the accept length ((accepted + rounds) / rounds) of each setup.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import interleaved, machine, medians, wait_for_engines  # noqa: E402
from bench.processors_logprobs import PROMPTS  # noqa: E402
from bench.report import print_ratios, write_json  # noqa: E402
from tandem.pipeline.llm import LLM  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402

SHORT_PROMPTS = ["def fib(n):", "class Stack:\n    def __init__(self):", "import os\n\ndef walk(path):",
                 "def parse_args(argv):", "for i in range(10):", "def read_json(path):", "class Node:",
                 "def merge(a, b):"]
PROMPT_SETS = {"code": PROMPTS, "short": SHORT_PROMPTS}


def one_pass(llm: LLM, prompts: list[str], batch: int, tokens: int, fields: dict) -> tuple[float, float]:
    """(tokens/s, accept length) over the prompts, `batch` requests at a time."""
    made = rounds = accepted = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        for out in llm.generate(prompts[i:i + batch], SamplingParams(max_tokens=tokens, ignore_eos=True, **fields)):
            made += len(out.token_ids)
            rounds += out.metrics.rounds
            accepted += out.metrics.accepted
    return made / (time.perf_counter() - start), (accepted + rounds) / rounds if rounds else 1.0


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine_dir")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8, help="how many prompts (cycling the eight)")
    parser.add_argument("--prompt-set", choices=sorted(PROMPT_SETS), default="code")
    parser.add_argument("--setups", help="which setups, comma-separated (default: all; plain always runs)")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    llm = LLM(args.engine_dir)
    wait_for_engines(llm)
    chosen = PROMPT_SETS[args.prompt_set]
    prompts = [chosen[i % len(chosen)] for i in range(args.prompts)]
    setups = {"plain": {"speculative": False}, "default": {}, **{f"k={k}": {"k": k} for k in range(1, llm.spec_k + 1)}}
    if args.setups:
        wanted = {"plain", *args.setups.split(",")}
        if wanted - set(setups):
            parser.error(f"--setups: {', '.join(sorted(wanted - set(setups)))} unknown; use {', '.join(setups)}")
        setups = {name: fields for name, fields in setups.items() if name in wanted}
    got = interleaved({name: lambda _, fields=fields: one_pass(llm, prompts, args.batch, args.tokens, fields)
                       for name, fields in setups.items()}, args.passes, warmup=1)
    print(f"{machine()}; {args.engine_dir}; batch {args.batch}, {len(prompts)} prompts x {args.tokens} tokens, "
          f"'{args.prompt_set}' prompts, median of {args.passes} passes")
    speeds = {name: medians(runs, 0)[0] for name, runs in got.items()}
    accepts = {name: medians(runs, 1)[0] for name, runs in got.items()}
    ratios = print_ratios(speeds, "plain", width=8,
                          extra={name: f"accept length {a:.2f}" for name, a in accepts.items()})
    rows = {name: {"tokens_per_s": round(speeds[name], 1), "vs_plain": round(ratios[name], 3),
                   "accept_length": accepts[name]} for name in got}
    figures = {"batch": args.batch, "tokens": args.tokens, "prompt_set": args.prompt_set, "setups": rows}
    if args.json:
        write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
