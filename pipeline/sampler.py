"""Host-side sampling from one row of logits (the first token after prefill, plain decode).
Same filtering as the verify graph: temperature, then top-k, then top-p on what top-k kept."""

from __future__ import annotations

import numpy as np

from tandem.pipeline.sampling_params import SamplingParams


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    s = scaled[order]
    k = top_k if 0 < top_k < len(s) else len(s)
    p = np.exp(s[:k] - s[0])
    p /= p.sum()
    keep = int(np.searchsorted(np.cumsum(p) - p, top_p, side="left")) if top_p < 1.0 else k
    threshold = s[max(1, min(keep, k)) - 1]
    probs = np.where(scaled >= threshold, np.exp(scaled - s[0]), 0.0)
    return probs / probs.sum()


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if params.greedy:
        return int(np.argmax(logits))
    probs = filtered_probs(logits, params.temperature, params.top_k, params.top_p)
    return int(min(np.searchsorted(np.cumsum(probs), rng.random(), side="right"), len(probs) - 1))
