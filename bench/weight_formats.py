"""Plain decoding with float, int8 and int4 linear weights (`--weights`), same checkpoint, same run.

    .venv/bin/python bench/weight_formats.py [--models models/tandem-tiny-code,qwen3_5_150m] [--tokens 96]
                                             [--batches 1,8] [--workdir DIR]

For each checkpoint (a folder, or a tiny/bench kind written on the fly) builds one engine dir per
weight format, then measures decode tokens/s (prefill excluded, median of 3 interleaved runs per
format) at each batch size, the build size, and the quality against the float engines: the share
of greedy tokens that agree (before the first divergence, per prompt) and the largest logit
difference on the first token relative to the logits' range. Speeds are quoted as ratios to float
in the same run; the machine is too noisy for absolutes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkpoints import build, checkpoint, workdir  # noqa: E402
from bench.common import interleaved, machine  # noqa: E402
from tandem.pipeline import host_tokens  # noqa: E402
from tandem.pipeline.llm import LLM, RuntimeConfig  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402

FORMATS = ("float", "int8", "int4")


def decode_speed(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    """Tokens/s after each sequence's first token, the whole batch decoding together."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, speculative=False)
    seqs = [llm.add_request(p, params) for p in prompts]
    while any(s.num_generated == 0 for s in seqs):
        llm.step()
    start, done = time.perf_counter(), sum(s.num_generated for s in seqs)
    while any(s.finish_reason is None for s in seqs):
        llm.step()
    return (sum(s.num_generated for s in seqs) - done) / (time.perf_counter() - start)


def greedy_with_first_logits(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], np.ndarray]:
    firsts = []
    real = host_tokens.next_token

    def record(sampler, seq, row):
        if seq.num_generated == 0:
            firsts.append(row.copy())
        return real(sampler, seq, row)

    host_tokens.next_token = record
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True, speculative=False))
    finally:
        host_tokens.next_token = real
    return [o.token_ids for o in outs], np.stack(firsts)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of tokens generated before the first divergence, over all prompts."""
    same = 0
    for x, y in zip(a, b):
        same += next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x))
    return same / sum(len(x) for x in a)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="models/tandem-tiny-code,qwen3_5_150m")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    work = workdir(args.workdir, prefix="tandem-weights-")
    batches = [int(b) for b in args.batches.split(",")]
    print(f"machine: {machine()}; plain greedy decoding, {args.tokens} tokens, prompt 32")
    figures = {}
    for model in args.models.split(","):
        src = checkpoint(model, work)
        llms, sizes = {}, {}
        for fmt in FORMATS:
            built = build(src, work / f"{src.name}-{fmt}", weights=fmt, batch_sizes=tuple(batches), no_mtp=True,
                          max_seq_len=1024)
            sizes[fmt] = built.size_bytes
            llms[fmt] = LLM(built.engine_dir, RuntimeConfig(speculative=False, memory_budget_bytes=1 << 30))
        rng = np.random.default_rng(0)
        vocab = llms["float"].desc.vocab_size
        prompts = [[int(t) for t in rng.integers(3, vocab, 32)] for _ in range(max(batches))]
        reference = greedy_with_first_logits(llms["float"], prompts[:4], 48)
        print(f"\n{src.name}: format | engine MiB | " + " | ".join(f"b{b} tok/s (x float)" for b in batches)
              + " | greedy agreement | first-token logit diff / range")
        got = interleaved({(fmt, b): lambda _, llm=llms[fmt], rows=prompts[:b]: decode_speed(llm, rows, args.tokens)
                           for fmt in FORMATS for b in batches}, 3)      # interleaved: drift hits every format alike
        speeds = {fmt: {b: got[(fmt, b)] for b in batches} for fmt in FORMATS}
        figures[src.name] = {}
        for fmt in FORMATS:
            tokens, logits = greedy_with_first_logits(llms[fmt], prompts[:4], 48)
            diff = np.abs(logits - reference[1]).max() / np.abs(reference[1]).max()
            cols = []
            for b in batches:
                s = statistics.median(speeds[fmt][b])
                cols.append(f"{s:8.1f} ({s / statistics.median(speeds['float'][b]):.2f}x)")
            print(f"  {fmt:>6} | {sizes[fmt] / 2**20:10.1f} | " + " | ".join(cols)
                  + f" | {agreement(tokens, reference[0]):16.0%} | {diff:.3f}")
            figures[src.name][fmt] = {
                "engine_mib": sizes[fmt] / 2**20, "greedy_agreement": agreement(tokens, reference[0]),
                "first_logit_diff_over_range": float(diff),
                "tokens_per_s": {b: statistics.median(speeds[fmt][b]) for b in batches},
                "vs_float": {b: statistics.median(speeds[fmt][b]) / statistics.median(speeds["float"][b])
                             for b in batches}}
    return figures


if __name__ == "__main__":
    main()
