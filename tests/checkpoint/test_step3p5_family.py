"""The Step-3.5 family module: config -> per-layer description, the Hub's stored names -> canonical
names (every stored tensor used exactly once), the config-time refusals `tandem inspect` gives, and
the inspect report. Headers only, no torch."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest

from tandem.checkpoint import open_checkpoint
from tandem.checkpoint.description import MLPKind, description_from_dict, description_to_dict
from tandem.checkpoint.families import FAMILIES, MODEL_TYPES, step3p5
from tandem.checkpoint.safetensors_files import TensorIndex
from tandem.cli import main
from tandem.testing.tiny_checkpoints import tiny_config, write_safetensors, write_tiny_checkpoint

from ..checkpoint_fixtures import refusal
from ..conftest import edit_json, read_all

ARCH = "Step3p5ForCausalLM"


@pytest.fixture(scope="module")
def step_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("step3p5")
    for kind in ("step3p5", "step3p5_tied_heads"):
        write_tiny_checkpoint(root / kind, kind)
    return root


@pytest.fixture
def step_copy(step_root, tmp_path):
    def copy(kind: str = "step3p5"):
        shutil.copytree(step_root / kind, tmp_path / kind)
        return tmp_path / kind
    return copy


def describe(mtp_layers: int = 3, **changes):
    cfg = {k: v for k, v in {**tiny_config("step3p5"), **changes}.items() if v is not None}
    return step3p5.describe(cfg, ARCH, mtp_layers=mtp_layers, mtp_source="checkpoint")


def test_description_per_layer():
    d = describe()
    assert FAMILIES[ARCH] is step3p5 and MODEL_TYPES["step3p7"] == "Step3p7ForConditionalGeneration"
    assert [layer.mixer.window for layer in d.layers] == [None, 8, 8, None, 8, 8]
    assert [layer.mixer.num_heads for layer in d.layers] == [4, 8, 8, 4, 8, 8]
    assert {layer.mixer.num_kv_heads for layer in d.all_layers} == {2}
    full, sliding = d.layers[0].mixer, d.layers[1].mixer
    assert (full.rotary_dim, full.rope_theta, sliding.rotary_dim, sliding.rope_theta) == (8, 5e6, 16, 1e4)
    assert all(m.head_gate and not m.output_gate and m.qk_norm and m.scale == 16 ** -0.5
               for m in (layer.mixer for layer in d.all_layers))
    assert [layer.mlp for layer in d.layers] == [MLPKind.DENSE] * 2 + [MLPKind.MOE] * 4
    assert [(layer.swiglu_limit, layer.shared_swiglu_limit) for layer in d.layers] == \
        [(None, None)] * 4 + [(0.6, 0.8), (1.0, 0.5)]
    m = d.moe
    assert (m.router, m.score_correction_bias, m.routed_scaling_factor, m.shared_expert_gate, m.norm_topk_prob) == \
        ("sigmoid", True, 1.5, False, True)
    assert (m.num_experts, m.top_k, m.expert_intermediate_size, m.shared_expert_intermediate_size) == (4, 2, 32, 32)
    assert (d.mtp.form, d.mtp.anchor, d.mtp.own_lm_head, d.mtp.num_layers) == ("nextn", "previous_head", True, 3)
    assert all(h.mixer.window is None and h.mlp == MLPKind.DENSE for h in d.mtp.layers)  # entries 6..8
    assert describe(query_pre_attn_scalar=64).layers[0].mixer.scale == 64 ** -0.5


def test_dense_layers_clamp_with_the_shared_list_as_transformers_does():
    d = describe(0, swiglu_limits=[5.0] + [0] * 8, swiglu_limits_shared=[3.0] + [0] * 8)  # no heads: entry 0 is theirs
    assert (d.layers[0].swiglu_limit, d.layers[0].shared_swiglu_limit) == (3.0, None)


def test_description_round_trip():
    d = describe()
    assert description_from_dict(json.loads(json.dumps(description_to_dict(d)))) == d


def test_sources_use_every_stored_tensor_exactly_once(step_root):
    ckpt = open_checkpoint(step_root / "step3p5")
    stored = [n for src in ckpt.sources.values() for n in src.names]
    assert len(stored) == len(set(stored))
    assert set(stored) == set(TensorIndex.open(step_root / "step3p5").names())
    assert ckpt.sources["mtp.layers.2.shared_head.head.weight"].names == \
        ("model.layers.8.transformer.shared_head.output.weight",)
    assert ckpt.sources["layers.5.mlp.gate.e_score_correction_bias"].names == ("model.layers.5.moe.router_bias",)
    assert ckpt.sources["mtp.layers.0.self_attn.g_proj.weight"].names == ("model.layers.6.self_attn.g_proj.weight",)


def test_canonical_weights_equal_the_stored_tensors(step_root):
    ckpt, stored = open_checkpoint(step_root / "step3p5"), read_all(step_root / "step3p5")
    gate_up = ckpt.weight("layers.3.mlp.experts.gate_up_proj")
    assert gate_up.shape == (4, 64, 64)
    np.testing.assert_array_equal(gate_up[:, :32], stored["model.layers.3.moe.gate_proj.weight"])
    np.testing.assert_array_equal(gate_up[:, 32:], stored["model.layers.3.moe.up_proj.weight"])
    np.testing.assert_array_equal(ckpt.weight("layers.3.mlp.shared_expert.down_proj.weight"),
                                  stored["model.layers.3.share_expert.down_proj.weight"])
    np.testing.assert_array_equal(ckpt.weight("mtp.layers.1.shared_head.norm.weight"),
                                  stored["model.layers.7.transformer.shared_head.norm.weight"])


def test_tied_heads_kind_copies_lm_head_into_every_own_head(step_root):
    tied, untied = open_checkpoint(step_root / "step3p5_tied_heads"), open_checkpoint(step_root / "step3p5")
    lm_head = tied.weight("lm_head.weight")
    for j in range(3):
        np.testing.assert_array_equal(tied.weight(f"mtp.layers.{j}.shared_head.head.weight"), lm_head)
        assert not np.array_equal(untied.weight(f"mtp.layers.{j}.shared_head.head.weight"), lm_head)
    np.testing.assert_array_equal(tied.weight("layers.2.mlp.experts.down_proj"),
                                  untied.weight("layers.2.mlp.experts.down_proj"))  # the rest is the same draw


def test_step3p7_text_part(step_copy):
    """Step-3.7's wrapper: text config under text_config, the same model.* names, vision tower ignored."""
    path = step_copy()
    cfg = json.loads((path / "config.json").read_text())
    wrapper = {"architectures": ["Step3p7ForConditionalGeneration"], "model_type": "step3p7",
               "text_config": cfg, "vision_config": {"hidden_size": 8}, "dtype": "float32"}
    (path / "config.json").write_text(json.dumps(wrapper))
    tensors = read_all(path)
    tensors["vision_model.conv1.weight"] = np.zeros((2, 2), np.float32)
    write_safetensors(path / "model.safetensors", tensors)
    d = open_checkpoint(path).description
    assert (d.architecture, d.model_type) == ("Step3p7ForConditionalGeneration", "step3p7")
    assert d.layers == describe().layers and d.mtp.layers == describe().mtp.layers


@pytest.mark.usefixtures("no_weight_reads")
def test_without_mtp_tensors(step_copy):
    path = step_copy()
    owns = step3p5.mtp_layout(tiny_config("step3p5")).owns
    write_safetensors(path / "model.safetensors", {n: a for n, a in read_all(path).items() if not owns(n)})
    msg = refusal(path)
    assert "no NextN (model.layers.6.* and up) tensors" in msg and "num_nextn_predict_layers=3" in msg
    assert open_checkpoint(path, speculative=False).description.mtp is None


@pytest.mark.usefixtures("no_weight_reads")
def test_missing_mtp_layer_names_the_layer_and_its_tensors(step_copy):
    path = step_copy()
    write_safetensors(path / "model.safetensors", {n: a for n, a in read_all(path).items()
                                                   if not n.startswith("model.layers.8.")})
    msg = refusal(path)
    assert "num_nextn_predict_layers=3 but the weights hold MTP layers [0, 1]" in msg
    assert "MTP layer(s) [2] (model.layers.8.*) are missing" in msg
    assert "missing: model.layers.8.eh_proj.weight" in msg


@pytest.mark.usefixtures("no_weight_reads")
def test_wrong_shape_is_refused(step_copy):
    path = step_copy()
    edit_json(path / "config.json", share_expert_dim=48)
    msg = refusal(path)
    assert "tensor model.layers.2.share_expert.up_proj.weight has shape [32, 64] but config.json implies [48, 64]" \
        in msg


@pytest.mark.usefixtures("no_weight_reads")
def test_spec_k_above_the_chained_heads(step_root):
    msg = refusal(step_root / "step3p5", spec_k=4)
    assert "spec-k 4 is more than this model's 3 chained nextn MTP heads" in msg and "--spec-k 3" in msg
    assert open_checkpoint(step_root / "step3p5", spec_k=3).description.mtp.num_layers == 3
    assert open_checkpoint(step_root / "step3p5", speculative=False, spec_k=4).description.mtp is None


@pytest.mark.usefixtures("no_weight_reads")
def test_quantized_checkpoint_is_refused(step_copy):
    path = step_copy()
    tensors = read_all(path)
    name = "model.layers.3.moe.gate_proj.weight"
    tensors[name] = tensors[name].astype(ml_dtypes.float8_e4m3fn)
    tensors[name + "_scale_inv"] = np.ones((4, 1, 1), np.float32)
    write_safetensors(path / "model.safetensors", tensors)
    edit_json(path / "config.json", quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    msg = refusal(path)
    assert "quantized checkpoints are not supported yet" in msg and name + "_scale_inv" in msg


@pytest.mark.usefixtures("no_weight_reads")
@pytest.mark.parametrize("changes, expected", [
    (dict(attention_other_setting={"num_attention_heads": 8, "num_attention_groups": 1, "head_dim": 16}),
     "attention_other_setting.num_attention_groups is 1 but num_attention_groups is 2"),
    (dict(rope_theta=[5e6, 1e4, 2e4] * 2 + [5e6] * 3), "sliding_attention layer 2 (20000.0, 1.0) differ from layer 1"),
    (dict(partial_rotary_factors=[0.5, 1.0, 1.0] * 2 + [0.5, 0.5, 1.0]), "full_attention layer 8"),
    (dict(swiglu_limits_shared=[0, 0, 0, 0, 0.8, 0.5, 0, 2.0, 0]),
     "swiglu_limits_shared[7] (MTP layer 1) is 2.0 but transformers 5.24 clamps MTP layer 1 with"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 2.0}), "rope_type 'llama3' is not supported yet"),
    (dict(norm_expert_weight=False), "'norm_expert_weight' is False"),
    (dict(layer_types=["full_attention"] * 8), "'layer_types' has 8 entries but 9 layers"),
])
def test_config_refusals(step_copy, changes, expected):
    path = step_copy()
    edit_json(path / "config.json", **changes)
    msg = refusal(path)
    assert f"{path / 'config.json'}: " in msg and expected in msg and "Fix config.json" in msg


def test_inspect_describes_the_window_layers(step_root, capsys):
    assert main(["inspect", str(step_root / "step3p5")]) == 0
    out = capsys.readouterr().out
    assert "2 full attention, 4 sliding-window attention  [ASSASS]" in out
    assert "layer 4" in out and "sliding window 8, 8/2 heads x 16, head gate" in out and "swiglu clamp 0.6" in out
    assert "mtp 0-2" in out and "nextn form" in out and "previous head's hidden, own lm heads" in out
    assert main(["inspect", str(step_root / "step3p5"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["window"] for r in report["layer_table"]] == [None, 8, 8, None, 8, 8, None, None, None]
    assert report["mtp"]["anchor"] == "previous_head" and report["moe"]["router"] == "sigmoid"


def test_nextn_layers_from_a_draft_folder(step_root, tmp_path):
    """The NextN layers split off into a --draft folder are found by their model.layers.{N+j} names."""
    owns = step3p5.mtp_layout(tiny_config("step3p5")).owns
    tensors, target, draft = read_all(step_root / "step3p5"), tmp_path / "t", tmp_path / "d"
    shutil.copytree(step_root / "step3p5", target)
    draft.mkdir()
    write_safetensors(target / "model.safetensors", {n: a for n, a in tensors.items() if not owns(n)})
    write_safetensors(draft / "model.safetensors", {n: a for n, a in tensors.items() if owns(n)})
    ckpt = open_checkpoint(target, draft=draft)
    assert ckpt.description.mtp.num_layers == 3 and ckpt.description.mtp.source == str(draft)
    np.testing.assert_array_equal(ckpt.weight("mtp.layers.2.eh_proj.weight"), tensors["model.layers.8.eh_proj.weight"])
    assert "no NextN (model.layers.6.* and up) tensors" in refusal(target, draft=target)
