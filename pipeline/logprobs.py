"""Log-probabilities a request reports: the target's raw distribution at each position (the
log-softmax of its logits before any processor, temperature or mask: vLLM's default logprobs mode),
never a draft head's. The host computes them from a target step's logits; a verify round takes
them from the verify graph's outputs (export/acceptance.logprobs), the same numbers in float32."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem import contract as c


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its log-probability, and the position's top (token, logprob)
    pairs, most likely first (as many as the request asked for)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None     # 1 + tokens more likely than it (prompt positions: vLLM's prompt_logprobs)


def from_logits(logits: np.ndarray, token: int, n: int, rank: bool = False) -> TokenLogprob:
    """From one row of logits [V]: log-softmax in float32, as the verify graph computes it."""
    x = logits.astype(np.float32)
    m = x.max()
    lp = x - (m + np.float32(np.log(np.exp(x - m, dtype=np.float32).sum(dtype=np.float32))))
    top = ()
    if n:
        best = np.argpartition(-lp, n - 1)[:n] if n < len(lp) else np.arange(len(lp))
        best = best[np.lexsort((best, -lp[best]))]     # descending, lower id first among equals (as TopK)
        top = tuple((int(t), float(lp[t])) for t in best)
    return TokenLogprob(int(token), float(lp[token]), top, int((lp > lp[token]).sum()) + 1 if rank else None)


def from_verify(out: dict[str, np.ndarray], tokens: list[int], n: int) -> list[TokenLogprob]:
    """Rows 0..len(tokens)-1 of one sequence's verify outputs, the tokens they emitted."""
    lp, top, ids = out[c.TOKEN_LOGPROBS], out[c.TOP_LOGPROBS], out[c.TOP_LOGPROB_IDS]
    return [TokenLogprob(t, float(lp[i]), tuple(zip(ids[i, :n].tolist(), top[i, :n].tolist())))
            for i, t in enumerate(tokens)]


def prompt_logprobs(logits: np.ndarray, following: list[int], n: int) -> list[TokenLogprob]:
    """Row i of a prefill chunk's logits [R, V] scores the prompt token after it, following[i]."""
    return [from_logits(logits[i], t, n, rank=True) for i, t in enumerate(following)]
