"""A request's logits processors (vLLM's sampling parameters) and its token rules: the grammar and
the processors together, as one object the engine asks for each row's masks and edits.

Processors, in vLLM's order, on the target's logits x of a row that follows `output` (the tokens
generated so far, the pending one and, in a verify row, the drafts before the row):
    masks     allowed_token_ids; bad_words (a word's last token where the output ends in the rest of
              it); min_tokens (EOS and stop ids while fewer than min_tokens tokens are out); a grammar
    edits     per token t of an edit list: x_t += logit_bias[t]
                                         x_t  = x_t / r if x_t > 0 else x_t * r      (t in prompt or output)
                                         x_t -= f * count(t) + p * (count(t) > 0)   (as one float32 number)
Masks are bits in the grammar's bitmask rows (contract.TOKEN_BITMASK); edits are sparse: ids [N]
and (bias, scale, post) [N, 3] float32, tokens outside the list unchanged. The verify graph takes
both per row (export/acceptance.py) and applies the same float32 operations in the same order, so
a row's processed logits are the same bits in the graph and here: speculative greedy == plain greedy.
Counts follow the sequence's committed output (sync), so only accepted tokens ever count; a verify
row adds the drafts before it on top. Work per row is O(edit list), never a loop over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from tandem.contract import mask_words
from tandem.pipeline.dead_ends import DeadEnds
from tandem.pipeline.grammar import allowed_tokens, fill_masks
from tandem.pipeline.sampling_params import SamplingParams

EDIT_VALUES = 3      # (bias, scale, post) per edited token
NO_EDIT = np.array([0.0, 1.0, 0.0], np.float32)


def clear_bits(row: np.ndarray, ids: np.ndarray) -> None:
    """Clear the bits of token `ids` in one bitmask row [words] (int32), in place."""
    if len(ids):
        bits = row.view(np.uint32)
        np.bitwise_and.at(bits, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))


def mask_of(ids: Seq[int], vocab_size: int) -> np.ndarray:
    """A bitmask row [words] with only `ids` allowed."""
    row = np.zeros(mask_words(vocab_size), np.uint32)
    ids = np.asarray(ids, np.int64)
    np.bitwise_or.at(row, ids >> 5, np.uint32(1) << (ids & 31).astype(np.uint32))
    return row.view(np.int32)


class Processors:
    """One sequence's processors (SamplingParams' processor fields), following its output."""

    def __init__(self, params: SamplingParams, prompt: list[int], vocab_size: int, stop_ids: frozenset[int],
                 bad_words: list[list[int]]):
        self.vocab_size = vocab_size
        self.allowed = mask_of(params.allowed_token_ids, vocab_size) if params.allowed_token_ids else None
        self.bad_single = np.array(sorted({w[0] for w in bad_words if len(w) == 1}), np.int64)
        self.bad_multi = [tuple(w) for w in bad_words if len(w) > 1]
        self.longest = max((len(w) for w in self.bad_multi), default=0)
        self.min_tokens, self.stop_ids = params.min_tokens, np.array(sorted(stop_ids), np.int64)
        self.rep, self.freq, self.pres = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
        self.counts = np.zeros(vocab_size, np.int32)      # output tokens
        self.seen = np.zeros(vocab_size, bool)            # prompt and output tokens (repetition)
        self.bias = np.zeros(vocab_size, np.float32)
        for t, b in params.logit_bias:
            self.bias[t] = b
        self.penalised = self.rep != 1.0 or self.freq != 0.0 or self.pres != 0.0
        self.edits = self.penalised or bool(params.logit_bias)
        ids = {t for t, _ in params.logit_bias}
        if self.rep != 1.0:
            self.seen[prompt] = True
            ids.update(prompt)
        # the edit list (unique; in the order tokens joined it): a buffer that grows, ids its filled part
        self._ids = np.zeros(max(64, 2 * len(ids)), np.int64)
        self._ids[: len(ids)] = sorted(ids)
        self.ids = self._ids[: len(ids)]
        self.listed = np.zeros(vocab_size, bool)
        self.listed[self.ids] = True
        self._n = np.array([len(self.ids)], np.int64)   # the list's length, where native bursts read it
        # every token's (bias, scale, post) after the synced output, kept current for the tokens it adds,
        # so the row after it (the host's, a verify row's first) is one gather of the edit list
        self.values = np.zeros((vocab_size, EDIT_VALUES), np.float32)
        self.values[:, 0], self.values[:, 1] = self.bias, 1.0
        if self.rep != 1.0:
            self.values[self.seen, 1] = np.float32(self.rep)
        self.consumed = 0

    def sync(self, output: list[int]) -> None:
        """Count output[consumed:] (committed tokens only: the engine syncs before each use). Token by
        token, as scalars: a step adds one token or a few, where array operations cost more."""
        new = output[self.consumed :]
        if not new:
            return
        self.consumed = len(output)
        if not self.penalised:
            return
        f, p, rep = np.float32(self.freq), np.float32(self.pres), np.float32(self.rep)
        for t in new:
            count = self.counts[t] + 1
            self.counts[t], self.seen[t] = count, True
            # the values _scale_post gives, as float32 scalars (the same operations, the same bits)
            self.values[t, 1] = rep if self.rep != 1.0 else np.float32(1.0)
            self.values[t, 2] = -(f * np.float32(count) + p * np.float32(count > 0))
            if not self.listed[t]:
                self.listed[t] = True
                n = len(self.ids)
                if n == len(self._ids):
                    self._ids = np.concatenate([self._ids, np.zeros(n, np.int64)])
                self._ids[n] = t
                self.ids = self._ids[: n + 1]
                self._n[0] = n + 1

    def burst_fields(self, steps: int) -> list[int]:
        """This row's fields for a native decode burst (plugins/cpu/decode_burst.cc, tandem_burst_edited:
        it edits the row's logits and moves the counts, values and edit list on as sync does), the
        list's buffer grown first to hold `steps` more tokens. After sync; burst_done(steps made) after."""
        n = len(self.ids)
        if len(self._ids) < n + steps:
            self._ids = np.concatenate([self._ids, np.zeros(n + steps, np.int64)])
            self.ids = self._ids[:n]
        floats = np.array([self.rep, self.freq, self.pres], np.float64).view(np.int64).tolist()
        return [1, int(self.penalised), self._ids.ctypes.data, self._n.ctypes.data, len(self._ids),
                self.listed.ctypes.data, self.counts.ctypes.data, self.seen.ctypes.data, self.values.ctypes.data,
                *floats]    # (12 fields; the 13th, a raw copy's address, is the burst's)

    def burst_done(self, made: int) -> None:
        """A native burst counted `made` more output tokens."""
        self.consumed += made
        self.ids = self._ids[: int(self._n[0])]

    def _scale_post(self, counts: np.ndarray, seen: np.ndarray) -> tuple:
        """The repetition scale and the post term of tokens with these counts (float32) and seen flags."""
        scale = np.where(seen, np.float32(self.rep), np.float32(1.0)) if self.rep != 1.0 else np.float32(1.0)
        return scale, -(np.float32(self.freq) * counts + np.float32(self.pres) * (counts > 0))

    def masks(self, output: list[int]) -> bool:
        """Whether any mask applies to the row after `output` (else mask_row changes nothing)."""
        return (self.allowed is not None or len(self.bad_single) > 0 or bool(self.bad_multi)
                or len(output) < self.min_tokens)

    def mask_row(self, row: np.ndarray, output: list[int], extra: Seq[int] = ()) -> None:
        """AND this row's masks into row [words] (int32), for the token after output + extra."""
        if self.allowed is not None:
            np.bitwise_and(row, self.allowed, out=row)
        clear_bits(row, self.bad_single)
        if self.bad_multi:
            tail = [*output[-self.longest :], *extra]
            banned = [w[-1] for w in self.bad_multi
                      if len(w) - 1 <= len(tail) and tuple(tail[len(tail) - len(w) + 1 :]) == w[:-1]]
            clear_bits(row, np.array(banned, np.int64))
        if len(output) + len(extra) < self.min_tokens:
            clear_bits(row, self.stop_ids)

    def filters(self, position: int) -> str:
        """The fields whose masks apply at output position `position`, for an error that names them."""
        names = [name for name, on in (("allowed_token_ids", self.allowed is not None),
                                       ("bad_words", len(self.bad_single) > 0 or bool(self.bad_multi)),
                                       (f"min_tokens ({self.min_tokens})", position < self.min_tokens)) if on]
        return " and ".join(names) or "the request's token filters"

    def row_edits(self, extra: Seq[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The edit list of the row after the synced output + extra: ids [N] int64, values [N, 3] float32."""
        if not (extra and self.penalised):
            return self.ids, self.values[self.ids]
        ids = np.union1d(self.ids, extra)
        counts = self.counts[ids].astype(np.float32)
        seen = self.seen[ids]
        at = np.searchsorted(ids, np.asarray(extra, np.int64))
        np.add.at(counts, at, 1)
        seen[at] = True
        values = np.empty((len(ids), EDIT_VALUES), np.float32)
        values[:, 0] = self.bias[ids]
        values[:, 1], values[:, 2] = self._scale_post(counts, seen)
        return ids, values


def apply_edits(logits: np.ndarray, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The edited copy of one row of logits [V] (float32), in the verify graph's order of operations."""
    out = logits.astype(np.float32, copy=True)
    _edit_in_place(out[None], ids[None], values[None])
    return out


def _edit_in_place(rows: np.ndarray, ids: np.ndarray, values: np.ndarray) -> None:
    """rows [n, V] float32 edited in place by ids [n, N] and values [n, N, 3] (pad_edits' layout)."""
    at = np.arange(len(rows))[:, None]
    x = rows[at, ids] + values[..., 0]
    x = np.where(x > 0, x / values[..., 1], x * values[..., 1])
    rows[at, ids] = x + values[..., 2]


def pad_edits(rows: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-row edit lists -> ids [R, N] and values [R, N, 3], N the longest; a shorter row repeats its
    first entry (a duplicate write of the same value), an empty one edits token 0 by nothing."""
    n = max(1, max(len(ids) for ids, _ in rows))
    if len(rows) == 1 and len(rows[0][0]) == n:
        return rows[0][0][None], rows[0][1][None]
    ids = np.zeros((len(rows), n), np.int64)
    values = np.empty((len(rows), n, EDIT_VALUES), np.float32)
    values[:] = NO_EDIT
    for r, (i, v) in enumerate(rows):
        if len(i):
            ids[r], values[r] = i[0], v[0]
            ids[r, : len(i)], values[r, : len(i)] = i, v
    return ids, values


class TokenRules:
    """What shapes one sequence's logits: its grammar matcher (pipeline/grammar.py) and processors,
    either or both. The engine asks it for the masks and edits of verify rows, head rows and host rows."""

    def __init__(self, vocab_size: int, matcher=None, processors: Processors | None = None):
        self.vocab_size, self.words = vocab_size, mask_words(vocab_size)
        self.matcher, self.processors = matcher, processors
        # where the processors' masks and the grammar (if any) together leave no token (pipeline/dead_ends.py)
        self.dead_ends = DeadEnds(matcher.field if matcher is not None else None) if processors is not None else None
        if matcher is not None:
            matcher.dead_ends = self.dead_ends

    @property
    def edits(self) -> bool:
        return self.processors is not None and self.processors.edits

    def edits_only(self, output: list[int]) -> bool:
        """Whether the rows after `output` (and after any tokens added to it) take edits at most, no
        mask: no grammar, no allowed ids or bad words, min_tokens reached (it stays reached)."""
        p = self.processors
        return self.matcher is None and (p is None or (p.allowed is None and not len(p.bad_single)
                                                       and not p.bad_multi and len(output) >= p.min_tokens))

    def draft_masks(self, output: list[int], drafts: list[int]) -> tuple[list[int], np.ndarray]:
        """Masks of the verify rows [pending, d_1..d_k] -> (drafts, masks [k + 1, words]); the grammar
        may replace a draft it forces (Matcher.draft_masks)."""
        if self.matcher is not None:
            drafts, masks = self.matcher.draft_masks(output, drafts)
        else:
            masks = np.full((len(drafts) + 1, self.words), -1, np.int32)
        if self.processors is not None:
            self.processors.sync(output)
            for i in range(len(drafts) + 1):     # (row 0 decides a token: every round commits one)
                self.processors.mask_row(masks[i], output, drafts[:i])
                self._dead_end(masks[i], output, drafts[:i], deciding=i == 0)
        return drafts, masks

    def draft_edits(self, output: list[int], drafts: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """Edits of the verify rows [pending, d_1..d_k]: ids [k + 1, N], values [k + 1, N, 3]; None: none."""
        if not self.edits:
            return None
        self.processors.sync(output)
        return pad_edits([self.processors.row_edits(drafts[:i]) for i in range(len(drafts) + 1)])

    def head_edits(self, output: list[int], drafts: list[int], rows: int) -> tuple[np.ndarray, np.ndarray] | None:
        """A head call's edits over its `rows` rows, for the draft after output + drafts: every row that
        token's list (the head reads last_row's only); None: none."""
        if not self.edits:
            return None
        self.processors.sync(output)
        ids, values = self.processors.row_edits(drafts)
        if not len(ids):        # (penalties before any output: nothing to edit yet)
            return None
        return np.broadcast_to(ids, (rows, len(ids))), np.broadcast_to(values, (rows, *values.shape))

    def next_mask(self, output: list[int], drafts: list[int], deciding: bool = False) -> np.ndarray | None:
        """The mask [words] of the token after output + drafts (a head's draft; `deciding`: the host's
        row, whose token is chosen now), None where the grammar refuses a draft (nothing drafted after
        it can be kept)."""
        if self.matcher is not None:
            row = self.matcher.next_mask(output, drafts)
            if row is None:
                return None
        else:
            row = np.full(self.words, -1, np.int32)
        if self.processors is not None:
            self.processors.mask_row(row, output, drafts)
            self._dead_end(row, output, drafts, deciding)
        return row

    def _dead_end(self, row: np.ndarray, output: list[int], drafts: Seq[int], deciding: bool) -> None:
        """A row the processors' masks (and the grammar) leave empty: refused now where it decides a token
        (the host's, a verify's first), else recorded (a head's row after the answer's last token is
        reached and decides nothing)."""
        if not row.any():
            position = len(output) + len(drafts)
            self.dead_ends.found(output, drafts, self.processors.filters(position), deciding)

    def process(self, logits: np.ndarray, output: list[int]) -> np.ndarray:
        """One row of logits [V] after every rule, for the token after `output` (process_rows)."""
        return process_rows([self], [output], logits[None])[0]


def prepare_masks(rows: list[tuple[TokenRules, list[int], list[int]]]) -> None:
    """Before a batch's masks are read (rules, output, drafts per row): each grammar's state moved to
    output + drafts, and the masks those states lack computed together (grammar.fill_masks)."""
    fill_masks([r.matcher for r, output, drafts in rows if r.matcher is not None and r.matcher.at(output, drafts)])


def process_rows(rules: list[TokenRules], outputs: list[list[int]], logits: np.ndarray) -> np.ndarray:
    """Rows of logits [n, V] after each row's rules, for the token after its output: edited (every
    row's edit list at once, in the verify graph's float32 order), then masked (-inf where forbidden,
    only in rows that have a mask now). A float32 copy."""
    out = logits.astype(np.float32, copy=True)
    edited = [i for i, r in enumerate(rules) if r.edits]
    if edited:
        for i in edited:
            rules[i].processors.sync(outputs[i])
        ids, values = pad_edits([rules[i].processors.row_edits() for i in edited])
        if len(edited) == len(rules):
            _edit_in_place(out, ids, values)
        else:
            part = out[edited]
            _edit_in_place(part, ids, values)
            out[edited] = part
    for i, (r, output) in enumerate(zip(rules, outputs)):
        if r.matcher is not None or r.processors.masks(output):
            keep = allowed_tokens(r.next_mask(output, [], deciding=True), r.vocab_size)
            out[i, ~keep[: out.shape[1]]] = -np.inf
    return out
