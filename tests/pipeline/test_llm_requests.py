"""The offline API's side of bad input: `LLM.add_request` refuses what the engines cannot run (the
same checks the server runs), and a failed request never stays in the scheduler."""

from __future__ import annotations

import pytest

from tandem.pipeline.llm import LLM
from tandem.pipeline.sampling_params import SamplingParams

VOCAB = 384
MARK = VOCAB - 1


@pytest.fixture(scope="module")
def llm(engine_dirs):
    return LLM(engine_dirs["qwen3_5_mtp3"])


def _idle(llm: LLM) -> bool:
    return not llm.scheduler.has_work() and llm.pages.available == llm.pages.size - 1


BAD = [
    ([VOCAB], {}, "prompt[0]: token id 384 is outside the vocabulary [0, 384)"),
    ([-5000], {}, "prompt[0]: token id -5000 is outside"),
    ([100, -1], {}, "prompt[1]: token id -1 is outside"),
    ([2**64], {}, "prompt[0]: token id 18446744073709551616"),
    ([True], {}, "prompt[0] must be an integer token id, got bool"),
    ([], {}, "prompt is empty"),
    ("", {}, "prompt is empty"),
    ("a\ud800b", {}, "prompt is not valid Unicode: a lone surrogate '\\ud800' at index 1; send valid Unicode"),
    (7, {}, "prompt must be a string or a list of token ids"),
    ("x", {"top_k": 2**70}, "top_k=1180591620717411303424 is out of range"),
    ("x", {"seed": 2**64}, "seed=18446744073709551616 is out of range"),
    ("x", {"max_tokens": 2**64}, "max_tokens=18446744073709551616 is out of range"),
    ("x", {"k": 2**64}, "spec_k=18446744073709551616 is out of range"),
    ("x", {"stop": ("\udfff",)}, "stop[0] is not valid Unicode"),
]


@pytest.mark.parametrize("prompt,params,message", BAD)
def test_bad_requests_are_refused_naming_the_field(llm, prompt, params, message):
    with pytest.raises(ValueError) as e:
        llm.add_request(prompt, SamplingParams(**params))
    assert message in str(e.value)
    assert _idle(llm)


def test_generate_checks_every_prompt_before_queueing_any(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt\[0\]: token id 999"):
        llm.generate(["def add(a, b):", [999]], SamplingParams(max_tokens=4))
    assert _idle(llm)


def test_a_step_that_raises_leaves_nothing_behind_and_the_next_generate_works(llm, monkeypatch):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    reference = llm.generate(["def add(a, b):"], params)[0].token_ids
    real = llm.runner._call

    def faulty(graph, rows, fixed, commits=False):
        if any(list(r.ids).count(MARK) >= 3 for r in rows):
            raise RuntimeError("injected fault")
        return real(graph, rows, fixed, commits)

    monkeypatch.setattr(llm.runner, "_call", faulty)
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.generate(["def add(a, b):", [5, MARK, MARK, MARK]], params)
    assert _idle(llm)  # both of that call's sequences aborted, their pages and slots freed
    assert llm.generate(["def add(a, b):"], params)[0].token_ids == reference


def test_closing_a_stream_early_aborts_its_request(llm):
    chunks = llm.stream("def add(a, b):", SamplingParams(max_tokens=50, ignore_eos=True))
    next(chunks)
    assert llm.scheduler.has_work()
    chunks.close()
    assert _idle(llm)


def _container_sizes(llm: LLM) -> dict[str, int]:
    """len() of every dict/list/set the pipeline's long-lived objects hold."""
    owners = {"llm": llm, "engine": llm.round_loop, "scheduler": llm.scheduler, "runner": llm.runner}
    return {f"{o}.{k}": len(v) for o, obj in owners.items() for k, v in vars(obj).items()
            if isinstance(v, (dict, list, set)) and f"{o}.{k}" not in _PER_BUCKET}


# one entry per (graph, batch, width, pages) bucket that has run (and per batch row count, for the
# outputs' views), one per graph kind or engine file that has run, one per round engine seen open: bounded by the
# engine dir, not by requests (which graph kinds a run reaches depends on the adaptive width's timings)
_PER_BUCKET = {"runner._bindings", "runner._views", "runner._decode_fills", "runner._consecutive", "runner.calls",
               "runner.seconds", "runner._tables", "runner._io", "runner._engine_of", "runner._engine_runs",
               "engine._open"}


def test_ended_requests_leave_no_per_request_state(llm):
    """Finished and aborted requests (aborted after their first output) keep nothing alive in the
    engine, scheduler, runner or LLM: a server aborts requests all day."""
    def one(i: int) -> None:
        stream = llm.stream(f"request {i}", SamplingParams(max_tokens=32, ignore_eos=True))
        next(stream)
        stream.close()                      # aborts it mid-generation
        llm.generate([f"done {i}"], SamplingParams(max_tokens=3))

    one(10)
    before = _container_sizes(llm)
    for i in range(10, 30):
        one(i)
    assert _idle(llm)
    grown = {k: (before.get(k, 0), n) for k, n in _container_sizes(llm).items() if n > before.get(k, 0)}
    assert not grown, f"per-request state left behind: {grown}"
