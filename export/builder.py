"""A small ONNX graph builder: hierarchical node names, deduplicated constants, weights kept
aside for external data, and the same builder for model-local function bodies.

    b = GraphBuilder()
    with b.scope("model/layers.3/attn"):
        y = b.op("MatMul", x, b.weight("layers.3.self_attn.q_proj.weight_t", w_t), name="q_proj/MatMul")
    # node "/model/layers.3/attn/q_proj/MatMul", output "/model/layers.3/attn/q_proj/MatMul/output_0"

Building the same graph twice gives the same names in the same order, so exports are
byte-for-byte deterministic.
"""

from __future__ import annotations

import contextlib

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tandem.contract import TANDEM_DOMAIN  # noqa: F401 (the exporter's users import it from here)

OPSET = 23  # RMSNormalization is a standard op from opset 23
IR_VERSION = 10
MS_DOMAIN = "com.microsoft"
ONNX_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int64": TensorProto.INT64,
               "bool": TensorProto.BOOL, "int32": TensorProto.INT32}


class GraphBuilder:
    """Collects nodes of one graph (or one function body when `function=True`: constants
    then become Constant nodes, since functions have no initializers)."""

    def __init__(self, function: bool = False, root: str | None = None):
        self.function = function
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, np.ndarray] = {}  # name -> array (weights and constants)
        self.stored: dict[str, tuple] = {}      # name -> (shape, dtype): weights already in weights.bin
        self._const_names: dict[tuple, str] = {}
        self._scopes: list[str] = [root] if root else []  # a distinct root keeps subgraph names apart
        self._used: dict[str, int] = {}

    # ---- naming ------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self, name: str):
        self._scopes.append(name.strip("/"))
        try:
            yield
        finally:
            self._scopes.pop()

    def _unique(self, base: str) -> str:
        n = self._used.get(base, 0)
        self._used[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def _node_name(self, name: str | None, op_type: str) -> str:
        prefix = "/" + "/".join(self._scopes) if self._scopes else ""
        return self._unique(f"{prefix}/{name or op_type}")

    # ---- nodes -------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: str, name: str | None = None, outputs: int | list[str] = 1,
           domain: str = "", **attrs):
        """Add a node; returns its output name (or a list when outputs > 1 / given as names)."""
        node_name = self._node_name(name, op_type)
        out_names = outputs if isinstance(outputs, list) else [f"{node_name}/output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), out_names, name=node_name, domain=domain or None,
                                           **attrs))
        return out_names[0] if len(out_names) == 1 and not isinstance(outputs, list) else out_names

    def const(self, value, dtype=None) -> str:
        """A constant tensor (deduplicated by content)."""
        arr = np.asarray(value, dtype=dtype)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key in self._const_names:
            return self._const_names[key]
        if self.function:
            name = self.op("Constant", name="Constant", value=numpy_helper.from_array(arr))
        else:
            name = f"/const/{len(self._const_names)}"
            self.initializers[name] = arr
        self._const_names[key] = name
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        """A model weight, stored under its own name (deduplicated by name)."""
        if name not in self.initializers:
            self.initializers[name] = np.ascontiguousarray(array)
        return name

    def stored_weight(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> str:
        """A model weight an earlier graph of this export already wrote to weights.bin: the graph gets
        an external reference to it, not a copy (exporter.export_checkpoint)."""
        self.stored[name] = (tuple(shape), np.dtype(dtype))
        return name

    def attr_const(self, attr: str, kind: str) -> str:
        """Function bodies only: a Constant whose value is the calling node's attribute `attr`."""
        attr_type = {"int": onnx.AttributeProto.INT, "float": onnx.AttributeProto.FLOAT}[kind]
        node_name = self._node_name(f"{attr}_const", "Constant")
        out = f"{node_name}/output_0"
        node = helper.make_node("Constant", [], [out], name=node_name)
        node.attribute.append(helper.make_attribute_ref(f"value_{kind}", attr_type, ref_attr_name=attr))
        self.nodes.append(node)
        return out

    # ---- shorthands --------------------------------------------------------------------
    def shape_of(self, x: str, start: int | None = None, end: int | None = None) -> str:
        attrs = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
        return self.op("Shape", x, **attrs)

    def reshape(self, x: str, shape) -> str:
        return self.op("Reshape", x, shape if isinstance(shape, str) else self.const(shape, np.int64))

    def unsqueeze(self, x: str, axes) -> str:
        return self.op("Unsqueeze", x, self.const(list(axes), np.int64))

    def squeeze(self, x: str, axes) -> str:
        return self.op("Squeeze", x, self.const(list(axes), np.int64))

    def slice(self, x: str, starts, ends, axes) -> str:
        c = lambda v: v if isinstance(v, str) else self.const(list(v), np.int64)  # noqa: E731
        return self.op("Slice", x, c(starts), c(ends), c(axes))

    def concat(self, xs: list[str], axis: int) -> str:
        return self.op("Concat", *xs, axis=axis)


def value_info(name: str, dtype: str, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, ONNX_DTYPES[dtype], list(shape))
