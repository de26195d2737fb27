"""The DeepSeek-V3.2 / GLM-5 tiny kinds and their fp8 block writer, declared by the family
(checkpoint/families/deepseek_dsa/tiny.py)."""

from tandem.checkpoint.families.deepseek_dsa.tiny import (  # noqa: F401
    DSA_BENCH_KINDS,
    DSA_KINDS,
    FP8_QUANTIZATION,
    dsa_config,
    finish_tensors,
    quantize_fp8_blocks,
    quantized_in_fp8,
)
