"""LLM.stats(): the moment's load and the counters so far, in one call, for the server's gauges and a
replica router (which no longer read the scheduler, the page groups or the engine's counters)."""

from __future__ import annotations

from tandem.pipeline.llm import LLM
from tandem.pipeline.sampling_params import SamplingParams

PROMPT = [5, 17, 33, 200, 7, 64, 91, 3, 8, 9, 12, 40, 41, 42, 43, 44, 45, 46, 47, 48]


def test_stats_follow_the_requests(engine_dirs):
    llm = LLM(engine_dirs["qwen3_5_mtp3"])
    idle = llm.stats()
    assert (idle.running, idle.waiting, sum(idle.pages_held.values())) == (0, 0, 0)
    assert idle.kv_pages_free == idle.kv_pages_total > 0 and idle.prefix_caching
    seqs = [llm.add_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True)) for _ in range(2)]
    assert llm.stats().waiting == 2
    llm.step()
    busy = llm.stats()
    assert busy.running == 2 and busy.waiting == 0 and sum(busy.pages_held.values()) > 0
    assert busy.kv_pages_free < idle.kv_pages_free and busy.kv_pages_total == idle.kv_pages_total
    while any(s.finish_reason is None for s in seqs):
        llm.step()
    llm.generate([PROMPT], SamplingParams(max_tokens=2))       # the same prompt again: a prefix hit
    done = llm.stats()
    assert done.running == 0 and done.prefix_cache_queries > busy.prefix_cache_queries
    assert done.prefix_cache_hits > 0 and done.prefix_cache_entries > 0
    assert done.acceptance_per_position == llm.round_loop.stats.acceptance_per_position()


def test_reset_and_run_stats_time_one_run(engine_dirs):
    """`tandem profile`'s window: counters from zero, engine seconds per graph kind and the phase trace
    of that run only."""
    llm = LLM(engine_dirs["qwen3_5_mtp3"])
    llm.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))
    llm.reset_stats(trace=True)
    stats, seconds, events = llm.run_stats()
    assert stats.rounds == 0 and seconds == {} and events == []
    llm.generate([PROMPT, PROMPT[:5]], SamplingParams(max_tokens=6, ignore_eos=True))
    stats, seconds, events = llm.run_stats()
    assert stats.rounds > 0 and stats.generated_tokens == 12 and seconds.get("target_step", 0) > 0
    assert {name for name, _, _ in events} >= {"prefill"} and all(a <= b for _, a, b in events)
    llm.reset_stats()
    llm.generate([PROMPT], SamplingParams(max_tokens=3, ignore_eos=True))
    assert llm.run_stats()[2] == []                                   # no trace unless asked
