"""Float32 matmuls with constant weights onto tandem's kernel (plugins/cpu/matmul_f32.cc), in the
saved optimized graphs of ONNX Runtime's CPU provider (engines/backends/onnxruntime_kernel_files.py):

    MatMul(A, W), W a float32 [K, N] initializer   -> ai.tandem.cpu::MatMul(A, weight_panels(W), N)
    MatMul(RMSNormalization(X, s), W)              -> ai.tandem.cpu::MatMul(X, weight_panels(diag(s) W),
        where every reader of the norm is such a      N, rms_norm=1, epsilon)
        MatMul
    Add(R, ai.tandem.cpu::MatMul(...)), the        -> ai.tandem.cpu::MatMul(..., residual=R)
        matmul's only reader
    Mul(QuickGelu(g), u), [g, u] = Split(MatMul(A, W))  -> ai.tandem.cpu::MatMul(A, swiglu_panels(W),
        (the MLP's gate: QuickGelu with alpha 1 is         N=N/2, swiglu=1)
        silu)
    MatMul(Reshape(Mul(RMSNormalization(X, s),     -> ai.tandem.cpu::MatMul(X, ..., norm_scale=s, gate=Z,
        QuickGelu(Z))), W) (Gated DeltaNet's           norm_group=len(s))  (and the same for
        gated norm before out_proj)                     tandem's MatMulNBits)
    Split(MatMul(A, W), widths, axis=-1), the      -> ai.tandem.cpu::MatMul(A, ..., split=widths) with the
        matmul's only reader (fused projections),     Split's outputs, as heads where a Reshape to heads
        and Reshapes of its outputs to heads          read one (and the same for MatMulNBits)

Why: ONNX Runtime's MatMul packs its own copy of each weight per session at load; the panels are
written once into optimized.bin and every session maps them. The norm before a projection, the
residual Add after it and the MLP's gate become part of the matmul node: two to four nodes fewer
per sub-layer, and no normalized [..., K] or product [..., N] tensor written and read back.

bfloat16 panels (`bf16`: `--weights bf16` builds, whose linear weights the export rounded to
bfloat16 values): the same panels as bfloat16 bit patterns, half the bytes; the kernel widens each
weight exactly, so its products are the float32 panels' bit for bit. A norm's scale is not folded
into them (diag(s) W is not bfloat16): the node takes it as input 3 and scales A's columns.

Numerics: the folded scale and the row scale applied after the product round differently from the
RMSNormalization they replace, and the kernel's silu (its own exp) from ONNX Runtime's QuickGelu
(within the build verification's tolerance; the residual add is the same single rounding). Every
row runs the same code whatever the call's rows, so verify rows still equal decode steps bit for
bit.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import helper, numpy_helper

from tandem.export.cpu_kernel_lowering import CPU_DOMAIN, import_cpu_domain, names_read

PANEL = 16   # columns per panel of ai.tandem.cpu::MatMul's B
_ONNX = ("", "ai.onnx")
_NORMS = {("RMSNormalization", ""), ("RMSNormalization", "ai.onnx"), ("SimplifiedLayerNormalization", ""),
          ("SimplifiedLayerNormalization", "com.microsoft")}


def weight_panels(w: np.ndarray) -> np.ndarray:
    """W [K, N] as ai.tandem.cpu::MatMul's B: [ceil(N / 16), K, 16], panel p holding columns
    16p..16p+15 row after row (columns past N zeros), so each panel is one contiguous stream."""
    k, n = w.shape
    padded = np.zeros((k, -(-n // PANEL) * PANEL), np.float32)
    padded[:, :n] = w
    return np.ascontiguousarray(padded.reshape(k, -1, PANEL).transpose(1, 0, 2))


def bf16_bits(panels: np.ndarray) -> np.ndarray:
    """float32 panels as bfloat16 bit patterns (uint16), rounded to nearest even: exact for the
    bfloat16-valued weights of a `--weights bf16` export."""
    return panels.astype(ml_dtypes.bfloat16).view(np.uint16)


def swiglu_panels(w: np.ndarray) -> np.ndarray:
    """The gate and up projections W = [gate | up] ([K, 2I]) as a swiglu node's B: their panels in
    turns, gate panel q then up panel q ([2 ceil(I / 16), K, 16])."""
    half = w.shape[1] // 2
    gate, up = weight_panels(w[:, :half]), weight_panels(w[:, half:])
    return np.stack([gate, up], axis=1).reshape(-1, *gate.shape[1:])


def lower_matmul_to_kernel(model: onnx.ModelProto, tensors, bf16: bool = False) -> bool:
    """Rewrite `model` in place as the module says. `tensors` is the saved graph's tensor store
    (array(tensor) -> ndarray; add(name, array) -> TensorProto, written once). Weights and norms
    nothing reads any more leave the graph. Returns whether any node was rewritten. bf16: the
    panels as bfloat16 (the norms' scales as inputs, not folded)."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    readers = _readers(graph)
    producers = {o: n for n in graph.node for o in n.output}
    # norm output -> its scale, for the norms that fold (names, not wrappers: protobuf's Python
    # objects for the same node are not the same object twice)
    norms = {n.output[0]: s for n in graph.node if (s := _foldable_norm(n, inits, readers, outputs)) is not None}
    lowered, gated = [], set()                             # gated: (op, output) of the nodes swiglu took
    for node in graph.node:
        w = _constant_weight(node, inits)
        if w is None:
            continue
        scale = norms.get(node.input[0])
        norm = producers.get(node.input[0])
        gate = _swiglu_gate(node, int(w.dims[1]), inits, readers, outputs)
        folds = scale is not None and not bf16
        name = f"{w.name}/{'swiglu_' if gate else ''}panels" + (f"*{scale.name}" if folds else "") + \
            (".bf16" if bf16 else "")
        if name not in inits:
            weight = tensors.array(w)
            if folds:
                weight = tensors.array(scale).astype(np.float32)[:, None] * weight
            panels = swiglu_panels(weight) if gate else weight_panels(weight)
            inits[name] = tensors.add(name, bf16_bits(panels) if bf16 else panels)
            graph.initializer.append(inits[name])
        node.input[1] = name
        node.domain = CPU_DOMAIN
        node.attribute.extend([helper.make_attribute("N", int(w.dims[1]) // (2 if gate else 1))])
        if bf16:
            node.attribute.extend([helper.make_attribute("bf16", 1)])
        if gate:
            node.output[0] = gate[-1].output[0]            # the Mul's: Split, QuickGelu and Mul go
            node.attribute.extend([helper.make_attribute("swiglu", 1)])
            gated.update((g.op_type, g.output[0]) for g in gate)
        if scale is not None:
            node.input[0] = norm.input[0]
            if not folds:              # the scale multiplies A's columns in the kernel (input 3)
                node.input.extend([""] * (4 - len(node.input)))
                node.input[3] = scale.name
            node.attribute.extend([helper.make_attribute("rms_norm", 1),
                                   helper.make_attribute("epsilon", _attr(norm, "epsilon", 1e-5))])
        lowered.append(w.name)
    gated |= _gate_into_nbits(graph, inits, outputs)
    kept = [n for n in graph.node if (n.op_type, n.output[0]) not in gated]
    del graph.node[:]
    graph.node.extend(kept)
    folded = _fold_norms_into_nbits(graph, inits, outputs)
    folded = _fold_gated_norms(graph, inits, outputs) or folded
    fused = _fuse_residual_adds(graph, inits, outputs)
    fused = _fuse_column_splits(graph, tensors, outputs) or fused
    if not (lowered or gated or folded or fused):
        return False
    while True:                    # chains left unread (Reshape <- Mul <- norm, QuickGelu): until none
        read = outputs.union(*(names_read(n) for n in graph.node))
        dead = [n for n in graph.node if ((n.op_type, n.domain) in _NORMS or n.op_type in _GATE_NODES)
                and not read & set(n.output)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    read = outputs.union(*(names_read(n) for n in graph.node))
    for tensor in [t for t in graph.initializer if t.name not in read]:
        graph.initializer.remove(tensor)
    import_cpu_domain(model)
    return True


def _constant_weight(node: onnx.NodeProto, inits: dict) -> onnx.TensorProto | None:
    """B of a MatMul whose B is a float32 [K, N] initializer; else None."""
    if node.op_type != "MatMul" or node.domain not in _ONNX:
        return None
    w = inits.get(node.input[1])
    ok = w is not None and w.data_type == onnx.TensorProto.FLOAT and len(w.dims) == 2 and 0 not in w.dims
    return w if ok else None


def _foldable_norm(node: onnx.NodeProto, inits: dict, readers: dict, outputs: set,
                   nbits: bool = False) -> onnx.TensorProto | None:
    """The scale of an RMS norm over the last axis that only such MatMuls read (their K its length,
    its output no graph output; `nbits`: tandem's MatMulNBits nodes instead); else None."""
    if (node.op_type, node.domain) not in _NORMS or _attr(node, "axis", -1) != -1 or len(node.input) != 2:
        return None
    if any(o for o in node.output[1:]) or node.output[0] in outputs:
        return None
    scale = inits.get(node.input[1])
    if scale is None or scale.data_type != onnx.TensorProto.FLOAT or len(scale.dims) != 1:
        return None
    users = readers.get(node.output[0], [])
    ks = [_nbits_k(u) if nbits else (w.dims[0] if (w := _constant_weight(u, inits)) is not None else None)
          for u in users]
    if not users or any(k != scale.dims[0] or u.input[0] != node.output[0] for u, k in zip(users, ks)):
        return None
    return scale


def _nbits_k(node: onnx.NodeProto) -> int | None:
    """K of one of tandem's MatMulNBits nodes with no norm folded in yet; else None."""
    if (node.domain, node.op_type) != (CPU_DOMAIN, "MatMulNBits") or _attr(node, "rms_norm", 0):
        return None
    return _attr(node, "K", None)


def _gate_into_nbits(graph: onnx.GraphProto, inits: dict, outputs: set) -> set:
    """tandem's MatMulNBits nodes whose product is the MLP's gate and up take the gate (swiglu=1,
    their output the Mul's); returns (op, output) of the Split, QuickGelu and Mul nodes they took."""
    readers, taken = _readers(graph), set()
    for node in graph.node:
        if (node.domain, node.op_type) != (CPU_DOMAIN, "MatMulNBits") or _attr(node, "swiglu", 0):
            continue
        gate = _swiglu_gate(node, _attr(node, "N", 0), inits, readers, outputs)
        if gate is None:
            continue
        node.output[0] = gate[-1].output[0]
        node.attribute.extend([helper.make_attribute("swiglu", 1)])
        taken.update((g.op_type, g.output[0]) for g in gate)
    return taken


_GATE_NODES = {"QuickGelu", "Mul", "Reshape"}    # what a folded gated norm leaves unread
_NORM_INPUTS = {"MatMul": (3, 4), "MatMulNBits": (5, 6)}   # where each kernel takes norm_scale and gate


def _fold_gated_norms(graph: onnx.GraphProto, inits: dict, outputs: set) -> bool:
    """Each of tandem's matmul nodes with no norm of its own whose A is Reshape(Mul(RMSNormalization(X,
    s), QuickGelu(Z))) (alpha 1: silu), each of those read by the next one only, takes X, s and Z
    (norm_group = len(s), dividing its K; Z before a Reshape only QuickGelu reads); the four (five)
    nodes are left unread."""
    readers, producers = _readers(graph), {o: n for n in graph.node for o in n.output}
    done = False
    for node in graph.node:
        at = _NORM_INPUTS.get(node.op_type) if node.domain == CPU_DOMAIN else None
        if at is None or _attr(node, "rms_norm", 0) or _attr(node, "norm_group", 0):
            continue
        reshape = producers.get(node.input[0])
        if reshape is None or reshape.op_type != "Reshape" or _only_reader(reshape.output[0], readers, outputs) is None:
            continue
        mul = producers.get(reshape.input[0])
        if mul is None or mul.op_type != "Mul" or _only_reader(mul.output[0], readers, outputs) is None:
            continue
        parts = {producers[i].op_type: producers[i] for i in mul.input if i in producers}
        norm, act = next((p for p in parts.values() if (p.op_type, p.domain) in _NORMS), None), parts.get("QuickGelu")
        if norm is None or act is None or act.domain != "com.microsoft" or _attr(act, "alpha", 1.702) != 1.0:
            continue
        if any(_only_reader(n.output[0], readers, outputs) is None for n in (norm, act)):
            continue
        scale = inits.get(norm.input[1]) if len(norm.input) == 2 else None
        k = _attr(node, "K", None) if node.op_type == "MatMulNBits" else inits[node.input[1]].dims[1]
        if scale is None or len(scale.dims) != 1 or _attr(norm, "axis", -1) != -1 or k % scale.dims[0]:
            continue
        gate = act.input[0]
        shaped = producers.get(gate)
        if shaped is not None and shaped.op_type == "Reshape" and _only_reader(gate, readers, outputs) is not None:
            gate = shaped.input[0]      # the kernel reads the gate element by element: its shape is moot
        node.input[0] = norm.input[0]
        node.input.extend([""] * (at[1] + 1 - len(node.input)))
        node.input[at[0]], node.input[at[1]] = scale.name, gate
        node.attribute.extend([helper.make_attribute("norm_group", int(scale.dims[0])),
                               helper.make_attribute("epsilon", _attr(norm, "epsilon", 1e-5))])
        done = True
    return done


def _fold_norms_into_nbits(graph: onnx.GraphProto, inits: dict, outputs: set) -> bool:
    """An RMS norm only tandem's MatMulNBits nodes read goes into them (input 5 its scale, rms_norm,
    epsilon): their weights are quantized, so the scale is applied to the rows, not folded."""
    readers = _readers(graph)
    done = False
    for norm in graph.node:
        scale = _foldable_norm(norm, inits, readers, outputs, nbits=True)
        if scale is None:
            continue
        for user in readers[norm.output[0]]:
            user.input[0] = norm.input[0]
            user.input.extend([""] * (6 - len(user.input)))
            user.input[5] = scale.name
            user.attribute.extend([helper.make_attribute("rms_norm", 1),
                                   helper.make_attribute("epsilon", _attr(norm, "epsilon", 1e-5))])
        done = True
    return done


def _swiglu_gate(node: onnx.NodeProto, n: int, inits: dict, readers: dict, outputs: set) -> tuple | None:
    """(Split, QuickGelu, Mul) where the product [..., n] is only split into halves g | u, g only
    goes through QuickGelu with alpha 1 (silu) and the two meet in one Mul; else None."""
    product = node.output[0]
    split = _only_reader(product, readers, outputs)
    if split is None or split.op_type != "Split" or split.domain not in _ONNX or n % 2:
        return None
    sizes = inits.get(split.input[1]) if len(split.input) > 1 else None
    halves = sizes is not None and list(numpy_helper.to_array(sizes)) == [n // 2, n // 2]
    if _attr(split, "axis", 0) != -1 or len(split.output) != 2 or not halves:
        return None
    act, mul = _only_reader(split.output[0], readers, outputs), _only_reader(split.output[1], readers, outputs)
    if act is None or (act.op_type, act.domain) != ("QuickGelu", "com.microsoft") or _attr(act, "alpha", 1.702) != 1.0:
        return None
    if mul is None or (mul.op_type, mul.domain) not in (("Mul", ""), ("Mul", "ai.onnx")):
        return None
    after = _only_reader(act.output[0], readers, outputs)
    if after is None or after.output[0] != mul.output[0] or sorted(mul.input) != sorted([act.output[0],
                                                                                         split.output[1]]):
        return None
    return split, act, mul


def _only_reader(name: str, readers: dict, outputs: set) -> onnx.NodeProto | None:
    users = readers.get(name, [])
    return users[0] if len(users) == 1 and name not in outputs else None


_RESIDUAL_INPUT = {"MatMul": 2, "MatMulNBits": 4}    # where each of tandem's matmuls takes its residual


def _fuse_residual_adds(graph: onnx.GraphProto, inits: dict, outputs: set) -> bool:
    """Each of tandem's matmul nodes whose product only an Add reads, with a computed tensor (not a
    constant bias) as its other term, takes that term as its residual and the Add's output; the
    fused node goes where the Add was (its residual may be computed after the matmul's own place)."""
    readers = _readers(graph)
    fused = {}                                            # the Add's output -> the matmul taking its place
    for node in graph.node:
        at = _RESIDUAL_INPUT.get(node.op_type) if node.domain == CPU_DOMAIN else None
        if at is None or (len(node.input) > at and node.input[at]) or _attr(node, "swiglu", 0):
            continue
        product, users = node.output[0], readers.get(node.output[0], [])
        if product in outputs or len(users) != 1:
            continue
        add = users[0]
        if add.op_type != "Add" or add.domain not in _ONNX or list(add.input).count(product) != 1:
            continue
        other = add.input[1] if add.input[0] == product else add.input[0]
        if other in inits or add.output[0] in fused:
            continue
        node.input.extend([""] * (at + 1 - len(node.input)))
        node.input[at] = other
        node.output[0] = add.output[0]
        fused[add.output[0]] = node
    if not fused:
        return False
    order = []
    for node in graph.node:        # the matmul leaves its place and takes its Add's
        if node.output[0] not in fused:
            order.append(node)
        elif node.op_type == "Add":
            order.append(fused[node.output[0]])
    del graph.node[:]
    graph.node.extend(order)
    return True


_SPLIT_INPUT = {"MatMul": 5, "MatMulNBits": 7}     # where each of tandem's matmuls takes its column split


def _fuse_column_splits(graph: onnx.GraphProto, tensors, outputs: set) -> bool:
    """Each of tandem's matmul nodes with no residual and no swiglu whose product only a Split of its
    last axis into at most 4 constant widths reads (linears' fused projections: Gated DeltaNet's
    in_proj, attention's qkv_proj) makes the Split's outputs itself: the widths go in as its
    `split` input, and the Split goes; so does a Reshape to heads [0, 0, h, d] that is an output's
    only reader (`split_heads`: that output comes out as [..., h, d])."""
    readers, inits = _readers(graph), {t.name: t for t in graph.initializer}
    taken = set()
    for node in graph.node:
        at = _SPLIT_INPUT.get(node.op_type) if node.domain == CPU_DOMAIN else None
        residual = _RESIDUAL_INPUT.get(node.op_type, 0)
        if at is None or _attr(node, "swiglu", 0) or (len(node.input) > residual and node.input[residual]):
            continue
        users = readers.get(node.output[0], [])
        split = users[0] if len(users) == 1 and node.output[0] not in outputs else None
        if split is None or split.op_type != "Split" or split.domain not in _ONNX or _attr(split, "axis", 0) != -1:
            continue
        given = inits.get(split.input[1]) if len(split.input) > 1 else None
        read = tensors.array if tensors is not None else numpy_helper.to_array    # (None: all inline)
        widths = read(given).reshape(-1).tolist() if given is not None else _attr(split, "split", None)
        if not widths or len(widths) != len(split.output) or len(widths) > 4 or sum(widths) != _attr(node, "N", 0):
            continue
        name = f"{node.name}/split_widths"
        graph.initializer.append(numpy_helper.from_array(np.array(widths, np.int64), name))
        node.input.extend([""] * (at + 1 - len(node.input)))
        node.input[at] = name
        outs, heads = list(split.output), [0] * len(widths)
        for i, out in enumerate(split.output):        # a Reshape to heads [0, 0, h, width / h] after an output
            reshape = _only_reader(out, readers, outputs)
            shape = read(inits[reshape.input[1]]) if reshape is not None and reshape.op_type == "Reshape" \
                and reshape.input[1] in inits else None
            if shape is not None and shape.tolist()[:2] == [0, 0] and len(shape) == 4 \
                    and shape[2] > 0 and shape[2] * shape[3] == widths[i]:
                outs[i], heads[i] = reshape.output[0], int(shape[2])
                taken.add(reshape.name or reshape.output[0])
        if any(heads):
            graph.initializer.append(numpy_helper.from_array(np.array(heads, np.int64), f"{node.name}/split_heads"))
            node.input.append(f"{node.name}/split_heads")
        del node.output[:]
        node.output.extend(outs)
        taken.add(split.name or split.output[0])
    if not taken:
        return False
    kept = [n for n in graph.node if not (n.op_type in ("Split", "Reshape") and (n.name or n.output[0]) in taken)]
    del graph.node[:]
    graph.node.extend(kept)
    return True


def _readers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """name -> the graph's nodes that read it (directly or in a subgraph of theirs)."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in names_read(node):
            readers.setdefault(name, []).append(node)
    return readers


def _attr(node: onnx.NodeProto, name: str, default):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)
