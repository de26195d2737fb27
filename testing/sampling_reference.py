"""The host sampler's definition computed the direct way, by sorting each row's vocabulary: what
pipeline/sampler.py computed before it partitioned, kept as the reference its fast path must equal
bit for bit (tests/pipeline/test_sampling_reproducible.py) and the baseline its cost is measured against
(bench/sampler.py)."""

from __future__ import annotations

import numpy as np


def sorted_filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """float64 [V]: logits / T and exp in float32, sums in float64; the nucleus over the top-k
    sorted, p = exp(s[:k] - s[0]) / sum, the leading tokens whose mass before them is below top_p
    (at least one); then the softmax of the kept tokens, in id order."""
    scaled = logits / np.float32(min(temperature, float(np.finfo(np.float32).max)))
    s = np.sort(scaled)[::-1]
    k = top_k if 0 < top_k < len(s) else len(s)
    p = np.exp(s[:k] - s[0]).astype(np.float64)
    p /= p.sum()
    keep = int(np.searchsorted(np.cumsum(p) - p, top_p, side="left")) if top_p < 1.0 else k
    kept = scaled >= s[max(1, min(keep, k)) - 1]
    probs = np.exp(scaled[kept] - s[0]).astype(np.float64)
    out = np.zeros(len(logits))
    out[kept] = probs / probs.sum()
    return out


def sorted_sample(logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """The token at uniform u: the first id whose cumulative probability exceeds u, never past the
    last id with non-zero probability."""
    probs = sorted_filtered_probs(logits, temperature, top_k, top_p)
    return min(int(np.searchsorted(np.cumsum(probs), u, side="right")), int(np.flatnonzero(probs)[-1]))


def lm_like_logits(rng: np.random.Generator, vocab: int, spread: float) -> np.ndarray:
    """float32 logits shaped like a language model's: log-probabilities falling with rank (Zipf, a
    larger spread is more peaked) in a random order, with noise; ties at the top and at the
    filters' usual thresholds, and a few masked tokens."""
    logits = (-np.log1p(rng.permutation(vocab)) * spread + rng.standard_normal(vocab) * 0.3).astype(np.float32)
    logits[rng.integers(0, vocab, 8)] = logits.max()
    logits[rng.integers(0, vocab, 8)] = np.sort(logits)[-30]
    logits[rng.integers(0, vocab, 4)] = -np.inf
    return logits
