"""bench/where_time_goes.py's reading of an ONNX Runtime profile into the graph, op and layer
tables, on a small synthetic profile (the bench itself is run by hand: docs/performance.md)."""

from __future__ import annotations

import json

import pytest

from tandem.bench.where_time_goes import read_events, tables


def _node(name: str, op: str, ts: int, dur: int) -> dict:
    return {"cat": "Node", "ph": "X", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}


def _run(ts: int, dur: int) -> dict:
    return {"cat": "Session", "ph": "X", "name": "model_run", "ts": ts, "dur": dur, "args": {}}


@pytest.fixture
def profile(tmp_path):
    """Two runs of one graph: the first (warm-up, before the window) must not count."""
    events = [{"cat": "Session", "ph": "X", "name": "session_initialization", "ts": 0, "dur": 50, "args": {}}]
    for start in (100, 1000):
        events += [
            _node("/model/embed_tokens/Gather", "Gather", start + 1, 2),
            _node("/model/layers.0/attn/q_proj/MatMul", "MatMul", start + 3, 10),
            _node("_inlfunc_PagedSparseAttention_/Softmax", "Softmax", start + 13, 20),  # layer 0's body
            _node("//model/layers.1/linear_attn/GatedDeltaNet/lowered/LinearAtt", "LinearAttention", start + 33, 30),
            _node("/model/layers.1/mlp/down_proj/MatMul", "MatMul", start + 63, 30),
            _node("/lm_head/MatMul", "MatMul", start + 93, 8),
            _run(start, 110),
        ]
    path = tmp_path / "target_step_2026.json"
    path.write_text(json.dumps(events))
    return path


def test_tables_group_by_graph_op_and_layer(profile):
    start_ns = 5_000_000_000
    window = (start_ns + 900_000, start_ns + 2_000_000)  # µs 900..2000: the second run only
    t = tables({"target_step.onnx": read_events(profile, start_ns, window)})
    assert t["graphs"] == {"target_step": {"calls": 1, "total_ms": 0.11, "ms_per_call": 0.11}}
    assert t["node_ms"] == pytest.approx(0.1)
    ops = {k: v["ms"] for k, v in t["ops"].items()}
    assert ops == pytest.approx({"MatMul": 0.048, "GatedDeltaNet (body)": 0.03, "PagedSparseAttention (body)": 0.02,
                                 "Gather": 0.002})
    assert list(t["ops"]) == ["MatMul", "GatedDeltaNet (body)", "PagedSparseAttention (body)", "Gather"]
    layers = {k: v["share"] for k, v in t["layers"].items()}
    assert layers == pytest.approx({"layers.01": 0.6, "layers.00": 0.3, "lm_head": 0.08, "embed_tokens": 0.02})


def test_unreadable_profile_names_the_file(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("[{")
    with pytest.raises(SystemExit, match="broken.json"):
        read_events(bad, 0, (0, 1))
