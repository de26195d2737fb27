"""The fused verify graph: acceptance == the numpy reference (greedy and sampled, same
uniforms), and what it outputs for the accepted rows == what single decode steps leave."""

from __future__ import annotations

import numpy as np
import pytest

from tandem import contract as c
from tandem.testing.acceptance_reference import accept

from ..paged_driver import function_body_graphs, prefilled

K = 3
PROMPTS = [[5, 17, 33, 200, 7, 64, 91], [9, 120, 77, 301, 15], [44, 3, 250, 8, 160, 21]]


@pytest.fixture(scope="module", params=["qwen3_5_mtp1", "qwen3_next"])
def graphs(request, tiny_root):
    return function_body_graphs(tiny_root / request.param)


def greedy_continuation(desc, target, prompts, steps):
    state, nxt = prefilled(desc, target, prompts)
    toks, snapshots = [nxt], []
    for _ in range(steps):
        out = state.run(target, {c.INPUT_IDS: toks[-1][:, None], c.STATE_ROWS: np.ones(len(prompts), np.int64)})
        state.commit(out, np.ones(len(prompts), np.int64))
        snapshots.append(out)
        toks.append(out[c.LOGITS][:, 0].argmax(-1))
    return np.stack(toks, 1), snapshots  # toks[:, 0] = pending, toks[:, i] = greedy token i


@pytest.mark.parametrize("n_right", range(K + 1))
def test_greedy_accepts_the_matching_prefix_and_commits_like_decode(graphs, n_right):
    desc, target, verify, _ = graphs
    greedy, steps = greedy_continuation(desc, target, PROMPTS, K + 1)
    ids = greedy[:, : K + 1].copy()                          # [pending, g_1..g_k]
    if n_right < K:
        ids[:, n_right + 1] = (ids[:, n_right + 1] + 1) % desc.vocab_size   # first wrong draft
    state, _ = prefilled(desc, target, PROMPTS)
    out = state.run(verify, {c.INPUT_IDS: ids})
    assert (out[c.ACCEPTED] == n_right).all()
    assert (out[c.NEXT_TOKEN] == greedy[:, n_right + 1]).all()
    # the states it outputs are the ones n_right + 1 single decode steps leave
    snap = steps[n_right]
    for name in snap:
        if name.startswith(("new_recurrent_state", "new_conv_state")):
            assert np.abs(out[name] - snap[name]).max() < 1e-5, name
    # and the K/V rows of the accepted rows are the decode steps' rows
    for i in state.kv_layers:
        for r in range(n_right + 1):
            assert np.abs(out[c.new_key(i)][:, r] - steps[r][c.new_key(i)][:, 0]).max() < 1e-5


@pytest.mark.parametrize("seed", range(6))
def test_sampled_acceptance_matches_numpy_reference(graphs, seed):
    desc, target, _, verify = graphs
    rng = np.random.default_rng(seed)
    greedy, _ = greedy_continuation(desc, target, PROMPTS, K)
    ids = greedy[:, : K + 1].copy()
    # mix right, wrong and random drafts so every acceptance length shows up across seeds
    wrong = rng.random(ids[:, 1:].shape) < 0.3
    ids[:, 1:] = np.where(wrong, rng.integers(0, desc.vocab_size, ids[:, 1:].shape), ids[:, 1:])
    bsz = len(PROMPTS)
    params = {c.TEMPERATURE: np.array([0.0, 0.7, 1.3], np.float32)[rng.permutation(3)],
              c.TOP_K: rng.choice([0, 5, 40], bsz).astype(np.int64),
              c.TOP_P: rng.choice([1.0, 0.9, 0.5], bsz).astype(np.float32),
              c.UNIFORMS: rng.random((bsz, K + 1)).astype(np.float32)}
    state, _ = prefilled(desc, target, PROMPTS)
    out = state.run(verify, {c.INPUT_IDS: ids, **params})
    state2, _ = prefilled(desc, target, PROMPTS)
    logits = state2.run(target, {c.INPUT_IDS: ids, c.STATE_ROWS: np.full(bsz, K + 1, np.int64)})[c.LOGITS]
    ref_acc, ref_next = accept(logits, ids, params[c.TEMPERATURE], params[c.TOP_K], params[c.TOP_P],
                               params[c.UNIFORMS])
    np.testing.assert_array_equal(out[c.ACCEPTED], ref_acc)
    np.testing.assert_array_equal(out[c.NEXT_TOKEN], ref_next)


def test_acceptance_reference_preserves_the_target_distribution():
    """Rejection sampling with deterministic drafts: the first emitted token follows p exactly."""
    rng = np.random.default_rng(0)
    v, n = 6, 40000
    logits = rng.standard_normal((1, 2, v)) * 1.5
    p = np.exp(logits[0, 0] - logits[0, 0].max())
    p /= p.sum()
    draft = int(np.argsort(p)[-2])           # a plausible but not the top token
    ids = np.array([[0, draft]])
    counts = np.zeros(v)
    for u in rng.random((n, 2)):
        a, nxt = accept(logits, ids, np.array([1.0]), np.array([0]), np.array([1.0]), u[None])
        counts[draft if a[0] == 1 else nxt[0]] += 1
    chi2 = (((counts - n * p) ** 2) / (n * p)).sum()
    assert chi2 < 20.5  # 99.9% quantile of chi-square with 5 degrees of freedom
