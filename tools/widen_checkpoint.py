"""Widen a Qwen3.5-layout checkpoint with MTP layers (such as models/tandem-tiny-code) to a larger
hidden and intermediate size without changing what it computes: a model with a large model's
costs whose heads agree as the trained small model's do, for measuring speculation where a step is
bound by memory bandwidth (a CPU cannot train a 150M model with heads in a session).

    .venv/bin/python tools/widen_checkpoint.py models/tandem-tiny-code /tmp/tiny-code-150m \\
        --hidden 1024 --intermediate 4608          # 147M parameters, float32

The new rows and columns are zeros, so every added hidden channel and MLP unit stays 0, and the
residual stream is carried s = sqrt(H' / H) times larger, so that its mean square over H' equals
the small model's over H and every RMSNorm (x / sqrt(ms(x) + eps) * (1 + w), zero-centred) sees
the same ms and eps:
    linear layers reading the hidden state        [out, H] -> [out, H']  (zero columns)
    linear layers writing it (o_proj, out_proj,    [H, in]  -> [H', in]   (zero rows; rows x s)
      down_proj, mtp.fc) and embed_tokens
    MLP units                                       gate/up [I, H] -> [I', H'], down [H, I] -> [H', I']
                                                    (silu(0) * 0 = 0)
    mtp.fc [H, 2H]: the input is cat(embedding half, hidden half); each half keeps its place at the
      start of its H' half
    norms before a layer or mtp.fc                  1 + w -> (1 + w) / s: their outputs are the small
                                                    model's
    the final norms (model.norm, mtp.norm)          as they are: their outputs are s times the small
                                                    model's, which the heads' pre-fc norm takes in
                                                    and lm_head [V, H] -> [V, H'] / s gives back
Scaling 1 + w by sqrt(H / H') alone and keeping the stream's size left eps relatively H' / H times
larger, 4e-4 off at the first layer (the embeddings' mean square is about 3e-4). Attention heads,
Gated DeltaNet heads, head-dim norms, eps and the vocabulary stay as they are. The result is saved
in float32 (the scaled weights are not bfloat16 numbers).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import numpy as np

WRITERS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")   # [H, in]: rows are hidden channels
INPUT_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "pre_fc_norm_embedding.weight",
               "pre_fc_norm_hidden.weight")
FINAL_NORMS = ("model.norm.weight", "mtp.norm.weight")


def widen_tensor(name: str, w: np.ndarray, h: int, h2: int, i: int, i2: int) -> np.ndarray:
    """`w` (float32) in the widened model; raises on a tensor whose role is not known here."""
    def pad(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        out = np.zeros(shape, np.float32)
        out[tuple(slice(0, n) for n in a.shape)] = a
        return out

    s = math.sqrt(h2 / h)
    if name.endswith(INPUT_NORMS) and w.shape == (h,):
        return pad((1.0 + w) / s - 1.0, (h2,))
    if name in FINAL_NORMS:
        return pad(w, (h2,))
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return pad(w, (i2, h2))
    if name.endswith("down_proj.weight"):
        return pad(w * s, (h2, i2))
    if name.endswith("mtp.fc.weight"):                    # [H, 2H]: two input halves
        out = np.zeros((h2, 2 * h2), np.float32)
        out[:h, :h], out[:h, h2:h2 + h] = w[:, :h] * s, w[:, h:] * s
        return out
    if name.endswith(WRITERS):
        return pad(w * s, (h2, w.shape[1]))
    if name.endswith("embed_tokens.weight"):
        return pad(w * s, (w.shape[0], h2))
    if name.endswith("lm_head.weight"):
        return pad(w / s, (w.shape[0], h2))
    if w.ndim == 2 and w.shape[1] == h:                  # readers of the normed hidden state: q/k/v, in_proj_*
        return pad(w, (w.shape[0], h2))
    if w.ndim <= 1 or name.endswith("conv1d.weight"):    # per-head: A_log, dt_bias, head-dim norms, conv
        return w
    raise ValueError(f"{name} {w.shape}: no rule to widen it")


def widen(src: Path, out: Path, hidden: int, intermediate: int) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "qwen3_5_text":      # (its rules know the dense Qwen3.5 text layout only)
        raise SystemExit(f"{src}: model_type {config.get('model_type')!r}; this widens dense Qwen3.5 text "
                         "checkpoints (model_type 'qwen3_5_text'), such as models/tandem-tiny-code")
    h, i = config["hidden_size"], config["intermediate_size"]
    if hidden < h or intermediate < i:
        raise SystemExit(f"--hidden {hidden} / --intermediate {intermediate}: below the checkpoint's {h} / {i}")
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out}: exists and is not empty; name a new folder (nothing there is overwritten)")
    state = load_file(str(src / "model.safetensors"))
    wide = {n: torch.from_numpy(widen_tensor(n, t.float().numpy(), h, hidden, i, intermediate))
            for n, t in state.items()}
    partial = out.with_name(out.name + ".partial")     # renamed when whole: no half-written checkpoint
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for f in src.iterdir():           # tokenizer, generation config, chat template
        if f.is_file() and f.name not in ("config.json", "model.safetensors", "README.md", "training_report.json"):
            shutil.copy2(f, partial / f.name)
    save_file(wide, str(partial / "model.safetensors"), metadata={"format": "pt"})
    config.update(hidden_size=hidden, intermediate_size=intermediate, dtype="float32")
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if out.exists():
        out.rmdir()                   # (empty, checked above)
    partial.rename(out)
    return {"parameters": sum(t.numel() for t in wide.values()), "from": str(src), "to": str(out)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=4608)
    args = p.parse_args(argv)
    result = widen(Path(args.src), Path(args.out), args.hidden, args.intermediate)
    print(f"{result['to']}: {result['parameters'] / 1e6:.1f}M parameters, the function of {result['from']}")


if __name__ == "__main__":
    main()
