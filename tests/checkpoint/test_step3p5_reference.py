"""The tiny Step-3.5 checkpoint is the Hub layout (transformers loads it with no missing or unexpected
keys, every stored MTP tensor has a place), it exercises every Step-3.5 feature, and the torch NextN
reference drafts exactly what transformers' own MTP path drafts (chained heads, k = 1, 2, 3): the
contract tandem's Step-3.5 engines are held to."""

from __future__ import annotations

import pytest

from tandem.testing.tiny_checkpoints import stored_shapes, tiny_config, write_tiny_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.step3p7")

from tandem.checkpoint.families.step3p5 import reference as ref  # noqa: E402

# Longer than the window (8), so the sliding layers drop rows.
PROMPT = [5, 17, 33, 200, 7, 64, 91, 12, 40, 41, 99, 150, 3, 77]


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    """(folder, target, MtpModel, reference) for the tiny Step-3.5 checkpoint, loaded once."""
    transformers.logging.set_verbosity_error()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 64-wide matmuls: a second thread's hand-off costs more than the math
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("step") / "step3p5", "step3p5")
    target = ref.load_target(folder)
    yield folder, target, ref.load_mtp_model(target, folder), ref.NextNReference(target, folder)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def theirs(step):
    _, target, mtp, _ = step
    return ref.transformers_drafts(target, mtp, PROMPT)


def test_transformers_loads_the_trunk_with_no_missing_or_unexpected_keys(step):
    folder, _, _, _ = step
    _, info = ref.Step3p5ForCausalLM.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"]


def test_every_stored_mtp_tensor_has_a_place(step):
    """load_mtp_model / NextNReference raise on a missing or unexpected name; here: all three layers
    are there with the Hub's own-head names, and transformers' MTP weights equal the stored ones."""
    folder, target, mtp, _ = step
    cfg = tiny_config("step3p5")
    n, stored = cfg["num_hidden_layers"], stored_shapes(cfg)
    state = ref.mtp_state(folder, n, 3)
    assert len(state) == sum(name.startswith(f"model.layers.{i}.") for name in stored for i in range(n, n + 3))
    for j in range(3):
        assert f"{j}.shared_head.head.weight" in state and f"{j}.shared_head.norm.weight" in state
        torch.testing.assert_close(mtp.layers[j].post_norm.weight, state[f"{j}.shared_head.norm.weight"])
        torch.testing.assert_close(mtp.layers[j].eh_proj.weight, state[f"{j}.eh_proj.weight"])
    assert mtp.shared_head is target.lm_head  # transformers: the target's head, not shared_head.output


def test_tiny_checkpoint_exercises_every_feature(step):
    """Sliding layers with their own head count, per-type RoPE, MoE + dense, and clamps that bind
    (an expert's `up` projection exceeds the layer's limit on the prompt)."""
    _, target, _, _ = step
    cfg, layers = target.config, target.model.layers
    assert cfg.layer_types.count("sliding_attention") == 4 and cfg.sliding_window < len(PROMPT)
    assert layers[1].self_attn.g_proj.weight.shape[0] == 8 and layers[0].self_attn.g_proj.weight.shape[0] == 4
    assert cfg.rope_parameters["full_attention"] != cfg.rope_parameters["sliding_attention"]
    assert {type(layer.mlp).__name__ for layer in layers} == {"Step3p7MLP", "Step3p7SparseMoeBlock"}
    seen = {}

    def up_max(i):  # [E, T, I] up projections of the layer's experts on the tokens it sees
        def hook(m, args, out):
            seen[i] = (args[0] @ m.gate_up_proj.transpose(1, 2)).chunk(2, -1)[1].abs().max()
        return hook

    hooks = [layers[i].mlp.experts.register_forward_hook(up_max(i)) for i in (4, 5)]
    with torch.no_grad():
        target(input_ids=torch.tensor([PROMPT]))
    for h in hooks:
        h.remove()
    assert all(seen[i] > layers[i].mlp.experts.limit for i in (4, 5)), seen


@pytest.mark.parametrize("k", [1, 2, 3])
def test_reference_drafts_equal_transformers_mtp_model(step, theirs, k):
    """Chained: head j runs on head j-1's hidden; k drafts are the first k of transformers' three."""
    ours = step[3].drafts(PROMPT, k)
    assert ours.next_token == theirs.next_token
    assert ours.tokens == theirs.tokens[:k]
    torch.testing.assert_close(ours.logits, theirs.logits[:k], atol=1e-4, rtol=0)


def test_reference_drafts_equal_generate_use_mtp_every_round(step):
    """Across transformers' generate(use_mtp=True) rounds (its MTP cache, crops after rejections),
    each round's drafts == the reference recomputed from that round's committed sequence, and the
    output == plain greedy."""
    _, target, mtp, nextn = step
    tokens, rounds = ref.mtp_generate(target, mtp, PROMPT, max_new_tokens=24)
    assert tokens == ref.greedy(target, PROMPT, 24).tokens
    assert len(rounds) >= 12
    for r in rounds:
        ours = nextn.drafts(r.committed[:-1], len(r.drafts))
        assert (ours.next_token, ours.tokens) == (r.committed[-1], r.drafts), len(r.committed)


def test_own_heads_draft_differently_from_the_shared_head(step):
    """The Hub stores an lm head per MTP layer (vLLM reads it); transformers uses the target's.
    On the tiny checkpoint they differ, so which one an engine uses is visible."""
    _, _, _, nextn = step
    assert nextn.drafts(PROMPT, 3, own_head=True).tokens != nextn.drafts(PROMPT, 3).tokens


def test_greedy_past_the_window_equals_full_recomputation(step):
    """transformers' cached greedy (sliding-window cache) == recomputing the whole sequence per step."""
    _, target, _, _ = step
    out = ref.greedy(target, PROMPT, 64)
    seq = PROMPT + out.tokens
    with torch.no_grad():
        full = target(input_ids=torch.tensor([seq[:-1]])).logits[0, len(PROMPT) - 1:]
    assert full.argmax(-1).tolist() == out.tokens
    torch.testing.assert_close(out.logits, full, atol=1e-4, rtol=0)
