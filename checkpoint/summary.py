"""What `tandem inspect` reports about a checkpoint: a plain dict (for --json and tests) and
its aligned text form."""

from __future__ import annotations

from tandem.checkpoint.description import AttentionSpec, LayerKind, LinearAttentionSpec, MLPKind
from tandem.checkpoint.reader import Checkpoint


def summarize(ckpt: Checkpoint, spec_k: int | None) -> dict:
    d = ckpt.description
    kinds = {k.value: len(d.layer_indices(k)) for k in LayerKind}
    mlps = {m.value: sum(1 for layer in d.layers if layer.mlp == m) for m in MLPKind}
    out = {
        "path": str(ckpt.path),
        "family": d.family,
        "architecture": d.architecture,
        "model_type": d.model_type,
        "dtype": d.dtype,
        "vocab_size": d.vocab_size,
        "hidden_size": d.hidden_size,
        "num_layers": d.num_layers,
        "layer_kinds": kinds,
        "layer_pattern": "".join("A" if layer.kind == LayerKind.FULL_ATTENTION else "L" for layer in d.layers),
        "mlp_kinds": mlps,
        "attention": _attention(d.attention),
        "gated_deltanet": _gdn(d.linear_attention),
        "moe": None if d.moe is None else {"experts": d.moe.num_experts, "top_k": d.moe.top_k,
                                           "expert_intermediate": d.moe.expert_intermediate_size,
                                           "shared_expert_intermediate": d.moe.shared_expert_intermediate_size},
        "parameters": {"trunk": ckpt.parameter_count(), "mtp": ckpt.parameter_count(mtp=True) if d.mtp else 0},
        "mtp": None if d.mtp is None else {"layers": d.mtp.num_layers, "source": d.mtp.source,
                                           "mlp": d.mtp.layer.mlp.value},
        "kv_bytes_per_token": {"target": d.kv_bytes_per_token(include_mtp=False),
                               "with_mtp": d.kv_bytes_per_token(include_mtp=True)},
        "state_bytes_per_sequence": d.state_bytes_per_sequence(),
        "eos_token_ids": list(d.eos_token_ids),
        "verdict": "ok",
        "speculative": {"enabled": spec_k is not None, "k": spec_k},
    }
    return out


def _attention(a: AttentionSpec) -> dict:
    """The first attention layer's spec (the one every Qwen attention layer shares)."""
    return {"heads": a.num_heads, "kv_heads": a.num_kv_heads, "head_dim": a.head_dim, "rotary_dim": a.rotary_dim,
            "rope_theta": a.rope_theta, "output_gate": a.output_gate, "window": a.window}


def _gdn(g: LinearAttentionSpec | None) -> dict | None:
    return None if g is None else {"key_heads": g.num_key_heads, "value_heads": g.num_value_heads,
                                   "key_head_dim": g.key_head_dim, "value_head_dim": g.value_head_dim,
                                   "conv_kernel": g.conv_kernel}


def format_summary(s: dict) -> str:
    a, g, kv = s["attention"], s["gated_deltanet"], s["kv_bytes_per_token"]
    rows = [
        ("family", f"{s['family']} ({s['architecture']}, model_type {s['model_type']})"),
        ("dtype", s["dtype"]),
        ("vocab / hidden", f"{s['vocab_size']} / {s['hidden_size']}"),
        ("layers", f"{s['num_layers']}: {s['layer_kinds']['linear_attention']} Gated DeltaNet, "
                   f"{s['layer_kinds']['full_attention']} gated full attention  [{s['layer_pattern']}]"),
        ("mlp", ", ".join(f"{n} {k}" for k, n in s["mlp_kinds"].items() if n)),
        ("attention", f"{a['heads']} query / {a['kv_heads']} KV heads x {a['head_dim']}, rotary {a['rotary_dim']} "
                      f"dims (theta {a['rope_theta']:g})" + (", output gate" if a["output_gate"] else "")
                      + (f", sliding window {a['window']}" if a["window"] else "")),
    ]
    if g:
        rows.append(("gated deltanet", f"{g['key_heads']} key heads x {g['key_head_dim']}, {g['value_heads']} value "
                                       f"heads x {g['value_head_dim']}, conv kernel {g['conv_kernel']}"))
    if s["moe"]:
        m = s["moe"]
        rows.append(("moe", f"{m['experts']} experts, top-{m['top_k']}, expert {m['expert_intermediate']}, "
                            f"shared expert {m['shared_expert_intermediate']}"))
    p = s["parameters"]
    rows.append(("parameters", f"{p['trunk']:,} trunk + {p['mtp']:,} MTP"))
    if s["mtp"]:
        rows.append(("mtp heads", f"{s['mtp']['layers']} layer(s), {s['mtp']['mlp']} MLP, from {s['mtp']['source']}"))
    else:
        rows.append(("mtp heads", "none (plain decoding)"))
    rows += [("KV bytes/token", f"{kv['target']:,} target + {kv['with_mtp'] - kv['target']:,} MTP = "
                                f"{kv['with_mtp']:,} ({s['dtype']})"),
             ("state bytes/seq", f"{s['state_bytes_per_sequence']:,} (fp32 recurrent + conv window)")]
    spec = s["speculative"]
    rows.append(("verdict", "OK: " + (f"ready for speculative decoding, k={spec['k']}" if spec["enabled"]
                                      else "ready for plain decoding")))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
