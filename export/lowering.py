"""Per-backend lowering: rewrite `ai.tandem` ops into a runtime's native kernels where that is
faster, keep the standard-ONNX function body everywhere else.

ONNX Runtime (CPU), chosen by measurement (figures in docs/lowering.md, `bench/ops.py`):
  GatedDeltaNet  -> com.microsoft::LinearAttention (update_rule gated_delta), keys repeated to the
                    value heads (value head h reads key head h // r: checked against numpy).
                    Rows past state_rows get decay 0 and beta 0, as in the function body.
                    row_states (verify) is only ever read at one row per sequence: GatherND at the
                    accepted row a, after acceptance. CPU LinearAttention cannot emit per-row
                    states (state_window is CUDA-only), so each such GatherND becomes a second
                    LinearAttention over the same rows with decay and beta zeroed past row a: its
                    final state is the state after row a (a zero row leaves the state as it is,
                    exp(0) = 1 and beta 0, bit for bit). Two nodes per layer instead of one
                    single-row node per row with its slices (the round graph: 9% fewer nodes).
  PagedSparseAttention -> where no row selects (`selected` a constant with K = 0): the body's
                    math without its selection branch, the visibility mask built once per graph
                    and window and shared by every layer (export/attention_lowering.py). Where rows
                    select, the function body. GroupQueryAttention was measured too: 1.4-1.8x the
                    body per op at batch 1, none at batch 8, and it refuses batch > 1 with several
                    new rows over a past (prefill chunks, verify), so it would need an If per node.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from tandem.export.attention_lowering import (
    dense_attention_nodes,
    lower_dense_attention,
    pass_of,
    query_heads,
    static_pool_dims,
)
from tandem.export.builder import MS_DOMAIN, TANDEM_DOMAIN, GraphBuilder
from tandem.export.cpu_attention_lowering import (
    elide_output_identities,
    lower_attention_to_kernel,
    lower_norm_rope_to_kernel,
    lower_rotary_tables_to_kernel,
)
from tandem.export.cpu_kernel_lowering import lower_gdn_to_kernel
from tandem.export.ops import gated_deltanet, paged_sparse_attention


def lower_for_onnxruntime(model: onnx.ModelProto, rows: int | None = None, cpu_kernels: bool = False
                          ) -> onnx.ModelProto:
    """Return a copy of `model` with its GatedDeltaNet nodes lowered (see module doc). `rows`
    is the static verify width; without it, nodes that emit row states keep their body.
    `cpu_kernels`: lower them, and dense float32 attention, to tandem's own CPU kernels instead
    (export/cpu_kernel_lowering.py; the session needs plugins/cpu_kernels.py's library)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes, masks = [], {}    # masks: the state_rows mask per (state_rows, graph pass), shared by the layers
    if cpu_kernels:
        lower_gdn_to_kernel(out)
    dense = dense_attention_nodes(out)
    if cpu_kernels:
        dense -= lower_attention_to_kernel(out, dense)
        lower_norm_rope_to_kernel(out)
        lower_rotary_tables_to_kernel(out)
        elide_output_identities(out.graph)
    picks = gated_deltanet.row_state_picks(out.graph)
    replays = {}             # row_states tensor -> its node's replay (inputs packed for LinearAttention)
    for node in out.graph.node:
        if node.domain == TANDEM_DOMAIN and node.op_type == gated_deltanet.OP_TYPE:
            emits_rows = len(node.output) == 3 and node.output[2] != ""
            if not emits_rows or node.output[2] in picks or rows is not None:
                lowered_nodes, replay = _lower_gdn(node, rows if emits_rows and node.output[2] not in picks else None,
                                                   masks)
                nodes.extend(lowered_nodes)
                if emits_rows:
                    replays[node.output[2]] = replay
                continue
        if node.op_type == "GatherND" and node.input[0] in picks and node.input[0] in replays:
            nodes.extend(replays[node.input[0]](node))
            continue
        nodes.append(node)
    nodes, _ = lower_dense_attention(nodes, dense, static_pool_dims(out.graph), query_heads(model))
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    _alias_shared_dequantize_inputs(out.graph)
    if any(n.domain == MS_DOMAIN for n in nodes) and not any(o.domain == MS_DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    for op in (gated_deltanet.OP_TYPE, paged_sparse_attention.OP_TYPE):   # functions no node calls any more
        if not any(n.op_type == op and n.domain == TANDEM_DOMAIN for n in out.graph.node):
            keep = [f for f in out.functions if f.name != op]
            del out.functions[:]
            out.functions.extend(keep)
    return out


def _alias_shared_dequantize_inputs(graph: onnx.GraphProto) -> None:
    """Give every DequantizeLinear its own initializer names: ONNX Runtime fuses DequantizeLinear +
    MatMul into MatMulNBits only where the quantized weight has one consumer. A weight read in
    several passes of one graph (the lm_head in a unified round's verify and draft passes, a reused
    head) would otherwise stay DequantizeLinear + float MatMul there: other numerics than the same
    weight's MatMulNBits in the decode step (speculative != plain greedy at near-ties) and a
    dequantization every call. The alias is a second TensorProto over the same bytes (same
    external-data offset), so nothing is stored twice."""
    inits = {t.name: t for t in graph.initializer}
    uses: dict[str, int] = {}
    for node in graph.node:
        if node.op_type != "DequantizeLinear":
            continue
        for i, name in enumerate(node.input):
            if name not in inits:
                continue
            uses[name] = uses.get(name, 0) + 1
            if uses[name] > 1:
                alias = onnx.TensorProto()
                alias.CopyFrom(inits[name])
                alias.name = f"{name}#{uses[name]}"
                graph.initializer.append(alias)
                node.input[i] = alias.name


def _lower_gdn(node: onnx.NodeProto, unroll: int | None, masks: dict):
    """GatedDeltaNet(q, k, v, g, beta, s0, state_rows) -> LinearAttention on [B, T, H*D] tensors.
    Returns (nodes, replay): replay(gather) gives the nodes that replace GatherND(row_states,
    [B, 1] row a, batch_dims=1): the state after row a, from a second LinearAttention whose rows
    past a have decay 0 and beta 0."""
    q, k, v, g, beta, s0, rows = node.input
    scale = next(a.f for a in node.attribute if a.name == "scale")
    b = GraphBuilder(function=True, root=node.name + "/lowered")  # constants as nodes: no initializers
    i64 = lambda x: b.const(x, np.int64)  # noqa: E731
    # mask rows at or beyond state_rows (same as the body); one mask per graph pass, shared by its layers
    key = (rows, pass_of(node))
    if key not in masks:
        w = b.op("Range", i64(0), b.squeeze(b.shape_of(q, 1, 2), [0]), i64(1))
        masks[key] = b.unsqueeze(b.op("Cast", b.op("Less", b.unsqueeze(w, [0]), b.unsqueeze(rows, [1])),
                                      to=TensorProto.FLOAT), [2])
    validf = masks[key]
    g_m, beta_m = b.op("Mul", g, validf), b.op("Mul", beta, validf)
    # keys repeated to the value heads (h -> h // r, static head counts: Expand broadcasts the ones),
    # everything packed to [B, T, H*D]
    hq, hv = _heads(node, "q"), _heads(node, "v")
    k_rep = b.op("Expand", b.unsqueeze(k, [3]), i64([1, 1, 1, hv // hq, 1])) if hv != hq else b.unsqueeze(k, [3])
    pack = lambda x: b.reshape(x, [0, 0, -1])  # noqa: E731
    qp, kp, vp = pack(q), pack(k_rep), pack(v)
    attrs = dict(update_rule="gated_delta", scale=scale)

    def linear_attention(qx, kx, vx, state, gx, bx, outputs, name):
        # q heads and kv heads come from shapes at build time; they are static in every graph tandem builds
        return b.op("LinearAttention", qx, kx, vx, state, gx, bx, domain=MS_DOMAIN, outputs=outputs, name=name,
                    q_num_heads=hq, kv_num_heads=hv, **attrs)

    def replay(gather: onnx.NodeProto) -> list[onnx.NodeProto]:
        r = GraphBuilder(function=True, root=gather.name + "/replayed")
        if ("upto", gather.input[1]) not in masks:     # one per pick (the accepted row), shared by the layers
            w = r.op("Range", r.const(0, np.int64), r.squeeze(r.shape_of(q, 1, 2), [0]), r.const(1, np.int64))
            upto = r.op("Cast", r.op("LessOrEqual", r.unsqueeze(w, [0]), gather.input[1]), to=TensorProto.FLOAT)
            masks[("upto", gather.input[1])] = r.unsqueeze(upto, [2])          # [B, W, 1]: rows 0..a
        upto = masks[("upto", gather.input[1])]
        _, state_a = r.op("LinearAttention", qp, kp, vp, s0, r.op("Mul", g_m, upto), r.op("Mul", beta_m, upto),
                          domain=MS_DOMAIN, outputs=2, name="LinearAttention", q_num_heads=hq, kv_num_heads=hv, **attrs)
        r.op("Identity", state_a, outputs=[gather.output[0]])
        return r.nodes

    if unroll is None:
        out, final = linear_attention(qp, kp, vp, s0, g_m, beta_m, 2, "LinearAttention")
        b.op("Reshape", out, i64([0, 0, hv, -1]), outputs=[node.output[0]])
        b.op("Identity", final, outputs=[node.output[1]])
        return b.nodes, replay
    state, outs, states = s0, [], []
    for t in range(unroll):
        sl = lambda x, t=t: b.slice(x, [t], [t + 1], [1])  # noqa: E731
        o, state = linear_attention(sl(qp), sl(kp), sl(vp), state, sl(g_m), sl(beta_m), 2, f"LinearAttention_{t}")
        outs.append(o)
        states.append(b.unsqueeze(state, [1]))
    b.op("Reshape", b.concat(outs, 1), i64([0, 0, hv, -1]), outputs=[node.output[0]])
    b.op("Identity", state, outputs=[node.output[1]])
    b.op("Concat", *states, axis=1, outputs=[node.output[2]])
    return b.nodes, replay


def _heads(node: onnx.NodeProto, which: str) -> int:
    """Head counts are recorded on the node by the exporter (q_heads / v_heads attributes)."""
    attr = {"q": "num_key_heads", "v": "num_value_heads"}[which]
    for a in node.attribute:
        if a.name == attr:
            return a.i
    raise ValueError(f"{node.name}: GatedDeltaNet node lacks the {attr} attribute needed to lower it")
