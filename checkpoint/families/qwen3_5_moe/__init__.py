"""Qwen3.5-MoE: every layer a sparse MoE block (router, experts, gated shared expert).
Experts are read stacked (`mlp.experts.gate_up_proj`, as bf16 releases store them) or
gathered from per-expert tensors (`mlp.experts.N.gate_proj.weight`)."""

from __future__ import annotations

from tandem.checkpoint.families import base, qwen_hybrid
from tandem.checkpoint.families.base import Source

FAMILY = "qwen3_5_moe"
ARCHITECTURES = {
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe_text", "model.", None),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", "model.language_model.", "text_config"),
}
IGNORED_PREFIXES = ("model.visual.",)
CHAT_FORMATS = {arch: {"tool_calls": "qwen3_xml", "reasoning": "think"} for arch in ARCHITECTURES}  # as qwen3_5
mtp_layout = qwen_hybrid.mtp_layout  # the heads under `mtp.`


def text_config(config: dict, architecture: str) -> dict:
    return base.text_config(config, ARCHITECTURES[architecture][2])


def describe(config: dict, architecture: str, *, mtp_layers: int, mtp_source: str):
    return qwen_hybrid.describe(
        text_config(config, architecture), family=FAMILY, architecture=architecture,
        model_type=ARCHITECTURES[architecture][0], moe_layer=lambda i: True, mtp_layers=mtp_layers,
        mtp_source=mtp_source, top=config)


def sources(desc, per_expert: bool = False) -> dict[str, Source]:
    return qwen_hybrid.sources(desc, trunk_prefix=ARCHITECTURES[desc.architecture][1],
                               per_expert=per_expert)
