"""The MLP half of a decoder layer: dense SwiGLU and the routed MoE, built from the layer's spec
(LayerSpec's clamps, MoESpec's router) and the canonical weights. Nothing here knows a family.

    dense     down(act(gate(x), up(x)))
    act       silu(g) * u; with a SwiGLU limit L: min(silu(g), L) * clip(u, -L, L)
    MoE       router logits r = gate(x) (fp32)
              softmax router: p = softmax(r), top-k by p
              sigmoid router: p = sigmoid(r), top-k by p + e_score_correction_bias (if any)
              groups (DeepSeek, n_group > 1): only the topk_group groups with the best sum of their
              two best choice scores are eligible for the top-k
              weights p[top] (/ their sum when norm_topk_prob); routed sum x routed_scaling_factor
              + shared expert (x sigmoid(shared_expert_gate(x)) when gated)
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from tandem.checkpoint.description import LayerSpec, MLPKind, ModelDescription
from tandem.export.builder import GraphBuilder
from tandem.export.primitives import Weights, cast, linear, linears, silu


def mlp(b: GraphBuilder, desc: ModelDescription, w: Weights, x: str, p: str, layer: LayerSpec) -> str:
    """The MLP of `layer` (canonical prefix `p`) on x [B, W, H]."""
    with b.scope("mlp"):
        if layer.mlp == MLPKind.DENSE:
            return swiglu(b, w, x, p + "mlp.", layer.swiglu_limit)
        return _moe(b, desc, w, x, p + "mlp.", layer)


def swiglu(b: GraphBuilder, w: Weights, x: str, p: str, limit: float | None = None) -> str:
    gate, up = linears(b, w, x, (p + "gate_proj.weight", p + "up_proj.weight"), "gate_up_proj")   # one MatMul
    return linear(b, w, _act(b, w, gate, up, limit), p + "down_proj.weight", "down_proj")


def _act(b: GraphBuilder, w: Weights, gate: str, up: str, limit: float | None) -> str:
    """silu(gate) * up, clamped as transformers' Step3p7MLP / Step3p7Experts when `limit` is set."""
    act = silu(b, gate)
    if limit is None:
        return b.op("Mul", act, up)
    lim = b.const(np.asarray(limit, w.np_dtype))
    act = b.op("Min", act, lim, name="swiglu_limit/Min")
    up = b.op("Clip", up, b.const(np.asarray(-limit, w.np_dtype)), lim, name="swiglu_limit/Clip")
    return b.op("Mul", act, up)


def _route(b: GraphBuilder, desc: ModelDescription, w: Weights, x2: str, p: str) -> str:
    """x2 [T, H] -> dense routing weights [T, E] (zero off the top-k), float32 throughout: top-k
    ties must not depend on the export dtype (transformers routes in fp32 too)."""
    m = desc.moe
    logits = cast(b, linear(b, w, x2, p + "gate.weight", "gate"), w.dtype, "float32")
    probs = b.op("Softmax", logits, axis=-1) if m.router == "softmax" else b.op("Sigmoid", logits)
    choice = probs                                                              # [T, E]
    if m.score_correction_bias:  # picks the experts; the weights stay the unbiased scores
        choice = b.op("Add", probs, w.plain(b, p + "gate.e_score_correction_bias", np.float32), name="choice")
    if m.n_group > 1:
        choice = _group_limited(b, choice, m.n_group, m.topk_group, m.num_experts)
    top_v, top_i = b.op("TopK", choice, b.const([m.top_k], np.int64), outputs=2, axis=-1)
    if choice != probs:
        top_v = b.op("GatherElements", probs, top_i, axis=1)
    if m.norm_topk_prob:
        top_v = b.op("Div", top_v, b.op("ReduceSum", top_v, b.const([-1], np.int64), keepdims=1))
    route = b.op("ScatterElements", b.op("Mul", probs, b.const(0.0, np.float32)), top_i, top_v, axis=1)
    return cast(b, route, "float32", w.dtype)


def _group_limited(b: GraphBuilder, choice: str, n_group: int, topk_group: int, num_experts: int) -> str:
    """choice [T, E] -> the same with -inf outside the topk_group best of n_group expert groups,
    each scored by the sum of its two best choice scores (transformers' DeepseekV3TopkRouter)."""
    with b.scope("groups"):
        grouped = b.reshape(choice, [0, n_group, num_experts // n_group])                    # [T, G, E/G]
        best2, _ = b.op("TopK", grouped, b.const([2], np.int64), outputs=2, axis=-1)
        scores = b.op("ReduceSum", best2, b.const([-1], np.int64), keepdims=0)               # [T, G]
        _, keep = b.op("TopK", scores, b.const([topk_group], np.int64), outputs=2, axis=-1)  # [T, topk_group]
        ones = b.op("Expand", b.const(np.float32(1)), b.shape_of(keep))
        kept = b.op("ScatterElements", b.op("Mul", scores, b.const(0.0, np.float32)), keep, ones, axis=1)
        mask = b.op("Expand", b.unsqueeze(kept, [2]), b.shape_of(grouped))                   # [T, G, E/G]
        eligible = b.op("Cast", b.reshape(mask, [0, num_experts]), to=TensorProto.BOOL)    # [T, E]
        return b.op("Where", eligible, choice, b.const(-np.inf, np.float32), name="eligible")


def _moe(b: GraphBuilder, desc: ModelDescription, w: Weights, x: str, p: str, layer: LayerSpec) -> str:
    """Routed experts, all computed densely and weighted (a fused MoE kernel is a lowering), plus
    the shared expert."""
    m = desc.moe
    shape = b.shape_of(x)
    x2 = b.reshape(x, [-1, desc.hidden_size])                                   # [T, H]
    route = _route(b, desc, w, x2, p)
    gate_up = w.derived(b, p + "experts.gate_up_proj.T",   # [E, H, 2I], gate columns first
                        lambda: w.raw(p + "experts.gate_up_proj").transpose(0, 2, 1).astype(w.np_dtype))
    down = w.derived(b, p + "experts.down_proj.T",         # [E, I, H]
                     lambda: w.raw(p + "experts.down_proj").transpose(0, 2, 1).astype(w.np_dtype))
    i = m.expert_intermediate_size
    h = b.op("MatMul", b.unsqueeze(x2, [0]), gate_up, name="experts/gate_up/MatMul")   # [E, T, 2I]
    act = _act(b, w, b.slice(h, [0], [i], [2]), b.slice(h, [i], [2 * i], [2]), layer.swiglu_limit)
    y = b.op("MatMul", act, down, name="experts/down/MatMul")                           # [E, T, H]
    weighted = b.op("Mul", y, b.unsqueeze(b.op("Transpose", route, perm=[1, 0]), [2]))
    out = b.op("ReduceSum", weighted, b.const([0], np.int64), keepdims=0)              # [T, H]
    if m.routed_scaling_factor != 1.0:
        out = b.op("Mul", out, b.const(np.asarray(m.routed_scaling_factor, w.np_dtype)), name="routed_scaling")
    if m.shared_expert_intermediate_size:
        with b.scope("shared_expert"):
            shared = swiglu(b, w, x2, p + "shared_expert.", layer.shared_swiglu_limit)
        if m.shared_expert_gate:
            shared = b.op("Mul", shared, b.op("Sigmoid", linear(b, w, x2, p + "shared_expert_gate.weight",
                                                                  "shared_expert_gate")))
        out = b.op("Add", out, shared)
    return b.reshape(out, shape)
