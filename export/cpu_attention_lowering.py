"""Attention on tandem's ONNX Runtime CPU kernels (plugins/cpu/), in the graphs the CPU provider
serves (export/lowering.py calls these after export/cpu_kernel_lowering.py's Gated DeltaNet pass):

    ai.tandem::PagedSparseAttention, dense, fp32  -> ai.tandem.cpu::PagedAttention (no `selected`;
        reads the committed K/V through the block table where it lies, no copies), taking the
        query's RMS norm and RoPE and the output gate where they are the exporter's (from the q
        projection's [B, W, Hq, 2 D] itself where the query and gate are its heads' halves)
    a key's RMSNormalization -> RoPE nodes        -> ai.tandem.cpu::NormRope
    the rotary tables those read (14 nodes)       -> ai.tandem.cpu::RotaryTables
    Identity nodes that name graph outputs        -> gone: the producers make the outputs

The patterns are matched in export/cpu_prologues.py. Each pass rewrites every match in a graph, and
every graph of an engine dir comes from the same exporter, so queries, keys and tables are made by
the same kernels wherever a graph makes them (a unified round's re-anchored heads included): keys a
graph commits have the same bits in every graph.
"""

from __future__ import annotations

import onnx
from onnx import helper

from tandem.export.cpu_kernel_lowering import CPU_DOMAIN, import_cpu_domain, names_read, set_nodes
from tandem.export.cpu_prologues import GraphIndex, match_attention, match_norm_rope, match_rotary_tables


def lower_attention_to_kernel(model: onnx.ModelProto, dense: set[str]) -> set[str]:
    """Rewrite in place the PagedSparseAttention nodes named in `dense` (no row selects:
    attention_lowering.dense_attention_nodes) whose caches are float32 graph inputs; returns the
    names rewritten (the others keep the graph lowering: float16 caches). Where the query's norm and
    RoPE and the output gate are the exporter's (export/cpu_prologues.py) the node takes them too
    and makes the gated output itself (8 nodes fewer a layer)."""
    graph = model.graph
    f32 = {i.name for i in graph.input if i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    index = GraphIndex(graph)
    done, made = set(), set()          # made: outputs a fused node now makes in place of their producers
    for node in graph.node:
        if node.name in dense and node.input[3] in f32 and node.input[4] in f32:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            kept = list(node.input[:7])                                  # all but `selected`
            fused = match_attention(index, node)
            del node.input[:], node.attribute[:]
            node.domain, node.op_type = CPU_DOMAIN, "PagedAttention"
            node.attribute.extend([helper.make_attribute("scale", float(attrs["scale"])),
                                   helper.make_attribute("sliding_window", int(attrs.get("sliding_window", 0)))])
            if fused is not None:
                kept[0] = fused.packed or fused.q_raw          # packed: the query and the gate in one
                kept += [fused.q_norm, fused.cos, fused.sin, fused.perm, "" if fused.packed else fused.gate]
                if fused.packed:
                    node.attribute.append(helper.make_attribute("packed_gate", 1))
                while kept[-1] == "":
                    kept.pop()
                if fused.gated:                        # the node makes the gated output in the Mul's place
                    node.output[0] = fused.gated
                    made.add(fused.gated)
                if fused.q_norm:
                    node.attribute.append(helper.make_attribute("norm_epsilon", fused.norm_epsilon))
            node.input.extend(kept)
            done.add(node.name)
    if done:
        nodes = [n for n in graph.node if n.domain == CPU_DOMAIN or not set(n.output) & made]
        set_nodes(graph, nodes)
        import_cpu_domain(model)
    return done


def lower_norm_rope_to_kernel(model: onnx.ModelProto) -> int:
    """Every key norm and RoPE chain of the exporter's (export/cpu_prologues.py, match_norm_rope) left
    after the attention nodes took their queries' -> one ai.tandem.cpu::NormRope node in the Add's
    place; returns how many. Every graph runs this over all its chains, so keys are made by the same
    kernel in all of them (the same bits wherever a graph commits them)."""
    graph = model.graph
    index = GraphIndex(graph)
    nodes, made = [], 0
    for node in graph.node:
        found = match_norm_rope(index, node)
        if found is None:
            nodes.append(node)
            continue
        raw, scale, eps, cos, sin, perm = found
        nodes.append(helper.make_node("NormRope", [raw, scale, cos, sin, perm], list(node.output), domain=CPU_DOMAIN,
                                      name=f"{node.name}/NormRope", **({"epsilon": eps} if scale else {})))
        made += 1
    if made:
        set_nodes(graph, nodes)
        import_cpu_domain(model)
    return made


def lower_rotary_tables_to_kernel(model: onnx.ModelProto) -> int:
    """The exporter's rotary tables (export/cpu_prologues.py, match_rotary_tables) that tandem's
    NormRope and attention nodes read -> one ai.tandem.cpu::RotaryTables node each, where the graph
    made the cos table; returns how many. Every graph makes its tables with it, so queries and keys
    are rotated alike in all of them."""
    graph = model.graph
    index = GraphIndex(graph)
    pairs: dict[tuple[str, str], object] = {}
    for node in graph.node:
        at = {"NormRope": 2, "PagedAttention": 8}.get(node.op_type) if node.domain == CPU_DOMAIN else None
        if at is not None and len(node.input) > at + 1 and node.input[at]:
            pair = (node.input[at], node.input[at + 1])
            if pair not in pairs:
                pairs[pair] = match_rotary_tables(index, *pair)
    found = {t.cos: t for t in pairs.values() if t is not None}
    if not found:
        return 0
    sines = {t.sin for t in found.values()}
    nodes = []
    for node in graph.node:
        tables = found.get(node.output[0]) if node.output else None
        if tables is not None:             # the cos table's place: after the positions, before its readers
            inputs = (["", tables.inv_freq, tables.context_lens, tables.ids] if tables.context_lens
                      else [tables.positions, tables.inv_freq])        # positions made in the node, or given
            nodes.append(helper.make_node("RotaryTables", inputs, [tables.cos, tables.sin], domain=CPU_DOMAIN,
                                          name=f"{node.name}/RotaryTables", head_dim=tables.head_dim))
        elif not (node.output and node.output[0] in sines):
            nodes.append(node)
    set_nodes(graph, nodes)
    return len(found)


def elide_output_identities(graph: onnx.GraphProto) -> int:
    """Identity(x) -> y, y a graph output: x's producer makes y itself and x's readers read y (the
    exporter names outputs through Identity nodes; ONNX Runtime keeps an Identity whose output is a
    graph output). Skipped where x is a graph input, output or initializer, or a subgraph reads it.
    Returns how many went."""
    outputs = {o.name for o in graph.output}
    fixed = outputs | {i.name for i in graph.input} | {t.name for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    in_subgraphs = set().union(*(names_read(n) - set(n.input) for n in graph.node))
    renamed: dict[str, str] = {}
    for node in graph.node:
        if node.op_type == "Identity" and node.domain in ("", "ai.onnx") and node.output[0] in outputs:
            x = node.input[0]
            if x not in fixed and x not in in_subgraphs and x in producers and x not in renamed:
                renamed[x] = node.output[0]
    if not renamed:
        return 0
    kept = []
    for node in graph.node:
        if node.op_type == "Identity" and renamed.get(node.input[0]) == node.output[0]:
            continue
        for i, name in enumerate(node.input):
            node.input[i] = renamed.get(name, name)
        for i, name in enumerate(node.output):
            node.output[i] = renamed.get(name, name)
        kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    info = [v for v in graph.value_info if v.name not in renamed]
    del graph.value_info[:]
    graph.value_info.extend(info)
    return len(renamed)
