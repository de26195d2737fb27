"""A stand-in for the slice of `tensorrt` / `tensorrt.plugin` that plugins/tensorrt_registration.py
calls, following TensorRT's documented Python API, so that glue runs on machines without
TensorRT. Dims are ints that answer is_constant / constant_value(); registered functions are
kept for the test to call as TensorRT would."""

from __future__ import annotations

import types
from dataclasses import dataclass, field


class Dim(int):
    is_constant = True

    def constant_value(self) -> int:
        return int(self)


class DynamicDim(Dim):
    is_constant = False


@dataclass
class TensorDesc:
    shape: tuple
    dtype: str = "float32"

    @property
    def shape_expr(self):
        return [d if isinstance(d, Dim) else Dim(d) for d in self.shape]

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass
class KernelLaunchParams:
    grid_x: object = 1
    grid_y: object = 1
    grid_z: object = 1
    block_x: int = 1
    shared_mem: int = 0


@dataclass
class SymInt32:
    expr: object


@dataclass
class FakePlugins:
    descs: dict = field(default_factory=dict)
    aots: dict = field(default_factory=dict)


def make_modules():
    """(tensorrt, tensorrt.plugin, registry of what was registered)."""
    registry = FakePlugins()
    trt = types.ModuleType("tensorrt")
    trt.float32, trt.float16, trt.bfloat16 = "float32", "float16", "bfloat16"
    trtp = types.ModuleType("tensorrt.plugin")
    trtp.TensorDesc, trtp.KernelLaunchParams, trtp.SymInt32 = TensorDesc, KernelLaunchParams, SymInt32
    trtp.ShapeExprs = types.SimpleNamespace(from_tuple=tuple)
    trtp.SymIntExprs = types.SimpleNamespace(from_tuple=list)
    trtp.from_shape_expr = lambda shape, dtype: TensorDesc(tuple(shape), dtype)

    def register(plugin_id):
        def wrap(fn):
            registry.descs[plugin_id] = fn
            return fn
        return wrap

    def aot_impl(plugin_id):
        def wrap(fn):
            registry.aots[plugin_id] = fn
            return fn
        return wrap

    trtp.register, trtp.aot_impl = register, aot_impl
    trt.plugin = trtp
    return trt, trtp, registry


# ---- the runtime slice the pipeline runner (engines/backends/tensorrt_runner.py) calls ----------------
def make_runtime(cuda, engine_dir):
    """A `tensorrt` stand-in whose engines are the ONNX Runtime engine files of `engine_dir`: a
    plan's bytes name the file, an execution context runs it over the addresses it was given
    (host memory: tests/fake_cuda.py), enqueued on the stand-in stream so capture records it."""
    import ctypes
    import types as types_module
    from pathlib import Path

    import numpy as np

    from tandem.engines.backends.onnxruntime_backend import session

    files = {p.read_bytes(): p for p in Path(engine_dir).glob("*.onnx")}
    types = {"tensor(int64)": np.dtype(np.int64), "tensor(int32)": np.dtype(np.int32),
             "tensor(float)": np.dtype(np.float32), "tensor(float16)": np.dtype(np.float16)}
    trt = types_module.ModuleType("tensorrt")
    trt.TensorIOMode = types_module.SimpleNamespace(INPUT="input", OUTPUT="output")
    trt.nptype = lambda dtype: dtype

    class Logger:
        WARNING = 2

        def __init__(self, level):
            self.level = level

    class Context:
        def __init__(self, engine):
            self.engine, self.shapes, self.addresses, self.profile = engine, {}, {}, None

        def set_optimization_profile_async(self, profile, stream):
            self.profile = profile

        def set_input_shape(self, name, shape):
            self.shapes[name] = tuple(shape)

        def set_tensor_address(self, name, ptr):
            self.addresses[name] = ptr

        def execute_async_v3(self, stream):
            cuda.enqueue("enqueue", self._run)
            return True

        def _run(self):
            sess = self.engine.sess
            io = sess.io_binding()
            for i in sess.get_inputs():
                io.bind_input(i.name, "cpu", 0, types[i.type], self.shapes[i.name], self.addresses[i.name])
            for o in sess.get_outputs():
                io.bind_output(o.name, "cpu")
            sess.run_with_iobinding(io)
            for o, value in zip(sess.get_outputs(), io.copy_outputs_to_cpu()):
                value = np.ascontiguousarray(value)
                ctypes.memmove(self.addresses[o.name], value.ctypes.data, value.nbytes)

    class Engine:
        num_optimization_profiles = 2       # batches 1..4 and 5..1024, as one profile per batch range

        def __init__(self, path):
            self.sess = session(path)
            self.tensors = [t for t in (*self.sess.get_inputs(), *self.sess.get_outputs())]
            self.inputs = {i.name for i in self.sess.get_inputs()}
            self.contexts = []

        @property
        def num_io_tensors(self):
            return len(self.tensors)

        def get_tensor_name(self, i):
            return self.tensors[i].name

        def get_tensor_mode(self, name):
            return trt.TensorIOMode.INPUT if name in self.inputs else trt.TensorIOMode.OUTPUT

        def get_tensor_dtype(self, name):
            return types[next(t.type for t in self.tensors if t.name == name)]

        def get_tensor_profile_shape(self, name, profile):
            return [(1,), (4,), (4,)] if profile == 0 else [(5,), (8,), (1024,)]

        def create_execution_context(self):
            self.contexts.append(Context(self))
            return self.contexts[-1]

    class Runtime:
        def __init__(self, logger):
            self.engines = []

        def deserialize_cuda_engine(self, plan: bytes):
            self.engines.append(Engine(files[plan]))
            return self.engines[-1]

    trt.Logger, trt.Runtime = Logger, Runtime
    return trt
