"""config.json's values, checked before any family reads them: every number finite (Python's json
reads NaN and Infinity), and the fields tandem reads of the right type and in a sane range. Each
problem names the field (dotted path for nested ones), the value, and what it must be.

The ranges are wide on purpose: they hold every released model and refuse only values no model
has (a norm epsilon of NaN or 2, a context of a trillion tokens, a negative head count), which
would otherwise reach the build as nonsense shapes or a silently broken model.
"""

from __future__ import annotations

import math

# field -> (smallest, largest) for integers (None allowed where families treat it as absent)
INT_RANGES = {
    "vocab_size": (1, 1 << 24), "hidden_size": (1, 1 << 17), "intermediate_size": (1, 1 << 20),
    "moe_intermediate_size": (1, 1 << 20), "shared_expert_intermediate_size": (0, 1 << 20),
    "num_hidden_layers": (1, 1024), "num_attention_heads": (1, 1024), "num_key_value_heads": (1, 1024),
    "head_dim": (1, 4096), "max_position_embeddings": (1, 1 << 24), "sliding_window": (1, 1 << 24),
    "num_experts": (1, 4096), "n_routed_experts": (1, 4096), "num_experts_per_tok": (1, 1024),
    "n_shared_experts": (0, 64), "n_group": (1, 1024), "topk_group": (1, 1024),
    "linear_num_key_heads": (1, 1024), "linear_num_value_heads": (1, 1024), "linear_key_head_dim": (1, 4096),
    "linear_value_head_dim": (1, 4096), "linear_conv_kernel_dim": (1, 64),
    "kv_lora_rank": (1, 1 << 16), "q_lora_rank": (1, 1 << 16), "qk_rope_head_dim": (1, 4096),
    "qk_nope_head_dim": (1, 4096), "v_head_dim": (1, 4096), "index_topk": (1, 1 << 24), "index_n_heads": (1, 1024),
    "index_head_dim": (1, 4096), "first_k_dense_replace": (0, 1024),
    "mtp_num_hidden_layers": (0, 64), "num_nextn_predict_layers": (0, 64),
}
# field -> (exclusive lower bound, inclusive upper bound) for floats
FLOAT_RANGES = {
    "rms_norm_eps": (0.0, 0.1), "layer_norm_eps": (0.0, 0.1), "rope_theta": (0.0, 1e12),
    "partial_rotary_factor": (0.0, 1.0), "routed_scaling_factor": (0.0, 1e4), "factor": (0.0, 1e4),
}


def check_config_values(config: dict, where: str) -> list[str]:
    """Problems with config.json's values (`config`: the whole file; nested objects such as
    text_config and rope_parameters are checked by the same field names)."""
    problems: list[str] = []
    _walk(config, "", where, problems)
    return problems


def _walk(value, path: str, where: str, problems: list[str]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _walk(item, f"{path}.{key}" if path else str(key), where, problems)
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _walk(item, f"{path}[{i}]", where, problems)
        return
    field = path.rsplit(".", 1)[-1]
    if isinstance(value, float) and not math.isfinite(value):
        problems.append(f"{where}: {path} is {value}; it must be a finite number. Fix config.json (it was probably "
                        "written with a NaN or an overflowed value).")
    elif field in INT_RANGES and value is not None:
        low, high = INT_RANGES[field]
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{where}: {path} is {value!r}; it must be an integer in {low:,}..{high:,}. "
                            "Fix config.json.")
        elif not low <= value <= high:
            problems.append(f"{where}: {path} is {value:,}, outside {low:,}..{high:,} (no model has that). "
                            "Fix config.json.")
    elif field in FLOAT_RANGES and value is not None:
        low, high = FLOAT_RANGES[field]
        if isinstance(value, bool) or not isinstance(value, int | float):
            problems.append(f"{where}: {path} is {value!r}; it must be a number in ({low:g}, {high:g}]. "
                            "Fix config.json.")
        elif not low < value <= high:
            problems.append(f"{where}: {path} is {value:g}, outside ({low:g}, {high:g}] (no model has that). "
                            "Fix config.json.")
