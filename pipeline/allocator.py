"""Page and state-slot allocation: plain Python over free lists, no runtime imports.

Page 0 and slot 0 are reserved as scratch: padded batch rows point at them, so a padded row
reads and writes nothing that belongs to a sequence.
"""

from __future__ import annotations

from collections import deque

SCRATCH = 0


class OutOfMemory(Exception):
    """No free page or slot; the scheduler preempts a sequence and retries."""


class FreeList:
    def __init__(self, size: int, what: str):
        if size < 2:
            raise ValueError(f"need at least 2 {what}s (one is scratch), got {size}")
        self.size, self.what = size, what
        self._free = deque(range(1, size))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfMemory(f"need {n} {self.what}(s), {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, items: list[int]) -> None:
        self._free.extend(items)


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
