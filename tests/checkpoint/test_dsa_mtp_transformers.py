"""The DeepSeek-V3.2 NextN reference (deepseek_dsa/reference.NextNReference, which the engines' drafts
are held to in test_dsa_pipeline.py) == transformers' own MTP path, closing engine == reference ==
transformers.

transformers 5.24 drafts with an MTP layer for DeepSeek-V3 only (`MtpModel`, `generate(use_mtp=True)`),
and DeepSeek-V3.2 with `index_topk` >= the context attends every visible position: V3's dense MLA.
So the tiny deepseek_v32 checkpoint is written twice:

    v32/  index_topk 64 (> prompt + generated)          -> DeepseekV32ForCausalLM + NextNReference
    v3/   the same weights minus every indexer tensor   -> DeepseekV3ForCausalLM + MtpModel (transformers'
          (config: model_type deepseek_v3)                 own key mapping: layers.{N} -> layers.0.mtp_block,
                                                           shared_head.norm -> post_norm)

both with the NextN layer's `shared_head.head` := `lm_head`: transformers' MtpModel projects with the
target's lm_head and ignores the stored head, the reference (like vLLM and the engines) uses the
stored one. What is comparable is the first draft of a round: transformers has one MTP layer, so
one draft per round (k > 1 chains layer j+1 on layer j's rows there; the engines reuse one layer).
transformers puts the row (t_{i+1}, h_i) at position i + 1, the reference at i: RoPE (YaRN too) is
relative, so this changes rounding only.
"""

from __future__ import annotations

import json

import pytest

from tandem.testing.tiny_checkpoints import write_tiny_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from transformers import modeling_layers  # noqa: E402
from transformers.generation import candidate_generator  # noqa: E402

from tandem.checkpoint.families.deepseek_dsa.reference import NextNReference, load_target  # noqa: E402

PROMPT = [5, 17, 33, 200, 7, 90, 12, 14, 150, 61, 8, 9, 30, 41]
ACCEPTING = [89, 172, 220, 33, 53, 76, 359, 114, 25]    # the target accepts one of its drafts
NEW_TOKENS = 16
TOP_K = 64          # > len(PROMPT) + NEW_TOKENS: every visible position is selected


def _write_copies(root):
    """(v32 folder, v3 folder, N) from one tiny deepseek_v32 checkpoint (see the module docstring)."""
    src = write_tiny_checkpoint(root / "src", "deepseek_v32")
    config = json.loads((src / "config.json").read_text())
    n = config["num_hidden_layers"]
    weights = safetensors_torch.load_file(src / "model.safetensors")
    weights[f"model.layers.{n}.shared_head.head.weight"] = weights["lm_head.weight"].clone()
    v3_config = {k: v for k, v in config.items() if not k.startswith("index_")}
    v3_config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    folders = {"v32": (dict(config, index_topk=TOP_K), weights),
               "v3": (v3_config, {k: v for k, v in weights.items() if ".self_attn.indexer." not in k})}
    for name, (cfg, tensors) in folders.items():
        (root / name).mkdir()
        safetensors_torch.save_file(tensors, root / name / "model.safetensors")
        (root / name / "config.json").write_text(json.dumps(cfg, indent=2))
    return root / "v32", root / "v3", n


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(DeepseekV3ForCausalLM with its loading info, NextNReference on the V3.2 copy, v3 folder, N)."""
    transformers.logging.set_verbosity_error()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    v32, v3, n = _write_copies(tmp_path_factory.mktemp("dsa_mtp"))
    main, info = transformers.DeepseekV3ForCausalLM.from_pretrained(v3, dtype=torch.float32,
                                                                     output_loading_info=True)
    # transformers names the published checkpoint's NextN layer (`model\.layers\.61.*`); the tiny one is N
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}\..*"]
    yield main.eval(), info, NextNReference(load_target(v32), v32), v3, n
    torch.set_num_threads(threads)


@pytest.fixture
def mtp_loads(monkeypatch):
    """Every LoadStateDictInfo MtpModel.from_pretrained reports (it raises on missing keys only)."""
    seen = []
    real = modeling_layers.log_state_dict_report
    monkeypatch.setattr(modeling_layers, "log_state_dict_report",
                        lambda **kw: seen.append(kw["loading_info"]) or real(**kw))
    return seen


def test_v3_and_its_mtp_model_load_every_tensor_but_the_indexer(models, mtp_loads):
    main, info, _, v3, n = models
    stored = safetensors_torch.load_file(v3 / "model.safetensors")
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"], info
    assert info["unexpected_keys"] and all(k.startswith(f"model.layers.{n}.") for k in info["unexpected_keys"])
    mtp = modeling_layers.MtpModel.from_pretrained(main)
    (loaded,) = mtp_loads
    assert not loaded.missing_keys and not loaded.unexpected_keys and not loaded.mismatched_keys, loaded
    layer = mtp.layers[0]
    assert type(layer.mtp_block.mlp).__name__ == "DeepseekV3MoE"     # the NextN layer is an MoE layer
    torch.testing.assert_close(layer.post_norm.weight, stored[f"model.layers.{n}.shared_head.norm.weight"])
    torch.testing.assert_close(layer.enorm.weight, stored[f"model.layers.{n}.enorm.weight"])
    assert mtp.shared_head is main.lm_head and mtp.embed_tokens is main.model.embed_tokens


@pytest.mark.parametrize("prompt,accepted", [(PROMPT, 0), (ACCEPTING, 1)])
def test_nextn_reference_equals_generate_use_mtp_every_round(models, mtp_loads, monkeypatch, prompt, accepted):
    """Each round of transformers' generate(use_mtp=True) (its MTP cache over the rounds, two new rows
    after an accepted draft): the target's token and the draft == NextNReference recomputed on the V3.2
    model from that round's sequence, logits within 1e-4; the output == the V3.2 model's plain greedy."""
    main, _, nextn, _, _ = models
    rounds = []
    real = candidate_generator.MTPCandidateGenerator.get_candidates

    def record(self, input_ids, *args, **kwargs):
        ids, logits = real(self, input_ids, *args, **kwargs)
        if logits is not None:   # the first call only lets the target prefill
            rounds.append((input_ids[0].tolist(), ids[0, input_ids.shape[1]:].tolist(), logits[0]))
        return ids, logits

    monkeypatch.setattr(candidate_generator.MTPCandidateGenerator, "get_candidates", record)
    with torch.no_grad():
        out = main.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True)
        plain = nextn.target.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert len(mtp_loads) == 1 and not mtp_loads[0].unexpected_keys     # generate loaded the MtpModel itself
    assert out[0].tolist() == plain[0].tolist() and out.shape[1] == len(prompt) + NEW_TOKENS
    assert len(rounds) >= NEW_TOKENS // 2 and max(len(c) for c, _, _ in rounds) <= TOP_K
    lengths = [len(c) for c, _, _ in rounds]
    assert sum(b - a - 1 for a, b in zip(lengths, lengths[1:])) == accepted, "tiny checkpoint changed? re-pick"
    for committed, drafts, logits in rounds:
        nxt, ours, our_logits = nextn.draft_logits(committed[:-1], 1)
        assert (nxt, ours) == (committed[-1], drafts), len(committed)
        torch.testing.assert_close(our_logits, logits, atol=1e-4, rtol=0)
