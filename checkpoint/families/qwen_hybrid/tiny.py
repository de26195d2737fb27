"""Tiny Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints in the released layouts, shared by the three
families' `tiny` modules (testing/tiny_checkpoints.py writes them): hidden 64, 4 layers (GDN,
attention, GDN, attention), 4 query / 2 KV heads of 16, GDN with 2 key / 4 value heads of 16.

    Qwen3_5ForConditionalGeneration   the multimodal wrapper, text under `text_config`, with a one-block
                                      vision tower (stored, never read) and interleaved M-RoPE sections
    Qwen3_5ForCausalLM                text only
    Qwen3_5MoeForCausalLM             every layer MoE: 4 experts, top 2, a gated shared expert, stacked
    Qwen3NextForCausalLM              layer types from full_attention_interval, layer 1 dense, the
                                      top-level rope keys, per-expert tensors in 2 shards
"""

from __future__ import annotations

from tandem.checkpoint.families.base import Shape, TinyKind

_TEXT = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    max_position_embeddings=4096, hidden_act="silu", tie_word_embeddings=False,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
               temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
# ~150M parameters for benchmarks: 12 layers (9 GDN + 3 attention), hidden 768, vocab 32000
BENCH_150M = dict(
    vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
    num_key_value_heads=2, head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=128, linear_value_head_dim=128,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 3,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


def config(arch: str, mtp_layers: int, dtype: str, overrides: dict | None = None) -> dict:
    """config.json of a tiny checkpoint of `arch`, as the family's releases write it."""
    text = dict(_TEXT, **(overrides or {}), mtp_num_hidden_layers=mtp_layers, dtype=dtype, eos_token_id=2,
                pad_token_id=0)
    if arch.startswith("Qwen3_5Moe"):
        text.update(_MOE, model_type="qwen3_5_moe_text")
    elif arch == "Qwen3NextForCausalLM":
        # No layer_types: derived from full_attention_interval; layer 1 keeps a dense MLP.
        text.update(_MOE, model_type="qwen3_next", full_attention_interval=2, decoder_sparse_step=1,
                    mlp_only_layers=[1], norm_topk_prob=True)
        del text["layer_types"]
        text["rope_theta"] = text["rope_parameters"]["rope_theta"]
        text["partial_rotary_factor"] = text.pop("rope_parameters")["partial_rotary_factor"]
    else:
        text["model_type"] = "qwen3_5_text"
    if arch == "Qwen3_5ForConditionalGeneration":
        text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[1, 1, 0], mrope_interleaved=True)
        return {"architectures": [arch], "model_type": "qwen3_5", "text_config": text,
                "vision_config": dict(_VISION, model_type="qwen3_5_vision"), "tie_word_embeddings": False,
                "dtype": dtype}
    return dict(text, architectures=[arch])


def vision_shapes(config: dict) -> dict[str, Shape]:
    """The wrapper's vision tower (`model.visual.*`): stored, ignored by the family, loaded by transformers."""
    v = config["vision_config"]
    h, m, p, t = v["hidden_size"], v["intermediate_size"], v["patch_size"], v["temporal_patch_size"]
    merged = h * v["spatial_merge_size"] ** 2
    out = {"model.visual.patch_embed.proj.weight": (h, v["in_channels"], t, p, p),
           "model.visual.patch_embed.proj.bias": (h,),
           "model.visual.pos_embed.weight": (v["num_position_embeddings"], h),
           "model.visual.merger.norm.weight": (h,), "model.visual.merger.norm.bias": (h,),
           "model.visual.merger.linear_fc1.weight": (merged, merged), "model.visual.merger.linear_fc1.bias": (merged,),
           "model.visual.merger.linear_fc2.weight": (v["out_hidden_size"], merged),
           "model.visual.merger.linear_fc2.bias": (v["out_hidden_size"],)}
    for b in range(v["depth"]):
        q = f"model.visual.blocks.{b}."
        out.update({q + "norm1.weight": (h,), q + "norm1.bias": (h,), q + "norm2.weight": (h,), q + "norm2.bias": (h,),
                    q + "attn.qkv.weight": (3 * h, h), q + "attn.qkv.bias": (3 * h,), q + "attn.proj.weight": (h, h),
                    q + "attn.proj.bias": (h,), q + "mlp.linear_fc1.weight": (m, h), q + "mlp.linear_fc1.bias": (m,),
                    q + "mlp.linear_fc2.weight": (h, m), q + "mlp.linear_fc2.bias": (h,)})
    return out


def kind(arch: str, mtp_layers: int, *, per_expert: bool = False, shards: int = 1,
         overrides: dict | None = None) -> TinyKind:
    wrapper = arch == "Qwen3_5ForConditionalGeneration"
    return TinyKind(lambda dtype: config(arch, mtp_layers, dtype, overrides), per_expert=per_expert, shards=shards,
                    extra_shapes=vision_shapes if wrapper else None)
