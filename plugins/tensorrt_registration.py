"""Registers the tandem plugins with TensorRT through its `tensorrt.plugin` API, as AOT plugins:
at engine build time each plugin instance compiles its Triton kernel to PTX, which TensorRT
stores in the plan; running the engine needs neither Python nor Triton, and the launch is
CUDA-graph safe (no allocation, no sync). Everything but the API calls is in tensorrt_plugins.py.

No `from __future__ import annotations` here: tensorrt.plugin reads the parameter annotations
as objects to derive the plugin's inputs and attribute fields. Attributes are 1-D float32 /
int32 arrays, exactly what the ONNX parser passes (PLUGIN_FIELDS; a Python float would declare a
float64 field).
"""

from typing import Tuple  # noqa: UP035 - the form tensorrt.plugin's annotation checks document

import numpy as np
import numpy.typing as npt

from tandem.plugins.tensorrt_plugins import PLUGIN_NAMESPACE, kernel_plan, output_shapes

F32, I32 = npt.NDArray[np.float32], npt.NDArray[np.int32]

_registered = False


def register_plugins(capability: int) -> None:
    """Register the three plugins once per process, compiling for sm_<capability>."""
    global _registered
    if _registered:
        return
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from tandem.plugins.ptx import compile_ptx

    dtypes = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}
    Desc, Out = trtp.TensorDesc, Tuple[trtp.TensorDesc]  # noqa: UP006 - any number of outputs

    def constant(dim, what: str) -> int:
        if not dim.is_constant:
            raise ValueError(f"tandem plugin: {what} must be known when the engine is built (got a dynamic dim)")
        return int(dim.constant_value())

    def shapes(inputs: list) -> list[tuple]:
        return [tuple(d.shape_expr[i] for i in range(d.ndim)) for d in inputs]

    def descs(plugin: str, inputs: list, like_dtype: list) -> tuple:
        return tuple(trtp.from_shape_expr(trtp.ShapeExprs.from_tuple(shape), dtype=dtype)
                     for shape, dtype in zip(output_shapes(plugin, shapes(inputs)), like_dtype))

    def aot(plugin: str, inputs: list, fields: dict, dtype) -> tuple:
        plan = kernel_plan(plugin, shapes(inputs), fields, dtypes[dtype], constant)
        kernel = compile_ptx(plan, capability)
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y, launch.grid_z = plan.grid
        launch.block_x = kernel.num_warps * 32
        launch.shared_mem = kernel.shared_bytes
        extras = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in plan.extra_args])
        return kernel.name, kernel.ptx, launch, extras

    # --- GatedDeltaNet (2 outputs) and GatedDeltaNetRowStates (3 outputs) ---
    def register_gdn(name: str, n_out: int) -> None:
        def gdn_desc(query: Desc, key: Desc, value: Desc, decay: Desc, beta: Desc, initial_state: Desc,
                     state_rows: Desc, scale: F32, num_key_heads: I32, num_value_heads: I32) -> Out:
            inputs = [query, key, value, decay, beta, initial_state, state_rows]
            return descs(name, inputs, [value.dtype, trt.float32, trt.float32][:n_out])

        def gdn_aot(query: Desc, key: Desc, value: Desc, decay: Desc, beta: Desc, initial_state: Desc,
                    state_rows: Desc, scale: F32, num_key_heads: I32, num_value_heads: I32, outputs: Out):
            fields = {"scale": scale, "num_key_heads": num_key_heads, "num_value_heads": num_value_heads}
            return aot(name, [query, key, value, decay, beta, initial_state, state_rows], fields, value.dtype)

        trtp.register(f"{PLUGIN_NAMESPACE}::{name}")(gdn_desc)
        trtp.aot_impl(f"{PLUGIN_NAMESPACE}::{name}")(gdn_aot)

    register_gdn("GatedDeltaNet", 2)
    register_gdn("GatedDeltaNetRowStates", 3)

    # --- PagedSparseAttention ---
    @trtp.register(f"{PLUGIN_NAMESPACE}::PagedSparseAttention")
    def attention_desc(query: Desc, key: Desc, value: Desc, key_cache: Desc, value_cache: Desc, block_tables: Desc,
                       context_lens: Desc, selected: Desc, scale: F32, sliding_window: I32) -> Desc:
        inputs = [query, key, value, key_cache, value_cache, block_tables, context_lens, selected]
        return descs("PagedSparseAttention", inputs, [query.dtype])[0]

    @trtp.aot_impl(f"{PLUGIN_NAMESPACE}::PagedSparseAttention")
    def attention_aot(query: Desc, key: Desc, value: Desc, key_cache: Desc, value_cache: Desc, block_tables: Desc,
                      context_lens: Desc, selected: Desc, scale: F32, sliding_window: I32, outputs: Out):
        inputs = [query, key, value, key_cache, value_cache, block_tables, context_lens, selected]
        return aot("PagedSparseAttention", inputs, {"scale": scale, "sliding_window": sliding_window}, query.dtype)

    _registered = True

