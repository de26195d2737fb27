"""Tiny Qwen3.5 checkpoints (qwen_hybrid/tiny.py): the multimodal wrapper with one MTP layer, the text
model with three, and a ~150M random one for benchmarks."""

from tandem.checkpoint.families.qwen_hybrid.tiny import BENCH_150M, kind

TINY_KINDS = {
    "qwen3_5_mtp1": kind("Qwen3_5ForConditionalGeneration", 1),
    "qwen3_5_mtp3": kind("Qwen3_5ForCausalLM", 3),
    "qwen3_5_150m": kind("Qwen3_5ForConditionalGeneration", 1, overrides=BENCH_150M),
}
