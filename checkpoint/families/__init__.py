"""The model-family registry: one dict from config.json `architectures[0]` to the family
module. Each family module exports the same names: FAMILY, ARCHITECTURES (architecture ->
(model_type, text-weight prefix, text-config key)), IGNORED_PREFIXES, text_config(),
mtp_layout(text_cfg), describe(), sources(desc, per_expert), CHAT_FORMATS (architecture -> the tool-call
and reasoning formats the server parses, docs/structured_outputs.md). Optional: BLOCK_FP8 (the family reads
DeepSeek's fp8 block-quantized releases), unused_tensors(desc) (stored names that may be present
and are never read) and fit_mtp_to_tensors(desc, stored names) (the MTP spec as the stored tensors
have it, where config.json cannot say: DeepSeek's optional NextN `shared_head.head`)."""

from tandem.checkpoint.families import deepseek_dsa, qwen3_5, qwen3_5_moe, qwen3_next, step3p5

FAMILIES = {arch: module for module in (qwen3_5, qwen3_5_moe, qwen3_next, step3p5, deepseek_dsa)
            for arch in module.ARCHITECTURES}
# model_type -> architecture, for configs without an `architectures` list
MODEL_TYPES = {spec[0]: arch for arch, module in FAMILIES.items() for spec in [module.ARCHITECTURES[arch]]}
