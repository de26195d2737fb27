"""Random checkpoints in the exact Hugging Face layouts real models use, small enough for tests.

    write_tiny_checkpoint(tmp / "m", "qwen3_5_mtp1")   # -> folder transformers and tandem load

Kinds (TINY_KINDS): Qwen3.5 dense as the multimodal wrapper with 1 MTP layer (the released
layout, vision tower included), Qwen3.5 dense text with 3 MTP layers, Qwen3.5-MoE (stacked
experts), Qwen3-Next (interleaved GDN projections, per-expert MoE, a dense layer, 2 shards).
Stored names and shapes come from the family's own `sources()`, so the generator and the
reader cannot drift apart silently: a test loads every kind with transformers' classes.

Step-3.5 kinds (STEP3P5_KINDS) are the Hub layout of stepfun-ai/Step-3.5-Flash (MoE as `moe.*` /
`share_expert.*`, three NextN MTP layers at `model.layers.{N..N+2}` with
`transformer.shared_head.{norm,output}`), written from the step3p5 family's `sources()` too;
`step3p5_tied_heads` makes every head's own lm head a copy of `lm_head.weight`, so drafting with the
heads' own lm heads must equal transformers' drafts (which use the target's).

DeepSeek-V3.2 / GLM-5 kinds (tiny_dsa.DSA_KINDS: deepseek_v32, glm_moe_dsa, deepseek_v32_fp8) are the
Hub layout too (per-expert MoE, NextN at `model.layers.{N}`), written from the deepseek_dsa family's
`sources()` with tiny_dsa's finishing touches (plain-RMSNorm weights, fp8 blocks).
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from tandem.checkpoint.families import FAMILIES, FAMILY_MODULES
from tandem.testing.tiny_dsa import DSA_BENCH_KINDS, DSA_KINDS, dsa_config, finish_tensors
from tandem.testing.tokenizer_files import SPECIAL_TOKENS, save_tokenizer, train_byte_level_bpe

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

# kind -> (architecture, mtp layers, per-expert MoE tensors, number of shards)
TINY_KINDS = {
    "qwen3_5_mtp1": ("Qwen3_5ForConditionalGeneration", 1, False, 1),
    "qwen3_5_mtp3": ("Qwen3_5ForCausalLM", 3, False, 1),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", 1, False, 1),
    "qwen3_next": ("Qwen3NextForCausalLM", 1, True, 2),
}
# Larger random checkpoints for benchmarks: kind -> (base tiny kind, text-config overrides).
# qwen3_5_150m: ~150M parameters (12 layers, 9 GDN + 3 attention, hidden 768, vocab 32000).
BENCH_KINDS = {
    "qwen3_5_150m": ("qwen3_5_mtp1", dict(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=128, linear_value_head_dim=128,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 3,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})),
}
_STEP_150M_LAYERS = ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"] * 2 + [
    "full_attention", "sliding_attention"]
# step3p5_150m: ~170M parameters (10 layers, 3 full + 7 window-128, dense 0-5 and MoE 6-9 with 8 experts, hidden
# 768, vocab 16000, three NextN heads with their own lm heads)
BENCH_KINDS["step3p5_150m"] = ("step3p5", dict(
    vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=10, num_attention_heads=8,
    num_attention_groups=2, head_dim=128, sliding_window=128,  # Step-3.5-Flash: window 128, 3 SWA : 1 full
    attention_other_setting={"attention_type": "sliding_attention", "num_attention_heads": 12,
                             "num_attention_groups": 2, "head_dim": 128},
    layer_types=_STEP_150M_LAYERS + ["full_attention"] * 3,
    rope_theta=[5e6 if t == "full_attention" else 1e4 for t in _STEP_150M_LAYERS] + [5e6] * 3,
    partial_rotary_factors=[0.5 if t == "full_attention" else 1.0 for t in _STEP_150M_LAYERS] + [0.5] * 3,
    moe_layers_enum="6,7,8,9", moe_num_experts=8, moe_top_k=2, moe_intermediate_size=384, share_expert_dim=384,
    swiglu_limits=[0] * 8 + [7.0, 7.0] + [0] * 3, swiglu_limits_shared=[0] * 8 + [16.0, 16.0] + [0] * 3))
# Step-3.5-Flash, tiny: 6 layers (full, sliding x2, full, sliding x2) + 3 MTP layers, sliding layers with
# their own head count, window 8, per-type RoPE theta / partial rotary factor, dense layers 0-1 and MoE
# layers 2-5, SwiGLU clamps on layers 4-5 small enough to bind on random weights. Per-layer lists are
# padded with the MTP layers' entries as the Hub config is; the MTP layers are full attention and dense.
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
# kind -> heads' own lm heads are copies of lm_head.weight (the Hub's text-only model, model_type "step3p5").
STEP3P5_KINDS = {"step3p5": False, "step3p5_tied_heads": True}
# kinds the families declare themselves (base.TinyKind), by name
FAMILY_KINDS = {kind: spec for module in FAMILY_MODULES.values()
                for kind, spec in getattr(module, "TINY_KINDS", {}).items()}
_TOKENIZER_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and verifies them.",
    "for i in range(10):\n    print(i * i)\n",
    "Multi-token prediction heads propose several tokens; the target model checks them in one pass.",
    "class Cache:\n    def __init__(self):\n        self.pages = []\n",
]


def tiny_config(kind: str, dtype: str = "float32") -> dict:
    """config.json for a tiny (or BENCH_KINDS) checkpoint of `kind`, as the family's releases write it."""
    kind, overrides = BENCH_KINDS.get(kind, (kind, {}))
    arch, mtp_layers, _, _ = TINY_KINDS[kind]
    text = dict(_TEXT, **overrides, mtp_num_hidden_layers=mtp_layers, dtype=dtype, eos_token_id=2, pad_token_id=0)
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


def _init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random values with the statistics of a trained model, so tests see real signal
    (no near-ties from all-equal logits)."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("linear_attn.norm.weight"):  # plain-weight RMSNormGated
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if "norm" in name and leaf in ("weight", "bias"):  # zero-centred RMSNorm, vision LayerNorm
        return 0.1 * rng.standard_normal(shape)
    if leaf == "A_log":
        return np.log(rng.uniform(1.0, 16.0, shape))
    if leaf == "dt_bias":
        return rng.uniform(0.5, 1.5, shape)
    if leaf in ("bias", "router_bias"):
        return 0.02 * rng.standard_normal(shape)
    if "embed_tokens" in name:
        return rng.standard_normal(shape)
    fan_in = int(np.prod(shape[1:])) if len(shape) == 2 or "conv1d" in name else shape[-1]
    return rng.standard_normal(shape) / np.sqrt(fan_in)


def _vision_shapes(v: dict) -> dict[str, tuple[int, ...]]:
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


def _family_sources(config: dict, per_expert: bool = False) -> dict:
    """The family's canonical -> stored map for this config.json, with every declared MTP layer."""
    arch = config["architectures"][0]
    family = FAMILIES[arch]
    text = family.text_config(config, arch)
    desc = family.describe(config, arch, mtp_layers=text.get(family.mtp_layout(text).count_key, 0),
                           mtp_source="checkpoint")
    return family.sources(desc, per_expert=per_expert)


def stored_shapes(config: dict, per_expert: bool = False) -> dict[str, tuple[int, ...]]:
    """Every stored tensor name -> shape a checkpoint with this config.json holds."""
    shapes: dict[str, tuple[int, ...]] = {}
    for src in _family_sources(config, per_expert).values():
        shapes.update(zip(src.names, src.shapes, strict=True))
    if "vision_config" in config:
        shapes.update(_vision_shapes(config["vision_config"]))
    return shapes


def step3p5_config(dtype: str = "float32", kind: str = "step3p5") -> dict:
    """config.json of the tiny (or a BENCH_KINDS) Step-3.5 checkpoint, with the Hub's key names
    (num_attention_groups, attention_other_setting, moe_layers_enum, per-layer rope_theta lists
    padded with the MTP layers)."""
    overrides = BENCH_KINDS[kind][1] if kind in BENCH_KINDS else {}
    return dict(_STEP3P5, **overrides, architectures=["Step3p5ForCausalLM"], model_type="step3p5", dtype=dtype)


def step3p5_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every stored tensor name -> shape of a Step-3.5 checkpoint (trunk layers, then the NextN MTP
    layers at model.layers.{N..N+2}, each with its own shared head): the family's stored names."""
    return stored_shapes(config)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Minimal safetensors writer (any numpy dtype incl. ml_dtypes.bfloat16), names sorted."""
    tags = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
            np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.uint8): "U8",
            np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        data = np.ascontiguousarray(tensors[name]).tobytes()
        header[name] = {"dtype": tags[tensors[name].dtype], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def write_weights(folder: Path, tensors: dict[str, np.ndarray], shards: int = 1) -> None:
    """model.safetensors, or `shards` files plus model.safetensors.index.json."""
    if shards == 1:
        write_safetensors(folder / "model.safetensors", tensors)
        return
    names = sorted(tensors)
    weight_map, total = {}, 0
    for s in range(shards):
        part = names[s::shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(folder / file, {n: tensors[n] for n in part})
        weight_map.update({n: file for n in part})
        total += sum(tensors[n].nbytes for n in part)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_tiny_tokenizer(folder: Path, vocab_size: int = 300) -> dict[str, int]:
    return save_tokenizer(train_byte_level_bpe(_TOKENIZER_TEXT, vocab_size), folder)


def write_tiny_checkpoint(folder: str | Path, kind: str, *, seed: int = 0, dtype: str = "float32",
                          overrides: dict | None = None) -> Path:
    """Write a complete tiny checkpoint folder of `kind` (see TINY_KINDS) and return its path.
    `overrides`: text-config values on top of the kind's (the tensors follow them)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    spec = FAMILY_KINDS.get(kind)
    if spec is not None:  # declared by its family (checkpoint/families/*: TINY_KINDS)
        config, per_expert, shards = spec.config(dtype), spec.per_expert, spec.shards
        shapes = stored_shapes(config, per_expert)
    elif kind in STEP3P5_KINDS or BENCH_KINDS.get(kind, ("",))[0] in STEP3P5_KINDS:
        config, per_expert, shards = step3p5_config(dtype, kind), False, 1
        shapes = stored_shapes(config)
    elif kind in DSA_KINDS or kind in DSA_BENCH_KINDS:  # the Hub's per-expert tensors
        config, per_expert, shards = dsa_config(kind, dtype), True, 1
        shapes = stored_shapes(config, per_expert)
    else:
        _, _, per_expert, shards = TINY_KINDS[BENCH_KINDS.get(kind, (kind,))[0]]
        config = tiny_config(kind, dtype)
        shapes = stored_shapes(config, per_expert)
    if overrides:
        config.get("text_config", config).update(overrides)
        shapes = stored_shapes(config, per_expert)
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    rng = np.random.default_rng(seed)
    tensors = {name: _init(name, shape, rng).astype(np.float32).astype(np_dtype)
               for name, shape in sorted(shapes.items())}
    if spec is not None and spec.finish is not None:
        tensors = spec.finish(config, tensors, rng)
    if kind in DSA_KINDS or kind in DSA_BENCH_KINDS:
        tensors = finish_tensors(kind, tensors, rng)
    if STEP3P5_KINDS.get(kind):  # each NextN head's own lm head := the target's
        for canonical, src in _family_sources(config).items():
            if canonical.endswith(".shared_head.head.weight"):
                tensors[src.names[0]] = tensors["lm_head.weight"].copy()
    write_weights(folder, tensors, shards)
    ids = write_tiny_tokenizer(folder)
    eos = ids["<|im_end|>"]
    text = config.get("text_config", config)
    text.update(eos_token_id=eos, pad_token_id=ids["<|endoftext|>"])
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"eos_token_id": [eos, ids[SPECIAL_TOKENS[0]]], "pad_token_id": ids["<|endoftext|>"], "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return folder


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny random checkpoint (no download).")
    parser.add_argument("out", help="folder to write")
    parser.add_argument("--kind", choices=sorted(TINY_KINDS) + sorted(STEP3P5_KINDS) + sorted(DSA_KINDS)
                        + sorted(BENCH_KINDS) + sorted(DSA_BENCH_KINDS) + sorted(FAMILY_KINDS),
                        default="qwen3_5_mtp3")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = write_tiny_checkpoint(args.out, args.kind, seed=args.seed, dtype=args.dtype)
    print(f"wrote tiny {args.kind} checkpoint to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
