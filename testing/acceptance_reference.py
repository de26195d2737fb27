"""numpy reference of the verify graph's acceptance (same semantics as export/acceptance.py)."""

from __future__ import annotations

import numpy as np


def _filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """softmax(logits / T) restricted to the top-k, then to the top-p nucleus of that."""
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    s = scaled[order]
    k = top_k if top_k > 0 else len(s)
    ps = np.exp(s[:k] - s[0])
    ps /= ps.sum()
    before = np.cumsum(ps) - ps
    keep = np.flatnonzero(before < top_p)
    n_keep = max(1, keep[-1] + 1 if len(keep) else 1)
    threshold = s[n_keep - 1]
    p = np.where(scaled >= threshold, np.exp(scaled - s[0]), 0.0)
    return p / p.sum()


def accept(logits, ids, temperature, top_k, top_p, uniforms) -> tuple[np.ndarray, np.ndarray]:
    """logits [B, W, V], ids [B, W] = [pending, d_1..d_k] -> (accepted [B], next_token [B])."""
    bsz, w, vocab = logits.shape
    accepted, nxt = np.zeros(bsz, np.int64), np.zeros(bsz, np.int64)
    for b in range(bsz):
        if temperature[b] <= 0:
            best = logits[b].argmax(-1)
            a = 0
            while a < w - 1 and ids[b, a + 1] == best[a]:
                a += 1
            accepted[b], nxt[b] = a, best[a]
            continue
        probs = [_filtered_probs(logits[b, i], temperature[b], top_k[b], top_p[b]) for i in range(w)]
        a = 0
        while a < w - 1 and uniforms[b, a] < probs[a][ids[b, a + 1]]:
            a += 1
        residual = probs[a].copy()
        if a < w - 1:
            residual[ids[b, a + 1]] = 0.0
        cdf = np.cumsum(residual)
        accepted[b] = a
        nxt[b] = min(int((cdf <= uniforms[b, -1] * residual.sum()).sum()), vocab - 1)
    return accepted, nxt
