"""The torch MTP reference runs on every tiny checkpoint and computes the documented equation:
x = fc(cat[pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)]) -> layer -> mtp.norm
-> lm_head, with h_i the target's post-final-norm hidden."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.checkpoint import open_checkpoint
from tandem.testing.tiny_checkpoints import TINY_KINDS

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tandem.checkpoint.families.qwen_hybrid.reference import greedy_draft  # noqa: E402

PROMPT = [5, 17, 33, 200, 7, 64, 91]


@pytest.fixture(scope="module")
def refs(torch_references):
    return torch_references


def zero_centred_rms_norm(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_head_computes_the_documented_equation(tiny_root, refs, kind):
    text_model, lm_head, ref = refs[kind]
    ckpt = open_checkpoint(tiny_root / kind)
    w = {n: ckpt.weight(n).astype(np.float64) for n in ckpt.canonical_names()
         if n.startswith("mtp.") and "layers" not in n or n in ("embed_tokens.weight", "lm_head.weight")}
    tokens = torch.tensor([PROMPT[1:]])
    with torch.no_grad():
        hidden = text_model(input_ids=torch.tensor([PROMPT[:-1]])).last_hidden_state
    seen = {}
    handle = ref.layers[0].register_forward_hook(lambda m, args, out: seen.update(x=args[0], y=out))
    with torch.no_grad():
        g, logits = ref(tokens, hidden, layer=0)
    handle.remove()
    emb = zero_centred_rms_norm(w["embed_tokens.weight"][PROMPT[1:]], w["mtp.pre_fc_norm_embedding.weight"])
    hid = zero_centred_rms_norm(hidden[0].double().numpy(), w["mtp.pre_fc_norm_hidden.weight"])
    x = np.concatenate([emb, hid], -1) @ w["mtp.fc.weight"].T  # [embedding, hidden] order
    np.testing.assert_allclose(seen["x"][0].double().numpy(), x, atol=1e-4)
    g_ref = zero_centred_rms_norm(seen["y"][0].double().numpy(), w["mtp.norm.weight"])
    np.testing.assert_allclose(g[0].double().numpy(), g_ref, atol=1e-4)
    np.testing.assert_allclose(logits[0].double().numpy(), g_ref @ w["lm_head.weight"].T, atol=1e-3)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_rows_are_causal_and_positions_relative(refs, kind):
    """Row i sees rows <= i only (so a KV-cached head can extend row by row), and a uniform
    position shift changes nothing (RoPE is relative)."""
    text_model, _, ref = refs[kind]
    tokens = torch.tensor([PROMPT[1:]])
    with torch.no_grad():
        hidden = text_model(input_ids=torch.tensor([PROMPT[:-1]])).last_hidden_state
        g_all, logits_all = ref(tokens, hidden, layer=0)
        g_pre, _ = ref(tokens[:, :3], hidden[:, :3], layer=0)
        g_shift, _ = ref(tokens, hidden, layer=0, positions=torch.arange(11, 11 + tokens.shape[1])[None])
    torch.testing.assert_close(g_pre, g_all[:, :3], atol=1e-5, rtol=0)
    torch.testing.assert_close(g_shift, g_all, atol=1e-4, rtol=0)


def test_chained_heads_differ_from_reused_head(refs):
    text_model, lm_head, ref = refs["qwen3_5_mtp3"]
    t_next, chained = greedy_draft(text_model, lm_head, ref, PROMPT, k=3, chained=True)
    _, reused = greedy_draft(text_model, lm_head, ref, PROMPT, k=3, chained=False)
    assert len(chained) == len(reused) == 3
    assert chained[0] == reused[0]  # step 0 runs layer 0 in both modes
    assert chained != reused
    # With one MTP layer, chained and reused are the same thing.
    text_model, lm_head, ref = refs["qwen3_5_mtp1"]
    assert greedy_draft(text_model, lm_head, ref, PROMPT, 3, True) == greedy_draft(
        text_model, lm_head, ref, PROMPT, 3, False)


def test_first_draft_is_the_head_on_the_target_rows(refs):
    """d_1 = argmax of the head over rows (t_{i+1}, h_i) ending with (t_P, h_{P-1})."""
    text_model, lm_head, ref = refs["qwen3_next"]
    t_next, drafts = greedy_draft(text_model, lm_head, ref, PROMPT, k=1)
    with torch.no_grad():
        h = text_model(input_ids=torch.tensor([PROMPT])).last_hidden_state
        assert t_next == int(lm_head(h[0, -1]).argmax())
        _, logits = ref(torch.tensor([PROMPT[1:] + [t_next]]), h, layer=0)
    assert drafts == [int(logits[0, -1].argmax())]
