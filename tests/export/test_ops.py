"""The `ai.tandem` ops' standard-ONNX bodies against plain numpy references."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.export.ops import gated_deltanet, paged_sparse_attention
from tandem.testing import op_references as ref

from ..op_harness import run, single_op_model


def l2(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def gdn_inputs(rng, b=3, w=5, hk=2, hv=4, dk=8, dv=6):
    q = l2(rng.standard_normal((b, w, hk, dk))).astype(np.float32)
    k = l2(rng.standard_normal((b, w, hk, dk))).astype(np.float32)
    v = rng.standard_normal((b, w, hv, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 2.0, (b, w, hv)).astype(np.float32)
    beta = rng.uniform(0, 1, (b, w, hv)).astype(np.float32)
    s0 = rng.standard_normal((b, hv, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("emit_rows", [False, True])
def test_gated_deltanet_matches_numpy(emit_rows):
    rng = np.random.default_rng(0)
    q, k, v, g, beta, s0 = gdn_inputs(rng)
    rows = np.array([5, 2, 1], np.int64)
    model = single_op_model(gated_deltanet.make_function(emit_rows), "GatedDeltaNet", [q, k, v, g, beta, s0, rows],
                            [4, 4, 5] if emit_rows else [4, 4], scale=0.35)
    outs = run(model, [q, k, v, g, beta, s0, rows])
    r_out, r_final, r_rows = ref.gated_deltanet(q, k, v, g, beta, s0, rows, scale=0.35)
    for b, n in enumerate(rows):
        np.testing.assert_allclose(outs[0][b, :n], r_out[b, :n], atol=1e-5)
    np.testing.assert_allclose(outs[1], r_final, atol=1e-5)
    if emit_rows:  # with all rows valid, row_states[:, n-1] is the state after n rows
        full = run(model, [q, k, v, g, beta, s0, np.full(3, 5, np.int64)])
        np.testing.assert_allclose(full[2], ref.gated_deltanet(q, k, v, g, beta, s0, scale=0.35)[2], atol=1e-5)


@pytest.mark.parametrize("n", range(0, 6))
def test_gated_deltanet_commit_of_n_rows_equals_n_single_steps(n):
    rng = np.random.default_rng(1)
    q, k, v, g, beta, s0 = gdn_inputs(rng, b=2)
    model = single_op_model(gated_deltanet.make_function(False), "GatedDeltaNet", [q, k, v, g, beta, s0,
                            np.zeros(2, np.int64)], [4, 4], scale=0.35)
    _, committed = run(model, [q, k, v, g, beta, s0, np.full(2, n, np.int64)])
    one = lambda x, t: np.ascontiguousarray(x[:, t : t + 1])  # noqa: E731
    state = s0
    for t in range(n):
        _, state = run(model, [one(q, t), one(k, t), one(v, t), one(g, t), one(beta, t), state,
                               np.ones(2, np.int64)])
    np.testing.assert_allclose(committed, state, atol=1e-5)


def attention_case(rng, b=3, w=4, hq=4, hkv=2, d=8, dv=8, n_pages=12, page=4, max_pages=4):
    q = rng.standard_normal((b, w, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, w, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, w, hkv, dv)).astype(np.float32)
    kc = rng.standard_normal((n_pages, page, hkv, d)).astype(np.float32)
    vc = rng.standard_normal((n_pages, page, hkv, dv)).astype(np.float32)
    tables = rng.permutation(n_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int64)
    lens = rng.integers(0, max_pages * page + 1, b).astype(np.int64)
    lens[0] = 0  # a sequence with nothing committed yet
    return q, k, v, kc, vc, tables, lens


@pytest.mark.parametrize("window", [0, 3, 9])
@pytest.mark.parametrize("selection", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_attention_matches_dense_masked(window, selection, seed):
    rng = np.random.default_rng(seed)
    q, k, v, kc, vc, tables, lens = attention_case(rng, dv=6 if seed else 8)
    sel = (rng.integers(-1, 16, (3, 4, 5)) if selection else np.zeros((1, 1, 0))).astype(np.int64)
    inputs = [q, k, v, kc, vc, tables, lens, sel]
    model = single_op_model(paged_sparse_attention.make_function(), "PagedSparseAttention", inputs, [4],
                            scale=0.3, sliding_window=window)
    (out,) = run(model, inputs)
    expected = ref.paged_attention(q, k, v, kc, vc, tables, lens, 0.3, window, sel if selection else None)
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_paged_attention_ignores_pool_contents_past_context(seed=3):
    rng = np.random.default_rng(seed)
    q, k, v, kc, vc, tables, lens = attention_case(rng)
    inputs = [q, k, v, kc, vc, tables, lens, np.zeros((1, 1, 0), np.int64)]
    model = single_op_model(paged_sparse_attention.make_function(), "PagedSparseAttention", inputs, [4],
                            scale=0.3, sliding_window=0)
    (before,) = run(model, inputs)
    for b in range(3):  # scribble over every slot past each sequence's context
        for j in range(int(lens[b]), tables.shape[1] * kc.shape[1]):
            kc[tables[b, j // 4], j % 4] = 1e3
    kc_untouched_pages = set(tables.flatten())
    for page in set(range(12)) - kc_untouched_pages:
        kc[page] = -1e3
    (after,) = run(model, inputs)
    np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("w,chunk", [(5, 4), (16, 4), (13, 8), (1, 4), (40, 16)])
def test_gated_deltanet_chunked_equals_recurrent_and_numpy(w, chunk):
    rng = np.random.default_rng(w)
    q, k, v, g, beta, s0 = gdn_inputs(rng, b=2, w=w)
    rows = np.array([w, max(1, w - 3)], np.int64)
    inputs = [q, k, v, g, beta, s0, rows]
    attrs = dict(scale=0.35, num_key_heads=2, num_value_heads=4)
    chunked = run(single_op_model(gated_deltanet.make_function(chunk_size=chunk), "GatedDeltaNet", inputs, [4, 4],
                                  **attrs), inputs)
    recurrent = run(single_op_model(gated_deltanet.make_function(), "GatedDeltaNet", inputs, [4, 4], **attrs), inputs)
    r_out, r_final, _ = ref.gated_deltanet(q, k, v, g, beta, s0, rows, scale=0.35)
    np.testing.assert_allclose(chunked[1], r_final, atol=2e-5)
    np.testing.assert_allclose(recurrent[1], r_final, atol=2e-5)
    for b, n in enumerate(rows):
        np.testing.assert_allclose(chunked[0][b, :n], r_out[b, :n], atol=2e-5)
        np.testing.assert_allclose(chunked[0][b, :n], recurrent[0][b, :n], atol=2e-5)
