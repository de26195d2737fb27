"""TensorRT plugins for the `ai.tandem` ops, the backend-neutral part: which plugin a node maps
to, the attributes the ONNX parser hands it, its output shapes and its kernel launch plan.
tensorrt_registration.py only wraps these in TensorRT's `tensorrt.plugin` API.

    ONNX node (ai.tandem)  --mark_for_plugins-->  plugin_namespace="tandem", op renamed if needed
    TensorRT parser        -->  registered plugin tandem::<name>  (AOT: Triton kernel as PTX)
                                no plugin registered -> the node's function body (fallback)

The parser hands a plugin only the attributes named in its creator's field list, narrowing
INT(S) to int32 and FLOAT(S) to float32 (see ../shared reference, runtimes.md). PLUGIN_FIELDS is
that list for each plugin; plugin_fields() applies the same narrowing to an ONNX node, so what a
plugin will receive is checked here, without TensorRT.

GatedDeltaNet with a third output (row_states, in verify graphs) is its own plugin,
GatedDeltaNetRowStates: an AOT plugin has a fixed output count and launches one kernel.
"""

from __future__ import annotations

import numpy as np
import onnx

from tandem.contract import TANDEM_DOMAIN

PLUGIN_NAMESPACE = "tandem"
PLUGIN_VERSION = "1"
_GDN_FIELDS = {"scale": np.float32, "num_key_heads": np.int32, "num_value_heads": np.int32}
PLUGIN_FIELDS: dict[str, dict[str, type]] = {
    "GatedDeltaNet": _GDN_FIELDS,
    "GatedDeltaNetRowStates": _GDN_FIELDS,
    "PagedSparseAttention": {"scale": np.float32, "sliding_window": np.int32},
}
PLUGIN_ARITY = {"GatedDeltaNet": (7, 2), "GatedDeltaNetRowStates": (7, 3), "PagedSparseAttention": (8, 1)}


class PluginFieldError(ValueError):
    pass


def _output_count(node: onnx.NodeProto) -> int:
    return sum(1 for o in node.output if o)  # an empty name is an omitted optional output


def plugin_name(node: onnx.NodeProto) -> str:
    """The plugin serving this node (refusing nodes no plugin serves)."""
    if node.domain != TANDEM_DOMAIN or node.op_type not in PLUGIN_FIELDS:
        raise PluginFieldError(f"{node.name}: {node.domain}::{node.op_type} has no tandem plugin")
    name = node.op_type
    if name == "GatedDeltaNet" and _output_count(node) == 3:
        name = "GatedDeltaNetRowStates"
    return name


def plugin_fields(node: onnx.NodeProto) -> dict[str, np.ndarray]:
    """The fields TensorRT's parser would pass for this node: only the plugin's declared names,
    INT narrowed to int32 (refusing values that do not fit), FLOAT to float32."""
    declared = PLUGIN_FIELDS[plugin_name(node)]
    out = {}
    for attr in node.attribute:
        if attr.name not in declared:
            continue
        value = onnx.helper.get_attribute_value(attr)
        kind = declared[attr.name]
        arr = np.atleast_1d(np.asarray(value))
        if kind is np.int32 and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
            raise PluginFieldError(f"{node.name}: attribute {attr.name}={value} does not fit the plugin's int32 field")
        out[attr.name] = arr.astype(kind)
    missing = set(declared) - set(out)
    if missing:
        raise PluginFieldError(f"{node.name}: {node.op_type} lacks plugin field(s) {sorted(missing)}")
    return out


def mark_for_plugins(model: onnx.ModelProto) -> onnx.ModelProto:
    """Tag each tandem node with plugin_namespace / plugin_version, which makes the parser pick
    a registered plugin over the function body, and give it its plugin's name."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        if node.domain == TANDEM_DOMAIN and node.op_type in PLUGIN_FIELDS and not _body_only(node):
            plugin_fields(node)  # refuse early what the plugin could not take
            name = plugin_name(node)
            n_in, n_out = PLUGIN_ARITY[name]
            if (len(node.input), _output_count(node)) != (n_in, n_out):
                raise PluginFieldError(f"{node.name}: {name} takes {n_in} inputs and gives {n_out} outputs; "
                                       f"the node has {len(node.input)} and {len(node.output)}")
            node.op_type = name
            node.attribute.extend([onnx.helper.make_attribute("plugin_namespace", PLUGIN_NAMESPACE),
                                   onnx.helper.make_attribute("plugin_version", PLUGIN_VERSION)])
    return out


def _body_only(node: onnx.NodeProto) -> bool:
    """Nodes whose attributes ask for what the plugin kernel does not implement keep their function
    body: PagedSparseAttention with select_new_rows (sparse MLA: the selection filters new rows)."""
    return any(a.name == "select_new_rows" and a.i for a in node.attribute)


def output_shapes(plugin: str, shapes: list[tuple]) -> list[tuple]:
    """Output shapes from input shapes (entries: ints or TensorRT shape expressions)."""
    if plugin.startswith("GatedDeltaNet"):
        q, _, v, _, _, s0, _ = shapes
        out = [tuple(v), tuple(s0)]
        if plugin == "GatedDeltaNetRowStates":
            out.append((v[0], v[1], v[2], s0[2], s0[3]))
        return out
    q, _, v, *_ = shapes
    return [(q[0], q[1], q[2], v[3])]


def _known(dim, what: str) -> int:
    return int(dim)


def kernel_plan(plugin: str, shapes: list[tuple], fields: dict, dtype: str, constant=_known):
    """The Triton launch plan for one plugin instance. `constant(dim, what)` turns a dimension
    that must be known at build time (head counts and dims, page size) into an int."""
    if plugin.startswith("GatedDeltaNet"):
        from tandem.plugins.gated_deltanet_kernel import gated_deltanet_plan
        q, _, v, *_ = shapes
        return gated_deltanet_plan(
            v[0], v[1], num_key_heads=int(np.asarray(fields["num_key_heads"]).item()),
            num_value_heads=int(np.asarray(fields["num_value_heads"]).item()),
            key_dim=constant(q[3], "the key head dim"), value_dim=constant(v[3], "the value head dim"),
            scale=float(np.asarray(fields["scale"]).item()), emit_row_states=plugin == "GatedDeltaNetRowStates",
            dtype=dtype)
    if plugin == "PagedSparseAttention":
        from tandem.plugins.paged_attention_kernel import paged_attention_plan
        q, k, v, key_cache, _, tables, _, selected = shapes
        return paged_attention_plan(
            q[0], q[1], tables[1], tuple(selected), num_query_heads=constant(q[2], "the query head count"),
            num_kv_heads=constant(k[2], "the KV head count"), head_dim=constant(q[3], "the head dim"),
            value_dim=constant(v[3], "the value head dim"), page_size=constant(key_cache[1], "the page size"),
            scale=float(np.asarray(fields["scale"]).item()),
            sliding_window=int(np.asarray(fields["sliding_window"]).item()), dtype=dtype)
    raise PluginFieldError(f"no tandem plugin named {plugin}")
