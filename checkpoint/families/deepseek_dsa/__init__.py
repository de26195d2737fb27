"""DeepSeek Sparse Attention models: `DeepseekV32ForCausalLM` (model_type deepseek_v32, the Hub's
deepseek-ai/DeepSeek-V3.2*) and `GlmMoeDsaForCausalLM` (model_type glm_moe_dsa, zai-org/GLM-5*).
One module: both are transformers 5.24's DeepSeek-V3 MLA + lightning indexer + DeepSeek MoE with a
NextN MTP layer, and differ only in the indexer's RoPE pairing (GLM-5: interleaved) and GLM-5's
per-layer top-k reuse (`indexer_types`: "shared" layers take the previous layer's selection).

Stored (Hub) -> canonical (transformers' Qwen3.5 text layout without `model.`):
    model.layers.{i}.self_attn.{q_a_proj,q_a_layernorm,q_b_proj,kv_a_proj_with_mqa,kv_a_layernorm,
        kv_b_proj,o_proj}.*, self_attn.indexer.{wq_b,wk,k_norm,weights_proj}.*    -> same names
    model.layers.{i}.mlp.gate.{weight,e_score_correction_bias}                   -> same names
    model.layers.{i}.mlp.experts.{k}.{gate,up,down}_proj.weight (Hub) or stacked
        mlp.experts.{gate_up_proj,down_proj} (transformers' save)                -> stacked [E, 2I, H], [E, H, I]
    model.layers.{i}.mlp.shared_experts.*                                        -> layers.{i}.mlp.shared_expert.*
    model.layers.{N+j}.*                                                         -> mtp.layers.{j}.* (NextN head
        j: enorm, hnorm, eh_proj, a full sparse-MLA MoE decoder layer, shared_head.{norm,head}, the
        head optional: without it the target's lm_head projects, see fit_mtp_to_tensors); the Hub's
        copy of the embedding there (`model.layers.{N+j}.embed_tokens.weight`) may be present and is
        never read: the head embeds with the target's embed_tokens.

Config: transformers 5.24's form (`rope_parameters`, `mlp_layer_types`) and the Hub's
(`rope_scaling` + `rope_theta`, `first_k_dense_replace`). What transformers computes otherwise is
refused: q LoRA is always on (the indexer reads its residual), MLA RoPE is always interleaved,
scoring is sigmoid with the correction bias (`noaux_tc`), every trunk layer is indexed attention;
RoPE is plain or YaRN. NextN layers run their own indexer (GLM-5's pattern covers the trunk only).
"""

from __future__ import annotations

from tandem.checkpoint.description import LayerSpec, MLPKind, ModelDescription, MTPSpec
from tandem.checkpoint.families import deepseek_moe
from tandem.checkpoint.families.base import (
    ConfigError,
    checkpoint_dtype,
    config_value,
    eos_token_ids,
    nextn_fit_lm_heads,
    nextn_layout,
    nextn_unused_tensors,
)
from tandem.checkpoint.mla_specs import IndexerSpec, MLASpec, YarnSpec

FAMILY = "deepseek_dsa"
# architecture -> (model_type, prefix of the text weights, config key holding the text config)
ARCHITECTURES = {
    "DeepseekV32ForCausalLM": ("deepseek_v32", "model.", None),
    "GlmMoeDsaForCausalLM": ("glm_moe_dsa", "model.", None),
}
IGNORED_PREFIXES = ()
# chat formats the server parses: GLM-5 writes <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>;
# DeepSeek-V3.2's DSML tool calls are not parsed yet (refused); both think in <think>
CHAT_FORMATS = {"DeepseekV32ForCausalLM": {"tool_calls": None, "reasoning": "think"},
                "GlmMoeDsaForCausalLM": {"tool_calls": "glm", "reasoning": "think"}}
BLOCK_FP8 = True  # DeepSeek's fp8 block-quantized releases are read dequantized (validation.block_fp8_scales)
ROPE_TYPES = ("default", "yarn")
# config key -> the only value transformers 5.24 computes (when the key is present at all)
_FIXED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu", "mlp_bias": False,
          "rope_interleave": True, "moe_layer_freq": 1}


def text_config(config: dict, architecture: str) -> dict:
    return config


mtp_layout = nextn_layout  # NextN head j stored as decoder layer N+j, as for Step-3.5


def _refuse_unsupported(cfg: dict) -> None:
    for key, value in _FIXED.items():
        if key in cfg and cfg[key] != value:
            raise ConfigError(f"'{key}' is {cfg[key]!r}; transformers 5.24's DeepSeek-V3.2 / GLM-5 always computes "
                              f"{value!r}, and tandem only supports that form")
    if cfg.get("q_lora_rank") is None:
        raise ConfigError("'q_lora_rank' is missing or null; DeepSeek-V3.2 / GLM-5 attention always projects the "
                          "query through q LoRA (the lightning indexer reads its residual)")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"'partial_rotary_factor' is {cfg['partial_rotary_factor']}; MLA rotates exactly "
                          "qk_rope_head_dim dims")
    if any(t != "indexed_attention" for t in cfg.get("layer_types") or ()):
        raise ConfigError(f"layer_types holds {sorted(set(cfg['layer_types']) - {'indexed_attention'})}; every "
                          "DeepSeek-V3.2 / GLM-5 layer is 'indexed_attention'")


def _rope(cfg: dict) -> tuple[float, YarnSpec | None]:
    """(theta, YaRN or None) from `rope_parameters` (transformers 5) or the Hub's `rope_scaling`."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope_type {rope_type!r} is not supported (supported: {ROPE_TYPES})")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    original = int(config_value(params, "original_max_position_embeddings"))
    factor = params.get("factor") or int(config_value(cfg, "max_position_embeddings")) / original
    return theta, YarnSpec(
        factor=float(factor), original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))


def indexer_types(cfg: dict, n: int) -> list[str]:
    """GLM-5's per-layer indexer mode ("full" or "shared"), as transformers' GlmMoeDsaConfig derives
    it: `indexer_types`, else `index_topk_pattern` ("F"/"S"), else every (i - offset + 1)-th layer
    of `index_topk_freq` runs it. DeepSeek-V3.2: every layer is "full"."""
    if cfg.get("indexer_types") is not None:
        types = list(cfg["indexer_types"])
    elif cfg.get("index_topk_pattern") is not None:
        pattern = cfg["index_topk_pattern"]
        try:
            types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        except KeyError as e:
            raise ConfigError(f"index_topk_pattern {pattern!r} holds {e}; use 'F' (full) and 'S' (shared)") from e
    else:
        freq, offset = max(int(cfg.get("index_topk_freq", 1)), 1), int(cfg.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(types) < n or set(types) - {"full", "shared"}:
        raise ConfigError(f"indexer_types {types} must give 'full' or 'shared' for each of the {n} layers")
    if types[0] == "shared":
        raise ConfigError("indexer_types[0] is 'shared', but layer 0 has no previous layer whose top-k it could reuse")
    return types[:n]


def describe(config: dict, architecture: str, *, mtp_layers: int, mtp_source: str) -> ModelDescription:
    cfg = text_config(config, architecture)
    _refuse_unsupported(cfg)
    n = int(config_value(cfg, "num_hidden_layers"))
    theta, yarn = _rope(cfg)
    glm = ARCHITECTURES[architecture][0] == "glm_moe_dsa"
    types = indexer_types(cfg, n) if glm else ["full"] * n

    def mla(reuse: bool) -> MLASpec:
        indexer = IndexerSpec(num_heads=int(config_value(cfg, "index_n_heads")),
                              head_dim=int(config_value(cfg, "index_head_dim")),
                              topk=int(config_value(cfg, "index_topk")), rope_interleave=glm, reuse_previous=reuse)
        return MLASpec(
            num_heads=int(config_value(cfg, "num_attention_heads")), q_lora_rank=int(cfg["q_lora_rank"]),
            kv_lora_rank=int(config_value(cfg, "kv_lora_rank")),
            qk_nope_head_dim=int(config_value(cfg, "qk_nope_head_dim")),
            qk_rope_head_dim=int(config_value(cfg, "qk_rope_head_dim")),
            v_head_dim=int(config_value(cfg, "v_head_dim")),
            rope_theta=theta, rope_interleave=True, yarn=yarn, indexer=indexer,
            bias=bool(cfg.get("attention_bias", False)), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)))

    full, shared = mla(False), mla(True)  # one spec object per shape
    mlp_types = deepseek_moe.mlp_types(cfg, n, first_dense_default=3)
    moe = deepseek_moe.moe_spec(cfg) if "sparse" in mlp_types or mtp_layers else None
    layers = tuple(LayerSpec(shared if t == "shared" else full, MLPKind.MOE if m == "sparse" else MLPKind.DENSE)
                   for t, m in zip(types, mlp_types, strict=True))
    mtp = None
    if mtp_layers:  # DeepSeek's NextN layer is an MoE layer with its own indexer
        mtp = MTPSpec((LayerSpec(full, MLPKind.MOE),) * mtp_layers, mtp_source, form="nextn", own_lm_head=True,
                      anchor="target")
    return ModelDescription(
        family=FAMILY, architecture=architecture, model_type=ARCHITECTURES[architecture][0],
        vocab_size=int(config_value(cfg, "vocab_size")), hidden_size=int(config_value(cfg, "hidden_size")),
        intermediate_size=int(config_value(cfg, "intermediate_size")), layers=layers, moe=moe,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), tie_word_embeddings=bool(cfg.get("tie_word_embeddings")),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 163840)),
        dtype=checkpoint_dtype(config, cfg, default="bfloat16"), mtp=mtp,
        eos_token_ids=eos_token_ids(config, cfg),
        bos_token_id=cfg.get("bos_token_id"), norm_zero_centred=False)


sources = deepseek_moe.sources             # DeepSeek-V3's stored names (both architectures under `model.`)
unused_tensors = nextn_unused_tensors    # each NextN layer's copy of the embedding
fit_mtp_to_tensors = nextn_fit_lm_heads  # heads without shared_head.head project with lm_head
