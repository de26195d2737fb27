"""A test-side stand-in for the Step-3.5 family: the tiny checkpoint's description and its
canonical tensors (Hub names mapped as docs/families/step3p5.md lists), for export tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open

from tandem.checkpoint.description import AttentionSpec, LayerSpec, MLPKind, ModelDescription, MoESpec, MTPSpec


@dataclass(frozen=True)
class Step3p5Checkpoint:
    description: ModelDescription
    folder: Path

    def weight(self, name: str) -> np.ndarray:
        n = self.description.num_layers
        parts = name.split(".")
        if parts[0] == "mtp":   # mtp.layers.{j}.X -> model.layers.{N+j}.X
            name = f"layers.{n + int(parts[2])}." + ".".join(parts[3:])
            name = name.replace("shared_head.norm", "transformer.shared_head.norm")
            name = name.replace("shared_head.head", "transformer.shared_head.output")
        hub = name if name == "lm_head.weight" else "model." + name
        if name.endswith("mlp.experts.gate_up_proj"):
            base = hub.replace("mlp.experts.gate_up_proj", "moe.")
            return np.concatenate([self._read(base + "gate_proj.weight"), self._read(base + "up_proj.weight")], 1)
        for canon, stored in (("mlp.experts.down_proj", "moe.down_proj.weight"),
                              ("mlp.gate.e_score_correction_bias", "moe.router_bias"),
                              ("mlp.gate.weight", "moe.gate.weight"), ("mlp.shared_expert.", "share_expert.")):
            hub = hub.replace(canon, stored)
        return self._read(hub)

    def _read(self, name: str) -> np.ndarray:
        with safe_open(self.folder / "model.safetensors", "np") as f:
            return f.get_tensor(name)


def open_step3p5(folder: Path) -> Step3p5Checkpoint:
    cfg = json.loads((folder / "config.json").read_text())
    other, n = cfg["attention_other_setting"], cfg["num_hidden_layers"]
    moe = {int(i) for i in cfg["moe_layers_enum"].split(",")}

    def attention(i: int) -> AttentionSpec:
        sliding = cfg["layer_types"][i] == "sliding_attention" and i < n
        d = cfg["head_dim"]
        return AttentionSpec(other["num_attention_heads"] if sliding else cfg["num_attention_heads"],
                             cfg["num_attention_groups"], d, int(d * cfg["partial_rotary_factors"][i]),
                             float(cfg["rope_theta"][i]), output_gate=False, window=cfg["sliding_window"] if sliding
                             else None, head_gate=True)

    def layer(i: int, limits: int) -> LayerSpec:
        routed, shared = cfg["swiglu_limits"][limits] or None, cfg["swiglu_limits_shared"][limits] or None
        if i in moe:
            return LayerSpec(attention(i), MLPKind.MOE, routed, shared)
        return LayerSpec(attention(i), MLPKind.DENSE, shared)   # transformers: dense layers clamp with the shared list

    heads = tuple(layer(i, i - n) for i in range(n, n + cfg["num_nextn_predict_layers"]))
    desc = ModelDescription(
        family="step3p5", architecture="Step3p5ForCausalLM", model_type="step3p5", vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        layers=tuple(layer(i, i) for i in range(n)),
        moe=MoESpec(cfg["moe_num_experts"], cfg["moe_top_k"], cfg["moe_intermediate_size"], cfg["share_expert_dim"],
                    norm_topk_prob=True, router="sigmoid", score_correction_bias=True,
                    routed_scaling_factor=cfg["moe_router_scaling_factor"], shared_expert_gate=False),
        rms_norm_eps=cfg["rms_norm_eps"], tie_word_embeddings=False,
        max_position_embeddings=cfg["max_position_embeddings"], dtype="float32",
        mtp=MTPSpec(heads, "checkpoint", form="nextn", own_lm_head=True, anchor="previous_head"))
    return Step3p5Checkpoint(desc, folder)
