"""LLM.isolate_failure (pipeline/failure_isolation.py), offline: after a step raised, the request that
makes engine calls raise is found, aborted and reported with its error; the others finish with the
tokens they get alone; a fault that no request reproduces alone fails nobody."""

from __future__ import annotations

from tandem.pipeline.llm import LLM
from tandem.pipeline.sampling_params import SamplingParams

PROMPTS = [[5, 17, 33, 200, 7], [9, 120, 77, 301], [44, 45, 46]]
MARK = 383                      # three of these in one engine row make the injected fault fire
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _run(llm: LLM, prompts) -> tuple[dict[str, list[int]], dict[str, Exception], int]:
    """Every request to its end, isolating whenever a step raises: (tokens by request id, the
    failed ones with their errors, how many steps raised); request i's id is f"p{i}"."""
    seqs = [llm.add_request(p, GREEDY, request_id=f"p{i}") for i, p in enumerate(prompts)]
    failed, raised = {}, 0
    while llm.has_unfinished_requests():
        try:
            llm.step()
        except RuntimeError:
            raised += 1
            failed.update(llm.isolate_failure().failed)
    return {s.request_id: s.output_ids() for s in seqs if s.request_id not in failed}, failed, raised


def _faulty(llm: LLM, fires):
    real = llm.runner._call

    def call(graph, rows, fixed, commits=False):
        if fires(rows):
            raise RuntimeError("injected fault")
        return real(graph, rows, fixed, commits)
    return call


def test_the_request_that_makes_steps_raise_fails_alone(engine_dirs, monkeypatch):
    alone = [LLM(engine_dirs["qwen3_5_mtp3"]).generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    llm = LLM(engine_dirs["qwen3_5_mtp3"])
    monkeypatch.setattr(llm.runner, "_call", _faulty(llm, lambda rows: any(list(r.ids).count(MARK) >= 3
                                                                          for r in rows)))
    outputs, failed, raised = _run(llm, [*PROMPTS, [5, MARK, MARK, MARK, 7]])
    assert raised >= 1 and list(failed) == ["p3"] and "injected fault" in str(failed["p3"])
    assert list(outputs.values()) == alone
    assert llm.stats().running == 0 and llm.stats().waiting == 0


def test_a_fault_no_request_reproduces_alone_fails_nobody(engine_dirs, monkeypatch):
    alone = [LLM(engine_dirs["qwen3_5_mtp3"]).generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    llm = LLM(engine_dirs["qwen3_5_mtp3"])
    once = [True]

    def first_batched_call(rows):
        fire = once[0] and len(rows) > 1
        once[0] = once[0] and not fire
        return fire
    monkeypatch.setattr(llm.runner, "_call", _faulty(llm, first_batched_call))
    outputs, failed, raised = _run(llm, PROMPTS)
    assert raised == 1 and failed == {}
    assert list(outputs.values()) == alone
