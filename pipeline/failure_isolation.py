"""Find the request that makes a round raise, so that it alone fails (`LLM.isolate_failure`).

    round raises -> preempt every running sequence (pages and slot freed; it is recomputed from
                    its tokens, as after any preemption)
                 -> each one alone: rounds until it commits a new token (or finishes)
                        ok     -> preempted again, back in the queue in its place
                        raises -> aborted; reported with its error
    A fault that no request reproduces alone (a transient one) fails nobody. Sequences queued but
    not yet running when the round raised keep their places behind the survivors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.pipeline.outputs import StepOutput
from tandem.pipeline.sequence import Sequence, Status

if TYPE_CHECKING:
    from tandem.pipeline.llm import LLM


@dataclass
class Isolation:
    outputs: list[StepOutput] = field(default_factory=list)   # what the rounds run alone produced, in order
    failed: dict[str, Exception] = field(default_factory=dict)  # request id -> the error it raises alone


def isolate_failure(llm: LLM) -> Isolation:
    sched, result = llm.scheduler, Isolation()
    suspects = list(sched.running)
    for seq in reversed(suspects):  # reversed: preempt() puts each at the front of the queue
        sched.preempt(seq)
    queued = [s for s in sched.waiting if s not in suspects]  # never ran in the failed round
    sched.waiting.clear()
    survivors = []
    for seq in suspects:
        sched.waiting.append(seq)
        try:
            _run_alone(llm, seq, result.outputs)
        except Exception as e:  # noqa: BLE001 - this request makes rounds raise
            llm.abort(seq.request_id)
            result.failed[seq.request_id] = e
            continue
        if seq.status != Status.FINISHED:
            sched.preempt(seq)
            sched.waiting.remove(seq)
            survivors.append(seq)
    sched.waiting.extend(survivors + queued)
    return result


def _run_alone(llm: LLM, seq: Sequence, outputs: list[StepOutput]) -> None:
    """Rounds with `seq` the only sequence, until it commits a token past those it had (after
    recomputing them) or finishes."""
    had = len(seq.tokens)
    for _ in range(seq.prefill_target // llm.scheduler.prefill_chunk + 3):
        outputs.extend(llm.step())
        if seq.status == Status.FINISHED or (seq.status == Status.DECODE and len(seq.tokens) > had):
            return
