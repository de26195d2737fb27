"""Automatic prefix caching (pipeline/prefix_cache.py): page holders and idle pages in the free
lists, the cache's entries, lookups and eviction in plain Python; then multi-turn conversations on
tiny engines of every family: an answer after a cache hit is the answer after a miss, token for token,
speculation on and off, several conversations at once, with preemption; the heads draft after a hit
what they draft after a miss; a corrupted snapshot changes the answer (the hit reads it)."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.engines.options import BuildOptions
from tandem.pipeline.allocator import SCRATCH, FreeList
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.prefix_cache import PrefixCache
from tandem.pipeline.sampling_params import SamplingParams

from ..pipeline_fixtures import record_drafts, tiny_engines

pytestmark = pytest.mark.slow

OPTIONS = BuildOptions(batch_sizes=(1, 4, 8), spec_k=2, prefill_chunk=8, max_seq_len=256, page_size=4)
KINDS = ("qwen3_5_mtp1", "qwen3_5_moe", "step3p5", "deepseek_v32", "glm_moe_dsa")


# ---- free lists and the cache alone ------------------------------------------------------------
def test_holders_idle_pages_and_the_last_free():
    pages = FreeList(10, "KV page")
    a = pages.allocate(3)
    pages.retain(a[:2], cache=True)             # an entry holds two of them
    assert pages.num_idle == 0 and pages.num_free == 6
    pages.free(a)                               # the sequence lets go: the third is free, two idle
    assert pages.num_free == 7 and pages.num_idle == 2 and pages.available == 9
    pages.retain(a[:1])                         # a sequence resumes from the entry
    assert pages.num_idle == 1
    pages.free(a[:2], cache=True)               # the entry is evicted: a[1] is free, a[0] still held
    assert pages.num_free == 8 and pages.num_idle == 0 and a[1] in pages.allocate(1)
    pages.free(a[:1])
    assert pages.num_free == 8 and not pages.shared and not pages.cache_holds


class FakePools:
    def __init__(self):
        self.snaps, self.copies, self.restored = {}, [], []

    def snapshot(self, slot, row):
        self.snaps[row] = slot

    def restore(self, row, slot):
        self.restored.append((row, slot))

    def copy_page_rows(self, window, src, dst, rows):
        self.copies.append((window, src, dst, rows))


def _cache(snapshots=4, stateful=True):
    lists = {None: FreeList(32, "KV page")}
    return PrefixCache(4, lists, snapshots, "fingerprint", stateful), lists


def test_lookup_takes_the_longest_entry_the_prompt_starts_with():
    cache, lists = _cache()
    pages = lists[None].allocate(4)                 # positions 0..15
    tokens = list(range(100, 116))
    cache.make(tokens[:7], {None: pages}, None, 6, {}, lambda row: None)     # prefix of 6
    cache.make(tokens[:12], {None: pages}, None, 0, {}, lambda row: None)    # prefix of 11, no heads
    assert cache.lookup(tokens, 15, None).length == 11 and not cache.lookup(tokens, 15, None).heads
    assert cache.lookup(tokens, 10, None).length == 6 and cache.lookup(tokens, 10, None).heads   # at most `longest`
    assert cache.lookup([1] + tokens, 15, None) is None
    assert cache.lookup(tokens[:6] + [7] * 10, 15, None) is None         # the key goes one token past
    assert cache.lookup(tokens, 15, "salt") is None                      # another salt shares nothing
    assert cache.stats.hits == 11 + 11 + 6 + 6


def test_entries_hold_pages_and_rows_and_eviction_gives_them_back():
    cache, lists = _cache(snapshots=2)
    pages = lists[None].allocate(3)
    for n in (5, 9, 10):            # three entries, two snapshot rows: the least recently used goes
        cache.make(list(range(n)), {None: pages}, None, 0, {}, lambda row: None)
    assert len(cache.entries) == 2 and cache.stats.evicted == 1
    lists[None].free(pages)         # the sequence ends: its pages stay held by the entries
    assert lists[None].num_free == 28 and lists[None].num_idle == 3
    cache.clear()
    assert lists[None].num_free == 31 and cache.rows.num_free == 2 and not cache.index


def test_resume_shares_full_pages_and_copies_the_partial_one():
    cache, lists = _cache()
    pages = lists[None].allocate(3)
    entry = cache.make(list(range(10)), {None: pages}, None, 9, {}, lambda row: None)  # prefix 9: 2 pages + 1
    lists[None].free(pages)

    class Seq:
        from tandem.pipeline.allocator import PageTables
        table = PageTables(4)
        slot, prefilled, committed, head_committed, carries, cached_tokens = 3, 0, 0, 0, {}, 0

    seq, pools = Seq(), FakePools()
    assert cache.resume(seq, entry, pools)
    got = seq.table.groups[None].pages
    assert got[:2] == pages[:2] and got[2] not in pages and got[2] != SCRATCH
    assert pools.copies == [(None, pages[2], got[2], 1)] and pools.restored == [(entry.snapshot, 3)]
    assert seq.committed == seq.prefilled == seq.head_committed == seq.cached_tokens == 9


# ---- on engines ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def families(tmp_path_factory, engine_dirs):
    out = {kind: path for kind, (_, path) in tiny_engines(tmp_path_factory.mktemp("prefix"), KINDS, OPTIONS).items()}
    return {**out, **engine_dirs}


def converse(llm: LLM, starts: list[list[int]], turns: int, params: SamplingParams) -> list[list[list[int]]]:
    """Conversations in parallel: each turn's prompt is the last prompt, its answer and a new message."""
    history = [list(s) for s in starts]
    answers = [[] for _ in starts]
    for turn in range(turns):
        out = llm.generate(history, params)
        for i, r in enumerate(out):
            answers[i].append(r.token_ids)
            history[i] = history[i] + r.token_ids + [7 + turn, 11 * (i + 1) % 300, 5]
    return answers


STARTS = [[5, 17, 33, 200, 7, 90, 12, 14, 150, 61], [9, 120, 77, 3], [44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54],
          [3, 250, 8, 160, 21, 6], [300, 12, 12, 12, 12, 12, 12], [101, 5, 9, 11, 13, 15, 17, 19, 21, 23]]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("kind", [*KINDS, "qwen3_5_mtp3", "qwen3_next"])
@pytest.mark.parametrize("speculative", [True, False])
def test_answers_after_a_hit_are_the_answers_after_a_miss(families, kind, speculative):
    """Five turns of six conversations at once (batches up to 8), speculation on or off: the same
    tokens with the cache and without, and most of every later prompt comes from the cache."""
    config = dict(speculative=speculative)
    want = converse(LLM(families[kind], RuntimeConfig(prefix_cache=False, **config)), STARTS, 5, PARAMS)
    llm = LLM(families[kind], RuntimeConfig(**config))
    assert converse(llm, STARTS, 5, PARAMS) == want
    stats = llm.prefix_cache.stats
    assert stats.hits > 0.6 * stats.queries, stats


def test_a_hit_survives_preemption_and_sampling(families):
    """A pool too small for every conversation at once and room for three snapshots: sequences are
    preempted (and resumed, from the cache too), entries evicted, and the sampled answers, seeded, are
    still the ones without a cache."""
    one = LLM(families["qwen3_5_mtp3"]).pools.snapshot_bytes
    config = dict(memory_budget_bytes=1 << 18, max_num_seqs=8, prefix_snapshot_mb=3.5 * one / 2**20)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=3)
    base = LLM(families["qwen3_5_mtp3"], RuntimeConfig(prefix_cache=False, **config))
    want = converse(base, STARTS * 2, 3, params)
    llm = LLM(families["qwen3_5_mtp3"], RuntimeConfig(**config))
    got = converse(llm, STARTS * 2, 3, params)
    assert got == want and llm.pools.snapshots == 3
    assert llm.prefix_cache.stats.hits > 0 and llm.prefix_cache.stats.evicted > 0


@pytest.mark.parametrize("kind", ["qwen3_5_mtp3", "step3p5"])
def test_the_heads_draft_after_a_hit_as_after_a_miss(families, kind, monkeypatch):
    """Fixed k, so every round drafts: each round's drafts, keyed by the tokens they follow, are the same
    with the cache as without: the heads' rows (and chained heads' carries) came back with the pages."""
    rounds = record_drafts(monkeypatch)
    config = dict(adaptive_width=False, spec_k=2)
    converse(LLM(families[kind], RuntimeConfig(prefix_cache=False, **config)), STARTS[:3], 4, PARAMS)
    miss = {tuple(tokens): drafts for tokens, drafts in rounds}
    rounds.clear()
    llm = LLM(families[kind], RuntimeConfig(**config))
    converse(llm, STARTS[:3], 4, PARAMS)
    hit = {tuple(tokens): drafts for tokens, drafts in rounds}
    assert llm.prefix_cache.stats.hits > 0 and hit == miss


def test_a_corrupted_snapshot_changes_the_answer(families):
    """The hit reads the snapshot: noise in every snapshot row after the first turn changes what the
    second turn answers (and without the noise it does not: the test above)."""
    want = converse(LLM(families["qwen3_5_mtp3"], RuntimeConfig(prefix_cache=False)), STARTS[:2], 2, PARAMS)
    llm = LLM(families["qwen3_5_mtp3"])
    first = llm.generate(STARTS[:2], PARAMS)
    rng = np.random.default_rng(0)
    for snap, _ in llm.pools._snap_pairs:
        snap[:] = rng.standard_normal(snap.shape).astype(snap.dtype)
    second = llm.generate([s + r.token_ids + [7, 11 * (i + 1) % 300, 5] for i, (s, r) in
                           enumerate(zip(STARTS[:2], first))], PARAMS)
    assert [r.token_ids for r in first] == [w[0] for w in want]
    assert llm.prefix_cache.stats.hits > 0 and [r.token_ids for r in second] != [w[1] for w in want]


def test_prompt_logprobs_and_salts_and_the_switch(families):
    llm = LLM(families["qwen3_5_mtp3"])
    llm.generate([STARTS[0] * 3], PARAMS)
    hits = llm.prefix_cache.stats.hits
    llm.generate([STARTS[0] * 3 + [5]], SamplingParams(max_tokens=2, prompt_logprobs=1))   # needs every row
    llm.generate([STARTS[0] * 3 + [5]], SamplingParams(max_tokens=2, cache_salt="tenant-b"))
    assert llm.prefix_cache.stats.hits == hits
    llm.generate([STARTS[0] * 3 + [5]], SamplingParams(max_tokens=2))
    assert llm.prefix_cache.stats.hits > hits
    assert LLM(families["qwen3_5_mtp3"], RuntimeConfig(prefix_cache=False)).prefix_cache is None


@pytest.mark.server
def test_the_server_reports_cached_tokens_and_vllms_counters(engine_dirs):
    """usage.prompt_tokens_details.cached_tokens tells what the second turn of a chat reused; another
    cache_salt reuses nothing; /metrics counts the tokens looked up and restored under vLLM's names."""
    import httpx

    from ..server.test_server import Live

    def hits(live) -> float:
        return live.metrics().get('vllm:prefix_cache_hits_total{"model_name": "tiny"}', 0.0)

    with Live(engine_dirs["qwen3_5_mtp3"]) as live:
        messages = [{"role": "user", "content": "def add(a, b): return a + b. Now write sub, mul and div."}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        first = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60).json()
        before = hits(live)
        messages = [*messages, first["choices"][0]["message"], {"role": "user", "content": "and mod"}]
        second = httpx.post(f"{live.url}/v1/chat/completions", json={**body, "messages": messages}, timeout=60).json()
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        # (a random model's answer need not tokenize back to its tokens: at least the first prompt's pages)
        assert first["usage"]["prompt_tokens"] // 8 * 8 <= cached < second["usage"]["prompt_tokens"]
        assert hits(live) - before == cached
        ids = list(range(40, 70))             # token ids: the next turn resends the answer's own tokens
        one = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 9,
                                                            "return_token_ids": True, "ignore_eos": True}).json()
        answer = one["choices"][0]["token_ids"]
        two = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": ids + answer + [5, 6],
                                                            "max_tokens": 2}).json()
        assert two["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) + len(answer) - 1
        salted = httpx.post(f"{live.url}/v1/chat/completions", json={**body, "messages": messages,
                                                                     "cache_salt": "tenant-b"}, timeout=60).json()
        assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert salted["choices"][0]["message"] == second["choices"][0]["message"]


def test_a_prefix_cached_without_drafting_resumes_without_drafting(families):
    """A request that ran plain leaves no head rows: a drafting request resuming from it runs plain,
    with the answer it has without the cache."""
    prompt = STARTS[0] * 3
    base = LLM(families["qwen3_5_mtp3"], RuntimeConfig(prefix_cache=False))
    llm = LLM(families["qwen3_5_mtp3"])
    first = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, speculative=False))[0]
    seq = llm.add_request(prompt + first.token_ids + [5], PARAMS)
    while seq.finish_reason is None:
        llm.step()
    assert seq.cached_tokens == len(prompt) + 7 and not seq.speculative
    assert seq.output_ids() == base.generate([prompt + first.token_ids + [5]], PARAMS)[0].token_ids


def test_a_full_cache_keeps_admitting_and_memory_stays_flat(families):
    """A small pool that the cache fills within a few conversations: new requests still run (the least
    recently used entries go), and RSS after warm-up stays flat over hundreds of multi-turn requests."""
    from .test_memory_flat import _rss

    llm = LLM(families["qwen3_5_mtp3"], RuntimeConfig(memory_budget_bytes=1 << 20, adaptive_width=False))
    rng = np.random.default_rng(1)
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def conversations(n: int) -> None:
        for _ in range(n):
            starts = [[int(t) for t in rng.integers(3, 300, 24)] for _ in range(4)]
            assert all(len(turn) == 8 for conv in converse(llm, starts, 3, params) for turn in conv)

    conversations(10)                                   # warm-up: the pool and the snapshot pool fill
    before = _rss()
    evicted = llm.prefix_cache.stats.evicted
    conversations(25)                                   # 300 more requests
    assert llm.prefix_cache.stats.evicted > evicted and llm.prefix_cache.stats.hits > 0
    assert _rss() - before < 4 << 20


def test_drafting_stops_at_the_budget_so_the_answer_is_cached_to_its_end(families, monkeypatch):
    """A round drafts no more than the request's budget leaves (RoundLoop.round_k): with drafts that are
    always right, nothing is committed past the last token it emits, so the entry at its end holds
    the whole answer and the next turn, which resends it, resumes after it."""
    from ..pipeline_fixtures import install_drafter

    prompt = STARTS[0] * 2
    ref = LLM(families["qwen3_5_mtp3"], RuntimeConfig(prefix_cache=False)).generate(
        [prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    install_drafter(monkeypatch, "oracle", {"a": ref})
    llm = LLM(families["qwen3_5_mtp3"], RuntimeConfig(adaptive_width=False, spec_k=3))
    for max_tokens in (5, 6, 7, 9):
        seq = llm.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id="a")
        while seq.finish_reason is None:
            llm.step()
        assert seq.output_ids() == ref[:max_tokens] and seq.metrics.accepted > 0
        assert seq.committed == len(prompt) + max_tokens - 1       # nothing past the budget
        nxt = llm.add_request(prompt + ref[:max_tokens] + [5], SamplingParams(max_tokens=1), request_id="b")
        while nxt.finish_reason is None:
            llm.step()
        assert nxt.cached_tokens == len(prompt) + max_tokens - 1, max_tokens
        llm.reset_prefix_cache()
