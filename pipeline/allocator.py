"""Page and state-slot allocation: plain Python over free lists, no runtime imports.

Page 0 and slot 0 are reserved as scratch: padded batch rows point at them, so a padded row
reads and writes nothing that belongs to a sequence.

Freed pages and slots are handed out again before any never-used one. The pools are zeroed
arrays that the OS maps in only when first touched, so the resident part of a pool is the set of
pages ever handed out; reusing the last freed keeps that set at the peak number in use at once.
A first-in-first-out queue cycled through the whole pool instead, and RSS grew with every
request until the pool was resident (+10 to +30 KiB per request on tiny engines with the
default 512 MiB budget; docs/pipeline.md).

Page groups (contract.page_groups): the paged pools of full-attention layers form one group,
those of each sliding window w another, each group with its own pools, free list and block
table per sequence. Page i of every group's table holds positions [i*S, (i+1)*S), so logical
indexing is the same in all groups. A window group's page whose positions all lie below
(smallest context any graph still writes or queries from) - w + 1 is never read again (a query
at q reads keys q-w+1..q): it goes back to its free list while the sequence runs and its entry
becomes SCRATCH (masked by the window, never read). A long generation thus holds O(w) pages of
a window group and O(length) only of the full group. Why per-group tables rather than one
table with holes: the groups' pools differ in bytes per page, so a shared page number would
waste the window pools' share of every full-attention page, and the budget could not size them
apart (pipeline/pools.py plan_pools).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from tandem.contract import block_tables

SCRATCH = 0
_versions = itertools.count(1)   # table versions are unique over the process: a version names one table's state


class OutOfMemory(Exception):
    """No free page or slot; the scheduler preempts a sequence and retries."""


class FreeList:
    """Items 1..size-1; freed items are handed out again first (last freed, first out), and an
    item never handed out only when none is free: the items ever used stay as few as the peak
    number in use at once.

    `lowest_first` hands out the lowest free item instead (state slots): sequences admitted
    together then hold consecutive slots in admission order, and a decode batch whose slots are
    consecutive has its states written by the engine straight into the pool rows
    (ModelRunner._place_states), with no copy left for the commit."""

    def __init__(self, size: int, what: str, lowest_first: bool = False):
        if size < 2:
            raise ValueError(f"need at least 2 {what}s (one is scratch), got {size}")
        self.size, self.what = size, what
        self.lowest_first = lowest_first
        self._freed: list[int] = []     # a stack: the end is handed out next (lowest_first: a min-heap)
        self._fresh = 1                 # items >= this were never handed out
        # holders of an item beyond the one that allocated it (the prefix cache, sequences that hit it):
        # free() drops one holder, and the item goes back only when none is left
        self.shared: dict[int, int] = {}
        self.cache_holds: dict[int, int] = {}   # of an item's holders, the prefix cache's entries
        self.num_idle = 0                       # items only the cache holds: free to take back (evict)

    @property
    def num_free(self) -> int:
        return len(self._freed) + self.size - self._fresh

    @property
    def available(self) -> int:
        """Free items and those only the prefix cache holds (it gives them back when asked)."""
        return self.num_free + self.num_idle

    @property
    def ever_used(self) -> int:
        """Items handed out at least once (what the pools hold resident)."""
        return self._fresh - 1

    def allocate(self, n: int) -> list[int]:
        freed = self._freed
        reused = min(n, len(freed))
        if n - reused > self.size - self._fresh:
            raise OutOfMemory(f"need {n} {self.what}(s), {self.num_free} free")
        if self.lowest_first:
            out = [heapq.heappop(freed) for _ in range(reused)]
        else:
            out = freed[len(freed) - reused :]
            del freed[len(freed) - reused :]
            out.reverse()               # the top of the stack first
        if n > reused:
            out += range(self._fresh, self._fresh + n - reused)
            self._fresh += n - reused
        return out

    def retain(self, items, cache: bool = False) -> None:
        """One more holder of each of `items` (allocated ones): each free() drops one. `cache`: the
        holder is a prefix-cache entry (it counts toward num_idle)."""
        for item in items:
            idle = self._idle(item)
            self.shared[item] = self.shared.get(item, 0) + 1
            if cache:
                self.cache_holds[item] = self.cache_holds.get(item, 0) + 1
            self.num_idle += self._idle(item) - idle

    def _idle(self, item: int) -> bool:
        held = self.cache_holds.get(item, 0)
        return held > 0 and held == 1 + self.shared.get(item, 0)

    def free(self, items: list[int], cache: bool = False) -> None:
        """Drop one holder of each of `items`; those with none left are free again. `cache`: the
        holder was a prefix-cache entry."""
        if self.shared:
            items = self._unshared(items, cache)
        if self.lowest_first:
            for item in items:
                heapq.heappush(self._freed, item)
        else:
            self._freed.extend(reversed(items))   # items[0] on top: a table comes back in its order


    def _unshared(self, items: list[int], cache: bool) -> list[int]:
        """Of `items`, those whose last holder lets go; the others lose a holder."""
        out = []
        for item in items:
            idle = self._idle(item)
            held = self.shared.get(item, 0)
            if held > 1:
                self.shared[item] = held - 1
            elif held == 1:
                del self.shared[item]
            else:
                out.append(item)
            if cache:
                left = self.cache_holds[item] - 1
                if left:
                    self.cache_holds[item] = left
                else:
                    del self.cache_holds[item]
            self.num_idle += self._idle(item) - idle
        return out


class BlockTable:
    """The pages of one sequence in one page group: entry i is the pool page holding positions
    [i*S, (i+1)*S) of the group's pools (target and MTP heads alike: their pools share the
    table). Entries below `released` went back to the free list and read SCRATCH."""

    def __init__(self, page_size: int, window: int | None = None):
        self.page_size, self.window = page_size, window
        self.pages: list[int] = []
        self.released = 0

    @property
    def held(self) -> int:
        return len(self.pages) - self.released

    def capacity(self) -> int:
        return len(self.pages) * self.page_size

    def need(self, positions: int) -> int:
        return max(0, -(-positions // self.page_size) - len(self.pages))

    def ensure(self, positions: int, allocator: FreeList) -> None:
        """Grow to hold `positions` positions (raises OutOfMemory, allocating nothing)."""
        need = self.need(positions)
        if need > 0:
            self.pages.extend(allocator.allocate(need))

    def release_below(self, position: int, allocator: FreeList) -> int:
        """Free the pages whose positions all lie below `position`; returns how many."""
        upto = min(max(0, position) // self.page_size, len(self.pages))
        if upto <= self.released:
            return 0
        n = upto - self.released
        allocator.free(self.pages[self.released : upto])
        self.pages[self.released : upto] = [SCRATCH] * n    # in place: views of the list stay valid
        self.released = upto
        return n

    def release(self, allocator: FreeList) -> None:
        allocator.free(self.pages[self.released :])
        self.pages.clear()
        self.released = 0


class Pages(Sequence):
    """What `seq.table.pages` gives: indexable and sized as the first group's table (full
    attention when the model has any, as a single table was), with every group's table under
    its block-table input name in `tables`. A view: it follows the tables as they change."""

    __slots__ = ("tables", "_first")

    def __init__(self, tables: dict[str, list[int]]):
        self.tables = tables
        self._first = next(iter(tables.values()))

    def __len__(self) -> int:
        return len(self._first)

    def __getitem__(self, i):
        return self._first[i]

    def __repr__(self) -> str:
        return f"Pages({self.tables})"


def group_tables(pages) -> dict[str, list[int]] | None:
    """Block-table input name -> table of a `Pages`; None for a plain list (one table for all groups)."""
    return pages.tables if isinstance(pages, Pages) else None


class PageTables:
    """One sequence's block table per page group (window None: full attention), all of the same
    logical length. `lists`: the free list of each group."""

    def __init__(self, page_size: int, windows=(None,)):
        self.page_size = page_size
        self.groups = {w: BlockTable(page_size, w) for w in windows}
        self.pages = Pages({block_tables(w): t.pages for w, t in self.groups.items()})
        self.version = next(_versions)   # new on every change: the decode path refills a table row only then

    def capacity(self) -> int:
        return len(self.pages) * self.page_size

    def touch(self) -> None:
        """A new version after the tables were set from outside (a prefix cache hit)."""
        self.version = next(_versions)

    def held(self) -> dict[int | None, int]:
        """Pages this sequence holds per group."""
        return {w: t.held for w, t in self.groups.items()}

    def ensure(self, positions: int, lists: dict[int | None, FreeList]) -> None:
        """Grow every group to hold `positions` positions (raises OutOfMemory, allocating nothing)."""
        if positions <= len(self.pages._first) * self.page_size:   # most rounds: nothing to do
            return
        for w, t in self.groups.items():
            need = t.need(positions)
            if need > lists[w].num_free:
                raise OutOfMemory(f"need {need} {lists[w].what}(s), {lists[w].num_free} free")
        for w, t in self.groups.items():
            t.ensure(positions, lists[w])
        self.version = next(_versions)

    def release_out_of_window(self, min_context: int, lists: dict[int | None, FreeList]) -> int:
        """Free every window group's pages that no query from position `min_context` on reads
        (all positions below min_context - w + 1); returns how many pages went back."""
        freed = sum(t.release_below(min_context - w + 1, lists[w]) for w, t in self.groups.items() if w is not None)
        if freed:
            self.version = next(_versions)
        return freed

    def release(self, lists: dict[int | None, FreeList]) -> None:
        for w, t in self.groups.items():
            t.release(lists[w])
        self.version = next(_versions)


class PageGroups:
    """One free list per page group, keyed by window (None: full attention), full first."""

    def __init__(self, num_pages: dict[int | None, int]):
        self.lists = {w: FreeList(n, "KV page" if w is None else f"window-{w} KV page") for w, n in num_pages.items()}

    @classmethod
    def full_only(cls, pages: FreeList) -> PageGroups:
        """One group, full attention, over an existing free list."""
        groups = cls({})
        groups.lists[None] = pages
        return groups

    def new_tables(self, page_size: int) -> PageTables:
        return PageTables(page_size, tuple(self.lists))

    def in_use(self) -> dict[int | None, int]:
        """Pages sequences hold, per group (a page only the prefix cache holds is not in use: it goes
        back when needed)."""
        return {w: fl.size - 1 - fl.num_free - fl.num_idle for w, fl in self.lists.items()}
