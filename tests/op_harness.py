"""Run one `ai.tandem` op (function body or a lowering of it) in ONNX Runtime on numpy inputs."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from tandem.engines.backends.onnxruntime_backend import session
from tandem.export.builder import IR_VERSION, OPSET, TANDEM_DOMAIN

_DT = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
       np.dtype(np.int64): TensorProto.INT64}


def single_op_model(function, op_type: str, inputs: list[np.ndarray], out_ranks: list[int],
                    out_dtype=np.float32, **attrs):
    names = [f"in{j}" for j in range(len(inputs))]
    outs = [f"out{j}" for j in range(len(out_ranks))]
    node = helper.make_node(op_type, names, outs, domain=TANDEM_DOMAIN, name=op_type, **attrs)
    ins = [helper.make_tensor_value_info(n, _DT[a.dtype], [None] * a.ndim) for n, a in zip(names, inputs)]
    out_type = _DT[np.dtype(out_dtype)]
    outs_info = [helper.make_tensor_value_info(o, out_type, [None] * r) for o, r in zip(outs, out_ranks)]
    graph = helper.make_graph([node], "single_op", ins, outs_info)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(TANDEM_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, functions=[function])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def run(model, inputs: list[np.ndarray]) -> list[np.ndarray]:
    return session(model).run(None, {f"in{j}": a for j, a in enumerate(inputs)})
