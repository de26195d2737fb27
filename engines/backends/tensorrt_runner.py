"""The TensorRT pipeline runner: the backend protocol (memory, binding, capture) on a GPU.

Per engine file one deserialized engine; per bucket (file, batch, rows, pages) one execution
context on the optimization profile that holds the batch, and one buffer plan: the inputs the
host fills, then the outputs it reads, then the outputs only the commits read, laid out in one
device allocation, with the first two ranges mirrored in pinned host memory. Pools are device
buffers (DeviceMemory), bound once by address. A call is a fixed sequence on the runner's stream:

    H2D  inputs (one copy)  ->  enqueueV3  ->  D2H  host outputs (one copy)

run plainly once (TensorRT sets itself up for the shapes), then captured into one CUDA graph
per bucket and replayed every call after (memory.Replay). Nothing pool-sized crosses: commits
go to the device commit kernel with O(batch x k) index bytes. Imports tensorrt and cuda-python
only when constructed; without them, or without a GPU, it raises BackendUnavailable.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tandem.engines.backends.common import BackendUnavailable
from tandem.engines.backends.cuda_memory import CommitKernels, Cuda, DeviceArray, DeviceMemory, pinned_view
from tandem.engines.backends.memory import Replay, Transfers, plan_buffers


def _profile_for(engine, name: str, batch: int) -> int:
    """The optimization profile whose range of `name`'s first dimension holds `batch`."""
    for profile in range(engine.num_optimization_profiles):
        lo, _, hi = engine.get_tensor_profile_shape(name, profile)
        if lo[0] <= batch <= hi[0]:
            return profile
    raise ValueError(f"no optimization profile of the engine takes batch {batch}; rebuild the engine dir "
                     "with this batch size in --batch-sizes")


class Runner:
    def __init__(self, engine_dir: Path, files: list[str], threads: int | None = None, device: str | None = None,
                 trt=None, cuda=None, kernels=None):
        """trt / cuda / kernels: the libraries' stand-ins in tests; imported and built here otherwise."""
        if device not in (None, "cuda"):
            raise ValueError(f"TensorRT engines run on an NVIDIA GPU (device 'cuda'), not on device {device!r}")
        from tandem.engines.backends import tensorrt_backend
        try:
            self.trt = trt or tensorrt_backend._trt()
            self.cuda = cuda or Cuda()
        except BackendUnavailable as e:
            raise BackendUnavailable(f"{engine_dir} holds TensorRT engines, which run only where the TensorRT Python "
                                     f"package, cuda-python and an NVIDIA GPU are present: {e}") from e
        if kernels is None:
            from tandem.plugins.ptx import current_capability
            tensorrt_backend._register_plugins()        # plans with plugin layers need their creators
            kernels = CommitKernels(self.cuda, current_capability())
        self.memory = DeviceMemory(self.cuda, kernels)
        self.host_kernels = None      # the backend protocol's host kernels: none (numpy samples on the host)
        runtime = self.trt.Runtime(self.trt.Logger(self.trt.Logger.WARNING))
        self.engines = {}
        for f in files:
            engine = runtime.deserialize_cuda_engine((Path(engine_dir) / f).read_bytes())
            if engine is None:
                raise RuntimeError(f"{Path(engine_dir) / f}: TensorRT could not deserialize the plan (built with "
                                   "another TensorRT version or for another GPU?); rebuild the engine dir here")
            self.engines[f] = engine
        self._bindings: dict[tuple, _Binding] = {}

    @property
    def transfers(self) -> Transfers:
        return self.memory.transfers

    def binding(self, file: str, key: tuple, input_shapes: dict, output_shapes: dict, fixed: dict,
                backend_outputs=frozenset()) -> _Binding:
        b = self._bindings.get((file, key))
        if b is None:
            b = self._bindings[(file, key)] = _Binding(self, self.engines[file], f"{file}{key}", key[0], input_shapes,
                                                       output_shapes, fixed, backend_outputs)
        return b

    def prefetch(self, files: list[str]) -> None:
        """The backend protocol's early open: this runner opened every engine when it was made."""

    def ready(self, files: list[str]) -> bool:
        """The backend protocol's open check: every engine was opened when this runner was made."""
        return True

    def capture(self, binding: _Binding):
        return binding.run


class _Binding:
    def __init__(self, runner: Runner, engine, name: str, batch: int, input_shapes: dict, output_shapes: dict,
                 fixed: dict, backend_outputs):
        trt, cuda, memory = runner.trt, runner.cuda, runner.memory
        self.cuda, self.memory, self.transfers = cuda, memory, memory.transfers
        tensors = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        is_input = {t: engine.get_tensor_mode(t) == trt.TensorIOMode.INPUT for t in tensors}
        dtype = {t: np.dtype(trt.nptype(engine.get_tensor_dtype(t))) for t in tensors}
        ins = [(n, s, dtype[n]) for n, s in input_shapes.items() if n in dtype]
        host_outs = [(n, s, dtype[n]) for n, s in output_shapes.items() if n in dtype and n not in backend_outputs]
        dev_outs = [(n, s, dtype[n]) for n, s in output_shapes.items() if n in dtype and n in backend_outputs]
        missing = [t for t in tensors if t not in input_shapes and t not in output_shapes and t not in fixed]
        if missing:
            raise ValueError(f"{name}: the engine has tensors the pipeline does not bind ({', '.join(missing)}); "
                             "the engine dir was built for another graph contract: rebuild it")
        self.plan = plan_buffers([*ins, *host_outs, *dev_outs])
        self.device = memory.allocate(name, (self.plan.total,), np.uint8).ptr
        self.upload = self.plan.span([n for n, *_ in ins])              # (offset, bytes)
        self.download = self.plan.span([n for n, *_ in host_outs])
        host_bytes = max(a + b for a, b in (self.upload, self.download))
        self.host = memory.allocate_host(name, host_bytes)
        view = lambda n: pinned_view(self.host + self.plan[n].offset, self.plan[n].nbytes,  # noqa: E731
                                     self.plan[n].shape, self.plan[n].dtype)
        self.inputs = {n: view(n) for n, *_ in ins}
        self.outputs = {**{n: view(n) for n, *_ in host_outs},
                        **{n: DeviceArray(self.device + self.plan[n].offset, s, d) for n, s, d in dev_outs}}
        self.context = engine.create_execution_context()
        first = next(t for t in tensors if is_input[t] and t in input_shapes)
        self.context.set_optimization_profile_async(_profile_for(engine, first, batch), cuda.stream_handle)
        self.addresses = {}
        for t in tensors:
            if t in fixed:
                self.addresses[t] = fixed[t].ptr
                self.context.set_input_shape(t, fixed[t].shape)
            else:
                self.addresses[t] = self.device + self.plan[t].offset
                if is_input[t]:
                    self.context.set_input_shape(t, self.plan[t].shape)
            self.context.set_tensor_address(t, self.addresses[t])
        self.replay = Replay()

    def _sequence(self) -> None:
        (up, up_n), (down, down_n) = self.upload, self.download
        self.cuda.copy_to_device(self.device + up, self.host + up, up_n)
        if not self.context.execute_async_v3(self.cuda.stream_handle):
            raise RuntimeError("TensorRT enqueue failed (see its log above)")
        self.cuda.copy_to_host(self.host + down, self.device + down, down_n)

    def run(self) -> dict:
        addresses = (self.device, self.host, *self.addresses.values())
        self.replay.run(addresses, self._sequence, lambda: self.cuda.capture(self._sequence), self.cuda.replay)
        self.memory.synchronize()                 # outputs are read now; the commit ring starts over
        self.transfers.calls += 1
        self.transfers.to_backend += self.upload[1]
        self.transfers.to_host += self.download[1]
        return self.outputs
