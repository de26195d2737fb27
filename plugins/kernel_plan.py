"""What it takes to launch one Triton kernel behind a custom op, independent of the launcher.

A KernelPlan names the kernel, its runtime parameters in launch order (tensor inputs, scalar
extras, tensor outputs: TensorRT's AOT plugin order), the compile-time constants, the grid and
the scalar values. The same plan drives both launchers:

    TensorRT AOT plugin:  compile_ptx(plan) -> PTX baked into the engine; grid / extras become
                          symbolic expressions of the input shapes (tensorrt_plugins.py)
    direct launch:        launch(plan, inputs, outputs) on torch tensors (tests; Triton's
                          interpreter on CPU, or a GPU)

so what the tests check is what the plugin runs. Imports no Triton itself.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

_POINTER = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "int64": "*i64", "int32": "*i32"}


@dataclass(frozen=True)
class KernelPlan:
    kernel: str                 # name of the @triton.jit entry point in `module`
    module: str
    signature: dict[str, str]   # runtime parameter -> Triton type, in launch order
    constexprs: dict[str, int | float | bool]
    grid: tuple                 # 3 entries: ints, or TensorRT shape expressions
    extra_args: tuple           # values of the scalar ("i32") parameters, in order
    num_warps: int
    num_stages: int             # Triton software pipelining depth (1 keeps shared memory small)
    num_inputs: int             # leading pointer parameters that are op inputs; the rest after the extras are outputs

    @property
    def num_outputs(self) -> int:
        return len(self.signature) - self.num_inputs - len(self.extra_args)

    def entry_point(self):
        return getattr(importlib.import_module(self.module), self.kernel)


def pointer_type(dtype: str) -> str:
    try:
        return _POINTER[dtype]
    except KeyError:
        raise ValueError(f"no Triton pointer type for tensors of dtype {dtype!r}") from None


def next_power_of_2(n: int) -> int:
    """Triton block extents are powers of two (at least 16, the smallest tl.dot tile)."""
    return max(16, 1 << (int(n) - 1).bit_length())


def launch(plan: KernelPlan, inputs: list, outputs: list) -> None:
    """Run the plan's kernel on tensors (torch, on the device Triton targets; on CPU under
    TRITON_INTERPRET=1). Grid and extras must be plain ints here."""
    if len(inputs) != plan.num_inputs or len(outputs) != plan.num_outputs:
        raise ValueError(f"{plan.kernel} takes {plan.num_inputs} inputs and {plan.num_outputs} outputs, "
                         f"got {len(inputs)} and {len(outputs)}")
    plan.entry_point()[plan.grid](*inputs, *plan.extra_args, *outputs, **plan.constexprs,
                                       num_warps=plan.num_warps, num_stages=plan.num_stages)
