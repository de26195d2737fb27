"""Plain numpy references for the `ai.tandem` custom ops (loops, no tricks): the ground truth
the function bodies and every lowering are tested against."""

from __future__ import annotations

import numpy as np


def gated_deltanet(q, k, v, g, beta, state, state_rows=None, scale=1.0):
    """q, k [B, W, Hk, dk]; v [B, W, Hv, dv]; g, beta [B, W, Hv]; state [B, Hv, dk, dv].
    Returns (output [B, W, Hv, dv], final_state after state_rows rows, row_states [B, W, ...])."""
    bsz, w, hk, _ = q.shape
    hv = v.shape[2]
    r = hv // hk
    rows = np.full(bsz, w) if state_rows is None else state_rows
    s = state.astype(np.float64).copy()
    out = np.zeros(v.shape, np.float64)
    row_states = np.zeros((bsz, w) + state.shape[1:], np.float64)
    final = s.copy()
    for b in range(bsz):
        for t in range(w):
            for h in range(hv):
                kk, qq = k[b, t, h // r].astype(np.float64), q[b, t, h // r].astype(np.float64)
                s[b, h] *= np.exp(g[b, t, h])
                u = beta[b, t, h] * (v[b, t, h] - s[b, h].T @ kk)
                s[b, h] += np.outer(kk, u)
                out[b, t, h] = scale * (s[b, h].T @ qq)
            row_states[b, t] = s[b]
            if t == rows[b] - 1:
                final[b] = s[b]
    return out, final, row_states


def paged_attention(q, k, v, key_cache, value_cache, block_tables, context_lens, scale,
                    sliding_window=0, selected=None, select_new_rows=False):
    """Dense masked attention over [committed (gathered by pages), new rows]; see the op doc."""
    bsz, w, hq, _ = q.shape
    hkv, page = k.shape[2], key_cache.shape[1]
    grp = hq // hkv
    out = np.zeros((bsz, w, hq, v.shape[3]), np.float64)
    for b in range(bsz):
        n = int(context_lens[b])
        ck = np.stack([key_cache[block_tables[b, j // page], j % page] for j in range(n)]) if n else k[b, :0]
        cv = np.stack([value_cache[block_tables[b, j // page], j % page] for j in range(n)]) if n else v[b, :0]
        keys, vals = np.concatenate([ck, k[b]]), np.concatenate([cv, v[b]])
        for i in range(w):
            pos = n + i
            sparse = selected is not None and selected.shape[-1]
            listed = selected[min(b, len(selected) - 1), min(i, selected.shape[1] - 1)] if sparse else None
            visible = []
            for j in range(n + w):
                if j >= n and j - n > i:
                    continue  # a later new row
                if sliding_window and pos - j >= sliding_window:
                    continue
                if sparse and (j < n or select_new_rows) and j not in listed:
                    continue
                visible.append(j)
            for h in range(hq):
                s = np.array([q[b, i, h] @ keys[j, h // grp] for j in visible], np.float64) * scale
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, i, h] = p @ vals[visible, h // grp]
    return out
