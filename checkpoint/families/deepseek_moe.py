"""DeepSeek-V3's MLP layout and stored names, shared by the families built on it (DeepSeek-V3.2,
GLM-5, GLM-4-MoE): the first layers dense, the rest MoE with sigmoid scoring, the score-correction
bias, group-limited routing, a scaled routed sum and `n_shared_experts` shared experts folded into
one; stored under `model.` with `mlp.shared_experts.*`, experts one tensor each (the Hub) or stacked
(transformers' save), NextN head j as decoder layer N+j."""

from __future__ import annotations

from tandem.checkpoint.description import ModelDescription, MoESpec
from tandem.checkpoint.families.base import ConfigError, Source, config_value, nextn_stored, single
from tandem.checkpoint.families.layer_tensors import expert_sources, nextn_model_shapes


def mlp_types(cfg: dict, n: int, first_dense_default: int) -> list[str]:
    """"dense" or "sparse" per trunk layer: transformers 5.24's `mlp_layer_types`, else the Hub's
    `first_k_dense_replace` (the family's default where the key is absent)."""
    types = cfg.get("mlp_layer_types")
    if types is None:
        dense = min(int(cfg.get("first_k_dense_replace", first_dense_default)), n)
        types = ["dense"] * dense + ["sparse"] * (n - dense)
    if len(types) != n or set(types) - {"dense", "sparse"}:
        raise ConfigError(f"mlp_layer_types {types} must give 'dense' or 'sparse' for each of the {n} layers")
    return list(types)


def moe_spec(cfg: dict) -> MoESpec:
    if int(cfg.get("n_shared_experts", 1)) < 1:
        raise ConfigError(f"'n_shared_experts' is {cfg['n_shared_experts']}; tandem needs the shared expert")
    expert = int(config_value(cfg, "moe_intermediate_size"))
    return MoESpec(
        num_experts=int(config_value(cfg, "n_routed_experts", cfg.get("num_experts"))),
        top_k=int(config_value(cfg, "num_experts_per_tok")), expert_intermediate_size=expert,
        shared_expert_intermediate_size=expert * int(cfg.get("n_shared_experts", 1)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), router="sigmoid", score_correction_bias=True,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)), shared_expert_gate=False,
        n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1))


def sources(desc: ModelDescription, per_expert: bool = False) -> dict[str, Source]:
    """Every canonical tensor's stored form (the trunk and its NextN heads)."""
    out: dict[str, Source] = {}
    for canonical, shape in nextn_model_shapes(desc).items():
        stored = nextn_stored(canonical, desc.num_layers).replace(".mlp.shared_expert.", ".mlp.shared_experts.")
        if canonical == "lm_head.weight":
            out[canonical] = single("model.embed_tokens.weight" if desc.tie_word_embeddings else canonical, shape)
        elif ".mlp.experts." in canonical:
            out[canonical] = expert_sources(stored, shape, "model.", per_expert)
        else:
            out[canonical] = single("model." + stored, shape)
    return out
