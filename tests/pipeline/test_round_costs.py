"""Measured round costs for the adaptive width (`round_seconds_per_batch` in runtime_settings.json,
written by `tandem profile`): where every round costs more plain steps than its width, drafting is
off from the first round; where a wide round pays, the bucket starts there; the controller's own
samples replace the given costs once it has them; bad values are refused naming the file."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from tandem.engines.manifest import ManifestError
from tandem.pipeline.grammar import GrammarSpec
from tandem.pipeline.llm import LLM
from tandem.pipeline.sampling_params import SamplingParams
from tandem.pipeline.width_control import WidthController
from tandem.profiling.report import round_costs

from .test_structured_outputs import CODE_PROMPTS, SCHEMAS, shipped  # noqa: F401 (a fixture)

KIND = "qwen3_5_mtp3"
PROMPTS = [[5, 17, 33, 200, 7], [9, 120, 77, 301, 15, 2, 88, 91, 14, 250, 3]]
DEAR = {1: 1.0, 2: 3.1, 3: 3.6, 4: 4.3}     # ms: every width loses even with every draft accepted
CHEAP = {1: 1.0, 2: 1.2, 3: 1.35, 4: 1.5}


def test_given_costs_that_cannot_pay_turn_drafting_off_at_the_first_round():
    ctl = WidthController([2, 3, 4], [1, 8], costs={1: DEAR, 8: CHEAP})
    assert ctl.width(1) == 1 and ctl.hopeless(1)
    assert ctl.width(8) == 4 and not ctl.hopeless(8)        # batch 8's costs pay at the widest
    unseeded = WidthController([2, 3, 4], [1])
    assert unseeded.width(1) == 4 and not unseeded.hopeless(1)   # no costs: the widest, measured live


def test_a_profiled_bucket_holds_its_first_width_until_it_has_measured_it():
    """Given costs where width 4 pays, one round with no draft accepted (a request's first draft,
    after its prompt, often misses) does not turn the bucket off: it holds width 4 until it has its
    own samples of it, and then judges on what those rounds saw."""
    ctl = WidthController([2, 3, 4], [1], costs={1: CHEAP})
    widths = []
    for accepted in (0, 3):
        widths.append(ctl.width(1))
        ctl.observe(1, widths[-1], CHEAP[4], [3], [accepted])
    assert widths == [4, 4]
    for _ in range(8):                 # measured: none accepted from now, and the bucket goes off
        w = ctl.width(1)
        ctl.observe(1, w, CHEAP[w], [w - 1] if w > 1 else [], [0] if w > 1 else [])
    assert ctl.choice(1) == 1


def test_live_samples_replace_the_given_costs():
    ctl = WidthController([2, 3, 4], [1], costs={1: CHEAP})
    assert ctl.width(1) == 4
    for _ in range(4):          # width 4 measured at 6 plain steps a round: it cannot pay
        w = ctl.width(1)
        ctl.observe(1, w, 6.0 if w == 4 else CHEAP[w], [w - 1], [w - 1])
    assert ctl.choice(1) != 4 and [e.cost for e in ctl.estimates(1)][3] == 6.0


def test_rounds_that_pay_less_than_the_gain_drafting_needs_are_off_at_the_first_round():
    """At full acceptance width 4 gives 4 tokens in 3.9 plain steps' time: 2.6% over plain steps,
    under the 5% `min_gain` drafting must beat them by, so no acceptance a probe could see would turn
    drafting on: the verdict comes at once (a schema's rounds on the shipped model, profiled)."""
    ctl = WidthController([2, 3, 4], [1], costs={1: {1: 1.0, 2: 2.5, 3: 3.2, 4: 3.9}})
    assert ctl.width(1) == 1 and ctl.hopeless(1)
    ctl = WidthController([2, 3, 4], [1], costs={1: {1: 1.0, 2: 2.5, 3: 3.2, 4: 3.7}})    # 8% over: tried
    assert ctl.width(1) == 4 and not ctl.hopeless(1)


def test_schema_rounds_take_only_their_own_costs():
    """Rounds under a grammar (multi-call, masks) are given the constrained costs, never the free
    rounds' (one call, no masks): given those, a schema's bucket drafted at width 4 from cheap figures."""
    ctl = WidthController([2, 3, 4], [1], costs={1: CHEAP}, constrained_costs={1: DEAR})
    assert ctl.width(1, constrained=True) == 1 and ctl.hopeless(1, constrained=True)
    assert ctl.width(1) == 4 and not ctl.hopeless(1)
    only_free = WidthController([2, 3, 4], [1], costs={1: CHEAP})
    assert [e.cost for e in only_free.estimates(1, constrained=True)] == [None] * 4
    assert only_free.width(1, constrained=True) == 4        # measured live, as without a profile


def test_a_cold_off_round_does_not_measure_plain_steps():
    """An off round that ran an engine's first call (several times a step) does not replace the given
    cost of plain steps: one off round measures them, and a dear one made drafting look good."""
    ctl = WidthController([2, 3, 4], [1], constrained_costs={1: {1: 1.0, 2: 2.5, 3: 3.2, 4: 3.9}})
    ctl.observe(1, 1, 2.5, [], [], constrained=True, steps=4, cold=True)
    assert ctl.estimates(1, constrained=True)[0].cost == 1.0 and ctl.hopeless(1, constrained=True)
    ctl.observe(1, 1, 0.9, [], [], constrained=True, steps=4)
    assert ctl.estimates(1, constrained=True)[0].cost == 0.9


def test_a_bucket_takes_the_costs_of_the_next_batch_size_up():
    ctl = WidthController([2, 3, 4], [1, 2, 4, 8], costs={4: DEAR})
    assert ctl.width(2) == 1 and ctl.hopeless(3) and ctl.width(8) == 1   # 8 > every given: the largest's


@pytest.fixture(scope="module")
def dear_dir(engine_dirs, tmp_path_factory):
    path = tmp_path_factory.mktemp("round_costs") / "engines"
    shutil.copytree(engine_dirs[KIND], path)
    seconds = {str(b): {str(w): ms / 1e3 for w, ms in DEAR.items()} for b in (1, 8)}
    (path / "runtime_settings.json").write_text(json.dumps({"verify_width_per_batch": {},
                                                            "round_seconds_per_batch": seconds}))
    return path


def test_an_engine_dir_whose_rounds_cannot_pay_decodes_plain_from_the_start(dear_dir, engine_dirs):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [r.token_ids for r in LLM(engine_dirs[KIND]).generate(PROMPTS, replace(params, speculative=False))]
    llm = LLM(dear_dir)
    out = llm.generate(PROMPTS, params)
    assert [r.token_ids for r in out] == plain
    assert all(r.metrics.rounds == 0 and r.metrics.drafted == 0 for r in out)
    assert not any(name.startswith(("round_", "verify_")) for name in llm.runner.calls)
    fixed = llm.generate([PROMPTS[0]], replace(params, k=2))[0]     # a request's own k still drafts
    assert fixed.metrics.drafted > 0 and fixed.token_ids == plain[0]


@pytest.mark.parametrize("costs, problem", [
    ({"1": {"2": -1.0}}, "round seconds -1.0 at batch size 1, width 2 must be a positive number"),
    ({"1": {"2": "fast"}}, "round seconds 'fast'"),
    ({"1": {"9": 0.001}}, "verify width '9' for batch size 1 is not one the engines were built for"),
    ({"1": [0.001]}, "must be {batch size: {width: seconds}}"),
])
@pytest.mark.parametrize("key", ["round_seconds_per_batch", "constrained_round_seconds_per_batch"])
def test_bad_round_costs_are_refused_naming_the_file(dear_dir, tmp_path, costs, problem, key):
    path = tmp_path / "engines"
    shutil.copytree(dear_dir, path)
    (path / "runtime_settings.json").write_text(json.dumps({key: costs}))
    with pytest.raises(ManifestError, match=f"runtime_settings.json.*{key}.*{problem}.*tandem profile".replace(
            "{", r"\{")):
        LLM(path)


def test_profile_costs_a_plain_step_per_token_not_per_burst():
    """An off round is a burst of many steps: width 1's cost is the decode time per token of a
    sequence, or every width would look cheap next to it."""
    latency = [{"graph": g, "batch": 1, "rows": r, "median_ms": ms}
               for g, r, ms in [("verify_greedy", 2, 2.0), ("verify_greedy", 4, 2.5), ("mtp_head_0", 1, 0.5),
                                ("mtp_head_0", 2, 0.5), ("mtp_head_0", 4, 0.6)]]
    runs = [{"mode": "off", "batch": 1, "decode_tokens_per_s": 500.0, "round_ms": 16 * 2.0},   # bursts of 16
            {"mode": "on", "batch": 1, "round_ms": 4.0}]
    rounds = round_costs({"latency": latency, "runs": runs}, [1], [2, 4], reanchored=1)
    assert rounds[(1, 1)] == pytest.approx(0.002)
    assert rounds[(1, 4)] == pytest.approx(0.004)                  # calibrated on the measured round


def test_grammar_rounds_keep_their_own_figures():
    """A verdict of off on rounds under a grammar (multi-call, drafts under masks) leaves the free
    rounds of the same batch size as they were, and the other way round."""
    ctl = WidthController([2, 3, 4], [1])
    for _ in range(300):                 # constrained: nothing accepted, rounds dear
        w = ctl.width(1, constrained=True)
        ctl.observe(1, w, {1: 1.0, 2: 1.6, 3: 1.9, 4: 2.2}[w], [w - 1], [0], constrained=True)
    assert ctl.choice(1, constrained=True) == 1 and ctl.hopeless(1, constrained=True)
    assert ctl.width(1) == 4 and not ctl.hopeless(1)


def test_a_schema_judged_off_leaves_free_requests_drafting(shipped):  # noqa: F811
    """On the engine: the constrained bucket judged off, a schema request decodes plain from its
    prefill while a free request at the same batch size drafts (the shipped model's heads agree)."""
    llm = LLM(shipped)
    ctl = llm.round_loop.width_control
    for _ in range(300):
        w = ctl.width(1, constrained=True)
        ctl.observe(1, w, {1: 1.0, 2: 1.6, 3: 1.9, 4: 2.2}[w], [w - 1], [0], constrained=True)
    assert ctl.hopeless(1, constrained=True)
    schema = GrammarSpec.json_schema(SCHEMAS["nested"])
    ruled = llm.generate([CODE_PROMPTS[0]], SamplingParams(max_tokens=32, grammar=schema))[0]
    free = llm.generate([CODE_PROMPTS[0]], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert ruled.metrics.rounds == 0 and free.metrics.rounds > 0 and free.metrics.accepted > 0


def test_only_full_width_rounds_are_timed(shipped, monkeypatch):  # noqa: F811
    """A round whose sequences drafted fewer than its width asks (their budgets' end) ran a narrower,
    cheaper verify, or plain steps: its time is not that width's cost."""
    seen = []
    observe = WidthController.observe

    def record(self, batch, width, seconds, drafted, accepted, constrained=False, steps=1, cold=False):
        seen.append((width, seconds, list(drafted)))
        observe(self, batch, width, seconds, drafted, accepted, constrained, steps, cold)

    monkeypatch.setattr(WidthController, "observe", record)
    llm = LLM(shipped)
    for tokens in (5, 6, 7, 9):
        llm.generate(CODE_PROMPTS, SamplingParams(max_tokens=tokens, ignore_eos=True))
    timed = [(w, d) for w, s, d in seen if s is not None and w > 1]
    assert timed and all(d and all(x == w - 1 for x in d) for w, d in timed), timed
    assert any(s is None and w > 1 for w, s, _ in seen)       # the budget-cut rounds happened, untimed
