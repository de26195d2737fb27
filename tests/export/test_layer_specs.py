"""Per-layer mixer specs: every trunk and MTP head layer carries its own mixer spec, the
description round-trips through the manifest form (and reads the form written before per-layer
specs), the attention spec's sliding window reaches its paged pools, and the exporter builds a
window layer on its page group's table and per-layer RoPE on its own tables."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

from tandem.checkpoint import LayerKind, open_checkpoint
from tandem.checkpoint.description import (
    AttentionSpec,
    LayerSpec,
    LinearAttentionSpec,
    MTPSpec,
    description_from_dict,
    description_to_dict,
)
from tandem.export.graphs import mtp_head, target_step
from tandem.export.layers import Weights


@pytest.fixture(scope="module")
def ckpt(tiny_root):
    return open_checkpoint(tiny_root / "qwen3_5_mtp3")


def _old_form(desc) -> dict:
    """The manifest's description as written before per-layer mixers: one global attention and
    linear_attention spec, layers as {"kind", "mlp"}, mtp as {"num_layers", "layer", "source"}."""
    data = description_to_dict(desc)
    old_layer = lambda x: {"kind": x["kind"], "mlp": x["mlp"]}  # noqa: E731
    data["attention"] = {**asdict(desc.attention), "mrope_section": list(desc.attention.mrope_section or []) or None}
    data["linear_attention"] = asdict(desc.linear_attention)
    data["layers"] = [old_layer(x) for x in data["layers"]]
    data["mtp"] = {"num_layers": desc.mtp.num_layers, "layer": old_layer(data["mtp"]["layers"][0]),
                   "source": desc.mtp.source}
    for spec in (data["attention"], data["linear_attention"]):
        spec.pop("window", None)  # the old spec had no window field
    return data


def test_qwen_layers_share_one_spec_per_mixer_kind(ckpt):
    d = ckpt.description
    attn = {id(x.mixer) for x in d.all_layers if x.kind == LayerKind.FULL_ATTENTION}
    gdn = {id(x.mixer) for x in d.all_layers if x.kind == LayerKind.LINEAR_ATTENTION}
    assert len(attn) == 1 and len(gdn) == 1
    assert d.attention is d.layers[d.layer_indices(LayerKind.FULL_ATTENTION)[0]].mixer
    assert d.linear_attention is d.layers[d.layer_indices(LayerKind.LINEAR_ATTENTION)[0]].mixer
    assert all(x.mixer is d.attention for x in d.mtp.layers) and d.mtp.num_layers == 3
    assert isinstance(d.attention, AttentionSpec) and isinstance(d.linear_attention, LinearAttentionSpec)


def test_manifest_form_round_trips_with_per_layer_mixers(ckpt):
    d = ckpt.description
    back = description_from_dict(description_to_dict(d))
    assert back == d
    assert len({id(x.mixer) for x in back.all_layers}) == 2  # equal specs are read back as one object
    # a layer with its own spec survives the round trip as its own
    own = replace(d.attention, num_kv_heads=1, rope_theta=5e5, window=16)
    layers = d.layers[:1] + (replace(d.layers[1], mixer=own),) + d.layers[2:]
    assert d.layers[1].kind == LayerKind.FULL_ATTENTION
    mixed = replace(d, layers=layers)
    again = description_from_dict(description_to_dict(mixed))
    assert again == mixed and again.layers[1].mixer == own and again.layers[3].mixer == d.attention


def test_a_manifest_written_before_per_layer_mixers_still_loads(ckpt):
    d = ckpt.description
    old = _old_form(d)
    assert "mixer" not in old["layers"][0] and "attention" in old
    back = description_from_dict(old)
    assert back == d and back.layer_caches() == d.layer_caches()


def test_pure_attention_model_has_no_gated_deltanet_and_no_state(ckpt):
    d = ckpt.description
    pure = replace(d, layers=tuple(LayerSpec(d.attention, x.mlp) for x in d.layers))
    assert pure.linear_attention is None
    assert pure.state_bytes_per_sequence() == 0
    assert all(c.paged and not c.states for c in pure.layer_caches())
    assert description_from_dict(description_to_dict(pure)) == pure


def test_window_is_validated_and_reaches_the_paged_pools(ckpt):
    a = ckpt.description.attention
    for bad in (0, -4, 2.5):
        with pytest.raises(ValueError, match="sliding window"):
            replace(a, window=bad)
    assert {p.window for p in a.cache_specs()} == {None}
    windowed = replace(a, window=16)
    assert [(p.name, p.window) for p in windowed.cache_specs()] == [("key", 16), ("value", 16)]
    d = ckpt.description
    i = d.layer_indices(LayerKind.FULL_ATTENTION)[0]
    layers = tuple(replace(x, mixer=windowed) if j == i else x for j, x in enumerate(d.layers))
    caches = replace(d, layers=layers).layer_caches()
    assert [p.window for p in caches[i].paged] == [16, 16]
    assert all(p.window is None for c in caches if c.layer != i or c.head for p in c.paged)


def _attention_nodes(model):
    return [n for n in model.graph.node if n.op_type == "PagedSparseAttention"]


def test_a_window_layer_reads_its_page_groups_table_and_masks_its_window(ckpt):
    d = ckpt.description
    i = d.layer_indices(LayerKind.FULL_ATTENTION)[-1]
    layers = tuple(replace(x, mixer=replace(d.attention, window=8)) if j == i else x for j, x in enumerate(d.layers))
    model = target_step(replace(d, layers=layers), Weights(ckpt))
    assert [x.name for x in model.graph.input if x.name.startswith("block_tables")] == ["block_tables",
                                                                                       "block_tables.window8"]
    by_layer = {n.name.split("/")[2]: n for n in _attention_nodes(model)}
    window = {n: next(a.i for a in node.attribute if a.name == "sliding_window") for n, node in by_layer.items()}
    assert window.pop(f"layers.{i}") == 8 and set(window.values()) == {0}
    assert by_layer[f"layers.{i}"].input[5] == "block_tables.window8"
    assert {node.input[5] for n, node in by_layer.items() if n != f"layers.{i}"} == {"block_tables"}
    heads = MTPSpec(d.mtp.layers[:2] + (replace(d.mtp.layers[2], mixer=replace(d.attention, window=8)),),
                    d.mtp.source)
    head = mtp_head(replace(d, mtp=heads), Weights(ckpt), 2)
    assert [x.name for x in head.graph.input if x.name.startswith("block_tables")] == ["block_tables.window8"]


def test_per_layer_rope_gets_its_own_tables(ckpt):
    d = ckpt.description
    i = d.layer_indices(LayerKind.FULL_ATTENTION)[-1]
    layers = tuple(replace(x, mixer=replace(d.attention, rope_theta=123.0)) if j == i else x
                   for j, x in enumerate(d.layers))
    model = target_step(replace(d, layers=layers), Weights(ckpt))
    cos = [n.name for n in model.graph.node if n.op_type == "Cos"]
    assert cos == ["/rotary/cos", f"/rotary.{d.attention.rotary_dim}.123/cos"]
