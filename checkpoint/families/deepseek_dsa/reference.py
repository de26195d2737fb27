"""Plain numpy reference for `ai.tandem::LightningIndexer` (loops, float64): the ground truth its
function body is tested against, with the scores so tests can see ties."""

from __future__ import annotations

import numpy as np


def lightning_indexer(q, weights, k, key_cache, block_tables, context_lens, scale, top_k):
    """q [B, W, Hi, D], weights [B, W, Hi], k [B, W, D], key_cache [N, S, D].

    Returns (selected [B, W, top_k] int64: the visible positions by descending score, equal
    scores lower position first, -1 padded; scores [B, W, max(ctx) + W] float64 by position,
    -inf where the row does not see the position)."""
    bsz, w = q.shape[:2]
    page = key_cache.shape[1]
    selected = np.full((bsz, w, top_k), -1, np.int64)
    scores = np.full((bsz, w, int(context_lens.max()) + w), -np.inf)
    for b in range(bsz):
        n = int(context_lens[b])
        keys = [key_cache[block_tables[b, j // page], j % page] for j in range(n)] + list(k[b])
        for i in range(w):
            for pos in range(n + i + 1):
                dots = q[b, i].astype(np.float64) @ keys[pos].astype(np.float64) * scale     # [Hi]
                scores[b, i, pos] = float(np.maximum(dots, 0.0) @ weights[b, i].astype(np.float64))
            order = sorted(range(n + i + 1), key=lambda pos: (-scores[b, i, pos], pos))[:top_k]
            selected[b, i, : len(order)] = order
    return selected, scores


def boundary_ties(scores_row, top_k, tol):
    """Whether the k-th best visible score of one row is within `tol` of the next one (then the
    attended set depends on how equal scores are ordered)."""
    visible = np.sort(scores_row[np.isfinite(scores_row)])[::-1]
    return len(visible) > top_k and visible[top_k - 1] - visible[top_k] <= tol


# ---- NextN head in torch (tests only: imports torch and transformers lazily) -------------------------

def load_target(model_dir, dtype=None):
    """transformers' DeepseekV32ForCausalLM / GlmMoeDsaForCausalLM for a tiny DSA checkpoint, float32."""
    import json
    from pathlib import Path

    import torch
    import transformers

    arch = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(model_dir, dtype=dtype or torch.float32).eval()


class NextNReference:
    """The DSA NextN layer (`model.layers.{N}`, N = num_hidden_layers) in explicit math on
    transformers' own decoder-layer class (its MLA, lightning indexer and DeepSeek MoE), recomputed
    over the whole sequence at every draft step:

        x = eh_proj(cat[enorm(embed(t_{i+1})), hnorm(h_i)])      row i, h the target's post-norm hidden
        g = shared_head.norm(layer(x))                            causal over the rows, top-k by its indexer
        d = argmax(shared_head.head(g[last]))                     (vLLM's DeepSeek MTP: the layer's own head)

    Draft step s > 0 appends the row (d_s, g_{s-1}) and runs again (k drafts from the one layer;
    the post-norm hidden is chained, as transformers' MtpLayer passes it on). With index share, the
    draft rows of steps s > 0 attend the top-k step 0 chose for the last prompt row plus the draft
    positions, in place of the indexer's own choice. transformers 5.24 builds no MTP model for these
    configs (no `num_mtp_layers`); tests/checkpoint/test_dsa_mtp_transformers.py holds step 0 to DeepSeek-V3's
    `MtpModel` on the same weights with top-k past the context (there V3.2 is V3's dense MLA)."""

    def __init__(self, target, model_dir):
        import copy
        from pathlib import Path

        import torch
        from safetensors.torch import load_file

        cfg = copy.deepcopy(target.config)
        n = cfg.num_hidden_layers
        cfg.num_hidden_layers, cfg.mlp_layer_types = 1, ["sparse"]          # the NextN layer is an MoE layer
        if hasattr(cfg, "indexer_types"):
            cfg.indexer_types = ["full"]                                    # with its own indexer
        cfg._attn_implementation = "eager"
        layer_cls = type(target.model.layers[0])
        self.target, self.rotary = target, target.model.rotary_emb
        self.layer = layer_cls(cfg, 0)
        prefix = f"model.layers.{n}."
        stored = {k[len(prefix):]: v for k, v in load_file(Path(model_dir) / "model.safetensors").items()
                  if k.startswith(prefix)}
        experts = cfg.n_routed_experts
        state = {k: v for k, v in stored.items() if ".experts." not in k}
        state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([stored[f"mlp.experts.{e}.gate_proj.weight"],
                                                                    stored[f"mlp.experts.{e}.up_proj.weight"]])
                                                         for e in range(experts)])
        state["mlp.experts.down_proj"] = torch.stack([stored[f"mlp.experts.{e}.down_proj.weight"]
                                                      for e in range(experts)])
        own = {k: state.pop(k) for k in list(state) if k.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head",
                                                                            "embed_tokens")}
        missing, unexpected = self.layer.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"NextN layer from {model_dir}: missing {missing}, unexpected {unexpected}")
        self.layer.eval()
        self.own = {k: v.float() for k, v in own.items()}
        self.eps = cfg.rms_norm_eps

    def _norm(self, x, name):
        import torch

        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.own[name]

    def rows(self, tokens, hidden, share=None):
        """tokens [T] (t_{i+1}), hidden [T, H] (h_i or g) -> (g [T, H], logits [T, V], the indexer's
        top-k [T, K]) over positions 0..T-1. share = (rows P, top-k [K]): rows >= P attend those
        positions and the rows P .. themselves instead of the indexer's choice."""
        import torch

        seen = []

        def pick(_module, _inputs, out):
            seen.append(out[0])
            if share is None:
                return None
            p, first = share
            t = out.shape[1]
            rows = [out[0, i] for i in range(p)]                                                # own choice
            rows += [torch.cat([first.to(out.dtype), torch.arange(p, t, dtype=out.dtype)]) for _ in range(p, t)]
            width = max(len(r) for r in rows)          # a repeated position counts once in the mask
            return torch.stack([torch.cat([r, r[:1].expand(width - len(r))]) for r in rows])[None]

        hook = self.layer.self_attn.indexer.register_forward_hook(pick)
        try:
            g, logits = self._rows(tokens, hidden)
        finally:
            hook.remove()
        return g, logits, seen[0]

    def _rows(self, tokens, hidden):
        import torch

        with torch.no_grad():
            g, logits = self.forward(torch.as_tensor(tokens)[None], hidden[None])
        return g[0], logits[0]

    def forward(self, tokens, hidden, positions=None, visible=None):
        """tokens [B, T], hidden [B, T, H] -> (g [B, T, H], logits [B, T, V]), differentiable (the NextN
        loss of tools/train_dsa_model.py). positions [T] (default 0..T-1) and visible [T, T] bool
        (default causal) let one call hold the rows of several draft steps."""
        import torch

        e = self.target.model.embed_tokens(tokens)
        x = torch.cat([self._norm(e, "enorm.weight"), self._norm(hidden, "hnorm.weight")], -1)
        x = x @ self.own["eh_proj.weight"].T
        b, t = x.shape[:2]
        pos = (torch.arange(t) if positions is None else positions)[None]
        visible = torch.ones(t, t, dtype=torch.bool).tril() if visible is None else visible
        mask = torch.zeros(t, t).masked_fill(~visible, torch.finfo(torch.float32).min).expand(b, 1, t, t)
        y = self.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(x, pos))
        y = y[0] if isinstance(y, tuple) else y          # GLM-5's layer also returns its top-k
        g = self._norm(y, "shared_head.norm.weight")
        return g, g @ self.own["shared_head.head.weight"].T

    def drafts(self, tokens: list[int], k: int, index_share: bool = False) -> tuple[int, list[int]]:
        """(the target's next token t_P, drafts d_1..d_k) after `tokens`."""
        nxt, out, _ = self.draft_logits(tokens, k, index_share)
        return nxt, out

    def draft_logits(self, tokens: list[int], k: int, index_share: bool = False):
        """(t_P, drafts d_1..d_k, the logits [k, V] each draft is the argmax of) after `tokens`."""
        import torch

        with torch.no_grad():
            h = self.target.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]
            nxt = int(self.target.lm_head(h[-1]).argmax())
        ids, hidden, out, rows, share = list(tokens[1:]) + [nxt], h, [], [], None
        for _ in range(k):
            g, logits, picked = self.rows(ids, hidden, share)
            if index_share and share is None:
                share = len(ids), picked[-1]
            out.append(int(logits[-1].argmax()))
            rows.append(logits[-1])
            ids, hidden = ids + [out[-1]], torch.cat([hidden, g[-1:]])
        return nxt, out, torch.stack(rows)
