"""Continuous batching: who runs this round, with memory for it.

Requests wait in arrival order, are admitted while a state slot is free, prefill in chunks (at
most `max_batch` sequences per round), then decode. Before each round every decoding sequence
gets pages for the rows it may write (k+1, or a burst's or multi-step decode's n); when the pool runs out,
the most recently admitted other sequence is preempted: its pages and slot are freed and it goes
back to the front of the queue, to be recomputed (prefill over its prompt and the tokens it
already produced).

Pages come per page group (pipeline/allocator.py). Before a sequence's pages are reserved, its
window groups give back the pages out of every window: those below min_context - w + 1, where
min_context is the smallest context a graph still queries from (the target's committed count
and, for a speculative sequence, the heads' head_committed, less `head_lag` for heads whose
context trails it). `release_out_of_window` is public so the engine can also call it right
after a commit; at reservation time is enough for the bound (pipeline/pools.py plan_pools).
"""

from __future__ import annotations

from collections import deque

from tandem.pipeline.allocator import FreeList, OutOfMemory, PageGroups
from tandem.pipeline.pools import Pools
from tandem.pipeline.prefix_cache import PrefixCache
from tandem.pipeline.sequence import Sequence, Status


class Scheduler:
    """`pages`: a PageGroups (one free list per page group), or a single FreeList (full attention only)."""

    def __init__(self, pages: PageGroups | FreeList, slots: FreeList, pools: Pools, max_batch: int,
                 prefill_chunk: int, head_lag: int = 0, prefix_cache: PrefixCache | None = None):
        self.groups = pages if isinstance(pages, PageGroups) else PageGroups.full_only(pages)
        self.pages = next(iter(self.groups.lists.values()))   # the first group's list (full attention if any)
        self.windowed = any(w is not None for w in self.groups.lists)
        self.slots, self.pools = slots, pools
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.head_lag = head_lag            # how far the heads' contexts may trail head_committed
        self.decode_steps = 1               # most tokens a plain step takes (a burst, a multi-step graph)
        self.decode_samples = False         # and whether sampled rows take them too (a burst)
        self.max_positions = 1 << 62        # positions a block table holds (LLM: max_pages x page_size)
        self.released_out_of_window = 0     # window pages given back while their sequences ran
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # admission order
        self.prefix_cache = prefix_cache    # resumes admitted sequences from earlier ones' prefixes

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> None:
        while self.waiting and self.slots.num_free:
            seq = self.waiting.popleft()
            seq.slot = self.slots.allocate(1)[0]
            if seq.table.groups.keys() != self.groups.lists.keys():  # never admitted: the default table, empty
                seq.table = self.groups.new_tables(seq.page_size)
            self.pools.clear_slot(seq.slot)          # recurrent state starts from zero
            seq.status, seq.prefilled = Status.PREFILL, 0
            seq.committed = seq.head_committed = seq.cached_tokens = 0
            self._resume(seq)
            self.running.append(seq)

    def _resume(self, seq: Sequence) -> None:
        """Continue from the longest cached prefix of its tokens, where there is one (pipeline/prefix_cache.py).
        A request with prompt logprobs computes its whole prompt (they come from its rows)."""
        cache = self.prefix_cache
        if cache is None or seq.params.prompt_logprobs is not None:
            return
        entry = cache.lookup(seq.tokens, seq.prefill_target - 1, seq.params.cache_salt)
        if entry is not None:
            cache.resume(seq, entry, self.pools)

    def prefill_batch(self) -> list[tuple[Sequence, int, int]]:
        """(sequence, start, end) of the next prompt chunk for up to max_batch prefilling sequences."""
        out = []
        for seq in [s for s in self.running if s.status == Status.PREFILL][: self.max_batch]:
            start = seq.prefilled
            end = min(seq.prefill_target, start + self.prefill_chunk)
            if self.prefix_cache is not None and start < (mark := self.prefix_cache.mark(seq)) < end:
                end = mark      # the chunk stops where the prefix cache keeps an entry (RoundLoop._keep_prefix)
            # a later sequence's reservation may have preempted this one: a waiting one holds no pages
            if seq.status == Status.PREFILL and self._reserve(seq, end):
                out.append((seq, start, end))
        return [w for w in out if w[0].status == Status.PREFILL]  # a later reservation may preempt

    def decode_batch(self) -> list[Sequence]:
        out, reserved = [], False
        for seq in [s for s in self.running if s.status == Status.DECODE]:
            # a speculative sequence: its widest round, or a burst while drafting is off (AdaptiveRounds._off_round)
            rows = seq.decode_rows(self.decode_steps, self.decode_samples)
            rows = max(rows, seq.k + 1) if seq.speculative else rows
            positions = min(seq.committed + rows, self.max_positions)   # (RoundLoop.round_k stays inside)
            if not self.windowed and positions <= seq.table.capacity():   # most steps: pages held already
                out.append(seq)
            elif seq.status == Status.DECODE and self._reserve(seq, positions):
                out.append(seq)
                reserved = True
        # a later reservation may preempt an earlier sequence
        return [s for s in out if s.status == Status.DECODE] if reserved else out

    def _reserve(self, seq: Sequence, positions: int) -> bool:
        """Pages for `positions` positions, preempting newer sequences if needed."""
        self.release_out_of_window(seq)
        while True:
            try:
                seq.table.ensure(positions, self.groups.lists)
                return True
            except OutOfMemory:
                if self.prefix_cache is not None and self.prefix_cache.evict():   # cached prefixes go first
                    continue
                victims = [s for s in self.running if s is not seq and s.status != Status.FINISHED]
                if not victims:  # alone and still out of pages: the sequence outgrew the whole pool
                    self.finish(seq, "length")
                    return False
                self.preempt(victims[-1])

    def min_context(self, seq: Sequence) -> int:
        """The smallest position any graph of `seq` may still query from."""
        if not seq.speculative:
            return seq.committed
        return min(seq.committed, seq.head_committed) - self.head_lag

    def release_out_of_window(self, seq: Sequence) -> int:
        """Give back `seq`'s window-group pages that no later query reads; returns how many."""
        if not self.windowed:   # full attention only: nothing to give back (the hot loop skips it)
            return 0
        n = seq.table.release_out_of_window(self.min_context(seq), self.groups.lists)
        self.released_out_of_window += n
        return n

    def pages_in_use(self) -> dict[int | None, int]:
        """Pages held per page group (window None: full attention), all sequences together."""
        return self.groups.in_use()

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = Status.WAITING
        seq.metrics.preemptions += 1
        seq.draft = seq.chain_hidden = None
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self._release(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.finish(seq, "abort")
                return seq
        return None

    def _release(self, seq: Sequence) -> None:
        seq.table.release(self.groups.lists)
        if seq.slot is not None:
            self.slots.free([seq.slot])
            seq.slot = None
        if seq in self.running:
            self.running.remove(seq)
