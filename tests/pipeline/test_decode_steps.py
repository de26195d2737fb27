"""The multi-step decode graph (export/decode_graph.py, `--decode-steps n`): one call is n plain
greedy decode steps, bit for bit: the same tokens, and the rows and states it hands the runtime to
commit are the pools after n committed decode steps. The pipeline runs it for plain greedy rows
and emits what one token per call emits, stops and budgets included."""

from __future__ import annotations

import numpy as np
import pytest

from tandem import contract as c
from tandem.checkpoint import open_checkpoint
from tandem.engines.backends.onnxruntime_backend import open_served
from tandem.engines.builder import build_engines
from tandem.engines.options import BuildOptions, OptionsError
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams

from ..paged_driver import prefilled

STEPS = 4
PROMPTS = [[5, 17, 33, 200, 7, 64, 91], [9, 120, 77, 301, 15], [3]]


@pytest.fixture(scope="module", params=["qwen3_5_mtp3", "qwen3_next"])
def built(request, tiny_root, tmp_path_factory):
    kind = request.param
    out = tmp_path_factory.mktemp("decode_steps") / kind
    build_engines(tiny_root / kind, out, BuildOptions(batch_sizes=(1, 4), prefill_chunk=8, max_seq_len=256,
                                                      page_size=4, no_mtp=True, decode_steps=STEPS),
                  show_progress=False)
    return kind, out


def test_one_call_equals_n_committed_decode_steps_bit_for_bit(built, tiny_root):
    kind, engine_dir = built
    desc = open_checkpoint(tiny_root / kind).description
    target = open_served(engine_dir, "target_step.opt.onnx")          # what the runtime opens
    decode = open_served(engine_dir, f"decode_greedy_n{STEPS}.opt.onnx")
    one = np.ones(len(PROMPTS), np.int64)

    steps, token = prefilled(desc, target, PROMPTS)
    tokens = []
    for _ in range(STEPS):                                   # plain greedy: one row per call, committed
        out = steps.run(target, {c.INPUT_IDS: token[:, None], c.STATE_ROWS: one})
        steps.commit(out, one)
        token = out[c.LOGITS][:, 0].argmax(-1)
        tokens.append(token)

    call, first = prefilled(desc, target, PROMPTS)
    out = call.run(decode, {c.INPUT_IDS: first[:, None]})
    assert np.array_equal(out[c.NEXT_TOKENS], np.stack(tokens, 1))
    call.commit(out, one * STEPS)
    assert (call.lens == steps.lens).all()
    for name, pool in steps.pools.items():
        assert np.array_equal(call.pools[name], pool), name


def _generate(engine_dir, decode_steps, params):
    llm = LLM(engine_dir, RuntimeConfig(decode_steps=decode_steps, decode_burst=1))   # 1: one token a call
    results = llm.generate(PROMPTS, params)
    return [(r.token_ids, r.finish_reason) for r in results], llm.runner.calls


@pytest.mark.parametrize("max_tokens", [STEPS * 5 + 2, STEPS - 1])
def test_the_pipeline_emits_what_one_token_per_call_emits(built, max_tokens):
    _, engine_dir = built
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    plain, plain_calls = _generate(engine_dir, 1, params)
    multi, calls = _generate(engine_dir, None, params)
    assert multi == plain
    assert f"decode_greedy_n{STEPS}" not in plain_calls
    # budgets under n tokens take one token a call: no position past the request's is written
    assert (calls.get(f"decode_greedy_n{STEPS}", 0) > 0) == (max_tokens > STEPS)


def test_a_stop_inside_a_call_ends_the_output_there(built):
    _, engine_dir = built
    free, _ = _generate(engine_dir, 1, SamplingParams(max_tokens=3 * STEPS, ignore_eos=True))
    stop = free[0][0][STEPS + 1]              # a token the first prompt emits in the middle of its second call
    params = SamplingParams(max_tokens=3 * STEPS, ignore_eos=True, stop_token_ids=(stop,))
    plain, _ = _generate(engine_dir, 1, params)
    multi, _ = _generate(engine_dir, None, params)
    assert multi == plain and multi[0][1] == "stop" and len(multi[0][0]) <= STEPS + 1


def test_sampled_requests_take_one_token_a_call(built):
    _, engine_dir = built
    llm = LLM(engine_dir)
    llm.generate(PROMPTS, SamplingParams(max_tokens=2 * STEPS + 1, temperature=0.8, seed=3))
    assert f"decode_greedy_n{STEPS}" not in llm.runner.calls


@pytest.mark.parametrize("steps", [0, 17])
def test_out_of_range_steps_are_refused(steps):
    with pytest.raises(OptionsError, match="--decode-steps"):
        BuildOptions(decode_steps=steps)
