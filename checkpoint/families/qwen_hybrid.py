"""What Qwen3.5, Qwen3.5-MoE and Qwen3-Next share: config parsing and the canonical tensor set.

Canonical names are transformers' Qwen3.5 text layout without the `model.` prefix
(`layers.3.linear_attn.in_proj_qkv.weight`, `mtp.layers.0.self_attn.q_proj.weight`), with MoE
experts stacked (`layers.0.mlp.experts.gate_up_proj` [E, 2I, H]). Each family maps the
canonical names to what its checkpoints store (`Source`): prefixes, the Qwen3-Next interleaved
projections, per-expert tensors. The sibling family files are thin on purpose.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

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

Shape = tuple[int, ...]
SUPPORTED_ROPE_TYPES = ("default",)
TORCH_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
                "torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}


@dataclass(frozen=True)
class Source:
    """How one canonical tensor is read: the stored tensors and the shapes config implies for
    them, and how to turn them into the canonical array (None: the single tensor as is)."""

    names: tuple[str, ...]
    shapes: tuple[Shape, ...]
    combine: Callable[[list[np.ndarray]], np.ndarray] | None = None


@dataclass(frozen=True)
class MTPLayout:
    """Where a family stores its MTP heads: `count_key` (config.json) declares how many, `owns` tells
    a head's stored tensor from the trunk's, `layer_of` gives its head layer (None: shared by every
    head), `layer_prefix(j)` names head j's stored decoder layer and `pattern` all of them, in messages."""

    count_key: str
    pattern: str
    owns: Callable[[str], bool]
    layer_of: Callable[[str], int | None]
    layer_prefix: Callable[[int], str]


_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def mtp_layout(cfg: dict) -> MTPLayout:
    """Qwen's MTP head: every tensor under the top-level `mtp.` (fc, norms, `mtp.layers.{j}.*`)."""
    return MTPLayout("mtp_num_hidden_layers", "mtp.*", lambda n: n.startswith("mtp."),
                     lambda n: int(m.group(1)) if (m := _MTP_LAYER.match(n)) else None, lambda j: f"mtp.layers.{j}.")


def single(name: str, shape: Shape) -> Source:
    return Source((name,), (tuple(shape),))


class ConfigError(ValueError):
    """A config.json value that is missing or out of range; the reader adds the file name."""


def _get(cfg: dict, key: str, default=None, required: bool = True):
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is None and required:
        raise ConfigError(f"'{key}' is missing")
    return default


def text_config(config: dict, key: str | None) -> dict:
    """The text model's config: the wrapper's `text_config` section, or the whole file."""
    return (config.get(key) or {}) if key else config


def rope_settings(cfg: dict, head_dim: int) -> tuple[int, float, tuple[int, ...] | None]:
    """(rotary_dim, theta, mrope_section) from `rope_parameters` (transformers 5) or the older
    top-level `rope_theta` / `partial_rotary_factor` / `rope_scaling` keys."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope_type {rope_type!r} is not supported yet (supported: {SUPPORTED_ROPE_TYPES})")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    mrope = params.get("mrope_section")
    return int(head_dim * factor), theta, (tuple(mrope) if mrope else None)


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
    hidden = int(_get(cfg, "hidden_size"))
    n_layers = int(_get(cfg, "num_hidden_layers"))
    n_heads = int(_get(cfg, "num_attention_heads"))
    head_dim = int(_get(cfg, "head_dim", hidden // n_heads))
    rotary_dim, theta, mrope = rope_settings(cfg, head_dim)
    attention = AttentionSpec(
        num_heads=n_heads, num_kv_heads=int(_get(cfg, "num_key_value_heads", n_heads)), head_dim=head_dim,
        rotary_dim=rotary_dim, rope_theta=theta, output_gate=bool(cfg.get("attn_output_gate", True)),
        bias=bool(cfg.get("attention_bias", False)), mrope_section=mrope)
    gdn = LinearAttentionSpec(
        num_key_heads=int(_get(cfg, "linear_num_key_heads")), num_value_heads=int(_get(cfg, "linear_num_value_heads")),
        key_head_dim=int(_get(cfg, "linear_key_head_dim")), value_head_dim=int(_get(cfg, "linear_value_head_dim")),
        conv_kernel=int(_get(cfg, "linear_conv_kernel_dim", 4)))
    moe = None
    if moe_layer is not None:
        moe = MoESpec(
            num_experts=int(_get(cfg, "num_experts")), top_k=int(_get(cfg, "num_experts_per_tok")),
            expert_intermediate_size=int(_get(cfg, "moe_intermediate_size")),
            shared_expert_intermediate_size=int(_get(cfg, "shared_expert_intermediate_size")),
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
    eos = top.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    dtype_name = str(top.get("dtype") or top.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype")
                     or "float32")
    if dtype_name not in TORCH_DTYPES:
        raise ConfigError(f"dtype {dtype_name!r} is not supported (use bfloat16, float16 or float32)")
    return ModelDescription(
        family=family, architecture=architecture, model_type=model_type,
        vocab_size=int(_get(cfg, "vocab_size")), hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or 0), layers=layers,
        moe=moe,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(top.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        dtype=TORCH_DTYPES[dtype_name], mtp=mtp, eos_token_ids=eos_ids,
        bos_token_id=top.get("bos_token_id", cfg.get("bos_token_id")))


# ---- canonical tensors -------------------------------------------------------------------

def attention_shapes(d: ModelDescription, p: str, a: AttentionSpec) -> dict[str, Shape]:
    h = d.hidden_size
    q_rows = a.num_heads * a.head_dim * (2 if a.output_gate else 1)
    kv_rows = a.num_kv_heads * a.head_dim
    out = {p + "self_attn.q_proj.weight": (q_rows, h), p + "self_attn.k_proj.weight": (kv_rows, h),
           p + "self_attn.v_proj.weight": (kv_rows, h), p + "self_attn.o_proj.weight": (h, a.num_heads * a.head_dim),
           p + "self_attn.q_norm.weight": (a.head_dim,), p + "self_attn.k_norm.weight": (a.head_dim,)}
    if a.bias:
        out.update({p + "self_attn.q_proj.bias": (q_rows,), p + "self_attn.k_proj.bias": (kv_rows,),
                    p + "self_attn.v_proj.bias": (kv_rows,), p + "self_attn.o_proj.bias": (h,)})
    if a.head_gate:
        out[p + "self_attn.g_proj.weight"] = (a.num_heads, h)
    return out


def linear_attention_shapes(d: ModelDescription, p: str, g: LinearAttentionSpec) -> dict[str, Shape]:
    h, q = d.hidden_size, p + "linear_attn."
    return {q + "in_proj_qkv.weight": (g.conv_dim, h), q + "in_proj_z.weight": (g.value_dim, h),
            q + "in_proj_b.weight": (g.num_value_heads, h), q + "in_proj_a.weight": (g.num_value_heads, h),
            q + "conv1d.weight": (g.conv_dim, 1, g.conv_kernel), q + "A_log": (g.num_value_heads,),
            q + "dt_bias": (g.num_value_heads,), q + "norm.weight": (g.value_head_dim,),
            q + "out_proj.weight": (h, g.value_dim)}


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
    m = layer.mixer
    out.update(attention_shapes(d, p, m) if isinstance(m, AttentionSpec) else linear_attention_shapes(d, p, m))
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

def _stack_experts(parts: list[np.ndarray]) -> np.ndarray:
    return np.stack(parts)


def _stack_gate_up(parts: list[np.ndarray]) -> np.ndarray:
    # parts = [gate_0, up_0, gate_1, up_1, ...] -> [E, 2I, H] with gate rows first per expert
    return np.stack([np.concatenate(parts[k : k + 2]) for k in range(0, len(parts), 2)])


def expert_sources(canonical: str, shape: Shape, stored_prefix: str, per_expert: bool) -> Source:
    """Stacked experts as stored (Qwen3.5-MoE bf16) or gathered from per-expert tensors."""
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


def uses_per_expert(stored_names) -> bool:
    return any(".mlp.experts.0." in n for n in stored_names)
