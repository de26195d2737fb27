"""Automatic prefix caching: a new request whose prompt starts with what an earlier one ran resumes
from that earlier request's pages and recurrent states instead of recomputing them.

Plain Python over page ids, token ids and snapshot rows; the pools do the copies (pipeline/pools.py).

    entry (prefix p of tokens t_0 .. t_p)     made before a prompt's last token, and when a request
                                              finishes
        pages   the full-attention and window groups' pages of positions [0, p) (held: refcounts in
                the groups' free lists), the last one partly written where p is not page-aligned
        state   a snapshot row: every recurrent (Gated DeltaNet) and conv state after t_0 .. t_{p-1}
        heads   MTP heads' rows [0, p) are in the same pages (their pools share the table); valid when
                the heads had committed them (head_committed), with previous-head anchoring their
                `carries` too
    key        the tokens t_0 .. t_p: one more than the prefix, since a head's row i pairs t_{i+1}
               with the target's hidden h_i (row p - 1 reads t_p)

A hit at admission (Scheduler.admit): the longest entry whose key the prompt starts with, p at most
the prefill's last position - 1 (the prefill still runs a row: the first token comes from its
logits). The sequence's tables take the entry's full pages (one more holder each), a fresh page for
the partly written one (its written rows copied), SCRATCH below a window; its slot takes the
snapshot; prefill and the heads go on from p, as after a prefill that had stopped there. An entry
whose request ran without drafting (its own choice, or the width controller's verdict that drafting
cannot pay) has no head rows: a request resuming from it runs without drafting too (the same output;
the heads could only catch up by recomputing the whole prefix).

Entries are found through the chain hash of their full pages (the request's cache_salt and the
engine dir's fingerprint at its root) and confirmed token by token. The least recently used entry
goes first when pages, snapshot rows or entries run short (evict). An entry is made before a prompt's
last token (the prefill stops a chunk there: the next turn of a chat resends the prompt, whatever the
answer after it tokenizes to; a prompt within one chunk leaves none) and when a request finishes (at
all it ran and emitted: where the answer tokenizes back to its tokens, the next turn resends it too).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from tandem.pipeline.allocator import SCRATCH, FreeList

MAX_ENTRIES = 4096       # entries kept at most (a stateless model's entries cost pages only)


@dataclass
class Entry:
    id: int
    found_by: bytes                            # the chain hash of its full pages (its index key)
    key: tuple[int, ...]                       # t_0 .. t_p
    pages: dict[int | None, list[int]]         # per page group (window): logical page -> pool page (SCRATCH below)
    snapshot: int | None                       # snapshot row (None: the model has no states)
    head_committed: int                        # head rows valid in the pages (0: no heads)
    carries: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def length(self) -> int:
        """p: the positions it restores."""
        return len(self.key) - 1

    @property
    def heads(self) -> bool:
        """Whether the heads' rows [0, p) are in its pages (its request drafted up to p)."""
        return self.head_committed >= self.length


@dataclass
class CacheStats:
    queries: int = 0          # prompt tokens looked up (vLLM's prefix_cache_queries)
    hits: int = 0             # of those, tokens restored (prefix_cache_hits)
    entries_made: int = 0
    evicted: int = 0


class PrefixCache:
    def __init__(self, page_size: int, lists: dict[int | None, FreeList], snapshots: int, fingerprint: str,
                 stateful: bool, prefill_chunk: int = 1):
        """lists: each page group's free list (window None: full attention); snapshots: rows of the
        snapshot pools (a model with states caches nothing without one); fingerprint: the engine dir's."""
        self.page_size, self.lists, self.prefill_chunk = page_size, lists, prefill_chunk
        self.stateful = stateful
        self.rows = FreeList(snapshots + 1, "state snapshot") if stateful and snapshots else None
        self.root = hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()
        self.entries: OrderedDict[int, Entry] = OrderedDict()     # id -> entry, least recently used first
        self.index: dict[bytes, set[int]] = {}                    # chain hash of the full pages -> entry ids
        self._ids = 0
        self.stats = CacheStats()

    @property
    def enabled(self) -> bool:
        return self.rows is not None or not self.stateful

    # ---- hashing ---------------------------------------------------------------------------
    def _chain(self, tokens, pages: int, salt: str | None) -> list[bytes]:
        """Chain hashes of the first `pages` full pages of `tokens`: h_0 (no page), h_1, .., h_pages."""
        h = hashlib.blake2b(self.root + (salt or "").encode("utf-8", "surrogatepass"), digest_size=16).digest()
        out = [h]
        s = self.page_size
        for i in range(pages):
            page = np.asarray(tokens[i * s : (i + 1) * s], np.int64).tobytes()
            h = hashlib.blake2b(h + page, digest_size=16).digest()
            out.append(h)
        return out

    # ---- lookup ----------------------------------------------------------------------------
    def lookup(self, tokens: list[int], longest: int, salt: str | None) -> Entry | None:
        """The entry to resume from: the longest whose key `tokens` starts with and that restores at
        most `longest` positions (of two as long, one with the heads' rows)."""
        self.stats.queries += longest + 1 if longest >= 0 else 0
        if longest < 1 or not self.entries:
            return None
        chain = self._chain(tokens, longest // self.page_size, salt)
        for full in range(len(chain) - 1, -1, -1):      # the most full pages first
            best = None
            for i in self.index.get(chain[full], ()):
                e = self.entries[i]
                if (e.length <= longest and (best is None or (e.length, e.heads) > (best.length, best.heads))
                        and tuple(tokens[: len(e.key)]) == e.key):
                    best = e
            if best is not None:
                self.entries.move_to_end(best.id)
                self.stats.hits += best.length
                return best
        return None

    # ---- entries ---------------------------------------------------------------------------
    def make(self, key: list[int], pages: dict[int | None, list[int]], salt: str | None, head_committed: int,
             carries: dict[int, np.ndarray], take_snapshot) -> Entry | None:
        """An entry for prefix key[:-1] over a sequence's `pages` (per group, logical page -> pool page;
        SCRATCH where released), its snapshot taken by take_snapshot(row); None where one exists already
        or nothing can be held."""
        p = len(key) - 1
        if p < 1:
            return None
        chain = self._chain(key, p // self.page_size, salt)
        if any(self.entries[i].key == tuple(key) for i in self.index.get(chain[-1], ())):
            return None
        row = None
        if self.stateful:
            if self.rows is None:
                return None
            while not self.rows.num_free and self.evict():
                pass
            if not self.rows.num_free:
                return None
            row = self.rows.allocate(1)[0] - 1        # (the free list's items start at 1)
            take_snapshot(row)
        while len(self.entries) >= MAX_ENTRIES and self.evict():
            pass
        used = -(-p // self.page_size)             # pages holding positions [0, p)
        held = {w: list(table[:used]) for w, table in pages.items()}
        for w, table in held.items():
            self.lists[w].retain([page for page in table if page != SCRATCH], cache=True)
        self._ids += 1
        entry = self.entries[self._ids] = Entry(self._ids, chain[-1], tuple(key), held, row, head_committed,
                                                {j: h.copy() for j, h in carries.items()})
        self.index.setdefault(chain[-1], set()).add(self._ids)
        self.stats.entries_made += 1
        return entry

    def evict(self) -> bool:
        """Drop the least recently used entry (its pages lose a holder: freed where it was the last);
        False when there is none."""
        if not self.entries:
            return False
        i, entry = self.entries.popitem(last=False)
        found = self.index[entry.found_by]
        found.discard(i)
        if not found:
            del self.index[entry.found_by]
        for w, table in entry.pages.items():
            self.lists[w].free([page for page in table if page != SCRATCH], cache=True)
        if entry.snapshot is not None:
            self.rows.free([entry.snapshot + 1])
        self.stats.evicted += 1
        return True

    # ---- resuming ---------------------------------------------------------------------------
    def resume(self, seq, entry: Entry, pools) -> bool:
        """Set a just-admitted sequence (empty tables, its slot cleared) to continue from `entry`: its
        tables hold the entry's pages (a fresh copy of the partly written one), its slot the snapshot,
        its heads the entry's rows; prefill goes on from entry.length. False (nothing changed) where a
        fresh page cannot be had."""
        p, s = entry.length, self.page_size
        partial = p % s
        fresh = {}
        if partial:
            for w in entry.pages:
                lst = self.lists[w]
                while not lst.num_free and self.evict_for(entry):
                    pass
                if not lst.num_free:
                    for v, page in fresh.items():
                        self.lists[v].free([page])
                    return False
                fresh[w] = lst.allocate(1)[0]
        for w, table in seq.table.groups.items():
            held = entry.pages[w]
            shared = held[: p // s]
            self.lists[w].retain([page for page in shared if page != SCRATCH])
            table.pages[:] = shared
            if partial:
                pools.copy_page_rows(w, held[-1], fresh[w], partial)
                table.pages.append(fresh[w])
            table.released = next((i for i, page in enumerate(table.pages) if page != SCRATCH), len(table.pages))
        seq.table.touch()
        if entry.snapshot is not None:
            pools.restore(entry.snapshot, seq.slot)
        seq.prefilled = seq.committed = p
        seq.head_committed = min(entry.head_committed, p)
        if not entry.heads:     # its request ran without drafting: so does this one (the heads have no rows)
            seq.speculative = False
        seq.carries = {j: h.copy() for j, h in entry.carries.items()}
        seq.cached_tokens = p
        return True

    def evict_for(self, keep: Entry | None = None) -> bool:
        """evict(), sparing `keep` (the entry being resumed from) while another is left."""
        if keep is not None and len(self.entries) == 1 and keep.id in self.entries:
            return False
        if keep is not None and next(iter(self.entries)) == keep.id:
            self.entries.move_to_end(keep.id)
        return self.evict()

    def mark(self, seq) -> int:
        """Where a fresh prompt's prefill stops a chunk and leaves an entry: before its last token, so
        that the entry is the whole prompt (t_0 .. t_{L-1}: the next turn of a chat resends it, whatever
        the answer after it tokenizes to); 0 (none) for a prompt within one chunk, whose recomputing
        costs that one call anyway."""
        if not self.enabled or seq.num_generated or len(seq.prompt) <= self.prefill_chunk:
            return 0
        return len(seq.prompt) - 1

    def clear(self) -> None:
        while self.evict():
            pass
