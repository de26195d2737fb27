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

from dataclasses import replace

from tandem.checkpoint.description import LayerSpec, MLPKind, ModelDescription, MoESpec, MTPSpec
from tandem.checkpoint.families import qwen_hybrid, step3p5
from tandem.checkpoint.families.qwen_hybrid import TORCH_DTYPES, ConfigError, MTPLayout, Shape, Source, _get, single
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


def mtp_layout(cfg: dict) -> MTPLayout:
    """NextN head j is stored as decoder layer N+j (`model.layers.{N+j}.*`), as for Step-3.5."""
    return step3p5.mtp_layout(cfg)


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
    if int(cfg.get("n_shared_experts", 1)) < 1:
        raise ConfigError(f"'n_shared_experts' is {cfg['n_shared_experts']}; tandem needs the shared expert")


def _rope(cfg: dict) -> tuple[float, YarnSpec | None]:
    """(theta, YaRN or None) from `rope_parameters` (transformers 5) or the Hub's `rope_scaling`."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope_type {rope_type!r} is not supported (supported: {ROPE_TYPES})")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    original = int(_get(params, "original_max_position_embeddings"))
    factor = params.get("factor") or int(_get(cfg, "max_position_embeddings")) / original
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
    n = int(_get(cfg, "num_hidden_layers"))
    theta, yarn = _rope(cfg)
    glm = ARCHITECTURES[architecture][0] == "glm_moe_dsa"
    types = indexer_types(cfg, n) if glm else ["full"] * n

    def mla(reuse: bool) -> MLASpec:
        indexer = IndexerSpec(num_heads=int(_get(cfg, "index_n_heads")), head_dim=int(_get(cfg, "index_head_dim")),
                              topk=int(_get(cfg, "index_topk")), rope_interleave=glm, reuse_previous=reuse)
        return MLASpec(
            num_heads=int(_get(cfg, "num_attention_heads")), q_lora_rank=int(cfg["q_lora_rank"]),
            kv_lora_rank=int(_get(cfg, "kv_lora_rank")), qk_nope_head_dim=int(_get(cfg, "qk_nope_head_dim")),
            qk_rope_head_dim=int(_get(cfg, "qk_rope_head_dim")), v_head_dim=int(_get(cfg, "v_head_dim")),
            rope_theta=theta, rope_interleave=True, yarn=yarn, indexer=indexer,
            bias=bool(cfg.get("attention_bias", False)), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)))

    full, shared = mla(False), mla(True)  # one spec object per shape
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None:
        dense = min(int(cfg.get("first_k_dense_replace", 3)), n)
        mlp_types = ["dense"] * dense + ["sparse"] * (n - dense)
    if len(mlp_types) != n or set(mlp_types) - {"dense", "sparse"}:
        raise ConfigError(f"mlp_layer_types {mlp_types} must give 'dense' or 'sparse' for each of the {n} layers")
    moe = None
    if "sparse" in mlp_types or mtp_layers:
        expert = int(_get(cfg, "moe_intermediate_size"))
        moe = MoESpec(
            num_experts=int(_get(cfg, "n_routed_experts", cfg.get("num_experts"))),
            top_k=int(_get(cfg, "num_experts_per_tok")), expert_intermediate_size=expert,
            shared_expert_intermediate_size=expert * int(cfg.get("n_shared_experts", 1)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), router="sigmoid", score_correction_bias=True,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)), shared_expert_gate=False,
            n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1))
    layers = tuple(LayerSpec(shared if t == "shared" else full, MLPKind.MOE if m == "sparse" else MLPKind.DENSE)
                   for t, m in zip(types, mlp_types, strict=True))
    mtp = None
    if mtp_layers:  # DeepSeek's NextN layer is an MoE layer with its own indexer
        mtp = MTPSpec((LayerSpec(full, MLPKind.MOE),) * mtp_layers, mtp_source, form="nextn", own_lm_head=True,
                      anchor="target")
    eos = cfg.get("eos_token_id")
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported (use bfloat16, float16 or float32)")
    return ModelDescription(
        family=FAMILY, architecture=architecture, model_type=ARCHITECTURES[architecture][0],
        vocab_size=int(_get(cfg, "vocab_size")), hidden_size=int(_get(cfg, "hidden_size")),
        intermediate_size=int(_get(cfg, "intermediate_size")), layers=layers, moe=moe,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), tie_word_embeddings=bool(cfg.get("tie_word_embeddings")),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 163840)), dtype=TORCH_DTYPES[dtype], mtp=mtp,
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        bos_token_id=cfg.get("bos_token_id"), norm_zero_centred=False)


# ---- canonical tensors -> stored ----------------------------------------------------------

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


def layer_shapes(d: ModelDescription, p: str, layer: LayerSpec) -> dict[str, Shape]:
    h = d.hidden_size
    out = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    out.update(mla_shapes(d, p, layer.mixer))
    out.update(qwen_hybrid.mlp_shapes(d, p, layer.mlp))
    return out


def canonical_shapes(d: ModelDescription) -> dict[str, Shape]:
    h, v = d.hidden_size, d.vocab_size
    out = {"embed_tokens.weight": (v, h)}
    for i, layer in enumerate(d.layers):
        out.update(layer_shapes(d, f"layers.{i}.", layer))
    out.update({"norm.weight": (h,), "lm_head.weight": (v, h)})
    for j, layer in enumerate(d.mtp.layers if d.mtp else ()):
        p = f"mtp.layers.{j}."
        out.update({p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
                    p + "shared_head.norm.weight": (h,)})
        if d.mtp.own_lm_head:  # else the head projects with the target's lm_head (fit_mtp_to_tensors)
            out[p + "shared_head.head.weight"] = (v, h)
        out.update(layer_shapes(d, p, layer))
    return out


def _stored(canonical: str, n: int) -> str:
    """Stored name without the `model.` prefix: NextN head j is layer N+j; shared experts plural."""
    if canonical.startswith("mtp.layers."):
        j, rest = canonical.removeprefix("mtp.layers.").split(".", 1)
        canonical = f"layers.{n + int(j)}.{rest}"
    return canonical.replace(".mlp.shared_expert.", ".mlp.shared_experts.")


def sources(desc: ModelDescription, per_expert: bool = False) -> dict[str, Source]:
    """Every canonical tensor's stored form; experts per expert (the Hub) or stacked (transformers)."""
    prefix, n = ARCHITECTURES[desc.architecture][1], desc.num_layers
    out: dict[str, Source] = {}
    for canonical, shape in canonical_shapes(desc).items():
        if canonical == "lm_head.weight":
            out[canonical] = single(prefix + "embed_tokens.weight" if desc.tie_word_embeddings else canonical, shape)
        elif ".mlp.experts." in canonical:
            out[canonical] = qwen_hybrid.expert_sources(_stored(canonical, n), shape, prefix, per_expert)
        else:
            out[canonical] = single(prefix + _stored(canonical, n), shape)
    return out


def unused_tensors(desc: ModelDescription) -> frozenset[str]:
    """Stored tensors a checkpoint may hold that are never read: each NextN layer's copy of the embedding."""
    n, heads = desc.num_layers, desc.mtp.num_layers if desc.mtp else 0
    return frozenset(f"model.layers.{n + j}.embed_tokens.weight" for j in range(heads))


def fit_mtp_to_tensors(desc: ModelDescription, stored: frozenset[str]) -> ModelDescription:
    """The description as the stored NextN tensors have it (config.json cannot say): when no NextN
    layer stores `shared_head.head` (published as a copy of lm_head, so some conversions drop it),
    every layer projects with the target's lm_head; when any does, each uses its own (and a layer
    without one is reported missing). `stored`: the names in the folder the NextN tensors come from."""
    if desc.mtp is None:
        return desc
    prefix, n = ARCHITECTURES[desc.architecture][1], desc.num_layers
    heads = [prefix + _stored(f"mtp.layers.{j}.shared_head.head.weight", n) for j in range(desc.mtp.num_layers)]
    if any(name in stored for name in heads):
        return desc
    return replace(desc, mtp=replace(desc.mtp, own_lm_head=False))
