"""DeepSeek-V3.2's NextN layer with and without its own `shared_head.head` (published as a copy of
lm_head, so some conversions drop it): the reader takes the choice from the stored names
(deepseek_dsa.fit_mtp_to_tensors), the engine dir's manifest carries it, and the engines' drafts
== the torch NextN reference projecting with the head that choice names. The tiny checkpoint's own
head differs from its lm_head, and each engine dir's drafts differ from the other head's reference
on some round, so an inverted choice fails here."""

from __future__ import annotations

import shutil

import pytest

from tandem.checkpoint import open_checkpoint
from tandem.checkpoint.families.deepseek_dsa.reference import NextNReference, load_target
from tandem.cli import main
from tandem.engines.builder import build_engines
from tandem.engines.manifest import read_manifest
from tandem.engines.options import BuildOptions
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams
from tandem.testing.tiny_checkpoints import write_safetensors, write_tiny_checkpoint

from ..conftest import read_all
from ..pipeline_fixtures import record_drafts, round_drafts

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HEAD = "model.layers.3.shared_head.head.weight"    # the tiny deepseek_v32 has 3 trunk layers
OPTIONS = BuildOptions(batch_sizes=(1,), spec_k=2, prefill_chunk=8, max_seq_len=64, page_size=4, unified_round=False)
PROMPT = [5, 17, 33, 200, 7, 90, 12, 14, 150, 61, 8, 9, 30, 41]    # past the indexer's top 8


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """"own" / "lm_head" -> (checkpoint folder, engine dir): the tiny deepseek_v32 checkpoint as
    written, and the same without the NextN layer's shared_head.head."""
    root = tmp_path_factory.mktemp("nextn_heads")
    write_tiny_checkpoint(root / "own", "deepseek_v32")
    shutil.copytree(root / "own", root / "lm_head")
    tensors = read_all(root / "own")
    del tensors[HEAD]
    write_safetensors(root / "lm_head" / "model.safetensors", tensors)
    for kind in ("own", "lm_head"):
        build_engines(root / kind, root / f"{kind}.engines", OPTIONS, show_progress=False)
    return {kind: (root / kind, root / f"{kind}.engines") for kind in ("own", "lm_head")}


@pytest.mark.parametrize("kind, own", [("own", True), ("lm_head", False)])
def test_the_stored_names_choose_the_head_and_the_manifest_carries_it(heads, capsys, kind, own):
    folder, engines = heads[kind]
    ckpt = open_checkpoint(folder)
    assert ckpt.description.mtp.own_lm_head == own
    assert ("mtp.layers.0.shared_head.head.weight" in ckpt.sources) == own
    assert read_manifest(engines)["description"]["mtp"]["own_lm_head"] == own
    assert main(["inspect", str(folder)]) == 0
    assert ("own lm heads" if own else "the shared lm_head") in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["own", "lm_head"])
def test_drafts_equal_the_reference_with_the_chosen_head(heads, monkeypatch, kind):
    """k = 2 drafts per round (multi-call rounds, no index share) == the reference's recomputation
    with the chosen head, and differ from the other head's on some round."""
    folder, engines = heads[kind]
    torch.set_num_threads(1)
    target = load_target(folder)
    own = NextNReference(target, heads["own"][0])
    with_lm_head = NextNReference(target, heads["own"][0])
    with_lm_head.own["shared_head.head.weight"] = target.lm_head.weight.detach().float()
    assert not torch.equal(own.own["shared_head.head.weight"], with_lm_head.own["shared_head.head.weight"])
    chosen, other = (own, with_lm_head) if kind == "own" else (with_lm_head, own)
    rounds = record_drafts(monkeypatch)
    LLM(engines, RuntimeConfig(round="multi", adaptive_width=False)).generate(
        [PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(rounds) >= 4 and all(len(d) == round_drafts(t, [PROMPT], 12, 2) for t, d in rounds)
    for tokens, drafts in rounds:
        assert chosen.drafts(tokens[:-1], len(drafts)) == (tokens[-1], drafts), len(tokens)
    assert any(other.drafts(tokens[:-1], len(drafts))[1] != drafts for tokens, drafts in rounds)
