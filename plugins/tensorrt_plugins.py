"""TensorRT plugins for the `ai.tandem` ops: the attribute mapping the ONNX parser applies and
the node tagging that selects a plugin. (Kernels are not written yet; without them TensorRT
imports the function bodies.)

The parser hands a plugin only the attributes named in its creator's field list, narrowing
INT(S) to int32 and FLOAT(S) to float32 (see ../shared reference, runtimes.md). PLUGIN_FIELDS is
that list for each op; plugin_fields() applies the same narrowing to an ONNX node, so what a
plugin will receive is checked here, without TensorRT.
"""

from __future__ import annotations

import numpy as np
import onnx

from tandem.export.builder import TANDEM_DOMAIN

PLUGIN_NAMESPACE = "tandem"
PLUGIN_VERSION = "1"
PLUGIN_FIELDS: dict[str, dict[str, type]] = {
    "GatedDeltaNet": {"scale": np.float32, "num_key_heads": np.int32, "num_value_heads": np.int32},
    "PagedSparseAttention": {"scale": np.float32, "sliding_window": np.int32},
}


class PluginFieldError(ValueError):
    pass


def plugin_fields(node: onnx.NodeProto) -> dict[str, np.ndarray]:
    """The fields TensorRT's parser would pass for this node: only the op's declared names,
    INT narrowed to int32 (refusing values that do not fit), FLOAT to float32."""
    if node.domain != TANDEM_DOMAIN or node.op_type not in PLUGIN_FIELDS:
        raise PluginFieldError(f"{node.name}: {node.domain}::{node.op_type} has no tandem plugin")
    declared = PLUGIN_FIELDS[node.op_type]
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
    a registered plugin over the function body (without it, the body is imported)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        if node.domain == TANDEM_DOMAIN and node.op_type in PLUGIN_FIELDS:
            plugin_fields(node)  # refuse early what the plugin could not take
            node.attribute.extend([onnx.helper.make_attribute("plugin_namespace", PLUGIN_NAMESPACE),
                                   onnx.helper.make_attribute("plugin_version", PLUGIN_VERSION)])
    return out

