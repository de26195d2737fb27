"""The host sampler in native code: `tandem_sample_rows` of tandem's CPU kernel library
(plugins/cpu/sampler.cc), from the engine dir that carries the library, called through ctypes.

Same steps as the numpy sampler (pipeline/sampler.py) with the library's own arithmetic (its exp,
its sums' order): a token is numpy's except where the uniform falls within rounding of a boundary
between two tokens (tests/kernels/test_native_sampler.py), and the same bits on every x86 CPU. A batch's
sampled rows go in one call, about 5 us a row at 4,096 logits (bench/sampler.py); numpy's calls
cost several times that, more after an engine call has pushed them out of the caches.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from tandem.pipeline.sampler import clamped_temperature
from tandem.pipeline.sampling_params import SamplingParams
from tandem.plugins import cpu_kernels


class NativeSampler:
    def __init__(self, library: Path):
        """Raises OSError where the library does not load here, AttributeError where it predates
        the sampler (an engine dir built before it)."""
        fn = ctypes.CDLL(str(library)).tandem_sample_rows
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p]
        self._fn = fn
        self._grow(8)
        try:        # logprobs came later: a library from before them samples, and numpy scores
            lp = ctypes.CDLL(str(library)).tandem_logprobs_rows
            lp.restype = None
            lp.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                           ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            self._logprobs = lp
        except AttributeError:
            self._logprobs = None

    def _grow(self, rows: int) -> None:
        # kept between calls with their addresses: numpy's .ctypes.data costs 1.5-2.5 us an array
        self._settings = np.zeros((rows, 4), np.float64)   # temperature, top_k, top_p, u
        self._tokens = np.zeros(rows, np.int64)
        self._at = (self._settings.ctypes.data, self._tokens.ctypes.data)

    def sample(self, logits: np.ndarray, params: list[SamplingParams], u, probs: np.ndarray | None = None
               ) -> np.ndarray:
        """Tokens (int64 [n], a copy) for sampled rows of logits [n, V], row i by params[i] (not
        greedy) and the uniform u[i]; probs (float64 [n, V], optional) receives each row's kept
        probabilities, zeros elsewhere."""
        n, vocab = logits.shape
        if n > len(self._tokens):
            self._grow(n)
        settings = self._settings[:n]
        settings[:, 0] = [clamped_temperature(p.temperature) for p in params]
        settings[:, 1] = [p.top_k for p in params]
        settings[:, 2] = [p.top_p for p in params]
        settings[:, 3] = u
        if probs is not None and (probs.shape != (n, vocab) or probs.dtype != np.float64
                                  or not probs.flags.c_contiguous):
            raise ValueError(f"probs must be a contiguous float64 array of shape {(n, vocab)}")
        logits = _writable_float32(logits)
        self._fn(ctypes.addressof(ctypes.c_char.from_buffer(logits)), n, vocab, *self._at,
                 None if probs is None else probs.ctypes.data)
        return self._tokens[:n].copy()


    def logprobs(self, logits: np.ndarray, tokens: list[int], n: int) -> tuple | None:
        """For rows of logits [rows, V]: (token_lp [rows] float32, top_ids [rows, n], top_lp [rows, n]),
        the log-softmax at each row's token and its n most likely; None where the library has none."""
        if self._logprobs is None:
            return None
        if logits.dtype != np.float32 or logits.strides[1] != 4:
            logits = np.ascontiguousarray(logits, np.float32)
        rows, vocab = logits.shape
        tokens = np.asarray(tokens, np.int64)
        token_lp, top_ids, top_lp = np.empty(rows, np.float32), np.empty((rows, n), np.int64), np.empty((rows, n),
                                                                                                     np.float32)
        self._logprobs(logits.ctypes.data, rows, vocab, logits.strides[0] // 4, tokens.ctypes.data, n,
                       token_lp.ctypes.data, top_ids.ctypes.data, top_lp.ctypes.data)
        return token_lp, top_ids, top_lp


def _writable_float32(logits: np.ndarray) -> np.ndarray:
    """logits as a contiguous, writable float32 array (ctypes takes the address of a writable
    buffer for a fraction of numpy's .ctypes), copied only where they are not."""
    if logits.dtype == np.float32 and logits.flags.c_contiguous and logits.flags.writeable:
        return logits
    return np.array(logits, np.float32, order="C")


def load(library: Path | None) -> NativeSampler | None:
    """The native sampler of this library, or None (numpy samples) where there is none."""
    return cpu_kernels.host_functions(NativeSampler, library, "native sampler", "sampling on the host with numpy")
