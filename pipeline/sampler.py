"""Host-side sampling (the first token after prefill, plain decode) and the per-request random stream.

The stream is counter-based: the uniform that decides the token at absolute position x of a
request (its index in seq.tokens) is U(seed, x), a pure function. Nothing is consumed, so which
other requests share a batch, the verify width and whether speculation is on cannot shift it.
    key = mix(seed ^ SALT);   U(seed, x) = top 24 bits of mix(key + (x + 1) * GOLDEN) / 2^24
mix is splitmix64's finaliser; 24 bits make every uniform exact in float32, so the verify graph
and this sampler read the same number.

Sampling is the verify graph's (export/acceptance.py), step for step: temperature, then top-k,
then top-p on what top-k kept; then inverse-CDF over the vocabulary in id order, never past the
last token with non-zero probability.
"""

from __future__ import annotations

import numpy as np

from tandem.pipeline.sampling_params import SamplingParams

_MASK = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SALT = 0x5DEECE66D2545F49


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


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """softmax(logits / T) over the top-k, then over the top-p nucleus of that (the top token always stays)."""
    scaled = logits.astype(np.float64) / temperature
    k = top_k if 0 < top_k < len(scaled) else len(scaled)
    if top_p >= 1.0:
        # no nucleus: the k-th largest is the threshold, found without sorting the vocabulary (a sort
        # of 150k logits costs milliseconds a token); the same values, in the same order, as below
        threshold = np.partition(scaled, len(scaled) - k)[len(scaled) - k] if k < len(scaled) else -np.inf
        probs = np.where(scaled >= threshold, np.exp(scaled - scaled.max()), 0.0)
        return probs / probs.sum()
    order = np.argsort(-scaled, kind="stable")
    s = scaled[order]
    p = np.exp(s[:k] - s[0])
    p /= p.sum()
    keep = int(np.searchsorted(np.cumsum(p) - p, top_p, side="left"))
    threshold = s[max(1, min(keep, k)) - 1]
    probs = np.where(scaled >= threshold, np.exp(scaled - s[0]), 0.0)
    return probs / probs.sum()


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    """The first token whose cumulative probability exceeds u; rounding never lands on a zero."""
    last = int(np.flatnonzero(probs)[-1])
    return min(int(np.searchsorted(np.cumsum(probs), u, side="right")), last)


def sample(logits: np.ndarray, params: SamplingParams, u: float) -> int:
    """The token for one row of logits, decided by the uniform of the position it fills."""
    if params.greedy:
        return int(np.argmax(logits))
    return inverse_cdf(filtered_probs(logits, params.temperature, params.top_k, params.top_p), float(u))
