"""Page groups: sliding-window layers' K/V pages live apart from full attention's (one free list
and one block table per group), and a window group's pages that fall out of every window go
back to its free list while the sequence runs, so a long generation holds O(window) of them.

No engines: a hand-built description (2 full + 2 window-8 attention layers, one window-8 NextN
head), the scheduler driven as the engine drives it, and the model runner over a recording
backend double."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tandem import contract as c
from tandem.checkpoint.description import AttentionSpec, LayerSpec, MLPKind, ModelDescription, MTPSpec
from tandem.graph_kinds import TARGET_STEP, GraphKind
from tandem.pipeline.allocator import SCRATCH, FreeList, PageGroups
from tandem.pipeline.model_runner import ModelRunner, Rows
from tandem.pipeline.pools import Pools, plan_pools, window_pages
from tandem.pipeline.sampling_params import SamplingParams
from tandem.pipeline.scheduler import Scheduler
from tandem.pipeline.sequence import Sequence, Status

PAGE, WINDOW, K, HEADS, CHUNK = 4, 8, 3, 1, 2
WIN = c.block_tables(WINDOW)
ROWS = max(CHUNK, K + 1)


def _attention(window):
    return AttentionSpec(num_heads=2, num_kv_heads=1, head_dim=8, rotary_dim=8, rope_theta=1e4, output_gate=False,
                         head_gate=True, window=window)


def _desc(windows=(None, WINDOW, None, WINDOW), head_window=WINDOW) -> ModelDescription:
    layers = tuple(LayerSpec(_attention(w), MLPKind.DENSE) for w in windows)
    mtp = MTPSpec((LayerSpec(_attention(head_window), MLPKind.DENSE),), "checkpoint", form="nextn",
                  anchor="previous_head")
    return ModelDescription("step3p5", "Step3p5ForCausalLM", "step3p5", 32, 16, 32, layers, None, 1e-6, False, 4096,
                            "float32", mtp)


@pytest.fixture
def desc():
    return _desc()


def _scheduler(desc, budget=1 << 20, max_seqs=2):
    sizes = plan_pools(desc, PAGE, budget, max_seqs, HEADS, rows=ROWS)
    pools = Pools(desc, sizes, PAGE, HEADS)
    groups = PageGroups(sizes.pages())
    return Scheduler(groups, FreeList(sizes.num_slots, "state slot"), pools, max_seqs, CHUNK, head_lag=HEADS), groups


def _seq(name, prompt_len=5, speculative=True):
    return Sequence(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=400), None, PAGE, speculative, K)


def _round(sched, rng, reserved=lambda seq, rows: None):
    """One engine step as the engine commits it: prefill chunks, then decode rounds accepting
    0..K drafts; the heads commit as many rows as the target (head_committed == committed).
    `reserved(seq, rows)` sees each sequence between its reservation and its commit."""
    for seq, start, end in sched.prefill_batch():
        reserved(seq, end - start)
        seq.prefilled = seq.committed = seq.head_committed = end
        if end == seq.prefill_target:
            seq.tokens.append(7)
            seq.status = Status.DECODE
    for seq in sched.decode_batch():
        reserved(seq, K + 1 if seq.speculative else 1)
        n = int(rng.integers(1, K + 2)) if seq.speculative else 1
        seq.committed += n
        seq.head_committed = seq.committed if seq.speculative else 0
        seq.tokens += [7] * n


def _run_until(sched, rng, done, limit=500):
    """Rounds until done() (bounded: a sequence the pools cannot hold fails instead of hanging)."""
    for _ in range(limit):
        if done():
            return
        _round(sched, rng)
    raise AssertionError(f"not done after {limit} rounds: {[(s.status, s.finish_reason) for s in sched.running]}")


def test_plan_sizes_each_group_and_counts_only_its_pools(desc):
    sizes = plan_pools(desc, PAGE, 1 << 20, 3, HEADS, rows=ROWS)
    row = 1 * 8 * 4                                       # [Hkv=1, head_dim=8] float32
    full, window = sizes.groups
    assert (full.window, window.window) == (None, WINDOW)
    assert full.page_bytes == PAGE * 2 * row * 2          # K and V of the 2 full layers
    assert window.page_bytes == PAGE * 2 * row * 3        # K and V of the 2 window layers and the head
    # a span of 8 + 4 + 1 - 1 = 12 positions touches at most 4 pages of 4: 3 sequences + scratch
    assert window_pages(WINDOW, PAGE, ROWS, HEADS) == 4
    assert window.num_pages == 3 * 4 + 1
    assert full.num_pages == ((1 << 20) - window.num_pages * window.page_bytes) // full.page_bytes
    pools = Pools(desc, sizes, PAGE, HEADS)
    assert {layer: pools.paged[layer]["key"].shape[0] for layer in pools.paged} == {
        0: full.num_pages, 1: window.num_pages, 2: full.num_pages, 3: window.num_pages, "mtp0": window.num_pages}


def test_window_groups_only_share_the_budget_by_page_bytes():
    desc = _desc(windows=(WINDOW, 16), head_window=16)
    sizes = plan_pools(desc, PAGE, 1 << 20, 2, HEADS, rows=ROWS)
    small, large = sizes.groups
    assert (small.window, large.window) == (WINDOW, 16)
    base = {g.window: 2 * window_pages(g.window, PAGE, ROWS, HEADS) + 1 for g in sizes.groups}
    extra = small.num_pages - base[WINDOW]
    assert extra > 0 and large.num_pages - base[16] == extra
    assert sum(g.num_pages * g.page_bytes for g in sizes.groups) <= 1 << 20
    assert (1 << 20) - sum(g.num_pages * g.page_bytes for g in sizes.groups) < small.page_bytes + large.page_bytes
    with pytest.raises(ValueError, match="does not hold 2 sequences' states .* sliding-window KV pages"):
        plan_pools(desc, PAGE, 4096, 2, HEADS, rows=ROWS)


def test_a_long_sequence_holds_a_bounded_number_of_window_pages(desc):
    sched, groups = _scheduler(desc)
    seq = _seq("a")
    sched.add(seq)
    sched.admit()
    rng = np.random.default_rng(0)
    held = []

    def check(seq, rows):
        window = seq.table.groups[WINDOW]
        # every position a query may still read (from the heads' lagging context on) is on a live page
        first = max(0, min(seq.committed, seq.head_committed) - HEADS - WINDOW + 1)
        assert SCRATCH not in window.pages[first // PAGE :]
        assert window.pages[: window.released] == [SCRATCH] * window.released
        assert len(window.pages) * PAGE >= seq.committed + rows
        held.append(window.held)

    for _ in range(300):
        if seq.committed >= 300:
            break
        _round(sched, rng, check)
        full = seq.table.groups[None]
        assert full.held == len(full.pages) >= math.ceil(seq.committed / PAGE)   # full attention keeps everything
    assert seq.committed >= 300 and len(seq.table.pages) >= 300 // PAGE
    assert max(held) == window_pages(WINDOW, PAGE, ROWS, HEADS) == 4
    assert groups.in_use() == {None: len(seq.table.pages), WINDOW: held[-1]}
    assert sched.released_out_of_window == len(seq.table.pages) - held[-1]


def test_released_window_pages_go_to_other_sequences(desc):
    sched, groups = _scheduler(desc)
    a, b = _seq("a"), _seq("b", prompt_len=9)
    sched.add(a)
    sched.admit()
    rng = np.random.default_rng(1)
    _run_until(sched, rng, lambda: a.committed >= 100)
    released = set(range(1, groups.lists[WINDOW].size)) - set(a.table.groups[WINDOW].pages)
    assert len(released) >= 4
    sched.add(b)
    sched.admit()
    _round(sched, rng)
    assert set(b.table.groups[WINDOW].pages) <= released
    _run_until(sched, rng, lambda: a.committed >= 300 and b.committed >= 300)
    # two sequences of 300 tokens never had more window pages than two windows' worth
    assert groups.lists[WINDOW].ever_used <= 2 * window_pages(WINDOW, PAGE, ROWS, HEADS)


def test_preemption_and_finish_free_both_groups(desc):
    # full group: room for one sequence's 70 positions, not two: the second preempts the first
    probe = plan_pools(desc, PAGE, 1 << 20, 2, HEADS, rows=ROWS)
    window_bytes = probe.groups[1].num_pages * probe.groups[1].page_bytes
    sched, groups = _scheduler(desc, budget=window_bytes + 26 * probe.page_bytes)
    assert groups.lists[None].size == 26
    a, b = _seq("a", prompt_len=3), _seq("b", prompt_len=3)
    sched.add(a)
    sched.add(b)
    sched.admit()
    rng = np.random.default_rng(2)
    for _ in range(200):
        _round(sched, rng)
        if a.metrics.preemptions + b.metrics.preemptions:
            break
    victim = a if a.metrics.preemptions else b
    assert victim.status == Status.WAITING and victim.table.held() == {None: 0, WINDOW: 0}
    other = b if victim is a else a
    assert groups.in_use() == other.table.held()
    sched.finish(other, "stop")
    assert groups.in_use() == {None: 0, WINDOW: 0}
    assert all(fl.num_free == fl.size - 1 for fl in groups.lists.values())


def test_waiting_sequences_hold_no_pages(desc):
    """A prefill reservation that preempts a sequence later in the same batch must not then
    reserve pages for it: it waits holding nothing."""
    probe = plan_pools(desc, PAGE, 1 << 20, 3, HEADS, rows=ROWS)
    window_bytes = probe.groups[1].num_pages * probe.groups[1].page_bytes
    sched, groups = _scheduler(desc, budget=window_bytes + 4 * probe.page_bytes, max_seqs=3)
    seqs = [_seq(name, prompt_len=9) for name in "abc"]
    for s in seqs:
        sched.add(s)
    sched.admit()
    rng = np.random.default_rng(7)
    for _ in range(30):
        _round(sched, rng)
        for s in sched.waiting:
            assert s.table.held() == {None: 0, WINDOW: 0}, s.request_id
        sched.admit()
    assert sum(s.metrics.preemptions for s in seqs) > 0


def test_plain_sequences_release_below_their_own_context(desc):
    sched, _ = _scheduler(desc)
    seq = _seq("p", speculative=False)
    sched.add(seq)
    sched.admit()
    rng = np.random.default_rng(3)
    _run_until(sched, rng, lambda: seq.committed >= 60)
    # no heads run: only the target's context counts (head_committed stays 0)
    assert seq.head_committed == 0 and seq.table.groups[WINDOW].held <= window_pages(WINDOW, PAGE, 1, 0)


def test_rows_land_in_their_groups_pages(desc):
    sched, _ = _scheduler(desc)
    seq = _seq("a")
    sched.add(seq)
    sched.admit()
    rng = np.random.default_rng(4)
    _run_until(sched, rng, lambda: seq.committed >= 40)
    assert sched.decode_batch() == [seq]                   # pages for the next K + 1 rows
    pools = sched.pools
    tables = seq.table.pages.tables
    assert set(tables) == {c.BLOCK_TABLES, WIN} and tables[c.BLOCK_TABLES] != tables[WIN]
    start, n = seq.committed, K + 1
    layers = [*pools.trunk_paged, c.mtp_layer_name(0)]
    outs = {c.pool_output(p, layer): rng.random((1, n, 1, 8)).astype(np.float32)
            for layer in layers for p in pools._specs[layer].paged}
    pools.write_rows(layers, outs, np.array([0]), np.array([n]), np.array([start]), [seq.table.pages])
    for layer in layers:
        window = pools._specs[layer].paged[0].window
        table = tables[c.block_tables(window)]
        for w in range(n):
            pos = start + w
            got = pools.paged[layer]["key"][table[pos // PAGE], pos % PAGE]
            np.testing.assert_array_equal(got, outs[c.new_key(layer)][0, w])
    assert not pools.paged[1]["key"][SCRATCH].any()       # released entries are never written


class _RecordingBackend:
    """Backend double: zero buffers per binding; each call records its inputs."""

    INTS = {c.INPUT_IDS, c.CONTEXT_LENS, c.STATE_SLOTS, c.STATE_ROWS, c.LAST_ROW, c.TOP_K}

    def __init__(self):
        self.calls = []

    def binding(self, file, key, ins, outs, fixed, backend_outputs=frozenset()):
        class Binding:
            inputs = {n: np.zeros(s, np.int64 if n in self.INTS or n.startswith(c.BLOCK_TABLES) else np.float32)
                      for n, s in ins.items()}
            outputs = {n: np.zeros(s, np.float32) for n, s in outs.items()}
        return Binding

    def capture(self, binding):
        def run():
            self.calls.append({n: a.copy() for n, a in binding.inputs.items()})
            return binding.outputs
        return run


def test_runner_fills_each_graphs_tables_from_their_groups(desc):
    sched, _ = _scheduler(desc)
    seqs = [_seq("a"), _seq("b", prompt_len=2)]
    for s in seqs:
        sched.add(s)
    sched.admit()
    rng = np.random.default_rng(6)
    _run_until(sched, rng, lambda: seqs[0].committed >= 50)
    backend = _RecordingBackend()
    files = {TARGET_STEP.engine_key(1): "t", GraphKind.mtp_head(0).engine_key(2): "h"}
    runner = ModelRunner(desc, backend, sched.pools, files, [1, 2], max_pages=128, mtp_layers=HEADS)
    runner.target_step([Rows(ids=[1], context=s.committed, pages=s.table.pages, slot=s.slot) for s in seqs[:1]])
    runner.head(0, [Rows(ids=[1, 2], context=s.head_committed, pages=s.table.pages, hidden=np.zeros((2, 16)))
                    for s in seqs])
    target, head = backend.calls
    a, b = (s.table.pages.tables for s in seqs)
    width = 16                                              # a's 14 logical pages, to a power of two
    assert target[c.BLOCK_TABLES].shape == target[WIN].shape == (1, width)
    for name in (c.BLOCK_TABLES, WIN):
        assert list(target[name][0]) == a[name] + [SCRATCH] * (width - len(a[name]))
    assert c.BLOCK_TABLES not in head                      # the head's pools are all window-8
    assert [list(r[: len(t[WIN])]) for r, t in zip(head[WIN], (a, b))] == [a[WIN], b[WIN]]
    assert SCRATCH in a[WIN] and SCRATCH not in a[c.BLOCK_TABLES]


def test_a_plain_list_of_pages_fills_every_table(desc):
    pools = Pools(desc, plan_pools(desc, PAGE, 1 << 20, 2, HEADS, rows=ROWS), PAGE, HEADS)
    backend = _RecordingBackend()
    runner = ModelRunner(desc, backend, pools, {TARGET_STEP.engine_key(2): "t"}, [1], max_pages=8, mtp_layers=0)
    runner.target_step([Rows(ids=[1, 2], context=0, pages=[3, 5], slot=1)])
    (call,) = backend.calls
    assert list(call[c.BLOCK_TABLES][0]) == list(call[WIN][0]) == [3, 5]


def test_llm_reports_pages_held_per_group(engine_dirs):
    from tandem.pipeline.llm import LLM

    llm = LLM(engine_dirs["qwen3_5_mtp3"])
    seq = llm.add_request([5, 17, 33, 200, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    llm.step()
    assert llm.pages_held() == {c.BLOCK_TABLES: len(seq.table.pages)} and len(seq.table.pages) > 0
    while seq.finish_reason is None:
        llm.step()
    assert llm.pages_held() == {c.BLOCK_TABLES: 0}
