"""Plain-decoding speed of one engine dir, for A/B runs of two code versions in one session.

    .venv/bin/python bench/plain_decode.py ENGINE_DIR [--tokens 128] [--repeats 5] [--label new]

Loads the engines with speculation off, warms up with one request, then times `--repeats`
requests of `--tokens` greedy tokens at batch 1 and prints the median decode tokens/s (tokens
after the first over their time, so prefill is excluded) and the host share of a step. Run it
alternately against two checkouts (old code: PYTHONPATH pointing at a folder whose `tandem` is
the old tree) and compare the medians of the same run; the machine is too noisy for absolutes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench/ helpers (tandem: wherever PYTHONPATH says)
from bench.common import decode_speed, summary  # noqa: E402
from tandem.pipeline.llm import LLM, RuntimeConfig  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine_dir")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--label", default="")
    parser.add_argument("--prompt", default="def fib(n):")
    args = parser.parse_args(argv)
    llm = LLM(args.engine_dir, RuntimeConfig(speculative=False))
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    llm.generate([args.prompt], params)
    speeds = [decode_speed(llm.generate([args.prompt], params)) for _ in range(args.repeats)]
    host_share = llm.round_loop.stats.host_share
    print(f"{args.label} plain decode, batch 1: {statistics.median(speeds):.1f} tokens/s (median of "
          f"{args.repeats}), host share {host_share:.3f}")
    return {"label": args.label, "tokens": args.tokens, "tokens_per_s": summary(speeds), "host_share": host_share}


if __name__ == "__main__":
    main()
