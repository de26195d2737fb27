"""The reader on every tiny layout: description from config, shapes from headers, lazy weights."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.checkpoint import LayerKind, MLPKind, open_checkpoint
from tandem.checkpoint.safetensors_files import TensorIndex
from tandem.testing.tiny_checkpoints import TINY_KINDS, write_tiny_checkpoint

EXPECTED = {  # kind -> (family, layer pattern, MLP kinds per layer, MTP layers)
    "qwen3_5_mtp1": ("qwen3_5", "LALA", "DDDD", 1),
    "qwen3_5_mtp3": ("qwen3_5", "LALA", "DDDD", 3),
    "qwen3_5_moe": ("qwen3_5_moe", "LALA", "MMMM", 1),
    "qwen3_next": ("qwen3_next", "LALA", "MDMM", 1),
}


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_description_from_config(tiny_root, kind, no_weight_reads):
    d = open_checkpoint(tiny_root / kind).description
    family, pattern, mlps, mtp_layers = EXPECTED[kind]
    assert d.family == family
    assert "".join("A" if layer.kind == LayerKind.FULL_ATTENTION else "L" for layer in d.layers) == pattern
    assert "".join("M" if layer.mlp == MLPKind.MOE else "D" for layer in d.layers) == mlps
    assert d.mtp.num_layers == mtp_layers and d.mtp.source == "checkpoint"
    assert d.attention.rotary_dim == 8 and d.attention.output_gate
    assert d.eos_token_ids == (2, 0)  # generation_config.json: <|im_end|>, <|endoftext|>
    # 2 full-attention layers (+ MTP layers), K and V of 2 heads x 16 dims, fp32
    assert d.kv_bytes_per_token(include_mtp=False) == 2 * 2 * 2 * 16 * 4
    assert d.kv_bytes_per_token() == (2 + mtp_layers) * 2 * 2 * 16 * 4
    # 2 GDN layers: 4 value heads x 16 x 16 fp32 + conv window 3 x (2*32 + 64) fp32
    assert d.state_bytes_per_sequence() == 2 * (4 * 16 * 16 * 4 + 3 * 128 * 4)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_every_canonical_weight_reads_with_its_shape(tiny_root, kind):
    ckpt = open_checkpoint(tiny_root / kind)
    from tandem.checkpoint.families.layer_tensors import trunk_shapes
    from tandem.checkpoint.families.qwen_hybrid import mtp_shapes

    shapes = {**trunk_shapes(ckpt.description), **mtp_shapes(ckpt.description)}
    assert set(ckpt.canonical_names()) == set(shapes)
    for name in ckpt.canonical_names():
        assert ckpt.weight(name).shape == shapes[name], name


def test_weight_reads_only_the_tensors_asked_for(tiny_root, monkeypatch):
    ckpt = open_checkpoint(tiny_root / "qwen3_next")
    seen = []
    real = TensorIndex.read
    monkeypatch.setattr(TensorIndex, "read", lambda self, name: seen.append(name) or real(self, name))
    ckpt.weight("layers.0.linear_attn.in_proj_z.weight")
    assert seen == ["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    seen.clear()
    ckpt.weight("layers.0.mlp.experts.down_proj")  # per-expert tensors stacked on read
    assert seen == [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(4)]


def test_qwen3_next_interleaved_projections_normalise_to_flat(tiny_root):
    """Group g of in_proj_qkvz holds [q_g | k_g | v_g (r heads) | z_g (r heads)]; canonical
    in_proj_qkv is [q (all groups) | k | v] and value head g*r + j keeps its rows."""
    ckpt = open_checkpoint(tiny_root / "qwen3_next")
    index = TensorIndex.open(tiny_root / "qwen3_next")
    qkvz = np.asarray(index.read("model.layers.0.linear_attn.in_proj_qkvz.weight"))
    hk, dk, dv, r = 2, 16, 16, 2
    group = qkvz.reshape(hk, 2 * dk + 2 * r * dv, -1)
    qkv = ckpt.weight("layers.0.linear_attn.in_proj_qkv.weight")
    z = ckpt.weight("layers.0.linear_attn.in_proj_z.weight")
    key_dim = hk * dk
    np.testing.assert_array_equal(qkv[dk : 2 * dk], group[1, :dk])  # q of group 1
    np.testing.assert_array_equal(qkv[key_dim + dk : key_dim + 2 * dk], group[1, dk : 2 * dk])  # k of group 1
    v_head3 = qkv[2 * key_dim + 3 * dv : 2 * key_dim + 4 * dv]  # value head 3 = group 1, j = 1
    np.testing.assert_array_equal(v_head3, group[1, 2 * dk + dv : 2 * dk + 2 * dv])
    np.testing.assert_array_equal(z[3 * dv : 4 * dv], group[1, 2 * dk + r * dv + dv :])
    ba = np.asarray(index.read("model.layers.0.linear_attn.in_proj_ba.weight")).reshape(hk, 2 * r, -1)
    np.testing.assert_array_equal(ckpt.weight("layers.0.linear_attn.in_proj_b.weight")[3], ba[1, 1])
    np.testing.assert_array_equal(ckpt.weight("layers.0.linear_attn.in_proj_a.weight")[2], ba[1, r])


def test_per_expert_and_stacked_experts_read_the_same(tiny_root, tmp_path):
    from tandem.testing.tiny_checkpoints import write_weights

    stacked = open_checkpoint(tiny_root / "qwen3_5_moe")
    index = TensorIndex.open(tiny_root / "qwen3_5_moe")
    tensors = {}
    for name in index.names():
        arr = np.asarray(index.read(name))
        if name.endswith("mlp.experts.gate_up_proj"):
            base, i = name.removesuffix(".gate_up_proj"), arr.shape[1] // 2
            for e in range(arr.shape[0]):
                tensors[f"{base}.{e}.gate_proj.weight"] = arr[e, :i]
                tensors[f"{base}.{e}.up_proj.weight"] = arr[e, i:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(arr.shape[0]):
                tensors[f"{name.removesuffix('.down_proj')}.{e}.down_proj.weight"] = arr[e]
        else:
            tensors[name] = arr
    folder = tmp_path / "per_expert"
    folder.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / f).write_bytes((tiny_root / "qwen3_5_moe" / f).read_bytes())
    write_weights(folder, tensors, shards=3)
    per_expert = open_checkpoint(folder)
    for name in stacked.canonical_names():
        np.testing.assert_array_equal(per_expert.weight(name), stacked.weight(name), err_msg=name)


def test_bf16_checkpoint_reads_as_bfloat16(tmp_path):
    ckpt = open_checkpoint(write_tiny_checkpoint(tmp_path / "bf16", "qwen3_5_mtp3", dtype="bfloat16"))
    assert ckpt.description.dtype == "bfloat16"
    w = ckpt.weight("mtp.fc.weight")
    assert w.dtype.name == "bfloat16" and np.isfinite(w.astype(np.float32)).all()
    assert ckpt.description.kv_bytes_per_token(include_mtp=False) == 2 * 2 * 2 * 16 * 2


def test_parameter_count_from_headers(tiny_root):
    ckpt = open_checkpoint(tiny_root / "qwen3_5_mtp3")
    total = sum(ckpt.weight(n).size for n in ckpt.canonical_names() if not n.startswith("mtp."))
    assert ckpt.parameter_count() == total
    assert ckpt.parameter_count(mtp=True) == sum(ckpt.weight(n).size for n in ckpt.canonical_names()
                                                 if n.startswith("mtp."))
