"""Train tandem's small shipped model on CPU: a Qwen3.5-text-layout trunk (Gated DeltaNet + gated
full attention, transformers' Qwen3_5ForCausalLM) with three MTP layers (tandem's torch MTP
reference), on the Python standard library source of the running interpreter.

    .venv/bin/python tools/train_small_model.py --out models/tandem-tiny-code --minutes 55
    .venv/bin/python tools/train_small_model.py --out models/tandem-tiny-code --eval-only

Data: every .py file of the stdlib, split train / held-out by a hash of the file path (1 in 20 held
out). Tokenizer: byte-level BPE trained on the training files. Loss: next-token cross-entropy plus
the MTP losses, head s (s = 0, 1, 2) predicting token t+s+2 from the embedding of t+s+1 and the
previous head's hidden (head 0: the trunk's post-norm hidden), weighted MTP_WEIGHTS.

Writes the checkpoint in Hugging Face layout (transformers loads the trunk; mtp.* ride along in the
same safetensors file), a chat template, and a model card with the held-out figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1].parent))
from tandem.checkpoint.families.qwen_hybrid.reference import MTPReference  # noqa: E402
from tandem.testing.tokenizer_files import SPECIAL_TOKENS, save_tokenizer, train_byte_level_bpe  # noqa: E402

MTP_LAYERS = 3
MTP_WEIGHTS = (0.5, 0.3, 0.2)
HELD_OUT_EVERY = 20


def stdlib_files() -> tuple[list[Path], list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py") if "site-packages" not in f.parts)
    held = [f for f in files if int(hashlib.sha256(str(f.relative_to(root)).encode()).hexdigest(), 16)
            % HELD_OUT_EVERY == 0]
    held_set = set(held)
    return [f for f in files if f not in held_set], held


def read(files: list[Path]) -> list[str]:
    out = []
    for f in files:
        try:
            out.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def encode(tok, texts: list[str], eot: int) -> np.ndarray:
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.asarray(ids, dtype=np.int32)


def model_config(vocab: int, eos: int, pad: int) -> dict:
    return dict(
        architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=vocab, hidden_size=256,
        intermediate_size=768, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096, hidden_act="silu",
        tie_word_embeddings=False, mtp_num_hidden_layers=MTP_LAYERS,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        eos_token_id=eos, pad_token_id=pad, bos_token_id=None)


def build(config: dict):
    import transformers

    cfg = transformers.Qwen3_5TextConfig(**{k: v for k, v in config.items() if k not in ("architectures",)})
    model = transformers.Qwen3_5ForCausalLM(cfg)
    mtp = MTPReference(model.model, model.lm_head, cfg, MTP_LAYERS, moe=False)
    for norm in (mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.norm):
        torch.nn.init.zeros_(norm.weight)  # zero-centred RMSNorm: 0 is the identity scale
    return model, mtp


def losses(model, mtp, batch: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """batch [B, T+1+MTP_LAYERS]: trunk loss over T positions, head s over T-s positions."""
    t = batch.shape[1] - 1 - MTP_LAYERS
    inputs = batch[:, :t]
    hidden = model.model(input_ids=inputs).last_hidden_state                 # [B, T, H] post-norm
    trunk = F.cross_entropy(model.lm_head(hidden).flatten(0, 1), batch[:, 1 : t + 1].flatten())
    heads, h = [], hidden
    for s in range(MTP_LAYERS):
        # row i: embed t_{i+s+1}, previous hidden at i -> predict t_{i+s+2}
        g, logits = mtp(batch[:, s + 1 : s + 1 + t], h, layer=s)
        heads.append(F.cross_entropy(logits.flatten(0, 1), batch[:, s + 2 : s + 2 + t].flatten()))
        h = g
    return trunk, heads


@torch.no_grad()
def evaluate(model, mtp, data: np.ndarray, seq: int, batches: int, seed: int = 0) -> dict:
    """Held-out trunk loss and per-head greedy acceptance given the previous drafts are right
    (teacher-forced chain), for chained heads and for head 0 reused."""
    model.eval()
    mtp.eval()
    rng = np.random.default_rng(seed)
    trunk_losses, right_chained, right_reused, total = [], np.zeros(MTP_LAYERS), np.zeros(MTP_LAYERS), 0
    for _ in range(batches):
        starts = rng.integers(0, len(data) - seq - MTP_LAYERS - 2, 8)
        batch = torch.from_numpy(np.stack([data[s : s + seq + 1 + MTP_LAYERS] for s in starts]).astype(np.int64))
        t = seq
        hidden = model.model(input_ids=batch[:, :t]).last_hidden_state
        trunk_losses.append(F.cross_entropy(model.lm_head(hidden).flatten(0, 1), batch[:, 1 : t + 1].flatten()).item())
        for chained, right in ((True, right_chained), (False, right_reused)):
            h = hidden
            for s in range(MTP_LAYERS):
                g, logits = mtp(batch[:, s + 1 : s + 1 + t], h, layer=s if chained else 0)
                right[s] += (logits.argmax(-1) == batch[:, s + 2 : s + 2 + t]).sum().item()
                h = g
        total += batch.shape[0] * t
    model.train()
    mtp.train()
    return {"held_out_loss": float(np.mean(trunk_losses)),
            "acceptance_chained": (right_chained / total).round(4).tolist(),
            "acceptance_reused": (right_reused / total).round(4).tolist(), "tokens": total}


def save(out: Path, model, mtp, config: dict, tok_ids: dict) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    shared = ("embed_tokens.", "lm_head.", "rotary_emb.")
    for k, v in mtp.state_dict().items():
        if not k.startswith(shared):
            state["mtp." + k] = v.detach().to(torch.bfloat16).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}, indent=2) + "\n")
    gen = {"eos_token_id": [tok_ids["<|im_end|>"], tok_ids["<|endoftext|>"]], "pad_token_id": tok_ids["<|endoftext|>"],
           "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def load(out: Path):
    from safetensors.torch import load_file

    config = json.loads((out / "config.json").read_text())
    model, mtp = build({k: v for k, v in config.items() if k != "dtype"})
    state = {k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()}
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("mtp.")}, strict=True)
    missing, unexpected = mtp.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("mtp.")},
                                              strict=False)
    assert not unexpected and all(m.startswith(("embed_tokens.", "lm_head.", "rotary_emb.")) for m in missing)
    return model, mtp


def model_card(out: Path, report: dict) -> None:
    e = report["eval"]
    rows = "\n".join(f"| head {s + 1} | {e['acceptance_chained'][s]:.3f} | {e['acceptance_reused'][s]:.3f} |"
                     for s in range(MTP_LAYERS))
    (out / "README.md").write_text(f"""# tandem-tiny-code

A small Qwen3.5-layout model with three MTP layers, trained by tandem on CPU so that its first
command runs on something real. It writes Python-looking code; it is not a useful assistant.

- Architecture: `Qwen3_5ForCausalLM` (6 layers: Gated DeltaNet, Gated DeltaNet, gated full
  attention, twice; hidden 256; 4 query / 2 KV heads of 64; GDN 2 key / 4 value heads of 64),
  {report['parameters']['trunk'] / 1e6:.1f} M trunk parameters + {report['parameters']['mtp'] / 1e6:.1f} M in
  three MTP layers (`mtp.*`, chained: layer s drafts token s+1), bf16 safetensors.
- Data: the `.py` files of the Python {report['python']} standard library; 1 file in {HELD_OUT_EVERY} held out
  (by a hash of its path): {report['train_tokens']:,} training tokens, {report['held_tokens']:,} held-out tokens.
- Tokenizer: byte-level BPE, {report['vocab']} tokens, trained on the training files; ChatML chat template.
- Training: {report['steps']} steps of {report['batch']} x {report['seq']} tokens ({report['tokens_seen']:,} tokens) in
  {report['minutes']:.1f} minutes on {report['threads']} CPU threads ({report['tokens_per_second']:.0f} tokens/s), AdamW
  lr {report['lr']} cosine, loss = next-token + {' + '.join(f'{w} x head {i + 1}' for i, w in enumerate(MTP_WEIGHTS))}.
- Final training losses: trunk {report['final_losses']['trunk']:.3f}, heads
  {', '.join(f'{x:.3f}' for x in report['final_losses']['heads'])}.

## Held-out figures ({e['tokens']:,} positions)

Next-token loss: {e['held_out_loss']:.3f} nats/token.

Greedy acceptance per head, given the previous drafts are right:

| | chained heads (layer s at step s) | head 1 reused |
| --- | --- | --- |
{rows}

## Reproduce

```bash
make setup-test
.venv/bin/python tools/train_small_model.py --out models/tandem-tiny-code --minutes {report['minutes_budget']}
.venv/bin/python tools/train_small_model.py --out models/tandem-tiny-code --eval-only
```
""")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="models/tandem-tiny-code")
    parser.add_argument("--minutes", type=float, default=55.0)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-only", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_files, held_files = stdlib_files()
    if args.eval_only:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        held = encode(tok, read(held_files), tok.token_to_id("<|endoftext|>"))
        model, mtp = load(out)
        print(json.dumps(evaluate(model, mtp, held, args.seq, 40), indent=2))
        return

    t0 = time.time()
    train_texts, held_texts = read(train_files), read(held_files)
    tok = train_byte_level_bpe(train_texts, args.vocab)
    ids = save_tokenizer(tok, out, model_max_length=4096)
    eot = ids["<|endoftext|>"]
    train, held = encode(tok, train_texts, eot), encode(tok, held_texts, eot)
    print(f"tokenizer + data: {time.time() - t0:.0f} s; {len(train):,} train tokens, {len(held):,} held-out tokens",
          flush=True)
    config = model_config(tok.get_vocab_size(), ids["<|im_end|>"], eot)
    model, mtp = build(config)
    params = [p for p in list(model.parameters()) + [p for n, p in mtp.named_parameters()
                                                     if not n.startswith(("embed_tokens.", "lm_head."))]]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(args.seed)
    budget = args.minutes * 60
    start, step, seen, warmup = time.time(), 0, 0, 100
    est_steps = None
    history = []
    while time.time() - start < budget:
        elapsed = time.time() - start
        if step == 20:
            est_steps = int(budget / (elapsed / 20))
        total = est_steps or 10**9
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, step / total)))
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * cosine)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, len(train) - args.seq - MTP_LAYERS - 2, args.batch)
        batch = torch.from_numpy(np.stack([train[s : s + args.seq + 1 + MTP_LAYERS] for s in starts]).astype(np.int64))
        trunk, heads = losses(model, mtp, batch)
        loss = trunk + sum(w * h for w, h in zip(MTP_WEIGHTS, heads))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        seen += args.batch * args.seq
        if step % 25 == 0:
            rate = seen / (time.time() - start)
            history.append({"step": step, "trunk": trunk.item(), "heads": [h.item() for h in heads]})
            print(f"step {step} lr {lr:.2e} trunk {trunk.item():.3f} heads {[round(h.item(), 3) for h in heads]} "
                  f"{rate:.0f} tok/s", flush=True)
    minutes = (time.time() - start) / 60
    save(out, model, mtp, config, ids)
    report = {
        "python": sys.version.split()[0], "vocab": tok.get_vocab_size(), "train_tokens": int(len(train)),
        "held_tokens": int(len(held)), "steps": step, "batch": args.batch, "seq": args.seq, "tokens_seen": seen,
        "minutes": minutes, "minutes_budget": args.minutes, "threads": torch.get_num_threads(),
        "tokens_per_second": seen / (minutes * 60), "lr": args.lr,
        "final_losses": {"trunk": float(np.mean([h["trunk"] for h in history[-4:]])),
                         "heads": np.mean([h["heads"] for h in history[-4:]], axis=0).tolist()},
        "parameters": {"trunk": sum(p.numel() for p in model.parameters()),
                       "mtp": sum(p.numel() for n, p in mtp.named_parameters()
                                  if not n.startswith(("embed_tokens.", "lm_head.")))},
        "eval": evaluate(model, mtp, held, args.seq, 40), "loss_curve": history, "special_tokens": SPECIAL_TOKENS,
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    model_card(out, report)
    print(json.dumps(report["eval"], indent=2))


if __name__ == "__main__":
    main()
