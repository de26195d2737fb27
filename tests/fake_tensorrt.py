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
