"""Relaxed acceptance (opt-in): off is exact; on, the verify graph accepts a superset of what greedy
accepts (drafts that are the target's 2nd-best within delta), never on rows outside the allowed
mask (the thinking span), never on sampled rows; requests are validated; the server takes it."""

from __future__ import annotations

import httpx
import numpy as np
import onnx
import pytest

from tandem import contract as c
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.relaxed import RelaxedRows
from tandem.pipeline.request_checks import RequestError
from tandem.pipeline.sampling_params import RelaxedAcceptance, SamplingParams
from tandem.testing.acceptance_reference import accept

from ..paged_driver import function_body_graphs, prefilled, relaxed_off
from ..pipeline_fixtures import GREEDY, install_drafter, run

K = 3
PROMPTS = [[5, 17, 33, 200, 7, 64, 91], [9, 120, 77, 301, 15], [44, 3, 250, 8, 160, 21]]


@pytest.fixture(scope="module")
def graphs(tiny_root):
    return function_body_graphs(tiny_root / "qwen3_5_mtp1")


def _prefilled(desc, target):
    return prefilled(desc, target, PROMPTS)


def _logits(desc, target, ids):
    """The target's logits over rows [pending, d_1..d_k] after the prompts (what verify sees)."""
    state, _ = _prefilled(desc, target)
    return state.run(target, {c.INPUT_IDS: ids, c.STATE_ROWS: np.full(len(ids), ids.shape[1], np.int64)})[c.LOGITS]


def _second_best_chain(desc, target):
    """[pending, d_1..d_K] where each d_{i+1} is the target's 2nd most likely token at row i,
    and the gap p(top) - p(d_{i+1}) of each row."""
    _, pending = _prefilled(desc, target)
    ids = pending[:, None]
    gaps = []
    for _ in range(K):
        p = _softmax(_logits(desc, target, ids)[:, -1])
        order = np.argsort(-p, axis=-1, kind="stable")
        ids = np.concatenate([ids, order[:, 1:2]], 1)
        gaps.append(np.take_along_axis(p, order[:, :1], 1)[:, 0] - np.take_along_axis(p, order[:, 1:2], 1)[:, 0])
    return ids, np.stack(gaps, 1)


def _softmax(x):
    e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def relaxed_reference(logits, ids, topk, delta, rows):
    """numpy TensorRT-LLM rule: d_{i+1} accepted if == argmax, or (rows[b, i] and rank < topk and
    p(d) >= p(top) - delta); next token = argmax of the first rejected row."""
    p = _softmax(logits)
    acc, nxt = np.zeros(len(ids), np.int64), np.zeros(len(ids), np.int64)
    for b in range(len(ids)):
        a = 0
        while a < ids.shape[1] - 1:
            d, row = ids[b, a + 1], logits[b, a]
            rank = int((row > row[d]).sum())
            relaxed = rows[b, a] and rank < topk[b] and p[b, a, d] >= p[b, a].max() - delta[b]
            if d != row.argmax() and not relaxed:
                break
            a += 1
        acc[b], nxt[b] = a, logits[b, a].argmax()
    return acc, nxt


GREEDY_ROWS = {c.TEMPERATURE: np.zeros(3, np.float32), c.TOP_K: np.zeros(3, np.int64),
               c.TOP_P: np.ones(3, np.float32), c.UNIFORMS: np.full((3, K + 1), 0.5, np.float32)}


def _relaxed(topk, delta, rows):
    n = len(topk)
    return {c.RELAXED_TOPK: np.asarray(topk, np.int64), c.RELAXED_DELTA: np.asarray(delta, np.float32),
            c.RELAXED_ROWS: np.broadcast_to(np.asarray(rows, np.int64), (n, K + 1)).copy()}


@pytest.mark.parametrize("seed", range(3))
def test_off_is_exact(graphs, seed):
    """top-k 0 (whatever delta and rows say) or rows all 0 (whatever top-k): greedy acceptance."""
    desc, target, verify, verify_sample = graphs
    rng = np.random.default_rng(seed)
    _, pending = _prefilled(desc, target)
    ids = np.concatenate([pending[:, None], rng.integers(0, desc.vocab_size, (3, K))], 1)
    logits = _logits(desc, target, ids)
    ref_acc, ref_next = accept(logits, ids, np.zeros(3), np.zeros(3, np.int64), np.ones(3), np.full((3, K + 1), .5))
    for extra in (relaxed_off(ids.shape), _relaxed([0, 0, 0], [1.0] * 3, 1), _relaxed([400] * 3, [1.0] * 3, 0)):
        for sess, sampling in ((verify, {}), (verify_sample, GREEDY_ROWS)):
            state, _ = _prefilled(desc, target)
            out = state.run(sess, {c.INPUT_IDS: ids, **sampling, **extra})
            np.testing.assert_array_equal(out[c.ACCEPTED], ref_acc)
            np.testing.assert_array_equal(out[c.NEXT_TOKEN], ref_next)


def test_accepts_second_best_within_delta_a_superset_of_greedy(graphs):
    desc, target, verify, _ = graphs
    ids, gaps = _second_best_chain(desc, target)
    logits = _logits(desc, target, ids)
    state, _ = _prefilled(desc, target)
    exact = state.run(verify, {c.INPUT_IDS: ids})
    assert (exact[c.ACCEPTED] == 0).all()          # no draft is the argmax
    delta = gaps.max(1) + 1e-4                     # every row's 2nd best is within delta
    state, _ = _prefilled(desc, target)
    on = state.run(verify, {c.INPUT_IDS: ids, **_relaxed([2] * 3, delta, 1)})
    assert (on[c.ACCEPTED] == K).all()
    np.testing.assert_array_equal(on[c.NEXT_TOKEN], logits[:, K].argmax(-1))   # the target's own bonus token
    # top-1 (2nd best is rank 1) or a delta below the first gap: nothing relaxed
    for topk, d in (([1] * 3, delta), ([2] * 3, gaps[:, 0] - 1e-4)):
        state, _ = _prefilled(desc, target)
        out = state.run(verify, {c.INPUT_IDS: ids, **_relaxed(topk, d, 1)})
        assert (out[c.ACCEPTED] == 0).all(), (topk, d)
    # random drafts mixed with greedy ones: == the numpy rule, and never fewer than greedy accepts
    rng = np.random.default_rng(0)
    for _ in range(4):
        mixed = ids.copy()
        greedy_rows = rng.random((3, K)) < 0.5
        mixed[:, 1:] = np.where(greedy_rows, logits[:, :K].argmax(-1), ids[:, 1:])
        lg = _logits(desc, target, mixed)
        relax = _relaxed(rng.choice([0, 2, 5], 3), rng.choice([0.0, 0.05, 0.5], 3), rng.integers(0, 2, (3, K + 1)))
        state, _ = _prefilled(desc, target)
        out = state.run(verify, {c.INPUT_IDS: mixed, **relax})
        ref = relaxed_reference(lg, mixed, relax[c.RELAXED_TOPK], relax[c.RELAXED_DELTA], relax[c.RELAXED_ROWS])
        np.testing.assert_array_equal(out[c.ACCEPTED], ref[0])
        np.testing.assert_array_equal(out[c.NEXT_TOKEN], ref[1])
        g_acc, _ = accept(lg, mixed, np.zeros(3), np.zeros(3, np.int64), np.ones(3), np.full((3, K + 1), .5))
        assert (out[c.ACCEPTED] >= g_acc).all()


def test_never_relaxes_where_rows_forbid_nor_on_sampled_rows(graphs):
    desc, target, verify, verify_sample = graphs
    ids, gaps = _second_best_chain(desc, target)
    delta = gaps.max(1) + 1e-4
    for stop in range(K):   # relaxing allowed on rows 0..stop-1 only: acceptance stops at row `stop`
        rows = (np.arange(K + 1) < stop).astype(np.int64)
        state, _ = _prefilled(desc, target)
        out = state.run(verify, {c.INPUT_IDS: ids, **_relaxed([2] * 3, delta, rows)})
        assert (out[c.ACCEPTED] == stop).all(), stop
    # the sampled graph: the greedy row relaxes, sampled rows give what they give without relaxing
    sampling = {c.TEMPERATURE: np.array([0.0, 0.8, 1.2], np.float32), c.TOP_K: np.zeros(3, np.int64),
                c.TOP_P: np.ones(3, np.float32), c.UNIFORMS: np.full((3, K + 1), 0.3, np.float32)}
    state, _ = _prefilled(desc, target)
    off = state.run(verify_sample, {c.INPUT_IDS: ids, **sampling})
    state, _ = _prefilled(desc, target)
    on = state.run(verify_sample, {c.INPUT_IDS: ids, **sampling, **_relaxed([2] * 3, delta, 1)})
    assert on[c.ACCEPTED][0] == K and off[c.ACCEPTED][0] == 0
    np.testing.assert_array_equal(on[c.ACCEPTED][1:], off[c.ACCEPTED][1:])
    np.testing.assert_array_equal(on[c.NEXT_TOKEN][1:], off[c.NEXT_TOKEN][1:])


# ---- the pipeline ------------------------------------------------------------------------

class _Seq:
    def __init__(self, tokens, relaxed, rid="r"):
        self.tokens, self.request_id = tokens, rid
        self.params = SamplingParams(relaxed=relaxed)


def _mask(rr: RelaxedRows, tokens, drafts, relaxed):
    from tandem.pipeline.model_runner import Rows

    seq, row = _Seq(tokens, relaxed), Rows(ids=[tokens[-1], *drafts], context=0, pages=[])
    rr.fill([seq], {"r": drafts}, [row])
    return row.relaxed_topk, row.relaxed_rows


def test_thinking_span_rows():
    rr = RelaxedRows(markers=(7, 8))
    think = RelaxedAcceptance(top_k=4, delta=0.3, thinking_only=True)
    assert _mask(rr, [1, 2, 7, 3], [4, 8, 5], think) == (4, [1, 1, 0, 0])   # a draft </think> ends it
    assert _mask(rr, [1, 7, 2, 8, 3], [4, 7, 5], think) == (4, [0, 0, 1, 1])  # closed, reopened by a draft
    assert _mask(rr, [1, 2, 3], [4, 5, 6], think) == (4, [0, 0, 0, 0])      # never inside
    assert _mask(rr, [1, 2, 3], [4, 5, 6], RelaxedAcceptance(top_k=4, delta=0.3)) == (4, [1, 1, 1, 1])
    assert _mask(rr, [1, 7, 3], [4, 5, 6], RelaxedAcceptance(top_k=0, delta=0.3)) == (0, None)   # off
    # the span is tracked incrementally: appending tokens after a scan is read correctly
    seq = _Seq([1, 7, 2], think)
    assert rr.inside(seq) and (seq.tokens.extend([3, 8, 4]) or True) and not rr.inside(seq)


def test_rows_that_judge_a_filler_never_relax():
    """A call wider than a sequence's drafts fills its rows past them (contract.FILLER_DRAFT): the rows
    judging a filler get 0 whatever the setting."""
    from tandem.contract import FILLER_DRAFT
    from tandem.pipeline.model_runner import Rows

    rr = RelaxedRows(markers=(7, 8))
    for setting in (RelaxedAcceptance(top_k=4, delta=0.3, thinking_only=True), RelaxedAcceptance(top_k=4, delta=0.3)):
        seq, row = _Seq([1, 7, 3], setting), Rows(ids=[3, 4, FILLER_DRAFT, FILLER_DRAFT], context=0, pages=[])
        rr.fill([seq], {"r": [4]}, [row])
        assert row.relaxed_rows == [1, 0, 0, 0]


def test_pipeline_relaxed_on_accepts_wrong_drafts_and_thinking_only_outside_is_exact(engine_dirs, monkeypatch):
    path = engine_dirs["qwen3_5_mtp3"]
    install_drafter(monkeypatch, "wrong")        # every draft is the greedy token + 1: never accepted exactly
    prompts = [[5, 17, 33, 200, 7, 64, 91], [9, 120, 77, 301, 15]]
    plain, _ = run(path, prompts, GREEDY, RuntimeConfig(speculative=False))
    anything = RelaxedAcceptance(top_k=1 << 20, delta=1.0)
    llm = LLM(path)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True, relaxed=anything))
    assert all(r.metrics.accepted > 0 for r in outs)           # relaxed accepted wrong drafts
    # thinking-only with markers the sequences never contain: exact, token for token, nothing accepted
    # (the tiny tokenizer has no <think>: two ids stand in for the markers)
    llm.round_loop.relaxed = RelaxedRows(RelaxedAcceptance(top_k=1 << 20, delta=1.0, thinking_only=True), (383, 382))
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in outs] == [plain[0], plain[1]] and all(r.metrics.accepted == 0
                                                                                    for r in outs)
    # the prompt opens the span: the same default relaxes
    outs = llm.generate([[5, 17, 383, 200, 7]], SamplingParams(max_tokens=24, ignore_eos=True))
    assert outs[0].metrics.accepted > 0


def test_request_validation(engine_dirs):
    for bad, match in ((dict(relaxed={"top_k": -1, "delta": 0.1}), "top_k must be an integer >= 0"),
                       (dict(relaxed={"top_k": 2, "delta": 1.5}), r"delta must be a probability gap in \[0, 1\]"),
                       (dict(relaxed={"top_k": 2, "delta": float("nan")}), "delta must be"),
                       (dict(relaxed={"top_k": True, "delta": 0.1}), "top_k must be an integer"),
                       (dict(relaxed={"top_k": 2, "delta": 0.1, "thinking_only": "yes"}), "thinking_only must be"),
                       (dict(relaxed={"top_k": 2, "delta": 0.1, "think": 1}), "takes top_k, delta"),
                       (dict(relaxed="on"), "must be a RelaxedAcceptance"),
                       (dict(temperature=0.7, relaxed={"top_k": 2, "delta": 0.1}), "greedy decoding only")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)
    SamplingParams(temperature=0.7, relaxed={"top_k": 0, "delta": 0.0})   # off is fine with sampling
    llm = LLM(engine_dirs["qwen3_5_mtp3"])     # the tiny tokenizer has no <think> tokens
    with pytest.raises(RequestError, match="thinking_only needs <think> and </think>") as e:
        llm.check_request("def f():", SamplingParams(relaxed=RelaxedAcceptance(2, 0.1, thinking_only=True)))
    assert e.value.param == "relaxed_acceptance"
    with pytest.raises(RequestError, match="relaxed_acceptance.top_k"):
        llm.check_request("def f():", SamplingParams(relaxed=RelaxedAcceptance(1 << 64, 0.1)))
    with pytest.raises(ValueError, match="RuntimeConfig.relaxed_acceptance is thinking_only.*tokenizer.json"):
        LLM(engine_dirs["qwen3_5_mtp3"], RuntimeConfig(relaxed_acceptance=RelaxedAcceptance(2, 0.1, True)))


@pytest.mark.server
def test_server_takes_relaxed_acceptance(engine_dirs):
    from ..server.test_server import Live

    with Live(engine_dirs["qwen3_5_mtp3"]) as live:
        body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0.0,
                "relaxed_acceptance": {"top_k": 4, "delta": 0.3}}
        r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        for bad, status in (({"top_k": 4, "delta": 2.0}, 400), ({"top_k": 4}, 400), ({"top_k": "4", "delta": .1}, 400),
                            ({"top_k": 4, "delta": 0.3, "thinking_only": True}, 400)):
            r = httpx.post(f"{live.url}/v1/completions", json={**body, "relaxed_acceptance": bad}, timeout=60)
            assert r.status_code == status, (bad, r.text)
        r = httpx.post(f"{live.url}/v1/completions", json={**body, "temperature": 0.8}, timeout=60)
        assert r.status_code == 400 and "greedy decoding only" in r.json()["error"]["message"]


def test_engines_built_before_relaxed_acceptance_load_and_run_exact(tiny_root, tmp_path, monkeypatch):
    """An engine dir whose verify graphs lack the relaxed inputs (as built before them) loads, and a
    relaxed request runs on it with exact acceptance: the same tokens as plain greedy."""
    from tandem.engines.builder import build_engines
    from tandem.engines.options import BuildOptions
    from tandem.export import acceptance

    greedy, sampled = acceptance.greedy, acceptance.sampled
    with monkeypatch.context() as old:
        verify_io = c.verify_step_io
        old.setattr(c, "verify_step_io", lambda *a, **k: (
            [s for s in verify_io(*a, **k)[0]
             if s.name not in (c.RELAXED_TOPK, c.RELAXED_DELTA, c.RELAXED_ROWS, c.TOKEN_BITMASK, c.LOGIT_EDIT_IDS,
                               c.LOGIT_EDITS, c.MIN_P_LOG)],
            verify_io(*a, **k)[1]))
        old.setattr(acceptance, "greedy", lambda *a, relaxed=None, bitmask=None, **_: greedy(*a))
        old.setattr(acceptance, "sampled", lambda *a, relaxed=None, bitmask=None, **_: sampled(*a))
        build_engines(tiny_root / "qwen3_5_mtp1", tmp_path / "old", BuildOptions(
            batch_sizes=(1, 2), spec_k=2, prefill_chunk=8, max_seq_len=128, page_size=4), show_progress=False)
    prompts = [[5, 17, 33, 200, 7, 64, 91], [9, 120, 77, 301, 15]]
    plain = LLM(tmp_path / "old", RuntimeConfig(speculative=False)).generate(prompts, GREEDY)
    install_drafter(monkeypatch, "wrong")
    llm = LLM(tmp_path / "old")
    verify_files = [e["file"] for e in llm.manifest["engines"] if e["graph"].startswith("verify")]
    assert verify_files and all(c.RELAXED_TOPK not in {i.name for i in onnx.load(tmp_path / "old" / f).graph.input}
                                for f in verify_files)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True,
                                                relaxed=RelaxedAcceptance(top_k=1 << 20, delta=1.0)))
    assert [r.token_ids for r in outs] == [r.token_ids for r in plain]
    assert all(r.metrics.accepted == 0 for r in outs)
