"""The round loop's adaptive-width rounds (pipeline/width_control.py decides; this runs what it
decides): the controller picks each round's width, width 1 runs plain decode steps with the heads'
re-anchor deferred (rows kept, caught up in one call per head), and step tells the controller what
the round gave once its outputs are made. A mixin of RoundLoop: it reads the loop's runner,
scheduler, stats and kept rows."""

from __future__ import annotations

import time

import numpy as np

from tandem import contract as c
from tandem.graph_kinds import GraphKind
from tandem.pipeline.decode_burst import DecodeBurst
from tandem.pipeline.sequence import Sequence, Status


class AdaptiveRounds:
    def _adaptive_round(self, seqs: list[Sequence]) -> tuple | None:
        """The controller picks the round's width; returns what the round gave, for step to tell it
        once the round's outputs are made (_tell_controller; None: the bucket decoded plain for good).
        Width 1: plain decode steps, the heads' re-anchor deferred (_off_round)."""
        for s in [s for s in self._lagging if s.status == Status.FINISHED]:
            del self._lagging[s]
        batch, constrained = len(seqs), any(under_grammar(s) for s in seqs)
        self._width = self._open_width(seqs, self.width_control.width(batch, constrained))
        if self._width == 1 and self.width_control.hopeless(batch, constrained):
            self._width = None
            fixed = [s for s in seqs if s.k_fixed]      # a request's own k wins over the controller
            judged = [s for s in seqs if not s.k_fixed]
            for s in judged:      # plain decoding for good: no drafts, probes or heads' catch-up
                s.speculative = False
                self._lagging.pop(s, None)
            if judged:
                self._judged()
            if fixed:
                self._speculative_round(fixed)
            if judged:
                with self._phase("decode"):
                    self._plain_round(judged)
            return None
        try:
            off = [s for s in seqs if self.round_k(s, batch) == 0]
            on = [s for s in seqs if self.round_k(s, batch) > 0]
            self._catch_up([s for s in on if s in self._lagging])
            before = {s: (s.metrics.drafted, s.metrics.accepted) for s in on}
            t, made, self._caught_up = time.perf_counter(), 1, 0.0
            first_runs = self.runner.first_runs
            if on:
                self._speculative_round(on)
            if off:
                with self._phase("decode"):
                    made = self._off_round(off)
            drafted = [s.metrics.drafted - before[s][0] for s in on]
            # a round's time is its width's cost only where every sequence drafted width - 1: one that
            # drafted fewer (its budget's end, a draft the grammar refused) ran a narrower, cheaper verify,
            # and a round whose sequences all had no budget left for drafts ran plain steps
            narrower = self._width > 1 and (not on or any(d != self._width - 1 for d in drafted))
            mixed = bool(on and off) or any(s.k_fixed for s in seqs) or narrower
            return (batch, self._width, t, made, mixed, drafted,
                    [s.metrics.accepted - before[s][1] for s in on], constrained, first_runs)
        finally:
            self._width = None

    def _tell_controller(self, batch: int, width: int, start: float, made: int, mixed: bool, drafted: list[int],
                         accepted: list[int], constrained: bool, first_runs: int, alone: bool) -> None:
        """What a round gave: drafts and accepted counts per sequence, and its time per step from
        the round's start to its outputs made, so a round pays for the host's work on its outputs
        as a burst does once for its steps; the heads' catch-up (an off round's when its kept rows
        reach lag_rows, or a drafting round's after off) is kept out: it is the price of changing
        state, not of a step, and counted it made plain steps look 10-200% dearer now and then. None
        where the round mixed widths, or plain sequences decoded in the same step (`alone` False).
        Cold where the round ran an engine's first call (`first_runs`: the runner's count of those
        before it): the runtime's first run, whose time is not the width's (the first request of a
        process ran its first width-4 round at 9.3 ms against 1.3)."""
        seconds = (time.perf_counter() - start - self._caught_up) / made
        self.width_control.observe(batch, width, seconds if alone and not mixed else None, drafted, accepted,
                                   constrained, steps=made, cold=self.runner.first_runs != first_runs)

    def _judged(self) -> None:
        """A verdict of off turned sequences plain: it holds new requests from this round on, for
        WidthPolicy.rejudge_rounds rounds (step)."""
        if self._judged_since is None:
            self._judged_since = self.stats.rounds

    def _open_width(self, seqs: list[Sequence], wanted: int) -> int:
        """`wanted` when the engine its round calls is open (or is one LLM() began opening, `waits_for`:
        the starting widths); else the widest width below it whose engine is, while `wanted`'s opens in
        the background. So the adaptive width's probes never wait on a session open (0.1-0.6 s each, in
        the middle of a generation); the controller is told the width the round took. Only a round
        with no open width of its kind below (a first sampling round) waits."""
        if wanted <= 1:
            return wanted
        sampling = any(not s.params.greedy for s in seqs)
        engine = self.round_engine(wanted, sampling)
        if engine in self._open or engine in self.waits_for or self._ready(engine, start=True):
            return wanted
        for width in range(wanted - 1, 1, -1):
            if self._ready(self.round_engine(width, sampling), start=False):
                return width
        return wanted       # no width of this kind is open yet (a first sampling round): it waits, as it must

    def _ready(self, engine: tuple[GraphKind, int], start: bool) -> bool:
        """Asks the runner once per engine: an open one stays open (_open keeps the hot loop's check a lookup)."""
        if engine in self._open:
            return True
        if self.runner.ready([engine], start=start):
            self._open.add(engine)
            return True
        return False

    def _off_round(self, seqs: list[Sequence]) -> int:
        """Plain decode steps, a burst where the engine has them (up to the rows the heads' catch-up
        may still take: it runs every kept row in one call per head); the (new token, hidden) rows
        the heads would re-anchor over are kept until drafting resumes or lag_rows rows wait (rows
        kept since a preemption are dropped). Returns the tokens each sequence took: the controller
        weighs drafting against the cost of a plain token, and a burst's token costs less than a
        step's (docs/performance.md, "Decode bursts and the native host sampler")."""
        kept: list[np.ndarray] = []     # per call, [n, H]
        room = self.lag_rows - max(len(self._lagging.get(s, (0, ()))[1]) for s in seqs)
        if not isinstance(self.decode, DecodeBurst) or self.decode.run(seqs, room, kept):
            kept = [self._plain_round(seqs).arrays[c.HIDDEN][:, 0].copy()]
        made = len(kept)
        for b, seq in enumerate(seqs):
            start, ids, hidden = self._lagging.get(seq, (seq.head_committed, [], []))
            if start != seq.head_committed:     # preempted and prefilled again: the heads are current
                start, ids, hidden = seq.head_committed, [], []
            self._lagging[seq] = (start, [*ids, *seq.tokens[-made:]], [*hidden, *(k[b] for k in kept)])
        self._catch_up([s for s in seqs if len(self._lagging[s][1]) >= self.lag_rows])
        return made

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Re-anchor the heads over every row kept while drafting was off, one call per head."""
        work = []
        for s in seqs:
            start, ids, hidden = self._lagging.pop(s)
            if start == s.head_committed:
                work.append((s, ids, np.stack(hidden)))
        if work:
            start = time.perf_counter()
            with self._phase("reanchor"):
                self._reanchor(work)
            self._caught_up += time.perf_counter() - start


def under_grammar(seq: Sequence) -> bool:
    """Whether the sequence decodes under a grammar: its rounds run the multi-call path with drafts
    under masks, and the adaptive width keeps their figures apart (WidthController._state)."""
    return seq.rules is not None and seq.rules.matcher is not None
