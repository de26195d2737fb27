"""Accept length of the shipped model through tandem's pipeline, on held-out stdlib code, at
k = 1, 2, 3 with the chained heads and with head 1 reused (the seed's before/after table).

    .venv/bin/python tools/eval_accept_length.py [--model models/tandem-tiny-code] [--prompts 16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT / "tools"))
from train_small_model import read, stdlib_files  # noqa: E402

from tandem.engines.builder import build_engines  # noqa: E402
from tandem.engines.options import BuildOptions  # noqa: E402
from tandem.pipeline.llm import LLM, RuntimeConfig  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402


def held_out_prompts(n: int, lines: int = 12) -> list[str]:
    """The first lines of held-out files that have some code in them."""
    _, held = stdlib_files()
    out = []
    for text in read(held):
        head = "\n".join(text.splitlines()[:lines]) + "\n"
        if len(head) > 200:
            out.append(head)
        if len(out) == n:
            break
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(ROOT / "models" / "tandem-tiny-code"))
    parser.add_argument("--engines", default=str(ROOT / ".cache" / "engines" / "eval-tandem-tiny-code"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    Path(args.engines).parent.mkdir(parents=True, exist_ok=True)
    build_engines(args.model, args.engines, BuildOptions(batch_sizes=(1, 8), spec_k=3, max_seq_len=1024),
                  show_progress=False)
    prompts = held_out_prompts(args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens)
    print(f"{len(prompts)} held-out prompts, greedy, {args.max_tokens} tokens each")
    print("| k | chained heads: accept length | head 1 reused: accept length |")
    print("| --- | --- | --- |")
    for k in (1, 2, 3):
        cells = []
        for mode in ("chained", "reused"):
            llm = LLM(args.engines, RuntimeConfig(mtp_mode=mode, spec_k=k))
            results = llm.generate(prompts, params)
            st = llm.run_stats()[0]   # the round counters since the LLM opened
            per_pos = ", ".join(f"{x:.2f}" for x in st.acceptance_per_position())
            cells.append(f"{st.accept_length:.2f} (per position {per_pos})")
            assert sum(r.metrics.rounds for r in results) == st.verify_rounds
        print(f"| {k} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
