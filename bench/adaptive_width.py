"""Adaptive verify width against plain decoding, in the same run (ONNX Runtime CPU).

    .venv/bin/python bench/adaptive_width.py [--kinds qwen3_5_mtp3,qwen3_5_150m] [--workdir DIR] [--repeats 3]
                                             [--acceptance 0,1] [--batches 1,8] [--max-tokens N]

Random weights accept nothing, so acceptance is the documented synthetic aid
(RuntimeConfig.synthetic_acceptance): 0.0, drafts never accepted, and 1.0, always accepted. The
controller is not told which: it sees accepted counts and round times as for any model. Per kind
and batch size (1, 8) it prints decode tok/s for plain decoding, for speculation at the engines' k
with the width fixed (adaptive_width=False) and for adaptive width, all after a warm-up of
--warmup rounds, as ratios to plain; and the widths adaptive width ran (how many rounds at each,
the choice at the end). Each mode runs --repeats times, interleaved; the best run counts (this
machine's other load only ever slows a run down).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkpoints import build, checkpoint, workdir  # noqa: E402
from bench.common import interleaved, machine  # noqa: E402
from tandem.pipeline.llm import LLM, RuntimeConfig  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402
from tandem.pipeline.width_control import WidthController  # noqa: E402

MODES = {  # name -> RuntimeConfig fields (acceptance filled in per run)
    "plain": {"speculative": False},
    "fixed": {"adaptive_width": False},
    "adaptive": {},
}


class Recording(WidthController):
    """The controller as the engine builds it, noting each round's width."""

    def __init__(self, *args):
        super().__init__(*args)
        self.ran: list[int] = []

    def width(self, batch: int, constrained: bool = False) -> int:
        self.ran.append(super().width(batch, constrained))
        return self.ran[-1]


def decode_run(engine_dir: Path, batch: int, mode: str, acceptance: float, max_tokens: int, warmup: int) -> dict:
    """tok/s of the decode rounds after the first `warmup` rounds, and the widths adaptive ran."""
    fields = MODES[mode]
    spec = fields.get("speculative", True)
    config = RuntimeConfig(memory_budget_bytes=1 << 30, synthetic_acceptance=acceptance if spec else None, **fields)
    llm = LLM(engine_dir, config)
    rng = np.random.default_rng(0)
    prompt = lambda: [int(t) for t in rng.integers(0, llm.desc.vocab_size, 32)]  # noqa: E731
    llm.generate([prompt()] * batch, SamplingParams(max_tokens=8, ignore_eos=True))   # bindings, first calls
    control = llm.round_loop.width_control
    if control is not None:   # a fresh one: what it learnt over the warm-up request is forgotten
        control = llm.round_loop.width_control = Recording(control.widths, control.batch_sizes, control.start,
                                                       control.policy)
    seqs = [llm.add_request(prompt(), SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for _ in range(batch)]
    llm.step()                                              # prefill: excluded
    for _ in range(warmup):
        llm.step()
    tokens0, t = sum(s.num_generated for s in seqs), time.perf_counter()
    while any(s.finish_reason is None for s in seqs):
        llm.step()
    wall = time.perf_counter() - t
    tokens = sum(len(s.output_ids()) for s in seqs) - tokens0
    return {"tok_s": tokens / wall, "widths": control.ran if control is not None else [],
            "choice": control.choice(batch) if control is not None else None}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="qwen3_5_mtp3,qwen3_5_150m")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=12, help="decode rounds not timed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--acceptance", default="0,1", help="synthetic acceptance values, comma-separated")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=None, help="per request (default: 160 for 150m, else 400)")
    args = parser.parse_args(argv)
    work = workdir(args.workdir)
    print(f"machine: {machine()}; k = {args.k}, warm-up {args.warmup} rounds, best of {args.repeats}")
    figures = {}
    for kind in args.kinds.split(","):
        src = checkpoint(kind, work)
        kind = src.name
        engines = work / f"{kind}-engines-k{args.k}-float32"
        built = build(src, engines, batch_sizes=(1, 8), spec_k=args.k, prefill_chunk=64, max_seq_len=1024)
        print(f"\n{kind}: build {built.status} in {built.seconds:.1f} s")
        figures[kind] = rows = []
        max_tokens = args.max_tokens or (160 if "150m" in kind else 400)
        print("  acceptance batch | plain tok/s | fixed k/plain | adaptive/plain | adaptive widths (rounds), end")
        for acceptance in [float(a) for a in args.acceptance.split(",")]:
            for batch in [int(b) for b in args.batches.split(",")]:
                run = partial(decode_run, engines, batch, acceptance=acceptance, max_tokens=max_tokens,
                              warmup=args.warmup)
                got = interleaved({mode: lambda _, mode=mode, run=run: run(mode) for mode in MODES}, args.repeats)
                best = {mode: max(runs, key=lambda r: r["tok_s"]) for mode, runs in got.items()}   # the best run
                plain = best["plain"]["tok_s"]
                ran = dict(sorted(Counter(best["adaptive"]["widths"]).items()))
                rows.append({"acceptance": acceptance, "batch": batch, "plain_tokens_per_s": plain,
                             "fixed_over_plain": best["fixed"]["tok_s"] / plain,
                             "adaptive_over_plain": best["adaptive"]["tok_s"] / plain, "adaptive_widths": ran,
                             "adaptive_choice": best["adaptive"]["choice"]})
                print(f"  {acceptance:10.1f} {batch:5} | {plain:11.1f} | {best['fixed']['tok_s'] / plain:13.2f} | "
                      f"{best['adaptive']['tok_s'] / plain:14.2f} | {ran}, {best['adaptive']['choice']}")
    return figures


if __name__ == "__main__":
    main()
