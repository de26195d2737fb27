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
The body is a Scan over rows (recurrent form).
"""

from __future__ import annotations

import numpy as np
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


def make_function(emit_row_states: bool = False):
    """The function body; `emit_row_states` picks the body variant a model uses (ONNX
    functions cannot switch structure on an attribute, so the exporter emits one per model)."""
    b = GraphBuilder(function=True)
    q, k, v, g, beta, s0, rows = "query", "key", "value", "decay", "beta", "initial_state", "state_rows"
    # Repeat q/k across the r value heads of each key head: [B, W, Hk, dk] -> [B, W, Hv, dk]
    hk = b.shape_of(q, 2, 3)
    r = b.op("Div", b.shape_of(v, 2, 3), hk)
    expand_to = b.concat([b.shape_of(q, 0, 3), r, b.shape_of(q, 3, 4)], 0)
    flat = b.concat([b.const([0, 0, -1], np.int64), b.shape_of(q, 3, 4)], 0)
    q_r = b.reshape(b.op("Expand", b.unsqueeze(q, [3]), expand_to), flat)
    k_r = b.reshape(b.op("Expand", b.unsqueeze(k, [3]), expand_to), flat)
    # Rows at or beyond state_rows: g = 0, beta = 0 (state unchanged)
    w = b.op("Range", b.const(0, np.int64), b.squeeze(b.shape_of(q, 1, 2), [0]), b.const(1, np.int64))
    valid = b.op("Less", b.unsqueeze(w, [0]), b.unsqueeze(rows, [1]))          # [B, W]
    validf = b.op("Cast", valid, to=TensorProto.FLOAT)
    g_m = b.op("Mul", g, b.unsqueeze(validf, [2]))
    beta_m = b.op("Mul", beta, b.unsqueeze(validf, [2]))
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
