"""Host-side sampling (the first token after prefill, plain decode) and the per-request random stream.

The stream is counter-based: the uniform that decides the token at absolute position x of a
request (its index in seq.tokens) is U(seed, x), a pure function. Nothing is consumed, so which
other requests share a batch, the verify width and whether speculation is on cannot shift it.
    key = mix(seed ^ SALT);   U(seed, x) = top 24 bits of mix(key + (x + 1) * GOLDEN) / 2^24
mix is splitmix64's finaliser; 24 bits make every uniform exact in float32, so the verify graph
and this sampler read the same number.

Sampling is the verify graph's (export/acceptance.py), step for step: temperature, then top-k,
then top-p on what top-k kept; then inverse-CDF over the vocabulary in id order, never past the
last token with non-zero probability. The host never sorts a vocabulary: a threshold is a
partition, a nucleus is searched among the largest logits, and a filtered row exponentiates and
accumulates only the tokens it keeps (tests/test_sampling_reproducible.py holds every setting to
the sorted computation bit for bit).
"""

from __future__ import annotations

import math
import threading

import numpy as np

from tandem.pipeline.sampling_params import SamplingParams

_MASK = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SALT = 0x5DEECE66D2545F49
_NUCLEUS_CANDIDATES = 256   # a top-p nucleus is looked for first among the 256 largest logits


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(seeds: list[int], positions: np.ndarray) -> np.ndarray:
    """U(seed, x) for B seeds (any Python ints) and positions [B, ...] (>= 0) -> float32 in [0, 1)."""
    positions = np.asarray(positions, np.uint64)
    keys = _mix(np.array([(s ^ _SALT) & _MASK for s in seeds], np.uint64))
    keys = keys.reshape(keys.shape + (1,) * (positions.ndim - 1))
    bits = _mix(keys + (positions + np.uint64(1)) * _GOLDEN) >> np.uint64(40)
    return (bits.astype(np.float64) * 2.0**-24).astype(np.float32)


def sample_rows(logits: np.ndarray, params: list[SamplingParams], u: np.ndarray) -> np.ndarray:
    """Tokens for rows of logits [n, V], row i by params[i] with the uniform u[i] of the position it
    fills: greedy rows by one argmax; rows sampled over the whole vocabulary together, in one pass
    of numpy calls (at a small vocabulary the calls' overhead is most of a token's host time); rows
    with a top-k or top-p filter one at a time, over the tokens they keep. Every row is computed
    from its own logits alone (elementwise, or reduced along its own row), so its token does not
    depend on the rows beside it."""
    tokens = np.argmax(logits, axis=-1)
    vocab = logits.shape[-1]
    full, filtered = [], []
    for i, p in enumerate(params):
        if not p.greedy:
            (full if _unfiltered(p, vocab) else filtered).append(i)
    if full:
        probs = _softmax_rows(logits if len(full) == len(params) else logits[full],
                              [params[i].temperature for i in full])
        for i, row in zip(full, probs):
            tokens[i] = _inverse_cdf(None, row, float(u[i]))
    for i in filtered:
        p = params[i]
        tokens[i] = _inverse_cdf(*_kept(_scaled_row(logits[i], p.temperature), p.top_k, p.top_p), float(u[i]))
    return tokens


def sample(logits: np.ndarray, params: SamplingParams, u: float) -> int:
    """The token for one row of logits [V], decided by the uniform of the position it fills."""
    if params.greedy:
        return int(np.argmax(logits))
    return int(sample_rows(logits[None], [params], (u,))[0])


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The probabilities a sampled row draws from, over the whole vocabulary [V] (float64):
    softmax(logits / T) over the top-k, then over the top-p nucleus of that (the top token always
    stays). The numbers sample_rows draws from, laid out over the vocabulary (a copy)."""
    if _unfiltered(SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p), len(logits)):
        return _softmax_rows(logits[None], [temperature])[0].copy()
    kept, probs = _kept(_scaled_row(logits, temperature), top_k, top_p)
    out = np.zeros(len(logits))
    out[kept] = probs
    return out


# ---- the arithmetic ------------------------------------------------------------------------------
# logits / T and the exponentials are float32, as the verify graph computes them (numpy's float64
# exp costs 1.4 ms over 150k logits, float32 0.15); the sums and cumulative sums that decide the
# token are float64. Large temporaries live in per-thread scratch buffers: a fresh 150k-logit
# float64 row (1.2 MB) is mapped and unmapped by malloc each time, about 300 page faults (1 ms).
_F32_MAX = float(np.finfo(np.float32).max)
_scratch_buffers = threading.local()
_SCRATCH_FROM = 1 << 15        # elements: smaller temporaries come from numpy's allocator (no faults)


def _scratch(name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A reused buffer of this thread, viewed as `shape`, for a large temporary (its contents are
    whatever was left)."""
    size = math.prod(shape)
    if size < _SCRATCH_FROM:
        return np.empty(shape, dtype)
    buffers = _scratch_buffers.__dict__.setdefault("buffers", {})
    buf = buffers.get(name)
    if buf is None or buf.size < size or buf.dtype != dtype:
        buf = buffers[name] = np.empty(size, dtype)
    return buf[:size].reshape(shape)


def _temperature(t: float) -> np.float32:
    return np.float32(min(t, _F32_MAX))     # the graph's input is float32 too


def _softmax_rows(logits: np.ndarray, temperatures: list[float]) -> np.ndarray:
    """softmax(logits / T) of rows [n, V] -> float64 [n, V] (a scratch buffer)."""
    n, vocab = logits.shape
    w = _scratch("weights", (n, vocab), np.float32)
    np.divide(logits, np.array([_temperature(t) for t in temperatures], np.float32)[:, None], out=w)
    w -= w.max(1, keepdims=True)
    np.exp(w, out=w)
    probs = _scratch("probs", (n, vocab), np.float64)
    probs[...] = w
    probs /= probs.sum(1, keepdims=True)
    return probs


def _scaled_row(logits: np.ndarray, temperature: float) -> np.ndarray:
    """logits / T of one row [V], float32 (a scratch buffer)."""
    return np.divide(logits, _temperature(temperature), out=_scratch("scaled", logits.shape, np.float32))


def _unfiltered(params: SamplingParams, vocab: int) -> bool:
    return params.top_p >= 1.0 and not 0 < params.top_k < vocab


def _inverse_cdf(ids: np.ndarray | None, probs: np.ndarray, u: float) -> int:
    """ids[j] (j itself for None) for the first j whose cumulative probability exceeds u; rounding
    never lands on a zero (j is capped at the last non-zero probability). Accumulates in place:
    probs is left holding the cumulative sums."""
    last = len(probs) - 1 if probs[-1] > 0 else int(np.flatnonzero(probs)[-1])
    j = min(int(np.searchsorted(np.cumsum(probs, out=probs), u, side="right")), last)
    return j if ids is None else int(ids[j])


def _kept(scaled: np.ndarray, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The ids a filtered row keeps, in id order, and their probabilities (float64): the softmax
    over them of scaled = logits / T [V]. Only the kept tokens are exponentiated, summed and
    accumulated: a top-k of 50 out of 150k logits costs a partition, not passes over the vocabulary."""
    top = scaled.max()
    mask = np.greater_equal(scaled, _threshold(scaled, top, top_k, top_p), out=_scratch("mask", scaled.shape, bool))
    kept = np.flatnonzero(mask)
    probs = np.exp(scaled[kept] - top).astype(np.float64)
    return kept, probs / probs.sum()


def _threshold(scaled: np.ndarray, top: np.float32, top_k: int, top_p: float) -> np.float32:
    """The least scaled logit a row keeps, found without sorting the vocabulary (a sort of 150k
    logits costs tens of milliseconds a token). The nucleus is the verify graph's
    (export/acceptance.py): over the top-k sorted, p = exp(s[:k] - s[0]) / sum, the leading tokens
    whose mass before them is below top_p (at least one). Its candidates are the top m logits,
    partitioned out and sorted; m grows until the nucleus ends inside them."""
    vocab = len(scaled)
    k = top_k if 0 < top_k < vocab else vocab
    copy = _scratch("partition", scaled.shape, np.float32)
    if top_p >= 1.0:
        copy[...] = scaled
        copy.partition(vocab - k)
        return copy[vocab - k]
    mass = None
    if k == vocab:      # the top-k's mass is the whole row's: float64 sums of float32 exponentials
        np.exp(np.subtract(scaled, top, out=copy), out=copy)
        mass = copy.sum(dtype=np.float64)
    m = min(k, _NUCLEUS_CANDIDATES) if k == vocab else k
    while True:
        copy[...] = scaled
        copy.partition(vocab - m)
        s = np.sort(copy[vocab - m:])[::-1]           # s[:m], descending
        p = np.exp(s - top).astype(np.float64)
        p /= p.sum() if m == k else mass
        keep = int(np.searchsorted(np.cumsum(p) - p, top_p, side="left"))
        if keep < m or m == k:
            return s[max(1, min(keep, k)) - 1]
        m = min(k, 4 * m)
