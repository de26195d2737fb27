"""Step-3.5-Flash: `Step3p5ForCausalLM` (model_type step3p5, the Hub's stepfun-ai/Step-3.5-Flash) and
the text part of transformers' `Step3p7ForConditionalGeneration` (model_type step3p7; the text config
under `text_config`, model_type step3p5 inside). Both store the text weights under `model.`
(`model.layers.*`, `model.embed_tokens`, `model.norm`) and `lm_head.weight` at the top: transformers
5.24's "step3p7" conversion mapping moves them to `model.language_model.` only when it loads them.
Step-3.7's vision tower (`vision_model.*`, `vit_large_projector.*`) is ignored.

Stored (Hub) -> canonical (transformers' Qwen3.5 text layout without `model.`):
    model.layers.{i}.moe.gate.weight            -> layers.{i}.mlp.gate.weight
    model.layers.{i}.moe.router_bias            -> layers.{i}.mlp.gate.e_score_correction_bias
    model.layers.{i}.moe.{gate,up}_proj.weight  -> layers.{i}.mlp.experts.gate_up_proj  [E, I, H] x2 -> [E, 2I, H]
    model.layers.{i}.moe.down_proj.weight       -> layers.{i}.mlp.experts.down_proj     [E, H, I]
    model.layers.{i}.share_expert.*             -> layers.{i}.mlp.shared_expert.*
    model.layers.{N+j}.*                        -> mtp.layers.{j}.* (N = num_hidden_layers; NextN head j:
        enorm, hnorm, eh_proj, its decoder layer, `transformer.shared_head.norm` -> `shared_head.norm`,
        `transformer.shared_head.output` -> `shared_head.head`, head j's own lm head)

Config: the Hub pads every per-layer list (`layer_types`, `rope_theta`, `partial_rotary_factors`,
`swiglu_limits`, `swiglu_limits_shared`, `moe_layers_enum` indices) with the MTP layers' entries;
head j is described by entry N+j. transformers 5.24 reads some things elsewhere, so where it would
compute something else describe() refuses instead of silently differing from it:
- KV heads and head_dim: `num_attention_groups` / `head_dim` for every layer; a different
  `attention_other_setting.num_attention_groups` or `.head_dim` is refused;
- RoPE per layer TYPE from the first layer of that type: values differing within a type are refused;
- SwiGLU clamps: dense layers clamp with `swiglu_limits_shared` (as transformers does, not
  `swiglu_limits`); MTP layer j clamps with entry j (the trunk's) in transformers: an entry N+j that
  differs from entry j is refused;
- the router always renormalises, is always sigmoid, q/k norms and g_proj always exist, norms are
  always zero-centred: a config saying otherwise is refused.
A sliding MTP layer gets the full-attention head count in transformers (`get_mtp_config` drops
`per_layer_config`); tandem follows the Hub entry, whose tensor shapes transformers could not load.
"""

from __future__ import annotations

import numpy as np

from tandem.checkpoint.description import AttentionSpec, LayerSpec, MLPKind, ModelDescription, MoESpec, MTPSpec
from tandem.checkpoint.families import base
from tandem.checkpoint.families.base import (
    SUPPORTED_ROPE_TYPES,
    ConfigError,
    Source,
    checkpoint_dtype,
    config_value,
    eos_token_ids,
    nextn_layout,
    nextn_stored,
    single,
)
from tandem.checkpoint.families.layer_tensors import nextn_model_shapes

FAMILY = "step3p5"
# architecture -> (model_type, prefix of the text weights, config key holding the text config)
ARCHITECTURES = {
    "Step3p5ForCausalLM": ("step3p5", "model.", None),
    "Step3p7ForConditionalGeneration": ("step3p7", "model.", "text_config"),
}
IGNORED_PREFIXES = ("vision_model.", "vit_large_projector.")
# chat formats the server parses: <think> reasoning (Step-3.5's template opens the span, the model writes
# only </think>); tool calls in the XML form of Qwen3-Coder / Qwen3.5 (<tool_call><function=name>
# <parameter=key>value</parameter></function></tool_call>), which Step-3.5-Flash's own parsers read
CHAT_FORMATS = {arch: {"tool_calls": "qwen3_xml", "reasoning": "think"} for arch in ARCHITECTURES}
LAYER_TYPES = ("full_attention", "sliding_attention")
# canonical -> stored name pieces, applied in order after the layer index is mapped
_RENAMES = ((".mlp.gate.e_score_correction_bias", ".moe.router_bias"), (".mlp.gate.weight", ".moe.gate.weight"),
            (".mlp.experts.down_proj", ".moe.down_proj.weight"), (".mlp.shared_expert.", ".share_expert."),
            (".shared_head.norm.", ".transformer.shared_head.norm."),
            (".shared_head.head.", ".transformer.shared_head.output."))


def text_config(config: dict, architecture: str) -> dict:
    return base.text_config(config, ARCHITECTURES[architecture][2])


mtp_layout = nextn_layout  # NextN head j stored as decoder layer N+j


def _per_layer(cfg: dict, key: str, count: int, default):
    """The first `count` entries of a per-layer list (a scalar applies to every layer)."""
    value = cfg.get(key)
    if value is None:
        return [default] * count
    if not isinstance(value, list):
        return [value] * count
    if len(value) < count:
        raise ConfigError(f"'{key}' has {len(value)} entries but {count} layers (trunk + MTP) need one each")
    return value[:count]


def _limit(x) -> float | None:
    return float(x) if x else None  # 0 / null: no clamp


def _refuse_unsupported(cfg: dict) -> None:
    fixed = {"use_head_wise_attn_gate": True, "use_qk_norm": True, "norm_expert_weight": True,
             "zero_centered": True, "mlp_bias": False, "moe_router_activation": "sigmoid"}
    for key, value in fixed.items():
        if key in cfg and cfg[key] != value:
            raise ConfigError(f"'{key}' is {cfg[key]!r}; transformers 5.24's Step-3.5 always computes it as "
                              f"{value!r}, and tandem only supports that form")
    for key in ("rope_scaling", "rope_parameters"):
        params = cfg.get(key) or {}
        per_type = [v for v in params.values() if isinstance(v, dict)]  # transformers' saved form
        for p in per_type or [params]:
            rope_type = p.get("rope_type", p.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(f"{key}: rope_type {rope_type!r} is not supported yet (supported: "
                                  f"{SUPPORTED_ROPE_TYPES})")


def _rope(cfg: dict, types: list[str], head_dim: int) -> dict[str, tuple[int, float]]:
    """layer type -> (rotary_dim, theta). transformers takes each type's values from its first layer."""
    per_type = cfg.get("rope_parameters") or {}
    if all(isinstance(per_type.get(t), dict) for t in set(types)):  # transformers' own saved form
        values = {t: (per_type[t].get("rope_theta", 10000.0), per_type[t].get("partial_rotary_factor", 1.0))
                  for t in set(types)}
    else:
        thetas = _per_layer(cfg, "rope_theta", len(types), 10000.0)
        factors = _per_layer(cfg, "partial_rotary_factors", len(types), 1.0)
        values = {}
        for i, t in enumerate(types):
            first = values.setdefault(t, (thetas[i], factors[i]))
            if first != (thetas[i], factors[i]):
                j = types.index(t)
                raise ConfigError(f"rope_theta / partial_rotary_factors of {t} layer {i} ({thetas[i]}, {factors[i]}) "
                                  f"differ from layer {j}'s ({first[0]}, {first[1]}); transformers 5.24 uses one "
                                  "value per layer type (its first layer's), so tandem refuses rather than differ")
    return {t: (int(head_dim * float(f)), float(th)) for t, (th, f) in values.items()}


def _attention(cfg: dict, types: list[str], window) -> dict[str, AttentionSpec]:
    """layer type -> its attention spec (sliding layers: their own query head count and window)."""
    heads, head_dim = int(config_value(cfg, "num_attention_heads")), int(config_value(cfg, "head_dim"))
    kv = int(config_value(cfg, "num_attention_groups", cfg.get("num_key_value_heads")))
    other = cfg.get("attention_other_setting") or {}
    for key, value in (("num_attention_groups", kv), ("head_dim", head_dim)):
        if key in other and int(other[key]) != value:
            raise ConfigError(f"attention_other_setting.{key} is {other[key]} but {key} is {value}; transformers "
                              f"5.24 uses {key} for the sliding layers too, so tandem refuses rather than differ")
    sliding_heads = int(cfg.get("num_sliding_attention_heads") or other.get("num_attention_heads") or heads)
    scalar = cfg.get("query_pre_attn_scalar")
    rope = _rope(cfg, types, head_dim)
    specs = {}
    for t in set(types):
        rotary, theta = rope[t]
        specs[t] = AttentionSpec(
            num_heads=sliding_heads if t == "sliding_attention" else heads, num_kv_heads=kv, head_dim=head_dim,
            rotary_dim=rotary, rope_theta=theta, output_gate=False, head_gate=True, qk_norm=True,
            bias=bool(cfg.get("attention_bias", False)), o_bias=bool(cfg.get("attention_bias", False)),
            window=window if t == "sliding_attention" else None,
            softmax_scale=float(scalar) ** -0.5 if scalar else None)
    return specs


def describe(config: dict, architecture: str, *, mtp_layers: int, mtp_source: str) -> ModelDescription:
    cfg = text_config(config, architecture)
    _refuse_unsupported(cfg)
    n = int(config_value(cfg, "num_hidden_layers"))
    total = n + mtp_layers
    types = list(cfg.get("layer_types") or ["full_attention"] * n)
    if len(types) == n and cfg.get("mtp_layer_types"):  # transformers' saved form keeps them apart
        types += list(cfg["mtp_layer_types"])
    types = _per_layer({"layer_types": types}, "layer_types", total, None)
    if unknown := sorted(set(types) - set(LAYER_TYPES)):
        raise ConfigError(f"layer_types holds {unknown}; expected {' or '.join(LAYER_TYPES)}")
    window = int(config_value(cfg, "sliding_window")) if "sliding_attention" in types else None
    attention = _attention(cfg, types, window)

    enum = cfg.get("moe_layers_enum")
    if enum is not None:
        moe_set = {int(i) for i in (enum.split(",") if isinstance(enum, str) else enum) if str(i).strip()}
    elif cfg.get("mlp_layer_types"):
        kinds = list(cfg["mlp_layer_types"]) + list(cfg.get("mtp_mlp_layer_types") or [])
        moe_set = {i for i, k in enumerate(kinds) if k == "sparse"}
    else:
        moe_set = set(range(3, n))  # transformers' default: trunk layers from 3 on, MTP layers dense
    # lists of N entries (transformers' saved form): MTP layer j clamps with entry j, as transformers does
    limits, shared = ([*v, *v[:mtp_layers]] if isinstance(v, list) and len(v) == n else v
                      for v in (cfg.get("swiglu_limits"), cfg.get("swiglu_limits_shared")))
    limits = _per_layer({"swiglu_limits": limits}, "swiglu_limits", total, 0)
    shared = _per_layer({"swiglu_limits_shared": shared}, "swiglu_limits_shared", total, 0)
    for j in range(mtp_layers):
        used = {"swiglu_limits_shared": shared} | ({"swiglu_limits": limits} if n + j in moe_set else {})
        for name, values in used.items():
            if _limit(values[n + j]) != _limit(values[j]):
                raise ConfigError(f"{name}[{n + j}] (MTP layer {j}) is {values[n + j]} but transformers 5.24 clamps "
                                  f"MTP layer {j} with {name}[{j}] = {values[j]}; tandem refuses rather than differ")

    def layer(i: int) -> LayerSpec:
        if i in moe_set:  # routed experts clamp with swiglu_limits, the shared expert with the shared list
            return LayerSpec(attention[types[i]], MLPKind.MOE, _limit(limits[i]), _limit(shared[i]))
        return LayerSpec(attention[types[i]], MLPKind.DENSE, _limit(shared[i]))  # dense: the shared list

    moe = None
    if moe_set & set(range(total)):
        moe = MoESpec(
            num_experts=int(config_value(cfg, "moe_num_experts", cfg.get("n_routed_experts"))),
            top_k=int(config_value(cfg, "moe_top_k", cfg.get("num_experts_per_tok"))),
            expert_intermediate_size=int(config_value(cfg, "moe_intermediate_size")),
            shared_expert_intermediate_size=int(config_value(cfg, "share_expert_dim")), norm_topk_prob=True,
            router="sigmoid", score_correction_bias=bool(cfg.get("use_moe_router_bias", True)),
            routed_scaling_factor=float(cfg.get("moe_router_scaling_factor", 1.0)), shared_expert_gate=False)
    mtp = None
    if mtp_layers:
        mtp = MTPSpec(tuple(layer(n + j) for j in range(mtp_layers)), mtp_source, form="nextn", own_lm_head=True,
                      anchor="previous_head")
    return ModelDescription(
        family=FAMILY, architecture=architecture, model_type=ARCHITECTURES[architecture][0],
        vocab_size=int(config_value(cfg, "vocab_size")), hidden_size=int(config_value(cfg, "hidden_size")),
        intermediate_size=int(cfg.get("intermediate_size") or 0), layers=tuple(layer(i) for i in range(n)), moe=moe,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 128000)), dtype=checkpoint_dtype(config, cfg),
        mtp=mtp, eos_token_ids=eos_token_ids(config, cfg),
        bos_token_id=config.get("bos_token_id", cfg.get("bos_token_id")))


# ---- canonical tensors -> stored ----------------------------------------------------------

def _stored(canonical: str, prefix: str, n: int) -> str:
    name = nextn_stored(canonical, n)
    for ours, theirs in _RENAMES:
        name = name.replace(ours, theirs)
    return prefix + name


def _concat_gate_up(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts, axis=1)  # [E, I, H] gate, [E, I, H] up -> [E, 2I, H], gate rows first


def sources(desc: ModelDescription, per_expert: bool = False) -> dict[str, Source]:
    """Every canonical tensor's stored form (experts are always stacked per layer on the Hub)."""
    prefix, n = ARCHITECTURES[desc.architecture][1], desc.num_layers
    out: dict[str, Source] = {}
    for canonical, shape in nextn_model_shapes(desc).items():
        if canonical == "lm_head.weight":
            out[canonical] = single(prefix + "embed_tokens.weight" if desc.tie_word_embeddings else canonical, shape)
        elif canonical.endswith(".mlp.experts.gate_up_proj"):
            base = _stored(canonical, prefix, n).removesuffix("experts.gate_up_proj").replace(".mlp.", ".moe.")
            half = (shape[0], shape[1] // 2, shape[2])
            out[canonical] = Source((base + "gate_proj.weight", base + "up_proj.weight"), (half, half), _concat_gate_up)
        else:
            out[canonical] = single(_stored(canonical, prefix, n), shape)
    return out
