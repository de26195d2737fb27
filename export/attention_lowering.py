"""ONNX Runtime lowering of `ai.tandem::PagedSparseAttention` in graphs where no row selects:
the node's `selected` input is a constant with K = 0 (every graph of a model without an
indexer). The math is the function body's (export/ops/paged_sparse_attention.py) minus its
selection branch, and the visibility mask is built once per graph and sliding window, then
shared by every attention layer (the body rebuilds it in each layer from that layer's shapes:
about 30 small nodes, a third of the tiny model's decode step in the profile of bench/where_time_goes.py).

Shared, per (block tables, context lens, window, graph pass), built before the first such node:

    T = P x S (block-table width x page size), W = the query's rows, B = batch
    keys are laid out by position: slot j holds position j (the W new rows are scattered to slots
    ctx[b] + w; W spare slots at the end make room when the table has no page for them yet)
    mask [B, 1, 1, W+1, T+W]: row w sees j <= ctx[b] + w (and ctx[b] + w - j < window)

Per layer (Hkv / D / Dv from the pools' declared shapes, constants in the Reshapes: ORT cannot fold a
Shape of a tensor whose batch or row count is symbolic, so shape arithmetic would run every call;
G from the query's size; from the layer's tensors where a pool's shape is not declared):

    K, V pages --Gather(block_tables)--> [B, T, Hkv, D] --Cast fp32, Concat(new), ScatterND(new at ctx+w)
    q [B,Hkv,G,W,D] --Pad one row (target layers)--> [B, Hkv, G*(W+1), D] (G static: one product per
    KV head, each key read once) x K^T x scale --Where(mask)--> Softmax --> x V --> drop the pad row
    --> [B, W, Hq, Dv] --CastLike(query)

Why by position, and why the pad row: each row's result must not depend on how many rows the
call has, so that a verify row gives bit for bit what the decode step at that position gives
(speculative greedy == plain greedy even at near-ties; with int8 activations a 1e-7 difference can
cross a rounding step and move a logit by 1e-2). By position, a verify row and the decode step
see the same key at the same slot (softmax and x V sum over slots; masked slots add exact zeros).
ONNX Runtime's MatMul with a non-constant B takes another path for a 1-row A than for 2 or more
rows (other rounding), so every call of a target layer has at least 2 query rows. The MTP heads'
layers get no pad row: their rows only draft, and the contract does not depend on them (the pad
cost the unified round 12% at batch 8 there).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto

from tandem.export.builder import GraphBuilder
from tandem.export.ops import paged_sparse_attention as psa

_NEG = -1e30  # as the body: finite, every row sees at least itself


@dataclass(frozen=True)
class Shared:
    """Built once per pass and window: the visibility mask and where the new rows go."""
    mask: str    # [B, 1, 1, W+pad, T+W] bool; with `groups` G: [B, 1, G*(W+pad), T+W] (row g*(W+pad) + w)
    where: str   # [B, W, 2] int64: (b, ctx_b + w), ScatterND indices of the new rows
    pad: int     # 1: one pad query row (target layers), 0: none (MTP heads' layers)
    groups: int | None = None   # G = Hq / Hkv when static: the query heads of a KV head are one matrix


def dense_attention_nodes(model: onnx.ModelProto) -> set[str]:
    """Names of the PagedSparseAttention nodes whose `selected` input is a constant with K = 0."""
    empty = {i.name for i in model.graph.initializer if len(i.dims) == 3 and i.dims[2] == 0}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            t = node.attribute[0].t
            if len(t.dims) == 3 and t.dims[2] == 0:
                empty.add(node.output[0])
    return {n.name for n in model.graph.node if n.op_type == psa.OP_TYPE and n.input[7] in empty}


def pass_of(node: onnx.NodeProto) -> str:
    """The pass of the graph a node belongs to: its name's scope before the layer's own
    (`/model/layers.N/...`, `/mtp/mtp{j}/...`). A unified round graph (export/round_graph.py) runs
    verify at the root and each head pass under `reanchor/head{j}` or `draft{s}`, on other rows
    over the same block tables and context lengths; all layers of one pass run on the same rows."""
    return node.name.split("/model/")[0].split("/mtp/")[0]


def static_pool_dims(graph: onnx.GraphProto) -> dict[str, tuple[int, int]]:
    """Graph input -> its last two dims where both are static: (Hkv, D) of a paged K or V pool
    [pages, page_size, Hkv, D] (the contract declares them from the cache specs)."""
    out = {}
    for i in graph.input:
        dims = i.type.tensor_type.shape.dim
        if len(dims) == 4 and all(d.HasField("dim_value") for d in dims[2:]):
            out[i.name] = (dims[2].dim_value, dims[3].dim_value)
    return out


def query_heads(model: onnx.ModelProto) -> dict[str, int]:
    """PagedSparseAttention query tensor -> its static head count Hq (ONNX shape inference: the
    exporter reshapes q to [B, W, Hq, D] with constant Hq)."""
    queries = {n.input[0] for n in model.graph.node if n.op_type == psa.OP_TYPE}
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph.value_info
    out = {}
    for v in inferred:
        dims = v.type.tensor_type.shape.dim
        if v.name in queries and len(dims) == 4 and dims[2].HasField("dim_value"):
            out[v.name] = dims[2].dim_value
    return out


def lower_dense_attention(nodes: list[onnx.NodeProto], dense: set[str], pool_dims: dict[str, tuple[int, int]],
                          heads: dict[str, int] | None = None) -> tuple[list[onnx.NodeProto], int]:
    """`nodes` with each PagedSparseAttention node named in `dense` replaced by its lowered form;
    the nodes of one pass (pass_of) with the same tables, context lengths and window share one
    mask. pool_dims: static_pool_dims of the graph; heads: query_heads of it. Returns (nodes, how
    many were lowered)."""
    out, masks, lowered = [], {}, 0
    b = GraphBuilder(function=True, root="dense_attention")   # Constant nodes: no initializers to add
    for node in nodes:
        if node.op_type != psa.OP_TYPE or node.name not in dense:
            out.append(node)
            continue
        q, k, v, kc, vc, tables, ctx, _ = node.input
        window = next((a.i for a in node.attribute if a.name == "sliding_window"), 0)
        scale = next(a.f for a in node.attribute if a.name == "scale")
        start = len(b.nodes)
        pad = 0 if "/mtp/" in node.name else 1   # the heads' rows only draft: exactness needs no pad there
        k_dims, v_dims, hq = pool_dims.get(kc), pool_dims.get(vc), (heads or {}).get(q)
        groups = hq // k_dims[0] if hq and k_dims and v_dims and hq % k_dims[0] == 0 else None
        key = (tables, ctx, window, pass_of(node), pad, groups)
        if key not in masks:
            masks[key] = _mask(b, q, kc, tables, ctx, window, pad, groups)
        _attention(b, node, masks[key], scale, k_dims, v_dims)
        out.extend(b.nodes[start:])
        lowered += 1
    return out, lowered


def _mask(b: GraphBuilder, q: str, kc: str, tables: str, ctx: str, window: int, pad: int,
          groups: int | None = None) -> Shared:
    """The pass's key positions and mask. Keys are laid out by position (see _attention), so
    key slot j holds position j: row w (position ctx + w) sees j <= ctx + w (and ctx + w - j <
    window). With `pad`, row W is the pad row (sees everything up to ctx + W; its output is dropped).
    With `groups` G the rows are the G query heads' W+pad rows one after the other (tiled)."""
    i64 = lambda x: b.const(x, np.int64)  # noqa: E731
    w_len = b.shape_of(q, 1, 2)                                                    # [1] = W
    t_len = b.op("Add", b.op("Mul", b.shape_of(tables, 1, 2), b.shape_of(kc, 1, 2)), w_len)  # [1] = P*S + W
    t = b.op("Range", i64(0), b.squeeze(t_len, [0]), i64(1))                       # [T+W]
    w = b.op("Range", i64(0), b.op("Add", b.squeeze(w_len, [0]), i64(pad)), i64(1))  # [W+pad]
    pos_q = b.op("Add", b.unsqueeze(ctx, [1]), b.unsqueeze(w, [0]))                # [B, W+pad]
    ahead = b.op("Sub", b.unsqueeze(pos_q, [2]), b.unsqueeze(t, [0, 1]))           # [B, W+pad, T+W] = pos - j
    mask = b.op("GreaterOrEqual", ahead, i64(0))
    if window > 0:
        mask = b.op("And", mask, b.op("Less", ahead, i64(window)))
    new_pos = b.slice(pos_q, [0], [-1], [1]) if pad else pos_q                     # [B, W]: the new rows' positions
    batch = b.op("Expand", b.unsqueeze(b.op("Range", i64(0), b.squeeze(b.shape_of(ctx, 0, 1), [0]), i64(1)), [1]),
                 b.shape_of(new_pos))                                              # [B, W]
    where = b.concat([b.unsqueeze(batch, [2]), b.unsqueeze(new_pos, [2])], 2)      # [B, W, 2] = (b, ctx_b + w)
    if groups:
        return Shared(b.unsqueeze(b.op("Tile", mask, i64([1, groups, 1])), [1]), where, pad, groups)
    return Shared(b.unsqueeze(mask, [1, 2]), where, pad)                           # mask [B, 1, 1, W+pad, T+W]


def _attention(b: GraphBuilder, node: onnx.NodeProto, shared: Shared, scale: float,
               k_dims: tuple[int, int] | None, v_dims: tuple[int, int] | None) -> None:
    """The body's attention for one layer under the pass's shared mask; writes the node's own output
    name. k_dims / v_dims: the pools' static (Hkv, D) and (Hkv, Dv), or None (read off the tensors)."""
    q, k, v, kc, vc, tables, _, _ = node.input
    i64 = lambda x: b.const(x, np.int64)  # noqa: E731
    f32 = lambda x: b.op("Cast", x, to=TensorProto.FLOAT)  # noqa: E731 (ORT drops it on float32 tensors)

    def rows(cache, new, dims):                                                    # [B, T+W, Hkv, D]
        paged = b.op("Gather", cache, tables, axis=0)                              # [B, P, S, Hkv, D]
        flat = b.reshape(paged, i64([0, -1, *dims]) if dims else b.concat([i64([0, -1]), b.shape_of(cache, 2, 4)], 0))
        spread = b.concat([f32(flat), f32(new)], 1)          # W spare slots: room when ctx + W > P*S
        return b.op("ScatterND", spread, shared.where, f32(new))                   # new row w at slot ctx + w

    if k_dims:
        q_shape = i64([0, 0, k_dims[0], -1, k_dims[1]])                           # G = Hq / Hkv from the size
    else:
        hkv = b.shape_of(k, 2, 3)
        q_shape = b.concat([i64([0, 0]), hkv, b.op("Div", b.shape_of(q, 2, 3), hkv), b.shape_of(q, 3, 4)], 0)
    q5 = b.op("Transpose", b.reshape(f32(q), q_shape), perm=[0, 2, 3, 1, 4])      # [B, Hkv, G, W, D]
    if shared.pad:
        q5 = b.op("Pad", q5, i64([0, 0, 0, 0, 0, 0, 0, 0, 1, 0]))                 # [B, Hkv, G, W+1, D]
    k4 = b.op("Transpose", rows(kc, k, k_dims), perm=[0, 2, 3, 1])                # [B, Hkv, D, T+W]
    v4 = b.op("Transpose", rows(vc, v, v_dims), perm=[0, 2, 1, 3])                # [B, Hkv, T+W, Dv]
    if shared.groups:   # one [G*(W+pad), D] x [D, T+W] product per KV head: each key and value read once
        q_rows, k_in, v_in = b.reshape(q5, i64([0, 0, -1, k_dims[1]])), k4, v4    # q [B, Hkv, G*(W+pad), D]
    else:               # [B, Hkv, G, W+pad, D] x [B, Hkv, 1, D, T+W]: keys and values read once per group
        q_rows, k_in, v_in = q5, b.unsqueeze(k4, [2]), b.unsqueeze(v4, [2])
    scores = b.op("Mul", b.op("MatMul", q_rows, k_in), b.const(np.float32(scale)))
    probs = b.op("Softmax", b.op("Where", shared.mask, scores, b.const(np.float32(_NEG))), axis=-1)
    out = b.op("MatMul", probs, v_in)
    if shared.groups:
        out = b.reshape(out, i64([0, 0, shared.groups, -1, v_dims[1]]))          # [B, Hkv, G, W+pad, Dv]
    out = b.slice(out, [0], [-1], [3]) if shared.pad else out                      # drop the pad row
    out = b.op("Transpose", out, perm=[0, 3, 1, 2, 4])                             # [B, W, Hkv, G, Dv]
    out = b.reshape(out, i64([0, 0, -1, v_dims[1]]) if v_dims else b.concat([i64([0, 0, -1]), b.shape_of(v, 3, 4)], 0))
    b.op("CastLike", out, q, outputs=[node.output[0]], name=node.name + "/output")
