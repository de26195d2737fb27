"""Tiny Step-3.5-Flash checkpoints in the Hub's layout (testing/tiny_checkpoints.py writes them): MoE
as `moe.*` / `share_expert.*`, three NextN MTP layers at `model.layers.{N..N+2}` with
`transformer.shared_head.{norm,output}`, the Hub's key names (num_attention_groups,
attention_other_setting, moe_layers_enum, per-layer lists padded with the MTP layers' entries).

    step3p5             6 layers (full, sliding x2, full, sliding x2) + 3 MTP layers; sliding layers with
                        their own head count, window 8, per-type RoPE theta / partial rotary factor, dense
                        layers 0-1 and MoE 2-5, SwiGLU clamps on layers 4-5 small enough to bind on random
                        weights; the MTP layers full attention and dense
    step3p5_tied_heads  the same with every head's own lm head a copy of lm_head (drafts == transformers',
                        which drafts with the target's)
    step3p5_150m        ~170M for benchmarks: 10 layers (3 full + 7 window-128), dense 0-5 and MoE 6-9 with
                        8 experts, hidden 768, vocab 16000
"""

from __future__ import annotations

import numpy as np

from tandem.checkpoint.families.base import TinyKind

_STEP3P5 = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
    num_attention_groups=2, head_dim=16, num_nextn_predict_layers=3, sliding_window=8,
    attention_other_setting={"attention_type": "sliding_attention", "num_attention_heads": 8,
                             "num_attention_groups": 2, "head_dim": 16},
    layer_types=["full_attention", "sliding_attention", "sliding_attention"] * 2 + ["full_attention"] * 3,
    rope_theta=[5e6, 1e4, 1e4] * 2 + [5e6] * 3, partial_rotary_factors=[0.5, 1.0, 1.0] * 2 + [0.5] * 3,
    moe_layers_enum="2,3,4,5", moe_num_experts=4, moe_top_k=2, moe_intermediate_size=32, share_expert_dim=32,
    moe_router_activation="sigmoid", moe_router_scaling_factor=1.5, norm_expert_weight=True,
    use_moe_router_bias=True, use_head_wise_attn_gate=True, use_qk_norm=True,
    swiglu_limits=[0, 0, 0, 0, 0.6, 1.0, 0, 0, 0], swiglu_limits_shared=[0, 0, 0, 0, 0.8, 0.5, 0, 0, 0],
    rms_norm_eps=1e-5, max_position_embeddings=4096, hidden_act="silu", tie_word_embeddings=False,
)
_150M_LAYERS = ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"] * 2 + [
    "full_attention", "sliding_attention"]
_150M = dict(
    vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=10, num_attention_heads=8,
    num_attention_groups=2, head_dim=128, sliding_window=128,  # Step-3.5-Flash: window 128, 3 SWA : 1 full
    attention_other_setting={"attention_type": "sliding_attention", "num_attention_heads": 12,
                             "num_attention_groups": 2, "head_dim": 128},
    layer_types=_150M_LAYERS + ["full_attention"] * 3,
    rope_theta=[5e6 if t == "full_attention" else 1e4 for t in _150M_LAYERS] + [5e6] * 3,
    partial_rotary_factors=[0.5 if t == "full_attention" else 1.0 for t in _150M_LAYERS] + [0.5] * 3,
    moe_layers_enum="6,7,8,9", moe_num_experts=8, moe_top_k=2, moe_intermediate_size=384, share_expert_dim=384,
    swiglu_limits=[0] * 8 + [7.0, 7.0] + [0] * 3, swiglu_limits_shared=[0] * 8 + [16.0, 16.0] + [0] * 3)


def config(dtype: str = "float32", overrides: dict | None = None) -> dict:
    return dict(_STEP3P5, **(overrides or {}), architectures=["Step3p5ForCausalLM"], model_type="step3p5",
                dtype=dtype)


def _tie_heads(config: dict, tensors: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Each NextN head's own lm head := the target's."""
    n = config["num_hidden_layers"]
    for j in range(config["num_nextn_predict_layers"]):
        tensors[f"model.layers.{n + j}.transformer.shared_head.output.weight"] = tensors["lm_head.weight"].copy()
    return tensors


TINY_KINDS = {
    "step3p5": TinyKind(config),
    "step3p5_tied_heads": TinyKind(config, finish=_tie_heads),
    "step3p5_150m": TinyKind(lambda dtype: config(dtype, _150M)),
}
