"""Engine calls on scratch inputs, for timing each graph a round uses (`LLM.latency_cases`,
`tandem profile`'s latency table). Every row points at the scratch page and slot: the call's
cost is real (the context's pages are read), its values are thrown away and nothing is committed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from tandem.graph_kinds import TARGET_STEP, VERIFY_GREEDY, GraphKind
from tandem.pipeline.allocator import SCRATCH
from tandem.pipeline.model_runner import Rows

if TYPE_CHECKING:
    from tandem.pipeline.llm import LLM


def latency_cases(llm: LLM, batch: int, context: int) -> list[tuple[GraphKind, int, Callable[[], object]]]:
    """(graph, rows a sequence sends, call) for every call shape a round at this batch size makes:
    the target step, the greedy verify at each width, head 0 over 1 .. the widest width's rows."""
    pages = [SCRATCH] * (-(-(context + 16) // llm.page_size))
    runner = llm.runner

    def rows(w: int, hidden: bool = False) -> list[Rows]:
        h = np.zeros((w, llm.desc.hidden_size), np.float32) if hidden else None
        return [Rows(ids=[1] * w, context=context, pages=pages, hidden=h) for _ in range(batch)]

    widths = sorted(llm.verify_widths)
    cases = [(TARGET_STEP, 1, lambda: runner.target_step(rows(1)))]
    cases += [(VERIFY_GREEDY, w, lambda w=w: runner.verify(rows(w), sampling=False)) for w in widths]
    if llm.mtp_layers:
        cases += [(GraphKind.mtp_head(0), r, lambda r=r: runner.head(0, rows(r, hidden=True)))
                  for r in range(1, max(widths, default=1) + 1)]
    return cases
