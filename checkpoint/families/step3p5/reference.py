"""Step-3.5-Flash in torch: the ground truth tandem's Step-3.5 engines are held to. Never imported
by the runtime path.

transformers 5.24 has no `Step3p5ForCausalLM`; its Step-3.5 text model is `Step3p7TextModel`
(model_type "step3p5") inside the multimodal `Step3p7ForConditionalGeneration`. `Step3p5ForCausalLM`
below is that text model plus the Hub's `lm_head`, loaded through transformers' own "step3p7" weight
renames (`moe.*` -> `mlp.experts`, `share_expert` -> `mlp.shared_experts`, `moe.router_bias` ->
`e_score_correction_bias`), so `from_pretrained` and `generate(use_mtp=True)` run transformers' code.

Three pieces:
- `greedy`: plain greedy decoding with transformers (tokens and the logits of each step).
- `NextNReference`: the chained draft in explicit math (sources and differences: docs/families/step3p5.md):

      x_j  = eh_proj(cat[enorm(embed(t_{p})), hnorm(g^{j-1}_{p-1})])     # [P, H], head j, row at position p
      g^j  = final_norm_j(layer_j(x_j))                                  # the head's hidden, chained to j+1
      d_j  = argmax(lm_head_j(g^j[-1]))                                  # lm_head_j: shared or own

  with g^{-1} = h, the target's hidden AFTER its final norm, and head j's rows at positions j+1 .. P+j
  (the rows of head j-1 shifted by one, the last token being d_{j-1}; d_0 := t_P).
- `transformers_drafts` / `mtp_generate`: the drafts transformers itself makes (`MtpModel`,
  `MTPCandidateGenerator`), the contract the reference is tested against.

transformers cannot load the Hub's MTP layers by itself: their final norm is stored as
`model.layers.{N+j}.transformer.shared_head.norm.weight` and `MtpModel`'s key mapping only knows
`shared_head.norm`, so `load_mtp_model` maps the names as vLLM's `Step3p5MTP.load_weights` does
(drop `.transformer.`) and fills transformers' `MtpModel` with them.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import GenerationMixin
from transformers import conversion_mapping as _conversions
from transformers.modeling_layers import MtpModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.step3p7 import modeling_step3p7 as _step

MTP_OWN = ("enorm.", "hnorm.", "eh_proj.")


class Step3p5ForCausalLM(_step.Step3p7PreTrainedModel, GenerationMixin):
    """The Hub's text-only Step-3.5 (`model.*` + `lm_head`) on transformers' Step3p7 text model."""

    config_class = _step.Step3p7TextConfig
    base_model_prefix = "model"
    _tied_weights_keys = {}

    def __init__(self, config):
        super().__init__(config)
        self.model = _step.Step3p7TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_decoder(self):
        return self.model

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                logits_to_keep=0, **kwargs) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, inputs_embeds=inputs_embeds, **kwargs)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return CausalLMOutputWithPast(logits=self.lm_head(out.last_hidden_state[:, keep]),
                                      past_key_values=out.cache, hidden_states=out.hidden_states)


def _register_hub_renames() -> None:
    """transformers' own "step3p7" renames minus its prefix moves (`^model.` -> `model.language_model.`,
    vision tower): the text-only checkpoint keeps `model.layers.*`."""
    if "Step3p5ForCausalLM" in _conversions.USER_REGISTERED_MAPPINGS:
        return
    renames = [t for t in _conversions.get_checkpoint_conversion_mapping("step3p7")
               if not any(p.startswith("^") for p in t.source_patterns)]
    _conversions.register_checkpoint_conversion_mapping("Step3p5ForCausalLM", renames)


def load_target(model_dir: str | Path, dtype=torch.float32) -> Step3p5ForCausalLM:
    _register_hub_renames()
    return Step3p5ForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _stored(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return {n: model_dir / f for n, f in json.loads(index.read_text())["weight_map"].items()}
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return {n: model_dir / "model.safetensors" for n in f.keys()}


def mtp_state(model_dir: str | Path, num_hidden_layers: int, num_mtp: int) -> dict[str, torch.Tensor]:
    """MTP layer j's Hub tensors under vLLM's names relative to the layer: enorm/hnorm/eh_proj,
    shared_head.norm / shared_head.head (Hub: transformer.shared_head.norm / .output), and the
    decoder layer's own names (self_attn.*, mlp.*, input_layernorm, post_attention_layernorm)."""
    model_dir = Path(model_dir)
    out = {}
    for name, file in _stored(model_dir).items():
        parts = name.split(".")
        if name.startswith("model.layers.") and num_hidden_layers <= int(parts[2]) < num_hidden_layers + num_mtp:
            rel = ".".join(parts[3:]).replace("transformer.", "", 1).replace("shared_head.output", "shared_head.head")
            with safe_open(file, "pt") as f:
                out[f"{int(parts[2]) - num_hidden_layers}.{rel}"] = f.get_tensor(name)
    return out


def load_mtp_model(target: Step3p5ForCausalLM, model_dir: str | Path) -> MtpModel:
    """transformers' `MtpModel` for `target`, filled from the Hub names. Its own choice stays:
    each layer's `shared_head.norm` becomes `post_norm`, the logits use the TARGET's lm_head
    (`shared_head.head` is not read)."""
    cfg = target.config
    mtp = MtpModel(target, cfg.num_nextn_predict_layers)
    state = {}
    for rel, tensor in mtp_state(model_dir, cfg.num_hidden_layers, cfg.num_nextn_predict_layers).items():
        j, leaf = rel.split(".", 1)
        if leaf.startswith("shared_head.head."):
            continue
        if leaf.startswith("shared_head.norm."):
            leaf = leaf.replace("shared_head.norm.", "post_norm.")
        elif not leaf.startswith(MTP_OWN):
            leaf = "mtp_block." + leaf
        state[f"layers.{j}.{leaf}"] = tensor
    missing, unexpected = mtp.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith(("embed_tokens.", "shared_head.", "rotary_emb."))]
    if missing or unexpected:
        raise ValueError(f"MtpModel from {model_dir}: missing {missing}, unexpected {unexpected}")
    mtp.tie_with_main_model(target)
    return mtp.to(target.dtype).eval()


@dataclass(frozen=True)
class Greedy:
    tokens: list[int]          # the generated tokens
    logits: torch.Tensor       # [n, V] the logits each token was the argmax of


@torch.no_grad()
def greedy(target: Step3p5ForCausalLM, prompt: list[int], max_new_tokens: int) -> Greedy:
    """Plain greedy decoding with transformers' generate (KV cache, sliding-window masks)."""
    out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    return Greedy(out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits, 0))


@dataclass(frozen=True)
class Drafts:
    next_token: int            # t_P, the target's greedy token after the prompt
    tokens: list[int]          # d_1 .. d_k
    logits: torch.Tensor       # [k, V] the logits each draft was the argmax of


class NextNReference(nn.Module):
    """Step-3.5's NextN heads in explicit math, on transformers' decoder-layer class and norm."""

    def __init__(self, target: Step3p5ForCausalLM, model_dir: str | Path):
        super().__init__()
        cfg = target.config
        self.target = target
        mtp_cfg = cfg.get_mtp_config()
        mtp_cfg._attn_implementation = "eager"
        h, eps, n = cfg.hidden_size, cfg.rms_norm_eps, cfg.num_nextn_predict_layers
        self.layer_types = mtp_cfg.layer_types
        self.window = cfg.sliding_window

        def head(j: int) -> nn.ModuleDict:
            return nn.ModuleDict(dict(
                enorm=_step.Step3p7RMSNorm(h, eps), hnorm=_step.Step3p7RMSNorm(h, eps),
                eh_proj=nn.Linear(2 * h, h, bias=False), layer=_step.Step3p7DecoderLayer(mtp_cfg, j),
                norm=_step.Step3p7RMSNorm(h, eps), lm_head=nn.Linear(h, cfg.vocab_size, bias=False)))

        self.heads = nn.ModuleList(head(j) for j in range(n))
        state = {}
        for rel, tensor in mtp_state(model_dir, cfg.num_hidden_layers, n).items():
            j, leaf = rel.split(".", 1)
            leaf = leaf.replace("shared_head.norm.", "norm.").replace("shared_head.head.", "lm_head.")
            state[f"heads.{j}.{leaf if leaf.startswith(MTP_OWN + ('norm.', 'lm_head.')) else 'layer.' + leaf}"] = tensor
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.startswith("target.")]
        if missing or unexpected:
            raise ValueError(f"NextN reference from {model_dir}: missing {missing}, unexpected {unexpected}")
        self.to(target.dtype).eval()

    def _mask(self, positions: torch.Tensor, layer_type: str) -> torch.Tensor:
        """[1, 1, T, T] additive mask: causal, and within the window for a sliding layer."""
        q, k = positions[:, None], positions[None, :]
        allowed = k <= q
        if layer_type == "sliding_attention":
            allowed &= q - k < self.window
        return torch.where(allowed, 0.0, float("-inf"))[None, None]

    def head_step(self, j: int, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                  own_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T] (t_p), hidden [T, H] (g^{j-1}_{p-1}), positions [T] (p) -> (g^j [T, H], logits [T, V]).
        own_head: logits from the layer's stored head (vLLM) instead of the target's (transformers)."""
        m = self.heads[j]
        e, g = m["enorm"](self.target.model.embed_tokens(tokens)), m["hnorm"](hidden)
        x = m["eh_proj"](torch.cat([e, g], dim=-1))[None]  # [1, T, H], embedding first
        layer_type = self.layer_types[j]
        rope = self.target.model.rotary_emb(x, positions[None], layer_type)
        x = m["layer"](x, attention_mask=self._mask(positions, layer_type), position_embeddings=rope,
                       position_ids=positions[None])
        g = m["norm"](x[0])
        return g, (m["lm_head"] if own_head else self.target.lm_head)(g)

    @torch.no_grad()
    def drafts(self, prompt: list[int], k: int, own_head: bool = False) -> Drafts:
        """Chained drafts d_1..d_k (k <= number of heads) for the committed sequence `prompt`,
        by full recomputation: each head runs over all P rows of its shifted sequence."""
        if not 1 <= k <= len(self.heads):
            raise ValueError(f"k={k}: Step-3.5 chains at most {len(self.heads)} heads, one draft each")
        out = self.target.model(input_ids=torch.tensor([prompt]))
        hidden = out.last_hidden_state[0]  # [P, H] after the final norm
        t_next = int(self.target.lm_head(hidden[-1]).argmax())
        tokens = torch.tensor(prompt[1:] + [t_next])
        positions = torch.arange(1, len(prompt) + 1)
        drafts, logits = [], []
        for j in range(k):
            hidden, head_logits = self.head_step(j, tokens, hidden, positions, own_head)
            drafts.append(int(head_logits[-1].argmax()))
            logits.append(head_logits[-1])
            tokens = torch.cat([tokens[1:], torch.tensor([drafts[-1]])])
            positions = positions + 1
        return Drafts(t_next, drafts, torch.stack(logits))


@torch.no_grad()
def transformers_drafts(target: Step3p5ForCausalLM, mtp: MtpModel, prompt: list[int]) -> Drafts:
    """What `MTPCandidateGenerator.get_candidates` drafts right after the prefill of `prompt`:
    `MtpModel` on a fresh cache, rows t_1..t_P with the target's last-layer hidden h_0..h_{P-1}."""
    from transformers.cache_utils import MtpCache

    out = target(input_ids=torch.tensor([prompt]), output_hidden_states=-1)
    t_next = int(out.logits[0, -1].argmax())
    ids = torch.tensor([prompt[1:] + [t_next]])
    cache = MtpCache(config=target.config.get_mtp_config())
    tokens, logits, _ = mtp(input_ids=ids, last_hidden_states=out.hidden_states[-1], attention_mask=None,
                            position_ids=torch.arange(1, len(prompt) + 1)[None], mtp_cache=cache)
    return Drafts(t_next, tokens[0].tolist(), logits[0])


@dataclass(frozen=True)
class MtpRound:
    committed: list[int]       # the sequence when the round drafted, ending with the target's t_P
    drafts: list[int]          # transformers' drafts for it


@torch.no_grad()
def mtp_generate(target: Step3p5ForCausalLM, mtp: MtpModel, prompt: list[int],
                 max_new_tokens: int) -> tuple[list[int], list[MtpRound]]:
    """transformers' `generate(use_mtp=True)` (greedy), with `mtp` as its MTP model: the tokens it
    generates and the drafts of every round (recorded at `MTPCandidateGenerator.get_candidates`)."""
    from transformers.generation import candidate_generator as cg

    rounds: list[MtpRound] = []
    real = cg.MTPCandidateGenerator.get_candidates

    def record(self, input_ids, *args, **kwargs):
        ids, logits = real(self, input_ids, *args, **kwargs)
        if logits is not None:
            n = input_ids.shape[1]
            rounds.append(MtpRound(input_ids[0].tolist(), ids[0, n:].tolist()))
        return ids, logits

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patch(cg.MTPCandidateGenerator, "get_candidates", record))
        stack.enter_context(_patch(MtpModel, "from_pretrained", classmethod(lambda cls, *a, **k: mtp)))
        out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                              use_mtp=True)
    return out[0, len(prompt):].tolist(), rounds


@contextlib.contextmanager
def _patch(owner, name, value):
    old = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)
