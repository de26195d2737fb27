"""Sampling per request: its random stream depends only on its seed and positions (the same tokens
alone, inside batches of 1-8, with speculation on or off, at any verify width); acceptance keeps the
target distribution; extreme temperatures and probabilities give valid tokens, never NaN."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest
from onnx import helper

from tandem import contract as c
from tandem.engines.backends.onnxruntime_backend import session
from tandem.export import acceptance
from tandem.export.builder import IR_VERSION, OPSET, GraphBuilder, value_info
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampler import _filtered_rows, filtered_probs, sample, sample_rows, uniforms
from tandem.pipeline.sampling_params import SamplingParams
from tandem.pipeline.sequence import Sequence
from tandem.testing.sampling_reference import lm_like_logits, sorted_filtered_probs, sorted_sample

from ..pipeline_fixtures import install_drafter

KIND = "qwen3_5_mtp3"
PROMPT = [9, 120, 77, 301, 15, 2, 88]
OTHERS = [[5, 17, 33, 200, 7], [44], [3, 250, 8, 160, 21, 6, 7], [300, 12, 12, 12], [77, 78], [101, 5, 9],
          [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
SAMPLED = SamplingParams(max_tokens=20, temperature=1.0, top_k=40, top_p=0.95, seed=1234, ignore_eos=True)


def other_params(i: int) -> SamplingParams:
    """Companions: greedy and sampled, other seeds and filters, other lengths."""
    if i % 3 == 0:
        return SamplingParams(max_tokens=8 + i, ignore_eos=True)
    return SamplingParams(max_tokens=6 + 2 * i, temperature=0.5 + 0.2 * i, top_k=10 * i, seed=i, ignore_eos=True)


def run_in_batch(llm: LLM, params, others: int, stagger: int) -> list[int]:
    """PROMPT's tokens when it arrives after `stagger` steps among `others` companions that
    arrive one per step."""
    queue = [(f"o{i}", OTHERS[i], other_params(i)) for i in range(others)]
    queue.insert(min(stagger, len(queue)), ("me", PROMPT, params))
    seqs = {}
    while queue or any(s.finish_reason is None for s in seqs.values()):
        if queue:
            rid, prompt, p = queue.pop(0)
            seqs[rid] = llm.add_request(prompt, p, request_id=rid)
        llm.step()
    llm.test_sequences = list(seqs.values())
    return seqs["me"].output_ids()


@pytest.fixture(scope="module")
def llm(engine_dirs):
    return LLM(engine_dirs[KIND])   # one for the module: building one costs more than a run


@pytest.fixture(scope="module")
def plain(llm):
    """The request alone, no speculation: one host sample per position."""
    return llm.generate([PROMPT], replace(SAMPLED, speculative=False))[0].token_ids


# ---- the stream ------------------------------------------------------------------------------
def test_uniforms_are_a_pure_function_of_seed_and_position():
    pos = np.arange(1000)
    a = uniforms([7], pos[None])[0]
    assert a.dtype == np.float32 and (a >= 0).all() and (a < 1).all()
    np.testing.assert_array_equal(a, [uniforms([7], np.array([x]))[0] for x in pos])   # vectorised == one by one
    np.testing.assert_array_equal(uniforms([7, 7], np.stack([pos, pos]))[1], a)          # batch neighbours: no effect
    assert np.all(a * 2**24 == np.round(a * 2**24))          # 24-bit: exact in float32, graph and host agree
    b = uniforms([8], pos[None])[0]
    assert np.mean(a == b) < 0.01                            # neighbouring seeds: unrelated streams
    assert uniforms([-1], pos[:3][None]).shape == (1, 3) and uniforms([2**80], pos[:3][None]).shape == (1, 3)
    many = uniforms([1], np.arange(200_000)[None])[0]
    hist = np.bincount((many * 20).astype(int), minlength=20)
    assert np.abs(hist / 10_000 - 1).max() < 0.05            # ~7 standard deviations: never flakes


def test_requests_without_a_seed_draw_one():
    fresh = lambda seed: Sequence("r", PROMPT, SamplingParams(temperature=1.0, seed=seed), None, 4, False, 0)  # noqa: E731
    assert fresh(None).seed != fresh(None).seed and fresh(5).seed == 5


# ---- same seed, same tokens ------------------------------------------------------------------
def test_alone_and_without_speculation_the_same(llm, plain):
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
    assert len(plain) == SAMPLED.max_tokens and plain != greedy                     # really sampled
    assert llm.generate([PROMPT], SAMPLED)[0].token_ids == plain


@pytest.mark.parametrize("batch", range(1, 9))
def test_inside_batches_with_staggered_arrivals(llm, plain, batch):
    # the verify width follows the batch size (manifest), and companions come and go
    assert run_in_batch(llm, SAMPLED, batch - 1, stagger=batch // 2) == plain


@pytest.mark.parametrize("k", [1, 2, 3])
def test_any_verify_width_per_request(llm, plain, k):
    assert run_in_batch(llm, replace(SAMPLED, k=k), 3, stagger=1) == plain


def test_any_verify_width_per_engine(engine_dirs, plain):
    assert run_in_batch(LLM(engine_dirs[KIND], RuntimeConfig(spec_k=1)), SAMPLED, 2, stagger=0) == plain


def test_under_preemption(engine_dirs, plain):
    # a budget of a few pages forces sequences out and back in (recomputed from their tokens)
    # (one token a step: greedy companions that burst finish before the pages run out)
    llm = LLM(engine_dirs[KIND], RuntimeConfig(memory_budget_bytes=230_000, max_num_seqs=8, decode_burst=1))
    assert run_in_batch(llm, SAMPLED, 7, stagger=2) == plain
    assert sum(s.metrics.preemptions for s in llm.test_sequences) > 0


@pytest.mark.parametrize("drafter", ["oracle", "prefix:1", "random"])
def test_whatever_the_drafts(engine_dirs, plain, monkeypatch, drafter):
    # oracle drafts are the sampled tokens themselves: every row's uniform must be its position's.
    # A fixed width: the adaptive controller of a shared LLM may have turned drafting off after the
    # random heads of earlier tests, and this test is about what happens to the drafts it makes.
    llm = LLM(engine_dirs[KIND], RuntimeConfig(adaptive_width=False))
    install_drafter(monkeypatch, drafter, {"me": plain})
    seq = llm.add_request(PROMPT, SAMPLED, request_id="me")
    while seq.finish_reason is None:
        llm.step()
    assert seq.output_ids() == plain
    if drafter == "oracle":
        assert seq.metrics.accepted == seq.metrics.drafted > 0


# ---- extreme settings ------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [dict(temperature=float("nan")), dict(temperature=float("inf")),
                                 dict(temperature=-0.5), dict(top_p=float("nan")), dict(top_p=float("inf")),
                                 dict(top_p=0.0), dict(top_k=-1), dict(seed=1.5)])
def test_sampling_params_refuse_non_finite_and_negative(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)


def test_denormal_temperature_is_greedy():
    assert SamplingParams(temperature=5e-324).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy


EXTREMES = [(1e-5, 0, 1.0), (1e30, 0, 1.0), (1e300, 0, 1.0), (0.7, 10**30, 1.0), (0.7, 0, 1e-300),
            (1.0, 1, 1.0), (2.0, 3, 1e-3)]


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("temperature, top_k, top_p", EXTREMES)
def test_host_sampler_on_extreme_settings(temperature, top_k, top_p):
    logits = (np.random.default_rng(0).standard_normal(64) * 30).astype(np.float32)
    p = filtered_probs(logits, temperature, top_k, top_p)
    assert np.isfinite(p).all() and abs(p.sum() - 1) < 1e-9
    if temperature >= 1e30:
        assert np.ptp(p) < 1e-12                             # near-uniform
    if top_p < 1e-100 or top_k == 1:
        assert p[np.argmax(logits)] == 1.0                   # the top token stays
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    for u in (0.0, 0.5, 1 - 2**-24):
        assert p[sample(logits, params, u)] > 0


def acceptance_session(sampling: bool = True):
    """The verify graph's acceptance alone, over given logits [B, W, V]."""
    b = GraphBuilder()
    ins = [value_info("logits", "float32", ("batch", "rows", "vocab")),
           value_info(c.INPUT_IDS, "int64", ("batch", "rows")), value_info(c.TEMPERATURE, "float32", ("batch",)),
           value_info(c.TOP_K, "int64", ("batch",)), value_info(c.TOP_P, "float32", ("batch",)),
           value_info(c.UNIFORMS, "float32", ("batch", "rows"))]
    outs = acceptance.sampled(b, "logits", c.INPUT_IDS, c.TEMPERATURE, c.TOP_K, c.TOP_P, c.UNIFORMS)
    for name, out in zip((c.ACCEPTED, c.NEXT_TOKEN), outs):
        b.op("Identity", out, outputs=[name])
    graph = helper.make_graph(b.nodes, "acceptance", ins, [value_info(c.ACCEPTED, "int64", ("batch",)),
                                                           value_info(c.NEXT_TOKEN, "int64", ("batch",))],
                              initializer=[onnx.numpy_helper.from_array(a, n) for n, a in b.initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return session(model)


@pytest.fixture(scope="module")
def accept_graph():
    return acceptance_session()


def run_graph(sess, logits, ids, temperature, top_k, top_p, u):
    n = len(logits)
    feeds = {"logits": logits.astype(np.float32), c.INPUT_IDS: ids.astype(np.int64),
             c.TEMPERATURE: np.full(n, min(temperature, float(np.finfo(np.float32).max)), np.float32),
             c.TOP_K: np.full(n, min(top_k, 2**62), np.int64),
             c.TOP_P: np.full(n, top_p, np.float32), c.UNIFORMS: u.astype(np.float32)}
    return sess.run([c.ACCEPTED, c.NEXT_TOKEN], feeds)


@pytest.mark.parametrize("temperature, top_k, top_p", EXTREMES + [(0.8, 6, 0.9), (5e-324, 0, 1.0), (1e-40, 0, 1.0)])
def test_graph_and_host_draw_the_same_token_from_the_same_uniform(accept_graph, temperature, top_k, top_p):
    """Never-accepted drafts (-1): next_token is row 0's own token, t_0 = inverse-CDF(p_0, u_0)."""
    rng = np.random.default_rng(1)
    n, vocab = 256, 64
    logits = rng.standard_normal((n, 1, vocab)).astype(np.float32).repeat(2, 1)
    u = np.stack([uniforms([5], np.arange(n)[None])[0], np.zeros(n)], 1)
    u[:64, 0], u[64:80, 0] = 1 - 2**-24, 0.0                 # the ends: never past the last non-zero token
    accepted, nxt = run_graph(accept_graph, logits, np.full((n, 2), -1), temperature, top_k, top_p, u)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    host = [sample(row[0], params, x) for row, x in zip(logits, u[:, 0])]
    assert (accepted == 0).all() and nxt.tolist() == host
    if 0.5 <= temperature <= 10 and top_k != 1 and top_p > 0.01:
        assert len(set(host)) > 16                           # really sampled


def test_acceptance_keeps_the_target_distribution_exactly(accept_graph):
    """Exact enumeration over a G x G grid of (u_0, u_1), drafts d_1 = a plausible token, d_2 =
    never: P(first token x) = p_0(x); P(d_1 then y) = p_0(d_1) p_1(y). Each cell is one batch row."""
    g, vocab = 64, 6
    p = np.array([[0.1, 0.35, 0.25, 0.15, 0.1, 0.05], [0.3, 0.05, 0.2, 0.15, 0.1, 0.2]])
    logits, d1 = np.log(p), 2                                # d_1 plausible but not the top token
    grid = (np.arange(g) + 0.5) / g
    u0, u1 = np.meshgrid(grid, grid, indexing="ij")
    u = np.stack([u0.ravel(), u1.ravel(), np.zeros(g * g)], 1)
    all_logits = np.broadcast_to(np.concatenate([logits, logits[1:]])[None], (g * g, 3, vocab))
    accepted, nxt = run_graph(accept_graph, all_logits, np.tile([0, d1, -1], (g * g, 1)), 1.0, 0, 1.0, u)
    first = np.bincount(np.where(accepted >= 1, d1, nxt), minlength=vocab) / g**2
    assert np.abs(first - p[0]).max() <= 1.0 / g             # each token's u-interval, to one grid step
    second = np.bincount(nxt[accepted == 1], minlength=vocab) / g**2
    assert np.abs(second - p[0, d1] * p[1]).max() <= 2.0 / g
    assert (accepted <= 1).all()


@pytest.mark.filterwarnings("error::RuntimeWarning")     # no overflow in a cast, no NaN on the way
def test_extreme_settings_through_the_pipeline(llm):
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    vocab = llm.desc.vocab_size
    for spec in (True, False):
        like_greedy = [dict(temperature=5e-324), dict(temperature=0.8, top_p=1e-300), dict(temperature=3.0, top_k=1)]
        for extra in like_greedy:
            r = llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, speculative=spec, **extra))[0]
            assert r.token_ids == greedy, extra
        for extra in (dict(temperature=1e30), dict(temperature=1e300), dict(temperature=0.9, top_k=2**63 - 1)):
            r = llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, speculative=spec, seed=4,
                                                      **extra))[0]
            assert len(r.token_ids) == 12 and all(0 <= t < vocab for t in r.token_ids), extra
    huge_k = replace(SAMPLED, top_k=2**63 - 1, seed=99)         # int64 max: past the vocabulary
    assert llm.generate([PROMPT], huge_k)[0].token_ids == llm.generate(
        [PROMPT], replace(SAMPLED, top_k=0, seed=99))[0].token_ids   # = off


@pytest.mark.parametrize("vocab, spread", [(384, 4.0), (384, 0.1), (4096, 3.0), (4096, 0.05), (40_000, 2.0)])
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.8, 0, 1.0), (1.0, 1, 1.0), (1.3, 20, 1.0), (0.5, 383, 1.0),
                                                       (2.0, 0, 0.9), (0.8, 40, 0.95), (1.0, 0, 0.5),
                                                       (1.0, 3000, 0.99), (1e-5, 0, 1.0), (0.7, 0, 1e-300)])
def test_the_sampler_equals_its_sorted_definition_bit_for_bit(vocab, spread, temperature, top_k, top_p):
    """Partitioned thresholds, the nucleus among growing candidate sets (a flat row's runs past 256
    and 1,024 of them), the kept tokens alone exponentiated: the same numbers as sorting every row."""
    rng = np.random.default_rng(vocab + top_k)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    batch = np.stack([lm_like_logits(rng, vocab, spread) for _ in range(5)])
    for logits in batch:
        fast = filtered_probs(logits, temperature, top_k, top_p)
        assert fast.tobytes() == sorted_filtered_probs(logits, temperature, top_k, top_p).tobytes()
        for u in (0.0, 0.3, 0.999, 1 - 2**-24):
            assert sample(logits, params, u) == sorted_sample(logits, temperature, top_k, top_p, u)
    u = uniforms([3], np.arange(5)[None])[0]        # the five rows as one batch
    expect = [sorted_sample(logits, temperature, top_k, top_p, float(x)) for logits, x in zip(batch, u)]
    assert sample_rows(batch, [params] * 5, u).tolist() == expect


@pytest.mark.parametrize("vocab", [384, 40_000])     # 40,000: the sampler's scratch buffers
def test_a_rows_token_does_not_depend_on_the_rows_beside_it(vocab):
    """Rows of every kind in one batch, peaked and flat (a flat row's nucleus runs past its first
    candidates while a peaked one's ends there): each row's token and kept probabilities are those
    it gets alone, bit for bit, in any order and company."""
    rng = np.random.default_rng(vocab)
    settings = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_k=30),
                SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=0.6, top_k=50, top_p=0.9),
                SamplingParams(temperature=1.5), SamplingParams(temperature=1.0, top_p=0.95)]
    logits = np.stack([lm_like_logits(rng, vocab, 2.0 if i % 3 else 0.05) for i in range(21)])
    params = [settings[i % len(settings)] for i in range(21)]
    u = uniforms([7], np.arange(21)[None])[0]
    alone = [sample(row, p, x) for row, p, x in zip(logits, params, u)]
    for rows in (np.arange(21), np.arange(21)[::-1], np.arange(3), np.array([5, 1, 4, 10, 17, 20, 13])):
        assert sample_rows(logits[rows], [params[i] for i in rows], u[rows]).tolist() == [alone[i] for i in rows]
    filtered = [i for i, p in enumerate(params) if not p.greedy and (p.top_k or p.top_p < 1)]
    together = _filtered_rows(logits[filtered], [params[i] for i in filtered])
    for i, (kept, probs) in zip(filtered, together):
        own = filtered_probs(logits[i], params[i].temperature, params[i].top_k, params[i].top_p)
        assert np.array_equal(kept, np.flatnonzero(own)) and probs.tobytes() == own[kept].tobytes()
