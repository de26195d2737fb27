"""transformers' own classes load every tiny checkpoint with no missing or unexpected keys
(mtp.* aside, which transformers drops), and tandem's canonical weights equal transformers'
parameters, so the generator writes, and the reader reads, the real layouts."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.checkpoint import open_checkpoint
from tandem.testing.tiny_checkpoints import TINY_KINDS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CLASSES = {"qwen3_5_mtp1": "Qwen3_5ForConditionalGeneration", "qwen3_5_mtp3": "Qwen3_5ForCausalLM",
           "qwen3_5_moe": "Qwen3_5MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}


def load(path, kind):
    transformers.logging.set_verbosity_error()
    cls = getattr(transformers, CLASSES[kind])
    return cls.from_pretrained(path, output_loading_info=True, dtype=torch.float32)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_transformers_loads_with_no_missing_or_unexpected_keys(tiny_root, kind):
    model, info = load(tiny_root / kind, kind)
    assert type(model).__name__ == CLASSES[kind]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"]


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_canonical_weights_equal_transformers_parameters(tiny_root, kind):
    model, _ = load(tiny_root / kind, kind)
    state = model.state_dict()
    prefix = "model.language_model." if kind == "qwen3_5_mtp1" else "model."
    ckpt = open_checkpoint(tiny_root / kind)
    compared = 0
    for name in ckpt.canonical_names():
        if name.startswith("mtp.") or (kind == "qwen3_next" and ".linear_attn.in_proj_" in name):
            continue
        key = name if name == "lm_head.weight" else prefix + name
        np.testing.assert_array_equal(ckpt.weight(name), state[key].numpy(), err_msg=name)
        compared += 1
    assert compared > 40


def test_qwen3_next_projections_match_transformers_split(tiny_root):
    """x @ in_proj_qkvz then transformers' fix_query_key_value_ordering == x @ canonical flat."""
    model, _ = load(tiny_root / "qwen3_next", "qwen3_next")
    ckpt = open_checkpoint(tiny_root / "qwen3_next")
    gdn = model.model.layers[2].linear_attn
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))
    w = {leaf: torch.from_numpy(ckpt.weight(f"layers.2.linear_attn.{leaf}.weight"))
         for leaf in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}
    qkv = x @ w["in_proj_qkv"].T
    torch.testing.assert_close(qkv[..., :32], q.reshape(1, 5, -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(qkv[..., 32:64], k.reshape(1, 5, -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(qkv[..., 64:], v.reshape(1, 5, -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(x @ w["in_proj_z"].T, z.reshape(1, 5, -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(x @ w["in_proj_b"].T, b, rtol=0, atol=1e-6)
    torch.testing.assert_close(x @ w["in_proj_a"].T, a, rtol=0, atol=1e-6)


def test_tokenizer_and_chat_template_load_in_transformers(tiny_root):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_root / "qwen3_5_mtp1")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_id == open_checkpoint(tiny_root / "qwen3_5_mtp1").description.eos_token_ids[0]
    ids = tok("def add(a, b): é ∑")["input_ids"]
    assert tok.decode(ids) == "def add(a, b): é ∑"
