"""One test per config-time refusal: each asserts the message names the problem and the fix,
and that no tensor data was read before refusing."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest

from tandem.checkpoint import CheckpointError, open_checkpoint
from tandem.cli import main
from tandem.testing.tiny_checkpoints import write_safetensors, write_weights

from ..checkpoint_fixtures import refusal
from ..conftest import edit_json, read_all

pytestmark = pytest.mark.usefixtures("no_weight_reads")


def split_off_mtp(src, target, draft):
    """Move a checkpoint's mtp.* tensors into a separate draft folder."""
    tensors = read_all(src)
    target.mkdir()
    draft.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, target / f)
    write_weights(target, {n: a for n, a in tensors.items() if not n.startswith("mtp.")})
    write_weights(draft, {n: a for n, a in tensors.items() if n.startswith("mtp.")})


def test_unknown_architecture(tiny_copy):
    path = tiny_copy("qwen3_5_mtp3")
    edit_json(path / "config.json", architectures=["LlamaForCausalLM"])
    msg = refusal(path)
    assert "architecture 'LlamaForCausalLM' is not supported" in msg and "Qwen3_5ForCausalLM" in msg


def test_unknown_model_type_without_architectures(tiny_copy):
    path = tiny_copy("qwen3_5_mtp3")
    edit_json(path / "config.json", architectures=None, model_type="llama")
    assert "model_type 'llama' is not supported" in refusal(path)


def test_model_type_alone_resolves_the_family(tiny_copy):
    path = tiny_copy("qwen3_next")
    edit_json(path / "config.json", architectures=None)
    assert open_checkpoint(path).description.family == "qwen3_next"


def test_speculative_without_mtp_tensors_or_draft(tiny_root, tmp_path):
    split_off_mtp(tiny_root / "qwen3_5_mtp1", tmp_path / "t", tmp_path / "d")
    msg = refusal(tmp_path / "t")
    assert "no mtp.* tensors" in msg and "mtp_num_hidden_layers=1" in msg
    assert "--draft" in msg and "--no-mtp" in msg
    # plain decoding accepts it; a separate draft folder restores speculative decoding
    assert open_checkpoint(tmp_path / "t", speculative=False).description.mtp is None
    ckpt = open_checkpoint(tmp_path / "t", draft=tmp_path / "d")
    assert ckpt.description.mtp.num_layers == 1 and ckpt.description.mtp.source == str(tmp_path / "d")


def test_draft_path_that_does_not_exist(tiny_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = refusal(tiny_root / "qwen3_5_mtp1", draft="./no-such-draft")
    assert "draft './no-such-draft' does not exist" in msg
    msg = refusal(tiny_root / "qwen3_5_mtp1", draft="models/x/no-such-draft")
    assert "does not exist" in msg


def test_draft_given_as_hub_id(tiny_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = refusal(tiny_root / "qwen3_5_mtp1", draft="Qwen/Qwen3.5-27B")
    assert "looks like a Hugging Face repo id" in msg and "never downloads" in msg
    assert "huggingface-cli download Qwen/Qwen3.5-27B --local-dir DIR" in msg


def test_model_given_as_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "download it" not in (msg := refusal("Qwen/Qwen3-Next-80B-A3B-Instruct")) and "never downloads" in msg


def test_draft_source_without_mtp_tensors(tiny_root, tmp_path):
    split_off_mtp(tiny_root / "qwen3_5_mtp1", tmp_path / "t", tmp_path / "d")
    msg = refusal(tmp_path / "t", draft=tmp_path / "t")  # the trunk-only folder as its own draft
    assert f"draft {tmp_path / 't'}: no mtp.* tensors" in msg


def test_draft_from_another_model(tiny_root, tmp_path):
    split_off_mtp(tiny_root / "qwen3_5_mtp1", tmp_path / "t", tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(json.dumps({"hidden_size": 128, "vocab_size": 384}))
    assert "hidden_size=128 but the target has 64" in refusal(tmp_path / "t", draft=tmp_path / "d")


def test_mtp_layer_count_disagrees_with_tensors(tiny_copy):
    path = tiny_copy("qwen3_5_mtp3")
    edit_json(path / "config.json", mtp_num_hidden_layers=2)
    msg = refusal(path)
    assert "mtp_num_hidden_layers=2 but the weights hold MTP layers [0, 1, 2]" in msg


@pytest.mark.parametrize("k", [0, 9, -1])
def test_spec_k_out_of_range(tiny_root, k):
    msg = refusal(tiny_root / "qwen3_5_mtp1", spec_k=k)
    assert f"spec-k {k} is out of range" in msg and "1..8" in msg


def test_spec_k_in_range_is_accepted(tiny_root):
    for k in (1, 8):
        open_checkpoint(tiny_root / "qwen3_5_mtp1", spec_k=k)


def test_tensor_shape_disagrees_with_config(tiny_copy):
    path = tiny_copy("qwen3_5_mtp3")
    edit_json(path / "config.json", intermediate_size=96)
    msg = refusal(path)
    assert "tensor model.layers.0.mlp.gate_proj.weight has shape [128, 64] but config.json implies [96, 64]" in msg
    assert "mtp.layers.0.mlp.up_proj.weight" in msg  # the MTP head is checked too


def test_missing_and_unexpected_tensors(tiny_copy):
    path = tiny_copy("qwen3_5_mtp3")
    edit_json(path / "config.json", num_hidden_layers=5, layer_types=["linear_attention", "full_attention"] * 2 +
              ["linear_attention"])
    msg = refusal(path)
    assert "missing: model.layers.4." in msg
    path = tiny_copy("qwen3_5_moe")
    edit_json(path / "config.json", num_hidden_layers=3, layer_types=["linear_attention", "full_attention"] +
              ["linear_attention"])
    assert "not part of the layout config.json describes: model.layers.3." in refusal(path)


def test_quantized_checkpoint_names_the_tensors(tiny_copy):
    path = tiny_copy("qwen3_5_mtp3")
    tensors = read_all(path)
    w = tensors["model.layers.0.mlp.gate_proj.weight"]
    tensors["model.layers.0.mlp.gate_proj.weight"] = w.astype(ml_dtypes.float8_e4m3fn)
    tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"] = np.ones((1, 1), np.float32)
    (path / "model.safetensors").unlink()
    write_safetensors(path / "model.safetensors", tensors)
    edit_json(path / "config.json", quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    msg = refusal(path)
    assert "quantized checkpoints are not supported yet" in msg and "quant_method='fp8'" in msg
    assert "model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.gate_proj.weight_scale_inv" in msg


def test_missing_config(tiny_copy):
    path = tiny_copy("qwen3_5_mtp1")
    (path / "config.json").unlink()
    assert "config.json is missing" in refusal(path)


def test_corrupt_config(tiny_copy):
    path = tiny_copy("qwen3_5_mtp1")
    (path / "config.json").write_text("{not json")
    assert "config.json is not valid JSON" in refusal(path)


def test_missing_weights(tiny_copy):
    path = tiny_copy("qwen3_5_mtp1")
    (path / "model.safetensors").unlink()
    assert "no model.safetensors or model.safetensors.index.json" in refusal(path)


def test_truncated_weight_file(tiny_copy):
    path = tiny_copy("qwen3_5_mtp1")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "(truncated download?)" in refusal(path)


def test_missing_shard(tiny_copy):
    path = tiny_copy("qwen3_next")
    (path / "model-00002-of-00002.safetensors").unlink()
    assert "names shard(s) that are not in" in (msg := refusal(path)) and "model-00002-of-00002" in msg


def test_missing_tokenizer(tiny_copy):
    path = tiny_copy("qwen3_5_mtp1")
    (path / "tokenizer.json").unlink()
    assert "tokenizer.json is missing" in refusal(path)


def test_unsupported_rope_type(tiny_copy):
    path = tiny_copy("qwen3_5_mtp3")
    edit_json(path / "config.json", rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})
    assert "rope_type 'yarn' is not supported yet" in refusal(path)


def test_all_problems_are_reported_together(tiny_copy):
    path = tiny_copy("qwen3_5_mtp3")
    edit_json(path / "config.json", intermediate_size=96, mtp_num_hidden_layers=1)
    (path / "tokenizer.json").unlink()
    err = pytest.raises(CheckpointError, open_checkpoint, path, spec_k=12).value
    assert len(err.problems) >= 4


def test_tokenizer_json_without_a_model(tiny_copy, capsys):
    path = tiny_copy("qwen3_5_mtp1")
    tok = json.loads((path / "tokenizer.json").read_text())
    del tok["model"]
    (path / "tokenizer.json").write_text(json.dumps(tok))
    msg = refusal(path)
    assert f"{path / 'tokenizer.json'} does not load as a tokenizer" in msg and "Model missing" in msg
    assert main(["inspect", str(path)]) == 1 and "does not load as a tokenizer" in capsys.readouterr().err


def test_broken_tokenizer_config(tiny_copy):
    path = tiny_copy("qwen3_5_mtp1")
    (path / "tokenizer_config.json").write_text('{"chat_template": "x",')
    assert f"{path / 'tokenizer_config.json'} is not a valid JSON object" in refusal(path)
    (path / "tokenizer_config.json").write_text("[]")
    assert "it holds no JSON object" in refusal(path)


@pytest.mark.parametrize("template", ["{% for m in messages %}{{ m.content }}", "{{ messages | no_such_filter }}"])
def test_chat_template_that_does_not_compile(tiny_copy, template):
    path = tiny_copy("qwen3_5_mtp1")
    edit_json(path / "tokenizer_config.json", chat_template=template)
    msg = refusal(path)
    assert f"{path / 'tokenizer_config.json'}" in msg and "the chat template does not compile" in msg


def test_named_chat_templates_and_the_jinja_file_are_compiled(tiny_copy):
    path = tiny_copy("qwen3_5_mtp1")
    edit_json(path / "tokenizer_config.json", chat_template=[{"name": "default", "template": "{{ 1 }}"},
                                                             {"name": "tool_use", "template": "{% if %}"}])
    assert "(tool_use): the chat template does not compile" in refusal(path)
    edit_json(path / "tokenizer_config.json", chat_template="{{ 1 }}")
    (path / "chat_template.jinja").write_text("{% endfor %}")
    assert f"{path / 'chat_template.jinja'}: the chat template does not compile" in refusal(path)
