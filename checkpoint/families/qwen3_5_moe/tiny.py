"""Tiny Qwen3.5-MoE checkpoint (qwen_hybrid/tiny.py): stacked experts, one MTP layer."""

from tandem.checkpoint.families.qwen_hybrid.tiny import kind

TINY_KINDS = {"qwen3_5_moe": kind("Qwen3_5MoeForCausalLM", 1)}
