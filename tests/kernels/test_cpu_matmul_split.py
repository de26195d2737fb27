"""The Split after a fused projection (linears: Gated DeltaNet's in_proj, attention's qkv_proj) in
tandem's matmul nodes (export/cpu_matmul_lowering.py, input `split` of plugins/cpu/matmul_f32.cc
and matmul_nbits.cc): the same outputs as MatMul -> Split, the Split gone, the exact copy of the
int4 node restoring it; nodes with a residual keep their Split; bad widths fail the call."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tandem.engines.backends import onnxruntime_backend
from tandem.engines.backends.onnxruntime_optimized import exact_copy
from tandem.export.builder import MS_DOMAIN
from tandem.export.cpu_kernel_lowering import CPU_DOMAIN, lower_matmul_nbits_to_kernel
from tandem.export.cpu_matmul_lowering import lower_matmul_to_kernel, weight_panels
from tandem.plugins import cpu_kernels

from .test_cpu_matmul_f32 import _Tensors
from .test_cpu_matmul_nbits import _packed

WIDTHS = [40, 24, 8, 8]            # as in_proj's qkv | z | b | a: not all multiples of 16


def _graph(product: onnx.NodeProto, inits: list, K: int, domain: str = "", widths=WIDTHS) -> onnx.ModelProto:
    outs = [f"y{i}" for i in range(len(widths))]
    nodes = [product, helper.make_node("Split", ["p", "widths"], outs, axis=-1)]
    inits = [*inits, numpy_helper.from_array(np.array(widths, np.int64), "widths")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["B", "W", K])],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], inits)
    opsets = [helper.make_opsetid("", 23)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(g, opset_imports=opsets)
    model.ir_version = 10
    return model


def _kinds(model: onnx.ModelProto, untiling: bool = True) -> list[tuple[str, str]]:
    """(op, domain) of the graph's nodes; untiling=False: but an exact copy's nodes that put the
    weights back in MatMulNBits' layout (export/nbits_tiles.py)."""
    return [(n.op_type, n.domain) for n in model.graph.node if untiling or "/untiled_" not in n.name]


# (K, widths): one pool task; 1.6 MB of weight panels in many tasks, each copying its own columns out
@pytest.mark.parametrize("K, widths", [(48, WIDTHS), (128, [2000, 1040, 8, 40])], ids=["small", "tasks"])
@pytest.mark.parametrize("rows", [1, 5, 9], ids=["decode", "batch-5", "two-blocks"])
def test_float_split_node_equals_matmul_then_split(library, rows, K, widths):
    rng = np.random.default_rng(rows)
    N = sum(widths)
    W = (rng.standard_normal((K, N)) * 0.2).astype(np.float32)
    model = _graph(helper.make_node("MatMul", ["X", "W"], ["p"]), [numpy_helper.from_array(W, "W")], K, widths=widths)
    feeds = {"X": rng.standard_normal((1, rows, K)).astype(np.float32)}
    expected = onnxruntime_backend.session(model).run(None, feeds)
    assert lower_matmul_to_kernel(model, _Tensors())
    assert _kinds(model) == [("MatMul", CPU_DOMAIN)]
    session = onnxruntime_backend.session(model, kernels=library)
    for _ in range(20 if K > 64 else 1):   # back to back: the pool's threads (spinning) share the tasks
        got = session.run(None, feeds)
        for e, o, width in zip(expected, got, widths):
            assert o.shape == (1, rows, width)
            np.testing.assert_allclose(o, e, rtol=1e-5, atol=1e-5)


def test_a_residual_node_keeps_its_split(library):
    """A product with a residual Add after it is not a projection's: the Split reads the Add."""
    rng = np.random.default_rng(4)
    K, N = 16, sum(WIDTHS)
    W = rng.standard_normal((K, N)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["X", "W"], ["m"]), helper.make_node("Add", ["m", "R"], ["p"])]
    model = _graph(nodes[0], [numpy_helper.from_array(W, "W")], K)
    model.graph.node.insert(1, nodes[1])
    model.graph.input.append(helper.make_tensor_value_info("R", TensorProto.FLOAT, ["B", "W", N]))
    assert lower_matmul_to_kernel(model, _Tensors())
    assert _kinds(model) == [("MatMul", CPU_DOMAIN), ("Split", "")]


def test_split_widths_that_do_not_sum_to_n_fail_the_call(library):
    K, N = 16, sum(WIDTHS)
    W = np.ones((K, N), np.float32)
    node = helper.make_node("MatMul", ["X", "B", "", "", "", "widths"], ["y0", "y1"], domain=CPU_DOMAIN, N=N)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, K])],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("y0", "y1")],
                          [numpy_helper.from_array(weight_panels(W), "B"),
                           numpy_helper.from_array(np.array([N, 1], np.int64), "widths")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(CPU_DOMAIN, 1)])
    model.ir_version = 10
    with pytest.raises(Exception, match="split widths must sum to N, one per output"):
        onnxruntime_backend.session(model, kernels=library).run(None, {"X": np.ones((1, K), np.float32)})


# (K, widths): one pool task; 1.6 MB of weights in many tasks, each copying its own columns out,
# the tile of columns 3040-3055 across two outputs
@pytest.mark.parametrize("K, widths", [(64, WIDTHS), (1024, [2000, 1040, 8, 40])], ids=["small", "tasks"])
def test_int4_split_node_and_its_exact_copy(library, tmp_path, K, widths):
    """The int4 node makes the Split's outputs (equal to its own product split); the exact copy
    restores MatMulNBits -> Split, equal to the original at level 0 bit for bit."""
    if not cpu_kernels.nbits_matmul():
        pytest.skip("no AVX-512 VNNI here: the build never makes these nodes")
    rng = np.random.default_rng(31)
    N = sum(widths)
    _, scales, _, B, packed = _packed(rng, K, N, 4, 32, True)
    inits = [numpy_helper.from_array(B, "B"), numpy_helper.from_array(scales.reshape(-1), "scales"),
             numpy_helper.from_array(packed, "zeros")]

    def graph(level):
        node = helper.make_node("MatMulNBits", ["X", "B", "scales", "zeros"], ["p"], domain=MS_DOMAIN, K=K, N=N,
                                bits=4, block_size=32, accuracy_level=level)
        return _graph(node, inits, K, MS_DOMAIN, widths)

    model, whole = graph(4), graph(4)
    for m in (model, whole):
        assert lower_matmul_nbits_to_kernel(m)
    assert lower_matmul_to_kernel(model, None)
    assert _kinds(model) == [("MatMulNBits", CPU_DOMAIN)]
    feeds = {"X": rng.standard_normal((2, 3, K)).astype(np.float32)}
    unsplit = whole.graph.node[0]                   # the same kernel without the split: then numpy's split
    del whole.graph.node[1:], whole.graph.output[:]
    whole.graph.output.append(helper.make_tensor_value_info(unsplit.output[0], TensorProto.FLOAT, None))
    product = onnxruntime_backend.session(whole, kernels=library).run(None, feeds)[0]
    session = onnxruntime_backend.session(model, kernels=library)
    for _ in range(20 if K > 64 else 1):   # back to back: the pool's threads (spinning) share the tasks
        got = session.run(None, feeds)
        for o, e in zip(got, np.split(product, np.cumsum(widths)[:-1], axis=-1)):
            np.testing.assert_array_equal(o, e)
    path = tmp_path / "g.opt.onnx"
    onnx.save(model, str(path))
    copy = onnx.load(str(exact_copy(path)))
    assert _kinds(copy, untiling=False) == [("MatMulNBits", MS_DOMAIN), ("Split", "")]
    level0 = onnxruntime_backend.session(graph(0)).run(None, feeds)
    for a, b in zip(onnxruntime_backend.session(copy).run(None, feeds), level0):
        np.testing.assert_array_equal(a, b)


def test_reshapes_of_split_outputs_to_heads_go_into_the_node(library):
    """Split outputs each read by a Reshape to [0, 0, h, d] only (qkv_proj's q, k and v) come out of
    the node as [..., h, d] (input split_heads); a Reshape to another shape stays. (The int4 exact
    copy's Reshapes: every quantized engine build verifies through them, tests/engines/test_quantized_engines.py.)"""
    rng = np.random.default_rng(6)
    K, N = 32, sum(WIDTHS)
    W = (rng.standard_normal((K, N)) * 0.2).astype(np.float32)
    model = _graph(helper.make_node("MatMul", ["X", "W"], ["p"]), [numpy_helper.from_array(W, "W")], K)
    shapes = {"y0": [0, 0, 5, 8], "y1": [0, 0, 3, 8], "y2": [0, -1]}        # y2: not to heads: stays
    for out, shape in shapes.items():
        model.graph.node.append(helper.make_node("Reshape", [out, f"{out}_shape"], [f"{out}_h"]))
        model.graph.initializer.append(numpy_helper.from_array(np.array(shape, np.int64), f"{out}_shape"))
        model.graph.output.append(helper.make_tensor_value_info(f"{out}_h", TensorProto.FLOAT, None))
    for name in shapes:
        model.graph.output.remove(next(o for o in model.graph.output if o.name == name))
    feeds = {"X": rng.standard_normal((2, 3, K)).astype(np.float32)}
    names = [o.name for o in model.graph.output]
    expected = dict(zip(names, onnxruntime_backend.session(model).run(None, feeds)))
    assert lower_matmul_to_kernel(model, _Tensors())
    assert _kinds(model) == [("MatMul", CPU_DOMAIN), ("Reshape", "")]
    got = dict(zip(names, onnxruntime_backend.session(model, kernels=library).run(None, feeds)))
    for name in names:
        assert got[name].shape == expected[name].shape, name
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-5)
