"""Tiny DeepSeek-V3.2 and GLM-5 checkpoints in the Hub's layout (per-expert MoE tensors, the NextN layer
at `model.layers.{N}` with the Hub's copy of the embedding), written by testing/tiny_checkpoints.py.

Kinds (DSA_KINDS), all with hidden 64, 3 layers (layer 0 dense, 1-2 MoE with 8 experts), MLA with q
LoRA 48, kv LoRA 32, nope 16 + rope 8, v 16, an indexer of 16 heads x 16 keeping the top 8 positions
(prompts longer than 8 are really sparse) and one NextN layer. 16 indexer heads, not fewer: a position
scores exactly 0 when relu zeroes every head (probability 2^-heads), and equal scores across the
k-th place make transformers' torch.topk pick an unspecified set:
    deepseek_v32      YaRN RoPE (factor 4, mscale = mscale_all_dim = 1), 2 expert groups of which 1 is kept
    glm_moe_dsa       plain RoPE, no groups, `indexer_types` full/shared/full (layer 1 reuses layer 0's top-k)
    deepseek_v32_fp8  deepseek_v32 in DeepSeek's fp8 format: every projection float8_e4m3fn with a float32
                      `weight_scale_inv` per 128x128 block (the dense MLP's 160 rows span two row blocks)
Norm weights are 1 + noise (DeepSeek's RMSNorm is x * w, not zero-centred).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from tandem.checkpoint.families.base import TinyKind

_DSA = dict(
    vocab_size=384, hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=16,
    num_nextn_predict_layers=1, rms_norm_eps=1e-6, max_position_embeddings=4096, hidden_act="silu",
    tie_word_embeddings=False, attention_bias=False, bos_token_id=0,
)
_DEEPSEEK = dict(n_group=2, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", rope_theta=10000.0,
                 rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
_GLM = dict(n_group=1, topk_group=1, rope_theta=1e6, indexer_types=["full", "shared", "full"])
# DeepSeek-V3.2's published quantization_config
FP8_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": [128, 128]}
# kind -> (architecture, model_type, config overrides, fp8)
DSA_KINDS = {
    "deepseek_v32": ("DeepseekV32ForCausalLM", "deepseek_v32", _DEEPSEEK, False),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", "glm_moe_dsa", _GLM, False),
    "deepseek_v32_fp8": ("DeepseekV32ForCausalLM", "deepseek_v32", _DEEPSEEK, True),
}
# Benchmark kinds (bench/run.py pipeline --kinds deepseek_v32_150m; never written by tests). deepseek_v32_150m:
# 125M trunk + 36M NextN, hidden 768, 8 layers (dense 0, MoE 1-7 with 8 experts in 4 groups), MLA 8 heads
# with q LoRA 384, kv LoRA 256, nope 64 + rope 32, v 64, indexer 16 x 64 keeping the top 16, vocab 32000
DSA_BENCH_KINDS = {
    "deepseek_v32_150m": ("DeepseekV32ForCausalLM", "deepseek_v32", dict(
        _DEEPSEEK, vocab_size=32000, hidden_size=768, intermediate_size=2048, moe_intermediate_size=384,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, n_group=4, topk_group=2, q_lora_rank=384,
        kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, index_topk=16, index_head_dim=64),
        False),
}
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def dsa_config(kind: str, dtype: str = "float32") -> dict:
    """config.json of a tiny DSA checkpoint, in the Hub's key names (rope_scaling, first_k_dense_replace)."""
    arch, model_type, overrides, fp8 = {**DSA_KINDS, **DSA_BENCH_KINDS}[kind]
    config = dict(_DSA, **overrides, architectures=[arch], model_type=model_type, dtype=dtype)
    if fp8:
        config["quantization_config"] = dict(FP8_QUANTIZATION)
    return config


def quantized_in_fp8(name: str, shape: tuple[int, ...]) -> bool:
    """What DeepSeek stores in fp8: every 2-D projection except the indexer's weights_proj (and not
    embeddings, norms, the router or the lm heads)."""
    return len(shape) == 2 and name.endswith("proj.weight") and not name.endswith("weights_proj.weight")


def quantize_fp8_blocks(w: np.ndarray, block: tuple[int, int] = (128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn weight, float32 scale_inv) with weight * scale_inv ~ w per block, amax mapped to 448."""
    rows, cols = w.shape
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    scale = np.ones((nr, nc), np.float32)
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    for r in range(nr):
        for c in range(nc):
            tile = w[r * block[0]:(r + 1) * block[0], c * block[1]:(c + 1) * block[1]].astype(np.float32)
            scale[r, c] = max(float(np.abs(tile).max()), 1e-12) / _FP8_MAX
            q[r * block[0]:(r + 1) * block[0], c * block[1]:(c + 1) * block[1]] = \
                (tile / scale[r, c]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def finish_tensors(kind: str, tensors: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The Hub's details on top of the generic random tensors: plain-RMSNorm weights around 1, the
    NextN layer's copy of the embedding, and for the fp8 kind the quantized projections + scales."""
    config = dsa_config(kind)
    out = {}
    for name, a in tensors.items():
        if "norm.weight" in name:
            a = (1.0 + 0.1 * rng.standard_normal(a.shape)).astype(a.dtype)
        out[name] = a
    n = config["num_hidden_layers"]
    for j in range(config["num_nextn_predict_layers"]):
        out[f"model.layers.{n + j}.embed_tokens.weight"] = out["model.embed_tokens.weight"].copy()
    if {**DSA_KINDS, **DSA_BENCH_KINDS}[kind][3]:
        for name in [x for x in out if quantized_in_fp8(x, out[x].shape)]:
            out[name], out[name + "_scale_inv"] = quantize_fp8_blocks(out[name].astype(np.float32))
    return out


TINY_KINDS = {name: TinyKind(lambda dtype, name=name: dsa_config(name, dtype), per_expert=True,
                             finish=lambda config, tensors, rng, name=name: finish_tensors(name, tensors, rng))
              for name in {**DSA_KINDS, **DSA_BENCH_KINDS}}
