"""Adaptive verify width: per batch-size bucket, the width that maximises expected tokens per
second, from the acceptance the engine observes and the round times it measures.

Plain Python over numbers the engine hands in (no engines, no runtime imports). The engine asks
`width(batch)` once per speculative round and reports the round back with `observe(...)`.

    expected tokens per sequence at width w      E(w) = 1 + alpha_1 + ... + alpha_{w-1}
        alpha_i = P(at least i drafts accepted | at least i drafted), from decayed counts per
        position; past the first, blended with `prior_weight` rows' worth of the position before's
        alpha (the prior)
    rate(w) = E(w) / cost(w)                      cost(w): least of the last steady round times at w
                                                  (interference only ever adds time)
    width 1 is speculation off (plain decode steps): E(1) = 1

A round's time is its width's cost only when the bucket's round before ran the same width (steady):
the first round after a change of width pays for the change (drafts the narrower round did not make
run as extra head calls, another engine's first call), 0.2-0.8 ms on the shipped model against a
1.0-1.3 ms round, and counting it made every probed width look dear, so the bucket kept a narrow
width where the widest paid. A probe of a width with no steady cost yet runs `min_samples` rounds
more to measure it.

Every round ages the counts at every position by `decay`, drafted or not (a decaying history):
what the bucket saw 20-30 rounds ago weighs about a tenth of what it saw last round. So a probe
after a stretch off weighs against faded evidence (a bucket turned off on a bad stretch takes a
good one back within tens of rounds, not hundreds), and a deep position no longer drafted fades
toward its prior (as good as the position before): a bucket that dropped to a narrow width on one
stretch of text (one request's, at batch 1) tries the wider widths again within about as many
rounds and keeps them where they pay. Position 1 has no prior: its counts alone (unseen: 1).

Measured costs can be handed in (`costs`: seconds per round per width and batch size, from
`tandem profile`, runtime_settings.json): a width uses them until it has its own samples, so a
bucket whose rounds cannot pay (a tiny model's: every round costs more plain steps than its width)
starts off and is hopeless from its first round. A width neither measured nor given a cost is
judged optimistically (cost: the largest measured cost of a narrower width, else 0; alpha_i unseen:
alpha_{i-1}), so it is tried once it might beat the best measured one. Every `probe_every` rounds
(doubling up to `probe_max` while the choice holds) one round runs a width next to the choice, above
and below in turn: above, acceptance at the next position is seen again and the width can climb
back; below, that width's cost is measured again. From off, upward probes run width 2 until its
cost is measured (it bounds the wider widths' costs), then the widest and width 2 in turn: the
widest sees every draft position's acceptance again, so a bucket that went off on early, noisy
estimates can find that a wide width pays even where width 2 does not.

Off for good (`hopeless`): drafting off still costs the heads' catch-up, so a bucket stops drafting
once it is known not to pay, from costs alone (every width loses even at full acceptance) or from
what its probes saw (off, the widest probed since the choice last changed, and the probes backed
off to `probe_max`: none looked promising). The second verdict holds `rejudge_rounds` engine rounds,
whatever requests come and go (requests one after another are one workload: probing each anew cost
random heads 5% of a 128-token request); then `rejudge` and the next requests are probed again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WidthPolicy:
    probe_every: int = 8        # rounds between probes after the choice changed
    probe_max: int = 128        # the interval doubles after each probe that changed nothing, up to this
    decay: float = 0.9          # acceptance counts are multiplied by this each observed round
    samples: int = 8            # round times kept per width (their least is the cost)
    min_samples: int = 2        # a width counts as measured with this many kept round times
    rejudge_rounds: int = 256   # engine rounds a probes' verdict of off holds for new requests (RoundLoop.step)
    prior_weight: float = 0.5   # drafted rows' worth of the prior (the position before's alpha) in each alpha

    def __post_init__(self):
        if not 1 <= self.probe_every <= self.probe_max:
            raise ValueError(f"need 1 <= probe_every <= probe_max, got {self.probe_every}, {self.probe_max}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if not 1 <= self.min_samples <= self.samples:
            raise ValueError(f"need 1 <= min_samples <= samples, got {self.min_samples}, {self.samples}")
        if self.rejudge_rounds < 1:
            raise ValueError(f"rejudge_rounds must be >= 1, got {self.rejudge_rounds}")
        if self.prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")


@dataclass(frozen=True)
class WidthEstimate:
    """One width's figures in a bucket: expected tokens per sequence, seconds per round (None:
    not measured), the seconds the rate counts (the cost, or where not measured the largest of a
    narrower width's: rounds only grow with width), and the rate used to choose."""

    width: int
    expected_tokens: float
    cost: float | None
    bound: float
    rate: float


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
    last_probe: int = 0                  # (off: the widest and width 2 alternate)


class WidthController:
    """widths: the verify widths rounds may use, 1 (off) included; start: the tuned width per
    batch size (manifest / `tandem profile`), else the widest; costs: measured seconds per round,
    {batch size: {width: seconds}} (width 1: one plain step), used where a bucket has no samples of
    its own yet (a bucket takes the costs of the smallest batch size >= it, as `start`)."""

    def __init__(self, widths: list[int], batch_sizes: list[int], start: dict[int, int] | None = None,
                 policy: WidthPolicy | None = None, costs: dict[int, dict[int, float]] | None = None):
        self.widths = sorted(set(widths) | {1})
        self.batch_sizes = sorted(batch_sizes)
        if not self.batch_sizes:
            raise ValueError("WidthController needs at least one batch size")
        self.policy = policy or WidthPolicy()
        self.start = dict(sorted((start or {}).items()))
        self.costs = dict(sorted((costs or {}).items()))
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
            given = {w: s for w, s in (_for_bucket(self.costs, b) or {}).items() if w in self.widths and s > 0}
            st = self._buckets[b, constrained] = _Bucket(b, choice, [0.0] * n, [0.0] * n, given=given,
                                            interval=self.policy.probe_every)
            st.next_probe = st.interval
            if given:
                st.choice = self._best(st)
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
            st.choice, st.interval = best, self.policy.probe_every
            st.next_probe = st.rounds + st.interval
            st.probed = set()
        if st.rounds >= st.next_probe:
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
            if st.probing is not None:
                st.probed.add(st.probing)
                st.last_probe = st.probing
                if not self._costed(st, st.probing):    # its first round is a change of width: not a cost
                    st.probe_left = self.policy.min_samples
            return st.probing or st.choice
        return st.choice

    def observe(self, batch: int, width: int, seconds: float | None, drafted: list[int],
                accepted: list[int], constrained: bool = False) -> None:
        """One round at `batch` sequences: per sequence its drafts and how many were accepted;
        `seconds` the round's wall time at `width` (None: not attributable to one width)."""
        st = self._state(batch, constrained)
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
        steady, st.last = st.last == width, width
        if seconds is not None and steady:    # (a change of width costs its first round more: not kept)
            st.times.setdefault(width, deque(maxlen=self.policy.samples)).append(seconds)

    def _costed(self, st: _Bucket, width: int) -> bool:
        """Whether the bucket has a cost for `width`: its own steady samples, or a given one."""
        return len(st.times.get(width, ())) >= self.policy.min_samples or width in st.given

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
        st.interval = self.policy.probe_every
        st.next_probe = st.rounds + st.interval

    # ---- the estimates -----------------------------------------------------------------
    def acceptance(self, batch: int, constrained: bool = False) -> list[float | None]:
        """alpha_i per draft position (None: never drafted there)."""
        st = self._state(batch, constrained)
        return [a / d if d > 1e-9 else None for a, d in zip(st.accepted, st.drafted)]

    def estimates(self, batch: int, constrained: bool = False) -> list[WidthEstimate]:
        return self._estimates(self._state(batch, constrained))

    def _estimates(self, st: _Bucket, seen: dict[int, float] | None = None) -> list[WidthEstimate]:
        """seen: acceptance per position to take instead of the bucket's (a probe's, to judge it)."""
        alpha, prev, m = [], 1.0, self.policy.prior_weight
        for i, (a, d) in enumerate(zip(st.accepted, st.drafted)):
            # past the first position, the counts blended with the prior (as good as the position
            # before; unseen: the prior alone); the first has its counts alone (drafted in every round
            # that drafts, it never goes stale; unseen: 1)
            est = (a + m * prev) / (d + m) if i else a / d if d > 1e-9 else 1.0
            prev = min((seen or {}).get(i, est), prev)
            alpha.append(prev)
        out, floor = [], 0.0
        for w in self.widths:
            expected = 1.0 + sum(alpha[: w - 1])
            times = st.times.get(w, ())
            cost = min(times) if len(times) >= self.policy.min_samples else st.given.get(w)
            if cost is not None:
                floor = max(floor, cost)
            bound = cost if cost is not None else floor
            out.append(WidthEstimate(w, expected, cost, bound, expected / bound if bound > 0 else float("inf")))
        return out

    def _best(self, st: _Bucket) -> int:
        """The start width until it is measured (or given a cost); then the best rate (ties: the
        narrower width)."""
        if not self._costed(st, st.choice):
            return st.choice
        best = max(self._estimates(st), key=lambda e: (e.rate, -e.width))
        return best.width

    def choice(self, batch: int, constrained: bool = False) -> int:
        """The width the bucket runs between probes."""
        return self._state(batch, constrained).choice

    def rejudge(self) -> None:
        """Forget what the probes of off buckets confirmed (the engine calls this `rejudge_rounds`
        rounds after the verdict): acceptance is the workload's, which may have changed, so the next
        requests are probed again. A verdict from costs alone stands."""
        for st in self._buckets.values():
            if st.choice == 1:      # (a probe already due sooner keeps its round)
                st.probed, st.interval = set(), self.policy.probe_every
                st.next_probe = min(st.next_probe, st.rounds + st.interval)

    def hopeless(self, batch: int, constrained: bool = False) -> bool:
        """Whether drafting is known not to pay at this batch size: the bucket off, plain steps
        measured, and either
        - every width w >= 2 costs at least w of them per round (its estimate's bound), so it loses
          even with every draft accepted (a tiny model's rounds, per-call overhead; a compute-bound
          batch's), or
        - its probes confirmed off: the widest width was probed since the choice last changed (every
          draft position seen) and the probes backed off to `probe_max` (none looked promising), so
          the acceptance they saw does not pay for the rounds' cost (random or mismatched heads;
          rounds nearly as dear as their width in plain steps).
        The engine then stops drafting for the bucket's sequences for good, and stops keeping their
        heads current, which alone cost 11-17% of a run on the shipped model."""
        st = self._state(batch, constrained)
        est = self._estimates(st)
        plain = est[0].cost
        if plain is None or st.choice != 1:
            return False
        confirmed = st.interval >= self.policy.probe_max and self.widths[-1] in st.probed
        return confirmed or all(e.bound >= e.width * plain for e in est[1:])


def _for_bucket(per_batch: dict, bucket: int):
    """The value of the smallest batch size >= bucket, else of the largest (None: none given)."""
    if not per_batch:
        return None
    return next((v for bs, v in per_batch.items() if bs >= bucket), per_batch[max(per_batch)])
