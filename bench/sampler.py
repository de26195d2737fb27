"""The host sampler's cost per token and row: numpy's and the native one, against sorting every row
(numpy's computation before it partitioned), in one process.

    .venv/bin/python bench/sampler.py [--vocab 384 4096 32000 151936] [--rows 1 8] [--rounds 5] [--json OUT]

Per vocabulary size, setting (temperature only; top-k 50; top-p 0.95; top-k 40 with top-p 0.95) and
batch of sampled rows: `pipeline/sampler.sample_rows` over language-model-like logits (Zipf
log-probabilities, testing/sampling_reference.lm_like_logits) against the sorted reference
(testing/sampling_reference.sorted_sample, one row at a time), alternated, the best of `--rounds`
windows each; reports µs per row-token for both and their ratio. Both must give the same tokens
(checked). The native sampler (plugins/cpu/sampler.cc, what the pipeline draws with where the engine
dir's kernel library has it; the library is built here if the kernel cache lacks it) runs alternated
with them, its tokens counted where they differ from numpy's (rounding at a boundary between two
tokens; none is expected on these rows). The sampler's time is host time in every plain decode
step and burst step with a sampled row; at batch 8 on a 150k vocabulary numpy's sorted form took
more than a 150M model's step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ helpers
from bench.common import machine  # noqa: E402
from tandem.pipeline.native_sampler import NativeSampler  # noqa: E402
from tandem.pipeline.sampler import sample_rows, uniforms  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402
from tandem.plugins import cpu_kernels  # noqa: E402
from tandem.testing.sampling_reference import lm_like_logits, sorted_sample  # noqa: E402

SETTINGS = {"T 0.8": (0.8, 0, 1.0), "T 0.8, top-k 50": (0.8, 50, 1.0), "T 0.8, top-p 0.95": (0.8, 0, 0.95),
            "T 0.8, top-k 40, top-p 0.95": (0.8, 40, 0.95)}


def best_us(fn, calls: int, rounds: int) -> list[float]:
    """µs per call of fn in each of `rounds` windows of `calls` calls."""
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append(1e6 * (time.perf_counter() - start) / calls)
    return out


def compare(logits: np.ndarray, u: np.ndarray, setting: tuple, calls: int, rounds: int,
            native: NativeSampler | None) -> dict | None:
    """µs per row-token of the sampler, the sorted reference and the native sampler, alternated
    (None: numpy's and the reference disagree), and the native tokens that differ from numpy's."""
    t, k, p = setting
    params = [SamplingParams(temperature=t, top_k=k, top_p=p)] * len(logits)

    def fast():
        return sample_rows(logits, params, u).tolist()

    def slow():
        return [sorted_sample(row, t, k, p, float(x)) for row, x in zip(logits, u)]

    def own():
        return native.sample(logits, params, u).tolist()

    tokens = fast()
    if tokens != slow():
        return None
    times = {"sampler": [], "sorted": [], **({"native": []} if native else {})}
    for _ in range(rounds):
        times["sampler"] += best_us(fast, calls, 1)
        times["sorted"] += best_us(slow, max(1, calls // 4), 1)
        if native:
            times["native"] += best_us(own, calls, 1)
    differ = sum(a != b for a, b in zip(tokens, own())) if native else None
    return {**{key: min(v) / len(logits) for key, v in times.items()}, "native_differ": differ}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[384, 4096, 32000, 151936])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    library = cpu_kernels.library()
    native = NativeSampler(library) if library else None
    print(f"{machine()}; µs per row-token, best of {args.rounds} alternated windows"
          + ("" if native else "; no C++ compiler: no native sampler"))
    rng, report = np.random.default_rng(0), []
    for vocab in args.vocab:
        calls = max(2, 400_000 // vocab)
        for rows in args.rows:
            logits = np.stack([lm_like_logits(rng, vocab, 3.0) for _ in range(rows)])
            u = uniforms([1], np.arange(rows)[None])[0]
            for name, setting in SETTINGS.items():
                us = compare(logits, u, setting, calls, args.rounds, native)
                if us is None:
                    raise SystemExit(f"vocab {vocab}, {name}: the sampler and the sorted reference disagree")
                differ = us.pop("native_differ")
                report.append({"vocab": vocab, "rows": rows, "setting": name, "native_tokens_differ": differ,
                               **{f"{k}_us": v for k, v in us.items()}})
                line = (f"  vocab {vocab:>7}, {rows} rows, {name:28s} sampler {us['sampler']:9.1f}  "
                        f"sorted {us['sorted']:9.1f}  ({us['sorted'] / us['sampler']:5.1f}x)")
                if native:
                    line += (f"  native {us['native']:8.1f}  ({us['sampler'] / us['native']:5.1f}x numpy's; "
                             f"{differ} tokens differ)")
                print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "results": report}, indent=1))
    return {"results": report}


if __name__ == "__main__":
    main()
