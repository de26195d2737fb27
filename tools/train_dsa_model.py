"""Train a small DeepSeek-V3.2-layout model with its NextN layer on CPU, so that the NextN draft's
index share (docs/families/deepseek_v32.md) can be measured on weights whose drafts get accepted.

    .venv/bin/python tools/train_dsa_model.py --out /tmp/dsa-small --minutes 20 [--tokenizer models/tandem-tiny-code]
    .venv/bin/python tools/train_dsa_model.py --out /tmp/dsa-small --eval-only

Trunk: transformers' DeepseekV32ForCausalLM (sparse MLA with the lightning indexer, DeepSeek MoE,
layer 0 dense). NextN: `model.layers.{N}` run by tandem's torch reference (checkpoint/families/deepseek_dsa/reference.
NextNReference.forward), the math the engines' drafts are tested against. Data and tokenizer are
tools/train_small_model.py's (stdlib .py files, held-out split by path hash, byte-level BPE).

Loss = next-token + sum_s w_s * NextN step s + the indexer's KL. NextN step s (s = 0, 1, 2, the
one layer reused, its post-norm hidden chained as the engines do) drafts t_{j+s+2} from the row
(t_{j+s+1}, g^{s-1}_j) at position j+s, which sees the step-0 rows 0..j and rows j of steps 1..s:
as served, where a draft row follows the committed rows. The indexer's forward is no_grad in
transformers (only its top-k leaves it), so it is trained as DeepSeek-V3.2 trains it: KL from the
main attention's distribution (summed over heads, L1-normalised) to softmax of the index scores,
indexer inputs detached. Warm-up (the first --dense-share of the budget): dense attention, KL over
every visible position; then sparse (top-`index_topk`), KL over the selected positions.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT / "tools"))
from train_small_model import encode, read, stdlib_files  # noqa: E402

from tandem.checkpoint.families.deepseek_dsa.reference import NextNReference  # noqa: E402
from tandem.testing.tokenizer_files import save_tokenizer, train_byte_level_bpe  # noqa: E402

STEPS_WEIGHTS = (0.5, 0.3, 0.2)     # NextN draft steps 0, 1, 2 (k = 3 at serving)


def model_config(vocab: int, eos: int, pad: int, layers: int = 4, hidden: int = 192, topk: int = 16) -> dict:
    """config.json in the Hub's key names (first_k_dense_replace, rope_theta), as DeepSeek publishes it."""
    return dict(
        architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=4 * hidden, moe_intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid",
        first_k_dense_replace=1, q_lora_rank=hidden // 2, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, index_topk=topk, index_head_dim=32, index_n_heads=8, num_nextn_predict_layers=1,
        rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=4096, hidden_act="silu",
        tie_word_embeddings=False, attention_bias=False, eos_token_id=eos, pad_token_id=pad, bos_token_id=None)


def hub_tensors(model, nextn_layer, own: dict, n: int) -> dict[str, torch.Tensor]:
    """The Hub layout: per-expert MoE tensors, the NextN layer at model.layers.{n} with its copy of the
    embedding (NextNReference's loader stacks the experts back)."""
    state = {f"model.layers.{n}.{k}": v for k, v in nextn_layer.state_dict().items()}
    state.update({f"model.layers.{n}.{k}": v for k, v in own.items()})
    state.update(model.state_dict())
    state[f"model.layers.{n}.embed_tokens.weight"] = model.model.embed_tokens.weight
    out = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):                     # [E, 2I, H] -> gate [I, H], up [I, H]
            base = k[: -len("gate_up_proj")]
            for e, w in enumerate(v):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = w.chunk(2)
        elif k.endswith("mlp.experts.down_proj"):
            out.update({f"{k[: -len('down_proj')]}{e}.down_proj.weight": w for e, w in enumerate(v)})
        else:
            out[k] = v
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in out.items()}


def save(out: Path, model, nextn_layer, own: dict, config: dict, eos: int, pad: int) -> None:
    from safetensors.torch import save_file

    save_file(hub_tensors(model, nextn_layer, own, config["num_hidden_layers"]), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}, indent=2) + "\n")
    gen = {"eos_token_id": [eos, pad], "pad_token_id": pad, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def initialise(out: Path, config: dict, eos: int, pad: int) -> None:
    """Random weights (transformers' initialisation) written to `out`: the NextN layer is layer N of
    a model built with N + 1 layers (an MoE layer with its own indexer); its norms 1, eh_proj and
    shared_head.head normal(0.02) as transformers initialises linear layers."""
    import transformers

    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    cfg = transformers.DeepseekV32Config(**{k: v for k, v in config.items() if k != "architectures"} | {
        "num_hidden_layers": n + 1})
    big = transformers.DeepseekV32ForCausalLM(cfg)
    std = cfg.initializer_range
    own = {"enorm.weight": torch.ones(hidden), "hnorm.weight": torch.ones(hidden),
           "eh_proj.weight": std * torch.randn(hidden, 2 * hidden), "shared_head.norm.weight": torch.ones(hidden),
           "shared_head.head.weight": std * torch.randn(config["vocab_size"], hidden)}
    nextn_layer = big.model.layers[n]
    del big.model.layers[n]
    save(out, big, nextn_layer, own, config, eos, pad)


def load(out: Path):
    """(target DeepseekV32ForCausalLM, NextNReference) from `out`, float32, eager attention (the
    indexer KL reads the attention probabilities)."""
    import transformers

    transformers.logging.set_verbosity_error()
    target, info = transformers.DeepseekV32ForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    n = target.config.num_hidden_layers
    unexpected = [k for k in info["unexpected_keys"] if not k.startswith(f"model.layers.{n}.")]
    if info["missing_keys"] or unexpected:        # the NextN layer N is the only thing transformers leaves unread
        raise ValueError(f"{out}: transformers reports missing {info['missing_keys']}, unexpected {unexpected}")
    return target, NextNReference(target, out)


def step_visible(t: int, anchors: torch.Tensor, steps: int) -> torch.Tensor:
    """[t + (steps-1) m, same] bool over the rows [step 0 (t rows); step 1 (m anchors); ...]: step-0 row j
    sees step-0 rows 0..j; the step-u row of anchor j sees step-0 rows 0..j and anchor j's rows of
    steps 1..u (what a draft row sees when served: the committed rows, then its chain of drafts)."""
    m, n = len(anchors), t + (steps - 1) * len(anchors)
    visible = torch.zeros(n, n, dtype=torch.bool)
    visible[:t, :t] = torch.ones(t, t, dtype=torch.bool).tril()
    for u in range(1, steps):
        rows = slice(t + (u - 1) * m, t + u * m)
        visible[rows, :t] = torch.arange(t)[None] <= anchors[:, None]
        for v in range(1, u + 1):
            visible[rows, t + (v - 1) * m : t + v * m] = torch.eye(m, dtype=torch.bool)
    return visible


def nextn_steps(nextn, batch: torch.Tensor, hidden: torch.Tensor, steps: int, anchors: torch.Tensor):
    """[(logits, targets)] of draft steps 0..steps-1: step 0 over every row, steps >= 1 over the
    `anchors` rows (a subset saves time; all rows for the evaluation). batch [B, T + 1 + steps],
    hidden [B, T, H] post-norm. Step s, anchor j: the row (t_{j+s+1}, g^{s-1}_j) at position j+s
    drafts t_{j+s+2}."""
    t = hidden.shape[1]
    tokens, hiddens, positions, out = [batch[:, 1 : 1 + t]], [hidden], [torch.arange(t)], []
    for s in range(steps):
        g, logits = nextn.forward(torch.cat(tokens, 1), torch.cat(hiddens, 1), torch.cat(positions),
                                  step_visible(t, anchors, s + 1))
        rows = torch.arange(t) if s == 0 else anchors
        out.append((logits[:, -len(rows) :], batch[:, rows + s + 2]))
        tokens.append(batch[:, anchors + s + 2])                              # the next step's rows
        hiddens.append(g[:, -len(rows) :][:, anchors] if s == 0 else g[:, -len(rows) :])
        positions.append(anchors + s + 1)
    return out


class IndexerKL:
    """Records each attention call's indexer inputs, top-k and attention probabilities (forward
    hooks), then gives the indexer loss: KL(p || softmax(index scores)) over the attended set."""

    def __init__(self, attns, sequences: int):
        self.calls: list[dict] = []
        self.sequences = sequences          # the loss reads the first ones of the batch (time)
        for attn in attns:
            attn.indexer.register_forward_hook(self._indexer, with_kwargs=True)
            attn.register_forward_hook(self._attn)

    def _indexer(self, module, args, kwargs, topk):
        hidden, q_resid, (cos, sin), mask = args[:4]
        self.calls.append(dict(ix=module, hidden=hidden.detach(), q_resid=q_resid.detach(), cos=cos, sin=sin,
                               mask=mask, topk=topk))

    def _attn(self, module, args, out):
        self.calls[-1]["probs"] = out[1].detach()                          # [B, heads, S, T]

    def loss(self) -> torch.Tensor:
        def first(x):
            return x[: self.sequences] if x.shape[0] > 1 else x

        total = sum(self._one(c["ix"], *(first(c[k]) for k in ("hidden", "q_resid", "cos", "sin", "mask", "topk",
                                                                 "probs"))) for c in self.calls)
        n = len(self.calls)
        self.calls.clear()
        return total / n

    @staticmethod
    def scores(ix, hidden, q_resid, cos, sin):
        """DeepseekV32Indexer.forward's index scores [B, S, T] before masking, with gradients."""
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

        b, s, _ = hidden.shape
        r = ix.qk_rope_head_dim
        q = ix.wq_b(q_resid).view(b, s, ix.n_heads, ix.head_dim)              # [B, S, Hi, D]
        k = ix.k_norm(ix.wk(hidden)).unsqueeze(2)                             # [B, T, 1, D]
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)   # NeoX halves
        q, k = torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1).squeeze(2)
        dots = F.relu(torch.einsum("bshd,btd->bsht", q, k) * ix.softmax_scale)
        w = ix.weights_proj(hidden) * ix.n_heads ** -0.5                        # [B, S, Hi]
        return torch.einsum("bsh,bsht->bst", w, dots)

    def _one(self, ix, hidden, q_resid, cos, sin, mask, topk, probs) -> torch.Tensor:
        visible = (mask == 0) if mask.dtype != torch.bool else mask                       # [B, S, T]
        chosen = torch.zeros(*topk.shape[:2], visible.shape[-1], dtype=torch.bool).scatter(-1, topk.long(), True)
        chosen &= visible
        p = probs.sum(1) * chosen
        p = p / p.sum(-1, keepdim=True)
        logq = torch.log_softmax(self.scores(ix, hidden, q_resid, cos, sin).masked_fill(~chosen, -torch.inf), -1)
        kl = torch.where(chosen, torch.xlogy(p, p) - p * logq.masked_fill(~chosen, 0.0), 0.0)
        return kl.sum(-1).mean()


def set_dense(attns, dense: bool, topk: int) -> None:
    for attn in attns:
        attn.indexer.index_topk = 1 << 30 if dense else topk


def windows(data: np.ndarray, rng, batch: int, length: int) -> torch.Tensor:
    starts = rng.integers(0, len(data) - length - 1, batch)
    return torch.from_numpy(np.stack([data[s : s + length] for s in starts]).astype(np.int64))


@torch.no_grad()
def evaluate(target, nextn, data: np.ndarray, seq: int, batches: int, seed: int = 0) -> dict:
    """Held-out next-token loss and, per draft step, the share of drafts equal to the text given the
    previous drafts were (teacher-forced, sparse attention, each step's own indexer: index share off)."""
    rng = np.random.default_rng(seed)
    steps = len(STEPS_WEIGHTS)
    losses, right, total = [], np.zeros(steps), 0
    for _ in range(batches):
        batch = windows(data, rng, 8, seq + 1 + steps)
        hidden = target.model(input_ids=batch[:, :seq]).last_hidden_state
        losses.append(F.cross_entropy(target.lm_head(hidden).flatten(0, 1), batch[:, 1 : seq + 1].flatten()).item())
        for s, (logits, want) in enumerate(nextn_steps(nextn, batch, hidden, steps, torch.arange(seq))):
            right[s] += (logits.argmax(-1) == want).sum().item()
        total += batch.shape[0] * seq
    return {"held_out_loss": float(np.mean(losses)), "acceptance": (right / total).round(4).tolist(), "tokens": total}


def tokenizer(args, train_texts: list[str]):
    from tokenizers import Tokenizer

    if args.tokenizer:
        return Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    return train_byte_level_bpe(train_texts, args.vocab)


def train(args, target, nextn, train_data: np.ndarray, topk: int) -> dict:
    attns = [layer.self_attn for layer in target.model.layers] + [nextn.layer.self_attn]
    kl = IndexerKL(attns, args.kl_sequences)
    for v in nextn.own.values():
        v.requires_grad_(True)
    own = [v for k, v in nextn.own.items() if k != "embed_tokens.weight"]       # the Hub's copy is never read
    params = list(target.parameters()) + list(nextn.layer.parameters()) + own
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(args.seed)
    budget, warmup, steps = args.minutes * 60, 50, len(STEPS_WEIGHTS)
    start, step, history, est, last = time.time(), 0, [], None, {}
    target.train()
    nextn.layer.train()
    while time.time() - start < budget and step < (args.max_steps or 1 << 62):
        elapsed = time.time() - start
        dense = elapsed < args.dense_share * budget
        set_dense(attns, dense, topk)
        if step == 10:
            est = int(budget / (elapsed / 10))
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, step / (est or 1 << 30))))
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * cosine)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = windows(train_data, rng, args.batch, args.seq + 1 + steps)
        hidden = target.model(input_ids=batch[:, : args.seq]).last_hidden_state          # [B, T, H] post-norm
        trunk = F.cross_entropy(target.lm_head(hidden).flatten(0, 1), batch[:, 1 : args.seq + 1].flatten())
        anchors = torch.from_numpy(np.sort(rng.choice(args.seq, args.seq // args.anchor_every, replace=False)))
        heads = [F.cross_entropy(lg.flatten(0, 1), want.flatten())
                 for lg, want in nextn_steps(nextn, batch, hidden, steps, anchors)]
        index = kl.loss()
        loss = trunk + sum(w * h for w, h in zip(STEPS_WEIGHTS, heads)) + index
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        last = {"step": step, "dense": dense, "trunk": trunk.item(), "heads": [h.item() for h in heads],
                "indexer_kl": index.item()}
        if step % 10 == 0:
            row = last
            history.append(row)
            rate = step * args.batch * args.seq / (time.time() - start)
            print(json.dumps(row | {"lr": round(lr, 6), "tok_s": round(rate)}), flush=True)
    set_dense(attns, False, topk)
    target.eval()
    nextn.layer.eval()
    for v in nextn.own.values():
        v.requires_grad_(False)
    return {"steps": step, "minutes": (time.time() - start) / 60, "last": last, "loss_curve": history,
            "tokens_seen": step * args.batch * args.seq}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="checkpoint folder (outside the repo: weights are not committed)")
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--tokenizer", help="folder whose tokenizer.json to reuse (default: train one, --vocab)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--index-topk", type=int, default=16)
    parser.add_argument("--max-steps", type=int, help="stop after this many steps, even within --minutes")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dense-share", type=float, default=0.2, help="share of the budget with dense attention")
    parser.add_argument("--anchor-every", type=int, default=4,
                        help="NextN steps >= 1 train on 1 in this many rows (random; 1: every row)")
    parser.add_argument("--kl-sequences", type=int, default=2, help="sequences of the batch the indexer KL reads")
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-only", action="store_true")
    args = parser.parse_args()
    if args.index_topk >= args.seq:
        raise SystemExit(f"--index-topk {args.index_topk} must be below --seq {args.seq}, or attention is never sparse")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    train_files, held_files = stdlib_files()
    if args.eval_only:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        held = encode(tok, read(held_files), tok.token_to_id("<|endoftext|>"))
        print(json.dumps(evaluate(*load(out), held, args.seq, args.eval_batches), indent=2))
        return
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    train_texts, held_texts = read(train_files), read(held_files)
    tok = tokenizer(args, train_texts)
    ids = save_tokenizer(tok, out, model_max_length=4096)
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    train_data, held = encode(tok, train_texts, pad), encode(tok, held_texts, pad)
    print(f"tokenizer + data: {time.time() - t0:.0f} s; {len(train_data):,} train, {len(held):,} held-out tokens",
          flush=True)
    config = model_config(tok.get_vocab_size(), eos, pad, args.layers, args.hidden, args.index_topk)
    initialise(out, config, eos, pad)
    target, nextn = load(out)
    report = train(args, target, nextn, train_data, args.index_topk)
    save(out, target, nextn.layer, {k: v for k, v in nextn.own.items() if k != "embed_tokens.weight"}, config, eos, pad)
    report.update(config={k: v for k, v in config.items() if k != "architectures"}, threads=torch.get_num_threads(),
                  batch=args.batch, seq=args.seq, lr=args.lr, dense_share=args.dense_share,
                  train_tokens=int(len(train_data)), held_tokens=int(len(held)),
                  parameters={"trunk": sum(p.numel() for p in target.parameters()),
                              "nextn": sum(p.numel() for p in nextn.layer.parameters())},
                  eval=evaluate(*load(out), held, args.seq, args.eval_batches))
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["eval"], indent=2))


if __name__ == "__main__":
    main()
