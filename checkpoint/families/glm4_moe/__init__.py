"""GLM-4.5 / 4.6 / 4.7: `Glm4MoeForCausalLM` (model_type glm4_moe, the Hub's zai-org/GLM-4.5*). GQA
with q/k/v biases (no o_proj bias), optional q/k norms and NeoX RoPE on half of each head, plain
RMSNorm (x * w); DeepSeek-V3's MLP layout (the first `first_k_dense_replace` layers dense, then
sigmoid-routed MoE with groups and shared experts); NextN MTP layers, drafted as DeepSeek's are
(every head anchored on the target's hidden state).

Stored (Hub) -> canonical (transformers' Qwen3.5 text layout without `model.`):
    model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}, o_proj.weight, [q_norm, k_norm]  -> same names
    model.layers.{i}.mlp.{gate,up,down}_proj.weight (dense) and mlp.gate.{weight,e_score_correction_bias}
                                                                                       -> same names
    model.layers.{i}.mlp.experts.{k}.{gate,up,down}_proj.weight (Hub) or stacked
        mlp.experts.{gate_up_proj,down_proj} (transformers' save)                      -> stacked
    model.layers.{i}.mlp.shared_experts.*                                              -> layers.{i}.mlp.shared_expert.*
    model.layers.{N+j}.*                                -> mtp.layers.{j}.* (NextN head j: enorm, hnorm, eh_proj,
        an MoE decoder layer, shared_head.{norm,head}; without shared_head.head it drafts with lm_head);
        the Hub's copy of the embedding there is never read
"""

from __future__ import annotations

from tandem.checkpoint.description import AttentionSpec, LayerSpec, MLPKind, ModelDescription, MTPSpec
from tandem.checkpoint.families import deepseek_moe
from tandem.checkpoint.families.base import (
    ConfigError,
    checkpoint_dtype,
    config_value,
    eos_token_ids,
    nextn_fit_lm_heads,
    nextn_layout,
    nextn_unused_tensors,
    rope_settings,
)

FAMILY = "glm4_moe"
ARCHITECTURES = {"Glm4MoeForCausalLM": ("glm4_moe", "model.", None)}
IGNORED_PREFIXES = ()
# GLM-4.5 writes <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call> and thinks in <think>
CHAT_FORMATS = {"Glm4MoeForCausalLM": {"tool_calls": "glm", "reasoning": "think"}}
mtp_layout = nextn_layout              # NextN head j stored as decoder layer N+j
unused_tensors = nextn_unused_tensors  # each NextN layer's copy of the embedding
fit_mtp_to_tensors = nextn_fit_lm_heads
sources = deepseek_moe.sources         # DeepSeek-V3's stored names


def text_config(config: dict, architecture: str) -> dict:
    return config


def describe(config: dict, architecture: str, *, mtp_layers: int, mtp_source: str) -> ModelDescription:
    cfg = config
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"'hidden_act' is {cfg['hidden_act']!r}; GLM-4-MoE's MLPs are SwiGLU (silu)")
    n, hidden, heads = (int(config_value(cfg, k)) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads"))
    head_dim = int(config_value(cfg, "head_dim", hidden // heads))
    rotary_dim, theta, _ = rope_settings(cfg, head_dim, default_partial_factor=0.5)
    attention = AttentionSpec(
        num_heads=heads, num_kv_heads=int(config_value(cfg, "num_key_value_heads", heads)), head_dim=head_dim,
        rotary_dim=rotary_dim, rope_theta=theta, output_gate=False, qk_norm=bool(cfg.get("use_qk_norm", False)),
        bias=bool(cfg.get("attention_bias", False)), o_bias=False)
    mlp_types = deepseek_moe.mlp_types(cfg, n, first_dense_default=1)
    moe = deepseek_moe.moe_spec(cfg) if "sparse" in mlp_types or mtp_layers else None
    layers = tuple(LayerSpec(attention, MLPKind.MOE if t == "sparse" else MLPKind.DENSE) for t in mlp_types)
    mtp = None
    if mtp_layers:  # a NextN layer's index is past first_k_dense_replace: an MoE layer
        mtp = MTPSpec((LayerSpec(attention, MLPKind.MOE),) * mtp_layers, mtp_source, form="nextn", own_lm_head=True,
                      anchor="target")
    return ModelDescription(
        family=FAMILY, architecture=architecture, model_type=ARCHITECTURES[architecture][0],
        vocab_size=int(config_value(cfg, "vocab_size")), hidden_size=hidden,
        intermediate_size=int(config_value(cfg, "intermediate_size")), layers=layers, moe=moe,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), tie_word_embeddings=bool(cfg.get("tie_word_embeddings")),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
        dtype=checkpoint_dtype(config, cfg, default="bfloat16"), mtp=mtp, eos_token_ids=eos_token_ids(config, cfg),
        bos_token_id=cfg.get("bos_token_id"), norm_zero_centred=False)
