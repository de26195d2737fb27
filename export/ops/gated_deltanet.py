"""`ai.tandem::GatedDeltaNet`: the gated delta rule over W rows per sequence.

Inputs   query, key [B, W, Hk, dk] (L2-normalised), value [B, W, Hv, dv], decay [B, W, Hv]
         (log-space g), beta [B, W, Hv], initial_state [B, Hv, dk, dv] fp32, state_rows [B] int64
Outputs  output [B, W, Hv, dv], final_state [B, Hv, dk, dv]  (state after state_rows[b] rows),
         row_states [B, W, Hv, dk, dv] (only with emit_row_states=1: the state after each row)
Attrs    scale (float): output = scale * S_t^T q_t; num_key_heads, num_value_heads (ints, for
         kernels that need them as attributes); emit_row_states is structural (body variant)

Per value head h (key head h // r, r = Hv / Hk), per row t:
    S = exp(g_t) * S;  u = beta_t * (v_t - S^T k_t);  S = S + k_t u^T;  o_t = scale * S^T q_t
Rows at or beyond state_rows[b] run with g = 0, beta = 0, so they leave the state unchanged:
padding rows of a prefill chunk and the final state agree with an unpadded run.

Why a `row_states` output: the verify graph learns how many rows to commit only at its end
(acceptance), so it keeps each row's state (W <= 9) and selects the accepted one in-graph.

Two bodies with the same semantics: the recurrent form (a Scan over rows; decode, verify) and
the chunked form (chunk_size C > 0; long prefill chunks where no native kernel exists). Chunked,
per chunk with G = cumsum(g), D[i, j] = exp(G_i - G_j) for j <= i (else 0):
    A = strictly_lower((beta k) k^T * D);  T = (I + A)^-1 = prod_j (I + (-A)^(2^j))  (A nilpotent)
    U = T (beta v);  Kd = T (beta k exp(G))            # the WY form of the chunk's delta updates
    then across chunks (Scan):  V' = U - Kd S;  o = (q exp(G)) S + tril(q k^T * D) V'
                                S = exp(G_last) S + (k exp(G_last - G))^T V'
Padding rows (g = 0, beta = 0) leave both forms' state unchanged.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from tandem.export.builder import OPSET, TANDEM_DOMAIN, GraphBuilder

OP_TYPE = "GatedDeltaNet"
ATTRIBUTES = ("scale", "num_key_heads", "num_value_heads")  # head counts: for lowerings


def _scan_body(emit_row_states: bool):
    """One row of the recurrence: (S, q_t, k_t, v_t, g_t, b_t) -> (S', o_t[, S'])."""
    b = GraphBuilder(function=True, root="row")
    s_in, q, k, v, g, beta = "S_in", "q_t", "k_t", "v_t", "g_t", "b_t"
    decay = b.unsqueeze(b.op("Exp", g), [2, 3])                     # [B, Hv, 1, 1]
    s1 = b.op("Mul", s_in, decay)                                   # [B, Hv, dk, dv]
    k4 = b.unsqueeze(k, [2])                                        # [B, Hv, 1, dk]
    kv_mem = b.op("MatMul", k4, s1)                                 # [B, Hv, 1, dv] = S^T k
    delta = b.op("Mul", b.op("Sub", b.unsqueeze(v, [2]), kv_mem), b.unsqueeze(beta, [2, 3]))
    s2 = b.op("Add", s1, b.op("MatMul", b.op("Transpose", k4, perm=[0, 1, 3, 2]), delta), outputs=["S_out"])
    o = b.op("MatMul", b.unsqueeze(q, [2]), s2[0])                  # [B, Hv, 1, dv]
    b.op("Squeeze", o, b.const([2], np.int64), outputs=["o_t"])
    outs = ["S_out", "o_t"]
    if emit_row_states:
        b.op("Identity", "S_out", outputs=["S_row"])
        outs.append("S_row")
    f = TensorProto.FLOAT
    ranks = {s_in: 4, q: 3, k: 3, v: 3, g: 2, beta: 2, "S_out": 4, "o_t": 3, "S_row": 4}
    info = lambda n: helper.make_tensor_value_info(n, f, [None] * ranks[n])  # noqa: E731
    return helper.make_graph(b.nodes, "gdn_row", [info(n) for n in (s_in, q, k, v, g, beta)], [info(n) for n in outs])


def make_function(emit_row_states: bool = False, chunk_size: int = 0):
    """The function body; `emit_row_states` and `chunk_size` pick the body variant a model uses
    (ONNX functions cannot switch structure on an attribute, so the exporter emits one per model)."""
    if chunk_size:
        if emit_row_states:
            raise ValueError("the chunked GatedDeltaNet body does not emit row states; use the recurrent one")
        return _chunked_function(chunk_size)
    b = GraphBuilder(function=True)
    q, k, v, g, beta, s0, rows = "query", "key", "value", "decay", "beta", "initial_state", "state_rows"
    q_r, k_r, g_m, beta_m = _repeat_and_mask(b, q, k, v, g, beta, rows)
    n_out = 3 if emit_row_states else 2
    scan = b.op("Scan", s0, q_r, k_r, v, g_m, beta_m, outputs=n_out, body=_scan_body(emit_row_states),
                num_scan_inputs=5, scan_input_axes=[1] * 5, scan_output_axes=[1] * (n_out - 1))
    b.op("Identity", scan[0], outputs=["final_state"])
    b.op("Mul", scan[1], b.attr_const("scale", "float"), outputs=["output"])
    outputs = ["output", "final_state"]
    if emit_row_states:
        b.op("Identity", scan[2], outputs=["row_states"])
        outputs.append("row_states")
    return helper.make_function(TANDEM_DOMAIN, OP_TYPE, [q, k, v, g, beta, s0, rows], outputs, b.nodes,
                                [helper.make_opsetid("", OPSET)], attributes=list(ATTRIBUTES))


def _repeat_and_mask(b: GraphBuilder, q, k, v, g, beta, rows):
    """q, k repeated to the value heads; g, beta zeroed at rows >= state_rows."""
    hk = b.shape_of(q, 2, 3)
    r = b.op("Div", b.shape_of(v, 2, 3), hk)
    expand_to = b.concat([b.shape_of(q, 0, 3), r, b.shape_of(q, 3, 4)], 0)
    flat = b.concat([b.const([0, 0, -1], np.int64), b.shape_of(q, 3, 4)], 0)
    q_r = b.reshape(b.op("Expand", b.unsqueeze(q, [3]), expand_to), flat)
    k_r = b.reshape(b.op("Expand", b.unsqueeze(k, [3]), expand_to), flat)
    w = b.op("Range", b.const(0, np.int64), b.squeeze(b.shape_of(q, 1, 2), [0]), b.const(1, np.int64))
    validf = b.unsqueeze(b.op("Cast", b.op("Less", b.unsqueeze(w, [0]), b.unsqueeze(rows, [1])),
                              to=TensorProto.FLOAT), [2])
    return q_r, k_r, b.op("Mul", g, validf), b.op("Mul", beta, validf)


def _chunk_scan_body():
    """One chunk: (S, q, k, U, Kd, Aq, G) -> (S', o). Shapes [B, H, C, d], Aq [B, H, C, C], G [B, H, C]."""
    b = GraphBuilder(function=True, root="chunk")
    s_in, q, k, u, kd, aq, gc = "S_in", "q_c", "k_c", "u_c", "kd_c", "aq_c", "g_c"
    v_new = b.op("Sub", u, b.op("MatMul", kd, s_in))                                   # [B, H, C, dv]
    inter = b.op("MatMul", b.op("Mul", q, b.unsqueeze(b.op("Exp", gc), [3])), s_in)
    b.op("Add", inter, b.op("MatMul", aq, v_new), outputs=["o_c"])
    g_last = b.slice(gc, [-1], [np.iinfo(np.int64).max], [2])                          # [B, H, 1]
    k_dec = b.op("Mul", k, b.unsqueeze(b.op("Exp", b.op("Sub", g_last, gc)), [3]))
    decayed = b.op("Mul", s_in, b.unsqueeze(b.op("Exp", g_last), [3]))
    b.op("Add", decayed, b.op("MatMul", b.op("Transpose", k_dec, perm=[0, 1, 3, 2]), v_new), outputs=["S_out"])
    ranks = {s_in: 4, q: 4, k: 4, u: 4, kd: 4, aq: 4, gc: 3, "S_out": 4, "o_c": 4}
    info = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [None] * ranks[n])  # noqa: E731
    return helper.make_graph(b.nodes, "gdn_chunk", [info(n) for n in (s_in, q, k, u, kd, aq, gc)],
                             [info("S_out"), info("o_c")])


def _chunked_function(chunk: int):
    b = GraphBuilder(function=True)
    q, k, v, g, beta, s0, rows = "query", "key", "value", "decay", "beta", "initial_state", "state_rows"
    i64 = lambda x: b.const(x, np.int64)  # noqa: E731
    q, k, g, beta = _repeat_and_mask(b, q, k, v, g, beta, rows)
    q = b.op("Mul", q, b.attr_const("scale", "float"))
    # pad W up to n_chunks * C rows (padding rows have g = beta = 0 and zero q/k/v)
    w_len = b.shape_of(q, 1, 2)
    n_chunks = b.op("Div", b.op("Add", w_len, i64([chunk - 1])), i64([chunk]))
    pad = b.op("Sub", b.op("Mul", n_chunks, i64([chunk])), w_len)

    def chunked(x, rank):  # [B, W, H(, d)] -> [B, H, nc, C(, d)]
        pads = b.concat([i64([0] * (rank + 1)), pad, i64([0] * (rank - 2))], 0)
        x = b.op("Pad", x, pads)
        x = b.reshape(x, b.concat([b.shape_of(x, 0, 1), n_chunks, i64([chunk]), b.shape_of(x, 2)], 0))
        return b.op("Transpose", x, perm=[0, 3, 1, 2, 4] if rank == 4 else [0, 3, 1, 2])
    qc, kc, vc, gc, bc = chunked(q, 4), chunked(k, 4), chunked(v, 4), chunked(g, 3), chunked(beta, 3)
    big_g = b.op("CumSum", gc, i64(-1))                                                # [B, H, nc, C]
    eye = b.const(np.eye(chunk, dtype=np.float32))
    lower_incl = b.const(np.tril(np.ones((chunk, chunk), bool)))
    lower_strict = b.const(np.tril(np.ones((chunk, chunk), bool), -1))
    diff = b.op("Sub", b.unsqueeze(big_g, [4]), b.unsqueeze(big_g, [3]))               # G_i - G_j
    zero = b.const(0.0, np.float32)
    decay_mask = b.op("Where", lower_incl, b.op("Exp", b.op("Where", lower_incl, diff, zero)), zero)
    k_beta = b.op("Mul", kc, b.unsqueeze(bc, [4]))
    v_beta = b.op("Mul", vc, b.unsqueeze(bc, [4]))
    kt = b.op("Transpose", kc, perm=[0, 1, 2, 4, 3])
    a = b.op("Where", lower_strict, b.op("Mul", b.op("MatMul", k_beta, kt), decay_mask), zero)
    # (I + A)^-1 = prod_j (I + N^(2^j)), N = -A nilpotent of order <= C
    n = b.op("Neg", a)
    inv = b.op("Add", eye, n)
    power = 1
    while power * 2 < chunk:
        n = b.op("MatMul", n, n)
        inv = b.op("MatMul", inv, b.op("Add", eye, n))
        power *= 2
    u = b.op("MatMul", inv, v_beta)                                                    # [B, H, nc, C, dv]
    kd = b.op("MatMul", inv, b.op("Mul", k_beta, b.unsqueeze(b.op("Exp", big_g), [4])))
    aq = b.op("Mul", b.op("MatMul", qc, kt), decay_mask)                               # [B, H, nc, C, C]
    scan = b.op("Scan", s0, qc, kc, u, kd, aq, big_g, outputs=2, body=_chunk_scan_body(), num_scan_inputs=6,
                scan_input_axes=[2] * 6, scan_output_axes=[2])
    b.op("Identity", scan[0], outputs=["final_state"])
    o = b.op("Transpose", scan[1], perm=[0, 2, 3, 1, 4])                               # [B, nc, C, H, dv]
    o = b.reshape(o, b.concat([b.shape_of(o, 0, 1), i64([-1]), b.shape_of(o, 3)], 0))
    b.op("Slice", o, i64([0]), w_len, i64([1]), outputs=["output"])
    return helper.make_function(TANDEM_DOMAIN, OP_TYPE, ["query", "key", "value", "decay", "beta", "initial_state",
                                                         "state_rows"], ["output", "final_state"], b.nodes,
                                [helper.make_opsetid("", OPSET)], attributes=list(ATTRIBUTES))


def row_state_picks(graph: onnx.GraphProto) -> set[str]:
    """The row_states tensors read only by GatherND at one row per batch row (indices [B, 1],
    batch_dims 1: the verify body's pick at the accepted row), and by nothing else: a lowering may
    replay the rows up to that one instead of keeping every row's state."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    picks = set()
    for node in graph.node:
        if node.domain == TANDEM_DOMAIN and node.op_type == OP_TYPE and len(node.output) == 3:
            users = readers.get(node.output[2], [])
            if users and node.output[2] not in outputs and all(
                    u.op_type == "GatherND" and u.input[0] == node.output[2]
                    and any(a.name == "batch_dims" and a.i == 1 for a in u.attribute) for u in users):
                picks.add(node.output[2])
    return picks
