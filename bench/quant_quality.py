"""Quality of the weight-only int8 / int4 engines on held-out text, measured by running the engines.

    .venv/bin/python bench/quant_quality.py [--model models/tandem-tiny-code] [--formats float,int8,int4,int4:64]
                                            [--windows 320] [--seq 256] [--prompts 16] [--tokens 48]
                                            [--workdir DIR] [--engines int8=DIR,...]

For one checkpoint (default the shipped model) builds one engine dir per format (`FMT` or
`FMT:BLOCK` for --quant-block; batch sizes 1 and 8, max_seq_len 1024, MTP heads included;
--engines reuses existing dirs), then with each:
- held-out next-token loss (nats/token) from the target engine's logits at every row of the prefill
  chunks, teacher-forced over the same windows for every format. The held-out stream and the windows
  are tools/train_small_model.py's (`stdlib_files`, `encode`, and `evaluate`'s draws: seed 0, 8
  windows per draw), so the defaults (320 windows of 256) are the positions of the model card's
  held-out loss (81,920), which the float engines should reproduce up to float rounding;
- top-1 agreement with float: the share of those positions where argmax(format) == argmax(float);
- greedy agreement as bench/weight_formats.py defines it (tokens before the first divergence from
  float's greedy output), on --prompts prompts of 32 held-out tokens, --tokens tokens each;
- the MTP heads' acceptance in speculative greedy decoding of the same prompts, every round drafting
  3 tokens (fixed k, adaptive width off): the mean accept length (tokens per verify round) and, per
  draft position i, the share of drafts accepted given drafts 1..i-1 were (the model card's
  definition, there teacher-forced); and on how many prompts speculative output equals plain greedy;
- the row-count drift: the largest difference, over the plain greedy tokens, between the log p the
  1-row decode step gave the token it chose and the log p a prefill chunk over prompt + output gives
  it, same engines (float: rounding only; a drift above a near-tie's margin lets a verify call, which
  has k + 1 rows, pick another token than plain decoding would).

torch is imported only for the held-out split helpers; every figure comes from ONNX Runtime engines.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkpoints import build, workdir  # noqa: E402
from bench.common import acceptance_per_position, machine  # noqa: E402
from bench.weight_formats import agreement  # noqa: E402
from tandem import contract as c  # noqa: E402
from tandem.pipeline import host_tokens  # noqa: E402
from tandem.pipeline.llm import LLM, RuntimeConfig  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402
from tools.train_small_model import MTP_LAYERS, encode, read, stdlib_files  # noqa: E402

PER_DRAW = 8    # windows per draw of train_small_model.evaluate's generator


@dataclass(frozen=True)
class Format:
    weights: str            # float, int8, int4
    block: int = 32         # --quant-block (ignored for float)

    @property
    def label(self) -> str:
        return "float" if self.weights == "float" else f"{self.weights}:{self.block}"

    @classmethod
    def parse(cls, text: str) -> Format:
        weights, _, block = text.partition(":")
        try:
            return cls(weights, int(block) if block else 32)
        except ValueError as e:
            raise SystemExit(f"--formats {text!r}: write FORMAT or FORMAT:BLOCK, e.g. int4:64") from e


@dataclass(frozen=True)
class Quality:
    loss: float                 # nats/token over every window position
    argmax: np.ndarray          # [windows, seq] argmax of the logits at each position
    greedy: list[list[int]]     # plain greedy tokens per prompt
    accept_length: float        # speculative: tokens per verify round
    acceptance: list[float]     # speculative, per draft position i: accepted given drafts 1..i-1 were
    rounds: int                 # speculative: verify rounds the acceptance figures count
    spec_equals_plain: int      # prompts whose speculative output is the plain greedy output
    rows_drift: float           # largest |log p| difference of a greedy token: 1-row decode step vs prefill chunk


@dataclass(frozen=True)
class HeldOut:
    windows: np.ndarray         # [windows, seq + 1] token ids: each window's inputs and next tokens
    stream_tokens: int          # the whole held-out stream (the model card gives its count)


def held_out_windows(tokenizer_file: Path, windows: int, seq: int, seed: int) -> HeldOut:
    """evaluate()'s windows of the held-out stream, in its order."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    held = encode(tok, read(stdlib_files()[1]), tok.token_to_id("<|endoftext|>"))
    rng = np.random.default_rng(seed)
    starts = np.concatenate([rng.integers(0, len(held) - seq - MTP_LAYERS - 2, PER_DRAW)
                             for _ in range(-(-windows // PER_DRAW))])[:windows]
    return HeldOut(np.stack([held[s : s + seq + 1] for s in starts]).astype(np.int64), len(held))


def teacher_forced(llm: LLM, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nll, argmax), each [windows, seq]: every prefill row's logits, read as the engine's own
    prefill runs (plain decoding, one token generated per window so each is prefilled once)."""
    n, seq = windows.shape[0], windows.shape[1] - 1
    nll, top = np.full((n, seq), np.nan), np.full((n, seq), -1, np.int64)
    index: dict[str, int] = {}
    real = llm.runner.target_step

    def record(rows, **kwargs):
        outs = real(rows, **kwargs)
        by_slot = {s.slot: s for s in llm.scheduler.running}
        for r, logits in zip(rows, outs.arrays[c.LOGITS]):
            w, a, k = index[by_slot[r.slot].request_id], r.context, len(r.ids)
            x = logits[:k].astype(np.float64)                                  # [k, V]
            m = x.max(-1)
            lse = m + np.log(np.exp(x - m[:, None]).sum(-1))
            nll[w, a : a + k] = lse - x[np.arange(k), windows[w, a + 1 : a + k + 1]]
            top[w, a : a + k] = x.argmax(-1)
        return outs

    llm.runner.target_step = record
    try:
        params = SamplingParams(max_tokens=1, ignore_eos=True, speculative=False)
        seqs = [llm.add_request(ids.tolist(), params) for ids in windows[:, :seq]]
        index.update({s.request_id: w for w, s in enumerate(seqs)})
        while llm.scheduler.has_work():
            llm.step()
    finally:
        llm.runner.target_step = real
    if np.isnan(nll).any():
        raise RuntimeError(f"{int(np.isnan(nll).sum())} positions were never prefilled: the runner's rows did not "
                           "cover every window")
    # the engine's own first token is the last row's argmax: rows were attributed to the right windows
    wrong = [w for w, s in enumerate(seqs) if s.tokens[-1] != top[w, -1]]
    if wrong:
        raise RuntimeError(f"windows {wrong[:5]}: the token generated after the prompt is not the argmax recorded for "
                           "its last row; the rows were attributed to the wrong windows")
    return nll, top


def measure(engine_dir: Path, windows: np.ndarray, prompts: list[list[int]], tokens: int) -> Quality:
    # every round drafts MTP_LAYERS tokens (the adaptive width would pick widths from timings)
    # one token a step: every greedy row passes host_tokens.next_tokens (greedy_with_drift records there)
    llm = LLM(engine_dir, RuntimeConfig(memory_budget_bytes=1 << 30, spec_k=MTP_LAYERS, adaptive_width=False,
                                       decode_burst=1))
    nll, top = teacher_forced(llm, windows)
    plain, drift = greedy_with_drift(llm, prompts, tokens)
    spec = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    accept_length, given, rounds = acceptance_per_position(spec, MTP_LAYERS, str(engine_dir))
    return Quality(float(nll.mean()), top, [r.token_ids for r in plain], accept_length, given, rounds,
                   sum(s.token_ids == p.token_ids for s, p in zip(spec, plain)), drift)


def _log_softmax_max(logits: np.ndarray) -> np.ndarray:
    """log p of each row's argmax token, [n, V] -> [n]."""
    x = logits.astype(np.float64)
    m = x.max(-1)
    return -np.log(np.exp(x - m[:, None]).sum(-1))


def greedy_with_drift(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[list, float]:
    """Plain greedy outputs, and how far the same engines' log p of each greedy token moves between
    the 1-row decode step that chose it and a prefill chunk over prompt + output (many rows per call)."""
    chosen: dict[str, list[float]] = {}
    real = host_tokens.next_tokens

    def record(sampler, seqs, logits):
        for seq, lp in zip(seqs, _log_softmax_max(logits)):
            chosen.setdefault(seq.request_id, []).append(float(lp))
        return real(sampler, seqs, logits)

    host_tokens.next_tokens = record
    try:
        plain = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True, speculative=False))
    finally:
        host_tokens.next_tokens = real
    n = len(prompts[0])
    if any(len(p) != n for p in prompts):
        raise ValueError("greedy_with_drift: prompts of one length, so the prefill windows line up")
    nll, _ = teacher_forced(llm, np.array([r.prompt_token_ids + r.token_ids for r in plain]))
    # decode step j fed token j at position n + j and chose token j + 1: nll column n + j
    decode = np.array([chosen[r.request_id] for r in plain])                  # [prompts, tokens - 1]
    return plain, float(np.abs(-nll[:, n : n + decode.shape[1]] - decode).max())


def engine_dir_for(fmt: Format, src: Path, work: Path, given: dict[str, str]) -> Path:
    if fmt.label in given:
        return Path(given[fmt.label])
    t = time.perf_counter()
    built = build(src, work / f"{src.name}-{fmt.label.replace(':', '-b')}", weights=fmt.weights, quant_block=fmt.block,
                  batch_sizes=(1, 8), max_seq_len=1024)
    print(f"  built {fmt.label}: {built.size_bytes / 2**20:.1f} MiB in {time.perf_counter() - t:.0f} s", flush=True)
    return built.engine_dir


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tandem-tiny-code")
    parser.add_argument("--formats", default="float,int8,int4,int4:64")
    parser.add_argument("--windows", type=int, default=320)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--engines", default="", help="existing engine dirs, e.g. float=DIR,int4:64=DIR")
    args = parser.parse_args(argv)
    src = Path(args.model)
    if not (src / "tokenizer.json").is_file():
        raise SystemExit(f"{src / 'tokenizer.json'} not found: --model must be a checkpoint folder trained on the "
                         "stdlib split of tools/train_small_model.py (e.g. models/tandem-tiny-code)")
    formats = [Format.parse(f) for f in args.formats.split(",")]
    if formats[0].weights != "float":
        raise SystemExit(f"--formats {args.formats}: the first must be float, the reference of the agreements")
    given = {}
    for kv in filter(None, args.engines.split(",")):
        label, sep, folder = kv.partition("=")
        if not sep or not (Path(folder) / "manifest.json").is_file():
            raise SystemExit(f"--engines {kv!r}: write FORMAT=ENGINE_DIR, the folder holding manifest.json")
        given[Format.parse(label).label] = folder
    work = workdir(args.workdir, prefix="tandem-quant-quality-")
    held = held_out_windows(src / "tokenizer.json", args.windows, args.seq, args.seed)
    windows = held.windows
    prompts = [w[:32].tolist() for w in windows[: args.prompts]]
    print(f"machine: {machine()}; {src}: held-out stream {held.stream_tokens:,} tokens, {windows.shape[0]} windows x "
      f"{args.seq} = "
          f"{windows.shape[0] * args.seq:,} positions; greedy and speculative: {len(prompts)} prompts of 32, "
          f"{args.tokens} tokens", flush=True)
    results: dict[str, Quality] = {}
    for fmt in formats:
        engine_dir = engine_dir_for(fmt, src, work, given)
        t = time.perf_counter()
        results[fmt.label] = measure(engine_dir, windows, prompts, args.tokens)
        print(f"  measured {fmt.label} in {time.perf_counter() - t:.0f} s", flush=True)
    ref = results["float"]
    print("\nformat | held-out loss (nats/token) | top-1 agreement with float | greedy agreement with float"
          " | accept length (rounds) | draft i accepted given 1..i-1 were | prompts speculative == plain"
          " | log p drift, 1 row vs chunk")
    for label, q in results.items():
        print(f"{label:>7} | {q.loss:.5f} ({q.loss - ref.loss:+.5f}) | {(q.argmax == ref.argmax).mean():.2%}"
              f" | {agreement(q.greedy, ref.greedy):.0%} | {q.accept_length:.2f} ({q.rounds})"
              f" | {', '.join(f'{a:.3f}' for a in q.acceptance)} | {q.spec_equals_plain}/{len(prompts)}"
              f" | {q.rows_drift:.1e}")
    return {"positions": int(windows.shape[0] * args.seq), "prompts": len(prompts), "formats": {
        label: {"loss": q.loss, "top1_agreement": float((q.argmax == ref.argmax).mean()),
                "greedy_agreement": agreement(q.greedy, ref.greedy), "accept_length": q.accept_length,
                "acceptance": q.acceptance, "rounds": q.rounds, "spec_equals_plain": q.spec_equals_plain,
                "rows_drift": q.rows_drift} for label, q in results.items()}}


if __name__ == "__main__":
    main()
