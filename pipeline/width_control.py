"""Adaptive verify width: per batch-size bucket, the width that maximises expected tokens per
second, from the acceptance the engine observes and the round times it measures.

Plain Python over numbers the engine hands in (no engines, no runtime imports). The engine asks
`width(batch)` once per speculative round and reports the round back with `observe(...)`.

    expected tokens per sequence at width w      E(w) = 1 + alpha_1 + ... + alpha_{w-1}
        alpha_i = P(at least i drafts accepted | at least i drafted), from decayed counts per
        position (never drafted: alpha_{i-1})
    rate(w) = E(w) / cost(w)                      cost(w): median of the last steady round times at w
                                                  (the least was optimistic by 5-10% for widths whose
                                                  rounds vary more: width 4 won at batch 4 by it)
    width 1 is speculation off (plain decode steps): E(1) = 1

A round's time is its width's cost only when the bucket's round before ran the same width (steady)
and it ran no engine's first call (`cold`: the runtime's first run of a session, 4-11 ms against a
1.3 ms round; kept, the first request of a process turned drafting that pays 1.4x off for its rest):
the first round after a change of width pays for the change (drafts the narrower round did not make
run as extra head calls, another engine's first call), 0.2-0.8 ms on the shipped model against a
1.0-1.3 ms round, and counting it made every probed width look dear, so the bucket kept a narrow
width where the widest paid. A probe runs a second round, a steady sample of its width's cost (the
first samples at a bucket's start include the engines' own first runs: 3.9 ms for a 1.4 ms round
at batch 2 on the shipped model), and where the width has no cost yet `min_samples` rounds after
the first.

Every round ages the counts at every position by `decay`, drafted or not (a decaying history):
what the bucket saw 20-30 rounds ago weighs about a tenth of what it saw last round, and a ratio
keeps its value as it ages. So a probe after a stretch off weighs against faded evidence (a bucket
turned off on a bad stretch takes a good one back within tens of rounds, not hundreds). A draft
position past the choice's whose count has faded below `stale_rows` is stale: where taking it as
good as the position before would make a wider width beat the choice, that width is probed at
once (`_stale_probe`), so a bucket that dropped to a narrow width on one stretch of text (one
request's, at batch 1) looks at the wide widths again within about 20-30 rounds and takes them
where they pay. Probe intervals count decode steps: an off round's burst counts its steps, so
probing costs the same share of the work, drafting or off.

Measured costs can be handed in (`costs`: seconds per round per width and batch size, from
`tandem profile`, runtime_settings.json): a width uses them until it has its own samples, so a
bucket whose rounds cannot pay (a tiny model's: every round costs more plain steps than its width)
starts off and is hopeless from its first round. A width neither measured nor given a cost is
judged optimistically (cost: the largest measured cost of a narrower width, else 0; alpha_i unseen:
alpha_{i-1}), so it is tried once it might beat the best measured one; the verdict from costs
(below) takes it on the line between its measured neighbours. Plain steps cost their least time, so
every off round counts, the first after drafting included, and one off round (a burst) measures
them: a process's first schema request at batch 1 then ends drafting after its third round, before
the heads' catch-up over the off rounds' rows. Every `probe_every` steps
(doubling up to `probe_max` while the choice holds) a probe runs a width next to the choice, above
and below in turn: above, acceptance at the next position is seen again and the width can climb
back; below, that width's cost is measured again. From off, upward probes run width 2 until its
cost is measured (it bounds the wider widths' costs), then the widest and width 2 in turn: the
widest sees every draft position's acceptance again, so a bucket that went off on early, noisy
estimates can find that a wide width pays even where width 2 does not. A bucket the verdict from
costs judged runs no probe: it stands for the process (a width-2 probe, with the heads' catch-up
before it, cost the first schema request at batch 8 a fifth of its time).

Off for good (`hopeless`): drafting off still costs the heads' catch-up (off with the heads kept
current ran 10% slower than plain decoding at batch 1 on the shipped model, 24% at batch 4), so a
bucket stops drafting once it is known not to pay, from costs alone (every width loses even at full
acceptance; a width not measured taken on the line between its measured neighbours, `_between`)
or from what its probes saw (off, and `confirm_probes` probes in a row, the widest among them, none
looked promising: 8, 16 and 32 steps apart). The second verdict holds
`rejudge_rounds` engine rounds, whatever requests come and go (requests one after another are one
workload: probing each anew cost random heads 5% of a 128-token request); then `rejudge` and the
next requests are probed again.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from tandem.pipeline.width_policy import WidthEstimate, WidthPolicy


@dataclass
class _Bucket:
    key: int                             # the batch-size bucket
    choice: int
    drafted: list[float]                 # per draft position, decayed
    accepted: list[float]
    times: dict[int, deque] = field(default_factory=dict)
    given: dict[int, float] = field(default_factory=dict)   # width -> seconds per round, until measured here
    last: int | None = None              # the width of the bucket's last round (its next at it is steady)
    rounds: int = 0
    next_probe: int = 0
    interval: int = 0
    probes: int = 0
    probing: int | None = None           # the width this round probes
    probe_left: int = 0                  # rounds the probe runs after this one (measuring its cost)
    probed: set[int] = field(default_factory=set)   # widths probed since the choice last changed
    quiet: int = 0                       # probes from off in a row none of which looked promising
    last_probe: int = 0                  # (off: the widest and width 2 alternate)
    opening: bool = True                 # the first choice, held until measured (cleared at a change)


class WidthController:
    """widths: the verify widths rounds may use, 1 (off) included; start: the tuned width per
    batch size (manifest / `tandem profile`), else the widest; costs: measured seconds per round,
    {batch size: {width: seconds}} (width 1: one plain step), used where a bucket has no samples of
    its own yet (a bucket takes the costs of the smallest batch size >= it, as `start`);
    constrained_costs: the same for rounds under a grammar (multi-call rounds, plain steps with
    their masks), which are never given the free rounds' (2.7x cheaper on the shipped model)."""

    def __init__(self, widths: list[int], batch_sizes: list[int], start: dict[int, int] | None = None,
                 policy: WidthPolicy | None = None, costs: dict[int, dict[int, float]] | None = None,
                 constrained_costs: dict[int, dict[int, float]] | None = None):
        self.widths = sorted(set(widths) | {1})
        self.batch_sizes = sorted(batch_sizes)
        if not self.batch_sizes:
            raise ValueError("WidthController needs at least one batch size")
        self.policy = policy or WidthPolicy()
        self.start = dict(sorted((start or {}).items()))
        self.costs = dict(sorted((costs or {}).items()))
        self.constrained_costs = dict(sorted((constrained_costs or {}).items()))
        self._buckets: dict[tuple[int, bool], _Bucket] = {}   # (bucket, constrained) -> its state

    def bucket(self, batch: int) -> int:
        return next((b for b in self.batch_sizes if b >= batch), self.batch_sizes[-1])

    def _state(self, batch: int, constrained: bool = False) -> _Bucket:
        """A bucket's state; rounds with grammar requests (`constrained`: multi-call rounds, drafts under
        masks) keep their own, apart from free rounds: their costs and acceptance differ, and a verdict
        of off on one kind said nothing of the other (a schema's rounds turned speculation off for the
        free requests after them)."""
        b = self.bucket(batch)
        st = self._buckets.get((b, constrained))
        if st is None:
            # the tuned width of the smallest tuned batch size >= b, else of the largest (as round_k reads it)
            tuned = _for_bucket(self.start, b)
            choice = tuned if tuned in self.widths else self.widths[-1]
            n = self.widths[-1] - 1
            costs = self.constrained_costs if constrained else self.costs
            given = {w: s for w, s in (_for_bucket(costs, b) or {}).items() if w in self.widths and s > 0}
            st = self._buckets[b, constrained] = _Bucket(b, choice, [0.0] * n, [0.0] * n, given=given,
                                            interval=self.policy.probe_every)
            st.next_probe = st.interval
            if given:
                st.choice = self._best(st, hold=False)
        return st

    # ---- the round's width -------------------------------------------------------------
    def width(self, batch: int, constrained: bool = False) -> int:
        """The verify width for this round at `batch` sequences (1: plain decode steps)."""
        st = self._state(batch, constrained)
        st.rounds += 1
        if st.probe_left:             # a probe measuring its width's cost: its rounds run back to back
            st.probe_left -= 1
            return st.probing
        best = self._best(st)
        if best != st.choice:
            st.choice, st.interval, st.opening = best, self.policy.probe_every, False
            st.next_probe = st.rounds + st.interval
            st.probed, st.quiet = set(), 0
        if not self._costed(st, st.choice):     # the choice is measured before anything is probed
            return st.choice
        if st.choice == 1 and self._rounds_lose(st):
            return 1        # the verdict from costs stands for the process: nothing a probe sees changes it
        stale = self._stale_probe(st)
        if stale is not None:
            st.probing = stale
        elif st.rounds >= st.next_probe:
            st.interval = min(2 * st.interval, self.policy.probe_max)
            st.next_probe = st.rounds + st.interval
            st.probes += 1
            above = [w for w in self.widths if w > st.choice]
            below = [w for w in self.widths if w < st.choice]
            if above and not below:     # off: width 2 until measured, then the widest and width 2 in turn
                measured = len(st.times.get(above[0], ())) >= self.policy.min_samples
                st.probing = above[-1] if measured and st.last_probe != above[-1] else above[0]
            elif above and st.probes % 2:
                st.probing = above[0]
            elif below:
                st.probing = below[-1]
        if st.probing is None:
            return st.choice
        st.probed.add(st.probing)
        st.last_probe = st.probing
        st.quiet += st.choice == 1      # (_promising sets it back to 0)
        # its first round pays for the change of width: the rounds after it are its cost (a width's
        # first samples, at a bucket's start, include the engine's own first runs)
        st.probe_left = 1 if self._costed(st, st.probing) else self.policy.min_samples
        return st.probing

    def _stale_probe(self, st: _Bucket) -> int | None:
        """While drafting: the width to probe now because a draft position past the choice's went stale
        (its aged count below `stale_rows`: not drafted for tens of rounds) and, taken as good as the
        position before, it would make that width beat the choice; None where none would. Stale
        evidence is looked at again, not assumed good: assuming it kept a batch-4 bucket switching to
        width 4 every 20 rounds, where width 4 loses."""
        if st.choice < 2:
            return None
        stale = {i: None for i in range(st.choice - 1, len(st.drafted)) if st.drafted[i] < self.policy.stale_rows}
        if not stale:
            return None
        rates = {e.width: e.rate for e in self._estimates(st, stale)}
        best = max((w for w in self.widths if w > st.choice), key=lambda w: (rates[w], -w), default=None)
        return best if best is not None and rates[best] > rates[st.choice] else None

    def observe(self, batch: int, width: int, seconds: float | None, drafted: list[int],
                accepted: list[int], constrained: bool = False, steps: int = 1, cold: bool = False) -> None:
        """One round at `batch` sequences: per sequence its drafts and how many were accepted;
        `seconds` the round's wall time at `width` per step (None: not attributable to one width);
        `steps` the decode steps it took (an off round's burst: several), which the probes' intervals
        count: probing then costs the same share of the work, drafting or off. `cold`: the round ran
        an engine's first call (the runtime's first run of a session, several times a round's time):
        a drafting width does not keep its time, and the round after it is steady."""
        st = self._state(batch, constrained)
        st.rounds += steps - 1
        if st.probing is not None and st.probing == width > st.choice:
            self._promising(st, width, drafted, accepted)
        if not st.probe_left:
            st.probing = None
        for i in range(len(st.drafted)):   # every round ages every position, drafted or not
            st.drafted[i] *= self.policy.decay
            st.accepted[i] *= self.policy.decay
        for d, a in zip(drafted, accepted):
            for i in range(min(d, len(st.drafted))):
                st.drafted[i] += 1
                st.accepted[i] += i < a
        # a round's time counts after a round at the same width (a change costs its first round more);
        # a round of several widths (seconds None: requests with their own k, a budget's end) ends the run
        # Plain steps cost their least time, which a change does not lower: every off round counts
        # (their bursts are long, and waiting for two steady ones spent half of a 64-token first
        # request off), but not a cold one: one sample measures them, and an engine's first step
        # (1.95 ms against 0.8-1.0 on the shipped model) took the place of the profile's cost
        steady, st.last = st.last == width, width if seconds is not None else None
        if seconds is not None and (steady or width == 1) and not cold:
            st.times.setdefault(width, deque(maxlen=self.policy.samples)).append(seconds)

    def _costed(self, st: _Bucket, width: int) -> bool:
        """Whether the bucket has a cost for `width`: its own steady samples, or a given one."""
        return self._measured(st, width) or width in st.given

    def _measured(self, st: _Bucket, width: int) -> bool:
        """Whether the bucket has its own samples of `width`: min_samples of them; one off round for plain
        steps (a burst of them, and their least time counts, which a later round only lowers)."""
        return len(st.times.get(width, ())) >= (1 if width == 1 else self.policy.min_samples)

    def _promising(self, st: _Bucket, width: int, drafted: list[int], accepted: list[int]) -> None:
        """An upward probe is followed by another soon (no back-off) when its acceptance at the
        positions the choice does not draft would make its width, or one between it and the choice,
        beat the choice, or when it saw a position never drafted before accepted: old evidence of a
        bad position fades only where it is drafted. A probe that merely saw more than the estimate
        (half of them do, by chance, when acceptance holds still) backs off as usual: resetting on
        those kept a batch-8 int4 bucket probing every 8-9 rounds for long stretches."""
        seen, better = {}, False
        for i in range(max(0, st.choice - 1), width - 1):
            n = sum(d > i for d in drafted)
            hits = sum(a > i for d, a in zip(drafted, accepted) if d > i)
            if not n:
                continue
            if st.drafted[i] <= 1e-9:
                if hits:
                    break           # accepted where never drafted before: look again soon
                continue
            seen[i] = hits / n
            better |= seen[i] > st.accepted[i] / st.drafted[i]
        else:                       # (no break: judge what the probe saw)
            if not better:
                return
            rates = {e.width: e.rate for e in self._estimates(st, seen)}
            if max(rates[w] for w in self.widths if st.choice < w <= width) <= rates[st.choice]:
                return
        st.interval, st.quiet = self.policy.probe_every, 0
        st.next_probe = st.rounds + st.interval

    # ---- the estimates -----------------------------------------------------------------
    def acceptance(self, batch: int, constrained: bool = False) -> list[float | None]:
        """alpha_i per draft position (None: never drafted there)."""
        st = self._state(batch, constrained)
        return [a / d if d > 1e-9 else None for a, d in zip(st.accepted, st.drafted)]

    def estimates(self, batch: int, constrained: bool = False) -> list[WidthEstimate]:
        return self._estimates(self._state(batch, constrained))

    def _estimates(self, st: _Bucket, seen: dict[int, float | None] | None = None,
                   least: bool = False) -> list[WidthEstimate]:
        """seen: acceptance per position to take instead of the bucket's (a probe's, to judge it; None:
        as if never drafted). least: every width's cost its least round time (the verdict from costs,
        which stands for the process: a bucket's first rounds, beside engines still opening, ran 2-3x
        their time, and their median made rounds that pay 1.4x look hopeless)."""
        alpha, prev = [], 1.0
        for i, (a, d) in enumerate(zip(st.accepted, st.drafted)):
            # aged counts keep their ratio; never drafted (or taken as such): as good as the position before
            est = (seen or {}).get(i, a / d if d > 0.0 else None)
            prev = prev if est is None else min(est, prev)
            alpha.append(prev)
        costs = {}
        for w in self.widths:
            times = st.times.get(w, ())
            # (an off round's time per step falls with its burst's length: its least is a full burst's)
            typical = min if w == 1 or least else statistics.median
            costs[w] = typical(times) if self._measured(st, w) else st.given.get(w)
        out, floor = [], 0.0
        for w in self.widths:
            expected, cost = 1.0 + sum(alpha[: w - 1]), costs[w]
            if cost is not None:
                floor = max(floor, cost)
            # a width not measured: the choice takes the floor (optimistic: it is tried where it might
            # win); the verdict the line between its measured neighbours (_between)
            bound = cost if cost is not None else _between(costs, w, floor) if least else floor
            out.append(WidthEstimate(w, expected, cost, bound, expected / bound if bound > 0 else float("inf")))
        return out

    def _best(self, st: _Bucket, hold: bool = True) -> int:
        """The start width until it is measured (`hold`: given a cost too, as a request's first round
        is the bucket's only acceptance: its first draft, after the prompt, missed more often than not,
        and one round with none accepted turned a profiled bucket off, its first request 0.69-0.78x
        plain); then the best rate (ties: the narrower width), where drafting beats plain steps by min_gain."""
        if not self._costed(st, st.choice) or hold and st.opening and not self._measured(st, st.choice):
            return st.choice
        est = self._estimates(st)
        best = max(est, key=lambda e: (e.rate, -e.width))
        # the heads cost outside the rounds too (their pass over each prompt, a request's first round):
        # drafting that only ties with plain steps in rounds loses over whole requests
        if best.rate <= est[0].rate * (1 + self.policy.min_gain):
            return 1
        # a width not measured is chosen on hope (the floor); where the verdict from costs (the line)
        # says no width can pay, it is not worth trying. (A measured width that beats plain steps
        # cannot be judged so: its least time is at most its median.)
        return 1 if best.cost is None and self._rounds_lose(st) else best.width

    def choice(self, batch: int, constrained: bool = False) -> int:
        """The width the bucket runs between probes."""
        return self._state(batch, constrained).choice

    def rejudge(self) -> None:
        """Forget what the probes of off buckets confirmed (the engine calls this `rejudge_rounds`
        rounds after the verdict): acceptance is the workload's, which may have changed, so the next
        requests are probed again. A verdict from costs alone stands."""
        for st in self._buckets.values():
            if st.choice == 1:      # (a probe already due sooner keeps its round)
                st.probed, st.interval, st.quiet = set(), self.policy.probe_every, 0
                st.next_probe = min(st.next_probe, st.rounds + st.interval)

    def hopeless(self, batch: int, constrained: bool = False) -> bool:
        """Whether drafting is known not to pay at this batch size: the bucket off, plain steps
        measured, and either
        - every width w >= 2 costs at least w of them per round (its least round time; a width not
          measured, on the line between its measured neighbours), so it loses even with every draft
          accepted (a tiny model's rounds, per-call overhead; a compute-bound batch's; a schema's
          multi-call rounds), or
        - its probes confirmed off: the last `confirm_probes` probes (the widest among those since the
          choice last changed: every draft position seen) looked unpromising, so the acceptance
          they saw does not pay for the rounds' cost (random or mismatched heads; rounds nearly as
          dear as their width in plain steps).
        The engine then stops drafting for the bucket's sequences for good, and stops keeping their
        heads current (their catch-up, and their pass over each new prompt), so the verdict comes
        after three probes, not when they have backed off to probe_max."""
        st = self._state(batch, constrained)
        if st.choice != 1:
            return False
        confirmed = st.quiet >= self.policy.confirm_probes and self.widths[-1] in st.probed
        return (confirmed and self._costed(st, 1)) or self._rounds_lose(st)

    def _rounds_lose(self, st: _Bucket) -> bool:
        """Plain steps measured and every width w >= 2 costing at least w of them per round (its least
        round time; a width not measured, on the line between its measured neighbours), less the gain
        `_best` asks of drafting: even with every draft accepted no width would be chosen."""
        est = self._estimates(st, least=True)
        plain = est[0].cost
        return plain is not None and all(e.bound * (1 + self.policy.min_gain) >= e.width * plain for e in est[1:])


def _between(costs: dict[int, float | None], width: int, floor: float) -> float:
    """A width not measured, for the verdict: on the line between the nearest measured widths below
    and above it (plain steps are width 1), else `floor` (the largest cost below: rounds only grow
    with width). A round's parts, the verify's rows and the heads' passes, grow with the width about
    linearly or less, so the line is at or under its cost. Only the floor, a schema's bucket had to
    measure every width before its verdict: width 4 at 7.4 ms against 0.94 ms a plain token, then
    widths 3 and 2 in turn as the choice, their rounds losing its second request (0.66-0.70x plain)."""
    below = max((w for w, t in costs.items() if w < width and t is not None), default=None)
    above = min((w for w, t in costs.items() if w > width and t is not None), default=None)
    if below is None or above is None:
        return floor
    return costs[below] + (costs[above] - costs[below]) * (width - below) / (above - below)


def _for_bucket(per_batch: dict, bucket: int):
    """The value of the smallest batch size >= bucket, else of the largest (None: none given)."""
    if not per_batch:
        return None
    return next((v for bs, v in per_batch.items() if bs >= bucket), per_batch[max(per_batch)])
