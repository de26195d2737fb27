"""Plain greedy decoding n tokens per engine call, on the multi-step decode graph an engine dir
holds (`tandem build-engines --decode-steps n`, export/decode_graph.py).

    call      each sequence's pending token T at position c  ->  t_1 .. t_n
    commit    the n rows at positions c .. c+n-1 (T, t_1 .. t_{n-1}) and the states after them
    sequence  tokens += t_1 .. t_n; committed += n

The same invariant as n plain decode steps: the pools hold the rows of every token but the
pending one. A sequence takes the call only while its token budget holds n more tokens
(Sequence.decode_rows: greedy, no grammar), so no position past the request's admitted length is
written; a stop inside the call ends the output there (RoundLoop._postprocess drops what follows,
and the sequence, finished, never reads its extra rows).
"""

from __future__ import annotations

import numpy as np

from tandem import contract as c
from tandem.graph_kinds import GraphKind
from tandem.pipeline.model_runner import ModelRunner
from tandem.pipeline.pools import Pools
from tandem.pipeline.sequence import Sequence


class MultiStepDecode:
    samples = False           # greedy rows only: the graph takes each step's argmax

    def __init__(self, runner: ModelRunner, pools: Pools, kind: GraphKind):
        if not kind.is_decode:
            raise ValueError(f"a multi-step decode graph kind expected, got {kind.name}")
        self.runner, self.pools, self.kind = runner, pools, kind
        self.steps = kind.steps

    def run(self, seqs: list[Sequence]) -> list[Sequence]:
        """One call for the sequences that can take n tokens; returns the others (one token a call)."""
        multi, rest = [], []
        for s in seqs:
            (multi if s.decode_rows(self.steps, self.samples) == self.steps else rest).append(s)
        if multi:
            self._call(multi)
        return rest

    def _call(self, seqs: list[Sequence]) -> None:
        steps, n = self.steps, len(seqs)
        outs = self.runner.decode_steps(self.kind, seqs)
        self.pools.write_rows(self.runner.trunk_kv, outs.arrays, range(n), [steps] * n, [s.committed for s in seqs],
                              [s.table.pages for s in seqs])
        self.pools.commit_states(outs.arrays, np.arange(n), np.array([s.slot for s in seqs]))
        for seq, new in zip(seqs, outs.arrays[c.NEXT_TOKENS][:n].tolist()):
            seq.committed += steps
            seq.tokens += new
