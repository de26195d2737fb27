"""`ai.tandem::PagedSparseAttention`: W new query rows per sequence over the committed K/V in a
paged pool plus the W new rows (causal), with GQA, sliding window and optional top-k selection.

Inputs   query [B, W, Hq, D], key [B, W, Hkv, D], value [B, W, Hkv, Dv] (new rows, post-RoPE),
         key_cache [N, S, Hkv, D], value_cache [N, S, Hkv, Dv], block_tables [B, P] int64,
         context_lens [B] int64, selected [B|1, W|1, K] int64 (positions each row may see, -1
         padded; K = 0 means dense)
Output   [B, W, Hq, Dv], the query's dtype
Attrs    scale (float), sliding_window (int, 0 = none), select_new_rows (int, default 0: the
         selection filters committed positions only; 1: also the new rows, at positions
         context_lens[b] + w', as a top-k indexer over all visible positions gives them)
Types    query, key, value and the caches share one float type (float32 or float16); scores,
         softmax and the weighted sum are float32 (K/V cast after the gather, so only the pages
         in use are widened, never the pool).

Row w sits at position p = context_lens[b] + w. It sees committed position j < context_lens[b]
when p - j < window (if any) and j is selected (if any), and new row w' <= w when w - w' < window
(and, with select_new_rows, position context_lens[b] + w' is selected).
Committed slot j of a sequence is page block_tables[b, j // S], offset j % S.

A listed position counts once however often it is listed; -1 and positions a row cannot see are
ignored. Every row must see at least one position (itself, or with select_new_rows one listed).
One If on K picks the branch, so each call runs only its own:

    dense (K = 0):  key_cache --Gather(block_tables)--> [B, P*S, Hkv, D] --Cast fp32, Concat(new rows)
                    --> [B, T+W, Hkv, D];  q [B,Hkv,G,W,D] x K^T --> [B,Hkv,G,W,T+W] --mask--> Softmax --> x V
    sparse (K > 0): the K listed rows of each query row through the page table --Gather--> [B, W, K, Hkv, D]
                    (no page gather: flat in the context); q x [listed | new rows] --> [B,W,Hkv,G,K+W]
                    --mask--> Softmax --> x [V listed | V new]
    --> CastLike(query)
The dense branch is the body as it was before the sparse branch existed (bit-identical outputs).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from tandem.export.builder import OPSET, TANDEM_DOMAIN, GraphBuilder

OP_TYPE = "PagedSparseAttention"
ATTRIBUTES = ("scale", "sliding_window")
DEFAULTS = {"select_new_rows": 0}  # optional attributes: absent on a node means this value
_NEG = -1e30  # finite: every row sees itself (or, with select_new_rows, its >= 1 selected positions)


def make_function():
    b = GraphBuilder(function=True)
    q, k, v, kc, vc, tables, ctx, sel = ("query", "key", "value", "key_cache", "value_cache", "block_tables",
                                         "context_lens", "selected")
    # Shared by both branches (subgraphs read these outer names; attributes resolve out here)
    scale = b.attr_const("scale", "float")
    window = b.attr_const("sliding_window", "int")
    select_new = b.op("Greater", b.attr_const("select_new_rows", "int"), b.const(0, np.int64))
    dense = b.op("Equal", b.shape_of(sel, 2, 3), b.const([0], np.int64))            # [1]
    common = (q, k, v, ctx, scale, window)
    out = b.op("If", dense, then_branch=_branch(_dense, "dense", common + (kc, vc, tables)),
               else_branch=_branch(_sparse, "sparse", common + (kc, vc, tables, sel, select_new)))
    b.op("CastLike", out, q, outputs=["output"])
    return helper.make_function(TANDEM_DOMAIN, OP_TYPE, [q, k, v, kc, vc, tables, ctx, sel], ["output"], b.nodes,
                                [helper.make_opsetid("", OPSET)], attributes=list(ATTRIBUTES),
                                attribute_protos=[helper.make_attribute(k, v) for k, v in DEFAULTS.items()])


def _branch(build, name: str, args: tuple) -> onnx.GraphProto:
    sub = GraphBuilder(function=True, root=name)
    out = build(sub, *args)                                                         # [B, W, Hq, Dv] fp32
    return helper.make_graph(sub.nodes, name, [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])


def _heads(b: GraphBuilder, q: str, k: str):
    """q as [B, Hkv, G, W, D] (fp32) and the W range."""
    i64 = lambda x: b.const(x, np.int64)  # noqa: E731
    hkv = b.shape_of(k, 2, 3)
    g = b.op("Div", b.shape_of(q, 2, 3), hkv)
    q5 = b.op("Transpose", b.reshape(_f32(b, q), b.concat([i64([0, 0]), hkv, g, b.shape_of(q, 3, 4)], 0)),
              perm=[0, 2, 3, 1, 4])
    w = b.op("Range", i64(0), b.squeeze(b.shape_of(q, 1, 2), [0]), i64(1))         # [W]
    return q5, w


def _f32(b: GraphBuilder, x: str) -> str:
    return b.op("Cast", x, to=TensorProto.FLOAT)  # identity on float32 inputs


def _new_rows_mask(b: GraphBuilder, w: str, window: str, no_window: str) -> str:
    """[W, W]: new row w' visible to row w (w' <= w, inside the window)."""
    dw = b.op("Sub", b.unsqueeze(w, [1]), b.unsqueeze(w, [0]))                      # [W, W] = w - w'
    return b.op("And", b.op("GreaterOrEqual", dw, b.const(0, np.int64)),
                b.op("Or", b.op("Less", dw, window), no_window))


def _dense(b: GraphBuilder, q, k, v, ctx, scale, window, kc, vc, tables) -> str:
    """Every committed position: all pages of the table, then the new rows."""
    i64 = lambda x: b.const(x, np.int64)  # noqa: E731
    # Committed K/V of each sequence, in position order: [B, T, Hkv, D], T = P * S
    def gather(cache):
        paged = b.op("Gather", cache, tables, axis=0)                               # [B, P, S, Hkv, D]
        return _f32(b, b.reshape(paged, b.concat([i64([0, -1]), b.shape_of(cache, 2, 4)], 0)))
    k_all = b.concat([gather(kc), _f32(b, k)], 1)                                   # [B, T+W, Hkv, D]
    v_all = b.concat([gather(vc), _f32(b, v)], 1)
    t_len = b.op("Mul", b.shape_of(tables, 1, 2), b.shape_of(kc, 1, 2))             # [1] = P*S
    q5, w = _heads(b, q, k)
    k5 = b.unsqueeze(b.op("Transpose", k_all, perm=[0, 2, 3, 1]), [2])              # [B, Hkv, 1, D, T+W]
    v5 = b.unsqueeze(b.op("Transpose", v_all, perm=[0, 2, 1, 3]), [2])              # [B, Hkv, 1, T+W, Dv]
    scores = b.op("Mul", b.op("MatMul", q5, k5), scale)                             # [B, Hkv, G, W, T+W]

    # Visibility mask [B, W, T+W]
    t = b.op("Range", i64(0), b.squeeze(t_len, [0]), i64(1))                        # [T]
    ctx3 = b.unsqueeze(ctx, [1, 2])                                                 # [B, 1, 1]
    pos_q = b.op("Add", ctx3, b.unsqueeze(w, [0, 2]))                               # [B, W, 1]
    no_window = b.op("LessOrEqual", window, i64(0))
    committed = b.op("Less", b.unsqueeze(t, [0, 1]), ctx3)                          # [B, 1, T]
    in_window_c = b.op("Or", b.op("Less", b.op("Sub", pos_q, b.unsqueeze(t, [0, 1])), window), no_window)
    mask_c = b.op("And", committed, in_window_c)                                   # [B, W, T]
    bw = b.concat([b.shape_of(q, 0, 2), b.shape_of(q, 1, 2)], 0)
    mask_n = b.op("Expand", b.unsqueeze(_new_rows_mask(b, w, window, no_window), [0]), bw)
    mask_c = b.op("Expand", mask_c, b.concat([b.shape_of(q, 0, 2), t_len], 0))
    mask = b.concat([mask_c, mask_n], 2)                                            # [B, W, T+W]
    masked = b.op("Where", b.unsqueeze(mask, [1, 2]), scores, b.const(_NEG, np.float32))
    probs = b.op("Softmax", masked, axis=-1)
    out5 = b.op("MatMul", probs, v5)                                                # [B, Hkv, G, W, Dv]
    out = b.op("Transpose", out5, perm=[0, 3, 1, 2, 4])                             # [B, W, Hkv, G, Dv]
    return b.reshape(out, b.concat([i64([0, 0, -1]), b.shape_of(v, 3, 4)], 0))


def _sparse(b: GraphBuilder, q, k, v, ctx, scale, window, kc, vc, tables, sel, select_new) -> str:
    """The K listed committed rows of each query row (through the page table), then the new rows."""
    i64 = lambda x: b.const(x, np.int64)  # noqa: E731
    q5, w = _heads(b, q, k)
    w_len = b.shape_of(q, 1, 2)
    page_size = b.shape_of(kc, 1, 2)
    ctx3 = b.unsqueeze(ctx, [1, 2])                                                 # [B, 1, 1]
    pos_q = b.op("Add", ctx3, b.unsqueeze(w, [0, 2]))                               # [B, W, 1]
    no_window = b.op("LessOrEqual", window, i64(0))
    bwk = b.concat([b.shape_of(q, 0, 2), b.shape_of(sel, 2, 3)], 0)
    # Each listed position once (a repeat would count twice in the softmax): sorted, repeats dropped
    listed = b.op("TopK", b.op("Expand", sel, bwk), b.shape_of(sel, 2, 3), axis=-1, largest=1, sorted=1,
                  outputs=2)[0]                                                     # [B, W, K]
    before = b.op("ConstantOfShape", b.concat([b.shape_of(q, 0, 2), i64([1])], 0),
                  value=helper.make_tensor("minus_two", TensorProto.INT64, [1], [-2]))
    repeat = b.op("Equal", listed, b.slice(b.concat([before, listed], 2), [0], b.shape_of(sel, 2, 3), [2]))
    in_window = b.op("Or", b.op("Less", b.op("Sub", pos_q, listed), window), no_window)
    valid = b.op("And", b.op("And", b.op("GreaterOrEqual", listed, i64(0)), b.op("Less", listed, ctx3)),
                 b.op("And", in_window, b.op("Not", repeat)))                      # [B, W, K]
    j = b.op("Where", valid, listed, i64(0))
    page = b.op("GatherElements", tables, b.reshape(b.op("Div", j, page_size), [0, -1]), axis=1)    # [B, W*K]
    rows = b.op("Add", b.op("Mul", b.reshape(page, bwk), page_size), b.op("Mod", j, page_size))     # pool rows
    def gather_rows(cache):
        flat = b.reshape(cache, b.concat([i64([-1]), b.shape_of(cache, 2, 4)], 0))  # [N*S, Hkv, D]
        return _f32(b, b.op("Gather", flat, rows, axis=0))                          # [B, W, K, Hkv, D]
    q_w = b.op("Transpose", q5, perm=[0, 3, 1, 2, 4])                               # [B, W, Hkv, G, D]
    k_s = b.op("Transpose", gather_rows(kc), perm=[0, 1, 3, 4, 2])                  # [B, W, Hkv, D, K]
    v_s = b.op("Transpose", gather_rows(vc), perm=[0, 1, 3, 2, 4])                  # [B, W, Hkv, K, Dv]
    scores_s = b.op("Mul", b.op("MatMul", q_w, k_s), scale)                         # [B, W, Hkv, G, K]

    # New rows: causal and windowed; with select_new_rows only the listed ones (position ctx + w')
    col = b.op("Sub", listed, ctx3)
    col = b.op("Where", b.op("And", b.op("GreaterOrEqual", col, i64(0)), b.op("Less", col, w_len)), col, w_len)
    zeros = b.op("ConstantOfShape", b.concat([b.shape_of(q, 0, 2), b.op("Add", w_len, i64([1]))], 0),
                 value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))
    ones = b.op("ConstantOfShape", bwk, value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0]))
    flags = b.op("ScatterElements", zeros, col, ones, axis=2, reduction="max")       # [B, W, W + 1 spare]
    chosen = b.op("Or", b.op("Greater", b.slice(flags, [0], w_len, [2]), b.const(0.0, np.float32)),
                  b.op("Not", select_new))
    mask_n = b.op("And", b.unsqueeze(_new_rows_mask(b, w, window, no_window), [0]), chosen)   # [B, W, W]
    k_n = b.unsqueeze(b.op("Transpose", _f32(b, k), perm=[0, 2, 3, 1]), [1])       # [B, 1, Hkv, D, W]
    v_n = b.unsqueeze(b.op("Transpose", _f32(b, v), perm=[0, 2, 1, 3]), [1])       # [B, 1, Hkv, W, Dv]
    scores_n = b.op("Mul", b.op("MatMul", q_w, k_n), scale)                         # [B, W, Hkv, G, W]

    neg = b.const(_NEG, np.float32)
    masked = b.concat([b.op("Where", b.unsqueeze(valid, [2, 3]), scores_s, neg),
                       b.op("Where", b.unsqueeze(mask_n, [2, 3]), scores_n, neg)], 4)
    probs = b.op("Softmax", masked, axis=-1)                                        # [B, W, Hkv, G, K+W]
    k_len = b.shape_of(sel, 2, 3)
    out = b.op("Add", b.op("MatMul", b.slice(probs, [0], k_len, [4]), v_s),
               b.op("MatMul", b.slice(probs, k_len, [2 ** 62], [4]), v_n))          # [B, W, Hkv, G, Dv]
    return b.reshape(out, b.concat([i64([0, 0, -1]), b.shape_of(v, 3, 4)], 0))
