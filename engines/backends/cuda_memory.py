"""Device memory for the GPU runners (TensorRT): pools and bucket buffers allocated once with
cudaMalloc, pinned host mirrors for what the host fills and reads, commits by the device commit
kernel, stream capture into CUDA graphs. cuda-python is imported lazily, only here.

`Cuda` is the whole surface used from the CUDA runtime and driver, a dozen calls; the tests run
everything above it against a host-memory stand-in (tests/fake_cuda.py).

    commit:  host int64 [dst_rows | src_rows] -> pinned staging (ring) --H2D--> device staging
             -> copy_rows kernel (pool rows <- output rows), all on the runner's stream
"""

from __future__ import annotations

import ctypes

import numpy as np

from tandem.engines.backends.common import BackendUnavailable
from tandem.engines.backends.memory import DEVICE_ALIGNMENT, Transfers, runs_as_rows

STAGING_ROWS = 1 << 16     # index pairs staged between two synchronisations (a round's commits)


class DeviceArray:
    """A device buffer (or a view of one): address, shape, dtype. Indexing the first axis gives
    a view; nothing here reads device memory."""

    def __init__(self, ptr: int, shape: tuple, dtype):
        self.ptr, self.shape, self.dtype = int(ptr), tuple(shape), np.dtype(dtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def row_bytes(self, leading: int) -> int:
        return int(np.prod(self.shape[leading:], dtype=np.int64)) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def reshape(self, *shape) -> DeviceArray:
        """The same buffer under another shape (one -1 inferred), as numpy's reshape of a contiguous array."""
        size = int(np.prod(self.shape, dtype=np.int64))
        known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
        shape = tuple(size // known if d == -1 else d for d in shape)
        if int(np.prod(shape, dtype=np.int64)) != size:
            raise ValueError(f"cannot view {self.shape} as {shape}")
        return DeviceArray(self.ptr, shape, self.dtype)

    def __getitem__(self, key):
        stride = self.row_bytes(1)
        if isinstance(key, slice):
            start, stop, step = key.indices(self.shape[0])
            if step != 1:
                raise IndexError("device arrays take contiguous slices only")
            return DeviceArray(self.ptr + start * stride, (max(0, stop - start), *self.shape[1:]), self.dtype)
        index = int(key) + (self.shape[0] if int(key) < 0 else 0)
        if not 0 <= index < self.shape[0]:
            raise IndexError(f"index {key} out of range for {self.shape[0]} rows")
        return DeviceArray(self.ptr + index * stride, self.shape[1:], self.dtype)


def pinned_view(ptr: int, nbytes: int, shape: tuple, dtype) -> np.ndarray:
    """A numpy array over pinned host memory at `ptr` (no copy)."""
    raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr)
    return np.frombuffer(raw, np.uint8, nbytes).view(dtype).reshape(shape)


class DeviceMemory:
    """The memory protocol of engines/backends/memory.py on one CUDA device and stream."""

    device = "cuda"

    def __init__(self, cuda, kernels):
        """cuda: a Cuda (or its test stand-in); kernels: launch(cuda, rows, row_bytes, src, idx, pool)."""
        self.cuda, self.kernels = cuda, kernels
        self.transfers = Transfers()
        self.allocations: dict[str, int] = {}      # name -> bytes, one cudaMalloc each
        self._host_staging = pinned_view(cuda.malloc_host(16 * STAGING_ROWS), 16 * STAGING_ROWS,
                                         (2 * STAGING_ROWS,), np.int64)
        self._device_staging = cuda.malloc(16 * STAGING_ROWS)
        self._staged = 0     # int64 entries of the ring in use since the last synchronisation

    def allocate(self, name: str, shape, dtype) -> DeviceArray:
        if name in self.allocations:
            raise ValueError(f"buffer {name!r} is allocated already: pools and bucket buffers are allocated once")
        array = DeviceArray(0, tuple(shape), dtype)
        size = -(-max(array.nbytes, 1) // DEVICE_ALIGNMENT) * DEVICE_ALIGNMENT
        array.ptr = self.cuda.malloc(size)
        self.cuda.memset(array.ptr, 0, size)
        self.allocations[name] = size
        return array

    def allocate_host(self, name: str, nbytes: int) -> int:
        """Pinned host memory (one allocation) for a bucket's host-side mirrors."""
        self.allocations[f"{name} (host)"] = nbytes
        return self.cuda.malloc_host(max(nbytes, 1))

    def scatter(self, pool: DeviceArray, leading: int, dst_rows: np.ndarray, src: DeviceArray, src_leading: int,
                src_rows: np.ndarray) -> None:
        n, row = len(dst_rows), pool.row_bytes(leading)
        if src.row_bytes(src_leading) != row:
            raise ValueError(f"commit rows differ in size: pool rows of {row} bytes, output rows of "
                             f"{src.row_bytes(src_leading)}")
        if n == 0:
            return
        idx = self._stage(dst_rows, src_rows)
        self.kernels(self.cuda, n, row, src.ptr, idx, pool.ptr)
        self.transfers.to_backend += 16 * n
        self.transfers.commits += 1

    def scatter_many(self, pairs, dst_rows: np.ndarray, src_rows: np.ndarray) -> None:
        """Each (pool, src) [rows, row] pair scattered under one index pair, staged and sent once."""
        n = len(dst_rows)
        if n == 0 or not pairs:
            return
        for pool, src in pairs:
            if src.row_bytes(1) != pool.row_bytes(1):
                raise ValueError(f"commit rows differ in size: pool rows of {pool.row_bytes(1)} bytes, output rows "
                                 f"of {src.row_bytes(1)}")
        idx = self._stage(dst_rows, src_rows)
        for pool, src in pairs:
            self.kernels(self.cuda, n, pool.row_bytes(1), src.ptr, idx, pool.ptr)
        self.transfers.to_backend += 16 * n
        self.transfers.commits += len(pairs)

    def scatter_runs(self, pairs, runs) -> None:
        """Contiguous runs (memory.HostMemory.scatter_runs) as one index pair."""
        if runs:
            self.scatter_many(pairs, *runs_as_rows(runs))

    def _stage(self, dst_rows: np.ndarray, src_rows: np.ndarray) -> int:
        """Copy one index pair into the staging ring and on to the device; returns its device address
        (dst rows, then src rows)."""
        n = len(dst_rows)
        if self._staged + 2 * n > self._host_staging.size:
            self.synchronize()                    # the ring is full: let the queued copies finish first
        at = self._staged
        self._host_staging[at : at + n] = dst_rows
        self._host_staging[at + n : at + 2 * n] = np.arange(n) if src_rows is None else src_rows
        self._staged += 2 * n
        idx = self._device_staging + 8 * at
        self.cuda.copy_to_device(idx, self._host_staging.ctypes.data + 8 * at, 16 * n)
        return idx

    def zero_row(self, pool: DeviceArray, row: int) -> None:
        size = pool.row_bytes(1)
        self.cuda.memset(pool.ptr + row * size, 0, size)

    def synchronize(self) -> None:
        self.cuda.synchronize()
        self._staged = 0


class Cuda:
    """The CUDA runtime and driver calls the GPU runners make (cuda-python), on one stream."""

    def __init__(self, device: int = 0):
        try:
            from cuda.bindings import driver, runtime
        except ImportError:
            try:
                from cuda import cuda as driver
                from cuda import cudart as runtime
            except ImportError as e:
                raise BackendUnavailable("the TensorRT runner needs cuda-python (pip install cuda-python) and an "
                                         "NVIDIA GPU; neither is importable here. Serve onnxruntime engines on "
                                         "this machine (build-engines --backend onnxruntime).") from e
        self.rt, self.drv = runtime, driver
        err, count = runtime.cudaGetDeviceCount()
        if int(err) != 0 or count == 0:
            raise BackendUnavailable("the TensorRT runner needs an NVIDIA GPU, and CUDA finds none here "
                                     f"({err}); serve onnxruntime engines on this machine")
        self._check(runtime.cudaSetDevice(device))
        self.stream = self._check(runtime.cudaStreamCreate())

    def _check(self, result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise RuntimeError(f"CUDA call failed: {err}")
        return rest[0] if len(rest) == 1 else rest or None

    def malloc(self, nbytes: int) -> int:
        return int(self._check(self.rt.cudaMalloc(nbytes)))

    def malloc_host(self, nbytes: int) -> int:
        return int(self._check(self.rt.cudaMallocHost(nbytes)))

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self._check(self.rt.cudaMemsetAsync(ptr, value, nbytes, self.stream))

    def copy_to_device(self, dst: int, src: int, nbytes: int) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._check(self.rt.cudaMemcpyAsync(dst, src, nbytes, kind, self.stream))

    def copy_to_host(self, dst: int, src: int, nbytes: int) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._check(self.rt.cudaMemcpyAsync(dst, src, nbytes, kind, self.stream))

    def synchronize(self) -> None:
        self._check(self.rt.cudaStreamSynchronize(self.stream))

    @property
    def stream_handle(self) -> int:
        return int(self.stream)

    def capture(self, sequence):
        """Record `sequence()`'s work on the stream into an instantiated CUDA graph (not run)."""
        mode = self.rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        self._check(self.rt.cudaStreamBeginCapture(self.stream, mode))
        try:
            sequence()
        finally:
            graph = self._check(self.rt.cudaStreamEndCapture(self.stream))
        return self._check(self.rt.cudaGraphInstantiate(graph, 0))

    def replay(self, graph) -> None:
        self._check(self.rt.cudaGraphLaunch(graph, self.stream))

    def load_kernel(self, ptx: str, name: str):
        module = self._check(self.drv.cuModuleLoadData(ptx.encode() + b"\0"))
        return self._check(self.drv.cuModuleGetFunction(module, name.encode()))

    def launch(self, function, grid: tuple, block: tuple, shared: int, args: tuple, types: tuple) -> None:
        self._check(self.drv.cuLaunchKernel(function, *grid, *block, shared, self.stream, (args, types), 0))


class CommitKernels:
    """The copy_rows kernel, compiled to PTX for this GPU once and launched through the driver."""

    def __init__(self, cuda: Cuda, capability: int):
        from tandem.engines.backends.commit_kernel import copy_rows_plan
        from tandem.plugins.ptx import compile_ptx
        compiled = compile_ptx(copy_rows_plan(1, 1), capability)
        self.function = cuda.load_kernel(compiled.ptx, compiled.name)
        self.warps, self.shared, self.plan = compiled.num_warps, compiled.shared_bytes, copy_rows_plan

    def __call__(self, cuda: Cuda, rows: int, row_bytes: int, src: int, idx: int, pool: int) -> None:
        grid = self.plan(rows, row_bytes).grid
        args = (src, idx, idx + 8 * rows, row_bytes, pool)
        types = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
        cuda.launch(self.function, grid, (32 * self.warps, 1, 1), self.shared, args, types)
