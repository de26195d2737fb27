"""The DeepSeek-V3.2 / GLM-5 family (checkpoint side): MLA + indexer + grouped-MoE specs and their
pools, the Hub's stored names (every stored tensor used once), transformers loading the tiny
checkpoints and agreeing on RoPE / softmax scale, FP8 block dequantization against torch's, the
config-time refusals and `tandem inspect`."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest

from tandem.checkpoint import open_checkpoint
from tandem.checkpoint.description import MLPKind, MoESpec, description_from_dict, description_to_dict
from tandem.checkpoint.families import FAMILIES, MODEL_TYPES, deepseek_dsa
from tandem.checkpoint.families.deepseek_dsa.tiny import DSA_KINDS, dsa_config, quantize_fp8_blocks
from tandem.checkpoint.families.layer_tensors import nextn_model_shapes
from tandem.checkpoint.mla_specs import IndexerSpec, MLASpec
from tandem.checkpoint.safetensors_files import TensorIndex, dequantize_fp8_blocks
from tandem.cli import main
from tandem.testing.tiny_checkpoints import write_safetensors, write_tiny_checkpoint

from ..checkpoint_fixtures import refusal
from ..conftest import edit_json, read_all

KINDS = tuple(DSA_KINDS)


@pytest.fixture(scope="module")
def dsa_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa")
    for kind in KINDS:
        write_tiny_checkpoint(root / kind, kind)
    return root


@pytest.fixture
def dsa_copy(dsa_root, tmp_path):
    def copy(kind: str = "deepseek_v32"):
        shutil.copytree(dsa_root / kind, tmp_path / kind)
        return tmp_path / kind
    return copy


def describe(kind: str = "deepseek_v32", mtp_layers: int = 1, **changes):
    cfg = {k: v for k, v in {**dsa_config(kind), **changes}.items() if v is not None}
    return deepseek_dsa.describe(cfg, cfg["architectures"][0], mtp_layers=mtp_layers, mtp_source="checkpoint")


def test_deepseek_v32_description():
    d = describe()
    assert FAMILIES["DeepseekV32ForCausalLM"] is deepseek_dsa and MODEL_TYPES["glm_moe_dsa"] == "GlmMoeDsaForCausalLM"
    m = d.layers[0].mixer
    assert isinstance(m, MLASpec) and all(x.mixer is m for x in d.all_layers)
    assert (m.num_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == \
        (4, 48, 32, 16, 8, 16)
    assert m.indexer == IndexerSpec(num_heads=16, head_dim=16, topk=8, rope_interleave=False, reuse_previous=False)
    assert m.rope_interleave and m.yarn.factor == 4.0 and m.yarn.original_max_position_embeddings == 512
    assert m.scale == pytest.approx(24 ** -0.5 * (0.1 * np.log(4.0) + 1) ** 2)  # mscale_all_dim folded in
    assert [x.mlp for x in d.layers] == [MLPKind.DENSE, MLPKind.MOE, MLPKind.MOE] and not d.norm_zero_centred
    assert (d.moe.num_experts, d.moe.top_k, d.moe.n_group, d.moe.topk_group, d.moe.routed_scaling_factor) == \
        (8, 2, 2, 1, 2.5)
    assert (d.moe.router, d.moe.score_correction_bias, d.moe.shared_expert_gate) == ("sigmoid", True, False)
    assert (d.mtp.form, d.mtp.own_lm_head, d.mtp.layer.mlp, d.mtp.layer.mixer.indexer.reuse_previous) == \
        ("nextn", True, MLPKind.MOE, False)
    pools = [(p.name, p.row_shape) for p in m.cache_specs()]
    assert pools == [("latent", (1, 40)), ("index_keys", (16,))]
    assert d.kv_bytes_per_token("float32", include_mtp=False) == 3 * 4 * (40 + 16)


def test_glm_reuses_the_previous_top_k_and_interleaves_the_indexer_rope():
    d = describe("glm_moe_dsa")
    full, shared = d.layers[0].mixer, d.layers[1].mixer
    assert d.layers[2].mixer is full and d.mtp.layer.mixer is full and full.yarn is None
    assert full.indexer.rope_interleave and shared.indexer.reuse_previous and not full.indexer.reuse_previous
    assert [p.name for p in shared.cache_specs()] == ["latent"]
    assert (d.moe.n_group, full.scale) == (1, pytest.approx(24 ** -0.5))
    assert deepseek_dsa.indexer_types({"index_topk_freq": 2, "index_skip_topk_offset": 1}, 5) == \
        ["full", "shared", "full", "shared", "full"]
    assert deepseek_dsa.indexer_types({"index_topk_pattern": "FSSF"}, 4) == ["full", "shared", "shared", "full"]


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_description_round_trip(kind):
    d = describe(kind)
    back = description_from_dict(json.loads(json.dumps(description_to_dict(d))))
    assert back == d and back.layers[0].mixer.inv_freq().tolist() == d.layers[0].mixer.inv_freq().tolist()


@pytest.mark.parametrize("changes, expected", [
    (dict(n_group=3), "n_group 3 must be a positive divisor of num_experts 8"),
    (dict(topk_group=3), "topk_group 3 must be in 1..n_group 2"),
    (dict(n_group=8, topk_group=1), "every group needs at least 2"),
    (dict(n_group=4, topk_group=1, top_k=3), "exceeds the 1 x 2 experts"),
])
def test_moe_group_validation(changes, expected):
    base = dict(num_experts=8, top_k=2, expert_intermediate_size=4, shared_expert_intermediate_size=4,
                router="sigmoid", n_group=2, topk_group=1)
    with pytest.raises(ValueError, match=expected):
        MoESpec(**{**base, **changes})


def test_mla_validation():
    base = dict(num_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
                rope_theta=1e4)
    with pytest.raises(ValueError, match="needs q_lora_rank"):
        MLASpec(**{**base, "q_lora_rank": None}, indexer=IndexerSpec(2, 8, 4))
    with pytest.raises(ValueError, match="qk_rope_head_dim 3 must be even"):
        MLASpec(**{**base, "qk_rope_head_dim": 3})
    with pytest.raises(ValueError, match="smaller than qk_rope_head_dim"):
        MLASpec(**base, indexer=IndexerSpec(2, 2, 4))
    plain = MLASpec(**{**base, "q_lora_rank": None})  # DeepSeek-V2-Lite's plain q_proj
    assert [p.name for p in plain.cache_specs()] == ["latent"] and plain.scale == 8 ** -0.5


@pytest.mark.parametrize("kind", KINDS)
def test_sources_use_every_stored_tensor_exactly_once(dsa_root, kind):
    ckpt = open_checkpoint(dsa_root / kind)
    stored = [n for src in ckpt.sources.values() for n in src.names]
    assert len(stored) == len(set(stored))
    on_disk = set(TensorIndex.open(dsa_root / kind).names())
    scales = {n for n in on_disk if n.endswith("_scale_inv")}
    assert bool(scales) == kind.endswith("fp8")
    assert on_disk - scales - set(stored) == {"model.layers.3.embed_tokens.weight"}  # the Hub's unread copy
    assert ckpt.sources["mtp.layers.0.shared_head.head.weight"].names == ("model.layers.3.shared_head.head.weight",)
    assert ckpt.sources["layers.2.mlp.shared_expert.up_proj.weight"].names == \
        ("model.layers.2.mlp.shared_experts.up_proj.weight",)
    experts = ckpt.sources["mtp.layers.0.mlp.experts.gate_up_proj"].names
    assert experts[:2] == tuple(f"model.layers.3.mlp.experts.0.{w}_proj.weight" for w in ("gate", "up"))


def test_nextn_heads_follow_the_stored_shared_head():
    """No NextN layer stores shared_head.head: all project with lm_head (and none is expected);
    one does: each keeps its own, so the other's is expected (and reported missing)."""
    d = describe(mtp_layers=2)
    heads = ("model.layers.3.shared_head.head.weight", "model.layers.4.shared_head.head.weight")
    shared = deepseek_dsa.fit_mtp_to_tensors(d, frozenset({"model.layers.3.shared_head.norm.weight"}))
    assert d.mtp.own_lm_head and not shared.mtp.own_lm_head and shared.layers == d.layers
    assert not any(".shared_head.head." in n for n in nextn_model_shapes(shared))
    assert deepseek_dsa.fit_mtp_to_tensors(d, frozenset(heads[1:])) == d
    assert {n for s in deepseek_dsa.sources(d).values() for n in s.names} >= set(heads)


def test_glm_shared_layer_has_no_indexer_tensors(dsa_root):
    names = set(TensorIndex.open(dsa_root / "glm_moe_dsa").names())
    assert {f"model.layers.{i}.self_attn.indexer.wk.weight" for i in (0, 2, 3)} <= names
    assert not any(n.startswith("model.layers.1.self_attn.indexer.") for n in names)


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_transformers_loads_the_trunk_and_agrees_on_rope_and_scale(dsa_root, kind):
    """transformers 5.24 has no NextN module: it leaves exactly the model.layers.3.* tensors unread."""
    torch = pytest.importorskip("torch")
    import transformers

    path = dsa_root / kind
    model, info = getattr(transformers, DSA_KINDS[kind][0]).from_pretrained(path, output_loading_info=True,
                                                                          dtype=torch.float32)
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"]
    assert info["unexpected_keys"] and all(k.startswith("model.layers.3.") for k in info["unexpected_keys"])
    m = open_checkpoint(path).description.layers[0].mixer
    rotary = model.model.rotary_emb
    np.testing.assert_allclose(m.inv_freq(), rotary.inv_freq.numpy(), rtol=1e-6)
    assert m.rope_attention_factor == pytest.approx(rotary.attention_scaling)
    assert m.scale == pytest.approx(model.model.layers[0].self_attn.scaling, rel=1e-12)
    ours = open_checkpoint(path).weight("layers.1.mlp.experts.gate_up_proj")
    np.testing.assert_array_equal(ours, model.model.layers[1].mlp.experts.gate_up_proj.detach().numpy())


def test_yarn_inverse_frequencies_equal_transformers_on_real_dims():
    """DeepSeek-V3.2's own RoPE: qk_rope_head_dim 64, theta 1e4, YaRN factor 40 from 4096 positions."""
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV32Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0}
    m = describe(rope_scaling=rope, qk_rope_head_dim=64, qk_nope_head_dim=128, index_head_dim=128,
                 max_position_embeddings=163840).layers[0].mixer
    cfg = DeepseekV32Config(qk_rope_head_dim=64, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, **{
        k: v for k, v in rope.items() if k != "type"}}, max_position_embeddings=163840)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, torch.device("cpu"))
    np.testing.assert_allclose(m.inv_freq(), inv_freq.numpy(), rtol=1e-6)
    assert m.rope_attention_factor == pytest.approx(factor) and m.scale == pytest.approx(
        192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)


@pytest.mark.parametrize("shape", [(300, 260), (128, 128), (1, 129), (257, 7)])
def test_fp8_dequantization_equals_torch_reference(shape):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    q, scale = quantize_fp8_blocks(rng.standard_normal(shape).astype(np.float32) * 3)
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    tq = torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    s = torch.from_numpy(scale).repeat_interleave(128, 0).repeat_interleave(128, 1)[:shape[0], :shape[1]]
    reference = (tq.to(torch.float32) * s).numpy()
    np.testing.assert_array_equal(dequantize_fp8_blocks(q, scale, (128, 128)), reference)


def test_fp8_checkpoint_reads_dequantized_weights(dsa_root):
    torch = pytest.importorskip("torch")
    fp8, plain = open_checkpoint(dsa_root / "deepseek_v32_fp8"), open_checkpoint(dsa_root / "deepseek_v32")
    stored = read_all(dsa_root / "deepseek_v32_fp8")
    name = "model.layers.0.mlp.gate_proj.weight"  # [160, 64]: two row blocks, the second partial
    assert stored[name].dtype == ml_dtypes.float8_e4m3fn and stored[name + "_scale_inv"].shape == (2, 1)
    tq = torch.from_numpy(stored[name].view(np.uint8).copy()).view(torch.float8_e4m3fn).to(torch.float32)
    reference = tq * torch.from_numpy(stored[name + "_scale_inv"]).repeat_interleave(128, 0)[:160]
    got = fp8.weight("layers.0.mlp.gate_proj.weight")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, reference.numpy())
    for canonical in ("layers.0.mlp.gate_proj.weight", "layers.2.self_attn.kv_b_proj.weight",
                      "layers.1.mlp.experts.gate_up_proj", "mtp.layers.0.self_attn.indexer.wq_b.weight"):
        np.testing.assert_allclose(fp8.weight(canonical), plain.weight(canonical), rtol=0.07, atol=1e-3)
    np.testing.assert_array_equal(fp8.weight("embed_tokens.weight"), plain.weight("embed_tokens.weight"))


@pytest.mark.usefixtures("no_weight_reads")
@pytest.mark.parametrize("edit, expected", [
    ("block", "does not declare it"),
    ("no_scale", "fp8 tensor model.layers.0.mlp.up_proj.weight has no model.layers.0.mlp.up_proj.weight_scale_inv"),
    ("bad_scale", "model.layers.0.mlp.down_proj.weight_scale_inv is F32 [2, 2] but"),
    ("fp8_norm", "tensor model.norm.weight is F8_E4M3 [64], not a 2-D F8_E4M3 .weight"),
    ("orphan_scale", "tensor model.norm.weight_scale_inv is the scale of no fp8 weight"),
])
def test_other_quantized_forms_are_refused(dsa_copy, edit, expected):
    path = dsa_copy("deepseek_v32_fp8")
    tensors = read_all(path)
    if edit == "block":
        edit_json(path / "config.json", quantization_config={"quant_method": "fp8", "weight_block_size": [64, 64]})
    elif edit == "no_scale":
        del tensors["model.layers.0.mlp.up_proj.weight_scale_inv"]
    elif edit == "bad_scale":
        tensors["model.layers.0.mlp.down_proj.weight_scale_inv"] = np.ones((2, 2), np.float32)
    elif edit == "fp8_norm":
        tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(ml_dtypes.float8_e4m3fn)
    else:
        tensors["model.norm.weight_scale_inv"] = np.ones((1,), np.float32)
    write_safetensors(path / "model.safetensors", tensors)
    msg = refusal(path)
    assert "not in the one quantized format tandem reads" in msg and expected in msg, msg


@pytest.mark.usefixtures("no_weight_reads")
@pytest.mark.parametrize("kind, changes, expected", [
    ("deepseek_v32", dict(q_lora_rank=None), "'q_lora_rank' is missing or null"),
    ("deepseek_v32", dict(rope_scaling={"type": "llama3", "factor": 8.0}), "rope_type 'llama3' is not supported"),
    ("deepseek_v32", dict(scoring_func="softmax"), "'scoring_func' is 'softmax'"),
    ("deepseek_v32", dict(n_group=3), "n_group 3 must be a positive divisor of num_experts 8"),
    ("deepseek_v32", dict(layer_types=["full_attention"] * 3), "layer is 'indexed_attention'"),
    ("glm_moe_dsa", dict(indexer_types=["shared", "full", "full"]), "indexer_types[0] is 'shared'"),
    ("glm_moe_dsa", dict(indexer_types=["full", "sometimes", "full"]), "must give 'full' or 'shared'"),
])
def test_config_refusals(dsa_copy, kind, changes, expected):
    path = dsa_copy(kind)
    edit_json(path / "config.json", **changes)
    msg = refusal(path)
    assert f"{path / 'config.json'}: " in msg and expected in msg and "Fix config.json" in msg


def test_inspect_reports_mla_indexer_and_cache_bytes(dsa_root, capsys):
    assert main(["inspect", str(dsa_root / "glm_moe_dsa")]) == 0
    out = capsys.readouterr().out
    assert "3 latent attention (MLA)  [MMM]" in out and "q LoRA 48, kv LoRA 32, qk 16 nope + 8 rope, v 16" in out
    assert "layers [1] reuse the previous layer's selection" in out and "reuses the previous layer's top-8" in out
    assert "480 latent + 128 indexer = 608 bytes (float32, trunk) vs 1,920 for per-head K/V" in out
    assert "mtp 0" in out and "nextn form" in out
    assert main(["inspect", str(dsa_root / "deepseek_v32"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mla"]["bytes_per_token"] == {"latent": 3 * 40 * 4, "indexer": 3 * 16 * 4,
                                                "per_head_kv": 3 * 4 * (24 + 16) * 4}
    assert report["moe"]["n_group"] == 2 and report["mla"]["yarn_factor"] == 4.0 and report["attention"] is None
    assert report["fp8_block"] is None
    assert main(["inspect", str(dsa_root / "deepseek_v32_fp8")]) == 0
    assert "stored fp8 e4m3 in 128x128 blocks (read dequantized)" in capsys.readouterr().out


def test_nextn_layer_from_a_draft_folder(dsa_root, tmp_path):
    """The NextN layer (and the Hub's unread embedding copy) split off into a --draft folder."""
    owns = deepseek_dsa.mtp_layout(dsa_config("deepseek_v32")).owns
    tensors, target, draft = read_all(dsa_root / "deepseek_v32"), tmp_path / "t", tmp_path / "d"
    shutil.copytree(dsa_root / "deepseek_v32", target)
    draft.mkdir()
    write_safetensors(target / "model.safetensors", {n: a for n, a in tensors.items() if not owns(n)})
    write_safetensors(draft / "model.safetensors", {n: a for n, a in tensors.items() if owns(n)})
    ckpt = open_checkpoint(target, draft=draft)
    assert ckpt.description.mtp.source == str(draft)
    np.testing.assert_array_equal(ckpt.weight("mtp.layers.0.self_attn.indexer.wk.weight"),
                                  tensors["model.layers.3.self_attn.indexer.wk.weight"])
    assert "no NextN (model.layers.3.* and up) tensors" in refusal(target)
