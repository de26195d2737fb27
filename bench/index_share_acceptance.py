"""The NextN draft's index share on and off: acceptance through the pipeline, on held-out text.

    .venv/bin/python bench/index_share_acceptance.py CKPT [--workdir DIR] [--prompts 16] [--prompt-len 64]
                                                     [--tokens 96] [--engines ON_DIR,OFF_DIR]

For one DeepSeek-V3.2 / GLM-5 checkpoint with a NextN layer (e.g. tools/train_dsa_model.py's), builds
two engine dirs that differ only in `BuildOptions.index_share` (on: draft steps >= 1 of the unified
round reuse the re-anchor pass's top-k; off: every step runs the lightning indexer), batch sizes 1
and 8, k = 3; --engines reuses built ones. With each, on --prompts windows of --prompt-len held-out
tokens (bench/quant_quality.held_out_windows: tools/train_small_model.py's held-out stream), decodes
--tokens tokens greedily, plain and speculative (k = 3 every round: adaptive width off), and prints the
accept length (tokens per verify round), per draft position i the share accepted given drafts 1..i-1
were, and on how many prompts speculative == plain. Round time both ways: bench/engine_ab.py ON OFF
--graph round_greedy_reused_k3 (interleaved calls); the wall time printed here is one run each, A then B.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkpoints import build  # noqa: E402
from bench.common import acceptance_per_position, machine  # noqa: E402
from bench.quant_quality import held_out_windows  # noqa: E402
from tandem.pipeline.llm import LLM, RuntimeConfig  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402

K = 3


@dataclass(frozen=True)
class Acceptance:
    accept_length: float        # tokens per verify round
    given: list[float]          # per draft position i: accepted given drafts 1..i-1 were
    rounds: int
    spec_equals_plain: int      # prompts whose speculative output is the plain greedy one
    spec_seconds: float         # wall time of the speculative run (one run: noisy)
    outputs: list[list[int]]
    per_prompt: list[float]     # each prompt's accept length (the paired comparison's samples)


def measure(engine_dir: Path, prompts: list[list[int]], tokens: int) -> Acceptance:
    llm = LLM(engine_dir, RuntimeConfig(memory_budget_bytes=1 << 30, spec_k=K, adaptive_width=False))
    plain = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True, speculative=False))
    t0 = time.perf_counter()
    spec = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    seconds = time.perf_counter() - t0
    accept_length, given, rounds = acceptance_per_position(spec, K, str(engine_dir))
    return Acceptance(accept_length, [round(g, 4) for g in given], rounds,
                      sum(s.token_ids == p.token_ids for s, p in zip(spec, plain)), seconds,
                      [r.token_ids for r in spec], [(r.metrics.accepted + r.metrics.rounds) / r.metrics.rounds
                                                    for r in spec])


def engine_dirs(ckpt: Path, work: Path, given: str | None, max_seq_len: int) -> dict[str, Path]:
    if given:
        on, off = given.split(",")
        return {"on": Path(on), "off": Path(off)}
    work.mkdir(parents=True, exist_ok=True)
    out = {}
    for mode in ("on", "off"):
        out[mode] = work / f"share_{mode}"
        t0 = time.time()
        build(ckpt, out[mode], batch_sizes=(1, 8), spec_k=K, max_seq_len=max_seq_len, index_share=mode == "on")
        print(f"built {out[mode]} in {time.time() - t0:.0f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/index_share_acceptance"))
    parser.add_argument("--engines", help="ON_DIR,OFF_DIR: engine dirs already built (share on, share off)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if not (args.checkpoint / "tokenizer.json").exists():
        raise SystemExit(f"{args.checkpoint}: no tokenizer.json; give a checkpoint written by tools/train_dsa_model.py")
    dirs = engine_dirs(args.checkpoint, args.workdir, args.engines, max_seq_len=1024)
    windows = held_out_windows(args.checkpoint / "tokenizer.json", args.prompts, args.prompt_len, args.seed).windows
    prompts = [w[: args.prompt_len].tolist() for w in windows]
    results = {mode: measure(d, prompts, args.tokens) for mode, d in dirs.items()}
    same = sum(a == b for a, b in zip(results["on"].outputs, results["off"].outputs))
    print(f"\n{machine()}; {len(prompts)} held-out prompts of {args.prompt_len} tokens, {args.tokens} new tokens, "
          f"k = {K}; outputs equal between the two: {same}/{len(prompts)}")
    print("| index share | accept length (rounds) | draft i accepted given 1..i-1 were | speculative == plain "
          "| speculative run s |")
    print("| --- | --- | --- | --- | --- |")
    for mode, r in results.items():
        print(f"| {mode} | {r.accept_length:.3f} ({r.rounds}) | {', '.join(f'{a:.3f}' for a in r.given)} "
              f"| {r.spec_equals_plain}/{len(prompts)} | {r.spec_seconds:.1f} |")
    # paired over prompts (same prompts, same outputs): the noise is the prompts' spread of the difference
    diff = np.array(results["on"].per_prompt) - np.array(results["off"].per_prompt)
    print(f"accept length on - off per prompt: mean {diff.mean():+.4f}, standard error "
          f"{diff.std(ddof=1) / np.sqrt(len(diff)):.4f}, prompts on > off / equal / < off: {(diff > 0).sum()} / "
          f"{(diff == 0).sum()} / {(diff < 0).sum()}")
    return {"prompts": len(prompts), "outputs_equal": same,
            "modes": {mode: {"accept_length": r.accept_length, "given": r.given, "rounds": r.rounds,
                             "spec_equals_plain": r.spec_equals_plain, "spec_seconds": r.spec_seconds}
                      for mode, r in results.items()},
            "accept_length_on_minus_off": {"mean": float(diff.mean()),
                                           "standard_error": float(diff.std(ddof=1) / np.sqrt(len(diff)))}}


if __name__ == "__main__":
    main()
