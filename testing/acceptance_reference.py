"""numpy reference of the verify graph's acceptance (same semantics as export/acceptance.py)."""

from __future__ import annotations

import numpy as np

from tandem.contract import MIN_TEMPERATURE


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


def _own_token(logits, temperature, top_k, top_p, u) -> int:
    """The row's own token: argmax, or inverse-CDF of the filtered distribution at u."""
    if temperature < MIN_TEMPERATURE:
        return int(logits.argmax())
    p = _filtered_probs(logits, temperature, top_k, top_p)
    return min(int((np.cumsum(p) <= u).sum()), int(np.flatnonzero(p)[-1]))


def accept(logits, ids, temperature, top_k, top_p, uniforms) -> tuple[np.ndarray, np.ndarray]:
    """logits [B, W, V], ids [B, W] = [pending, d_1..d_k] -> (accepted [B], next_token [B]).
    Row i's own token t_i (uniforms[b, i] when sampled); accepted = leading drafts equal to t_i;
    next = t_accepted."""
    bsz, w, _ = logits.shape
    accepted, nxt = np.zeros(bsz, np.int64), np.zeros(bsz, np.int64)
    for b in range(bsz):
        a = 0
        t = _own_token(logits[b, 0], temperature[b], top_k[b], top_p[b], uniforms[b, 0])
        while a < w - 1 and ids[b, a + 1] == t:
            a += 1
            t = _own_token(logits[b, a], temperature[b], top_k[b], top_p[b], uniforms[b, a])
        accepted[b], nxt[b] = a, t
    return accepted, nxt
