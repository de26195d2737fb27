"""The round loop: one `step()` = admit, prefill chunks, one decode round, emit outputs.

The speculative round, for a sequence whose pending token T sits at position p (committed = p),
with head 0's draft d_1 and hidden g_0 already in hand from the last re-anchor:

      draft       head l_s over rows (d_1,g_0) .. (d_s,g_{s-1}) on top of its KV    -> d_{s+1}, g_s
                  (chained: l_s = s mod n, at most n drafts; reused: l_s = 0)         s = 1 .. k-1
          |
      verify      target over [T, d_1 .. d_k] at positions p .. p+k
                  -> a = accepted drafts, T' = next token, hidden h_p .. h_{p+k}, new K/V, states
          |
      commit      target K/V rows 0..a and the states after row a;  tokens += d_1..d_a, T'
          |
      re-anchor   every head over rows (d_1,h_p) .. (d_a,h_{p+a-1}), (T',h_{p+a}) with the
                  TARGET's hidden (not the chained one); commit those a+1 head rows
                  head 0 at the last row -> d_1, g_0 for the next round
          v
      invariant   pending = T' at position p+a+1, pending hidden = h_{p+a}

Rejecting a draft is not committing its rows: the pools only ever hold accepted rows.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from operator import attrgetter

import numpy as np

from tandem import contract as c
from tandem.graph_kinds import TARGET_STEP, GraphKind
from tandem.pipeline import host_tokens, logprobs
from tandem.pipeline.adaptive_rounds import AdaptiveRounds, under_grammar
from tandem.pipeline.decode_burst import DecodeBurst
from tandem.pipeline.head_drafts import HeadDrafts
from tandem.pipeline.logits_processors import prepare_masks
from tandem.pipeline.model_runner import ModelRunner, Outputs, Rows
from tandem.pipeline.multi_step_decode import MultiStepDecode
from tandem.pipeline.outputs import RoundStats, StepOutput
from tandem.pipeline.pools import Pools
from tandem.pipeline.prefix_cache import PrefixCache
from tandem.pipeline.relaxed import RelaxedRows
from tandem.pipeline.sampler import HostSampler, clamped_temperature, min_p_log, uniforms
from tandem.pipeline.sampling_params import SamplingParams
from tandem.pipeline.scheduler import Scheduler
from tandem.pipeline.sequence import Sequence, Status
from tandem.pipeline.unified_round import UnifiedRound
from tandem.pipeline.width_control import WidthController


def _sampling_inputs(p: SamplingParams) -> dict:
    """The verify graph's sampling inputs: greedy rows as temperature 0, a temperature past
    float32's range as its largest (still near-uniform, and no overflow filling the buffer)."""
    if p.greedy:
        return {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    return {"temperature": clamped_temperature(p.temperature), "top_k": p.top_k, "top_p": p.top_p,
            "min_p_log": min_p_log(p.min_p)}


def _round_groups(seqs: list[Sequence], drafts: dict[str, list[int]], max_positions: int,
                  merge: bool = True) -> list[tuple[int, list[Sequence]]]:
    """The engine calls of a round: (width, sequences). Sequences with fewer drafts than the widest
    (their budgets' ends, chains cut by p_min) ride its call with filler rows, where those rows stay
    inside the block tables: one call where one per width ran several (147M model, batch 8: the round
    in which four of eight requests reached max_tokens took 85 ms against 35). `merge` False (the
    synthetic-acceptance aid): one call per width."""
    width = {s.request_id: len(drafts[s.request_id]) + 1 for s in seqs}
    widest = max(width.values())
    merged = [s for s in seqs if s.committed + widest <= max_positions] if merge and widest > 1 else []
    inside = {s.request_id for s in merged}
    rest = [s for s in seqs if s.request_id not in inside]
    return ([(widest, merged)] if merged else []) + [
        (w, [s for s in rest if width[s.request_id] == w]) for w in sorted({width[s.request_id] for s in rest})]


class RoundLoop(AdaptiveRounds, HeadDrafts):
    def __init__(self, runner: ModelRunner, pools: Pools, scheduler: Scheduler, eos_ids: tuple[int, ...],
                 mtp_layers: int, chained: bool = True, synthetic_acceptance: float | None = None,
                 width_per_batch: dict[int, int] | None = None, width_control: WidthController | None = None,
                 unified: UnifiedRound | None = None, decode: MultiStepDecode | DecodeBurst | None = None,
                 sampler: HostSampler | None = None):
        self.runner, self.pools, self.scheduler = runner, pools, scheduler
        self.sampler = sampler or HostSampler()     # the host's draws (native where the engine dir has it)
        self.eos_ids = set(eos_ids)
        self.mtp_layers, self.chained = mtp_layers, chained
        mtp = runner.desc.mtp
        # only chained heads see another head's hidden; head 0 always pairs with the target's
        self.by_previous_head = chained and mtp is not None and mtp.anchor == "previous_head"
        self.synthetic_acceptance = synthetic_acceptance
        self.width_per_batch = dict(sorted((width_per_batch or {}).items()))
        self.width_control, self._width = width_control, None     # _width: this round's, when adaptive
        self._caught_up = 0.0                  # seconds of the heads' catch-up, kept out of the rounds' times
        # drafting off: heads catch up later in one call; a window page group cannot wait (its pools
        # hold only head_lag rows of lag), so there they catch up every round
        self.lag_rows = 1 if scheduler.windowed else max(1, scheduler.prefill_chunk)
        self._lagging: dict[Sequence, tuple[int, list[int], list[np.ndarray]]] = {}  # seq -> head_committed, rows
        # the engine round a verdict of off first turned sequences plain for good (None: no verdict holds);
        # it holds new requests WidthPolicy.rejudge_rounds rounds, then they are probed again
        self._judged_since: int | None = None
        self.unified = unified          # one-call rounds (pipeline/unified_round.py) at the widths it serves
        self.decode = decode            # n tokens a step for plain rows: a multi-step graph's call (greedy)
                                        # or a burst of n calls (None: one token a step)
        # the scheduler reserves the pages those calls write
        scheduler.decode_steps, scheduler.decode_samples = (decode.steps, decode.samples) if decode else (1, False)
        self.waits_for: set[tuple[GraphKind, int]] = set()   # round engines opening from the start (_open_width)
        self._open: set[tuple[GraphKind, int]] = set()       # round engines known to be open (_open_width)
        self.stats = RoundStats()
        self.prefix_cache: PrefixCache | None = None   # LLM sets it when prefix caching is on
        self.relaxed = RelaxedRows()   # relaxed acceptance: LLM sets the engine's default and <think> markers
        self.trace: list[tuple[str, float, float]] | None = None  # (phase, start, end) when profiling

    @contextlib.contextmanager
    def _phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.stats.phase_seconds[name] = self.stats.phase_seconds.get(name, 0.0) + end - start
            if self.trace is not None:
                self.trace.append((name, start, end))

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        engine_before = self.runner.engine_seconds
        ctl = self.width_control
        if ctl is not None and self._judged_since is not None and \
                self.stats.rounds - self._judged_since >= ctl.policy.rejudge_rounds:
            self._judged_since = None
            self.width_control.rejudge()    # the next requests are probed again
        self.scheduler.admit()
        touched: list[Sequence] = []
        prefill = self.scheduler.prefill_batch()
        if prefill:
            with self._phase("prefill"):
                touched += self._prefill(prefill)
        # in slot order: with slots handed out lowest first, a full batch's slots are then
        # consecutive and the engine writes its states into their pool rows (ModelRunner._place_states)
        decoding = sorted(self.scheduler.decode_batch(), key=attrgetter("slot"))
        spec = [s for s in decoding if s.speculative]
        plain = [s for s in decoding if not s.speculative]
        report = None       # what an adaptive round gave: told to the controller once its outputs are made
        if spec:
            report = self._adaptive_round(spec) if self.width_control else self._speculative_round(spec)
        if plain:   # n tokens a step where the batch can take them (a burst, or the dir's multi-step graph)
            with self._phase("decode"):
                if rest := (self.decode.run(plain) if self.decode is not None else plain):
                    self._plain_round(rest)
        touched += decoding
        outputs = [self._postprocess(s) for s in dict.fromkeys(touched)]
        if report is not None:      # (the round's time includes the host's work on its outputs)
            self._tell_controller(*report, alone=not plain)
        if decoding:
            self.stats.rounds += 1
            self.stats.round_seconds += time.perf_counter() - t0
            self.stats.engine_seconds += self.runner.engine_seconds - engine_before
        return [o for o in outputs if o is not None]

    # ---- prefill -----------------------------------------------------------------------
    def _prefill(self, work: list[tuple[Sequence, int, int]]) -> list[Sequence]:
        rows = [Rows(ids=s.tokens[a:b], context=a, pages=s.table.pages, slot=s.slot) for s, a, b in work]
        outs = self.runner.target_step(rows, commits=True)
        self.pools.write_rows(self.runner.trunk_kv, outs.arrays, np.arange(len(work)),
                              np.array([b - a for _, a, b in work]), np.array([a for _, a, _ in work]),
                              [s.table.pages for s, _, _ in work])
        self.pools.commit_states(outs.arrays, np.arange(len(work)), np.array([s.slot for s, _, _ in work]))
        done = []
        for (seq, a, b), out in zip(work, outs.rows()):
            seq.prefilled = seq.committed = b
            if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) == a:  # row i scores prompt[a + i + 1]
                following = seq.prompt[a + 1 : b + 1]
                seq.prompt_logprobs += logprobs.prompt_logprobs(out[c.LOGITS], following, seq.params.prompt_logprobs)
            if b == seq.prefill_target:
                if seq.num_generated == 0:  # fresh prompt: its first token comes from the last row
                    host_tokens.append_token(self.sampler, seq, out[c.LOGITS][b - a - 1])
                    seq.metrics.first_token = time.perf_counter()
                seq.status = Status.DECODE
                done.append(seq)
        if self.width_control is not None:
            for s, _, _ in work:      # drafting cannot pay at this batch size: no heads to keep (_adaptive_round),
                if s.speculative and not s.k_fixed and \
                        self.width_control.hopeless(len(self.scheduler.running), under_grammar(s)):
                    s.speculative = False       # (a request that fixed its k drafts: that always wins)
                    self._judged()
        spec = [(s, a, b, o) for (s, a, b), o in zip(work, outs.rows()) if s.speculative]
        if spec:  # re-anchor the heads over this chunk: row i pairs tokens[i+1] with h_i
            self._reanchor([(s, s.tokens[a + 1 : b + 1], o[c.HIDDEN][: b - a]) for s, a, b, o in spec])
        if self.prefix_cache is not None:   # a chunk that stopped at the cache's mark leaves an entry there
            for s, _, b in work:
                if b == self.prefix_cache.mark(s):
                    self._keep_prefix(s, s.tokens[: b + 1])
        return [s for s, _, _ in work]

    # ---- decode rounds -----------------------------------------------------------------
    def _plain_round(self, seqs: list[Sequence]) -> Outputs:
        """One token per sequence: the hot loop of plain decoding (the runner's and pools' lean
        decode paths; greedy rows take one argmax over the batch)."""
        outs, inputs = self.runner.decode(seqs)
        n = len(seqs)
        if inputs is not None:
            self.pools.commit_decode(self.runner.trunk_kv, outs.arrays, inputs, n)
        else:   # more sequences than the largest batch: the call was split, its inputs are gone
            self.pools.write_rows(self.runner.trunk_kv, outs.arrays, np.arange(n), np.ones(n, int),
                                  np.array([s.committed for s in seqs]), [s.table.pages for s in seqs])
            self.pools.commit_states(outs.arrays, np.arange(n), np.array([s.slot for s in seqs]))
        host_tokens.append_tokens(self.sampler, seqs, outs.arrays[c.LOGITS][:, 0])
        for seq in seqs:
            seq.committed += 1
        return outs

    def _speculative_round(self, seqs: list[Sequence]) -> None:
        with self._phase("draft"):
            drafts = self._draft(seqs)
        with self._phase("grammar"):
            masks = self._grammar_masks(seqs, drafts)
        for width, group in _round_groups(seqs, drafts, self.scheduler.max_positions,
                                          merge=self.synthetic_acceptance is None):
            sampling = any(not s.params.greedy for s in group)
            # a grammar request's drafts come from the heads under its masks, and a request with logprobs
            # reads them from the verify graph: the multi-call round (a unified round drafts the next
            # round's tokens inside the graph, before the host knows them, and reports no logprobs).
            # Logits processors alone ride the unified round: its verify applies their masks and edits
            multi = any(s.logprobs is not None or under_grammar(s) for s in group)
            if self.unified and self.synthetic_acceptance is None and self.unified.serves(width, sampling) \
                    and not multi:
                with self._phase("round"):
                    self.unified.run(group, self._verify_rows(group, drafts, width, masks), drafts, width, sampling)
            else:
                self._verify_and_commit(group, drafts, width, masks)

    @staticmethod
    def _grammar_masks(seqs: list[Sequence], drafts: dict[str, list[int]]) -> dict[str, np.ndarray]:
        """Grammar requests: the verify rows' masks, a wrong draft replaced where the grammar allows one
        token only (pipeline/grammar.py); other requests bind all-ones rows and cost nothing here."""
        masks = {}
        ruled = [s for s in seqs if s.rules is not None]
        prepare_masks([(s.rules, s.output_ids(), drafts[s.request_id]) for s in ruled])   # the last rows' masks
        for s in ruled:     # (the rows before: the draft steps' masks, computed then)
            drafts[s.request_id], masks[s.request_id] = s.rules.draft_masks(s.output_ids(), drafts[s.request_id])
        return masks

    def round_k(self, seq: Sequence, batch: int) -> int:
        """Drafts this round: the request's (or global) k, else the width the controller picked this
        round (adaptive), else the verify width the manifest (or `tandem profile`) chose for this
        batch size, minus one; no more than the sequence's token budget leaves after the round's own
        token, where the narrower round's engine is open or opening (a round past the budget computes
        and commits tokens that are dropped, and leaves the prefix cache no entry at the answer's end);
        where it is not, none when the round would write past the last position a block table holds
        (a request may fill max_seq_len with prompt + max_tokens: rows [committed, committed + k])."""
        if seq.k_fixed or (self._width is None and not self.width_per_batch):
            k = seq.k
        elif self._width is not None:
            k = min(seq.k, self._width - 1)
        else:
            bucket = next((b for b in self.width_per_batch if b >= batch), max(self.width_per_batch))
            k = min(seq.k, self.width_per_batch[bucket] - 1)
        k = min(k, self.mtp_layers) if self.chained else k
        left = max(0, seq.params.max_tokens - seq.num_generated - 1)
        if left < k:
            engine = self.round_engine(left + 1, not seq.params.greedy)
            if left == 0 or engine in self._open or engine in self.waits_for:
                k = left
            elif seq.committed + k >= self.scheduler.max_positions:
                k = 0   # the round's last row would pass the block table's end: plain steps finish it
        return k

    def round_engine(self, width: int, sampling: bool) -> tuple[GraphKind, int]:
        """The engine a round of this width calls: the unified round where the dir has it, else verify
        (the synthetic-acceptance aid: the target step)."""
        if self.synthetic_acceptance is not None:
            return TARGET_STEP, width
        if self.unified and self.unified.serves(width, sampling):
            return self.unified.kinds[(sampling, width)], width
        return GraphKind.verify(sampling), width

    def _verify_and_commit(self, seqs: list[Sequence], drafts: dict[str, list[int]], width: int,
                           masks: dict[str, np.ndarray]) -> None:
        sampling = any(not s.params.greedy for s in seqs)
        rows = self._verify_rows(seqs, drafts, width, masks)
        with self._phase("verify"):
            if self.synthetic_acceptance is None:
                outs = (self.runner.verify(rows, sampling, commits=True) if width > 1
                        else self.runner.target_step(rows, commits=True))
                accepted = [int(o[c.ACCEPTED]) if width > 1 else 0 for o in outs.rows()]
                nxt = [int(o[c.NEXT_TOKEN]) if width > 1 else host_tokens.next_token(self.sampler, s, o[c.LOGITS][0])
                       for o, s in zip(outs.rows(), seqs)]
                for s, o, t in zip(seqs, outs.rows(), nxt):
                    if s.logprobs is not None and width == 1:
                        s.logprobs.append(logprobs.from_logits(o[c.LOGITS][0], t, s.params.logprobs))
            else:
                accepted, nxt, outs = self._synthetic_verify(seqs, rows, width)
        n = len(seqs)
        with self._phase("commit"):
            self.pools.write_rows(self.runner.trunk_kv, outs.arrays, np.arange(n), np.array(accepted) + 1,
                                  np.array([s.committed for s in seqs]), [s.table.pages for s in seqs])
            self.pools.commit_states(outs.arrays, np.arange(n), np.array([s.slot for s in seqs]))
        anchor = []
        for seq, out, a, t in zip(seqs, outs.rows(), accepted, nxt):
            new = drafts[seq.request_id][:a] + [t]
            if seq.logprobs is not None and width > 1:   # the target's, from the verify rows that emitted them
                seq.logprobs += logprobs.from_verify(out, new, seq.params.logprobs)
            seq.metrics.record_round(len(drafts[seq.request_id]), a)
            seq.committed += a + 1
            seq.tokens += new
            anchor.append((seq, new, out[c.HIDDEN][: a + 1]))
        with self._phase("reanchor"):
            self._reanchor(anchor)

    def _verify_rows(self, seqs: list[Sequence], drafts: dict[str, list[int]], width: int,
                     masks: dict[str, np.ndarray]) -> list[Rows]:
        """[pending, d_1..d_k] per sequence with its sampling inputs and grammar masks (verify and unified rounds)."""
        # row i decides the token at position len(tokens) + i: its uniform is that position's (greedy
        # rows read none, so a greedy batch draws none)
        u = None
        if self.synthetic_acceptance is not None or any(not s.params.greedy for s in seqs):
            u = uniforms([s.seed for s in seqs], np.array([len(s.tokens) for s in seqs])[:, None] + np.arange(width))
        # a sequence with fewer drafts than the call's width (its budget's end, a chain cut by p_min) fills
        # its rows past them with contract.FILLER_DRAFT, never accepted (_round_groups)
        rows = [Rows(ids=[s.tokens[-1], *(d := drafts[s.request_id]), *[c.FILLER_DRAFT] * (width - 1 - len(d))],
                     context=s.committed, pages=s.table.pages,
                     slot=s.slot, uniforms=None if u is None else u[i], bitmask=masks.get(s.request_id),
                     edits=s.rules.draft_edits(s.output_ids(), drafts[s.request_id]) if s.rules else None,
                     logprobs=s.logprobs is not None,
                     **_sampling_inputs(s.params))
                for i, s in enumerate(seqs)]
        self.relaxed.fill(seqs, drafts, rows)
        return rows

    def _synthetic_verify(self, seqs, rows, width):
        """Benchmark aid (explicit option, documented): accept each draft with the configured
        probability, whatever the tokens; the target still runs over all rows and commits the
        states of the rows kept. Output tokens are not the model's: use only to time rounds."""
        for r in rows:
            keep = 0
            while keep < width - 1 and r.uniforms[keep] < self.synthetic_acceptance:
                keep += 1
            r.state_rows = keep + 1
        outs = self.runner.target_step(rows, commits=True)
        accepted = [r.state_rows - 1 for r in rows]
        nxt = [int(np.argmax(o[c.LOGITS][a])) for o, a in zip(outs.rows(), accepted)]
        return accepted, nxt, outs

    # ---- the prefix cache (pipeline/prefix_cache.py) ---------------------------------------
    def _keep_prefix(self, seq: Sequence, key: list[int], catch_up: bool = False) -> None:
        """Leave an entry for the prefix key[:-1] the sequence has run (its states are after it): its
        pages, a snapshot of its states and, where it drafts, its heads' rows (caught up first)."""
        if catch_up and seq.speculative and seq in self._lagging:
            self._catch_up([seq])
        heads = seq.head_committed if seq.speculative and seq.head_committed >= len(key) - 1 else 0
        self.prefix_cache.make(key, {w: t.pages for w, t in seq.table.groups.items()}, seq.params.cache_salt,
                               heads, seq.carries if heads else {}, lambda row: self.pools.snapshot(seq.slot, row))

    # ---- outputs -----------------------------------------------------------------------
    def forget(self, seq: Sequence) -> None:
        """Drop what the engine keeps for a sequence that ended (finished or aborted)."""
        self._lagging.pop(seq, None)

    def _postprocess(self, seq: Sequence) -> StepOutput | None:
        """Emit the tokens committed since the last output; stop on EOS, stop ids, stop strings
        or max_tokens (dropping whatever the round produced past the stop)."""
        if seq.status == Status.FINISHED:
            return None
        start = seq.emitted
        new = seq.tokens[start:]
        budget = seq.params.max_tokens - (start - len(seq.prompt))
        stops = seq.ending_ids(self.eos_ids)
        reason, kept = None, new
        if not stops.isdisjoint(new):     # (most steps: no stop id among the new tokens)
            kept = list(itertools.takewhile(lambda t: t not in stops, new))
            reason = "stop"
        if kept and len(kept) >= budget:
            kept, reason = kept[: max(budget, 1)], "length"
        added, at = seq.detok.add_until_stop(kept)
        if at >= 0:     # the token that completed a stop string ends the output
            kept = kept[:added]
            seq.detok.truncate(at + (seq.detok.matched if seq.params.include_stop_str_in_output else 0))
            reason = "stop"
        if seq.rules is not None and seq.rules.dead_ends is not None:   # the stop id that ends it included
            by_id = reason == "stop" and at < 0 and len(kept) < len(new)
            seq.rules.dead_ends.check(seq.tokens, len(seq.prompt), start + len(kept) + by_id)
        seq.emitted = start + len(kept)
        if reason is not None:
            if self.prefix_cache is not None and seq.committed <= seq.emitted:   # (no state past what it emits)
                self._keep_prefix(seq, seq.tokens[: seq.committed + 1], catch_up=True)
            del seq.tokens[start + len(kept) :]
            if seq.logprobs is not None:
                del seq.logprobs[seq.num_generated :]
            seq.metrics.finished = time.perf_counter()
            self.scheduler.finish(seq, reason)
            self.stats.add_finished(seq)
            self.forget(seq)
        first = start - len(seq.prompt)
        return StepOutput(seq.request_id, seq.detok.take(final=reason is not None), kept, reason is not None,
                          reason, seq, None if seq.logprobs is None else seq.logprobs[first : first + len(kept)])

