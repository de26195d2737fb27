"""A decode burst's work between calls in native code: `tandem_burst_greedy` / `tandem_burst_commit`
of tandem's CPU kernel library (plugins/cpu/decode_burst.cc), from the engine dir that carries it,
called through ctypes with one plan per burst.

Between two target steps of a burst (pipeline/decode_burst.py) the host commits the call's K/V
rows (and states not written in place), takes each row's greedy token, writes it and the context
into the next call's inputs and checks the stop ids. In numpy that is a dozen calls of a few µs
each, more after the engine call has pushed them out of the caches (tiny model, batch 8: 50 µs of
a 350 µs step); here one ctypes call of a few µs. The same rows land in the same pool rows and the
tokens are numpy's argmax (the first of the largest), so the outputs are the same bits.

A plan holds the addresses of the arrays it reads and writes (a bucket's bound inputs and outputs,
the pools) and keeps them referenced; the burst keeps one per bucket and makes a new one when the
runner hands back other arrays (a state placement changed). The pool rows come from the bound
block tables and context lengths, as the attention op reads them.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from tandem.plugins import cpu_kernels

EDIT_ROW_FIELDS = 17     # int64 fields per row of tandem_burst_edited's rows (Processors.burst_fields, logprobs)


class NativeBurst:
    def __init__(self, library: Path):
        """Raises OSError where the library does not load here, AttributeError where it predates
        the burst's functions (an engine dir built before them)."""
        lib = ctypes.CDLL(str(library))
        self._greedy, self._commit = lib.tandem_burst_greedy, lib.tandem_burst_commit
        self._greedy.argtypes, self._commit.argtypes = [ctypes.c_void_p, ctypes.c_int64], [ctypes.c_void_p]
        self._greedy.restype = self._commit.restype = ctypes.c_int64
        try:    # rows whose processors only edit (a library built before it: they take the numpy steps)
            self._edited = lib.tandem_burst_edited
            self._edited.argtypes, self._edited.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p], \
                ctypes.c_int64
        except AttributeError:
            self._edited = None

    @property
    def edits(self) -> bool:
        """Whether the library runs greedy rows with edit-only processors (tandem_burst_edited)."""
        return self._edited is not None

    def plan(self, copies: list[tuple[np.ndarray, np.ndarray, np.ndarray, bool]], page_size: int,
             logits: np.ndarray, tokens: np.ndarray, ids: np.ndarray, context: np.ndarray) -> BurstPlan | None:
        """The plan of bursts over one bucket's n rows, or None where an array's layout is not one the
        native step takes (the burst then runs its numpy steps):
        copies    (pool [R, row], output [n, row], index, paged): pool[r(b)] <- output[b], r(b) the
                  row of position context[b] in the page its block table `index` [batch, pages] holds
                  there (paged), or the slot index[b] (a state pool), as Pools.decode_copies gives them
        logits    float32 [n, V] (rows may be strided; each row contiguous)
        tokens    int64 [steps, n], contiguous: step s's greedy tokens go to tokens[s]
        ids       int64 [n] (strided): the next call's input ids; context int64 [n], contiguous: the
                  call's positions, then the next call's"""
        n = len(context)
        if not (_rows_ok(logits, np.float32) and _rows_ok(tokens, np.int64) and tokens.flags.c_contiguous
                and _int64(ids) and ids.ndim == 1 and _int64(context) and context.flags.c_contiguous):
            return None
        header = [n, len(copies), logits.ctypes.data, logits.shape[1], logits.strides[0] // 4, tokens.ctypes.data,
                  ids.ctypes.data, ids.strides[0] // 8, context.ctypes.data, 0, 0, page_size]
        pairs = []
        for pool, out, index, paged in copies:
            if not (_rows_ok(pool, out.dtype) and _rows_ok(out, out.dtype) and pool.shape[1] == out.shape[1]
                    and _int64(index) and index.ndim == (2 if paged else 1) and len(index) >= n):
                return None
            pairs += [out.ctypes.data, out.strides[0], pool.ctypes.data, pool.strides[0], out[0].nbytes,
                      index.ctypes.data, index.strides[0] // 8, index.shape[1] if paged else 0]
        return BurstPlan(self, np.array(header + pairs, np.int64), (copies, logits, tokens, ids, context))


class BurstPlan:
    def __init__(self, native: NativeBurst, plan: np.ndarray, arrays: tuple):
        self._plan, self._arrays = plan, arrays     # the arrays stay alive while their addresses are used
        self._address = plan.ctypes.data
        self._stops: tuple[frozenset, np.ndarray] = (frozenset(), np.zeros(0, np.int64))
        self._greedy, self._commit, self._edited = native._greedy, native._commit, native._edited

    def start(self, stops: frozenset[int]) -> None:
        """A burst begins: the stop ids of any of its rows."""
        if stops != self._stops[0]:
            ids = np.array(sorted(stops), np.int64)
            self._stops = (stops, ids)
            self._plan[9:11] = ids.ctypes.data, len(ids)

    def greedy(self, step: int) -> bool:
        """The call's commit, then its greedy tokens (into tokens[step], the ids) and context + 1;
        whether a token is a stop id."""
        result = self._greedy(self._address, step)
        if result < 0:
            raise _past_table()
        return result == 1

    def edited(self, step: int, rows: np.ndarray) -> bool:
        """greedy(step) with each row's edits applied first and its penalty state moved on by its token:
        rows int64 [n, EDIT_ROW_FIELDS] (Processors.burst_fields, then where a row's logprobs go:
        plugins/cpu/decode_burst.cc; zeros for a plain row)."""
        result = self._edited(self._address, step, rows.ctypes.data)
        if result == -2:
            raise RuntimeError("a decode burst's edit list had no room for the step's token (a bug: the burst "
                               "reserves its steps' room first)")
        if result < 0:
            raise _past_table()
        return result == 1

    def commit(self) -> None:
        """The call's commit only (a burst with sampled rows draws and writes its tokens itself)."""
        if self._commit(self._address) < 0:
            raise _past_table()


def _past_table() -> RuntimeError:
    return RuntimeError("a decode burst's row lies past its block table: the scheduler did not reserve the "
                        "burst's pages (a bug; RuntimeConfig(decode_burst=1) avoids bursts)")


def _rows_ok(array, dtype) -> bool:
    """A host [rows, row] array of `dtype` whose rows are each contiguous."""
    return (isinstance(array, np.ndarray) and array.ndim == 2 and array.dtype == dtype
            and array.strides[1] == array.itemsize and array.strides[0] > 0)


def _int64(array) -> bool:
    return isinstance(array, np.ndarray) and array.dtype == np.int64 and all(s % 8 == 0 for s in array.strides)


def load(library: Path | None) -> NativeBurst | None:
    """The native burst step of this library, or None (numpy steps) where there is none."""
    return cpu_kernels.host_functions(NativeBurst, library, "native decode-burst step",
                                      "bursts run their steps in numpy")
