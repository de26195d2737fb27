"""The host sampler in native code: `tandem_sample_rows` of tandem's CPU kernel library
(plugins/cpu/sampler.cc), from the engine dir that carries the library, called through ctypes.

Same steps as the numpy sampler (pipeline/sampler.py) with the library's own arithmetic (its exp,
its sums' order): a token is numpy's except where the uniform falls within rounding of a boundary
between two tokens (tests/test_native_sampler.py), and the same bits on every x86 CPU. A batch's
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


def _writable_float32(logits: np.ndarray) -> np.ndarray:
    """logits as a contiguous, writable float32 array (ctypes takes the address of a writable
    buffer for a fraction of numpy's .ctypes), copied only where they are not."""
    if logits.dtype == np.float32 and logits.flags.c_contiguous and logits.flags.writeable:
        return logits
    return np.array(logits, np.float32, order="C")


def load(library: Path | None) -> NativeSampler | None:
    """The native sampler of this library, or None (numpy samples) where there is none."""
    return cpu_kernels.host_functions(NativeSampler, library, "native sampler", "sampling on the host with numpy")
