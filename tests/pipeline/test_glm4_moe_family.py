"""GLM-4-MoE (`Glm4MoeForCausalLM`) end to end from its tiny checkpoint (checkpoint/families/glm4_moe/
declares the kind): transformers loads every stored tensor; engines built by `build_engines` give
transformers' greedy tokens and logits; the NextN head's drafts are transformers' own MTP drafts
(`generate(use_mtp=True)`, `MtpModel`) round by round; speculative == plain, batched and staggered."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.checkpoint import open_checkpoint
from tandem.engines.options import BuildOptions
from tandem.pipeline.llm import LLM
from tandem.pipeline.sampling_params import SamplingParams

from ..pipeline_fixtures import record_drafts, record_logits, run, tiny_engines

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.generation import candidate_generator  # noqa: E402

OPTIONS = BuildOptions(batch_sizes=(1, 4), spec_k=2, prefill_chunk=8, max_seq_len=128, page_size=4)
PROMPTS = [[5, 17, 33, 200, 7, 90, 12, 14, 150, 61, 8, 9, 30, 41], [9, 120, 77], [44], [300, 12, 12, 12],
           list(range(1, 19)), [101, 5, 9, 11, 13]]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(checkpoint folder, engine dir, transformers model with its loading info)."""
    folder, engines = tiny_engines(tmp_path_factory.mktemp("glm4_moe"), ("glm4_moe",), OPTIONS)["glm4_moe"]
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    model, info = transformers.Glm4MoeForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                   output_loading_info=True)
    n = open_checkpoint(folder).description.num_layers
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}\..*"]   # the NextN layer (MtpModel's)
    return folder, engines, model.eval(), info


def test_description_and_transformers_load_every_trunk_tensor(glm):
    folder, _, _, info = glm
    d = open_checkpoint(folder).description
    a = d.layers[0].mixer
    assert (a.bias, a.o_bias, a.qk_norm, a.rotary_dim) == (True, False, False, 8)
    assert [x.mlp.value for x in d.layers] == ["dense", "moe", "moe"] and d.mtp.layer.mlp.value == "moe"
    assert (d.moe.n_group, d.moe.topk_group, d.moe.router, d.moe.routed_scaling_factor) == (2, 1, "sigmoid", 2.5)
    assert not d.norm_zero_centred and d.mtp.form == "nextn" and d.mtp.anchor == "target"
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert info["unexpected_keys"] and all(k.startswith(f"model.layers.{d.num_layers}.")
                                           for k in info["unexpected_keys"])


def test_plain_greedy_tokens_and_logits_equal_transformers(glm, monkeypatch):
    _, engines, model, _ = glm
    logits = record_logits(monkeypatch)
    prompt = PROMPTS[0]
    out = LLM(engines).generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, speculative=False))[0]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)   # eos too
    assert out.token_ids == want.sequences[0, len(prompt):].tolist()
    np.testing.assert_allclose(np.stack(logits), torch.cat(want.logits).numpy(), atol=1e-4, rtol=0)


def test_drafts_equal_transformers_mtp_every_round(glm, monkeypatch):
    """transformers drafts one token a round with its MTP layer; the engines at spec_k 1 do the same:
    for every committed sequence both reach, the draft is the same token."""
    _, engines, model, _ = glm
    theirs = {}
    real = candidate_generator.MTPCandidateGenerator.get_candidates

    def record(self, input_ids, *args, **kwargs):
        ids, logits = real(self, input_ids, *args, **kwargs)
        if logits is not None:   # the first call only lets the target prefill
            theirs[tuple(input_ids[0].tolist())] = ids[0, input_ids.shape[1]:].tolist()
        return ids, logits

    monkeypatch.setattr(candidate_generator.MTPCandidateGenerator, "get_candidates", record)
    ours = record_drafts(monkeypatch)
    for prompt in PROMPTS[:3]:
        with torch.no_grad():
            model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True,
                           eos_token_id=None, pad_token_id=0)
        LLM(engines).generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, k=1))
    common = [(tokens, drafts) for tokens, drafts in ours if tuple(tokens) in theirs]
    assert len(common) >= 3 * (NEW_TOKENS // 2), (len(common), len(ours), len(theirs))
    assert all(drafts == theirs[tuple(tokens)] for tokens, drafts in common)


def test_speculative_equals_plain_batched_and_staggered(glm):
    engines = glm[1]
    plain = run(engines, PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, speculative=False))[0]
    outputs, llm = run(engines, PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), stagger=2)
    assert outputs == plain
    assert sum(s.metrics.rounds for s in llm.test_sequences) > 0
