"""Subgraph builders for one decoder layer's mixer (attention, Gated DeltaNet) and the residual
block around it, built straight from the weights and the layer's spec (the MLP half: mlp.py).

Shapes: x [B, W, H]; heads split as [B, W, heads, dim]. Norms are zero-centred RMSNorm (primitives.py)
unless the description says plain (DeepSeek); sparse MLA is mla.py's piece.

Precision: activations and weights are in the export dtype (float32 or float16). RoPE angles,
the Gated DeltaNet recurrence (its inputs, gate math, state and gated norm) and the MoE router
stay float32; attention scores are float32 inside PagedSparseAttention.

    attention:        x -> q_proj, k_proj, v_proj [+ biases] -> q per head ([q | gate] with the packed output
                      gate); [q_norm, k_norm]; partial NeoX RoPE with the layer's own (rotary_dim, theta)
                      -> PagedSparseAttention(q, k, v, pools, the page group's table, scale, window)
                      [* sigmoid(g_proj(x)) per head]  [* sigmoid(gate) elementwise] -> o_proj [+ bias]
    Gated DeltaNet:   x -> in_proj_qkv -> causal conv (with the K-1 window) -> SiLU -> q | k | v
                      q, k: L2 norm; beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias)
                      -> GatedDeltaNet -> RMSNormGated(., z) -> out_proj
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from tandem.checkpoint.description import AttentionSpec, LayerSpec, LinearAttentionSpec, ModelDescription, mixer_name
from tandem.checkpoint.mla_specs import MLASpec
from tandem.export.builder import TANDEM_DOMAIN, GraphBuilder
from tandem.export.mla import rope_tables
from tandem.export.mlp import mlp
from tandem.export.ops import gated_deltanet, paged_sparse_attention
from tandem.export.primitives import Weights, cast, linear, linears, rms_norm, silu


@dataclass(frozen=True)
class Paging:
    """The graph-level tensors the attention layers read: one block table per page group
    (sliding window, None = full attention) and one cos/sin pair per distinct RoPE."""

    context_lens: str                                      # [B]
    tables: dict[int | None, str]                          # window -> block tables [B, P]
    rotary: dict[tuple, tuple[str, str]]                   # rope_key -> cos, sin [B, W, 1, D] (MLA: [.., rd / 2])
    selected: str       # [B|1, W|1, K] committed positions each row may see; K = 0: dense

    def table(self, a: AttentionSpec | MLASpec) -> str:
        return self.tables[a.window]

    def rope(self, a: AttentionSpec | MLASpec) -> tuple[str, str]:
        return self.rotary[rope_key(a)]


def rope_key(a: AttentionSpec | MLASpec) -> tuple:
    """Layers with equal keys share one cos/sin pair: (rotary_dim, theta, head_dim); MLA: (rope dims,
    theta, its YaRN)."""
    return _ROPE_TABLES[mixer_name(a)][0](a)


def rope_pair(b: GraphBuilder, a: AttentionSpec | MLASpec, positions: str, dtype: str, scope: str) -> tuple[str, str]:
    """The cos/sin pair layer `a` reads: NeoX tables [.., D] (rotary_tables) or MLA's per-pair ones [.., rd / 2]."""
    return _ROPE_TABLES[mixer_name(a)][1](b, a, positions, dtype, scope)


def _mla_rope_pair(b: GraphBuilder, a: MLASpec, positions: str, dtype: str, scope: str) -> tuple[str, str]:
    with b.scope(scope):
        return rope_tables(b, a, positions, dtype)


# attention mixer (description.MIXERS' name) -> (its rope key, its cos/sin tables)
_ROPE_TABLES = {
    "attention": (lambda a: (a.rotary_dim, float(a.rope_theta), a.head_dim),
                  lambda b, a, positions, dtype, scope: rotary_tables(b, a, positions, scope)),
    "mla": (lambda a: (a.qk_rope_head_dim, float(a.rope_theta), a.yarn), _mla_rope_pair),
}


def norm_scale(b: GraphBuilder, desc: ModelDescription, w: Weights, name: str) -> str:
    """RMSNorm scale of `name`: 1 + w for zero-centred norms (Qwen3.5, Step-3.5), w itself for plain
    ones (DeepSeek: x * w)."""
    return w.plus_one(b, name) if desc.norm_zero_centred else w.plain(b, name)


def rotary_tables(b: GraphBuilder, a: AttentionSpec, positions: str, scope: str = "rotary") -> tuple[str, str]:
    """(cos, signed sin) [B, W, 1, D] float32 (apply_rotary computes in float32 in every dtype) for
    int64 positions [B, W], `a`'s theta and partial rotary dims rd (NeoX layout: freqs repeated
    twice), laid out for apply_rotary: over dims rd..D cos is 1 and sin 0 (they pass through), and
    sin is negated on the first half (rotate_half's sign). The angles are float32 (position x
    frequency needs the mantissa)."""
    half, pad = a.rotary_dim // 2, a.head_dim - a.rotary_dim
    inv_freq = 1.0 / (a.rope_theta ** (np.arange(0, a.rotary_dim, 2, dtype=np.float64) / a.rotary_dim))
    with b.scope(scope):
        freqs = b.op("Mul", b.unsqueeze(b.op("Cast", positions, to=TensorProto.FLOAT), [2]),
                     b.const(inv_freq.astype(np.float32)))                   # [B, W, rd/2]
        emb = b.unsqueeze(b.concat([freqs, freqs], -1), [2])                 # [B, W, 1, rd]
        cos, sin = b.op("Cos", emb, name="cos"), b.op("Sin", emb, name="sin")
        sign = np.concatenate([-np.ones(half), np.ones(half)]).astype(np.float32)
        sin = b.op("Mul", sin, b.const(sign))
        if pad:
            shape = b.concat([b.shape_of(emb, 0, 3), b.const([pad], np.int64)], 0)       # [B, W, 1, D-rd]
            fill = lambda v: b.op("Expand", b.const(np.full(pad, v, np.float32)), shape)  # noqa: E731
            cos, sin = b.concat([cos, fill(1.0)], -1), b.concat([sin, fill(0.0)], -1)
        return cos, sin


def apply_rotary(b: GraphBuilder, x: str, cos: str, sin: str, head_dim: int, rotary_dim: int, dtype: str) -> str:
    """Partial NeoX RoPE on x [B, W, H, D]: x * cos + rotate_half(x) * sin on the first rotary_dim
    dims, the rest as they are, as x * cos + x[perm] * sin with rotary_tables' padded, signed
    tables (perm swaps the two halves of the rotary dims): one Gather and three elementwise nodes
    per tensor where slicing, negating and concatenating took ten. The same products and sum as
    rotate_half's, so the same bits; a pass-through dim is x * 1 + x' * 0 = x.
    In float32 whatever `dtype`, with one explicit Cast back: ONNX Runtime CPU runs fp16 Mul / Add
    through casts it inserts and may drop as precision-free, and the new K rows an attention call
    reads must be rounded exactly as the ones it stores (row invariance of fp16 engines)."""
    half = rotary_dim // 2
    perm = np.concatenate([np.arange(half, rotary_dim), np.arange(half), np.arange(rotary_dim, head_dim)])
    x = cast(b, x, dtype, "float32")
    swapped = b.op("Gather", x, b.const(perm.astype(np.int64)), axis=3, name="rotate_half")
    return cast(b, b.op("Add", b.op("Mul", x, cos), b.op("Mul", swapped, sin)), "float32", dtype)


def attention(b: GraphBuilder, desc: ModelDescription, a: AttentionSpec, w: Weights, x: str, p: str,
              paging: Paging, key_pool: str, value_pool: str) -> tuple[str, str, str]:
    """Attention `a` of canonical layer prefix `p` -> (output, new K rows, new V rows)."""
    eps = desc.rms_norm_eps
    hd = a.head_dim
    with b.scope("attn"):
        projections = [p + f"self_attn.{n}_proj.weight" for n in ("q", "k", "v", "g")[: 3 + a.head_gate]]
        q, k, v, *g = linears(b, w, x, tuple(projections), "qkv_proj")   # one MatMul: same input
        if a.bias:  # q/k/v biases (GLM, Qwen with attention_bias), before the heads are split
            q, k, v = (b.op("Add", y, w.plain(b, p + f"self_attn.{n}_proj.bias"), name=f"{n}_proj/bias")
                       for y, n in ((q, "q"), (k, "k"), (v, "v")))
        if a.output_gate:  # [Hq, 2D] per head: query | elementwise gate
            qg = b.reshape(q, [0, 0, a.num_heads, 2 * hd])
            q = b.slice(qg, [0], [hd], [3])                                   # [B, W, Hq, D]
            gate = b.reshape(b.slice(qg, [hd], [2 * hd], [3]), [0, 0, a.num_heads * hd])
        else:
            q = b.reshape(q, [0, 0, a.num_heads, hd])
        k = b.reshape(k, [0, 0, a.num_kv_heads, hd])
        v = b.reshape(v, [0, 0, a.num_kv_heads, hd])
        if a.qk_norm:
            q = rms_norm(b, q, norm_scale(b, desc, w, p + "self_attn.q_norm.weight"), eps, "q_norm")
            k = rms_norm(b, k, norm_scale(b, desc, w, p + "self_attn.k_norm.weight"), eps, "k_norm")
        cos, sin = paging.rope(a)
        q = apply_rotary(b, q, cos, sin, hd, a.rotary_dim, w.dtype)
        k = apply_rotary(b, k, cos, sin, hd, a.rotary_dim, w.dtype)
        attn = b.op(paged_sparse_attention.OP_TYPE, q, k, v, key_pool, value_pool, paging.table(a),
                    paging.context_lens, paging.selected, domain=TANDEM_DOMAIN, scale=float(a.scale),
                    sliding_window=a.window or 0, name="PagedSparseAttention")     # [B, W, Hq, D]
        if a.head_gate:  # one sigmoid gate per head: g_proj [Hq, H]
            gate_h = b.op("Sigmoid", g[0])                                                   # [B, W, Hq]
            attn = b.op("Mul", attn, b.unsqueeze(gate_h, [3]), name="head_gate")
        attn = b.reshape(attn, [0, 0, a.num_heads * hd])
        if a.output_gate:
            attn = b.op("Mul", attn, b.op("Sigmoid", gate))
        out = linear(b, w, attn, p + "self_attn.o_proj.weight", "o_proj")
        if a.o_bias:
            out = b.op("Add", out, w.plain(b, p + "self_attn.o_proj.bias"), name="o_proj/bias")
    return out, k, v


@dataclass(frozen=True)
class GDNOutputs:
    output: str
    state: str          # [B, Hv, dk, dv] after state_rows rows, or [B, W, Hv, dk, dv] per row
    conv_padded: str    # [B, K-1+W, C]: the conv window followed by this step's conv inputs


def gated_deltanet_layer(b: GraphBuilder, desc: ModelDescription, g: LinearAttentionSpec, w: Weights, x: str,
                         p: str, recurrent_state: str, conv_state: str, state_rows: str,
                         row_states: bool, conv_index: str) -> GDNOutputs:
    """Gated DeltaNet mixer `g` of canonical prefix `p`; states are the gathered per-sequence ones
    (conv_state [B, K-1, C]); conv_index: conv_windows_index(), one per graph."""
    eps = desc.rms_norm_eps
    q = p + "linear_attn."
    with b.scope("linear_attn"):
        qkv, z, b_proj, a_proj = linears(b, w, x, tuple(q + f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")),
                                         "in_proj")                     # one MatMul: qkv [B, W, C], ...
        z = b.reshape(z, [0, 0, g.num_value_heads, g.value_head_dim])
        f32 = lambda t: cast(b, t, w.dtype, "float32")  # noqa: E731 (the recurrence runs in fp32)
        beta = b.op("Sigmoid", f32(b_proj))
        a_proj = f32(a_proj)
        neg_a = w.derived(b, q + "A_log.neg_exp", lambda: (-np.exp(w.raw(q + "A_log"))).astype(np.float32))
        decay = b.op("Mul", neg_a, b.op("Softplus", b.op("Add", a_proj, w.plain(b, q + "dt_bias", np.float32))))
        with b.scope("conv"):
            padded = b.concat([conv_state, qkv], 1)     # [B, K-1+W, C]: the state's K-1 inputs, then this call's
            taps = w.derived(b, q + "conv1d.weight.taps",    # [C, 1, K] -> [K, C], made here: no runtime fold
                             lambda: w.raw(q + "conv1d.weight").reshape(g.conv_dim, g.conv_kernel).T.astype(w.np_dtype))
            conv = causal_conv(b, padded, taps, conv_index)
            mixed = f32(silu(b, conv))                                                     # [B, W, C]
        kd = g.key_dim
        shape_k = [0, 0, g.num_key_heads, g.key_head_dim]
        qh = b.reshape(b.slice(mixed, [0], [kd], [2]), shape_k)
        kh = b.reshape(b.slice(mixed, [kd], [2 * kd], [2]), shape_k)
        vh = b.reshape(b.slice(mixed, [2 * kd], [2 * kd + g.value_dim], [2]), [0, 0, g.num_value_heads,
                                                                                  g.value_head_dim])
        qh, kh = l2_norm(b, qh, g.key_head_dim), l2_norm(b, kh, g.key_head_dim)
        outs = b.op(gated_deltanet.OP_TYPE, qh, kh, vh, decay, beta, recurrent_state, state_rows,
                    domain=TANDEM_DOMAIN, outputs=3 if row_states else 2, scale=float(g.key_head_dim ** -0.5),
                    num_key_heads=g.num_key_heads, num_value_heads=g.num_value_heads, name="GatedDeltaNet")
        # the gated norm reads the fp32 output (as transformers' RMSNormGated): per-head RMSNorm
        # scales up heads with small outputs, and their fp16 rounding with them (logits error -30%)
        normed = rms_norm(b, outs[0], w.plain(b, q + "norm.weight", np.float32), eps, "norm")  # [B, W, Hv, dv]
        gated = b.op("Mul", cast(b, normed, "float32", w.dtype), silu(b, z))
        out = linear(b, w, b.reshape(gated, [0, 0, g.value_dim]), q + "out_proj.weight", "out_proj")
    return GDNOutputs(out, outs[2] if row_states else outs[1], padded)


def conv_windows_index(b: GraphBuilder, ids: str, kernel: int) -> str:
    """[W, K]: row t's conv window is rows t .. t+K-1 of the state's K-1 inputs followed by the call's
    W (W from ids [B, W]). The same for every Gated DeltaNet layer of a graph: built once."""
    w_len = b.squeeze(b.shape_of(ids, 1, 2), [0])                                          # W
    t = b.op("Range", b.const(np.array(0, np.int64)), w_len, b.const(np.array(1, np.int64)))
    return b.op("Add", b.unsqueeze(t, [1]), b.const(np.arange(kernel)[None, :], np.int64), name="conv_windows")


def causal_conv(b: GraphBuilder, padded: str, taps: str, index: str) -> str:
    """Depthwise causal conv1d over padded [B, K-1+W, C] (the state's K-1 inputs, then the call's W)
    with taps [K, C] (conv1d.weight [C, 1, K] transposed) -> [B, W, C]: windows gathered as
    [B, W, K, C] (whole C-rows, index [W, K]: conv_windows_index), times the taps, summed over K.
    Not Conv: ONNX Runtime's Conv rounds a 1-position output (decode) differently from the same
    position among W (verify), and the exactness contract needs each row's result independent of
    how many rows a call has. The state is kept position-major [K-1, C] so that no Transpose runs."""
    windows = b.op("Gather", padded, index, axis=1)                                         # [B, W, K, C]
    return b.op("ReduceSum", b.op("Mul", windows, taps), b.const(np.array([2], np.int64)), keepdims=0)


def l2_norm(b: GraphBuilder, x: str, dim: int) -> str:
    """x * rsqrt(sum(x^2) + 1e-6) over the last axis (FLA's l2norm), as one RMSNormalization node
    (six before: at batch 1 each node costs more than its arithmetic): sum = D x mean, so
    x / sqrt(sum + eps) = x / sqrt(mean + eps / D) x D^-1/2, a constant scale."""
    scale = b.const(np.full(dim, dim ** -0.5, np.float32))
    return b.op("RMSNormalization", x, scale, axis=-1, epsilon=1e-6 / dim, stash_type=1, name="l2_norm")


def decoder_layer(b: GraphBuilder, desc: ModelDescription, w: Weights, x: str, p: str, layer: LayerSpec,
                  mixer, kept_rows=None) -> tuple[str, object]:
    """Pre-norm residual block: x + mixer(norm(x)), then + mlp(norm(.)). `mixer(xn)` returns
    (output, extra) where extra carries the layer's new K/V or state tensors. `kept_rows(h)`: the
    rows of the residual stream the MLP runs on, where the caller needs fewer than the mixer's (an
    MTP head needs every row's new K/V but only its last row's output)."""
    eps = desc.rms_norm_eps
    xn = rms_norm(b, x, norm_scale(b, desc, w, p + "input_layernorm.weight"), eps, "input_layernorm")
    mixed, extra = mixer(xn)
    h = b.op("Add", x, mixed, name="residual_attn")
    if kept_rows is not None:
        h = kept_rows(h)
    hn = rms_norm(b, h, norm_scale(b, desc, w, p + "post_attention_layernorm.weight"), eps,
                  "post_attention_layernorm")
    return b.op("Add", h, mlp(b, desc, w, hn, p, layer), name="residual_mlp"), extra
