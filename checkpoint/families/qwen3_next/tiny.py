"""Tiny Qwen3-Next checkpoint (qwen_hybrid/tiny.py): interleaved GDN projections, per-expert MoE,
a dense layer, two shards."""

from tandem.checkpoint.families.qwen_hybrid.tiny import kind

TINY_KINDS = {"qwen3_next": kind("Qwen3NextForCausalLM", 1, per_expert=True, shards=2)}
