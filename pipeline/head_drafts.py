"""The heads' side of a speculative round (a mixin of RoundLoop, pipeline/round_loop.py): drafting
d_2 .. d_k with the heads over the chain of their own rows, and re-anchoring every head over the rows
a round committed, which leaves head 0's draft d_1 for the next round. Grammar requests draft under
their masks: each head call's last row is drafted under the mask of the tokens so far."""

from __future__ import annotations

import numpy as np

from tandem import contract as c
from tandem.pipeline.logits_processors import prepare_masks
from tandem.pipeline.model_runner import Rows
from tandem.pipeline.sequence import Sequence


def _head_rows(j: int, base: int, n: int) -> tuple[int, int]:
    """Previous-head anchoring: head j's row q pairs tokens[q+1+j] with head j-1's hidden at row q,
    so when head 0 commits rows base .. base+n-1, head j commits rows first .. first+count-1 with
    the last `count` new tokens (rows below 0 do not exist: early in a prompt head j has fewer)."""
    first = max(0, base - j)
    return first, max(0, base + n - j) - first


def _last_row_mask(mask: np.ndarray | None, rows: int) -> np.ndarray | None:
    """A head call's grammar masks [rows, words]: all ones but its last row, whose draft is taken
    under `mask` (None: no grammar, nothing bound)."""
    if mask is None:
        return None
    masks = np.full((rows, len(mask)), -1, np.int32)
    masks[-1] = mask
    return masks


class HeadDrafts:
    """Reads the loop's runner, pools, phases, round_k and chaining settings."""

    def _draft(self, seqs: list[Sequence]) -> dict[str, list[int]]:
        """d_1 comes from the last re-anchor; steps s = 1..k-1 extend the chain. Head s drafts over
        rows (d_1, x_0) .. (d_s, x_{s-1}): x_i is the hidden of draft step i's last row (target
        anchoring), or for previous-head anchoring head s-1's hidden of the same rows, starting
        with its last committed row (see _head_rows)."""
        drafts = {s.request_id: [s.draft] if s.draft_prob >= s.params.p_min and self.round_k(s, len(seqs)) else []
                  for s in seqs}
        chains = {s.request_id: [s.chain_hidden] for s in seqs}
        limit = {s.request_id: self.round_k(s, len(seqs)) for s in seqs}
        stopped = set()     # a unified round's draft below p_min ends the chain there
        for s in seqs:      # drafts the last unified round made past d_1 (with their chain hidden)
            for token, prob, hidden in s.ahead:
                if len(drafts[s.request_id]) != len(chains[s.request_id]) or len(drafts[s.request_id]) >= limit[
                        s.request_id]:
                    break
                if prob < s.params.p_min:
                    stopped.add(s.request_id)
                    break
                drafts[s.request_id].append(token)
                chains[s.request_id].append(hidden)
        for step in range(1, max(limit.values())):
            active = [s for s in seqs if len(drafts[s.request_id]) == step < limit[s.request_id]
                      and s.request_id not in stopped]
            head = step % self.mtp_layers if self.chained else 0
            ruled = [s for s in active if s.rules is not None]
            grammar = {}
            if ruled:
                with self._phase("grammar"):      # (inside "draft": the heads' masks, a batch's together)
                    prepare_masks([(s.rules, s.output_ids(), drafts[s.request_id]) for s in ruled])
                    grammar = {s.request_id: s.rules.next_mask(s.output_ids(), drafts[s.request_id]) for s in ruled}
            stopped.update(rid for rid, mask in grammar.items() if mask is None)   # a draft the grammar refuses
            active = [s for s in active if s.request_id not in stopped]
            if not active:      # (stored drafts: a sequence may start past this step)
                continue
            rows = []
            for s in active:
                # previous-head anchoring: head s's committed rows end s rows before head 0's
                n = min(step, s.head_committed) if self.by_previous_head else step
                context = s.head_committed - (step if self.by_previous_head else 0)
                rows.append(Rows(ids=drafts[s.request_id][step - n :], context=context + step - n,
                                 pages=s.table.pages, hidden=np.stack(chains[s.request_id][-n:]),
                                 bitmask=_last_row_mask(grammar.get(s.request_id), n),
                                 edits=s.rules.head_edits(s.output_ids(), drafts[s.request_id], n)
                                 if s.rules is not None else None))
            for seq, out, r in zip(active, self.runner.head(head, rows).rows(), rows):
                if out[c.DRAFT_PROB] >= seq.params.p_min:
                    drafts[seq.request_id].append(int(out[c.DRAFT_TOKEN]))
                    if self.by_previous_head:  # the next head pairs these rows' hidden, after its own last row's
                        carry = [seq.carries[head]] if head in seq.carries else []
                        chains[seq.request_id] = [*carry, *out[c.HIDDEN_ROWS][: len(r.ids)].copy()]
                    else:
                        chains[seq.request_id].append(out[c.HIDDEN_OUT].copy())
        return drafts

    def _reanchor(self, work: list[tuple[Sequence, list[int], np.ndarray]]) -> None:
        """Run every head over the newly committed (token, hidden) rows and commit them; head 0's
        last row gives the next round's first draft. Target anchoring: every head pairs the new
        tokens with the target's hidden. Previous-head anchoring: head j pairs them with head j-1's
        hidden of the same rows (_head_rows), so heads run in order and each keeps its hidden at its
        last committed row (`carries`) for the next head's first row."""
        heads = range(self.mtp_layers) if self.chained else range(1)
        for s, _, _ in work:
            if s.head_committed == 0:   # a fresh (or recomputed) sequence
                s.carries.clear()
        previous: dict[int, np.ndarray] = {}  # id(seq) -> head j-1's hidden of head j's new rows
        for j in heads:
            batch = []
            for s, ids, h in work:
                if j and self.by_previous_head:
                    first, count = _head_rows(j, s.head_committed, len(ids))
                    if count:
                        batch.append((s, ids[len(ids) - count :], previous[id(s)][:count], first))
                else:
                    batch.append((s, ids, h, s.head_committed))
            if not batch:
                continue
            rows = []
            if j == 0:
                prepare_masks([(s.rules, s.output_ids(), []) for s, *_ in batch if s.rules is not None])
            for s, ids, h, first in batch:
                ruled = j == 0 and s.rules is not None    # head 0 drafts d_1 under the rules
                rows.append(Rows(ids=ids, context=first, pages=s.table.pages, hidden=h,
                                 bitmask=_last_row_mask(s.rules.next_mask(s.output_ids(), []), len(ids)) if ruled
                                 else None, edits=s.rules.head_edits(s.output_ids(), [], len(ids)) if ruled else None))
            outs = self.runner.head(j, rows)
            layer = c.mtp_layer_name(j)
            self.pools.write_rows([layer], outs.arrays, np.arange(len(batch)), np.array([len(r.ids) for r in rows]),
                                  np.array([r.context for r in rows]), [s.table.pages for s, *_ in batch])
            if self.by_previous_head:
                for i, (s, ids, _, first) in enumerate(batch):
                    new = outs.arrays[c.HIDDEN_ROWS][i, : len(ids)]
                    # head j+1's new rows start one row before head j's: at head j's last committed row
                    previous[id(s)] = np.concatenate([s.carries[j][None], new]) if first else new.copy()
                    s.carries[j] = new[-1].copy()
            if j == 0:
                for (seq, *_), out in zip(batch, outs.rows()):
                    seq.draft, seq.draft_prob = int(out[c.DRAFT_TOKEN]), float(out[c.DRAFT_PROB])
                    seq.chain_hidden = out[c.HIDDEN_OUT].copy()
                    seq.ahead = []
        for seq, ids, _ in work:
            seq.head_committed += len(ids)
