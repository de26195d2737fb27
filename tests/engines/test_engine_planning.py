"""Backend-neutral build logic, tested without any runtime: options, bucket plans, default
verify widths, TensorRT profile shapes and plugin attribute mapping."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from tandem.checkpoint import open_checkpoint
from tandem.engines.buckets import default_verify_width, plan, profile_shapes, verify_width_per_batch
from tandem.engines.options import BuildOptions, OptionsError
from tandem.export.builder import TANDEM_DOMAIN
from tandem.plugins.tensorrt_plugins import PluginFieldError, mark_for_plugins, plugin_fields


@pytest.mark.parametrize("kwargs,match", [
    (dict(backend="vulkan"), "--backend 'vulkan'"),
    (dict(batch_sizes=(0, 2)), "--batch-sizes"),
    (dict(spec_k=0), "--spec-k 0 is out of range"),
    (dict(verify_widths=(1,)), "must be in 2..9"),
    (dict(no_mtp=True, draft="x"), "contradict"),
    (dict(no_mtp=True, verify_widths=(2,)), "contradict"),
    (dict(page_size=12), "power of two"),
    (dict(max_seq_len=8, page_size=16), "smaller than one page"),
    (dict(prefill_chunk=0), "--prefill-chunk"),
    (dict(dtype="int4"), "--dtype int4 is not supported yet"),
])
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(OptionsError, match=match):
        BuildOptions(**kwargs)


def test_default_verify_width_shrinks_with_batch():
    assert [default_verify_width(b, 3) for b in (1, 2, 4, 8, 16)] == [4, 4, 3, 3, 2]
    assert verify_width_per_batch(BuildOptions(batch_sizes=(1, 8, 32))) == {1: 4, 8: 3, 32: 2}
    assert verify_width_per_batch(BuildOptions(verify_widths=(2, 4), batch_sizes=(1, 4))) == {1: 4, 4: 2}
    assert verify_width_per_batch(BuildOptions(no_mtp=True)) == {}


def test_plan_covers_every_role_per_batch(tiny_root):
    desc = open_checkpoint(tiny_root / "qwen3_5_mtp3").description
    buckets = plan(desc, BuildOptions(batch_sizes=(1, 8), prefill_chunk=32))
    names = {b.name for b in buckets}
    assert {"target_step.b1.w1", "target_step.b8.w32-2", "verify_greedy.b8.w3", "verify_sample.b1.w4",
            "mtp_head_2.b8.w32-1"} <= names
    assert len(names) == len(buckets)


def test_profile_shapes_follow_the_contract(tiny_root):
    desc = open_checkpoint(tiny_root / "qwen3_5_mtp1").description
    options = BuildOptions(batch_sizes=(4,), prefill_chunk=32, max_seq_len=256, page_size=16)
    buckets = {b.name: b for b in plan(desc, options)}
    prefill = profile_shapes(desc, buckets["target_step.b4.w32-2"], options)
    assert prefill["input_ids"] == ((4, 2), (4, 32), (4, 32))
    assert prefill["block_tables"] == ((4, 1), (4, 16), (4, 16))
    assert prefill["key_pool.1"][2] == (4 * 16 + 1, 16, 2, 16)
    assert prefill["recurrent_pool.0"][1] == (4, 4, 16, 16)
    verify = profile_shapes(desc, buckets["verify_sample.b4.w3"], options)
    assert verify["uniforms"] == ((4, 3),) * 3 and "state_rows" not in verify
    head = profile_shapes(desc, buckets["mtp_head_0.b4.w32-1"], options)
    assert head["hidden_in"] == ((4, 1, 64), (4, 32, 64), (4, 32, 64)) and "key_pool.mtp0" in head


def test_plugin_fields_narrow_like_the_parser():
    node = onnx.helper.make_node("GatedDeltaNet", [], [], domain=TANDEM_DOMAIN, name="gdn", scale=0.125,
                                 num_key_heads=16, num_value_heads=32, unrelated=7)
    fields = plugin_fields(node)
    assert set(fields) == {"scale", "num_key_heads", "num_value_heads"}  # unlisted attributes dropped
    assert fields["scale"].dtype == np.float32 and fields["num_value_heads"].dtype == np.int32
    big = onnx.helper.make_node("PagedSparseAttention", [], [], domain=TANDEM_DOMAIN, name="a", scale=1.0,
                                sliding_window=2**40)
    with pytest.raises(PluginFieldError, match="does not fit the plugin's int32 field"):
        plugin_fields(big)
    lacking = onnx.helper.make_node("PagedSparseAttention", [], [], domain=TANDEM_DOMAIN, name="a", scale=1.0)
    with pytest.raises(PluginFieldError, match="lacks plugin field"):
        plugin_fields(lacking)


def test_mark_for_plugins_tags_tandem_nodes_only(tiny_root):
    from tandem.export.exporter import build_graphs

    model = build_graphs(open_checkpoint(tiny_root / "qwen3_5_mtp1"))["target_step"]
    marked = mark_for_plugins(model)
    tagged = [n for n in marked.graph.node if any(a.name == "plugin_namespace" for a in n.attribute)]
    assert tagged and all(n.domain == TANDEM_DOMAIN for n in tagged)
    assert len(tagged) == sum(1 for n in model.graph.node if n.domain == TANDEM_DOMAIN)


def test_verify_graph_gated_deltanet_nodes_get_the_row_states_plugin(tiny_root):
    """Verify graphs keep every row's state (3 outputs): an AOT plugin has a fixed output count,
    so those nodes name their own plugin; a node of the wrong arity is refused before TensorRT."""
    from tandem.export.exporter import build_graphs

    model = build_graphs(open_checkpoint(tiny_root / "qwen3_5_mtp1"))["verify_greedy"]
    marked = mark_for_plugins(model)
    names = {n.op_type for n in marked.graph.node if n.domain == TANDEM_DOMAIN}
    assert names == {"GatedDeltaNetRowStates", "PagedSparseAttention"}
    gdn = next(n for n in model.graph.node if n.op_type == "GatedDeltaNet")
    del gdn.output[2]
    del gdn.input[6]
    with pytest.raises(PluginFieldError, match="takes 7 inputs and gives 2 outputs"):
        mark_for_plugins(model)


def test_tensorrt_build_runs_where_tensorrt_is_installed(tiny_root, tmp_path):
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (it needs NVIDIA's package index and a GPU); "
                                           "its build is exercised on GPU machines only")
    from tandem.engines.builder import build_engines
    from tandem.engines.manifest import read_manifest

    build_engines(tiny_root / "qwen3_5_mtp1", tmp_path / "trt", BuildOptions(backend="tensorrt", batch_sizes=(1,),
                                                                             prefill_chunk=8, max_seq_len=256))
    assert all(e["verification"]["passed"] for e in read_manifest(tmp_path / "trt")["engines"])
