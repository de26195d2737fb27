"""The adaptive width's controller alone (pipeline/width_control.py): its choices, probes and
verdicts with synthetic round costs and acceptance (milliseconds, no engines). The engine's side is
tests/pipeline/test_adaptive_width.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tandem.pipeline.width_control import WidthController, WidthPolicy

COST = {1: 1.0, 2: 1.3, 3: 1.6, 4: 1.9}     # ms per round at each width: a plain step, then drafting
# every round dearer than its width in plain steps (width 3, never measured from off, is bounded by
# width 2's 3.1): the shipped model's rounds cost 3.4-3.9 steps at width 2
DEAR = {1: 1.0, 2: 3.1, 3: 3.6, 4: 4.3}


def simulate(ctl: WidthController, rounds: int, accepted_at, batch: int = 1, cost=COST) -> list[int]:
    """Run `rounds` rounds; accepted_at(round, drafts) -> accepted count per sequence."""
    widths = []
    for r in range(rounds):
        w = ctl.width(batch)
        widths.append(w)
        per_seq = accepted_at(r, w - 1)
        ctl.observe(batch, w, cost[w], [w - 1] * len(per_seq), per_seq)
    return widths


def runs_of(widths: list[int]) -> list[tuple[int, int, int]]:
    """(first round, width, rounds) per run of one width."""
    out, i = [], 0
    for w, rounds in itertools.groupby(widths):
        n = len(list(rounds))
        out.append((i, w, n))
        i += n
    return out


def test_never_accepted_turns_drafting_off_then_probes_with_growing_gaps():
    ctl = WidthController([2, 3, 4], [1, 8])
    widths = simulate(ctl, 300, lambda r, d: [0])
    assert widths[:3] == [4, 4, 4]       # the start (no tuned settings: the widest) until measured
    off_from = widths.index(1)
    assert off_from == 3 and ctl.choice(1) == 1
    # probes (first round, width, rounds): from off, width 2 until its cost is measured (three rounds
    # back to back: the first after a change of width is not its cost), then the widest (every draft
    # position seen again; measured at the start) and width 2 in turn, two rounds each (the second
    # a steady sample of the width's cost)
    probes = [(i, w, n) for i, w, n in runs_of(widths) if i > off_from and w > 1]
    assert [(w, n) for _, w, n in probes][:5] == [(2, 3), (4, 2), (2, 2), (4, 2), (2, 2)]
    gaps = np.diff([i for i, _, _ in probes])
    assert list(gaps) == sorted(gaps) and gaps[-1] == ctl.policy.probe_max
    assert widths.count(1) >= 0.95 * len(widths)


def test_probes_that_keep_confirming_off_make_the_bucket_hopeless():
    # rounds that would pay at full acceptance (width 2 at 1.3 plain steps), heads never right: off
    # for good once three probes in a row, the widest among them, looked unpromising, not before
    verdicts = []
    ctl = WidthController([2, 3, 4], [1])
    for _ in range(200):
        w = ctl.width(1)
        ctl.observe(1, w, COST[w], [w - 1], [0])
        verdicts.append(ctl.hopeless(1))
    first = verdicts.index(True)
    # probes from off 8, 16 and 32 rounds apart, after the start width and the narrower ones are measured
    assert all(verdicts[first:]) and 8 + 16 + 32 <= first < 8 + 16 + 32 + 64
    st = ctl._state(1)
    assert 4 in st.probed and st.quiet >= ctl.policy.confirm_probes
    # the engine ran empty: the verdict is dropped, and the next probe comes no later than it would have
    due = st.next_probe
    ctl.rejudge()
    assert not ctl.hopeless(1) and st.next_probe == min(due, st.rounds + ctl.policy.probe_every)
    ctl2 = WidthController([2, 3, 4], [1])
    simulate(ctl2, 6, lambda r, d: [0])          # off after the start width, its first probe 8 rounds later
    due = ctl2._state(1).next_probe
    ctl2.rejudge()
    assert ctl2._state(1).next_probe == due
    # rounds as dear with drafts that pay (alpha = 1, 0.8, 0.6: width 4 makes 3.4 tokens in 2.5 steps)
    ctl = WidthController([2, 3, 4], [1])
    simulate(ctl, 200, lambda r, d: [min(d, [1, 2, 3, 3, 3][r % 5])], cost={1: 1.0, 2: 1.9, 3: 2.2, 4: 2.5})
    assert not ctl.hopeless(1) and ctl.choice(1) == 4


@pytest.mark.parametrize("seed", range(8))
def test_a_bucket_off_on_early_evidence_climbs_to_the_width_that_pays(seed):
    # 8 sequences; the first rounds see nothing accepted at every position (a noisy start), then each
    # draft is accepted with probability 0.8: width 2 still loses (1.8 tokens for 1.9 steps), width 4
    # gains (2.95 tokens for 2.5). Probes from off that only tried width 2 never saw positions 2 and 3
    # again, so the bucket stayed off; a probe judged by its own width only (not the widths below it)
    # was not promising when width 3 would have paid, and the bucket was judged off for good. (Seed 4
    # climbs late, after about 600 rounds, its probes having seen little by chance; the others within
    # 80-210.)
    rng = np.random.default_rng(seed)

    def accepted(r, d):
        return [0 if r < 20 else int(np.argmin(np.append(rng.random(d) < 0.8, False))) for _ in range(8)]
    ctl = WidthController([2, 3, 4], [8])
    cost = {1: 1.0, 2: 1.9, 3: 2.2, 4: 2.5}
    widths, verdicts = [], []
    for r in range(800):
        widths.append(ctl.width(8))
        ctl.observe(8, widths[-1], cost[widths[-1]], [widths[-1] - 1] * 8, accepted(r, widths[-1] - 1))
        verdicts.append(ctl.hopeless(8))
    assert widths[5:20].count(1) >= 12                 # off after the start width's noisy rounds (a probe of
                                                       # width 2: three rounds, measuring its cost)
    assert ctl.choice(8) == 4 and widths[-100:].count(4) >= 95
    assert not any(verdicts)                           # never judged off for good on the way


def test_always_accepted_climbs_from_off_to_the_widest():
    ctl = WidthController([2, 3, 4], [1], start={1: 1})
    widths = simulate(ctl, 60, lambda r, d: [d])
    assert widths[0] == 1 and ctl.choice(1) == 4
    assert widths[-20:].count(4) >= 19                # a probe below now and then


def test_picks_the_width_with_the_most_tokens_per_second():
    # 20 sequences: 12 accept >= 1 draft, 2 accept >= 2, 1 accepts 3 (alpha = 0.6, 0.1, 0.05):
    # tokens/ms at widths 1..4 = 1/1, 1.6/1.3, 1.7/1.6, 1.75/1.9: width 2
    def accepted(r, d):
        return [min(d, a) for a in [0] * 8 + [1] * 10 + [2] + [3]]
    ctl = WidthController([2, 3, 4], [32])
    simulate(ctl, 40, accepted, batch=20)
    assert ctl.choice(20) == 2
    rates = {e.width: e.rate for e in ctl.estimates(20)}
    assert max(rates, key=rates.get) == 2
    # the same acceptance on rounds four times as dear as a plain step: off
    ctl = WidthController([2, 3, 4], [32])
    simulate(ctl, 40, accepted, batch=20, cost={1: 1.0, 2: 4.0, 3: 4.3, 4: 4.6})
    assert ctl.choice(20) == 1


def test_climbs_back_when_acceptance_rises():
    ctl = WidthController([2, 3, 4], [1])
    widths = simulate(ctl, 400, lambda r, d: [0] if r < 100 else [d])
    assert widths[50:100].count(1) >= 48               # off while nothing is accepted (a probe or two)
    assert ctl.choice(1) == 4 and widths[-50:].count(4) >= 48


@pytest.mark.parametrize("bad", [60, 300, 2000])
def test_a_good_stretch_gets_the_widest_width_within_the_probe_bound(bad):
    # however long the bad stretch, and wherever the good one starts between two probes, the widest
    # width runs steadily within probe_max + 3 rounds: the next probe sees the good acceptance,
    # which outweighs the faded evidence of the bad stretch
    for offset in range(0, 130, 9):
        ctl = WidthController([2, 3, 4], [1])
        start = bad + offset
        widths = simulate(ctl, start + 200, lambda r, d, start=start: [0] if r < start else [d])
        climbed = next(i for i in range(start, len(widths)) if widths[i:i + 4] == [4] * 4)
        assert climbed - start <= ctl.policy.probe_max + 3, (bad, offset)


# the shipped model's rounds at batch 1 (ms): steady, and the first round after a change of width
STEADY = {1: 0.66, 2: 0.95, 3: 1.18, 4: 1.25}
CHANGE = 0.6


def run_switching(ctl: WidthController, rounds: int, accepted_at) -> list[int]:
    """Like simulate, with a round's time its width's steady cost plus CHANGE after a change of width
    (the drafts a narrower round did not make run as extra head calls, another engine's first call)."""
    widths = []
    for r in range(rounds):
        w = ctl.width(1)
        seconds = STEADY[w] + (CHANGE if widths and widths[-1] != w else 0.0)
        widths.append(w)
        ctl.observe(1, w, seconds, [w - 1], accepted_at(r, w - 1))
    return widths


def test_a_change_of_width_is_not_the_new_widths_cost():
    # every draft accepted with probability 0.8 (E = 1.8, 2.44, 2.95): tokens/ms 1.89, 2.07, 2.36 at
    # widths 2-4 in steady rounds. Starting at width 2, the probes above pay for the change; counted as
    # their width's cost (1.78, 1.85 ms) they made width 2 look best for good
    rng = np.random.default_rng(0)
    ctl = WidthController([2, 3, 4], [1], start={1: 2})
    widths = run_switching(ctl, 400, lambda r, d: [int(np.argmin(np.append(rng.random(d) < 0.8, False)))])
    assert ctl.choice(1) == 4 and widths[-100:].count(4) >= 95
    cost = {e.width: e.cost for e in ctl.estimates(1)}
    assert cost[4] == STEADY[4] and cost[2] == STEADY[2]
    # a probe of a width with no steady cost runs until it has one: back to back, the first not kept
    ctl = WidthController([2, 3, 4], [1])
    widths = run_switching(ctl, 40, lambda r, d: [0])
    first = next(i for i, w in enumerate(widths) if i > 3 and w > 1)
    assert widths[:3] == [4] * 3 and widths[first - 1:first + 4] == [1, 2, 2, 2, 1]


def test_deep_positions_no_longer_drafted_are_tried_again():
    # one request rejects every second draft (the second head wrong on its text): width 2 is best
    # (2 tokens in 0.95 ms against 2 in 1.25); the next accepts every draft. Evidence of the second
    # position fades every round, drafted or not; once stale it is probed at the widest width it
    # could make win (every 20-30 rounds), so the bucket climbs soon after the good request starts,
    # where probes one width up alone kept it at width 2 for good
    ctl = WidthController([2, 3, 4], [1])
    widths = run_switching(ctl, 200, lambda r, d: [min(d, 1) if r < 100 else d])
    assert widths[60:100].count(2) >= 32
    climbed = next(i for i in range(100, 200) if widths[i:i + 4] == [4] * 4)
    assert climbed - 100 <= 40 and widths[-50:].count(4) >= 48


def test_first_round_at_a_width_is_not_its_cost_and_buckets_are_separate():
    ctl = WidthController([2, 3, 4], [1, 8], start={1: 2, 8: 4})
    assert ctl.width(1) == 2 and ctl.width(5) == 4        # 5 sequences run at the 8 bucket's tuned width
    ctl.observe(1, 2, 50.0, [1], [1])                      # building the bindings: not a round's cost
    ctl.observe(1, 2, 1.4, [1], [1])
    assert next(e for e in ctl.estimates(1) if e.width == 2).cost is None     # one kept time: not yet
    ctl.observe(1, 2, 1.3, [1], [1])
    assert next(e for e in ctl.estimates(1) if e.width == 2).cost == pytest.approx(1.35)     # the median
    assert ctl.acceptance(1)[:2] == [1.0, None] and ctl.acceptance(8) == [None] * 3
    # a change of width and back: neither round is its width's cost (both paid for the change)
    ctl.observe(1, 3, 5.0, [2], [2])
    ctl.observe(1, 3, 1.6, [2], [2])
    ctl.observe(1, 2, 0.9, [1], [1])
    costs = {e.width: e.cost for e in ctl.estimates(1)}
    assert costs[2] == pytest.approx(1.35) and costs[3] is None and list(ctl._state(1).times[3]) == [1.6]
    # a round of several widths (a request with its own k) ends the run: the round after it is not kept
    ctl.observe(1, 2, 1.2, [1], [1])
    ctl.observe(1, 2, None, [1, 3], [1, 3])
    ctl.observe(1, 2, 0.5, [1], [1])
    assert list(ctl._state(1).times[2]) == [1.4, 1.3, 1.2]
    assert all(e.cost is None for e in ctl.estimates(8))


def test_an_engine_s_first_run_is_not_its_width_s_cost_and_plain_counts_every_burst():
    # the first request of a process: width 4's first round ran its engine's first call (9.3 ms
    # against 1.3); kept, its median made drafting that pays look dear. The round after a cold one is
    # steady. Plain steps cost their least time, so every off round counts, the first after drafting too
    ctl = WidthController([2, 3, 4], [1])
    for seconds, cold in ((12.0, True), (9.3, True), (1.4, False), (1.3, False)):
        ctl.observe(1, 4, seconds, [3], [3], cold=cold)
    assert list(ctl._state(1).times[4]) == [1.4, 1.3]
    ctl.observe(1, 1, 0.9, [], [], steps=12, cold=True)
    ctl.observe(1, 1, 0.7, [], [], steps=16)
    costs = {e.width: e.cost for e in ctl.estimates(1)}
    assert costs[1] == 0.7 and costs[4] == pytest.approx(1.35)


def test_a_drafting_width_costs_its_median_round_and_plain_its_fullest_burst():
    # a drafting round's typical time: one lucky round (less host work that time) does not make
    # width 2 look cheap; an off round's per-step time falls with its burst's length (a request's
    # last burst is short), so plain steps cost what the fullest burst's steps did
    ctl = WidthController([2, 3, 4], [1], start={1: 2})
    for seconds in (9.0, 1.5, 1.0, 1.5):                   # (the first: the bucket's first round)
        ctl.observe(1, 2, seconds, [1], [1])
    for seconds in (9.0, 0.6, 0.9, 0.8):
        ctl.observe(1, 1, seconds, [], [])
    costs = {e.width: e.cost for e in ctl.estimates(1)}
    assert costs[2] == 1.5 and costs[1] == 0.6


def test_drafting_must_beat_plain_steps_by_the_margin():
    # every draft accepted: width 2 makes 2 tokens a round. At 1.95 plain steps a round it is 2.6%
    # faster in rounds, which the heads' work outside them (each prompt, a first round) eats: plain
    for cost, chosen in ((1.95, 1), (1.8, 2)):
        ctl = WidthController([2], [1], start={1: 2})
        simulate(ctl, 12, lambda r, d: [d], cost={1: 1.0, 2: cost})
        assert ctl.choice(1) == chosen, cost


def test_a_bucket_s_first_slow_rounds_do_not_make_it_hopeless():
    # the shipped model's first request in a process (engines still opening beside it): each width's
    # first steady rounds ran 2-3x their time. Their median makes every width cost at least its width
    # in plain steps; the verdict from costs stands for the process, so it takes each width's least
    ctl = WidthController([2, 3, 4], [1])
    for width, seconds in ((4, 6.9), (4, 3.9), (4, 2.1), (1, 0.76), (1, 0.74), (1, 0.76),
                           (3, 6.0), (3, 1.9), (3, 4.0), (2, 4.7), (2, 1.6), (2, 3.1)):
        ctl.observe(1, width, seconds, [width - 1], [width - 1])
    st = ctl._state(1)
    st.choice = 1
    assert {e.width: e.cost for e in ctl.estimates(1)} == {1: 0.74, 2: 2.35, 3: 2.95, 4: 3.0}
    assert not ctl.hopeless(1)


def test_policy_refuses_nonsense():
    with pytest.raises(ValueError, match="probe_every"):
        WidthPolicy(probe_every=0)
    with pytest.raises(ValueError, match="min_samples"):
        WidthPolicy(min_samples=9)
    with pytest.raises(ValueError, match="decay"):
        WidthPolicy(decay=0.0)
    with pytest.raises(ValueError, match="batch size"):
        WidthController([2], [])


def test_hopeless_needs_every_width_to_lose_at_full_acceptance():
    # width 2 at 1.9 steps could pay, and width 3 at 2.8 where measured (the probes' verdict kept out of
    # it); a width not measured is taken on the line between its measured neighbours: width 3 between
    # 2.5 and 4.3 at 3.4, width 2 between 1 and 4.3 at 2.1 (a round's cost grows with its width linearly
    # or less: the line is at or under it), and the bucket's rounds are judged by it, without a probe
    costs_only = WidthPolicy(confirm_probes=1000)
    cheap_3 = {**DEAR, 2: 2.5, 3: 2.8}
    for cost, start, hopeless in ((DEAR, 4, True), ({**DEAR, 2: 1.9}, 2, False), ({**DEAR, 2: 1.9}, 4, True),
                                  (cheap_3, 3, False), (cheap_3, 4, True)):
        ctl = WidthController([2, 3, 4], [1], start={1: start}, policy=costs_only)
        widths = simulate(ctl, 100, lambda r, d: [0], cost=cost)
        assert ctl.choice(1) == 1 and ctl.hopeless(1) == hopeless, (cost, start)
        assert (len(ctl._state(1).times.get(3, ())) > 0) == (start == 3)
        if hopeless:        # judged from the rounds the start ran and one off round: nothing probed after
            assert widths[widths.index(1):] == [1] * (100 - widths.index(1)), (cost, start)


def test_a_schema_s_dear_widest_rounds_judge_the_widths_between_at_once():
    # the shipped model's multi-call rounds under a JSON schema: width 4 at 7.4 ms against 0.94 ms a
    # constrained plain token; widths 2 and 3 not measured are judged on the line (3.1 and 5.3 ms), so
    # the verdict comes from the widest's rounds; at the floor (0.94 ms) they were each chosen and
    # measured in turn, losing the process's second schema request
    ctl = WidthController([2, 3, 4], [1])
    for width, seconds in ((4, 8.5), (4, 7.8), (4, 7.4), (1, 1.02), (1, 0.94)):
        ctl.observe(1, width, seconds, [width - 1], [width - 1], constrained=True)
    assert ctl.width(1, constrained=True) == 1 and ctl.hopeless(1, constrained=True)
    bounds = {e.width: e.bound for e in ctl._estimates(ctl._state(1, True), least=True)}
    step = (7.4 - 0.94) / 3
    assert bounds[2] == pytest.approx(0.94 + step) and bounds[3] == pytest.approx(0.94 + 2 * step)
    # before plain steps are measured nothing is judged; one off round measures them (a burst's least time)
    ctl = WidthController([2, 3, 4], [1])
    assert simulate(ctl, 3, lambda r, d: [0], cost=DEAR) == [4, 4, 4]
    assert not ctl.hopeless(1)
    simulate(ctl, 1, lambda r, d: [0], cost=DEAR)
    assert ctl._costed(ctl._state(1), 1) and ctl.hopeless(1)
