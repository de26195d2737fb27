"""Backend-owned memory: the protocol a pipeline runner's memory speaks, the host implementation
that ONNX Runtime's CPU provider reads in place, the buffer plan device backends allocate
from, the per-bucket capture bookkeeping, and the host<->backend byte counters.

    Pools (load)      ─► memory.allocate(name, shape, dtype)        one allocation per pool
    ModelRunner       ─► runner.binding(...)                        once per bucket: its I/O buffers
    Pools (commit)    ─► every round, on the backend:
                         memory.scatter_many(pairs, dst_rows, src_rows)  several pools under one index
                                             pair (plain decoding's commit, the states' commit;
                                             src_rows None: the output's first len(dst_rows) rows)
                         memory.scatter_runs(pairs, runs)  contiguous runs (the rounds' and prefill's rows)
                         (memory.scatter: one pool; zero_row and bench/commit_paths.py use it)

A commit is a row scatter per pool: the pool seen as [R, row] (paged: R = num_pages x
page_size; states: R = num_slots), the engine output that holds the new rows seen as
[B x W, row] (states: [B, row]). The host computes and sends only int64 indices (or runs),
O(batch x k) of them; nothing pool-sized crosses per round. Knows no tensor names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

HOST_ALIGNMENT = 64        # a cache line: what ONNX Runtime's CPU kernels like their buffers aligned to
DEVICE_ALIGNMENT = 256     # cudaMalloc's own alignment; TensorRT wants >= 256 bytes per I/O tensor


@dataclass
class Transfers:
    """Bytes the host moved to the backend (inputs it filled, commit indices) and from it
    (outputs it read), and the calls and commits that moved them. Counters, not config."""

    to_backend: int = 0
    to_host: int = 0
    calls: int = 0
    commits: int = 0

    def total(self) -> int:
        return self.to_backend + self.to_host

    def since(self, before: Transfers) -> Transfers:
        return Transfers(self.to_backend - before.to_backend, self.to_host - before.to_host,
                         self.calls - before.calls, self.commits - before.commits)

    def copy(self) -> Transfers:
        return Transfers(self.to_backend, self.to_host, self.calls, self.commits)


def rows_view(array, leading: int):
    """`array` (numpy or a device array) as [rows, row] with its first `leading` axes flattened into rows."""
    if leading == 1 and len(array.shape) == 2:   # already rows: the commit plans pass such views every round
        return array
    return array.reshape(math.prod(array.shape[:leading]), -1)


def runs_as_rows(runs: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Runs (dst start, src start, count) -> the (dst rows, src rows) index pair of a scatter: what a
    device backend sends for scatter_runs."""
    dst = np.concatenate([np.arange(d, d + n, dtype=np.int64) for d, _, n in runs])
    src = np.concatenate([np.arange(s, s + n, dtype=np.int64) for _, s, n in runs])
    return dst, src


def aligned_zeros(shape, dtype, alignment: int = HOST_ALIGNMENT) -> np.ndarray:
    """A zeroed C-contiguous array whose data starts on an `alignment`-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.zeros(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)


# rows from this size up are copied one by one: 8 rows of 0.5 MiB (a Gated DeltaNet state) took
# 290-430 us through a fancy-indexed scatter (it gathers into a temporary first) and 130-140 us as 8
# slice copies; at 1 KiB rows the fancy one is faster (3.0 against 3.5 us)
_ROW_COPY_BYTES = 8192


class HostMemory:
    """Pools and bucket buffers in host memory, read and written in place by ONNX Runtime's CPU
    provider. Commits are numpy row scatters into the pools' own buffers: measured cheaper than
    an ONNX Runtime scatter graph bound to the same buffers (docs/engines.md, bench/commit_paths.py)."""

    device = "cpu"

    def __init__(self):
        self.transfers = Transfers()
        self.allocations: dict[str, np.ndarray] = {}

    def allocate(self, name: str, shape, dtype) -> np.ndarray:
        """One zeroed, aligned allocation, kept under `name` (a pool or a bucket buffer)."""
        if name in self.allocations:
            raise ValueError(f"buffer {name!r} is allocated already: pools and bucket buffers are allocated once")
        array = self.allocations[name] = aligned_zeros(tuple(shape), dtype)
        return array

    def scatter(self, pool: np.ndarray, leading: int, dst_rows: np.ndarray, src: np.ndarray, src_leading: int,
                src_rows: np.ndarray) -> None:
        """pool[dst_rows[i]] = src[src_rows[i]], pool seen as [R, row] over its first `leading`
        axes and src over its first `src_leading` (views: no copy of either buffer)."""
        self.scatter_many([(rows_view(pool, leading), rows_view(src, src_leading))], dst_rows, src_rows)

    def scatter_runs(self, pairs, runs: list[tuple[int, int, int]]) -> None:
        """pool[d : d + n] = src[s : s + n] for each run (d, s, n) and each (pool, src) [rows, row]
        pair: a sequence's new rows are contiguous in the output and, within a page, in the pool, so
        a commit is a few slice copies (a fancy-indexed scatter costs 4-5x a slice at these sizes).
        Counted as the index pair a device backend would send."""
        self.transfers.to_backend += 16 * sum(n for _, _, n in runs)
        self.transfers.commits += len(pairs)
        for pool, src in pairs:
            for d, s, n in runs:
                pool[d : d + n] = src[s : s + n]

    def scatter_many(self, pairs, dst_rows: np.ndarray, src_rows: np.ndarray | None) -> None:
        """pool[dst_rows[i]] = src[src_rows[i]] for each (pool, src) of `pairs`, both already
        [rows, row] views: the pools of one page group (or every state pool) share one index pair,
        so it is counted (and on a device, sent) once for all of them. src_rows None: src's first
        len(dst_rows) rows, in order (plain decoding's commit: a slice, not a gathered copy, half
        the time of the fancy-indexed pair at batch 8)."""
        n = len(dst_rows)
        self.transfers.to_backend += 2 * dst_rows.nbytes
        self.transfers.commits += len(pairs)
        if n == 1:   # batch 1 decoding: a plain row copy, a fifth of the fancy-indexed one's time
            dst, src_row = dst_rows[0], 0 if src_rows is None else src_rows[0]
            for pool, src in pairs:
                pool[dst] = src[src_row]
        else:
            listed = None
            for pool, src in pairs:
                if src[0].nbytes < _ROW_COPY_BYTES:
                    pool[dst_rows] = src[:n] if src_rows is None else src[src_rows]
                else:   # large rows (recurrent states): a copy per row, no gathered temporary to fault in
                    listed = listed or list(zip(dst_rows.tolist(), range(n) if src_rows is None else src_rows.tolist()))
                    for dst, src_row in listed:
                        pool[dst] = src[src_row]

    def zero_row(self, pool: np.ndarray, row: int) -> None:
        pool[row] = 0


@dataclass(frozen=True)
class Placement:
    name: str
    offset: int
    nbytes: int
    shape: tuple
    dtype: str


@dataclass(frozen=True)
class BufferPlan:
    """Buffers laid out in one allocation, each at an aligned offset, in the order given: a
    bucket's inputs first (one host->device copy uploads them all), then the outputs the host
    reads (one device->host copy), then the outputs that stay on the device."""

    placements: tuple[Placement, ...]
    total: int
    alignment: int

    def __getitem__(self, name: str) -> Placement:
        return next(p for p in self.placements if p.name == name)

    def span(self, names) -> tuple[int, int]:
        """(offset, bytes) of the contiguous range that covers `names` (empty: (0, 0))."""
        chosen = [p for p in self.placements if p.name in set(names)]
        if not chosen:
            return 0, 0
        start = min(p.offset for p in chosen)
        return start, max(p.offset + p.nbytes for p in chosen) - start


def plan_buffers(buffers: list[tuple[str, tuple, str]], alignment: int = DEVICE_ALIGNMENT) -> BufferPlan:
    """(name, shape, dtype) in order -> aligned offsets in one allocation."""
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    placements, offset = [], 0
    for name, shape, dtype in buffers:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        placements.append(Placement(name, offset, nbytes, tuple(shape), np.dtype(dtype).name))
        offset += -(-max(nbytes, 1) // alignment) * alignment
    return BufferPlan(tuple(placements), offset, alignment)


@dataclass
class Replay:
    """Capture bookkeeping of one bucket: the call sequence runs plainly `warmup` times (the
    first runs allocate workspace and pick kernels), is then captured once into a graph with
    the buffer addresses it saw, and replayed after that. A replay with other addresses would
    read freed or foreign memory, so it is refused."""

    warmup: int = 1
    runs: int = 0
    captures: int = 0
    replays: int = 0
    graph: object = None
    addresses: tuple = ()
    log: list = field(default_factory=list)

    def run(self, addresses: tuple, plain, capture, replay):
        """plain(): run the sequence; capture() -> graph (the sequence recorded, not run);
        replay(graph): run the recorded sequence."""
        self.runs += 1
        if self.graph is None and self.runs <= self.warmup:
            self.log.append("run")
            return plain()
        if self.graph is None:  # capturing records the sequence without running it
            self.graph, self.addresses = capture(), addresses
            self.captures += 1
            self.log.append("capture")
        if addresses != self.addresses:
            raise RuntimeError("a captured bucket's buffers moved (captured at "
                               f"{self.addresses}, now {addresses}); bucket buffers must be allocated once")
        self.replays += 1
        self.log.append("replay")
        return replay(self.graph)
