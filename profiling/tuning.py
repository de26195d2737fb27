"""Choose the verify width per batch size from measured latencies and acceptance.

For width W (k = W - 1 drafts), a round commits E(W) = 1 + sum_{j < k} r_j tokens per sequence,
where r_j is the measured share of rounds whose draft j+1 was accepted (given it was drafted);
it costs t_round(B, W) = t_verify(B, W) + t_draft(B, k) + t_reanchor(B, W) + t_host(B). Width 1
means no drafting: t_round = t_decode(B). The choice maximises B * E(W) / t_round(B, W).
"""

from __future__ import annotations


def expected_tokens(acceptance: list[float], width: int) -> float:
    return 1.0 + sum(acceptance[j] if j < len(acceptance) else 0.0 for j in range(width - 1))


def choose_widths(batch_sizes: list[int], widths: list[int], acceptance: list[float],
                  round_seconds: dict[tuple[int, int], float]) -> dict[int, dict]:
    """round_seconds[(B, W)]: predicted seconds of a round at batch B, width W (W = 1: plain).
    Returns per batch: chosen width, expected tokens/s per width, and the gain over plain decode."""
    out = {}
    for b in batch_sizes:
        options = {}
        for w in [1, *widths]:
            t = round_seconds.get((b, w))
            if t:
                options[w] = b * expected_tokens(acceptance, w) / t
        best = max(options, key=options.get)
        plain = options.get(1)
        out[b] = {"width": best, "tokens_per_s": {str(w): round(v, 2) for w, v in options.items()},
                  "gain_over_plain": round(options[best] / plain, 3) if plain else None}
    return out
