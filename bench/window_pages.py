"""KV pages one sequence holds per page group (full attention vs each sliding window) as it grows.

    .venv/bin/python bench/window_pages.py [--kinds step3p5,step3p5_150m] [--at 64,512,2048] [--workdir DIR]

Builds engines for each kind (a Step-3.5 bench or tiny kind, or a checkpoint folder), runs one
speculative sequence (synthetic acceptance 0.7, k = 3: the rows in flight and the heads' lag of a
real round) and prints the pages it holds in each group when its length reaches each mark, next to
what a single full-attention table would hold, and the bytes both come to. Pages out of a window
go back while the sequence runs (pipeline/allocator.py), so the window groups stay flat.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkpoints import build, checkpoint, workdir  # noqa: E402
from bench.common import machine  # noqa: E402
from tandem.pipeline.llm import LLM, RuntimeConfig  # noqa: E402
from tandem.pipeline.sampling_params import SamplingParams  # noqa: E402


def held_at(engine_dir: Path, marks: list[int], prompt_len: int = 16) -> tuple[LLM, dict[int, dict[str, int]]]:
    """Pages held per block-table input (page group) when the sequence first reaches each mark."""
    llm = LLM(engine_dir, RuntimeConfig(synthetic_acceptance=0.7, max_num_seqs=1, memory_budget_bytes=2 << 30))
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, llm.desc.vocab_size, prompt_len)]
    seq = llm.add_request(prompt, SamplingParams(max_tokens=max(marks) - prompt_len + 8, ignore_eos=True))
    out, todo = {}, sorted(marks)
    while todo and seq.finish_reason is None:
        llm.step()
        while todo and len(seq.tokens) >= todo[0]:
            out[todo.pop(0)] = llm.pages_held()
    return llm, out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="step3p5,step3p5_150m")
    parser.add_argument("--at", default="64,512,2048")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    marks = [int(x) for x in args.at.split(",")]
    work = workdir(args.workdir, prefix="tandem-pages-")
    print(f"machine: {machine()}; one sequence, speculative (synthetic acceptance 0.7, k = 3)")
    figures = {}
    for kind in args.kinds.split(","):
        src = checkpoint(kind, work, dtype="float32")
        engines = work / f"{src.name}-pages-engines"
        build(src, engines, batch_sizes=(1,), spec_k=3, prefill_chunk=64, page_size=16, max_seq_len=max(marks) + 64)
        llm, held = held_at(engines, marks)
        sizes = page_bytes_per_group(llm)
        print(f"\n{src.name}: page size {llm.page_size}; bytes per page " +
              ", ".join(f"{'full' if w is None else f'window {w}'} {b / 1024:.0f} KiB" for w, b in sizes.items()))
        print("  tokens | " + " | ".join(held[marks[0]]) + " | one table for all (pages) | KV MiB: groups / one table")
        one_page = sum(sizes.values())
        figures[src.name] = {"page_size": llm.page_size, "page_bytes": {str(w): b for w, b in sizes.items()},
                             "held": held}
        for mark, per_group in held.items():
            full = max(per_group.values())   # a single table holds every layer's rows on each page
            mib = sum(n * sizes[_window(name)] for name, n in per_group.items()) / 2**20
            print(f"  {mark:>6} | " + " | ".join(f"{n:>{len(name)}}" for name, n in per_group.items()) +
                  f" | {full:>25} | {mib:.2f} / {full * one_page / 2**20:.2f}")
    return figures


def page_bytes_per_group(llm: LLM) -> dict[int | None, int]:
    """Bytes of one page of each group: its pools' rows (trunk and heads) x page size."""
    out: dict[int | None, int] = {}
    for cache in llm.desc.layer_caches(llm.mtp_layers):
        for p in cache.paged:
            out[p.window] = out.get(p.window, 0) + llm.page_size * p.row_bytes(np.dtype(llm.dtype).itemsize)
    return out


def _window(table_name: str) -> int | None:
    return int(table_name.rsplit("window", 1)[1]) if "window" in table_name else None


if __name__ == "__main__":
    main()
