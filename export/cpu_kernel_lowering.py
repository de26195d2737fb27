"""Lower tandem's ops to its own ONNX Runtime CPU kernels (plugins/cpu/, compiled by
plugins/cpu_kernels.py), in the domain `ai.tandem.cpu`:

    ai.tandem::GatedDeltaNet                      -> ai.tandem.cpu::GatedDeltaNet   (below), or with
        the layer's conv, L2 norms and gates before it -> ai.tandem.cpu::ConvGatedDeltaNet (where they
        are the exporter's: export/cpu_prologues.py; 16 nodes fewer per layer)
    ai.tandem::PagedSparseAttention, dense, fp32  -> ai.tandem.cpu::PagedAttention, with the keys'
        NormRope and the RotaryTables (export/cpu_attention_lowering.py)
    com.microsoft::MatMulNBits, 4 / 8 bits, level 4 -> ai.tandem.cpu::MatMulNBits   (the same math,
        its weights in column tiles: export/nbits_tiles.py; in the saved optimized graph, after
        ONNX Runtime's optimizer made it from DequantizeLinear + MatMul: plugins/cpu/matmul_nbits.cc)
    MatMul(A, W) with W a float32 [K, N] constant  -> ai.tandem.cpu::MatMul (export/cpu_matmul_lowering.py)

    GatedDeltaNet(q, k, v, g, beta, Gather(pool, slots), rows)
        -> ai.tandem.cpu::GatedDeltaNet(q, k, v, g, beta, pool, slots, rows)

The kernel reads each sequence's state from its pool row: the Gather's 0.5 MiB copy per sequence
and layer (150M model) goes, and a final state bound to the pool's rows is updated where it lies.
Where the initial state is not such a Gather, the state tensor is its own pool over slots 0..B-1.

Verify graphs read the state after the accepted row a (GatherND(row_states, a) at the graph's end,
once acceptance is known): the GatherND becomes a second kernel node over the same rows with
state_rows min(rows, a + 1), whose final state is the state after row a. Rows past state_rows
leave the state as it is, so this equals the per-row state bit for bit, and no [B, W, Hv, dk, dv]
row states are made. Where row states are a graph's output, the kernel emits them.

Every row runs the same code whatever the graph's rows: a verify row equals a decode step bit for
bit (both kernels). The kernels serve the saved optimized graphs of the CPU provider only; the
lowered graphs (the CUDA provider's input, and the fallback) keep LinearAttention and the graph
lowering of attention (export/lowering.py, export/attention_lowering.py).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tandem.export.builder import MS_DOMAIN, TANDEM_DOMAIN, GraphBuilder
from tandem.export.cpu_prologues import GDN_OP, GraphIndex, match_conv_commit, match_prologue
from tandem.export.nbits_tiles import fits_half, tile_weights, untiled_inputs
from tandem.export.ops import gated_deltanet

CPU_DOMAIN = "ai.tandem.cpu"


def lower_gdn_to_kernel(model: onnx.ModelProto) -> int:
    """Rewrite `model`'s GatedDeltaNet nodes in place; returns how many. Where the layer's conv,
    norms and gates are the exporter's (export/cpu_prologues.py) the node takes them too, as
    ConvGatedDeltaNet. Drops the nodes it makes dead (state Gathers, row-state GatherNDs, prologues)."""
    graph = model.graph
    index = GraphIndex(graph)
    picks = gated_deltanet.row_state_picks(graph)
    outputs = {o.name for o in graph.output}
    read = outputs.union(*(names_read(n) for n in graph.node))      # every name read, subgraphs included
    nodes, lowered, replays, made = [], 0, {}, set()
    for node in graph.node:
        if node.domain == TANDEM_DOMAIN and node.op_type == gated_deltanet.OP_TYPE:
            new, replay, taken = _kernel_nodes(node, index, picks, read)
            nodes.extend(new)
            made |= taken
            if replay is not None:
                replays[node.output[2]] = replay
            lowered += 1
        elif node.op_type == "GatherND" and node.input[0] in replays:
            nodes.extend(replays[node.input[0]](node))
        else:
            nodes.append(node)
    # what a fused node makes itself (the conv window, the new conv state): the Concat, GatherND that did go
    set_nodes(graph, [n for n in nodes if n.domain == CPU_DOMAIN or not made & set(n.output)])
    if lowered:
        import_cpu_domain(model)
    return lowered


def lower_matmul_nbits_to_kernel(model: onnx.ModelProto, tensors=None) -> bool:
    """Rewrite in place the 4-bit and 8-bit MatMulNBits of an optimized graph that compute with int8
    activations (accuracy level 4) and whose blocks the kernel reads (a power of two >= 32 inputs,
    float32 scales that float16 holds, no g_idx or bias); returns whether any was. Their weights, scales and zero
    points become the kernel's column tiles (export/nbits_tiles.py), written with `tensors`
    (array(tensor) -> ndarray; add(name, array) -> TensorProto: the saved graph's tensor store;
    None: inside the graph). 8-bit nodes moved once the norm, residual and gate fusions came with
    the kernel (150M int8 plain decode 1.13x against the nodes left to MLAS)."""
    tensors = tensors or _InlineTensors()
    inits = {t.name: t for t in model.graph.initializer}
    tiled: dict[str, tuple[str, str, str]] = {}           # (B, scales, zeros) -> the tiles' names
    for node in model.graph.node:
        if node.domain != MS_DOMAIN or node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        block = attrs.get("block_size", 0)
        weights = list(node.input[1:4]) + [""] * (4 - len(node.input))
        if not (attrs.get("bits") in (4, 8) and attrs.get("accuracy_level") == 4 and len(node.input) <= 4
                and block >= 32 and not block & (block - 1) and attrs["K"] % block == 0
                and all(w in inits for w in weights if w)
                and inits[weights[1]].data_type == onnx.TensorProto.FLOAT):
            continue
        key = "|".join(weights)
        if key not in tiled:
            arrays = [tensors.array(inits[w]) if w else None for w in weights]
            if not fits_half(arrays[1]):       # not from tandem's quantizer: ONNX Runtime's node stays
                continue
            made = tile_weights(*arrays, attrs["N"], attrs["K"], attrs["bits"], block)
            tiled[key] = tuple(f"{w}/tiles" if w else "" for w in weights)
            for name, array in zip(tiled[key], made):
                if name and name not in inits:
                    inits[name] = tensors.add(name, array)
                    model.graph.initializer.append(inits[name])
        inputs = [node.input[0], *(w for w in tiled[key] if w)]
        del node.input[:]
        node.input.extend(inputs)
        kept = [a for a in node.attribute if a.name in ("K", "N", "bits", "block_size")]
        del node.attribute[:]
        node.attribute.extend(kept)
        node.domain = CPU_DOMAIN
    if not tiled:
        return False
    read = {o.name for o in model.graph.output}.union(*(names_read(n) for n in model.graph.node))
    for tensor in [t for t in model.graph.initializer if t.name not in read]:
        model.graph.initializer.remove(tensor)          # ONNX Runtime's layout, where no node reads it
    import_cpu_domain(model)
    return True


class _InlineTensors:
    """The tensor store of a graph whose initializers are inside it."""

    @staticmethod
    def array(tensor: onnx.TensorProto) -> np.ndarray:
        return numpy_helper.to_array(tensor)

    @staticmethod
    def add(name: str, array: np.ndarray) -> onnx.TensorProto:
        return numpy_helper.from_array(array, name)


def exact_matmul_nbits(model: onnx.ModelProto) -> None:
    """The inverse for the build's verification: every MatMulNBits (ONNX Runtime's or the kernel's)
    as ONNX Runtime's at accuracy level 0, dequantized weights in float32; a norm, a residual, the
    MLP's gate or a column split fused into tandem's (export/cpu_matmul_lowering.py) back as
    RMSNormalization before it, Add after it, Split -> QuickGelu -> Mul after it, or Split."""
    nodes = []
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    norm_op = "RMSNormalization" if opset >= 23 else "SimplifiedLayerNormalization"   # (ONNX Runtime's, before 23)
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or node.domain not in (MS_DOMAIN, CPU_DOMAIN):
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.domain == CPU_DOMAIN:          # the weights back in ONNX Runtime's layout
            nodes += untiled_inputs(model, node, attrs)
        inputs, output = list(node.input) + [""] * (9 - len(node.input)), node.output[0]
        if inputs[7]:                          # a column split: the whole product, then a Split node
            split_outputs, output = list(node.output), f"{node.name}/exact_whole"
            del node.output[:]
            node.output.append(output)
            heads = _constant(model, inputs[8]) if inputs[8] else [0] * len(split_outputs)
        if attrs.get("norm_group"):
            nodes += _gated_norm_nodes(model, node.name, inputs[0], inputs[5], inputs[6], attrs, norm_op)
            inputs[0] = f"{node.name}/exact_gated_norm"
        if attrs.get("rms_norm"):
            normed = f"{output}/exact_norm"
            nodes.append(helper.make_node(norm_op, [inputs[0], inputs[5]], [normed], axis=-1,
                                          epsilon=attrs["epsilon"], name=f"{node.name}/exact_norm"))
            inputs[0] = normed
        residual = inputs[4]
        fused = ("accuracy_level", "rms_norm", "norm_group", "epsilon", "swiglu")
        kept = [a for a in node.attribute if a.name not in fused]
        del node.attribute[:], node.input[:]
        node.input.extend(inputs[:4] if inputs[3] else inputs[:3])
        node.attribute.extend([*kept, helper.make_attribute("accuracy_level", 0)])
        node.domain = MS_DOMAIN
        nodes.append(node)
        if residual:
            node.output[0] = f"{output}/exact_product"
            nodes.append(helper.make_node("Add", [node.output[0], residual], [output], name=f"{node.name}/exact_add"))
        if inputs[7]:                          # and Reshapes of its outputs to heads [0, 0, h, width / h]
            parts = [f"{o}/exact_part" if h else o for o, h in zip(split_outputs, heads)]
            nodes.append(helper.make_node("Split", [output, inputs[7]], parts, axis=-1,
                                          name=f"{node.name}/exact_split"))
            widths = _constant(model, inputs[7])
            for part, out, h, width in zip(parts, split_outputs, heads, widths):
                if h:
                    shape = f"{out}/exact_heads"
                    model.graph.initializer.append(numpy_helper.from_array(np.array([0, 0, h, width // h], np.int64),
                                                                           shape))
                    nodes.append(helper.make_node("Reshape", [part, shape], [out], name=f"{out}/exact_reshape"))
        if attrs.get("swiglu"):
            product, halves = f"{output}/exact_product", f"{output}/exact_halves"
            node.output[0] = product
            model.graph.initializer.append(numpy_helper.from_array(np.array([attrs["N"] // 2] * 2, np.int64), halves))
            nodes += [helper.make_node("Split", [product, halves], [f"{product}/gate", f"{product}/up"], axis=-1),
                      helper.make_node("QuickGelu", [f"{product}/gate"], [f"{product}/silu"], domain=MS_DOMAIN,
                                       alpha=1.0),
                      helper.make_node("Mul", [f"{product}/silu", f"{product}/up"], [output])]
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _constant(model: onnx.ModelProto, name: str) -> list[int]:
    """An inline int64 initializer's values."""
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name)).reshape(-1).tolist()


def _gated_norm_nodes(model: onnx.ModelProto, name: str, x: str, scale: str, gate: str, attrs: dict,
                      norm_op: str) -> list[onnx.NodeProto]:
    """Reshape(Mul(norm(x, scale), QuickGelu(gate)), [..., K]) as nodes: a folded gated norm, back
    (x [..., K / G, G]: its dims but the last two, then K)."""
    b = GraphBuilder(function=True, root=f"{name}/exact")
    normed = b.op(norm_op, x, scale, axis=-1, epsilon=attrs["epsilon"])
    gate = b.op("Reshape", gate, b.op("Shape", x))              # the gate may come in another shape
    gated = b.op("Mul", normed, b.op("QuickGelu", gate, domain=MS_DOMAIN, alpha=1.0))
    lead = b.op("Slice", b.op("Shape", x), b.const([0], np.int64), b.const([-2], np.int64))
    shape = b.op("Concat", lead, b.const([attrs["K"]], np.int64), axis=0)
    b.op("Reshape", gated, shape, outputs=[f"{name}/exact_gated_norm"])
    return b.nodes


def _kernel_nodes(node: onnx.NodeProto, index: GraphIndex, picks: set[str], read: set[str]):
    """(nodes replacing `node`, replay(gather) -> nodes for its row-state picks or None, the names
    other nodes made that a fused node now makes: its conv window, its new conv state)."""
    q, k, v, g, beta, s0, rows = node.input
    scale = next(a.f for a in node.attribute if a.name == "scale")
    b = GraphBuilder(function=True, root=node.name + "/kernel")
    gather = index.producers.get(s0)
    axis = next((a.i for a in gather.attribute if a.name == "axis"), 0) if gather is not None else None
    prologue = None
    if gather is not None and gather.op_type == "Gather" and axis == 0:
        pool, slots = gather.input
        prologue = match_prologue(index, node, slots)
    else:  # the state tensor is its own pool: slots 0..B-1
        pool = s0
        slots = b.op("Range", b.const(0, np.int64), b.squeeze(b.shape_of(s0, 0, 1), [0]), b.const(1, np.int64))
    if prologue is not None and prologue.padded in read:      # the graph picks its new conv state there
        prologue = prologue if _read_only_after(node, prologue.padded, index) else None
    emits = len(node.output) == 3 and node.output[2] != ""
    picked = emits and node.output[2] in picks
    # a final state nothing reads (a verify's, whose picks replay the rows) stays in the kernel's scratch
    final = node.output[1] if node.output[1] in read else ""
    kernel_outputs = [node.output[0], final] + ([node.output[2]] if emits and not picked else [])
    made, commit = set(), None
    if prologue is not None:
        # where the rows a sequence keeps are known before the layer (decode, prefill), the node
        # picks the new conv state itself and the window is not written out unless another node reads it
        commit = match_conv_commit(index, prologue.padded, node)
        window = prologue.padded if _window_read(prologue.padded, index, commit) else ""
        kernel_outputs += [""] * (3 - len(kernel_outputs)) + [window] + ([commit[1]] if commit else [])
        made = {window, commit[1] if commit else ""} - {""}

    def kernel(builder, state_rows, outs, name, conv_rows=(), **attrs):
        if prologue is None:
            return builder.op(gated_deltanet.OP_TYPE, q, k, v, g, beta, pool, slots, state_rows, domain=CPU_DOMAIN,
                              outputs=outs, name=name, scale=scale, **attrs)
        return builder.op(GDN_OP, *prologue.inputs, pool, slots, state_rows, *conv_rows, domain=CPU_DOMAIN,
                          outputs=outs, name="Conv" + name, scale=scale, norm_epsilon=prologue.norm_epsilon,
                          norm_scale=prologue.norm_scale, **attrs)

    kernel(b, rows, kernel_outputs, "GatedDeltaNet", conv_rows=(commit[0],) if commit else ())
    if not picked:
        return b.nodes, None, made

    def replay(pick: onnx.NodeProto) -> list[onnx.NodeProto]:
        r = GraphBuilder(function=True, root=pick.name + "/replayed")
        upto = r.op("Add", r.squeeze(pick.input[1], [1]), r.const(1, np.int64))      # rows 0..a: a + 1 of them
        kernel(r, r.op("Min", rows, upto), [pick.output[0] + "/unused_output", pick.output[0]], "GatedDeltaNet",
               emit_output=0)                 # the state only: rows past a are not run
        return r.nodes

    return b.nodes, replay, made


def _window_read(padded: str, index: GraphIndex, commit: tuple[str, str] | None) -> bool:
    """Whether a node other than the prologue's window Gather and the fused pick reads `padded`, or
    it is a graph output."""
    return padded in index.outputs or any(
        not (n.op_type == "Gather" and n.input[0] == padded) and (commit is None or commit[1] not in n.output)
        for n in index.readers.get(padded, ()))


def _read_only_after(node: onnx.NodeProto, name: str, index: GraphIndex) -> bool:
    """Whether every node that reads `name`, but a prologue's window Gather, is `node` or comes after
    it in the graph's order: the fused `node` makes `name` at its place."""
    order = index.order
    return all(order[id(n)] >= order[id(node)] for n in index.readers.get(name, ())
               if not (n.op_type == "Gather" and n.input[0] == name))


def set_nodes(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    """The graph's nodes become `nodes`, less those whose outputs nothing reads (without_unread)."""
    kept = without_unread(nodes, {o.name for o in graph.output})
    del graph.node[:]
    graph.node.extend(kept)


def without_unread(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """`nodes` less those whose outputs nothing reads, in this graph or a subgraph of it, until none
    is left: the initial states the kernel now reads from their pools, the prologues it took."""
    while True:
        read = set(outputs)
        for node in nodes:
            read.update(names_read(node))
        kept = [n for n in nodes if read & set(n.output)]
        if len(kept) == len(nodes):
            return nodes
        nodes = kept


def import_cpu_domain(model: onnx.ModelProto) -> None:
    """The model imports the domain of tandem's CPU kernels (once)."""
    if not any(o.domain == CPU_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(CPU_DOMAIN, 1))


def names_read(node: onnx.NodeProto) -> set[str]:
    """The names a node reads: its inputs and those its subgraphs (If, Loop, Scan bodies) read."""
    names = set(node.input)
    for attr in node.attribute:
        for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
            for inner in g.node:
                names.update(names_read(inner))
    return names
