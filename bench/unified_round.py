"""The unified round against the multi-call round and plain decoding, same run, same engine dir
(ONNX Runtime CPU): engine calls per decode step, decode tok/s, host share of a step, accept length.

    .venv/bin/python bench/unified_round.py [--kinds qwen3_5_mtp3,models/tandem-tiny-code] [--k 3]
                                            [--batches 1,8] [--max-tokens 96] [--workdir DIR]

Drafts are the heads' own (no synthetic acceptance: that aid runs the multi-call path only), the
width fixed at k + 1 (no adaptive width, no per-batch defaults: the same rounds in both paths).
A kind may be a checkpoint folder. Decode only: the prefill step is excluded.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkpoints import build, checkpoint, workdir  # noqa: E402
from bench.common import accept_length, machine  # noqa: E402
from tandem.pipeline.llm import LLM, RuntimeConfig  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402

MODES = {"plain": dict(speculative=False), "multi": dict(round="multi"), "unified": dict(round="unified")}


def measure(engine_dir: Path, mode: str, batch: int, k: int, max_tokens: int, prompt_len: int) -> dict:
    fixed = {"adaptive_width": False} if "adaptive_width" in RuntimeConfig.__dataclass_fields__ else {}
    llm = LLM(engine_dir, RuntimeConfig(memory_budget_bytes=1 << 30, spec_k=k, **fixed, **MODES[mode]))
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, llm.desc.vocab_size, prompt_len)] for _ in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))          # warm-up: every graph used
    seqs = [llm.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    llm.step()                                                                      # prefill: excluded
    st, calls0 = llm.round_loop.stats, sum(llm.runner.calls.values())
    start = (st.rounds, st.round_seconds, st.engine_seconds, sum(s.num_generated for s in seqs))
    t = time.perf_counter()
    while any(s.finish_reason is None for s in seqs):
        llm.step()
    wall = time.perf_counter() - t
    rounds, round_s, engine_s = st.rounds - start[0], st.round_seconds - start[1], st.engine_seconds - start[2]
    tokens = sum(len(s.output_ids()) for s in seqs) - start[3]
    return {"tok_s": tokens / wall, "calls": (sum(llm.runner.calls.values()) - calls0) / rounds,
            "host": 1 - engine_s / round_s, "t_round": round_s / rounds, "accept": accept_length(seqs)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="qwen3_5_mtp3,models/tandem-tiny-code")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    work = workdir(args.workdir)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"machine: {machine()}; k = {args.k}, width {args.k + 1}, the heads' own drafts")
    figures = {}
    for kind in args.kinds.split(","):
        src = checkpoint(kind, work)
        engines = work / f"{src.name}-engines-k{args.k}"
        built = build(src, engines, batch_sizes=tuple(batches), spec_k=args.k, prefill_chunk=64, max_seq_len=1024)
        figures[src.name] = {}
        print(f"\n{src.name}: build {built.status} in {built.seconds:.1f} s")
        print("  batch  mode     calls/step  tok/s   t_step ms  host%  accept_len  vs plain")
        for batch in batches:
            got = {mode: measure(engines, mode, batch, args.k, args.max_tokens, 32) for mode in MODES}
            figures[src.name][batch] = {mode: {**r, "vs_plain": r["tok_s"] / got["plain"]["tok_s"]}
                                        for mode, r in got.items()}
            for mode, r in got.items():
                print(f"  {batch:>5}  {mode:<8} {r['calls']:10.2f}  {r['tok_s']:6.1f}  {r['t_round'] * 1e3:9.2f}  "
                      f"{r['host'] * 100:5.1f}  {r['accept']:10.2f}  {r['tok_s'] / got['plain']['tok_s']:7.2f}x")
    return figures


if __name__ == "__main__":
    main()
