"""Canonical tensors of each layer mixer and MLP, declared once: every family's weight map starts
from these names and shapes (then renames them to what its checkpoints store).

    trunk       embed_tokens [V, H], layers.{i}.*, norm [H], lm_head [V, H]
    layer       input_layernorm, post_attention_layernorm [H] + its mixer's tensors + its MLP's
    mixers      AttentionSpec (GQA, optional gates, biases, q/k norms), LinearAttentionSpec (Gated
                DeltaNet), MLASpec (DeepSeek MLA with the lightning indexer): MIXER_SHAPES
    MLP         dense SwiGLU, or MoE with experts stacked [E, 2I, H] / [E, H, I] and a shared expert
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tandem.checkpoint.description import (
    AttentionSpec,
    LayerSpec,
    LinearAttentionSpec,
    MLPKind,
    ModelDescription,
)
from tandem.checkpoint.families.base import Shape, Source, nextn_shapes, single
from tandem.checkpoint.mla_specs import MLASpec


def attention_shapes(d: ModelDescription, p: str, a: AttentionSpec) -> dict[str, Shape]:
    h = d.hidden_size
    q_rows = a.num_heads * a.head_dim * (2 if a.output_gate else 1)
    kv_rows = a.num_kv_heads * a.head_dim
    s = p + "self_attn."
    out = {s + "q_proj.weight": (q_rows, h), s + "k_proj.weight": (kv_rows, h), s + "v_proj.weight": (kv_rows, h),
           s + "o_proj.weight": (h, a.num_heads * a.head_dim)}
    if a.qk_norm:
        out.update({s + "q_norm.weight": (a.head_dim,), s + "k_norm.weight": (a.head_dim,)})
    if a.bias:
        out.update({s + "q_proj.bias": (q_rows,), s + "k_proj.bias": (kv_rows,), s + "v_proj.bias": (kv_rows,)})
    if a.o_bias:
        out[s + "o_proj.bias"] = (h,)
    if a.head_gate:
        out[s + "g_proj.weight"] = (a.num_heads, h)
    return out


def linear_attention_shapes(d: ModelDescription, p: str, g: LinearAttentionSpec) -> dict[str, Shape]:
    h, q = d.hidden_size, p + "linear_attn."
    return {q + "in_proj_qkv.weight": (g.conv_dim, h), q + "in_proj_z.weight": (g.value_dim, h),
            q + "in_proj_b.weight": (g.num_value_heads, h), q + "in_proj_a.weight": (g.num_value_heads, h),
            q + "conv1d.weight": (g.conv_dim, 1, g.conv_kernel), q + "A_log": (g.num_value_heads,),
            q + "dt_bias": (g.num_value_heads,), q + "norm.weight": (g.value_head_dim,),
            q + "out_proj.weight": (h, g.value_dim)}


def mla_shapes(d: ModelDescription, p: str, a: MLASpec) -> dict[str, Shape]:
    h, s = d.hidden_size, p + "self_attn."
    out = {s + "kv_a_proj_with_mqa.weight": (a.latent_dim, h), s + "kv_a_layernorm.weight": (a.kv_lora_rank,),
           s + "kv_b_proj.weight": (a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
           s + "o_proj.weight": (h, a.num_heads * a.v_head_dim)}
    q_rows = a.num_heads * a.qk_head_dim
    if a.q_lora_rank is None:
        out[s + "q_proj.weight"] = (q_rows, h)
    else:
        out.update({s + "q_a_proj.weight": (a.q_lora_rank, h), s + "q_a_layernorm.weight": (a.q_lora_rank,),
                    s + "q_b_proj.weight": (q_rows, a.q_lora_rank)})
    if a.bias:
        q_first = "q_proj" if a.q_lora_rank is None else "q_a_proj"
        out.update({s + f"{q_first}.bias": (out[s + f"{q_first}.weight"][0],),
                    s + "kv_a_proj_with_mqa.bias": (a.latent_dim,), s + "o_proj.bias": (h,)})
    i = a.indexer
    if i is not None and not i.reuse_previous:
        x = s + "indexer."
        out.update({x + "wq_b.weight": (i.num_heads * i.head_dim, a.q_lora_rank), x + "wk.weight": (i.head_dim, h),
                    x + "k_norm.weight": (i.head_dim,), x + "k_norm.bias": (i.head_dim,),
                    x + "weights_proj.weight": (i.num_heads, h)})
    return out


# mixer spec type -> its canonical tensors (the one place a new mixer declares them)
MIXER_SHAPES: dict[type, Callable[[ModelDescription, str, object], dict[str, Shape]]] = {
    AttentionSpec: attention_shapes, LinearAttentionSpec: linear_attention_shapes, MLASpec: mla_shapes}


def mlp_shapes(d: ModelDescription, p: str, kind: MLPKind) -> dict[str, Shape]:
    h, m = d.hidden_size, p + "mlp."
    if kind == MLPKind.DENSE:
        i = d.intermediate_size
        return {m + "gate_proj.weight": (i, h), m + "up_proj.weight": (i, h), m + "down_proj.weight": (h, i)}
    e, i, s = d.moe.num_experts, d.moe.expert_intermediate_size, d.moe.shared_expert_intermediate_size
    out = {m + "gate.weight": (e, h), m + "experts.gate_up_proj": (e, 2 * i, h),
           m + "experts.down_proj": (e, h, i), m + "shared_expert.gate_proj.weight": (s, h),
           m + "shared_expert.up_proj.weight": (s, h), m + "shared_expert.down_proj.weight": (h, s)}
    if d.moe.shared_expert_gate:
        out[m + "shared_expert_gate.weight"] = (1, h)
    if d.moe.score_correction_bias:
        out[m + "gate.e_score_correction_bias"] = (e,)
    return out


def layer_shapes(d: ModelDescription, p: str, layer: LayerSpec) -> dict[str, Shape]:
    h = d.hidden_size
    out = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    out.update(MIXER_SHAPES[type(layer.mixer)](d, p, layer.mixer))
    out.update(mlp_shapes(d, p, layer.mlp))
    return out


def trunk_shapes(d: ModelDescription) -> dict[str, Shape]:
    h, v = d.hidden_size, d.vocab_size
    out = {"embed_tokens.weight": (v, h)}
    for i, layer in enumerate(d.layers):
        out.update(layer_shapes(d, f"layers.{i}.", layer))
    out["norm.weight"] = (h,)
    out["lm_head.weight"] = (v, h)
    return out


def nextn_model_shapes(d: ModelDescription) -> dict[str, Shape]:
    """The trunk, then per NextN head j its own tensors (base.nextn_shapes) and its decoder layer."""
    out = trunk_shapes(d)
    for j, layer in enumerate(d.mtp.layers if d.mtp else ()):
        out.update(nextn_shapes(d, j))
        out.update(layer_shapes(d, f"mtp.layers.{j}.", layer))
    return out


# ---- experts as stored -----------------------------------------------------------------------

def _stack_experts(parts: list[np.ndarray]) -> np.ndarray:
    return np.stack(parts)


def _stack_gate_up(parts: list[np.ndarray]) -> np.ndarray:
    # parts = [gate_0, up_0, gate_1, up_1, ...] -> [E, 2I, H] with gate rows first per expert
    return np.stack([np.concatenate(parts[k : k + 2]) for k in range(0, len(parts), 2)])


def expert_sources(canonical: str, shape: Shape, stored_prefix: str, per_expert: bool) -> Source:
    """Stacked experts as stored (transformers' saves, Qwen3.5-MoE bf16) or gathered from per-expert
    tensors (`...mlp.experts.{k}.{gate,up,down}_proj.weight`, DeepSeek's and GLM's Hub releases)."""
    if not per_expert:
        return single(stored_prefix + canonical, shape)
    base = stored_prefix + canonical.rsplit(".", 1)[0]  # ...mlp.experts
    e = shape[0]
    if canonical.endswith("gate_up_proj"):
        i = shape[1] // 2
        names, shapes = [], []
        for k in range(e):
            names += [f"{base}.{k}.gate_proj.weight", f"{base}.{k}.up_proj.weight"]
            shapes += [(i, shape[2]), (i, shape[2])]
        return Source(tuple(names), tuple(shapes), _stack_gate_up)
    return Source(tuple(f"{base}.{k}.down_proj.weight" for k in range(e)), tuple([shape[1:]] * e), _stack_experts)


def uses_per_expert(stored_names) -> bool:
    return any(".mlp.experts.0." in n for n in stored_names)
