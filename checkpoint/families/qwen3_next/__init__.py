"""Qwen3-Next: Gated DeltaNet projections stored interleaved per key-head group, normalised
here to the Qwen3.5 flat form; MoE on the layers `decoder_sparse_step` / `mlp_only_layers` pick.

Interleaved layout (r = Hv / Hk value heads per key head, value head = g*r + j):
  in_proj_qkvz viewed [Hk, dk + dk + r*dv + r*dv]: per group g [q_g | k_g | v_g | z_g]
  in_proj_ba   viewed [Hk, 2r]:                   per group g [b_g | a_g]
"""

from __future__ import annotations

import numpy as np

from tandem.checkpoint.families import qwen_hybrid
from tandem.checkpoint.families.base import Source

FAMILY = "qwen3_next"
ARCHITECTURES = {"Qwen3NextForCausalLM": ("qwen3_next", "model.", None)}
IGNORED_PREFIXES = ()
# chat formats the server parses: Qwen3's <tool_call>{"name": ..., "arguments": {...}}</tool_call>, <think>
CHAT_FORMATS = {arch: {"tool_calls": "hermes_json", "reasoning": "think"} for arch in ARCHITECTURES}
mtp_layout = qwen_hybrid.mtp_layout  # the heads under `mtp.`


def text_config(config: dict, architecture: str) -> dict:
    return config


def describe(config: dict, architecture: str, *, mtp_layers: int, mtp_source: str):
    only_dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step", 1))
    moe = int(config.get("num_experts", 0)) > 0
    return qwen_hybrid.describe(
        config, family=FAMILY, architecture=architecture, model_type="qwen3_next",
        moe_layer=(lambda i: i not in only_dense and (i + 1) % step == 0) if moe else None,
        mtp_layers=mtp_layers, mtp_source=mtp_source, top=config)


def sources(desc, per_expert: bool = False) -> dict[str, Source]:
    def linear_attention(canonical: str, shape, stored_prefix: str) -> Source:
        head, leaf = canonical.rsplit(".linear_attn.", 1)
        stored_leaf, stored_shape, fn = _fused_picks(desc, head)[leaf.removesuffix(".weight")]
        return Source((f"{stored_prefix}{head}.linear_attn.{stored_leaf}.weight",), (stored_shape,), fn)

    return qwen_hybrid.sources(desc, trunk_prefix="model.", per_expert=per_expert,
                               linear_attention=linear_attention)


def _fused_picks(desc, head: str) -> dict:
    """How layer `head`'s (e.g. "layers.3") GDN projections are cut out of its fused, per-key-head
    interleaved in_proj_qkvz / in_proj_ba: {canonical leaf: (stored leaf, stored shape, take)}."""
    g = desc.layers[int(head.rsplit(".", 1)[1])].mixer
    hk, r, dk, dv, h = g.num_key_heads, g.num_value_heads // g.num_key_heads, g.key_head_dim, g.value_head_dim, \
        desc.hidden_size
    qkvz_shape, ba_shape = (hk * (2 * dk + 2 * r * dv), h), (hk * 2 * r, h)

    def take_qkv(parts):
        x = parts[0].reshape(hk, 2 * dk + 2 * r * dv, h)
        q, k, v = x[:, :dk], x[:, dk : 2 * dk], x[:, 2 * dk : 2 * dk + r * dv]
        return np.concatenate([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)])

    def take_z(parts):
        return parts[0].reshape(hk, 2 * dk + 2 * r * dv, h)[:, 2 * dk + r * dv :].reshape(-1, h)

    def take_b(parts):
        return parts[0].reshape(hk, 2 * r, h)[:, :r].reshape(-1, h)

    def take_a(parts):
        return parts[0].reshape(hk, 2 * r, h)[:, r:].reshape(-1, h)

    return {"in_proj_qkv": ("in_proj_qkvz", qkvz_shape, take_qkv), "in_proj_z": ("in_proj_qkvz", qkvz_shape, take_z),
            "in_proj_b": ("in_proj_ba", ba_shape, take_b), "in_proj_a": ("in_proj_ba", ba_shape, take_a)}
