"""ONNX Runtime on a device: the same engine files on the CUDA execution provider, pools and
bucket buffers as device OrtValues, commits by a small commit graph on the same provider, and
ONNX Runtime's own CUDA graphs (`enable_cuda_graph`, one graph id per bucket).

    commit graph:  Gather(out [S, row], src_rows) -> ScatterND(pool [R, row], dst_rows) -> pool'
                   with pool' bound to the pool's own buffer: ONNX Runtime's ScatterND skips its
                   input->output copy when they alias, so only the N accepted rows are written
                   (bench/commit_paths.py: the time does not grow with the pool)

A call: the host mirrors of the inputs are copied into their device OrtValues (same addresses
every call), the session runs (captured on its first runs under the bucket's graph id, replayed
after), the outputs the host reads are copied back. device="cpu" runs the same path on the CPU
provider without graphs: how the tests check it on machines without a GPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from tandem.engines.backends.common import BackendUnavailable
from tandem.engines.backends.cuda_memory import DeviceArray
from tandem.engines.backends.memory import Transfers, aligned_zeros, runs_as_rows
from tandem.engines.backends.onnxruntime_backend import _ensure_global_pool

_ONNX_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
               np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32}
_NUMPY_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
                "tensor(float16)": np.float16}


def commit_graph(dtype) -> onnx.ModelProto:
    """pool' = pool with rows dst_rows[i] <- src[src_rows[i]] (pool and src seen as [rows, row])."""
    t = _ONNX_TYPES[np.dtype(dtype)]
    nodes = [helper.make_node("Gather", ["src", "src_rows"], ["rows"], axis=0),
             helper.make_node("Unsqueeze", ["dst_rows", "axis"], ["dst"]),
             helper.make_node("ScatterND", ["pool", "dst", "rows"], ["pool_out"])]
    ins = [helper.make_tensor_value_info("pool", t, ["R", "row"]),
           helper.make_tensor_value_info("src", t, ["S", "row"]),
           helper.make_tensor_value_info("dst_rows", TensorProto.INT64, ["N"]),
           helper.make_tensor_value_info("src_rows", TensorProto.INT64, ["N"])]
    graph = helper.make_graph(nodes, "commit", ins, [helper.make_tensor_value_info("pool_out", t, ["R", "row"])],
                              [helper.make_tensor("axis", TensorProto.INT64, [1], [-1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _providers(device: str, device_id: int, cuda_graph: bool) -> list:
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise BackendUnavailable("device 'cuda' runs ONNX Runtime's CUDA provider, which this onnxruntime does not "
                                 "have (install onnxruntime-gpu, on a machine with an NVIDIA GPU); use device 'cpu'")
    return [("CUDAExecutionProvider", {"device_id": str(device_id), "enable_cuda_graph": "1" if cuda_graph else "0"})]


def _session(model, providers: list, threads: int | None = None) -> ort.InferenceSession:
    """On the process-wide thread pool every tandem session shares (onnxruntime_backend.session)."""
    _ensure_global_pool(threads)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    opts.use_per_session_threads = False
    return ort.InferenceSession(model, opts, providers=providers)


class OrtMemory:
    """Pools and buffers as OrtValues on `device`; commits by the commit graph, in place."""

    def __init__(self, device: str, device_id: int, providers: list):
        self.device, self.device_id, self.providers = device, device_id, providers
        self.transfers = Transfers()
        self.allocations: dict[str, ort.OrtValue] = {}
        self._commit: dict[np.dtype, tuple] = {}       # dtype -> (session, io binding)
        self._zeros: dict[tuple, DeviceArray] = {}

    def value(self, name: str, shape, dtype) -> ort.OrtValue:
        if name in self.allocations:
            raise ValueError(f"buffer {name!r} is allocated already: pools and bucket buffers are allocated once")
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.dtype(dtype), self.device, self.device_id)
        value.update_inplace(np.zeros(shape, dtype))   # zeroed once, at load
        self.allocations[name] = value
        return value

    def allocate(self, name: str, shape, dtype) -> DeviceArray:
        return DeviceArray(self.value(name, shape, dtype).data_ptr(), shape, dtype)

    def scatter(self, pool: DeviceArray, leading: int, dst_rows, src: DeviceArray, src_leading: int, src_rows) -> None:
        if len(dst_rows) == 0:
            return
        if pool.dtype not in self._commit:
            sess = _session(commit_graph(pool.dtype).SerializeToString(), self.providers)
            self._commit[pool.dtype] = (sess, sess.io_binding())
        sess, io = self._commit[pool.dtype]
        rows, row = int(np.prod(pool.shape[:leading])), int(np.prod(pool.shape[leading:]))
        src_n = int(np.prod(src.shape[:src_leading]))
        if int(np.prod(src.shape[src_leading:])) != row:
            raise ValueError(f"commit rows differ in size: pool rows of {row} elements, output rows of "
                             f"{int(np.prod(src.shape[src_leading:]))}")
        io.bind_input("pool", self.device, self.device_id, pool.dtype, [rows, row], pool.ptr)
        io.bind_input("src", self.device, self.device_id, src.dtype, [src_n, row], src.ptr)
        io.bind_cpu_input("dst_rows", np.ascontiguousarray(dst_rows, np.int64))
        src_rows = np.arange(len(dst_rows)) if src_rows is None else src_rows   # None: the first rows
        io.bind_cpu_input("src_rows", np.ascontiguousarray(src_rows, np.int64))
        io.bind_output("pool_out", self.device, self.device_id, pool.dtype, [rows, row], pool.ptr)
        sess.run_with_iobinding(io)
        self.transfers.to_backend += 16 * len(dst_rows)
        self.transfers.commits += 1

    def scatter_many(self, pairs, dst_rows, src_rows) -> None:
        """Each (pool, src) [rows, row] pair scattered under one index pair (one commit-graph run each)."""
        for pool, src in pairs:
            self.scatter(pool, 1, dst_rows, src, 1, src_rows)

    def scatter_runs(self, pairs, runs) -> None:
        """Contiguous runs (memory.HostMemory.scatter_runs) as one index pair."""
        if runs:
            self.scatter_many(pairs, *runs_as_rows(runs))

    def zero_row(self, pool: DeviceArray, row: int) -> None:
        key = (pool.dtype, pool.shape[1:])
        if key not in self._zeros:
            self._zeros[key] = self.allocate(f"zero row {key}", (1, *pool.shape[1:]), pool.dtype)
        self.scatter(pool, 1, np.array([row]), self._zeros[key], 1, np.array([0]))


class DeviceRunner:
    """The backend protocol (memory, binding, capture) on ONNX Runtime's CUDA provider."""

    def __init__(self, engine_dir: Path, files: list[str], threads: int | None = None, device: str = "cuda",
                 device_id: int = 0, cuda_graph: bool = True):
        self.cuda_graph = cuda_graph and device == "cuda"
        providers = _providers(device, device_id, self.cuda_graph)
        self.sessions = {f: _session(str(Path(engine_dir) / f), providers, threads) for f in files}
        self.memory = OrtMemory(device, device_id, providers)
        self.host_kernels = None      # the backend protocol's host kernels: none (numpy samples on the host)
        self._bindings: dict[tuple, _DeviceBinding] = {}

    @property
    def transfers(self) -> Transfers:
        return self.memory.transfers

    def binding(self, file: str, key: tuple, input_shapes: dict, output_shapes: dict, fixed: dict,
                backend_outputs=frozenset()) -> _DeviceBinding:
        b = self._bindings.get((file, key))
        if b is None:
            graph_id = len(self._bindings) + 1 if self.cuda_graph else None   # one CUDA graph per bucket
            b = self._bindings[(file, key)] = _DeviceBinding(self.sessions[file], self.memory, f"{file}{key}",
                                                             input_shapes, output_shapes, fixed, backend_outputs,
                                                             graph_id)
        return b

    def prefetch(self, files: list[str]) -> None:
        """The backend protocol's early open: this runner opened every engine when it was made."""

    def ready(self, files: list[str]) -> bool:
        """The backend protocol's open check: every engine was opened when this runner was made."""
        return True

    def capture(self, binding: _DeviceBinding):
        return binding.run


class _DeviceBinding:
    def __init__(self, sess, memory: OrtMemory, prefix: str, input_shapes, output_shapes, fixed, backend_outputs,
                 graph_id: int | None):
        self.sess, self.transfers = sess, memory.transfers
        types = {i.name: _NUMPY_TYPES[i.type] for i in sess.get_inputs()}
        out_types = {o.name: _NUMPY_TYPES[o.type] for o in sess.get_outputs()}
        self.inputs = {n: aligned_zeros(tuple(s), types[n]) for n, s in input_shapes.items() if n in types}
        self.device_inputs = {n: memory.value(f"{prefix}/{n}", a.shape, a.dtype) for n, a in self.inputs.items()}
        device_out = {n: memory.value(f"{prefix}/{n}", s, out_types[n]) for n, s in output_shapes.items()
                      if n in out_types}
        self.host_outputs = {n: aligned_zeros(tuple(v.shape()), out_types[n]) for n, v in device_out.items()
                             if n not in backend_outputs}
        self.outputs = {n: self.host_outputs.get(n) if n in self.host_outputs else
                        DeviceArray(v.data_ptr(), v.shape(), out_types[n]) for n, v in device_out.items()}
        self.io = sess.io_binding()
        for name, value in self.device_inputs.items():
            self.io.bind_ortvalue_input(name, value)
        for name, pool in fixed.items():
            if name in types:
                self.io.bind_input(name, memory.device, memory.device_id, pool.dtype, list(pool.shape), pool.ptr)
        for name, value in device_out.items():
            self.io.bind_ortvalue_output(name, value)
        self.device_outputs = device_out
        self.run_options = ort.RunOptions()
        if graph_id is not None:
            self.run_options.add_run_config_entry("gpu_graph_id", str(graph_id))
        self.bytes_in = sum(a.nbytes for a in self.inputs.values())
        self.bytes_out = sum(a.nbytes for a in self.host_outputs.values())

    def run(self) -> dict:
        for name, value in self.device_inputs.items():
            value.update_inplace(self.inputs[name])          # into the same device buffer every call
        self.sess.run_with_iobinding(self.io, self.run_options)
        for name, host in self.host_outputs.items():
            np.copyto(host, self.device_outputs[name].numpy())
        self.transfers.calls += 1
        self.transfers.to_backend += self.bytes_in
        self.transfers.to_host += self.bytes_out
        return self.outputs
