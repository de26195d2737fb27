"""Tiny GLM-4-MoE checkpoints in the Hub's layout (testing/tiny_checkpoints.py writes them).

hidden 64, 3 layers (layer 0 dense, 1-2 MoE: 8 experts in 2 groups of which 1 is kept, top 2, one
shared expert), 4 query / 2 KV heads of 16 with q/k/v biases, RoPE on 8 dims, one NextN layer
"""

from __future__ import annotations

import numpy as np

from tandem.checkpoint.families.base import TinyKind


def _tiny_config(dtype: str) -> dict:
    return dict(
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=384, hidden_size=64,
        intermediate_size=160, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        attention_bias=True, use_qk_norm=False, partial_rotary_factor=0.5, rope_theta=1e6,
        num_nextn_predict_layers=1, rms_norm_eps=1e-5, max_position_embeddings=4096, hidden_act="silu",
        tie_word_embeddings=False, dtype=dtype)


def _tiny_finish(config: dict, tensors: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Plain-RMSNorm weights around 1; each NextN layer's copy of the embedding and its lm head a copy
    of lm_head, as the Hub has them (transformers' MtpModel projects with lm_head)."""
    out = {name: (1.0 + 0.1 * rng.standard_normal(a.shape)).astype(a.dtype) if "norm.weight" in name else a
           for name, a in tensors.items()}
    n = config["num_hidden_layers"]
    for j in range(config["num_nextn_predict_layers"]):
        out[f"model.layers.{n + j}.embed_tokens.weight"] = out["model.embed_tokens.weight"].copy()
        out[f"model.layers.{n + j}.shared_head.head.weight"] = out["lm_head.weight"].copy()
    return out


TINY_KINDS = {"glm4_moe": TinyKind(_tiny_config, per_expert=True, finish=_tiny_finish)}
