"""The prefix cache under pressure: thousands of multi-turn requests on a small KV pool, RSS as they
go. The cache fills within the first conversations and then evicts its least recently used entries;
RSS should stay flat and every request should run.

    .venv/bin/python bench/prefix_cache_memory.py ENGINE_DIR [--requests 2000] [--budget-mb 8]

Conversations of four at once, five turns each: every turn's prompt is the last prompt, its answer (16
tokens) and 8 new tokens. Prints RSS (MiB) every 200 requests and the cache's counters.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import numpy as np

from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams


def rss_mib() -> float:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine_dir")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--budget-mb", type=float, default=8)
    args = parser.parse_args(argv)
    llm = LLM(args.engine_dir, RuntimeConfig(memory_budget_bytes=int(args.budget_mb * 2**20)))
    rng = np.random.default_rng(0)
    vocab = llm.desc.vocab_size
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    done, start, rss = 0, time.perf_counter(), {}
    while done < args.requests:
        history = [[int(x) for x in rng.integers(3, vocab, 40)] for _ in range(4)]
        for _ in range(5):
            for i, r in enumerate(llm.generate(history, params)):
                history[i] = history[i] + r.token_ids + [int(x) for x in rng.integers(3, vocab, 8)]
                done += 1
                if done % 200 == 0:
                    rss[done] = rss_mib()
                    print(f"{done} requests: RSS {rss[done]:.1f} MiB", flush=True)
    s, seconds = llm.prefix_cache.stats, time.perf_counter() - start
    print(f"{done} requests in {seconds:.0f} s; prefix cache: {s.hits} of {s.queries} prompt "
          f"tokens restored, {s.entries_made} entries made, {s.evicted} evicted")
    return {"requests": done, "seconds": seconds, "rss_mib": rss, "restored": s.hits, "queried": s.queries,
            "entries_made": s.entries_made, "evicted": s.evicted}


if __name__ == "__main__":
    main()
