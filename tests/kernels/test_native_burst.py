"""A decode burst's native step (plugins/cpu/decode_burst.cc through pipeline/native_burst.py)
against the numpy steps it replaces: the same pool rows written (paged pools at each row's
position in its block table's page, states at the slots), numpy's argmax (ties, NaN, -inf rows,
vocabularies that are not a multiple of the vector width, both the portable and AVX-512 forms),
the next call's ids and context, the stop ids; a position past its block table fails the call."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.pipeline.native_burst import NativeBurst
from tandem.plugins import cpu_kernels

PAGE = 4


@pytest.fixture(scope="module")
def native():
    library = cpu_kernels.library()
    if library is None:
        pytest.skip("no C++ compiler here: the kernel library, and so the native burst step, is not built")
    return NativeBurst(library)


class Call:
    """One bucket's arrays as the runner binds them: batch rows B >= n, outputs for n rows."""

    def __init__(self, n: int, vocab: int, rng: np.random.Generator, batch: int = 8, pages: int = 6):
        self.n = n
        self.logits_buf = rng.standard_normal((batch, 1, vocab)).astype(np.float32)
        self.ids = np.zeros((batch, 1), np.int64)
        self.context = rng.integers(0, pages * PAGE - 3, batch).astype(np.int64)   # 3 steps fit
        self.tables = np.stack([rng.permutation(32)[:pages] for _ in range(batch)]).astype(np.int64)
        self.slots = rng.permutation(16)[:batch].astype(np.int64)
        self.key_pool = rng.standard_normal((32, PAGE, 2, 8)).astype(np.float32)
        self.state_pool = rng.standard_normal((16, 3, 5)).astype(np.float32)
        self.key_out = rng.standard_normal((batch, 1, 2, 8)).astype(np.float32)
        self.state_out = rng.standard_normal((batch, 3, 5)).astype(np.float32)
        self.tokens = np.zeros((4, n), np.int64)

    def copies(self):
        return [(self.key_pool.reshape(32 * PAGE, -1), self.key_out[: self.n].reshape(self.n, -1), self.tables, True),
                (self.state_pool.reshape(16, -1), self.state_out[: self.n].reshape(self.n, -1), self.slots, False)]

    def plan(self, native):
        return native.plan(self.copies(), PAGE, self.logits_buf[: self.n, 0], self.tokens, self.ids[: self.n, 0],
                           self.context[: self.n])

    def numpy_step(self) -> np.ndarray:
        """What the numpy burst does: the commit (Pools.commit_decode), argmax, ids, context + 1."""
        n, ctx = self.n, self.context[: self.n]
        rows = self.tables[np.arange(n), ctx // PAGE] * PAGE + ctx % PAGE
        self.key_pool.reshape(32 * PAGE, -1)[rows] = self.key_out[:n].reshape(n, -1)
        self.state_pool[self.slots[:n]] = self.state_out[:n]
        token = self.logits_buf[:n, 0].argmax(-1)
        self.ids[:n, 0] = token
        self.context[:n] += 1
        return token


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("vocab", [5, 16, 384, 4099])
def test_a_native_step_is_the_numpy_step(native, monkeypatch, portable, vocab):
    if portable:
        monkeypatch.setenv("TANDEM_CPU_KERNELS_PORTABLE", "1")
    rng = np.random.default_rng(vocab)
    for n in (1, 3, 8):
        ours, theirs = Call(n, vocab, np.random.default_rng(n)), Call(n, vocab, np.random.default_rng(n))
        plan = ours.plan(native)
        plan.start(frozenset())
        for step in range(3):
            for call in (ours, theirs):     # new outputs per call, the same in both
                call.key_out[:], call.state_out[:] = rng.standard_normal(call.key_out.shape), \
                    rng.standard_normal(call.state_out.shape)
                call.logits_buf[:] = rng.standard_normal(call.logits_buf.shape).astype(np.float32)
            theirs.key_out[:], theirs.state_out[:], theirs.logits_buf[:] = ours.key_out, ours.state_out, ours.logits_buf
            # ties, NaN and -inf rows: numpy's argmax takes the first of the largest, the first NaN, 0
            ours.logits_buf[0, 0, vocab // 2 :] = ours.logits_buf[0, 0].max() + 1
            if n > 1:
                ours.logits_buf[1, 0, :] = -np.inf
            if n > 2:
                ours.logits_buf[2, 0, [vocab - 1, vocab // 3]] = np.nan
            theirs.logits_buf[:] = ours.logits_buf
            assert plan.greedy(step) is False
            expected = theirs.numpy_step()
            assert np.array_equal(ours.tokens[step], expected)
            for name in ("ids", "context", "key_pool", "state_pool"):
                assert np.array_equal(getattr(ours, name), getattr(theirs, name), equal_nan=True), (name, n, step)


def test_commit_only_and_stop_ids(native):
    call = Call(4, 64, np.random.default_rng(0))
    plan = call.plan(native)
    expected = call.logits_buf[:4, 0].argmax(-1)
    plan.start(frozenset({int(expected[2]), 99999}))
    before = call.key_pool.copy()
    ctx = call.context[:4].copy()
    plan.commit()       # the copies only: tokens, ids and context are the caller's
    assert not np.array_equal(call.key_pool, before)
    assert np.array_equal(call.context[:4], ctx) and not call.tokens.any()
    assert plan.greedy(1) is True       # row 2's token is a stop id
    assert np.array_equal(call.tokens[1], expected)
    plan.start(frozenset({-5}))
    assert plan.greedy(2) is False


def test_a_row_past_its_block_table_fails_the_call(native):
    call = Call(2, 32, np.random.default_rng(1), pages=2)
    call.context[1] = 2 * PAGE      # page index 2 of a table 2 pages wide
    plan = call.plan(native)
    plan.start(frozenset())
    before = call.key_pool.copy()
    with pytest.raises(RuntimeError, match="past its block table"):
        plan.greedy(0)
    with pytest.raises(RuntimeError, match="past its block table"):
        plan.commit()
    assert not call.tokens.any()
    assert np.array_equal(call.key_pool.reshape(32 * PAGE, -1)[call.tables[1] * PAGE],
                          before.reshape(32 * PAGE, -1)[call.tables[1] * PAGE])


def test_layouts_the_step_does_not_take_leave_the_numpy_steps(native):
    call = Call(2, 32, np.random.default_rng(2))
    assert call.plan(native) is not None
    ids64 = call.logits_buf[:2, 0]
    assert native.plan(call.copies(), PAGE, ids64.astype(np.float64), call.tokens, call.ids[:2, 0],
                       call.context[:2]) is None
    assert native.plan(call.copies(), PAGE, ids64, call.tokens, call.ids[:2, 0].astype(np.int32),
                       call.context[:2]) is None
    pool, out, index, _ = call.copies()[0]
    assert native.plan([(pool, out[:, ::2], index, True)], PAGE, ids64, call.tokens, call.ids[:2, 0],
                       call.context[:2]) is None
