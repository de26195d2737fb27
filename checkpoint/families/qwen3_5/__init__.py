"""Qwen3.5 dense: `Qwen3_5ForCausalLM` (text, `model.` prefix) and the multimodal wrapper
`Qwen3_5ForConditionalGeneration` (text under `model.language_model.`, vision tower ignored).
MTP tensors live at the top level (`mtp.*`) in both."""

from __future__ import annotations

from tandem.checkpoint.families import base, qwen_hybrid
from tandem.checkpoint.families.base import Source

FAMILY = "qwen3_5"
# architecture -> (model_type, prefix of the text weights, config key holding the text config)
ARCHITECTURES = {
    "Qwen3_5ForCausalLM": ("qwen3_5_text", "model.", None),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "model.language_model.", "text_config"),
}
IGNORED_PREFIXES = ("model.visual.",)
# chat formats the server parses (server/tool_calls.py, server/reasoning.py): Qwen3.5 writes
# <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call> (transformers 5.24)
CHAT_FORMATS = {arch: {"tool_calls": "qwen3_xml", "reasoning": "think"} for arch in ARCHITECTURES}
mtp_layout = qwen_hybrid.mtp_layout  # the heads under `mtp.`


def text_config(config: dict, architecture: str) -> dict:
    return base.text_config(config, ARCHITECTURES[architecture][2])


def describe(config: dict, architecture: str, *, mtp_layers: int, mtp_source: str):
    return qwen_hybrid.describe(
        text_config(config, architecture), family=FAMILY, architecture=architecture,
        model_type=ARCHITECTURES[architecture][0], moe_layer=None, mtp_layers=mtp_layers,
        mtp_source=mtp_source, top=config)


def sources(desc, per_expert: bool = False) -> dict[str, Source]:
    return qwen_hybrid.sources(desc, trunk_prefix=ARCHITECTURES[desc.architecture][1], per_expert=False)
