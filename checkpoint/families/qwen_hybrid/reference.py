"""The MTP head in torch, on top of transformers' own decoder-layer classes: the ground truth
for export parity (tests) and the module the small-model trainer optimises. Never imported by
the runtime path.

One head step, for rows i (token t_{i+1} paired with the target's hidden h_i):

    x = fc(cat[pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)])   # [B, T, H]
    x = mtp.layers[l](x)            # full-attention decoder layer, causal over the T rows
    g = mtp.norm(x)                 # the head's hidden: chained into the next draft step
    logits = lm_head(g)             # shared with the target

h_i is the target's hidden AFTER its final norm. Row i sits at position i + 1 (the position of
the token it embeds); RoPE is relative, so any uniform shift gives the same result.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tandem.checkpoint import open_checkpoint
from tandem.checkpoint.description import MLPKind


def load_target(model_dir: str | Path, dtype=torch.float32):
    """(text_model, lm_head, text_config) from transformers for a tiny or real checkpoint."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    if hasattr(config, "text_config") and config.model_type in ("qwen3_5", "qwen3_5_moe"):
        model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype)
        return model.model.language_model.eval(), model.lm_head, model.config.text_config
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.model.eval(), model.lm_head, model.config


def _decoder_layer_classes(text_config):
    """The family's (DecoderLayer, RMSNorm) classes, found from the config's module."""
    import importlib

    module = importlib.import_module(type(text_config).__module__.replace("configuration_", "modeling_"))
    prefix = {"qwen3_5_text": "Qwen3_5", "qwen3_5_moe_text": "Qwen3_5Moe", "qwen3_next": "Qwen3Next"}[
        text_config.model_type]
    return getattr(module, f"{prefix}DecoderLayer"), getattr(module, f"{prefix}RMSNorm")


class MTPReference(nn.Module):
    """n MTP decoder layers sharing fc, the pre-fc norms, mtp.norm and the target's embed/lm_head."""

    def __init__(self, text_model: nn.Module, lm_head: nn.Module, text_config, num_layers: int, moe: bool):
        super().__init__()
        layer_cls, norm_cls = _decoder_layer_classes(text_config)
        cfg = type(text_config)(**{**text_config.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"],
                                   "mlp_only_layers": [] if moe else [0]})
        cfg._attn_implementation = "eager"
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.embed_tokens, self.lm_head, self.rotary_emb = text_model.embed_tokens, lm_head, text_model.rotary_emb
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = norm_cls(h, eps), norm_cls(h, eps), \
            norm_cls(h, eps)
        self.layers = nn.ModuleList(layer_cls(cfg, layer_idx=0) for _ in range(num_layers))

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, text_model, lm_head, text_config) -> MTPReference:
        """Load mtp.* through tandem's reader (canonical names are transformers' names)."""
        ckpt = open_checkpoint(model_dir)
        mtp = ckpt.description.mtp
        ref = cls(text_model, lm_head, text_config, mtp.num_layers, moe=mtp.layer.mlp == MLPKind.MOE)
        state = {n.removeprefix("mtp."): torch.from_numpy(ckpt.weight(n).astype("float32"))
                 for n in ckpt.canonical_names() if n.startswith("mtp.")}
        missing, unexpected = ref.load_state_dict(state, strict=False)
        shared = ("embed_tokens.", "lm_head.", "rotary_emb.")
        missing = [m for m in missing if not m.startswith(shared)]
        if missing or unexpected:
            raise ValueError(f"MTP reference: missing {missing}, unexpected {unexpected}")
        return ref.to(next(text_model.parameters()).dtype).eval()

    def forward(self, next_tokens: torch.Tensor, hidden: torch.Tensor, layer: int,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """next_tokens [B, T] (t_{i+1}), hidden [B, T, H] (target h_i or a chained head hidden),
        positions [B, T] (default 1..T) -> (head hidden after mtp.norm [B, T, H], logits [B, T, V])."""
        b, t = next_tokens.shape
        if positions is None:
            positions = torch.arange(1, t + 1).expand(b, t)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(self.embed_tokens(next_tokens)),
                               self.pre_fc_norm_hidden(hidden)], dim=-1))
        mask = torch.full((t, t), float("-inf"), dtype=x.dtype).triu(1).expand(b, 1, t, t)
        x = self.layers[layer](x, position_embeddings=self.rotary_emb(x, positions), attention_mask=mask,
                               position_ids=positions)
        g = self.norm(x)
        return g, self.lm_head(g)


@torch.no_grad()
def greedy_draft(text_model, lm_head, mtp: MTPReference, tokens: list[int], k: int,
                 chained: bool = True) -> tuple[int, list[int]]:
    """Greedy drafting by full recomputation, the reference for the pipeline's rounds.

    tokens = the committed sequence t_0..t_{P-1}. The target gives h_0..h_{P-1} and the next
    token t_P. Draft step s (layer s % n when chained, layer 0 when reused) runs the head over
    the committed rows (t_{i+1}, h_i), i < P-1, then (t_P, h_{P-1}), (d_1, g_0) .. (d_s, g_{s-1}),
    where g_j is the head output at draft step j's last row. Returns (t_P, [d_1..d_k]).
    """
    ids = torch.tensor([tokens])
    h = text_model(input_ids=ids).last_hidden_state  # [1, P, H] post-norm
    t_next = int(lm_head(h[:, -1]).argmax(-1))
    row_tokens, row_hidden = tokens[1:] + [t_next], [h[0, i] for i in range(len(tokens))]
    drafts = []
    for s in range(k):
        layer = s % len(mtp.layers) if chained else 0
        g, logits = mtp(torch.tensor([row_tokens]), torch.stack(row_hidden)[None], layer)
        d = int(logits[0, -1].argmax())
        drafts.append(d)
        row_tokens, row_hidden = row_tokens + [d], row_hidden + [g[0, -1]]
    return t_next, drafts
