"""Adaptive verify width in the engine (pipeline/adaptive_rounds.py; the controller alone:
tests/pipeline/test_width_controller.py). On tiny engines: heads that are always wrong turn
drafting off after a short warm-up, probe and end it, an oracle climbs to the widest built width,
outputs stay plain greedy's, and the heads' deferred catch-up leaves them exactly where a
per-round re-anchor would."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams
from tandem.pipeline.sequence import Status
from tandem.pipeline.width_control import WidthController, WidthPolicy

from ..pipeline_fixtures import install_drafter, run
from .test_width_controller import COST, DEAR, runs_of

KIND = "qwen3_5_mtp3"
PROMPTS = [[5, 17, 33, 200, 7], [9, 120, 77, 301, 15, 2, 88, 91, 14, 250, 3]]
LONG = SamplingParams(max_tokens=96, ignore_eos=True)
# the width sequences below follow the batch's rounds from its first step: no prefix cache, whose
# entry before a prompt's last token splits that prompt's prefill (one step more for the longer prompt)
NO_CACHE = RuntimeConfig(prefix_cache=False)


# ---- in the engine ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain(engine_dirs):
    return run(engine_dirs[KIND], PROMPTS, LONG, RuntimeConfig(speculative=False))[0]


@pytest.fixture
def widths(monkeypatch) -> list[int]:
    """Every width the controller hands out, in order."""
    seen, original = [], WidthController.width

    def width(self, batch, constrained=False):
        seen.append(original(self, batch, constrained))
        return seen[-1]

    monkeypatch.setattr(WidthController, "width", width)
    return seen


def generate(llm: LLM, prompts, params=LONG) -> dict[int, list[int]]:
    seqs = [llm.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    while any(s.finish_reason is None for s in seqs):
        llm.step()
    llm.test_sequences = seqs
    return {i: s.output_ids() for i, s in enumerate(seqs)}


class ModeledCost(WidthController):
    """The engine's round times replaced by `cost` (COST by default): on tiny engines a round is all
    per-call overhead (and the test machine's load adds its own), so whether drafting pays there
    is not the point. A modeled round is never cold (the engine's first runs are its times' matter)."""

    cost = COST

    def observe(self, batch, width, seconds, drafted, accepted, constrained=False, steps=1, cold=False):
        super().observe(batch, width, None if seconds is None else self.cost[width], drafted, accepted, constrained,
                        steps)


def test_wrong_heads_turn_drafting_off_probe_and_end_it(engine_dirs, plain, monkeypatch, widths):
    """Heads never right, rounds that would pay at full acceptance: off after the start width is
    measured, three probes (width 2 until its cost is measured, the widest, width 2: their
    intervals count an off round's burst by its steps), then plain for good before the
    sequences end."""
    install_drafter(monkeypatch, "wrong")
    llm = LLM(engine_dirs[KIND], NO_CACHE)
    llm.round_loop.width_control = ctl = ModeledCost(sorted(llm.verify_widths), [1, 2, 4, 8])
    assert generate(llm, PROMPTS) == plain
    off_from = widths.index(1)
    assert off_from <= 4                            # warm-up: the start width measured, then off
    probes = [(w, n) for i, w, n in runs_of(widths) if i > off_from and w > 1]
    assert probes == [(2, 3), (max(llm.verify_widths), 2), (2, 2)]
    assert ctl.choice(len(PROMPTS)) == 1 and ctl.hopeless(len(PROMPTS))
    assert not any(s.speculative for s in llm.test_sequences)
    assert llm.runner.calls.get("target_step", 0) >= 0.8 * len(widths)       # off rounds are plain steps


class Recording(WidthController):
    """The engine's own round times, and every round it reports: (bucket, width, seconds, cold)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[tuple] = []

    def observe(self, batch, width, seconds, drafted, accepted, constrained=False, steps=1, cold=False):
        self.seen.append((self.bucket(batch), width, seconds, cold))
        super().observe(batch, width, seconds, drafted, accepted, constrained, steps, cold)


class NeverHopeless(Recording):
    """Never judged off (tiny engines' rounds cannot pay): every round and probe is seen."""

    def hopeless(self, batch, constrained=False):
        return False

    def _rounds_lose(self, st):
        return False


def test_a_rounds_time_counts_its_outputs_not_the_heads_catch_up(engine_dirs, plain, monkeypatch):
    """A round's time runs to its outputs made (the host's work on them is the round's, as a burst's
    is once for its steps), but not through the heads' catch-up over rows kept while off (the price
    of a change of state, not of a step). Both made slow here: 10 ms per output, 0.5 s per catch-up."""
    import time as clock

    from tandem.pipeline.round_loop import RoundLoop

    install_drafter(monkeypatch, "wrong")
    catching = []
    postprocess, catch_up, reanchor = RoundLoop._postprocess, RoundLoop._catch_up, RoundLoop._reanchor

    def slow_postprocess(self, seq):
        clock.sleep(0.01)
        return postprocess(self, seq)

    def counted_catch_up(self, seqs):
        catching.append(True)
        try:
            catch_up(self, seqs)
        finally:
            catching.pop()

    def slow_reanchor(self, work):
        if catching:
            clock.sleep(0.5)
        reanchor(self, work)

    monkeypatch.setattr(RoundLoop, "_postprocess", slow_postprocess)
    monkeypatch.setattr(RoundLoop, "_catch_up", counted_catch_up)
    monkeypatch.setattr(RoundLoop, "_reanchor", slow_reanchor)
    llm = LLM(engine_dirs[KIND], NO_CACHE)
    llm.round_loop.width_control = ctl = NeverHopeless(sorted(llm.verify_widths), [1, 2, 4, 8])
    llm.round_loop.lag_rows = 8         # off rounds catch the heads up every 8 kept rows
    short = SamplingParams(max_tokens=48, ignore_eos=True)
    assert generate(llm, PROMPTS, short) == {i: o[:48] for i, o in plain.items()}
    timed = [(w, t) for _, w, t, _ in ctl.seen if t is not None]
    assert llm.round_loop.stats.phase_seconds["reanchor"] > 1.0           # catch-ups ran (inside off rounds too)
    assert any(w > 1 and t >= 0.02 for w, t in timed)                     # two outputs of 10 ms: counted
    assert all(t < 0.05 for _, t in timed), timed       # a 0.5 s catch-up over <= 8 steps: never counted


def test_a_round_that_ran_an_engine_s_first_call_is_told_cold(engine_dirs, plain, monkeypatch):
    """An engine's first two calls (the runtime's first runs: several times a round's time) make
    their rounds cold, whose times the controller does not keep; a later round of that engine is
    not, a new shape (another batch size, more pages of context) included, and the same requests
    again have no cold round. (Plain steps' engine ran at the prefill.)"""
    llm = LLM(engine_dirs[KIND], NO_CACHE)
    llm.round_loop.width_control = ctl = NeverHopeless(sorted(llm.verify_widths), [1, 2, 4, 8])
    assert generate(llm, PROMPTS) == plain
    seen = [(b, w, cold) for b, w, _, cold in ctl.seen]
    # cold: each drafting width's first two rounds (its engine's first two runs), no other
    firsts = [i for w in {w for _, w, _ in seen} for i in [i for i, x in enumerate(seen) if x[1] == w][:2]]
    assert [i for i, x in enumerate(seen) if x[2]] == sorted(i for i in firsts if seen[i][1] > 1), seen
    # plain steps ran through growing contexts (tables of 1, 2, 4 ... pages: a new shape each), none cold
    shapes = {key[3] for key in llm.runner._bindings if key[0].name == "target_step" and key[1] == 2}
    assert len(shapes) >= 2 and seen.count((2, 1, False)) >= 3
    assert llm.runner.first_runs == sum(llm.runner._engine_runs.values()) >= 4
    ctl.seen.clear()
    assert generate(llm, PROMPTS) == plain and ctl.seen and not any(cold for *_, cold in ctl.seen)


class Hopeless(ModeledCost):
    cost = DEAR


def test_rounds_that_cannot_pay_end_drafting_and_the_heads_catch_up(engine_dirs, monkeypatch, widths):
    """Rounds that cost more plain steps than their width (a tiny model's per-call overhead): once
    the bucket is off and every width is known to lose even at full acceptance, its sequences decode
    plain for good: no probes, no heads' catch-up, and a later request skips the heads in prefill."""
    params = SamplingParams(max_tokens=192, ignore_eos=True)   # (drafts all accepted: rounds go fast)
    plain = run(engine_dirs[KIND], PROMPTS, params, RuntimeConfig(speculative=False))[0]
    install_drafter(monkeypatch, "oracle", {f"r{i}": out for i, out in plain.items()})
    llm = LLM(engine_dirs[KIND])
    llm.round_loop.width_control = Hopeless(sorted(llm.verify_widths), [1, 2, 4, 8], policy=WidthPolicy(probe_every=2))
    assert generate(llm, PROMPTS, params) == plain
    assert llm.round_loop.width_control.hopeless(len(PROMPTS))
    assert not any(s.speculative for s in llm.test_sequences)
    assert len(widths) <= 40                       # the start width, off, probes measuring each: then plain
    reanchor = llm.round_loop.stats.phase_seconds.get("reanchor", 0.0)
    heads = llm.runner.calls.get("mtp_head_0", 0)
    assert generate(llm, PROMPTS, params) == plain
    assert llm.runner.calls.get("mtp_head_0", 0) == heads         # the new requests' prefill ran no head
    assert llm.round_loop.stats.phase_seconds.get("reanchor", 0.0) == reanchor


def test_a_request_k_wins_over_a_hopeless_verdict(engine_dirs, monkeypatch, widths):
    """Once a bucket is judged hopeless, requests that leave k to the engine decode plain, but one that
    sends its own k still drafts that many each round, from its prefill on (and stays exact)."""
    params = SamplingParams(max_tokens=192, ignore_eos=True)   # (drafts all accepted: rounds go fast)
    plain = run(engine_dirs[KIND], PROMPTS, params, RuntimeConfig(speculative=False))[0]
    install_drafter(monkeypatch, "oracle", {f"r{i}": out for i, out in plain.items()})
    llm = LLM(engine_dirs[KIND])
    llm.round_loop.width_control = Hopeless(sorted(llm.verify_widths), [1, 2, 4, 8], policy=WidthPolicy(probe_every=2))
    assert generate(llm, PROMPTS, params) == plain and llm.round_loop.width_control.hopeless(len(PROMPTS))
    fixed = replace(params, k=2)
    assert generate(llm, PROMPTS, fixed) == plain
    for s in llm.test_sequences:   # 2 a round (but the last, where the budget leaves 1)
        assert s.speculative and s.metrics.rounds > 0 and s.metrics.drafted_per_position[0] == s.metrics.rounds
        assert s.metrics.drafted_per_position[1] >= s.metrics.rounds - 1


def judged_off(engine_dirs, monkeypatch, rejudge_rounds: int = 256):
    """Heads always wrong, rounds that would pay at full acceptance (buckets 1 and 4: a late request
    joins the bucket of the two running ones): PROMPTS decode until their sequences flip to plain
    or one finishes -> (llm, controller, sequences)."""
    install_drafter(monkeypatch, "wrong")
    # one token an off round: the verdict comes after a number of rounds, before 96 tokens are out
    llm = LLM(engine_dirs[KIND], RuntimeConfig(decode_burst=1))
    llm.round_loop.width_control = ctl = ModeledCost(sorted(llm.verify_widths), [1, 4],
                                                 policy=WidthPolicy(probe_every=2, probe_max=8,
                                                                    rejudge_rounds=rejudge_rounds))
    seqs = [llm.add_request(p, LONG, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
    while any(s.speculative for s in seqs) and all(s.finish_reason is None for s in seqs):
        llm.step()
    return llm, ctl, seqs


def test_heads_confirmed_wrong_end_drafting_while_the_engine_is_busy(engine_dirs, plain, monkeypatch, widths):
    """Rounds that would pay at full acceptance, heads always wrong: once the probes confirmed off
    (the widest probed, backed off to probe_max), the sequences decode plain to their end and a
    request prefilled while they run skips the heads."""
    llm, ctl, seqs = judged_off(engine_dirs, monkeypatch)
    assert ctl.hopeless(len(PROMPTS)) and max(llm.verify_widths) in ctl._state(len(PROMPTS)).probed
    assert len(widths) <= 30 and all(s.finish_reason is None for s in seqs)
    heads = llm.runner.calls.get("mtp_head_0", 0)
    late = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True), request_id="late")
    while any(s.finish_reason is None for s in [*seqs, late]):
        llm.step()
    assert not late.speculative and llm.runner.calls.get("mtp_head_0", 0) == heads    # prefilled without heads
    assert {i: s.output_ids() for i, s in enumerate(seqs)} == plain
    assert late.output_ids() == plain[0][:8]


def test_a_verdict_of_off_outlasts_its_sequences_and_an_empty_engine(engine_dirs, plain, monkeypatch):
    """Requests one after another (batch 1, say) are one workload: a verdict of off holds for the
    next requests though the sequences it was made on have left and the engine ran empty, so heads
    that never agree cost no probes and no heads' catch-up on every new request."""
    llm, ctl, seqs = judged_off(engine_dirs, monkeypatch)
    while any(s.finish_reason is None for s in seqs):
        llm.step()
    assert not llm.scheduler.running
    heads = llm.runner.calls.get("mtp_head_0", 0)
    again = llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [r.token_ids for r in again] == [plain[i][:8] for i in range(len(PROMPTS))]
    assert llm.runner.calls.get("mtp_head_0", 0) == heads and all(r.metrics.rounds == 0 for r in again)


def test_a_verdict_of_off_holds_new_requests_for_a_bounded_number_of_rounds(engine_dirs, plain, monkeypatch):
    """Under continuous load (the judged sequences still run) a verdict of off holds for new requests
    at most rejudge_rounds engine rounds: one arriving before skips the heads, one arriving after has
    them and is probed again, so a workload that turns good gets drafting back within the bound."""
    llm, ctl, seqs = judged_off(engine_dirs, monkeypatch, rejudge_rounds=12)
    since = llm.round_loop.stats.rounds
    early = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True), request_id="early")
    while early.finish_reason is None:
        llm.step()
    assert not early.speculative and llm.round_loop.stats.rounds - since < 12
    while llm.round_loop.stats.rounds - since < 12:
        llm.step()
    heads = llm.runner.calls.get("mtp_head_0", 0)
    late = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True), request_id="late")
    llm.step()                                                      # its prefill
    assert all(s.finish_reason is None for s in seqs)              # (the judged ones still run)
    assert late.speculative and llm.runner.calls.get("mtp_head_0", 0) > heads
    while any(s.finish_reason is None for s in [*seqs, late]):
        llm.step()
    assert {i: s.output_ids() for i, s in enumerate(seqs)} == plain and late.output_ids() == plain[1][:8]


class JudgedOff(ModeledCost):
    """A verdict of off from the first round on, dropped by `rejudge` (as a probes' verdict is)."""

    verdict = True

    def hopeless(self, batch, constrained=False):
        return self.verdict

    def rejudge(self):
        self.verdict = False
        super().rejudge()


def test_a_verdict_first_seen_at_a_prefill_holds_a_bounded_number_of_rounds(engine_dirs, plain, monkeypatch):
    """Requests one after another: the verdict of off is first seen when the next request is
    prefilled (no round ran in between). That request and those after it decode plain, and after
    rejudge_rounds rounds a new request has heads again (the verdict's clock starts at that prefill)."""
    install_drafter(monkeypatch, "wrong")
    llm = LLM(engine_dirs[KIND], RuntimeConfig(decode_burst=1))
    llm.round_loop.width_control = JudgedOff(sorted(llm.verify_widths), [1, 4], policy=WidthPolicy(rejudge_rounds=12))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    drafted = [llm.generate([PROMPTS[0]], params)[0].metrics.rounds > 0 for _ in range(5)]
    assert drafted[0] is False and any(drafted)     # 6 rounds a request: the third or fourth has heads again
    assert llm.round_loop.width_control.verdict is False


def test_oracle_climbs_from_off_to_the_widest_built_width(engine_dirs, plain, monkeypatch, widths):
    install_drafter(monkeypatch, "oracle", {f"r{i}": out for i, out in plain.items()})
    llm = LLM(engine_dirs[KIND], NO_CACHE)
    top = max(llm.verify_widths)
    llm.round_loop.width_control = ModeledCost(sorted(llm.verify_widths), [1, 2, 4, 8], start={8: 1})
    assert generate(llm, PROMPTS) == plain
    assert widths[0] == 1 and llm.round_loop.width_control.choice(len(PROMPTS)) == top
    assert widths.count(top) >= 0.6 * len(widths)   # (the last sequence alone climbs again in bucket 1)


def test_adaptive_width_off_keeps_the_tuned_width(engine_dirs, plain, monkeypatch):
    install_drafter(monkeypatch, "wrong")
    outputs, llm = run(engine_dirs[KIND], PROMPTS, LONG, RuntimeConfig(adaptive_width=False))
    assert outputs == plain and llm.round_loop.width_control is None
    for m in (s.metrics for s in llm.test_sequences):   # 3 a round, but the last three: 2, 1, 0 (the budget)
        assert m.drafted_per_position == [m.rounds - 1, m.rounds - 2, m.rounds - 3]


class Scripted:
    """A stand-in controller: the widths to run, in order (then the widest)."""

    def __init__(self, widths):
        self.widths = list(widths)

    def width(self, batch, constrained=False):
        return self.widths.pop(0) if self.widths else 4

    def observe(self, *args, **kwargs):
        pass

    def hopeless(self, batch, constrained=False):
        return False

    def rejudge(self):
        pass


@pytest.mark.parametrize("mode", ["chained", "reused"])
def test_deferred_catch_up_equals_reanchoring_every_round(engine_dirs, mode):
    """The real heads, drafting off for 11 rounds (the lag passes lag_rows once) then on: each
    step's drafts and hidden are those of a run whose heads re-anchor every round."""
    schedule = [4, 4] + [1] * 11 + [4] * 3 + [1] * 3 + [4] * 10
    traces = []
    for lag_rows in (None, 1):      # one token an off round (bursts: the next test), so the steps pair up
        llm = LLM(engine_dirs[KIND], RuntimeConfig(mtp_mode=mode, decode_burst=1))
        llm.round_loop.width_control = Scripted(schedule)
        if lag_rows:
            llm.round_loop.lag_rows = lag_rows
        seqs = [llm.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in PROMPTS]
        trace = []
        while any(s.finish_reason is None for s in seqs):
            llm.step()
            trace.append([(s.num_generated, s.head_committed, s.draft, s.draft_prob, s.chain_hidden) for s in seqs])
        traces.append((trace, [s.output_ids() for s in seqs]))
    (deferred, out_a), (every, out_b) = traces
    assert out_a == out_b and len(deferred) == len(every)
    synced = 0
    for a, b in zip(deferred, every):
        for (n, hc, d, p, h), (n2, hc2, d2, p2, h2) in zip(a, b):
            assert n == n2
            if hc == hc2:       # rows the deferred run has caught up on: same heads
                synced += 1
                assert d == d2 and p == pytest.approx(p2, rel=1e-4, abs=1e-6)
                np.testing.assert_allclose(h, h2, rtol=1e-4, atol=1e-5)
    assert synced >= len(deferred)
    assert any(hc < hc2 for a, b in zip(deferred, every) for (_, hc, *_), (_, hc2, *_) in zip(a, b))


@pytest.mark.parametrize("mode", ["chained", "reused"])
def test_off_rounds_burst_and_the_heads_catch_up_on_every_token(engine_dirs, mode):
    """Drafting off, a round is a decode burst (several tokens, each call's hidden row kept for the
    heads); the heads' catch-up over those rows leaves them as re-anchoring after every token does:
    wherever the two runs have made the same tokens and their heads committed the same rows, the
    drafts, their probabilities and the chain hidden are equal, and the outputs are."""
    schedule = [4, 4] + [1] * 5 + [4] * 3 + [1] * 3 + [4] * 10
    states, outputs = [], []
    for burst, lag_rows in ((8, None), (1, 1)):
        llm = LLM(engine_dirs[KIND], RuntimeConfig(mtp_mode=mode, decode_burst=burst))
        llm.round_loop.width_control = Scripted(schedule)
        if lag_rows:
            llm.round_loop.lag_rows = lag_rows
        seqs = [llm.add_request(p, SamplingParams(max_tokens=60, ignore_eos=True)) for p in PROMPTS]
        seen = {}
        while any(s.finish_reason is None for s in seqs):
            llm.step()
            for i, s in enumerate(seqs):
                seen[(i, s.num_generated, s.head_committed)] = (s.draft, s.draft_prob, s.chain_hidden)
        states.append(seen)
        outputs.append([s.output_ids() for s in seqs])
        if burst > 1:
            assert llm.round_loop.decode.bursts > 0 and llm.round_loop.decode.calls > 2 * llm.round_loop.decode.bursts
    assert outputs[0] == outputs[1]
    common = states[0].keys() & states[1].keys()
    assert len(common) >= 8
    for key in common:
        (d, p, h), (d2, p2, h2) = states[0][key], states[1][key]
        assert d == d2 and p == pytest.approx(p2, rel=1e-4, abs=1e-6), key
        np.testing.assert_allclose(h, h2, rtol=1e-4, atol=1e-5)


def test_deferred_rows_are_dropped_after_preemption(engine_dirs, plain, monkeypatch):
    """Drafting off under memory pressure: a preempted sequence's kept rows are stale (it is
    prefilled again, heads included) and outputs still equal plain greedy's."""
    install_drafter(monkeypatch, "wrong")
    llm = LLM(engine_dirs[KIND], RuntimeConfig(memory_budget_bytes=230_000, max_num_seqs=8))
    # rounds that could pay: the sequences keep their heads (no verdict of off for good) to the end
    llm.round_loop.width_control = ModeledCost(sorted(llm.verify_widths), [1, 2, 4, 8])
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    seqs, steps = [], 0
    while len(seqs) < 6 or any(s.finish_reason is None for s in seqs):
        if len(seqs) < 6 and steps % 2 == 0:
            seqs.append(llm.add_request(PROMPTS[len(seqs) % 2], params))
        llm.step()
        steps += 1
        for s in seqs:   # the heads plus the rows kept for them cover exactly what the target committed
            if s.status == Status.DECODE:
                kept = llm.round_loop._lagging.get(s, (0, []))[1]
                assert s.head_committed + len(kept) == s.committed
    assert [s.output_ids() for s in seqs] == [plain[i % 2][:40] for i in range(6)]
    assert sum(s.metrics.preemptions for s in seqs) > 0 and all(s.speculative for s in seqs)


def test_a_fixed_k_is_respected(engine_dirs, plain, monkeypatch, widths):
    """A global spec_k (as a request's) fixes the drafts per round: wrong heads still draft k."""
    install_drafter(monkeypatch, "wrong")
    llm = LLM(engine_dirs[KIND], RuntimeConfig(spec_k=3))
    llm.round_loop.width_control = Scripted([1] * 1000)         # a controller that would turn drafting off
    assert generate(llm, PROMPTS) == plain
    for s in llm.test_sequences:   # every token after the first from a verify round: none from drafting off
        m = s.metrics
        # k each round but where the budget leaves fewer: 2, 1, then none (the last token a plain step)
        d = m.drafted_per_position
        assert d == [d[0], d[0] - 1, d[0] - 2] and d[0] == m.rounds and m.rounds + m.accepted + 2 >= len(s.output_ids())


def test_spec_policy_names_the_two_switches(engine_dirs):
    """RuntimeConfig.spec_policy (`tandem serve --spec-policy`): adaptive, fixed (the tuned width, no
    controller), off (no drafting: a request's spec_k is refused, not ignored); contradictions refused."""
    assert LLM(engine_dirs[KIND], RuntimeConfig(spec_policy="adaptive")).round_loop.width_control is not None
    fixed = LLM(engine_dirs[KIND], RuntimeConfig(spec_policy="fixed"))
    assert fixed.round_loop.width_control is None and fixed.config.speculative
    off = LLM(engine_dirs[KIND], RuntimeConfig(spec_policy="off"))
    assert [r.metrics.rounds for r in off.generate(PROMPTS, SamplingParams(max_tokens=8))] == [0, 0]
    with pytest.raises(ValueError, match="spec_k"):
        off.add_request(PROMPTS[0], SamplingParams(max_tokens=8, k=2))
    for bad in (dict(spec_policy="sometimes"), dict(spec_policy="adaptive", adaptive_width=False),
                dict(spec_policy="fixed", speculative=False)):
        with pytest.raises(ValueError, match="spec_policy"):
            RuntimeConfig(**bad)
