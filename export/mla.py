"""Sparse multi-head latent attention (DeepSeek-V3.2 / GLM-5 MLA with the lightning indexer) as a
graph piece, built from the layer's MLASpec (checkpoint/mla_specs.py: dims, RoPE, scale, indexer)
and a canonical weight prefix; no family logic.

Per token and layer the caches hold one latent row [kv_lora_rank + qk_rope_head_dim] =
concat(c_kv, k_pe) (a PagedSparseAttention pool with ONE kv head, [N, S, 1, D]) and one indexer
key row [index_head_dim] (pool [N, S, Di]). The piece returns both rows for the W new tokens;
the runtime commits them (a rejected draft leaves nothing).

    q_resid = q_a_layernorm(q_a_proj(x))      q = q_b_proj(q_resid)  (or q_proj(x))  [B, W, n, nope + rope]
    kv = kv_a_proj_with_mqa(x):  c_kv = kv_a_layernorm(kv[:r]),  k_pe = RoPE(kv[r:])   (r = kv_lora_rank)
    absorbed:  q' = concat(q_nope x W_UK[h], RoPE(q_pe))  [B, W, n, r + rope]   (kv_b_proj = [W_UK | W_UV] per head)
               a = PagedSparseAttention(q', key = value = latent rows, Hkv = 1)[..., :r]
               out = o_proj(a x W_UV[h]^T)
    q'.row = q_nope . (W_UK c_kv) + q_pe . k_pe, the expanded form's score, with no per-head K/V.

RoPE: MLA rotates interleaved pairs (x0, x1), (x2, x3) .. and writes them de-interleaved (as
transformers' apply_rotary_pos_emb_interleave; DeepSeek-V3 with rope_interleave false: halves); the
DeepSeek-V3.2 indexer rotates the halves
(NeoX), GLM-5's indexer the interleaved pairs. cos/sin carry YaRN's attention factor; the softmax
scale is qk_head_dim^-0.5 x mscale(factor, mscale_all_dim)^2 (transformers' yarn_apply_mscale).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from tandem.checkpoint.mla_specs import IndexerSpec, MLASpec
from tandem.export.builder import TANDEM_DOMAIN, GraphBuilder
from tandem.export.ops import lightning_indexer, paged_sparse_attention
from tandem.export.primitives import Weights, cast, linear, rms_norm


@dataclass(frozen=True)
class MLAOutputs:
    output: str           # [B, W, H]
    latent_rows: str      # [B, W, 1, r + rope]: the latent pool rows of the new tokens
    index_key_rows: str   # [B, W, Di] (None without an indexer of its own)
    selected: str         # [B, W, top_k] positions attended (the input selection when reused; [1, 1, 0]: dense)


def rope_tables(b: GraphBuilder, a: MLASpec, positions: str, dtype: str = "float32") -> tuple[str, str]:
    """cos, sin [B, W, 1, rope / 2] in `dtype` for int64 positions [B, W], one angle per pair,
    times YaRN's attention factor (the angles are float32). The attention and the indexer share them."""
    with b.scope("rope"):
        freqs = b.op("Mul", b.unsqueeze(b.op("Cast", positions, to=TensorProto.FLOAT), [2]), b.const(a.inv_freq()))
        freqs = b.unsqueeze(freqs, [2])
        f = b.const(np.float32(a.rope_attention_factor))
        return (cast(b, b.op("Mul", b.op("Cos", freqs), f), "float32", dtype),
                cast(b, b.op("Mul", b.op("Sin", freqs), f), "float32", dtype))


def rotate(b: GraphBuilder, x: str, cos: str, sin: str, rope_dim: int, interleaved: bool) -> str:
    """RoPE on the last axis (width rope_dim) of x [B, W, h, rope_dim]: pairs (x[2i], x[2i+1])
    when interleaved, (x[i], x[i + rope_dim/2]) otherwise; output [x1 cos - x2 sin | x2 cos + x1 sin]."""
    half = rope_dim // 2
    if interleaved:
        x1 = b.op("Slice", x, b.const([0], np.int64), b.const([rope_dim], np.int64), b.const([3], np.int64),
                  b.const([2], np.int64))
        x2 = b.op("Slice", x, b.const([1], np.int64), b.const([rope_dim], np.int64), b.const([3], np.int64),
                  b.const([2], np.int64))
    else:
        x1, x2 = b.slice(x, [0], [half], [3]), b.slice(x, [half], [rope_dim], [3])
    return b.concat([b.op("Sub", b.op("Mul", x1, cos), b.op("Mul", x2, sin)),
                     b.op("Add", b.op("Mul", x2, cos), b.op("Mul", x1, sin))], -1)


def mla_attention(b: GraphBuilder, a: MLASpec, w: Weights, p: str, x: str, cos: str, sin: str, context_lens: str,
                  block_tables: str, latent_pool: str, index_pool: str | None = None,
                  selected: str | None = None) -> MLAOutputs:
    """Sparse MLA `a` of the attention module with canonical prefix `p` (e.g. "layers.3.self_attn.")
    on x [B, W, H]; cos, sin from rope_tables at the rows' positions. latent_pool [N, S, 1, r + rope],
    index_pool [N, S, Di]. Selection [B, W, K]: `selected` when given (required on layers that reuse
    the previous layer's, GLM-5 "shared"; on a layer with its own indexer it skips the indexer's
    scoring, whose key rows are still made: index share across draft steps), else the layer's own
    indexer (needs `index_pool`), else dense."""
    n, r, rd, nope = a.num_heads, a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim
    own_indexer = a.indexer is not None and not a.indexer.reuse_previous
    if a.indexer is not None and a.indexer.reuse_previous and selected is None:
        raise ValueError(f"{p}: this layer reuses the previous layer's top-k, but no selection was passed in")

    def proj(x_in: str, name: str) -> str:  # the projections transformers builds with bias=attention_bias
        y = linear(b, w, x_in, p + name + ".weight", name)
        return b.op("Add", y, w.plain(b, p + name + ".bias"), name=f"{name}/bias") if a.bias else y
    with b.scope("mla"):
        if a.q_lora_rank is None:
            q, q_resid = linear(b, w, x, p + "q_proj.weight", "q_proj"), None   # bias-free in transformers
        else:
            q_resid = rms_norm(b, proj(x, "q_a_proj"), w.plain(b, p + "q_a_layernorm.weight"), a.norm_eps,
                               "q_a_layernorm")
            q = linear(b, w, q_resid, p + "q_b_proj.weight", "q_b_proj")
        q = b.reshape(q, [0, 0, n, a.qk_head_dim])
        q_pe = rotate(b, b.slice(q, [nope], [a.qk_head_dim], [3]), cos, sin, rd, a.rope_interleave)
        kv_b = p + "kv_b_proj.weight"  # [n * (nope + v), r]
        w_uk = w.derived(b, kv_b + ".w_uk", lambda: w.raw(kv_b).reshape(n, nope + a.v_head_dim, r)[:, :nope]
                         .astype(w.np_dtype))                                        # [n, nope, r]
        q_nope = b.unsqueeze(b.slice(q, [0], [nope], [3]), [3])                      # [B, W, n, 1, nope]
        q_lat = b.squeeze(b.op("MatMul", q_nope, w_uk, name="absorb_uk"), [3])       # [B, W, n, r]
        query = b.concat([q_lat, q_pe], -1)                                          # [B, W, n, r + rope]

        kv = proj(x, "kv_a_proj_with_mqa")                                          # [B, W, r + rope]
        c_kv = rms_norm(b, b.slice(kv, [0], [r], [2]), w.plain(b, p + "kv_a_layernorm.weight"), a.norm_eps,
                        "kv_a_layernorm")
        k_pe = b.unsqueeze(b.slice(kv, [r], [a.latent_dim], [2]), [2])
        k_pe = rotate(b, k_pe, cos, sin, rd, a.rope_interleave)
        rows = b.concat([b.unsqueeze(c_kv, [2]), k_pe], -1)                          # [B, W, 1, r + rope]

        index_rows = None
        if own_indexer:
            if index_pool is None:
                raise ValueError(f"{p}: a layer with an indexer needs its index key pool")
            scored, index_rows = _indexer(b, a.indexer, rd, w, p + "indexer.", x, q_resid, cos, sin, context_lens,
                                          block_tables, index_pool, score=selected is None)
            selected = scored if selected is None else selected
        sel = selected if selected is not None else b.const(np.zeros((1, 1, 0), np.int64))
        attn = b.op(paged_sparse_attention.OP_TYPE, query, rows, rows, latent_pool, latent_pool, block_tables,
                    context_lens, sel, domain=TANDEM_DOMAIN, scale=a.scale, sliding_window=0,
                    select_new_rows=1, name="PagedSparseAttention")                   # [B, W, n, r + rope]
        # value = the latent part of the same rows: the pool serves as both caches (no second pool)
        latent = b.unsqueeze(b.slice(attn, [0], [r], [3]), [3])                     # [B, W, n, 1, r]
        w_uv = w.derived(b, kv_b + ".w_uv_t", lambda: np.ascontiguousarray(
            w.raw(kv_b).reshape(n, nope + a.v_head_dim, r)[:, nope:].transpose(0, 2, 1)).astype(w.np_dtype))
        heads = b.squeeze(b.op("MatMul", latent, w_uv, name="absorb_uv"), [3])     # [B, W, n, v]
        out = proj(b.reshape(heads, [0, 0, n * a.v_head_dim]), "o_proj")
    return MLAOutputs(out, rows, index_rows, sel)


def _indexer(b: GraphBuilder, d: IndexerSpec, rope_dim: int, w: Weights, p: str, x: str, q_resid: str, cos: str,
             sin: str, context_lens: str, block_tables: str, index_pool: str, score: bool = True
             ) -> tuple[str | None, str]:
    """Lightning indexer of prefix `p` ("...self_attn.indexer.") -> (selected, or None when not
    `score`; the new index key rows, always: the runtime commits them)."""
    with b.scope("indexer"):
        k = b.op("LayerNormalization", linear(b, w, x, p + "wk.weight", "wk"), w.plain(b, p + "k_norm.weight"),
                 w.plain(b, p + "k_norm.bias"), axis=-1, epsilon=d.norm_eps, name="k_norm")   # [B, W, Di]
        k = b.unsqueeze(k, [2])
        k = b.squeeze(b.concat([rotate(b, b.slice(k, [0], [rope_dim], [3]), cos, sin, rope_dim, d.rope_interleave),
                                b.slice(k, [rope_dim], [d.head_dim], [3])], -1), [2])
        if not score:
            return None, k
        q = b.reshape(linear(b, w, q_resid, p + "wq_b.weight", "wq_b"), [0, 0, d.num_heads, d.head_dim])
        q = b.concat([rotate(b, b.slice(q, [0], [rope_dim], [3]), cos, sin, rope_dim, d.rope_interleave),
                      b.slice(q, [rope_dim], [d.head_dim], [3])], -1)
        weights = b.op("Mul", cast(b, linear(b, w, x, p + "weights_proj.weight", "weights_proj"), w.dtype, "float32"),
                       b.const(np.float32(d.weights_scale)))
        selected = b.op(lightning_indexer.OP_TYPE, q, weights, k, index_pool, block_tables, context_lens,
                        domain=TANDEM_DOMAIN, scale=d.scale, top_k=d.topk, name="LightningIndexer")
    return selected, k
