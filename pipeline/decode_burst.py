"""Plain decoding several steps per engine step, host side: a decode burst (vLLM's
multi-step scheduling, `--num-scheduler-steps`).

One engine step of plain decoding is the target step's call plus the Python around it: the
scheduler's walk, the inputs' fill, the commit, the per-sequence output (detokenizer, stop
checks). On a small model the Python costs as much as the call (tiny model: 70 of 176 µs a step).
A burst runs up to n target steps back to back over the bucket the first one filled, doing
between calls only what the next call needs:

    call      target step over the bound inputs (each row's token at position c)
    commit    its K/V row into the page at c, its states to the slot (Pools.commit_decode)
    next      t = argmax(logits) (a sampled row: its draw, U(seed, index of t)); the row's token <- t,
              c <- c + 1, in the bound inputs

and hands the n tokens to the engine's usual output path once (RoundLoop._postprocess: stop ids,
stop strings, max_tokens, detokenizer), as a multi-step decode graph's call
(pipeline/multi_step_decode.py) does. The same engine calls in the same order as n engine
steps, so the tokens are the same bits. The invariant after a burst is n decode steps':

    tokens += t_1 .. t_n; committed += n; pools hold the rows of every token but the pending one

Who takes a burst: a batch whose first tokens are out (the time to first token does not wait for a
burst), for as many steps as the smallest token budget among them holds (Sequence.decode_rows); the
scheduler reserves those rows' pages before the step, so a burst never writes a position a request
was not admitted for. Greedy and sampled rows take their tokens as above; where a row has rules (a
grammar, logits processors) or asks for logprobs, every row's token comes from the host's step
(pipeline/host_tokens.py) and is appended as it comes, so the rules see the burst's earlier tokens.
A burst ends early when a token is a stop id of any of its rows (what follows would be
dropped), before a call that would take it past its time budget (so that a step of a large model,
where the host's share is small anyway, stays one call, and a stream's tokens come at least about
every budget), and after any call once `interrupt()` is true (the server sets it to "a request or
an abort is queued": new work waits about one step, not a burst). A stop string inside a burst ends
the output there; the sequence has finished and its extra rows are never read.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from tandem import contract as c
from tandem.graph_kinds import TARGET_STEP
from tandem.pipeline import host_tokens
from tandem.pipeline.logprobs import TokenLogprob
from tandem.pipeline.model_runner import ModelRunner
from tandem.pipeline.native_burst import EDIT_ROW_FIELDS, BurstPlan, NativeBurst
from tandem.pipeline.pools import Pools
from tandem.pipeline.sampler import HostSampler, uniforms
from tandem.pipeline.sequence import Sequence

# Target steps a burst may run, and the time it may take, about. A one-step burst pays the engine's
# whole Python step (150M int4: about 150 of 2,700 µs a token), a longer one that once. Measured on a
# 2-core AMD EPYC (Zen 4), the same dir with either setting, interleaved (docs/performance.md,
# "Decode bursts and the native host sampler"): 150M int4 (2.6 ms a step) 12 ms against 4 ms 1.04x
# (8 ms 1.02-1.08x), int8 1.03x, bf16 and float32 the same (their steps fill the budget alone); the
# tiny model 16 steps against 8 1.05x.
# Arrivals do not wait for a burst where the server interrupts it (DecodeBurst.interrupt).
DEFAULT_STEPS = 16
DEFAULT_BUDGET_MS = 12.0


def _greedy(logits: np.ndarray) -> np.ndarray:
    """Each row's token from logits [n, V]: the first of its largest (as the engine's greedy rows)."""
    return logits.argmax(-1)


class DecodeBurst:
    kind = TARGET_STEP        # the graph it calls (LLM opens it first anyway)
    samples = True            # sampled rows burst too: their tokens are drawn on the host between calls

    def __init__(self, runner: ModelRunner, pools: Pools, steps: int,
                 eos_ids: tuple[int, ...], budget_ms: float = DEFAULT_BUDGET_MS, sampler: HostSampler | None = None,
                 native: NativeBurst | None = None):
        if steps < 2:
            raise ValueError(f"a decode burst runs 2 or more steps, got {steps}")
        self.runner, self.pools, self.steps = runner, pools, steps
        self.eos_ids, self.budget_s = eos_ids, budget_ms / 1000
        self.sampler = sampler or HostSampler()     # the engine's: the same draws as one token a step
        self.native = native                        # the steps between calls in native code, where the dir has it
        self.interrupt: Callable[[], bool] | None = None   # true: end the burst after this call (new work waits)
        self.calls = self.bursts = 0        # target steps run in bursts, and bursts
        self.native_calls = 0               # of those, the ones whose step after ran natively
        self._tokens: dict[int, np.ndarray] = {}   # batch -> [steps, batch] tokens, kept
        self._plans: dict[tuple, tuple] = {}        # (batch, bucket's inputs) -> (outputs, inputs, native plan)

    def run(self, seqs: list[Sequence], most: int | None = None, hidden: list | None = None) -> list[Sequence]:
        """A burst when every sequence can take one, for as many steps as the least of them holds
        (and at most `most`); returns the sequences left to take one token a step (all of them, or
        none). All or none: rows left out would advance a token per burst (a grammar request beside
        free ones, at an eighth of their speed), and the batch would take two calls a step. A batch
        larger than the largest bucket splits its calls (ModelRunner.decode): one step. `hidden`:
        each call's hidden rows [n, H] are appended to it (the heads' catch-up rows while drafting
        is off, AdaptiveRounds._off_round)."""
        steps = min((s.decode_rows(self.steps, self.samples) for s in seqs), default=1)
        steps = steps if most is None else min(steps, most)
        if steps < 2 or len(seqs) > self.runner.batch_sizes[-1]:
            return seqs
        self._burst(seqs, steps, hidden)
        return []

    def _plan(self, outs, inputs: dict, n: int, tokens: np.ndarray, stops: frozenset[int]) -> BurstPlan | None:
        """The native step's plan over this bucket's arrays (kept while the runner hands back the
        same ones), started with this burst's stop ids; or None: numpy steps."""
        if self.native is None:
            return None
        kept = self._plans.get((n, id(inputs)))
        if kept is None or kept[0] is not outs or kept[1] is not inputs:
            copies = self.pools.decode_copies(self.runner.trunk_kv, outs.arrays, inputs, n)
            kept = self._plans[(n, id(inputs))] = (outs, inputs, self.native.plan(
                copies, self.pools.page_size, outs.arrays[c.LOGITS][:, 0], tokens, inputs[c.INPUT_IDS][:n, 0],
                inputs[c.CONTEXT_LENS][:n]))
        if kept[2] is not None:
            kept[2].start(stops)
        return kept[2]

    def _edit_rows(self, seqs: list[Sequence], steps: int, vocab: int) -> tuple[np.ndarray, dict] | None:
        """The native step's row fields (Processors.burst_fields, and where a request's logprobs go;
        zeros for a free row) and the logprobs arrays by row; or None where a row needs the host's
        step: masks (grammar, allowed ids, bad words, min_tokens not reached), a library without the
        edited step."""
        if not self.native.edits:
            return None
        rows = np.zeros((len(seqs), EDIT_ROW_FIELDS), np.int64)
        for b, s in enumerate(seqs):
            if s.rules is not None:
                output = s.output_ids()
                if not s.rules.edits_only(output):
                    return None
                if s.rules.processors is not None:
                    s.rules.processors.sync(output)     # the tokens since its last use (a host step's)
                    rows[b, :12] = s.rules.processors.burst_fields(steps)
        asked = [b for b, s in enumerate(seqs) if s.logprobs is not None]
        scores = {}
        if asked:   # the raw row's scratch, then per step its token's logprob and its top N
            top = max(seqs[b].params.logprobs for b in asked)
            scores = {b: (np.empty(vocab, np.float32), np.empty(steps, np.float32), np.empty((steps, top), np.int64),
                          np.empty((steps, top), np.float32)) for b in asked}
            for b, arrays in scores.items():
                rows[b, 12:] = [arrays[0].ctypes.data, top, *(a.ctypes.data for a in arrays[1:])]
        return rows, scores

    def _append_logprobs(self, seqs: list[Sequence], tokens: np.ndarray, made: int, scores: dict) -> None:
        """The logprobs a native burst wrote, as TokenLogprob entries (what a host step appends)."""
        for b, (_, token_lp, top_ids, top_lp) in scores.items():
            n = seqs[b].params.logprobs
            for t, lp, ids, lps in zip(tokens[:made, b].tolist(), token_lp[:made].tolist(),
                                       top_ids[:made, :n].tolist(), top_lp[:made, :n].tolist()):
                seqs[b].logprobs.append(TokenLogprob(t, lp, tuple(zip(ids, lps))))

    def _burst(self, seqs: list[Sequence], steps: int, hidden: list | None = None) -> None:
        n = len(seqs)
        stops = frozenset().union(*(s.ending_ids(self.eos_ids) for s in seqs))
        # rows with rules or logprobs: each step's tokens decided as a plain step decides them, and
        # appended as they come (the rules follow the output, a sampled row's draw its position)
        shaped = any(s.shaped for s in seqs)
        tokens = self._tokens.get(n)
        if tokens is None:
            tokens = self._tokens[n] = np.zeros((self.steps, n), np.int64)
        # sampled rows: the token at index x of seq.tokens is decided by U(seed, x) (pipeline/sampler.py),
        # so step s of the burst draws with the uniform of index len(tokens) + s, as step s would
        sampled = [b for b, s in enumerate(seqs) if not s.params.greedy]
        if sampled and not shaped:     # every step's uniforms, [sampled rows, steps], at once
            params = [seqs[b].params for b in sampled]
            at = np.array([[len(seqs[b].tokens)] for b in sampled]) + np.arange(steps)
            u = uniforms([seqs[b].seed for b in sampled], at)
        start = time.perf_counter()
        outs, inputs = self.runner.decode(seqs)        # fills the bucket's inputs (the lean decode path)
        ids, context = inputs[c.INPUT_IDS][:n, 0], inputs[c.CONTEXT_LENS][:n]
        layers, made = self.runner.trunk_kv, 0
        plan = self._plan(outs, inputs, n, tokens, stops)
        # greedy rows whose processors only edit (bias, penalties) or that ask for logprobs: the native
        # step edits and counts too, and writes the logprobs of the raw rows
        edit_rows = self._edit_rows(seqs, steps, outs.arrays[c.LOGITS].shape[-1]) \
            if plan is not None and shaped and not sampled else None
        # numpy's commit: the burst's pool rows worked out once (None: from each call's context lengths)
        burst = None if plan is not None else self.pools.burst_destinations(layers, inputs, n, steps)
        while True:
            if hidden is not None:      # before the commit: its row is this call's, whatever the path
                hidden.append(outs.arrays[c.HIDDEN][:n, 0].copy())
            if plan is not None and not sampled and not shaped:   # one native call: commit, tokens, ids, context, stops
                stopped = plan.greedy(made)
                made += 1
            elif edit_rows is not None:     # the same, each row's edits applied, its counts moved on
                stopped = plan.edited(made, edit_rows[0])     # and the logprobs asked for written
                made += 1
            else:
                if plan is not None:
                    plan.commit()
                else:
                    self.pools.commit_decode(layers, outs.arrays, inputs, n, burst, made)
                logits = outs.arrays[c.LOGITS][:, 0]
                if shaped:
                    token = np.array(host_tokens.append_tokens(self.sampler, seqs, logits))
                else:
                    token = _greedy(logits)
                    if sampled:
                        token[sampled] = self.sampler.rows(logits[sampled], params, u[:, made])
                tokens[made] = ids[:] = token
                context += 1        # (the next decode() writes both afresh: harmless after the last call)
                made += 1
                stopped = bool(stops) and not stops.isdisjoint(token.tolist())
            if made == steps or stopped or (self.interrupt is not None and self.interrupt()):
                break
            now = time.perf_counter()
            if now + (now - start) / made > start + self.budget_s:    # the next call would end past the budget
                break
            again = self.runner.decode_again()
            if again is not outs:   # a backend that hands back new arrays: the plan's addresses are stale
                outs, plan = again, self._plan(again, inputs, n, tokens, stops)
        self.calls += made
        self.bursts += 1
        self.native_calls += made if plan is not None else 0
        if edit_rows is not None:
            self._append_logprobs(seqs, tokens, made, edit_rows[1])
        for seq, new in zip(seqs, tokens[:made].T.tolist()):
            seq.committed += made
            if not shaped or edit_rows is not None:
                seq.tokens += new
            if edit_rows is not None and seq.rules is not None and seq.rules.processors is not None:
                seq.rules.processors.burst_done(made)
