"""Decode speed with speculative decoding off and on (ONNX Runtime CPU).

    .venv/bin/python bench/pipeline.py [--kinds qwen3_5_mtp3,qwen3_5_150m] [--acceptance 0.7] [--workdir DIR]
                                       [--dtype float32|float16] [--weights float|int8|int4] [--fixed-width]
                                       [--draft-weights auto|same|int8] [--tokens N]
    .venv/bin/python bench/pipeline.py --kinds models/tandem-tiny-code --acceptance model --dtype float16

Random weights accept nothing, so speculative runs use the documented synthetic-acceptance aid
(drafts accepted with the given probability; tokens are not the model's); `--acceptance model`
uses the heads' own drafts (for trained checkpoints). A kind may be a checkpoint folder. Prints
the build (seconds, engine dir size), tokens/s off and on at batch 1 and 8, accept length, host
overhead per round, and the measured speedup next to the bound accept_length x t_decode / t_round.
Decode only: the first step (prefill) is excluded.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkpoints import build, checkpoint, workdir  # noqa: E402
from bench.common import accept_length, machine, wait_for_engines  # noqa: E402
from tandem.pipeline.llm import LLM, RuntimeConfig  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402


def measure(engine_dir: Path, batch: int, spec: bool, acceptance: float | None, max_tokens: int, prompt_len: int,
            threads: int | None, adaptive: bool = True) -> dict:
    """acceptance None: the heads' own drafts. adaptive False: every round at the widest width."""
    config = RuntimeConfig(speculative=spec, synthetic_acceptance=acceptance if spec else None, threads=threads,
                          memory_budget_bytes=1 << 30, adaptive_width=adaptive)
    llm = LLM(engine_dir, config)
    rng = np.random.default_rng(0)
    vocab = llm.desc.vocab_size
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    # warm-up: a request as long as the measured ones, so the adaptive width has tried its widths (their
    # engines open in the background when first wanted), then those opens finish before the timing
    llm.generate([[int(t) for t in rng.integers(0, vocab, prompt_len)]] * batch,
                 SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    wait_for_engines(llm)
    seqs = [llm.add_request([int(t) for t in rng.integers(0, vocab, prompt_len)], params) for _ in range(batch)]
    llm.step()  # prefill (+ first round): excluded
    start_tokens = sum(s.num_generated for s in seqs)
    rounds0, round_s0, engine_s0 = llm.round_loop.stats.rounds, llm.round_loop.stats.round_seconds, \
        llm.round_loop.stats.engine_seconds
    t = time.perf_counter()
    while any(s.finish_reason is None for s in seqs):
        llm.step()
    wall = time.perf_counter() - t
    tokens = sum(len(s.output_ids()) for s in seqs) - start_tokens
    st = llm.round_loop.stats
    rounds = st.rounds - rounds0
    round_s = st.round_seconds - round_s0
    engine_s = st.engine_seconds - engine_s0
    return {"tok_s": tokens / wall, "t_round": round_s / rounds, "host_share": 1 - engine_s / round_s,
            "accept_length": accept_length(seqs)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="qwen3_5_mtp3,qwen3_5_150m")
    parser.add_argument("--acceptance", default="0.7", help="synthetic acceptance in [0, 1], or 'model'")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--dtype", default="float32", help="engine dtype: float32 or float16")
    parser.add_argument("--weights", default="float", help="linear layers: float (the dtype), int8 or int4")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--draft-weights", default="auto",
                        help="the heads' linear layers and lm_head: auto, same or int8 (BuildOptions)")
    parser.add_argument("--fixed-width", action="store_true", help="adaptive width off: every round drafts k")
    parser.add_argument("--tokens", type=int, default=None,
                        help="new tokens per sequence (default 48 for 150M kinds, else 96); the adaptive width "
                             "settles over the warm-up request, which is as long")
    args = parser.parse_args(argv)
    acceptance = None if args.acceptance == "model" else float(args.acceptance)
    work = workdir(args.workdir)
    print(f"machine: {machine()}; acceptance {args.acceptance}, k = {args.k}, dtype {args.dtype}, "
          f"weights {args.weights}")
    figures = {}
    for kind in args.kinds.split(","):
        src = checkpoint(kind, work)
        kind = src.name
        engines = work / f"{kind}-engines-k{args.k}-{args.dtype}-{args.weights}-{args.draft_weights}"
        built = build(src, engines, batch_sizes=(1, 8), spec_k=args.k, prefill_chunk=64, max_seq_len=1024,
                      dtype=args.dtype, weights=args.weights, draft_weights=args.draft_weights)
        figures[kind] = {"build_seconds": built.seconds, "engine_mib": built.size_bytes / 2**20, "batches": {}}
        print(f"\n{kind} ({args.dtype}, {args.weights} weights): build {built.status} in {built.seconds:.1f} s, "
              f"engine dir {built.size_bytes / 2**20:.1f} MiB")
        max_tokens = args.tokens or (48 if "150m" in kind else 96)
        print(f"{kind}:  batch | off tok/s  t_decode ms host% | on tok/s  t_round ms host%  accept_len | "
              f"speedup  bound  speedup/bound")
        for batch in (1, 8):
            off = measure(engines, batch, False, acceptance, max_tokens, 32, args.threads)
            on = measure(engines, batch, True, acceptance, max_tokens, 32, args.threads, not args.fixed_width)
            speedup = on["tok_s"] / off["tok_s"]
            bound = on["accept_length"] * off["t_round"] / on["t_round"]
            figures[kind]["batches"][batch] = {"off": off, "on": on, "speedup": speedup, "bound": bound}
            print(f"  {batch:>19} | {off['tok_s']:9.1f}  {off['t_round'] * 1e3:10.2f} {off['host_share'] * 100:4.1f} | "
                  f"{on['tok_s']:8.1f}  {on['t_round'] * 1e3:10.2f} {on['host_share'] * 100:4.1f}  "
                  f"{on['accept_length']:10.2f} | {speedup:7.2f}  {bound:5.2f}  {speedup / bound:6.0%}")
    return figures


if __name__ == "__main__":
    main()
