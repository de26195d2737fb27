"""The unified round (one engine call per round, export/round_graph.py + pipeline/unified_round.py)
obeys the exactness contract: speculative == plain greedy token for token whatever the drafts,
batches growing 1-8 (staggered), preemption, chained (qwen3_5_mtp3) and reused (one head:
qwen3_next, qwen3_5_mtp1) heads; and it equals the multi-call round round by round: tokens,
accepted counts, the drafts each round verifies and every pool, bitwise (trunk K/V, states, every
head's K/V). tests/pipeline/test_pipeline_contract.py runs the same contract on the default (unified) round."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tandem.checkpoint import open_checkpoint
from tandem.engines.buckets import plan, unified_round_kinds
from tandem.engines.builder import build_engines
from tandem.engines.manifest import read_manifest
from tandem.engines.options import BuildOptions
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.round_loop import RoundLoop
from tandem.pipeline.sampling_params import SamplingParams
from tandem.testing.tiny_checkpoints import write_tiny_checkpoint

from ..pipeline_fixtures import GREEDY, OPTIONS, install_drafter, run

PROMPTS = [[5, 17, 33, 200, 7], [9, 120, 77, 301, 15, 2, 88, 91, 14, 250, 3], [44], [3, 250, 8, 160, 21, 6, 7],
           [300, 12, 12, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [77, 78], [101, 5, 9]]
# both rounds at the same widths, round by round (the adaptive width controller, where there is one, off)
FIXED = {"adaptive_width": False} if "adaptive_width" in RuntimeConfig.__dataclass_fields__ else {}
OFF = SamplingParams(max_tokens=24, ignore_eos=True, speculative=False)


@pytest.fixture(scope="module")
def dirs(engine_dirs, tiny_root, tmp_path_factory):
    """The session's chained engine dirs and a one-head (reused) one."""
    path = tmp_path_factory.mktemp("engines") / "qwen3_5_mtp1"
    build_engines(tiny_root / "qwen3_5_mtp1", path, BuildOptions(**{**OPTIONS.to_json(), "batch_sizes": (1, 8)}),
                  show_progress=False)
    return {**engine_dirs, "qwen3_5_mtp1": path}


@pytest.fixture(scope="module")
def plain(dirs):
    return {kind: run(dirs[kind], PROMPTS, OFF)[0] for kind in ("qwen3_5_mtp3", "qwen3_next")}


def _round_calls(llm) -> int:
    return sum(n for name, n in llm.runner.calls.items() if name.startswith("round_"))


@pytest.mark.parametrize("drafter", ["wrong", "oracle", "prefix:1"])
def test_any_drafts_equal_plain_greedy_staggered(dirs, plain, monkeypatch, drafter):
    install_drafter(monkeypatch, drafter, {f"r{i}": out for i, out in plain["qwen3_5_mtp3"].items()})
    outputs, llm = run(dirs["qwen3_5_mtp3"], PROMPTS, config=RuntimeConfig(**FIXED), stagger=2)
    assert outputs == plain["qwen3_5_mtp3"]
    assert _round_calls(llm) > 0 and "verify_greedy" not in llm.runner.calls
    metrics = [s.metrics for s in llm.test_sequences]
    if drafter == "wrong":
        assert sum(m.accepted for m in metrics) == 0
    if drafter == "oracle":
        assert sum(m.accepted for m in metrics) == sum(m.drafted for m in metrics) > 0


def test_under_preemption(dirs, plain):
    config = RuntimeConfig(memory_budget_bytes=230_000, max_num_seqs=8, **FIXED)
    outputs, llm = run(dirs["qwen3_5_mtp3"], PROMPTS, config=config)
    assert outputs == plain["qwen3_5_mtp3"]
    assert sum(s.metrics.preemptions for s in llm.test_sequences) > 0 and _round_calls(llm) > 0


def _lockstep(path, params, prompts, check, monkeypatch, drafter=None):
    """Run the same requests through a unified and a multi-call LLM, one step at a time: after every
    step the tokens, accepted counts, the drafts each round verified and check(unified, multi) agree."""
    if drafter:
        install_drafter(monkeypatch, *drafter)
    real = RoundLoop._draft
    seen: dict[int, list] = {}

    def record(self, seqs):
        drafts = real(self, seqs)
        seen.setdefault(id(self), []).append(dict(drafts))
        return drafts

    monkeypatch.setattr(RoundLoop, "_draft", record)
    config = RuntimeConfig(memory_budget_bytes=4 << 20, **FIXED)
    llms = [LLM(path, replace(config, round=mode)) for mode in ("unified", "multi")]
    seqs = [[llm.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)] for llm in llms]
    while any(s.finish_reason is None for s in seqs[0]):
        for llm in llms:
            llm.step()
        check(*llms)
        assert seen.get(id(llms[0].round_loop)) == seen.get(id(llms[1].round_loop))
        for a, b in zip(*seqs):
            assert a.tokens == b.tokens and a.metrics.accepted == b.metrics.accepted
            assert (a.committed, a.head_committed) == (b.committed, b.head_committed)
    assert _round_calls(llms[1]) == 0 and "verify_greedy" not in llms[0].runner.calls
    # one call per decode step (a sequence whose budget leaves it fewer drafts than the others' rides
    # the widest call: _round_groups); head calls only re-anchor prefills, draft a new sequence's first
    # round and a round wider than the last one's drafts (the batch shrank)
    rounds = llms[0].round_loop.stats.rounds
    assert rounds - len(prompts) <= _round_calls(llms[0]) <= rounds
    heads = [sum(n for name, n in llm.runner.calls.items() if name.startswith("mtp_head")) for llm in llms]
    assert 3 * heads[0] < heads[1]
    return seqs


@pytest.mark.parametrize("kind,drafter", [("qwen3_5_mtp3", None), ("qwen3_5_mtp1", None),
                                          ("qwen3_next", "prefix:2")])
def test_unified_equals_multi_call_round_by_round_pools_included(dirs, plain, monkeypatch, kind, drafter):
    """Real heads, or (qwen3_next, whose random heads are never right) a drafter right twice a round."""
    worst = {}

    def same_pools(u, m):
        for where in ("paged", "states"):
            for layer, pools in getattr(u.pools, where).items():
                for name, pool in pools.items():
                    diff = float(np.abs(pool - getattr(m.pools, where)[layer][name]).max())
                    worst[(layer, name)] = max(worst.get((layer, name), 0.0), diff)
                    # bitwise: every row is computed by the same ops on the same inputs in both paths
                    # (MLAS's products do not depend on the row count here; measured, every pool 0.0)
                    assert diff == 0.0, f"{where} {layer} {name}: {diff}"

    reference = {f"r{i}": out for i, out in plain.get(kind, {}).items()}
    seqs = _lockstep(dirs[kind], GREEDY, PROMPTS[:3], same_pools, monkeypatch, drafter and (drafter, reference))
    assert worst and max(worst.values()) == 0.0
    if kind != "qwen3_5_mtp1":   # its random head is never right: rows past 0 are checked by the others
        assert sum(s.metrics.accepted for s in seqs[0]) > 0


def test_sampled_rounds_reproducible_and_equal_to_multi_call(dirs, monkeypatch):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.95, seed=3, ignore_eos=True)
    seqs = _lockstep(dirs["qwen3_next"], params, PROMPTS[:3], lambda u, m: None, monkeypatch)
    assert all(len(s.output_ids()) == 16 for s in seqs[0])   # same seed, two engines: the same samples


@pytest.mark.parametrize("mode", ["unified", "multi"])
def test_budgets_that_end_apart_share_one_call_a_round(dirs, plain, monkeypatch, mode):
    """Drafts always right, budgets of 5, 9, 14 and 24 tokens and a sampled request: as budgets end,
    sequences are left fewer drafts than the others and ride the widest call with filler rows, which
    are never accepted: every step makes one verify call, and every output is what plain decoding gives."""
    reference = {f"r{i}": out for i, out in plain["qwen3_5_mtp3"].items()}
    install_drafter(monkeypatch, "oracle", reference)
    drafter, mixed = RoundLoop._draft, []

    def draft(self, seqs):
        drafts = drafter(self, seqs)
        mixed.append(len({len(d) for d in drafts.values()}) > 1)
        return drafts

    monkeypatch.setattr(RoundLoop, "_draft", draft)
    sampled = SamplingParams(max_tokens=11, temperature=0.9, top_k=50, seed=5, ignore_eos=True)
    budgets = [5, 9, 14, 24]
    want = LLM(dirs["qwen3_5_mtp3"]).generate([PROMPTS[4]], replace(sampled, speculative=False))[0].token_ids
    llm = LLM(dirs["qwen3_5_mtp3"], RuntimeConfig(round=mode, **FIXED))
    seqs = [llm.add_request(PROMPTS[i], replace(OFF, max_tokens=n, speculative=True), request_id=f"r{i}")
            for i, n in enumerate(budgets)] + [llm.add_request(PROMPTS[4], sampled, request_id="s")]
    calls = []
    while any(s.finish_reason is None for s in seqs):
        before = sum(n for name, n in llm.runner.calls.items() if name.startswith(("round_", "verify_")))
        llm.step()
        calls.append(sum(n for name, n in llm.runner.calls.items() if name.startswith(("round_", "verify_"))) - before)
    assert [s.output_ids() for s in seqs[:4]] == [reference[f"r{i}"][:n] for i, n in enumerate(budgets)]
    assert seqs[4].output_ids() == want
    assert any(mixed) and max(calls) == 1


def test_build_plans_round_graphs_for_target_anchored_heads_only(tiny_root, dirs, tmp_path):
    manifest = read_manifest(dirs["qwen3_5_mtp3"])
    assert manifest["runtime"]["unified_round"] == {"built": True, "mode": "chained", "widths": [2, 3, 4]}
    assert all(e["verification"]["passed"] for e in manifest["engines"] if e["role"] == "round")
    assert read_manifest(dirs["qwen3_5_mtp1"])["runtime"]["unified_round"]["mode"] == "reused"
    write_tiny_checkpoint(tmp_path / "step3p5", "step3p5")
    step = open_checkpoint(tmp_path / "step3p5").description
    kinds, reason = unified_round_kinds(step, OPTIONS)
    assert kinds == [] and "previous head" in reason
    qwen = open_checkpoint(tiny_root / "qwen3_5_mtp3").description
    off = BuildOptions(**{**OPTIONS.to_json(), "unified_round": False})
    assert not [b for b in plan(qwen, off) if b.role == "round"]
    assert {b.graph.drafts for b in plan(qwen, OPTIONS) if b.role == "round"} == {1, 2, 3}
