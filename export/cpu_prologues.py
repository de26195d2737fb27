"""Find the nodes around an op that tandem's CPU kernels take into the op itself, so that the CPU
lowering (export/cpu_kernel_lowering.py) runs them in one node: each matcher checks the exporter's
graph node by node (float32 throughout: a float16 engine's Casts do not match) and returns what the
kernel takes in their place, or None, and the op keeps its plain kernel.

Gated DeltaNet (`match_prologue` -> ai.tandem.cpu::ConvGatedDeltaNet, plugins/cpu/conv_gated_deltanet.cc),
as export/layers.py's gated_deltanet_layer writes it:

    padded = Concat(Gather(conv_pool, slots), qkv, axis=1)                        [B, K-1+W, C]
    mixed  = silu(ReduceSum(Mul(Gather(padded, windows, axis=1), taps), [2]))     [B, W, C]
    q, k   = RMSNormalization(Reshape(Slice(mixed, ...)), s) (the L2 norm), v = Reshape(Slice(mixed))
    g      = Mul(neg_a, Softplus(Add(a, dt_bias)));  beta = Sigmoid(b)
    GatedDeltaNet(q, k, v, g, beta, Gather(state_pool, slots), rows)

Attention (`match_attention` -> ai.tandem.cpu::PagedAttention's optional inputs,
plugins/cpu/paged_attention.cc), as export/layers.py's attention writes it:

    q = Add(Mul(x, cos), Mul(Gather(x, perm, axis=3), sin)),  x = RMSNormalization(q_raw, q_norm)
        (the norm optional, RoPE not)
    out = Mul(Reshape(PagedSparseAttention(q, k, ...)), Sigmoid(gate))    (the output gate, optional)
    The keys' norm and RoPE stay nodes: the graph commits the keys, and a unified round's re-anchored
    MTP heads make them without attention, so the same nodes must make them in every graph.

Keys (`match_norm_rope` -> ai.tandem.cpu::NormRope, plugins/cpu/norm_rope.cc): the same norm and
RoPE wherever a graph makes keys, attention or not (a unified round's re-anchored heads).

Every graph of an engine dir is exported by the same code, so a pattern fuses in all of them or in
none: a verify row and a decode step then run the same kernel (speculative == plain greedy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

GDN_OP = "ConvGatedDeltaNet"


@dataclass(frozen=True)
class Prologue:
    inputs: list[str]       # qkv, beta_logits, decay_logits, conv_pool, conv_taps, neg_a, dt_bias
    padded: str             # the Concat's output: the window the graph picks the new conv state from
    norm_epsilon: float
    norm_scale: float


class GraphIndex:
    """Producers, readers, order, small constants and float32 weights of one graph's nodes."""

    def __init__(self, graph: onnx.GraphProto):
        self.producers = {o: n for n in graph.node for o in n.output}
        self.inits = {t.name: t for t in graph.initializer}
        self.order = {id(n): i for i, n in enumerate(graph.node)}
        self.outputs = {o.name for o in graph.output}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        for n in graph.node:
            for name in n.input:
                self.readers.setdefault(name, []).append(n)

    def node(self, name: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producers.get(name)
        return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None

    def value(self, name: str) -> np.ndarray | None:
        """An inline constant's value (initializer or Constant node); None for anything else."""
        t = self.inits.get(name)
        if t is None:
            node = self.node(name, "Constant")
            t = next((a.t for a in node.attribute if a.name == "value"), None) if node is not None else None
        if t is None or t.data_location == onnx.TensorProto.EXTERNAL:
            return None
        return numpy_helper.to_array(t)

    def f32_weight(self, name: str, rank: int) -> bool:
        t = self.inits.get(name)
        return t is not None and t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == rank


def _attr(node: onnx.NodeProto, name: str, default=None):
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _slice_of(g: GraphIndex, name: str) -> tuple[str, int, int] | None:
    """Reshape(Slice(x, [start], [end], [axis 2 or -1])) -> (x, start, end)."""
    reshape = g.node(name, "Reshape")
    return _slice(g, reshape.input[0], (2, -1)) if reshape is not None else None


def _slice(g: GraphIndex, name: str, axes: tuple[int, ...]) -> tuple[str, int, int] | None:
    """Slice(x, [start], [end], [axis], [1]) along one of `axes` -> (x, start, end)."""
    cut = g.node(name, "Slice")
    if cut is None or len(cut.input) not in (4, 5):
        return None
    starts, ends, axis = (g.value(n) for n in cut.input[1:4])
    steps = g.value(cut.input[4]) if len(cut.input) == 5 else np.ones(1)
    if any(v is None or v.size != 1 for v in (starts, ends, axis, steps)) or int(axis.reshape(-1)[0]) not in axes \
            or int(steps.reshape(-1)[0]) != 1:
        return None
    return cut.input[0], int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])


def _l2_norm(g: GraphIndex, name: str) -> tuple[str, int, int, float, float] | None:
    """RMSNormalization(slice, uniform scale s, last axis) -> (x, start, end, epsilon, s)."""
    norm = g.node(name, "RMSNormalization")
    if norm is None or _attr(norm, "axis", -1) != -1:
        return None
    scale, cut = g.value(norm.input[1]), _slice_of(g, norm.input[0])
    if scale is None or cut is None or scale.size == 0 or not np.all(scale == scale.flat[0]):
        return None
    return (*cut, float(_attr(norm, "epsilon", 1e-5)), float(scale.flat[0]))


def _binary(g: GraphIndex, name: str, op_type: str, weight_rank: int) -> tuple[str, str] | None:
    """op(x, w) or op(w, x) with w a float32 weight of that rank -> (x, w)."""
    node = g.node(name, op_type)
    if node is None:
        return None
    a, b = node.input
    if g.f32_weight(b, weight_rank):
        return a, b
    return (b, a) if g.f32_weight(a, weight_rank) else None


def _conv(g: GraphIndex, mixed: str, slots: str) -> tuple[str, str, str, str] | None:
    """silu(ReduceSum(Mul(Gather(Concat(Gather(pool, slots), qkv), windows), taps), [2]))
    -> (qkv, conv_pool, taps, padded)."""
    mul = g.node(mixed, "Mul")
    if mul is None:
        return None
    sig = g.node(mul.input[1], "Sigmoid") or g.node(mul.input[0], "Sigmoid")
    if sig is None or set(mul.input) != {sig.input[0], sig.output[0]}:
        return None
    total = g.node(sig.input[0], "ReduceSum")
    if total is None or _attr(total, "keepdims", 1) != 0 or len(total.input) != 2:
        return None
    axes = g.value(total.input[1])
    product = _binary(g, total.input[0], "Mul", 2)
    if axes is None or axes.tolist() != [2] or product is None:
        return None
    windows, taps = product
    gather = g.node(windows, "Gather")
    padded = g.node(gather.input[0], "Concat") if gather is not None and _attr(gather, "axis", 0) == 1 else None
    if padded is None or _attr(padded, "axis") != 1 or len(padded.input) != 2:
        return None
    state = g.node(padded.input[0], "Gather")
    if state is None or _attr(state, "axis", 0) != 0 or state.input[1] != slots:
        return None
    return padded.input[1], state.input[0], taps, padded.output[0]


def match_prologue(g: GraphIndex, gdn: onnx.NodeProto, slots: str) -> Prologue | None:
    """The prologue of GatedDeltaNet node `gdn` (inputs q, k, v, g, beta, state, rows), whose state
    pool is read at `slots`, in the graph `g` indexes; None where its inputs are not the exporter's
    prologue."""
    q, k, v, decay, beta = gdn.input[:5]
    qn, kn, vs = _l2_norm(g, q), _l2_norm(g, k), _slice_of(g, v)
    if qn is None or kn is None or vs is None or qn[0] != kn[0] or qn[0] != vs[0] or qn[3:] != kn[3:]:
        return None
    mixed, (_, q0, q1), (_, k0, k1), (_, v0, _) = qn[0], qn[:3], kn[:3], vs
    if q0 != 0 or k0 != q1 or k1 - k0 != q1 - q0 or v0 != k1:      # [q | k | v] along C
        return None
    conv, sig = _conv(g, mixed, slots), g.node(beta, "Sigmoid")
    gate = _binary(g, decay, "Mul", 1)
    softplus = g.node(gate[0], "Softplus") if gate is not None else None
    biased = _binary(g, softplus.input[0], "Add", 1) if softplus is not None else None
    if conv is None or sig is None or biased is None:
        return None
    qkv, conv_pool, taps, padded = conv
    if vs[2] != g.inits[taps].dims[1]:                                  # v ends at C: C = 2 kd + vd
        return None
    return Prologue([qkv, sig.input[0], biased[0], conv_pool, taps, gate[1], biased[1]], padded, qn[3], qn[4])


def match_conv_commit(g: GraphIndex, padded: str, before: onnx.NodeProto) -> tuple[str, str] | None:
    """The graph's pick of a layer's new conv state from its window `padded` [B, K-1+W, C]:
    GatherND(padded, Unsqueeze(Add(Unsqueeze(rows, [1]), [[0 .. K-2]]), [2]), batch_dims=1) ->
    (rows, the GatherND's output), where rows is there before node `before` (a graph input, or made
    earlier: a verify's kept rows come from its logits, after the layers); None otherwise."""
    for pick in g.readers.get(padded, []):
        if pick.op_type != "GatherND" or pick.input[0] != padded or _attr(pick, "batch_dims", 0) != 1:
            continue
        outer = g.node(pick.input[1], "Unsqueeze")
        add = g.node(outer.input[0], "Add") if outer is not None and _axes(g, outer) == [2] else None
        for rows_1, offsets in ((add.input, reversed(add.input)) if add is not None else ()):
            inner, steps = g.node(rows_1, "Unsqueeze"), g.value(offsets)
            if inner is None or _axes(g, inner) != [1] or steps is None \
                    or steps.reshape(-1).tolist() != list(range(steps.size)) or steps.shape[:1] != (1,):
                continue
            made = g.producers.get(inner.input[0])
            if made is None or g.order[id(made)] < g.order[id(before)]:
                return inner.input[0], pick.output[0]
    return None


def _axes(g: GraphIndex, node: onnx.NodeProto) -> list[int] | None:
    """An Unsqueeze's axes (input 1 from opset 13, else the attribute)."""
    if len(node.input) > 1:
        axes = g.value(node.input[1])
        return None if axes is None else axes.reshape(-1).tolist()
    return _attr(node, "axes")


@dataclass(frozen=True)
class AttentionPrologue:
    q_raw: str
    q_norm: str             # "" where the layer has none
    norm_epsilon: float
    cos: str
    sin: str
    perm: str
    gate: str               # "" where there is no output gate
    gated: str              # the Mul the gate fuses into ("" without one): the kernel's output then
    packed: str             # [B, W, Hq, 2 D] whose heads' halves the query and the gate are sliced from, or ""


def _normed(g: GraphIndex, name: str) -> tuple[str, str, float | None]:
    """RMSNormalization(x, scale) over the last axis -> (x, scale, epsilon); else (name, "", None)."""
    norm = g.node(name, "RMSNormalization")
    if norm is None or _attr(norm, "axis", -1) != -1 or not g.f32_weight(norm.input[1], 1):
        return name, "", None
    return norm.input[0], norm.input[1], float(_attr(norm, "epsilon", 1e-5))


def _rotated(g: GraphIndex, name: str) -> tuple[str, str, str, str] | None:
    """Add(Mul(x, cos), Mul(Gather(x, perm, axis=3), sin)) -> (x, cos, sin, perm)."""
    add = g.node(name, "Add")
    if add is None:
        return None
    for plain, swapped in (add.input, reversed(add.input)):
        m1, m2 = g.node(plain, "Mul"), g.node(swapped, "Mul")
        if m1 is None or m2 is None:
            continue
        for x, cos in (m1.input, reversed(m1.input)):
            for xs, sin in (m2.input, reversed(m2.input)):
                gather = g.node(xs, "Gather")
                if gather is not None and gather.input[0] == x and _attr(gather, "axis", 0) == 3 \
                        and g.value(gather.input[1]) is not None:
                    return x, cos, sin, gather.input[1]
    return None


def match_attention(g: GraphIndex, attention: onnx.NodeProto) -> AttentionPrologue | None:
    """The query's norm and RoPE before PagedSparseAttention node `attention` and the output gate after
    it, in the graph `g` indexes; None where its query is not the exporter's."""
    q = _rotated(g, attention.input[0])
    if q is None:
        return None
    q_raw, q_norm, eps = _normed(g, q[0])
    gate, gated = _output_gate(g, attention.output[0])
    return AttentionPrologue(q_raw, q_norm, eps or 0.0, *q[1:], gate, gated, _packed(g, q_raw, gate))


def _packed(g: GraphIndex, query: str, gate: str) -> str:
    """qg where query = Slice(qg, [0], [D], [3]) and gate = Reshape(Slice(qg, [D], [2 D], [3])) (the
    exporter's output gate: q_proj makes each head's query, then its gate); else ""."""
    reshape = g.node(gate, "Reshape") if gate else None
    q, z = _slice(g, query, (3,)), _slice(g, reshape.input[0], (3,)) if reshape is not None else None
    if q is None or z is None or q[0] != z[0] or q[1] != 0 or z[1] != q[2] or z[2] != 2 * q[2]:
        return ""
    return q[0]


def _output_gate(g: GraphIndex, out: str) -> tuple[str, str]:
    """Mul(Reshape(out), Sigmoid(gate)), out's and the Reshape's only reader -> (gate, Mul's output)."""
    readers = g.readers.get(out, [])
    reshape = readers[0] if len(readers) == 1 and readers[0].op_type == "Reshape" else None
    after = g.readers.get(reshape.output[0], []) if reshape is not None else []
    mul = after[0] if len(after) == 1 and after[0].op_type == "Mul" else None
    if mul is None:
        return "", ""
    other = mul.input[1] if mul.input[0] == reshape.output[0] else mul.input[0]
    sig = g.node(other, "Sigmoid")
    return (sig.input[0], mul.output[0]) if sig is not None else ("", "")


def match_norm_rope(g: GraphIndex, add: onnx.NodeProto) -> tuple[str, str, float, str, str, str] | None:
    """RoPE after an optional RMS norm, as the exporter writes a layer's keys (the queries' go into
    the attention node): Add(Mul(x, cos), Mul(Gather(x, perm, axis=3), sin)), x = RMSNormalization(raw,
    s) or raw -> (raw, s or "", epsilon, cos, sin, perm); None for any other Add."""
    rotated = _rotated(g, add.output[0]) if add.op_type == "Add" and add.domain in ("", "ai.onnx") else None
    if rotated is None:
        return None
    raw, scale, eps = _normed(g, rotated[0])
    return raw, scale, eps or 0.0, *rotated[1:]


@dataclass(frozen=True)
class RotaryTables:
    positions: str          # [B, W] int64
    inv_freq: str           # [rd / 2] float32 constant
    head_dim: int
    cos: str                # the tables the graph made: the kernel makes them under these names
    sin: str
    context_lens: str       # where positions = context_lens + w for the rows of `ids`: the kernel
    ids: str                # makes them itself ("" otherwise)


def match_rotary_tables(g: GraphIndex, cos: str, sin: str) -> RotaryTables | None:
    """The exporter's rotary_tables (export/layers.py) behind a (cos, sin) pair: E = Unsqueeze(Concat(F,
    F), [2]), F = Mul(Unsqueeze(Cast(positions), [2]), inv_freq); cos = Concat(Cos(E), Expand(ones))
    or Cos(E), sin = Concat(Mul(Sin(E), sign), Expand(zeros)) or Mul(Sin(E), sign), sign -1 on the
    first half and 1 on the second; None for anything else."""
    (c, pad), (signed, sin_pad) = _padded(g, cos, 1.0), _padded(g, sin, 0.0)
    cos_node, mul = g.node(c, "Cos") if c else None, g.node(signed, "Mul") if signed else None
    if cos_node is None or mul is None or pad != sin_pad:
        return None
    sin_node = next((n for n in (g.node(i, "Sin") for i in mul.input) if n is not None), None)
    sign = g.value(next((i for i in mul.input if sin_node is None or i != sin_node.output[0]), ""))
    if sin_node is None or sin_node.input[0] != cos_node.input[0] or sign is None:
        return None
    emb = g.node(cos_node.input[0], "Unsqueeze")
    twice = g.node(emb.input[0], "Concat") if emb is not None and _axes(g, emb) == [2] else None
    if twice is None or len(twice.input) != 2 or twice.input[0] != twice.input[1]:
        return None
    freqs = _binary_const(g, twice.input[0], "Mul")
    pos = g.node(freqs[0], "Unsqueeze") if freqs is not None else None
    cast = g.node(pos.input[0], "Cast") if pos is not None and _axes(g, pos) == [2] else None
    if cast is None or _attr(cast, "to") != onnx.TensorProto.FLOAT:
        return None
    half = int(freqs[1].size)
    if sign.reshape(-1).tolist() != [-1.0] * half + [1.0] * half:
        return None
    return RotaryTables(cast.input[0], freqs[2], 2 * half + pad, cos, sin, *_row_positions(g, cast.input[0]))


def _row_positions(g: GraphIndex, positions: str) -> tuple[str, str]:
    """(context_lens, ids) where positions = Add(Unsqueeze(context_lens, [1]), Unsqueeze(Range(0,
    Squeeze(Shape(ids, start=1, end=2), [0]), 1), [0])) (export/graphs.py's _paging); else ("", "")."""
    add = g.node(positions, "Add")
    for lens, rows in ((add.input, reversed(add.input)) if add is not None else ()):
        lens_1, rows_1 = g.node(lens, "Unsqueeze"), g.node(rows, "Unsqueeze")
        if lens_1 is None or rows_1 is None or _axes(g, lens_1) != [1] or _axes(g, rows_1) != [0]:
            continue
        span = g.node(rows_1.input[0], "Range")
        if span is None or [_scalar(g, span.input[0]), _scalar(g, span.input[2])] != [0, 1]:
            continue
        count = g.node(span.input[1], "Squeeze")
        shape = g.node(count.input[0], "Shape") if count is not None else None
        if shape is not None and _attr(shape, "start", 0) == 1 and _attr(shape, "end") == 2:
            return lens_1.input[0], shape.input[0]
    return "", ""


def _scalar(g: GraphIndex, name: str) -> int | None:
    value = g.value(name)
    return int(value.reshape(-1)[0]) if value is not None and value.size == 1 else None


def _padded(g: GraphIndex, name: str, fill: float) -> tuple[str, int]:
    """Concat(x, Expand(fill, shape), axis -1) -> (x, the padding's length); else (name, 0)."""
    cat = g.node(name, "Concat")
    if cat is None or len(cat.input) != 2 or _attr(cat, "axis") != -1:
        return name, 0
    expand = g.node(cat.input[1], "Expand")
    value = g.value(expand.input[0]) if expand is not None else None
    if value is None or value.ndim != 1 or not np.all(value == fill):
        return "", 0
    return cat.input[0], int(value.size)


def _binary_const(g: GraphIndex, name: str, op_type: str) -> tuple[str, np.ndarray, str] | None:
    """op(x, c) or op(c, x) with c an inline float32 constant -> (x, c's value, c's name)."""
    node = g.node(name, op_type)
    for x, c in ((node.input, reversed(node.input)) if node is not None else ()):
        value = g.value(c)
        if value is not None and value.dtype == np.float32 and value.ndim == 1:
            return x, value, c
    return None
