"""Decode bursts (pipeline/decode_burst.py): plain greedy rows run up to n target steps per engine
step. A burst is the same engine calls as n engine steps of one token each, so everything it
leaves is the same bits: the tokens, the finish reasons, the pools; stops and budgets end it
where one token a step would have ended, with no call more."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.engines.builder import build_engines
from tandem.engines.options import BuildOptions
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams
from tandem.testing.tiny_checkpoints import write_tiny_checkpoint

BURST = 4
PROMPTS = [[5, 17, 33, 200, 7, 64, 91], [9, 120, 77, 301, 15], [3]]


@pytest.fixture(scope="module", params=["qwen3_5_mtp3", "step3p5"])   # step3p5: window pages released
def built(request, tmp_path_factory):
    kind, root = request.param, tmp_path_factory.mktemp("decode_burst")
    write_tiny_checkpoint(root / kind, kind)
    out = root / "engines"
    build_engines(root / kind, out, BuildOptions(batch_sizes=(1, 4), prefill_chunk=8, max_seq_len=64,
                                                      page_size=4, no_mtp=True), show_progress=False)
    return out


@pytest.fixture(params=["native", "numpy"])
def steps(request):
    """How a burst's steps between calls run: the engine dir's native step, or numpy's."""
    return request.param


def _open(engine_dir, burst: int, steps: str = "native", **config) -> LLM:
    llm = LLM(engine_dir, RuntimeConfig(decode_burst=burst, **config))
    if llm.round_loop.decode is not None:
        assert llm.round_loop.decode.native is not None    # the test dirs carry the kernel library
        if steps == "numpy":
            llm.round_loop.decode.native = None
    return llm


def _generate(engine_dir, burst: int, params, prompts=PROMPTS, steps: str = "native", **config):
    llm = _open(engine_dir, burst, steps, **config)
    results = llm.generate(prompts, params)
    if llm.round_loop.decode is not None:
        assert (llm.round_loop.decode.native_calls > 0) == (steps == "native" and llm.round_loop.decode.bursts > 0)
    return [(r.token_ids, r.finish_reason) for r in results], llm


@pytest.mark.parametrize("max_tokens", [BURST * 5 + 2, BURST - 1, BURST])
def test_bursts_emit_what_one_token_a_step_emits(built, max_tokens, steps):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    plain, one = _generate(built, 1, params)
    burst, llm = _generate(built, BURST, params, steps=steps)
    assert burst == plain
    assert one.round_loop.decode is None
    assert llm.runner.calls["target_step"] == one.runner.calls["target_step"]    # no call more
    # a burst takes what the budget holds (no position past the request's is written): with the prompt's
    # token and the step that sends the first output, 3 tokens leave 1 (no burst), 4 leave 2
    assert (llm.round_loop.decode.bursts > 0) == (max_tokens >= 4)
    if max_tokens > BURST:
        assert llm.round_loop.stats.rounds < one.round_loop.stats.rounds


def _live_rows_at_finish(llm) -> dict:
    """Every pool's rows the finished request still held, by logical position (paged: the positions of
    the pages its tables held in each page group; states: its slot), taken as the scheduler lets it go."""
    seen, finish = {}, llm.round_loop.scheduler.finish

    def snapshot(seq, reason):
        page_size = llm.pools.page_size
        for layer, group in llm.pools.paged.items():
            windows = {spec.name: spec.window for spec in llm.pools._specs[layer].paged}
            for name, pool in group.items():
                table = seq.table.groups[windows[name]]
                rows = range(table.released * page_size, seq.committed)
                seen[f"{layer}.{name}"] = np.stack([pool[table.pages[r // page_size], r % page_size] for r in rows])
        for layer, group in llm.pools.states.items():
            for name, pool in group.items():
                seen[f"{layer}.{name}"] = pool[seq.slot].copy()
        finish(seq, reason)

    llm.round_loop.scheduler.finish = snapshot
    return seen


@pytest.mark.parametrize("budget_ms", [1e6, 1e-6])   # whole bursts; bursts the clock cuts after one call
def test_the_pools_after_a_burst_are_those_after_one_token_a_step(built, budget_ms, steps):
    """commit(n) == n decode steps: every row and state the request holds when it finishes is equal bit
    for bit. By logical position: a window group's pages go back once per burst, not once a step, so
    after a burst the clock cut short the same rows may sit in other pages."""
    params = SamplingParams(max_tokens=BURST * 3 + 1, ignore_eos=True)
    one = LLM(built, RuntimeConfig(decode_burst=1))
    burst = _open(built, BURST, steps, decode_burst_ms=budget_ms)
    rows_one, rows_burst = _live_rows_at_finish(one), _live_rows_at_finish(burst)
    assert one.generate(PROMPTS[:1], params)[0].token_ids == burst.generate(PROMPTS[:1], params)[0].token_ids
    assert burst.round_loop.decode.calls >= BURST * 2
    assert rows_one.keys() == rows_burst.keys() and rows_one
    for name, rows in rows_one.items():
        assert np.array_equal(rows_burst[name], rows), name


def test_a_stop_inside_a_burst_ends_the_output_and_the_burst_there(built, steps):
    free, _ = _generate(built, 1, SamplingParams(max_tokens=3 * BURST, ignore_eos=True))
    ids = free[0][0]       # tokens 0 (the prefill's) and 1 (the first output's step) come before the bursts
    at = next(i for i in range(3, len(ids)) if (i - 2) % BURST == 1 and ids[i] not in ids[:i])
    stop = ids[at]         # the first prompt's first token there: second of a burst, more would follow
    params = SamplingParams(max_tokens=3 * BURST, ignore_eos=True, stop_token_ids=(stop,))
    plain, _ = _generate(built, 1, params)
    burst, _ = _generate(built, BURST, params, steps=steps)
    assert burst == plain and burst[0][1] == "stop" and len(burst[0][0]) == at
    alone, one = _generate(built, 1, params, prompts=PROMPTS[:1])    # alone: no call after the stop
    burst, llm = _generate(built, BURST, params, prompts=PROMPTS[:1], steps=steps)
    assert burst == alone and llm.runner.calls["target_step"] == one.runner.calls["target_step"]


def test_a_stop_string_inside_a_burst_ends_the_output_there(built):
    params = SamplingParams(max_tokens=3 * BURST, ignore_eos=True)
    free, one = _generate(built, 1, params)
    text = one.tokenizer.decode(free[0][0][: BURST + 2])
    stop = text[-3:] if len(text.strip()) >= 3 else None
    if stop is None:
        pytest.skip("the first prompt's early text is too short for a stop string")
    params = SamplingParams(max_tokens=3 * BURST, ignore_eos=True, stop=[stop])
    plain, _ = _generate(built, 1, params)
    burst, _ = _generate(built, BURST, params)
    assert burst == plain and burst[0][1] == "stop"


def test_sampled_and_greedy_rows_burst_together(built, steps):
    """Sampled rows burst beside greedy ones: step s of a burst draws with the uniform of the index
    its token fills (sampling depends on the seed and positions only), so every request emits what
    it emits alone with one token a step, and the pools end the same."""
    greedy = SamplingParams(max_tokens=BURST * 4, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=BURST * 3 + 1, ignore_eos=True, temperature=0.9, seed=11),
               SamplingParams(max_tokens=BURST * 3, ignore_eos=True, temperature=1.3, top_k=20, top_p=0.9, seed=5),
               SamplingParams(max_tokens=BURST * 2, ignore_eos=True, temperature=0.7, seed=2)]
    params = [greedy] * 3 + sampled
    expected = [_generate(built, 1, p, prompts=[prompt])[0][0] for prompt, p in zip(PROMPTS * 2, params)]
    llm = _open(built, BURST, steps)
    bursts = []
    real = llm.round_loop.decode._burst
    llm.round_loop.decode._burst = (lambda seqs, *rest:
                                    bursts.append({s.params.greedy for s in seqs}) or real(seqs, *rest))
    results = llm.generate(PROMPTS * 2, params)
    assert [(r.token_ids, r.finish_reason) for r in results] == expected
    assert {False, True} in bursts           # greedy and sampled rows in one burst
    assert llm.round_loop.decode.calls > llm.round_loop.decode.bursts


def test_rows_with_rules_and_logprobs_burst_as_one_token_a_step(built, steps):
    """Rows with logits processors, a grammar or logprobs burst too, beside free ones: each step's
    token is the one a plain step decides from the counts, grammar state and position the earlier
    steps of the burst left, so every request emits what the same batch emits one token a step (tokens,
    finish reasons and logprobs, the same bits)."""
    from tandem.pipeline.grammar import GrammarSpec

    n = BURST * 3 + 1
    params = [SamplingParams(max_tokens=n, ignore_eos=True),
              SamplingParams(max_tokens=n, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0,
                             repetition_penalty=1.8, logit_bias=((17, 2.0),), logprobs=2),
              SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.9, seed=3, min_p=0.1,
                             frequency_penalty=2.0, logprobs=0),
              SamplingParams(max_tokens=n, grammar=GrammarSpec("regex", "[a-f0-9 ]{0,40}")),
              SamplingParams(max_tokens=n, ignore_eos=True, min_tokens=n - 2, logprobs=3, temperature=1.1, seed=8)]
    prompts = (PROMPTS * 2)[: len(params)]

    def run(burst: int, prompts, params):
        llm = _open(built, burst, steps)
        return [(r.token_ids, r.finish_reason, [(e.token, e.logprob, e.top) for e in r.logprobs or []])
                for r in llm.generate(prompts, params)], llm

    expected, _ = run(1, prompts, params)
    got, llm = run(BURST, prompts, params)
    assert got == expected
    assert llm.round_loop.decode.calls > 2 * llm.round_loop.decode.bursts > 0


def test_greedy_rows_with_edits_only_burst_natively_as_one_token_a_step(built, monkeypatch):
    """Greedy rows whose processors only edit (penalties, logit_bias) run the native step too
    (tandem_burst_edited: edits applied, counts moved on in the library), beside free rows and one
    whose min_tokens is reached partway (it takes the host's steps until then): the same tokens as
    one token a step, the same logprobs (of the raw rows, copied before their edits), and the
    processors' state after it is the one the host's steps leave."""
    n = BURST * 4 + 1
    params = [SamplingParams(max_tokens=n, ignore_eos=True),
              SamplingParams(max_tokens=n, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0,
                             repetition_penalty=1.8, logit_bias=((17, 2.0), (40, -3.5)), logprobs=2),
              SamplingParams(max_tokens=n, ignore_eos=True, frequency_penalty=0.7, min_tokens=5),
              SamplingParams(max_tokens=n, ignore_eos=True, logit_bias=((3, 9.0),)),
              SamplingParams(max_tokens=n, ignore_eos=True, logprobs=3)]
    prompts = (PROMPTS * 2)[: len(params)]

    def run(burst: int, steps: str):
        llm = _open(built, burst, steps)
        seqs = [llm.add_request(p, q) for p, q in zip(prompts, params)]
        while any(s.finish_reason is None for s in seqs):
            llm.step()
        ruled = [s for s in seqs if s.rules is not None]
        for s in ruled:      # (the host counts lazily, before each use: bring both up to the end)
            s.rules.processors.sync(s.output_ids())
        state = [(s.rules.processors.ids.tolist(), s.rules.processors.counts.copy(), s.rules.processors.values.copy())
                 for s in ruled]
        return [(s.tokens, [(e.token, e.logprob, e.top) for e in s.logprobs or []]) for s in seqs], state, llm

    from tandem.pipeline.native_burst import BurstPlan

    edited, real = [], BurstPlan.edited
    monkeypatch.setattr(BurstPlan, "edited", lambda self, step, rows: edited.append(step) or real(self, step, rows))
    (expected, expected_state, _), (got, state, llm) = run(1, "native"), run(BURST, "native")
    assert got == expected and len(edited) > llm.round_loop.decode.bursts   # the native edited step ran
    for (ids, counts, values), (ids2, counts2, values2) in zip(expected_state, state):
        assert ids == ids2 and np.array_equal(counts, counts2) and np.array_equal(values, values2)
    numpy_steps = run(BURST, "numpy")
    assert numpy_steps[0] == expected


def test_sampled_rows_alone_burst(built):
    params = SamplingParams(max_tokens=BURST * 3, ignore_eos=True, temperature=1.0, seed=7)
    plain, _ = _generate(built, 1, params)
    burst, llm = _generate(built, BURST, params)
    assert burst == plain and llm.round_loop.decode.bursts > 0


def test_the_time_budget_ends_a_burst(built):
    """A budget shorter than one call: every burst is one target step (a large model's step stays one call)."""
    params = SamplingParams(max_tokens=BURST * 3, ignore_eos=True)
    plain, _ = _generate(built, 1, params)
    burst, llm = _generate(built, BURST, params, decode_burst_ms=1e-6)
    assert burst == plain
    assert llm.round_loop.decode.calls == llm.round_loop.decode.bursts > 0


def test_an_interrupt_ends_each_burst_after_its_call(built, steps):
    """The server's interrupt (a request or an abort queued): a burst stops after the call it is in,
    whatever its budget, and the tokens stay those of one token a step; off again, bursts run on."""
    params = SamplingParams(max_tokens=BURST * 3, ignore_eos=True)
    plain, _ = _generate(built, 1, params)
    llm = _open(built, BURST, steps, decode_burst_ms=1e6)
    polls = []
    llm.interrupt_bursts_when(lambda: polls.append(True) or True)
    assert [(r.token_ids, r.finish_reason) for r in llm.generate(PROMPTS, params)] == plain
    decode = llm.round_loop.decode
    assert decode.calls == decode.bursts > 0 and len(polls) == decode.bursts
    llm.interrupt_bursts_when(lambda: False)
    calls, bursts = llm.round_loop.decode.calls, llm.round_loop.decode.bursts
    assert [(r.token_ids, r.finish_reason) for r in llm.generate(PROMPTS, params)] == plain
    assert llm.round_loop.decode.calls - calls > llm.round_loop.decode.bursts - bursts > 0


def test_the_server_interrupts_bursts_while_a_command_waits(built):
    from tandem.server.serve_loop import ServeLoop
    llm = _open(built, BURST)
    loop = ServeLoop(llm, max_queued=4)
    assert llm.round_loop.decode.interrupt is not None and not llm.round_loop.decode.interrupt()
    loop._commands.put(("abort", "req-none"))
    assert llm.round_loop.decode.interrupt()


def test_a_request_at_the_length_limit(built):
    """prompt + max_tokens = max_seq_len - 1: the burst's reserved rows stay inside the request's."""
    prompt = list(range(1, 30))
    params = SamplingParams(max_tokens=63 - len(prompt), ignore_eos=True)
    plain, _ = _generate(built, 1, params, prompts=[prompt])
    burst, _ = _generate(built, BURST, params, prompts=[prompt])
    assert burst == plain and len(burst[0][0]) == 63 - len(prompt)


@pytest.mark.parametrize("fields", [{"decode_burst": 0}, {"decode_burst": 17}, {"decode_burst": 4.0},
                                    {"decode_burst_ms": 0}])
def test_out_of_range_bursts_are_refused(fields):
    with pytest.raises(ValueError, match="decode_burst"):
        RuntimeConfig(**fields)
