"""A stand-in for the CUDA surface of engines/backends/cuda_memory.py (`Cuda`): "device" memory
is host memory, the stream is a queue run in order, stream capture records the queued work and a
replay runs the recording again (reading the pinned host buffers as they are then, as a CUDA
graph's copy nodes do). Every operation run is logged, so tests see each bucket's call sequence."""

from __future__ import annotations

import ctypes

import numpy as np

from tandem.engines.backends.memory import aligned_zeros


class FakeCuda:
    stream_handle = 7

    def __init__(self):
        self.buffers: dict[int, np.ndarray] = {}    # address -> the host array behind it (kept alive)
        self.mallocs = 0
        self.log: list = []                          # operations run, in order
        self.captures: list = []
        self._recording: list | None = None

    def _alloc(self, nbytes: int) -> int:
        buf = aligned_zeros((nbytes,), np.uint8, 256)
        self.buffers[buf.ctypes.data] = buf
        return buf.ctypes.data

    def malloc(self, nbytes: int) -> int:
        self.mallocs += 1
        return self._alloc(nbytes)

    def malloc_host(self, nbytes: int) -> int:
        return self._alloc(nbytes)

    def enqueue(self, op, fn) -> None:
        if self._recording is not None:
            self._recording.append((op, fn))
        else:
            self.log.append(op)
            fn()

    def memset(self, ptr, value, nbytes):
        self.enqueue("memset", lambda: ctypes.memset(ptr, value, nbytes))

    def copy_to_device(self, dst, src, nbytes):
        self.enqueue("h2d", lambda: ctypes.memmove(dst, src, nbytes))

    def copy_to_host(self, dst, src, nbytes):
        self.enqueue("d2h", lambda: ctypes.memmove(dst, src, nbytes))

    def synchronize(self):
        pass

    def capture(self, sequence):
        self._recording = []
        try:
            sequence()
        finally:
            graph, self._recording = self._recording, None
        self.captures.append(graph)
        return graph

    def replay(self, graph):
        self.log.append("graph")
        for op, fn in graph:
            self.log.append(op)
            fn()


def copy_rows(cuda: FakeCuda, rows: int, row_bytes: int, src: int, idx: int, pool: int) -> None:
    """The commit kernel's effect (engines/backends/commit_kernel.py), reading its index vector
    from "device" memory when the stream reaches it."""
    def run():
        index = np.frombuffer((ctypes.c_int64 * (2 * rows)).from_address(idx), np.int64)
        for d, s in zip(index[:rows], index[rows:]):
            ctypes.memmove(pool + int(d) * row_bytes, src + int(s) * row_bytes, row_bytes)
    cuda.enqueue("commit", run)
