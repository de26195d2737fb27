"""What Qwen3.5, Qwen3.5-MoE and Qwen3-Next share: config parsing and the canonical tensor set
(layer_tensors' names; the MTP head's fc and norms under `mtp.`). Each family maps the canonical
names to what its checkpoints store (`Source`): prefixes, the Qwen3-Next interleaved projections,
per-expert tensors. The sibling family files are thin on purpose.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from tandem.checkpoint.description import (
    AttentionSpec,
    LayerKind,
    LayerSpec,
    LinearAttentionSpec,
    MLPKind,
    ModelDescription,
    MoESpec,
    MTPSpec,
)
from tandem.checkpoint.families.base import (
    ConfigError,
    MTPLayout,
    Shape,
    Source,
    checkpoint_dtype,
    config_value,
    eos_token_ids,
    rope_settings,
    single,
)
from tandem.checkpoint.families.layer_tensors import expert_sources, layer_shapes, trunk_shapes

_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def mtp_layout(cfg: dict) -> MTPLayout:
    """Qwen's MTP head: every tensor under the top-level `mtp.` (fc, norms, `mtp.layers.{j}.*`)."""
    return MTPLayout("mtp_num_hidden_layers", "mtp.*", lambda n: n.startswith("mtp."),
                     lambda n: int(m.group(1)) if (m := _MTP_LAYER.match(n)) else None, lambda j: f"mtp.layers.{j}.")


def layer_kinds(cfg: dict, num_layers: int) -> list[LayerKind]:
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ConfigError(f"layer_types has {len(types)} entries but num_hidden_layers is {num_layers}")
    try:
        return [LayerKind(t) for t in types]
    except ValueError as e:
        raise ConfigError(f"layer_types: {e}; expected 'full_attention' or 'linear_attention'") from e


def describe(cfg: dict, *, family: str, architecture: str, model_type: str,
             moe_layer: Callable[[int], bool] | None, mtp_layers: int,
             mtp_source: str, top: dict) -> ModelDescription:
    """Build the description from a text config `cfg` (the wrapper's text_config or the whole
    file); `top` is the whole config.json (tie/eos/dtype may live at its top level)."""
    hidden = int(config_value(cfg, "hidden_size"))
    n_layers = int(config_value(cfg, "num_hidden_layers"))
    n_heads = int(config_value(cfg, "num_attention_heads"))
    head_dim = int(config_value(cfg, "head_dim", hidden // n_heads))
    rotary_dim, theta, mrope = rope_settings(cfg, head_dim, default_partial_factor=0.25)
    attention = AttentionSpec(
        num_heads=n_heads, num_kv_heads=int(config_value(cfg, "num_key_value_heads", n_heads)), head_dim=head_dim,
        rotary_dim=rotary_dim, rope_theta=theta, output_gate=bool(cfg.get("attn_output_gate", True)),
        bias=bool(cfg.get("attention_bias", False)), o_bias=bool(cfg.get("attention_bias", False)),
        mrope_section=mrope)
    gdn = LinearAttentionSpec(
        num_key_heads=int(config_value(cfg, "linear_num_key_heads")),
        num_value_heads=int(config_value(cfg, "linear_num_value_heads")),
        key_head_dim=int(config_value(cfg, "linear_key_head_dim")),
        value_head_dim=int(config_value(cfg, "linear_value_head_dim")),
        conv_kernel=int(config_value(cfg, "linear_conv_kernel_dim", 4)))
    moe = None
    if moe_layer is not None:
        moe = MoESpec(
            num_experts=int(config_value(cfg, "num_experts")), top_k=int(config_value(cfg, "num_experts_per_tok")),
            expert_intermediate_size=int(config_value(cfg, "moe_intermediate_size")),
            shared_expert_intermediate_size=int(config_value(cfg, "shared_expert_intermediate_size")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
    kinds = layer_kinds(cfg, n_layers)
    # every attention layer (trunk and heads) shares `attention`, every GDN layer `gdn`
    mixers = {LayerKind.FULL_ATTENTION: attention, LayerKind.LINEAR_ATTENTION: gdn}
    layers = tuple(LayerSpec(mixers[k], MLPKind.MOE if moe_layer and moe_layer(i) else MLPKind.DENSE)
                   for i, k in enumerate(kinds))
    mtp = None
    if mtp_layers > 0:
        head = LayerSpec(attention, MLPKind.MOE if moe is not None else MLPKind.DENSE)
        mtp = MTPSpec((head,) * mtp_layers, mtp_source)
    return ModelDescription(
        family=family, architecture=architecture, model_type=model_type,
        vocab_size=int(config_value(cfg, "vocab_size")), hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or 0), layers=layers,
        moe=moe,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(top.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        dtype=checkpoint_dtype(top, cfg), mtp=mtp, eos_token_ids=eos_token_ids(top, cfg),
        bos_token_id=top.get("bos_token_id", cfg.get("bos_token_id")))


# ---- canonical tensors -------------------------------------------------------------------

def mtp_shapes(d: ModelDescription) -> dict[str, Shape]:
    if d.mtp is None:
        return {}
    h = d.hidden_size
    out = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
           "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}
    for j, layer in enumerate(d.mtp.layers):
        out.update(layer_shapes(d, f"mtp.layers.{j}.", layer))
    return out


# ---- canonical -> stored ----------------------------------------------------------------

def sources(d: ModelDescription, *, trunk_prefix: str, per_expert: bool,
            linear_attention: Callable[[str, Shape, str], Source] | None = None) -> dict[str, Source]:
    """Map every canonical tensor to its stored form. `linear_attention(canonical, shape,
    stored_prefix)` overrides the GDN projections (Qwen3-Next)."""
    out: dict[str, Source] = {}
    for canonical, shape in {**trunk_shapes(d), **mtp_shapes(d)}.items():
        stored_prefix = "" if canonical.startswith("mtp.") else trunk_prefix
        if canonical == "lm_head.weight":
            name = trunk_prefix + "embed_tokens.weight" if d.tie_word_embeddings else "lm_head.weight"
            out[canonical] = single(name, shape)
        elif ".mlp.experts." in canonical:
            out[canonical] = expert_sources(canonical, shape, stored_prefix, per_expert)
        elif linear_attention is not None and ".linear_attn.in_proj_" in canonical:
            out[canonical] = linear_attention(canonical, shape, stored_prefix)
        else:
            out[canonical] = single(stored_prefix + canonical, shape)
    return out
