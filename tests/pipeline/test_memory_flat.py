"""No memory growth per request: thousands of engine calls through the real pipeline, and RSS
after warm-up stays flat. (It grew by every request's KV pages while a first-in-first-out free
list cycled through the lazily mapped pools; see pipeline/allocator.py.)"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from tandem.pipeline.allocator import FreeList

try:
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:  # numpy 1.x
    from numpy.core.multiarray import _set_madvise_hugepage
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def test_free_list_reuses_freed_items_before_fresh_ones():
    pages = FreeList(1000, "KV page")
    rng = np.random.default_rng(0)
    held: list[list[int]] = []
    peak = 0
    for _ in range(2000):   # random traffic, under 40 pages held at once
        if held and (sum(map(len, held)) > 30 or rng.random() < 0.5):
            pages.free(held.pop(int(rng.integers(len(held)))))
        else:
            held.append(pages.allocate(int(rng.integers(1, 10))))
        in_use = sum(map(len, held))
        peak = max(peak, in_use)
        assert pages.num_free == 999 - in_use
        assert len({p for t in held for p in t}) == in_use      # never handed out twice
    assert pages.ever_used == peak
    assert 0 not in {p for t in held for p in t}                 # scratch stays out


@pytest.fixture
def small_os_pages():
    """numpy advises huge pages for large arrays, so RSS moves in 2 MiB steps per pool array;
    with 4 KiB pages RSS counts the bytes touched."""
    before = _set_madvise_hugepage(False)
    yield
    _set_madvise_hugepage(before)


def test_rss_flat_over_thousands_of_engine_calls(engine_dirs, small_os_pages):
    # default budget: a large pool; fixed widths: the adaptive width's probes open engines when first
    # wanted (RoundLoop._open_width), a one-time allocation whose timing the machine's load decides; no
    # prefix cache: it keeps finished requests' pages until the pool is full (tests/pipeline/test_prefix_cache.py
    # holds RSS flat once it is)
    llm = LLM(engine_dirs["qwen3_5_mtp3"], RuntimeConfig(adaptive_width=False, prefix_cache=False))
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    batch, prompt_len, half = 8, 32, 20

    def run(n: int) -> None:
        for _ in range(n):
            llm.generate([[int(t) for t in rng.integers(3, 300, prompt_len)] for _ in range(batch)], params)

    run(5)                                                       # warm-up: every binding, allocator arenas
    calls0 = sum(llm.runner.calls.values())
    run(half)
    mid = _rss()
    run(half)
    grown = _rss() - mid
    calls = sum(llm.runner.calls.values()) - calls0
    # what handing out never-used pages would fault in over the second half: every request's pages
    page_bytes = sum(a[0].nbytes for pools in llm.pools.paged.values() for a in (pools["key"], pools["value"]))
    fresh = half * batch * -(-(prompt_len + params.max_tokens + llm.spec_k + 1) // llm.page_size) * page_bytes
    # the test can see the bug it guards (unified rounds: one engine call per decode step, ~900 here)
    assert calls >= 500 and fresh >= 8 << 20
    assert grown < fresh / 8, (f"RSS grew {grown / 2**20:.1f} MiB over the last {calls // 2} engine calls "
                               f"(never-used pages would add {fresh / 2**20:.1f} MiB)")
