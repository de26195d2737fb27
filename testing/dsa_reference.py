"""Plain numpy reference for `ai.tandem::LightningIndexer` (loops, float64): the ground truth its
function body is tested against, with the scores so tests can see ties."""

from __future__ import annotations

import numpy as np


def lightning_indexer(q, weights, k, key_cache, block_tables, context_lens, scale, top_k):
    """q [B, W, Hi, D], weights [B, W, Hi], k [B, W, D], key_cache [N, S, D].

    Returns (selected [B, W, top_k] int64: the visible positions by descending score, equal
    scores lower position first, -1 padded; scores [B, W, max(ctx) + W] float64 by position,
    -inf where the row does not see the position)."""
    bsz, w = q.shape[:2]
    page = key_cache.shape[1]
    selected = np.full((bsz, w, top_k), -1, np.int64)
    scores = np.full((bsz, w, int(context_lens.max()) + w), -np.inf)
    for b in range(bsz):
        n = int(context_lens[b])
        keys = [key_cache[block_tables[b, j // page], j % page] for j in range(n)] + list(k[b])
        for i in range(w):
            for pos in range(n + i + 1):
                dots = q[b, i].astype(np.float64) @ keys[pos].astype(np.float64) * scale     # [Hi]
                scores[b, i, pos] = float(np.maximum(dots, 0.0) @ weights[b, i].astype(np.float64))
            order = sorted(range(n + i + 1), key=lambda pos: (-scores[b, i, pos], pos))[:top_k]
            selected[b, i, : len(order)] = order
    return selected, scores


def boundary_ties(scores_row, top_k, tol):
    """Whether the k-th best visible score of one row is within `tol` of the next one (then the
    attended set depends on how equal scores are ordered)."""
    visible = np.sort(scores_row[np.isfinite(scores_row)])[::-1]
    return len(visible) > top_k and visible[top_k - 1] - visible[top_k] <= tol
