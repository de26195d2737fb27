"""ONNX Runtime lowering: GatedDeltaNet -> com.microsoft LinearAttention gives what the function
body gives, on the op alone and on whole exported graphs."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from tandem import contract as c
from tandem.checkpoint import open_checkpoint
from tandem.checkpoint.description import AttentionSpec
from tandem.export.exporter import build_graphs
from tandem.export.lowering import lower_for_onnxruntime
from tandem.export.ops import gated_deltanet
from tandem.testing import op_references as ref
from tandem.testing.tiny_checkpoints import write_tiny_checkpoint

from ..op_harness import run, single_op_model
from ..paged_driver import PagedState, session
from .test_ops import gdn_inputs


@pytest.mark.parametrize("emit_rows", [False, True])
def test_lowered_gated_deltanet_matches_numpy(emit_rows):
    rng = np.random.default_rng(2)
    q, k, v, g, beta, s0 = gdn_inputs(rng)
    rows = np.array([5, 5, 5] if emit_rows else [5, 2, 1], np.int64)
    inputs = [q, k, v, g, beta, s0, rows]
    model = single_op_model(gated_deltanet.make_function(emit_rows), "GatedDeltaNet", inputs,
                            [4, 4, 5] if emit_rows else [4, 4], scale=0.35, num_key_heads=2, num_value_heads=4)
    lowered = lower_for_onnxruntime(model, rows=5 if emit_rows else None)
    assert [n.op_type for n in lowered.graph.node].count("LinearAttention") == (5 if emit_rows else 1)
    assert not lowered.functions
    outs = run(lowered, inputs)
    r_out, r_final, r_rows = ref.gated_deltanet(q, k, v, g, beta, s0, rows, scale=0.35)
    for b, n in enumerate(rows):
        np.testing.assert_allclose(outs[0][b, :n], r_out[b, :n], atol=1e-5)
    np.testing.assert_allclose(outs[1], r_final, atol=1e-5)
    if emit_rows:
        np.testing.assert_allclose(outs[2], r_rows, atol=1e-5)


def _picked_row_state_model(inputs):
    """GatedDeltaNet emitting row states, read only by GatherND at one row per sequence: the verify
    body's pick of the state after the accepted row (export/graphs.verify_body)."""
    model = single_op_model(gated_deltanet.make_function(True), "GatedDeltaNet", inputs, [4, 4, 5], scale=0.35,
                            num_key_heads=2, num_value_heads=4)
    g = model.graph
    g.input.append(helper.make_tensor_value_info("row", TensorProto.INT64, [None, 1]))
    g.node.append(helper.make_node("GatherND", ["out2", "row"], ["picked"], batch_dims=1, name="pick"))
    del g.output[2]
    g.output.append(helper.make_tensor_value_info("picked", TensorProto.FLOAT, [None] * 4))
    return model


def test_picked_row_state_is_a_second_linear_attention_equal_to_the_state_after_that_row():
    """No per-row unrolling: the pick becomes LinearAttention over the same rows with decay and beta
    zeroed past row a, and its state equals, bit for bit, the final state of the plain lowering run
    with state_rows = a + 1 (what the target step commits after a + 1 rows)."""
    rng = np.random.default_rng(4)
    q, k, v, g, beta, s0 = gdn_inputs(rng)
    picks = np.array([[0], [3], [4]], np.int64)
    inputs = [q, k, v, g, beta, s0, np.full(3, 5, np.int64)]
    lowered = lower_for_onnxruntime(_picked_row_state_model(inputs))
    ops = [n.op_type for n in lowered.graph.node]
    assert ops.count("LinearAttention") == 2 and "GatherND" not in ops and "Slice" not in ops
    feeds = {f"in{j}": a for j, a in enumerate(inputs)} | {"row": picks}
    picked = session(lowered).run(["picked"], feeds)[0]
    r_rows = ref.gated_deltanet(q, k, v, g, beta, s0, inputs[6], scale=0.35)[2]
    np.testing.assert_allclose(picked, r_rows[np.arange(3), picks[:, 0]], atol=1e-5)
    plain = lower_for_onnxruntime(single_op_model(gated_deltanet.make_function(False), "GatedDeltaNet", inputs,
                                                  [4, 4], scale=0.35, num_key_heads=2, num_value_heads=4))
    after = run(plain, [q, k, v, g, beta, s0, picks[:, 0] + 1])[1]
    assert np.array_equal(picked, after)


def test_row_state_nodes_keep_their_body_without_a_static_width():
    rng = np.random.default_rng(2)
    inputs = [*gdn_inputs(rng), np.full(3, 5, np.int64)]
    model = single_op_model(gated_deltanet.make_function(True), "GatedDeltaNet", inputs, [4, 4, 5], scale=0.35,
                            num_key_heads=2, num_value_heads=4)
    assert lower_for_onnxruntime(model).graph.node[0].op_type == "GatedDeltaNet"


@pytest.mark.parametrize("kind", ["qwen3_5_mtp1", "qwen3_next", "step3p5"])
def test_lowered_graphs_match_function_bodies(tiny_root, tmp_path, kind):
    """GatedDeltaNet -> LinearAttention and, where no row selects, PagedSparseAttention -> the
    dense form with one shared mask per window (Step-3.5: full and sliding-window layers)."""
    folder = tiny_root / kind if (tiny_root / kind).exists() else write_tiny_checkpoint(tmp_path / kind, kind)
    ckpt = open_checkpoint(folder)
    graphs = build_graphs(ckpt)
    desc = ckpt.description
    ids = np.array([[5, 17, 33, 200], [9, 120, 77, 3]], np.int64)
    rows = np.array([4, 3], np.int64)
    for name, extra in (("target_step", {c.STATE_ROWS: rows}), ("verify_greedy", {})):
        plain = session(graphs[name])
        lowered = lower_for_onnxruntime(graphs[name], rows=4)
        assert not any(n.op_type == "PagedSparseAttention" for n in lowered.graph.node)
        windows = {layer.mixer.window for layer in desc.layers if isinstance(layer.mixer, AttentionSpec)}
        ranges = sum(n.op_type == "Range" and n.name.startswith("/dense_attention/") for n in lowered.graph.node)
        assert ranges == 3 * len(windows)        # one shared mask (three Ranges) per window, not per layer
        low = session(lowered)
        a = PagedState(desc, 2).run(plain, {c.INPUT_IDS: ids, **extra})
        b = PagedState(desc, 2).run(low, {c.INPUT_IDS: ids, **extra})
        for key in a:
            np.testing.assert_allclose(a[key], b[key], atol=2e-5, err_msg=f"{name}:{key}")


def test_output_identities_go_and_their_producers_make_the_outputs():
    """Identity(x) -> output: x's producer makes the output and x's readers read it; an Identity of a
    graph input stays (nothing else could make its output)."""
    from onnx import numpy_helper

    from tandem.engines.backends import onnxruntime_backend
    from tandem.export.cpu_attention_lowering import elide_output_identities
    info = helper.make_tensor_value_info
    nodes = [helper.make_node("Mul", ["a", "two"], ["x"]), helper.make_node("Add", ["x", "a"], ["z"]),
             helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Identity", ["a"], ["a_out"]),
             helper.make_node("Identity", ["z"], ["z_out"])]
    graph = helper.make_graph(nodes, "g", [info("a", TensorProto.FLOAT, [3])],
                              [info(n, TensorProto.FLOAT, [3]) for n in ("y", "a_out", "z_out")],
                              [numpy_helper.from_array(np.full(3, 2, np.float32), "two")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    feeds = {"a": np.arange(3, dtype=np.float32)}
    want = onnxruntime_backend.session(model).run(None, feeds)
    assert elide_output_identities(model.graph) == 2
    assert [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node] == [
        ("Mul", ["a", "two"], ["y"]), ("Add", ["y", "a"], ["z_out"]), ("Identity", ["a"], ["a_out"])]
    for got, expected in zip(onnxruntime_backend.session(model).run(None, feeds), want):
        np.testing.assert_array_equal(got, expected)
