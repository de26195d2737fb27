"""Page and state-slot allocation: plain Python over free lists, no runtime imports.

Page 0 and slot 0 are reserved as scratch: padded batch rows point at them, so a padded row
reads and writes nothing that belongs to a sequence.

Freed pages and slots are handed out again before any never-used one. The pools are zeroed
arrays that the OS maps in only when first touched, so the resident part of a pool is the set of
pages ever handed out; reusing the last freed keeps that set at the peak number in use at once.
A first-in-first-out queue cycled through the whole pool instead, and RSS grew with every
request until the pool was resident (+10 to +30 KiB per request on tiny engines with the
default 512 MiB budget; docs/pipeline.md).
"""

from __future__ import annotations

SCRATCH = 0


class OutOfMemory(Exception):
    """No free page or slot; the scheduler preempts a sequence and retries."""


class FreeList:
    """Items 1..size-1; freed items are handed out again first (last freed, first out), and an
    item never handed out only when none is free: the items ever used stay as few as the peak
    number in use at once."""

    def __init__(self, size: int, what: str):
        if size < 2:
            raise ValueError(f"need at least 2 {what}s (one is scratch), got {size}")
        self.size, self.what = size, what
        self._freed: list[int] = []     # a stack: the end is handed out next
        self._fresh = 1                 # items >= this were never handed out

    @property
    def num_free(self) -> int:
        return len(self._freed) + self.size - self._fresh

    @property
    def ever_used(self) -> int:
        """Items handed out at least once (what the pools hold resident)."""
        return self._fresh - 1

    def allocate(self, n: int) -> list[int]:
        freed = self._freed
        reused = min(n, len(freed))
        if n - reused > self.size - self._fresh:
            raise OutOfMemory(f"need {n} {self.what}(s), {self.num_free} free")
        out = freed[len(freed) - reused :]
        del freed[len(freed) - reused :]
        out.reverse()                   # the top of the stack first
        if n > reused:
            out += range(self._fresh, self._fresh + n - reused)
            self._fresh += n - reused
        return out

    def free(self, items: list[int]) -> None:
        self._freed.extend(reversed(items))   # items[0] on top: a table comes back in its order


class BlockTable:
    """The pages of one sequence; page i holds positions [i*S, (i+1)*S) of the target and of
    every MTP head (their pools share the table)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.pages: list[int] = []

    def capacity(self) -> int:
        return len(self.pages) * self.page_size

    def ensure(self, positions: int, allocator: FreeList) -> None:
        """Grow to hold `positions` positions (raises OutOfMemory, allocating nothing)."""
        need = -(-positions // self.page_size) - len(self.pages)
        if need > 0:
            self.pages.extend(allocator.allocate(need))

    def release(self, allocator: FreeList) -> None:
        allocator.free(self.pages)
        self.pages = []
