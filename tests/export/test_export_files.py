"""The exported folder: full ONNX checks, byte-identical re-export, shared external weights, and
graphs loaded from disk compute what the in-memory ones do."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from tandem import contract as c
from tandem.checkpoint import open_checkpoint
from tandem.cli import main
from tandem.export.exporter import export_checkpoint
from tandem.testing.tiny_checkpoints import TINY_KINDS

from ..paged_driver import PagedState, session


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_every_graph_passes_the_full_onnx_check(tiny_root, tmp_path, kind):
    result = export_checkpoint(open_checkpoint(tiny_root / kind), tmp_path / "x")
    n_heads = open_checkpoint(tiny_root / kind).description.mtp.num_layers
    assert set(result.graphs) == {"target_step", "verify_greedy", "verify_sample"} | {
        f"mtp_head_{j}" for j in range(n_heads)}
    for file in result.graphs.values():
        onnx.checker.check_model(str(tmp_path / "x" / file), full_check=True)


def test_export_is_deterministic(tiny_root, tmp_path):
    ckpt = open_checkpoint(tiny_root / "qwen3_next")
    export_checkpoint(ckpt, tmp_path / "a")
    export_checkpoint(open_checkpoint(tiny_root / "qwen3_next"), tmp_path / "b")
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_weights_are_stored_once_and_shared(tiny_root, tmp_path):
    ckpt = open_checkpoint(tiny_root / "qwen3_5_mtp3")
    result = export_checkpoint(ckpt, tmp_path)
    manifest = json.loads((tmp_path / "export.json").read_text())
    assert manifest["contract_version"] == c.CONTRACT_VERSION and manifest["mtp_layers"] == 3
    # embed/lm_head and the trunk are shared by 3 trunk graphs and 3 heads, yet stored once:
    params = ckpt.parameter_count() + ckpt.parameter_count(mtp=True)
    assert result.weights_bytes < 1.3 * 4 * params
    for file in result.graphs.values():
        model = onnx.load(str(tmp_path / file), load_external_data=False)
        big = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        assert big and all(dict((e.key, e.value) for e in t.external_data)["location"] == "weights.bin" for t in big)


def test_graph_from_disk_matches_in_memory(tiny_root, tmp_path):
    from tandem.export.exporter import build_graphs

    ckpt = open_checkpoint(tiny_root / "qwen3_5_moe")
    export_checkpoint(ckpt, tmp_path)
    disk, memory = session(tmp_path / "target_step.onnx"), session(build_graphs(ckpt)["target_step"])
    ids = np.array([[5, 17, 33, 200]], np.int64)
    outs = [PagedState(ckpt.description, 1).run(s, {c.INPUT_IDS: ids, c.STATE_ROWS: np.array([4])})
            for s in (disk, memory)]
    np.testing.assert_array_equal(outs[0][c.LOGITS], outs[1][c.LOGITS])


def test_export_cli(tiny_root, tmp_path, capsys):
    assert main(["export", str(tiny_root / "qwen3_5_mtp1"), "--out", str(tmp_path / "e")]) == 0
    assert "mtp_head_0.onnx" in capsys.readouterr().out
    assert main(["export", str(tiny_root / "qwen3_5_mtp1"), "--out", str(tmp_path / "f"), "--no-mtp"]) == 0
    assert not (tmp_path / "f" / "mtp_head_0.onnx").exists()
    assert main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "g")]) == 1
    assert main(["export", str(tiny_root / "qwen3_5_mtp1"), "--out", str(tmp_path / "h"), "--dtype", "float16"]) == 0
    weights = onnx.load(str(tmp_path / "h" / "target_step.onnx"), load_external_data=False).graph.initializer
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in weights)
    assert main(["export", str(tiny_root / "qwen3_5_mtp1"), "--out", str(tmp_path / "i"), "--dtype", "int4"]) == 2
    assert "--dtype int4" in capsys.readouterr().err and not (tmp_path / "i").exists()
