"""`ai.tandem::LightningIndexer`: DeepSeek Sparse Attention's top-k selection. For each of the W
new query rows, the `top_k` positions (committed or new, causal) with the highest index score,
as the `selected` input of `PagedSparseAttention` with `select_new_rows=1`.

Inputs   index_query [B, W, Hi, D] (wq_b(q_resid) per head, post-RoPE), index_weights [B, W, Hi]
         (weights_proj(x) * Hi^-0.5), index_key [B, W, D] (the new rows' keys: k_norm(wk(x)),
         post-RoPE), index_key_cache [N, S, D], block_tables [B, P] int64, context_lens [B] int64
Output   selected [B, W, top_k] int64: absolute positions, committed j < context_lens[b] or new
         row w' at context_lens[b] + w'; -1 padded when a row sees fewer than top_k positions
Attrs    scale (float: D^-0.5 in transformers), top_k (int >= 1)
Types    query, key and the cache share one float type; scores are float32.

    score[b, w, t] = sum_h index_weights[b, w, h] * relu(scale * index_query[b, w, h] . key_t)

Row w (position p = context_lens[b] + w) sees committed j < context_lens[b] and new rows w' <= w:
p + 1 positions. When p + 1 <= top_k every one of them is selected, so the attention is exactly
dense. Ties: TopK takes the lower position first among equal scores. transformers' torch.topk
leaves the order of equal values unspecified (CPU gives e.g. [13, 11, 14] out of twenty zeros),
so no rule can reproduce it; equal scores arise when relu zeroes every head for several
positions, and only a tie across the k-th score changes the attended set.

    cache --Gather(block_tables)--> [B, T, D] --Concat(new keys)--> [B, T+W, D]
    q [B,W,Hi,D] x K^T --> relu(scale .) [B,W,Hi,T+W] --weights--> [B,W,T+W] --mask--> TopK(min(k, T+W))
    --> column -> position, -inf -> -1 --> Pad to top_k with -1
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from tandem.export.builder import OPSET, TANDEM_DOMAIN, GraphBuilder

OP_TYPE = "LightningIndexer"
ATTRIBUTES = ("scale", "top_k")


def make_function():
    b = GraphBuilder(function=True)
    q, wts, k, kc, tables, ctx = ("index_query", "index_weights", "index_key", "index_key_cache", "block_tables",
                                  "context_lens")
    i64 = lambda x: b.const(x, np.int64)  # noqa: E731
    f32 = lambda x: b.op("Cast", x, to=TensorProto.FLOAT)  # noqa: E731 (identity on float32 inputs)
    paged = b.op("Gather", kc, tables, axis=0)                                      # [B, P, S, D]
    committed_keys = f32(b.reshape(paged, b.concat([i64([0, -1]), b.shape_of(kc, 2, 3)], 0)))
    k_all = b.concat([committed_keys, f32(k)], 1)                                   # [B, T+W, D]
    k_t = b.unsqueeze(b.op("Transpose", k_all, perm=[0, 2, 1]), [1])                # [B, 1, D, T+W]
    per_head = b.op("Relu", b.op("Mul", b.op("MatMul", f32(q), k_t), b.attr_const("scale", "float")))
    weights = b.unsqueeze(f32(wts), [2])                                            # [B, W, 1, Hi]
    scores = b.squeeze(b.op("MatMul", weights, per_head), [2])                      # [B, W, T+W]

    # Visibility [B, W, T+W]: committed j < ctx, new rows w' <= w
    t_len = b.op("Mul", b.shape_of(tables, 1, 2), b.shape_of(kc, 1, 2))             # [1] = P*S
    w_len = b.shape_of(q, 1, 2)
    t = b.op("Range", i64(0), b.squeeze(t_len, [0]), i64(1))                        # [T]
    w = b.op("Range", i64(0), b.squeeze(w_len, [0]), i64(1))                        # [W]
    ctx3 = b.unsqueeze(ctx, [1, 2])                                                 # [B, 1, 1]
    bsz = b.shape_of(q, 0, 1)
    committed = b.op("Expand", b.op("Less", b.unsqueeze(t, [0, 1]), ctx3), b.concat([bsz, w_len, t_len], 0))
    causal = b.op("GreaterOrEqual", b.unsqueeze(w, [1]), b.unsqueeze(w, [0]))      # [W, W]: w' <= w
    new = b.op("Expand", b.unsqueeze(causal, [0]), b.concat([bsz, w_len, w_len], 0))
    mask = b.concat([committed, new], 2)
    masked = b.op("Where", mask, scores, b.const(-np.inf, np.float32))

    top_k = b.attr_const("top_k", "int")
    kk = b.op("Min", b.reshape(top_k, [1]), b.op("Add", t_len, w_len))              # [1]: TopK needs k <= T+W
    values, cols = b.op("TopK", masked, kk, axis=-1, largest=1, sorted=1, outputs=2)
    pos = b.op("Where", b.op("Less", cols, t_len), cols, b.op("Add", b.op("Sub", cols, t_len), ctx3))
    pos = b.op("Where", b.op("Greater", values, b.const(-np.inf, np.float32)), pos, i64(-1))
    pads = b.concat([i64([0, 0, 0, 0, 0]), b.op("Sub", b.reshape(top_k, [1]), kk)], 0)
    b.op("Pad", pos, pads, i64(-1), outputs=["selected"])
    return helper.make_function(TANDEM_DOMAIN, OP_TYPE, [q, wts, k, kc, tables, ctx], ["selected"], b.nodes,
                                [helper.make_opsetid("", OPSET)], attributes=list(ATTRIBUTES))
