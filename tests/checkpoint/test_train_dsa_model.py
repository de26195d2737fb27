"""tools/train_dsa_model.py on a tiny config: two training steps, then the checkpoint it writes loads in
transformers with no missing or unexpected keys (only the NextN layer N left unread) and holds the
trained weights (the Hub's per-expert layout, bf16), the indexer is trained (its forward is no_grad in
transformers: only the KL reaches it) and the KL's index scores pick the indexer's own top-k."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools import train_dsa_model as tdm  # noqa: E402

SEQ, TOP_K = 16, 4      # top-k below the sequence: the sparse path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(folder, config, weights before, the trained target and NextN reference, the KL recorder)."""
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("dsa_train")
    config = tdm.model_config(vocab=320, eos=2, pad=0, layers=2, hidden=64, topk=TOP_K)
    tdm.initialise(folder, config, eos=2, pad=0)
    target, nextn = tdm.load(folder)
    before = {k: v.clone() for k, v in target.state_dict().items()} | \
        {f"nextn.{k}": v.clone() for k, v in nextn.layer.state_dict().items()}
    args = argparse.Namespace(kl_sequences=2, lr=3e-3, seed=0, minutes=5.0, dense_share=0.0, max_steps=2, seq=SEQ,
                              batch=2, anchor_every=4)
    data = np.random.default_rng(0).integers(3, 320, 5000).astype(np.int32)
    report = tdm.train(args, target, nextn, data, TOP_K)
    own = {k: v for k, v in nextn.own.items() if k != "embed_tokens.weight"}
    tdm.save(folder, target, nextn.layer, own, config, eos=2, pad=0)
    yield folder, report, before, target, nextn
    torch.set_num_threads(threads)


def test_two_steps_train_every_part_and_reload_exactly(trained):
    folder, report, before, target, nextn = trained
    last = report["last"]
    assert report["steps"] == 2 and np.isfinite([last["trunk"], *last["heads"]]).all() and last["indexer_kl"] > 0
    after = {k: v for k, v in target.state_dict().items()} | \
        {f"nextn.{k}": v for k, v in nextn.layer.state_dict().items()}
    for name in ("model.layers.1.self_attn.indexer.wq_b.weight", "nextn.self_attn.indexer.weights_proj.weight",
                 "model.layers.1.mlp.experts.gate_up_proj", "nextn.mlp.experts.down_proj", "lm_head.weight"):
        assert not torch.equal(before[name], after[name]), f"{name} was not trained"
    again, again_nextn = tdm.load(folder)          # raises on missing / unexpected keys
    for k, v in target.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v.to(torch.bfloat16).float(), rtol=0, atol=0)
    for k, v in nextn.layer.state_dict().items():
        torch.testing.assert_close(again_nextn.layer.state_dict()[k], v.to(torch.bfloat16).float(), rtol=0, atol=0)
    for k in ("eh_proj.weight", "shared_head.head.weight", "enorm.weight"):
        torch.testing.assert_close(again_nextn.own[k], nextn.own[k].to(torch.bfloat16).float(), rtol=0, atol=0)


def test_kl_scores_pick_the_indexers_top_k(trained):
    _, _, _, target, nextn = trained
    attns = [layer.self_attn for layer in target.model.layers] + [nextn.layer.self_attn]
    kl = tdm.IndexerKL(attns, sequences=2)
    batch = torch.randint(3, 320, (2, SEQ + 4))
    with torch.no_grad():
        hidden = target.model(input_ids=batch[:, :SEQ]).last_hidden_state
        tdm.nextn_steps(nextn, batch, hidden, 3, torch.tensor([3, 8, 12]))
    assert len(kl.calls) == len(target.model.layers) + 3
    for call in kl.calls:
        scores = tdm.IndexerKL.scores(call["ix"], call["hidden"], call["q_resid"], call["cos"], call["sin"])
        scores = scores.masked_fill(call["mask"] != 0, -torch.inf)
        theirs = call["topk"].long()                                                 # [B, S, K]
        mine = scores.topk(theirs.shape[-1], -1).indices
        real = torch.isfinite(scores.gather(-1, theirs))             # rows that see fewer than K pad with -inf
        assert torch.equal(mine.sort(-1).values[real.all(-1)], theirs.sort(-1).values[real.all(-1)])
        assert real.all(-1).any()
        with torch.no_grad():
            assert float(kl._one(*(call[k] for k in ("ix", "hidden", "q_resid", "cos", "sin", "mask", "topk",
                                                       "probs")))) >= 0
