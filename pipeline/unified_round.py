"""The unified round: one engine call per speculative round (export/round_graph.py), then the
commits of the trunk's and every head's accepted rows and the sequences' updates.

    drafts    d_1..d_k from RoundLoop._draft: the last round's next drafts (its output below), or after
              a prefill / a multi-call round, d_1 from the re-anchor and d_2..d_k from draft calls
        |
    round     one call over [T, d_1..d_k]: verify + acceptance, re-anchor, next drafts
              -> a, T', d'_1..d'_k with their probabilities and chain hidden g_0..g_{k-1}
        |
    commit    trunk K/V rows 0..a and the states after row a; every head's rows 0..a at c..c+a
        v
    sequence  tokens += d_1..d_a, T'; committed, head_committed += a + 1;
              draft, draft_prob, chain_hidden = d'_1, p_1, g_0; ahead = (d'_s, p_s, g_{s-1}), s >= 2

Same invariant as the multi-call round (pipeline/round_loop.py): the pools hold accepted rows only,
and the next drafts are the ones the multi-call round would draft from the same state (the host
cuts them by p_min and the next round's k).
"""

from __future__ import annotations

import numpy as np

from tandem import contract as c
from tandem.checkpoint.description import ModelDescription
from tandem.graph_kinds import GraphKind
from tandem.pipeline.model_runner import ModelRunner, Rows
from tandem.pipeline.pools import Pools
from tandem.pipeline.sequence import Sequence


class UnifiedRound:
    """Runs rounds on the unified graphs an engine dir holds: `kinds` are its round graph kinds
    (one head mode, the one the engine drafts with)."""

    def __init__(self, desc: ModelDescription, runner: ModelRunner, pools: Pools, kinds: list[GraphKind]):
        modes = {k.reused for k in kinds}
        if len(modes) != 1:
            raise ValueError(f"unified round graphs of one head mode expected, got {sorted(k.name for k in kinds)}")
        self.runner, self.pools = runner, pools
        self.kinds = {(k.sampling, k.drafts + 1): k for k in kinds}
        self.heads = [c.mtp_layer_name(j) for j in c.round_heads(desc, kinds[0])]
        self.layers = [*runner.trunk_kv, *self.heads]      # the paged layers a round commits

    def serves(self, width: int, sampling: bool) -> bool:
        return (sampling, width) in self.kinds

    def run(self, seqs: list[Sequence], rows: list[Rows], drafts: dict[str, list[int]], width: int,
            sampling: bool) -> None:
        # target anchoring: the heads have committed as many rows as the target (head_committed ==
        # committed, RoundLoop._catch_up), so the trunk's and the heads' rows go to the same positions;
        # checked before the call, which may write the states into the pools (commits=True)
        if any(s.head_committed != s.committed for s in seqs):
            raise RuntimeError("unified round over heads that lag the target: re-anchor them first")
        outs = self.runner.round(self.kinds[(sampling, width)], rows, commits=True)
        n = len(seqs)
        accepted = np.array(outs.arrays[c.ACCEPTED][:n], dtype=np.int64)     # host copies: [n], [n], [n, k]
        nxt = np.array(outs.arrays[c.NEXT_TOKEN][:n], dtype=np.int64)
        ahead = np.array(outs.arrays[c.NEXT_DRAFTS][:n], dtype=np.int64)
        probs = np.array(outs.arrays[c.DRAFT_PROBS][:n], dtype=np.float32)
        chain = np.array(outs.arrays[c.DRAFT_HIDDEN][:n])
        starts, tables = [s.committed for s in seqs], [s.table.pages for s in seqs]
        self.pools.write_rows(self.layers, outs.arrays, range(n), accepted + 1, starts, tables)
        self.pools.commit_states(outs.arrays, np.arange(n), np.array([s.slot for s in seqs]))
        for i, seq in enumerate(seqs):
            a = int(accepted[i])
            seq.metrics.record_round(len(drafts[seq.request_id]), a)
            seq.tokens += drafts[seq.request_id][:a] + [int(nxt[i])]
            seq.committed += a + 1
            seq.head_committed += a + 1
            seq.draft, seq.draft_prob, seq.chain_hidden = int(ahead[i, 0]), float(probs[i, 0]), chain[i, 0]
            seq.ahead = [(int(ahead[i, s]), float(probs[i, s]), chain[i, s]) for s in range(1, width - 1)]
