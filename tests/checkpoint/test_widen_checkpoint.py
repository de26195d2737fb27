"""tools/widen_checkpoint.py on the shipped model: the widened checkpoint computes what the small one
does (transformers' trunk: the same logits, the final hidden state scaled and padded with zeros; the
MTP reference's heads: the same drafts), at the larger size; a tensor it has no rule for is refused
by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tandem.checkpoint.families.qwen_hybrid.reference import greedy_draft  # noqa: E402
from tools import train_small_model as tsm  # noqa: E402
from tools import widen_checkpoint as wc  # noqa: E402

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tandem-tiny-code"
PROMPTS = [[5, 17, 33, 200, 7, 901, 44], [9, 120, 77, 301, 15, 2, 88, 91, 14, 250, 3, 1200]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    wide = tmp_path_factory.mktemp("widened")
    wc.widen(SHIPPED, wide, hidden=320, intermediate=1024)
    return tsm.load(SHIPPED), tsm.load(wide), wide


def test_the_widened_model_computes_the_small_one(pair):
    (model, mtp), (wide_model, wide_mtp), folder = pair
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["dtype"]) == (320, 1024, "float32")
    assert wide_model.lm_head.weight.shape == (4096, 320)
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            small, big = model.model(input_ids=ids).last_hidden_state, wide_model.model(input_ids=ids).last_hidden_state
            # (the final norm's output is the stream's size: sqrt(320 / 256) times the small model's)
            np.testing.assert_allclose(big[..., :256].numpy() / np.sqrt(320 / 256), small.numpy(), atol=1e-4)
            assert not big[..., 256:].any()                     # the added channels stay zero
            np.testing.assert_allclose(wide_model(input_ids=ids).logits.numpy(), model(input_ids=ids).logits.numpy(),
                                       atol=2e-3)
            assert greedy_draft(wide_model.model, wide_model.lm_head, wide_mtp, prompt, k=3) == \
                greedy_draft(model.model, model.lm_head, mtp, prompt, k=3)


def test_a_tensor_without_a_rule_or_another_layout_is_refused(tmp_path):
    with pytest.raises(ValueError, match="model.extra.weight .*no rule"):
        wc.widen_tensor("model.extra.weight", np.zeros((3, 5, 7), np.float32), 256, 320, 768, 1024)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v32", "hidden_size": 64}))
    with pytest.raises(SystemExit, match="deepseek_v32.*qwen3_5_text"):
        wc.widen(tmp_path, tmp_path / "out", hidden=128, intermediate=256)
    assert not (tmp_path / "out").exists()


def test_a_folder_that_holds_files_is_not_written_over(pair):
    folder = pair[2]
    before = {f.name: f.stat().st_mtime_ns for f in folder.iterdir()}
    with pytest.raises(SystemExit, match="not empty"):
        wc.widen(SHIPPED, folder, hidden=320, intermediate=1024)
    assert {f.name: f.stat().st_mtime_ns for f in folder.iterdir()} == before
