"""What `tandem inspect` reports about a checkpoint: a plain dict (for --json and tests) and
its aligned text form, with one row per run of identical layers (mixer, window, heads, RoPE, MLP,
SwiGLU clamps), trunk then MTP heads. Latent attention (MLA) reports its dims and indexer, and its
cache bytes per token against the plain per-head K/V cache the same heads would need."""

from __future__ import annotations

from tandem.checkpoint.cache_specs import DTYPE_BYTES
from tandem.checkpoint.description import AttentionSpec, LayerKind, LayerSpec, LinearAttentionSpec, MLPKind, mixer_name
from tandem.checkpoint.mla_specs import INDEX_KEYS, LATENT, MLASpec
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
        "fp8_block": list(ckpt.fp8_block) if ckpt.fp8_block else None,
        "vocab_size": d.vocab_size,
        "hidden_size": d.hidden_size,
        "num_layers": d.num_layers,
        "layer_kinds": kinds,
        "layer_pattern": "".join(_letter(layer) for layer in d.layers),
        "layer_table": [_layer_row(f"layer {i}", layer) for i, layer in enumerate(d.layers)]
        + [_layer_row(f"mtp {j}", layer) for j, layer in enumerate(d.mtp.layers if d.mtp else ())],
        "mlp_kinds": mlps,
        "attention": _attention(next((x.mixer for x in d.all_layers if mixer_name(x.mixer) == "attention"), None)),
        "mla": _mla(d),
        "gated_deltanet": _gdn(d.linear_attention),
        "moe": None if d.moe is None else {"experts": d.moe.num_experts, "top_k": d.moe.top_k,
                                           "expert_intermediate": d.moe.expert_intermediate_size,
                                           "shared_expert_intermediate": d.moe.shared_expert_intermediate_size,
                                           "router": d.moe.router, "score_correction_bias": d.moe.score_correction_bias,
                                           "routed_scaling_factor": d.moe.routed_scaling_factor,
                                           "shared_expert_gate": d.moe.shared_expert_gate,
                                           "n_group": d.moe.n_group, "topk_group": d.moe.topk_group},
        "parameters": {"trunk": ckpt.parameter_count(), "mtp": ckpt.parameter_count(mtp=True) if d.mtp else 0},
        "mtp": None if d.mtp is None else {"layers": d.mtp.num_layers, "source": d.mtp.source,
                                           "mlp": d.mtp.layer.mlp.value, "form": d.mtp.form,
                                           "anchor": d.mtp.anchor, "own_lm_head": d.mtp.own_lm_head},
        "kv_bytes_per_token": {"target": d.kv_bytes_per_token(include_mtp=False),
                               "with_mtp": d.kv_bytes_per_token(include_mtp=True)},
        "state_bytes_per_sequence": d.state_bytes_per_sequence(),
        "eos_token_ids": list(d.eos_token_ids),
        "verdict": "ok",
        "speculative": {"enabled": spec_k is not None, "k": spec_k},
    }
    return out


# per mixer (description.MIXERS' names): its letter in the layer pattern, its fields in the layer table
# and its one-line text in `tandem inspect`. A: full attention, S: sliding-window attention,
# L: Gated DeltaNet, M: latent attention (MLA).

def _attention_row(m: AttentionSpec) -> dict:
    return dict(window=m.window, heads=m.num_heads, kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                rotary_dim=m.rotary_dim, rope_theta=m.rope_theta,
                gate="output" if m.output_gate else "head" if m.head_gate else None, scale=m.scale)


def _attention_text(r: dict) -> str:
    return ((f"sliding window {r['window']}" if r["window"] else "full attention")
            + f", {r['heads']}/{r['kv_heads']} heads x {r['head_dim']}"
            + (f", {r['gate']} gate" if r["gate"] else "")
            + f", RoPE {r['rotary_dim']} dims theta {r['rope_theta']:g}")


def _mla_row(m: MLASpec) -> dict:
    i = m.indexer
    return dict(heads=m.num_heads, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                scale=m.scale, indexer=None if i is None else {
                    "heads": i.num_heads, "head_dim": i.head_dim, "topk": i.topk,
                    "reuse_previous": i.reuse_previous, "rope_interleave": i.rope_interleave})


def _mla_text(r: dict) -> str:
    i = r["indexer"]
    return (f"MLA, {r['heads']} heads, latent {r['kv_lora_rank']} + rope {r['qk_rope_head_dim']}"
            + ("" if i is None else f", reuses the previous layer's top-{i['topk']}" if i["reuse_previous"]
               else f", indexer {i['heads']} x {i['head_dim']} top-{i['topk']}"))


def _gdn_row(m: LinearAttentionSpec) -> dict:
    return dict(heads=m.num_value_heads, head_dim=m.value_head_dim)


def _gdn_text(r: dict) -> str:
    return f"Gated DeltaNet, {r['heads']} value heads x {r['head_dim']}"


_MIXER_SUMMARIES = {  # name -> (letter, table fields, text)
    "attention": (lambda m: "S" if m.window else "A", _attention_row, _attention_text),
    "mla": (lambda m: "M", _mla_row, _mla_text),
    "gated_deltanet": (lambda m: "L", _gdn_row, _gdn_text),
}


def _letter(layer: LayerSpec) -> str:
    return _MIXER_SUMMARIES[mixer_name(layer.mixer)][0](layer.mixer)


def _layer_row(name: str, layer: LayerSpec) -> dict:
    mixer = mixer_name(layer.mixer)
    return {"layer": name, "mixer": mixer, "mlp": layer.mlp.value, "swiglu_limit": layer.swiglu_limit,
            "shared_swiglu_limit": layer.shared_swiglu_limit, **_MIXER_SUMMARIES[mixer][1](layer.mixer)}


def _row_text(r: dict) -> str:
    text = _MIXER_SUMMARIES[r["mixer"]][2](r)
    clamps = [f"{what} clamp {r[key]:g}" for what, key in (("swiglu", "swiglu_limit"),
                                                            ("shared", "shared_swiglu_limit")) if r[key] is not None]
    return ", ".join([text, f"{r['mlp']} MLP", *clamps])


def _runs(table: list[dict]) -> list[tuple[str, str]]:
    """(layers, description) per run of consecutive layers described alike: "layer 4-7", "mtp 0-2"."""
    out: list[tuple[list[str], str]] = []
    for r in table:
        text = _row_text(r)
        if out and out[-1][1] == text and out[-1][0][0].split()[0] == r["layer"].split()[0]:
            out[-1][0].append(r["layer"])
        else:
            out.append(([r["layer"]], text))
    return [(names[0] if len(names) == 1 else f"{names[0]}-{names[-1].split()[1]}", text) for names, text in out]


def _mla(d) -> dict | None:
    """The first MLA layer's dims, and one token's cache bytes over the trunk: latent rows, indexer
    keys, and the per-head K [H, nope + rope] and V [H, v] rows plain attention would keep instead."""
    layers = [x.mixer for x in d.layers if mixer_name(x.mixer) == "mla"]
    if not layers:
        return None
    m, size = layers[0], DTYPE_BYTES[d.dtype]
    pools = [p for x in layers for p in x.cache_specs()]
    y = m.yarn
    return {"heads": m.num_heads, "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
            "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
            "v_head_dim": m.v_head_dim, "rope_theta": m.rope_theta, "yarn_factor": y.factor if y else None,
            "scale": m.scale, "indexer": None if m.indexer is None else {
                "heads": m.indexer.num_heads, "head_dim": m.indexer.head_dim, "topk": m.indexer.topk,
                "reuse_layers": [i for i, x in enumerate(d.layers) if x.mixer.reuses_previous_selection]},
            "bytes_per_token": {
                "latent": sum(p.row_bytes(size) for p in pools if p.name == LATENT),
                "indexer": sum(p.row_bytes(size) for p in pools if p.name == INDEX_KEYS),
                "per_head_kv": sum(x.num_heads * (x.qk_head_dim + x.v_head_dim) for x in layers) * size}}


def _attention(a: AttentionSpec | None) -> dict | None:
    """The first attention layer's spec (the one every Qwen attention layer shares)."""
    if a is None:
        return None
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
        ("dtype", s["dtype"] + (f", projections stored fp8 e4m3 in {s['fp8_block'][0]}x{s['fp8_block'][1]} blocks "
                                "(read dequantized)" if s["fp8_block"] else "")),
        ("vocab / hidden", f"{s['vocab_size']} / {s['hidden_size']}"),
        ("layers", f"{s['num_layers']}: " + ", ".join(
            f"{s['layer_pattern'].count(c)} {what}" for c, what in (("L", "Gated DeltaNet"), ("A", "full attention"),
                                                                    ("S", "sliding-window attention"),
                                                                    ("M", "latent attention (MLA)"))
            if c in s["layer_pattern"]) + f"  [{s['layer_pattern']}]"),
        ("mlp", ", ".join(f"{n} {k}" for k, n in s["mlp_kinds"].items() if n)),
    ]
    if a:
        rows.append(("attention", f"{a['heads']} query / {a['kv_heads']} KV heads x {a['head_dim']}, rotary "
                                  f"{a['rotary_dim']} dims (theta {a['rope_theta']:g})"
                                  + (", output gate" if a["output_gate"] else "")
                                  + (f", sliding window {a['window']}" if a["window"] else "")
                                  + "  (the first layer's)"))
    if s["mla"]:
        rows += _mla_rows(s["mla"], s["dtype"])
    rows += [(f"  {names}", text) for names, text in _runs(s["layer_table"])]
    if g:
        rows.append(("gated deltanet", f"{g['key_heads']} key heads x {g['key_head_dim']}, {g['value_heads']} value "
                                       f"heads x {g['value_head_dim']}, conv kernel {g['conv_kernel']}"))
    if s["moe"]:
        m = s["moe"]
        rows.append(("moe", f"{m['experts']} experts, top-{m['top_k']} ({m['router']} router"
                            + (", score correction bias" if m["score_correction_bias"] else "")
                            + (f", routed x {m['routed_scaling_factor']:g}" if m["routed_scaling_factor"] != 1 else "")
                            + (f", best {m['topk_group']} of {m['n_group']} groups" if m["n_group"] > 1 else "")
                            + f"), expert {m['expert_intermediate']}, shared expert "
                            f"{m['shared_expert_intermediate']}" + (" (gated)" if m["shared_expert_gate"] else "")))
    p = s["parameters"]
    rows.append(("parameters", f"{p['trunk']:,} trunk + {p['mtp']:,} MTP"))
    if s["mtp"]:
        t = s["mtp"]
        rows.append(("mtp heads", f"{t['layers']} layer(s), {t['form']} form, rows anchored on "
                                  + ("the previous head's hidden, " if t["anchor"] == "previous_head"
                                     else "the target's hidden, ")
                                  + ("own lm heads" if t["own_lm_head"] else "the shared lm_head")
                                  + f", from {t['source']}"))
    else:
        rows.append(("mtp heads", "none (plain decoding)"))
    rows += [("KV bytes/token", f"{kv['target']:,} target + {kv['with_mtp'] - kv['target']:,} MTP = "
                                f"{kv['with_mtp']:,} ({s['dtype']})"),
             ("state bytes/seq", f"{s['state_bytes_per_sequence']:,} " + ("(fp32 recurrent + conv window)"
                                                                        if s["state_bytes_per_sequence"]
                                                                        else "(no recurrent layers)"))]
    spec = s["speculative"]
    rows.append(("verdict", "OK: " + (f"ready for speculative decoding, k={spec['k']}" if spec["enabled"]
                                      else "ready for plain decoding")))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _mla_rows(m: dict, dtype: str) -> list[tuple[str, str]]:
    i, b = m["indexer"], m["bytes_per_token"]
    rows = [("mla", f"{m['heads']} heads, q LoRA {m['q_lora_rank']}, kv LoRA {m['kv_lora_rank']}, "
                    f"qk {m['qk_nope_head_dim']} nope + {m['qk_rope_head_dim']} rope, v {m['v_head_dim']}, "
                    f"RoPE theta {m['rope_theta']:g}"
                    + (f" YaRN x{m['yarn_factor']:g}" if m["yarn_factor"] else "") + f", scale {m['scale']:.4g}")]
    if i:
        rows.append(("indexer", f"{i['heads']} heads x {i['head_dim']}, top-{i['topk']} positions per query"
                                + (f"; layers {i['reuse_layers']} reuse the previous layer's selection"
                                   if i["reuse_layers"] else "")))
    cached = b["latent"] + b["indexer"]
    kv = b["per_head_kv"]
    rows.append(("MLA cache/token", f"{b['latent']:,} latent + {b['indexer']:,} indexer = {cached:,} bytes ({dtype}, "
                                    f"trunk) vs {kv:,} for per-head K/V ({kv / cached:.1f}x)"))
    return rows
