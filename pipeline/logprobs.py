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
    """From one row of logits [V]: log-softmax in float32, as the verify graph computes it
    (x - (max + log(sum(exp(x - max))))), taken only at the tokens reported: the top n are the top n
    logits, so the whole row of log-probabilities is never made."""
    x = logits if logits.dtype == np.float32 else logits.astype(np.float32)
    m = x.max()
    lse = m + np.float32(np.log(np.exp(x - m, dtype=np.float32).sum(dtype=np.float32)))
    top = ()
    if n:
        best = _top(x, n)
        top = tuple(zip(best.tolist(), (x[best] - lse).tolist()))
    return TokenLogprob(int(token), float(x[token] - lse), top, int((x > x[token]).sum()) + 1 if rank else None)


def _top(x: np.ndarray, n: int, kth: float | None = None) -> np.ndarray:
    """The ids of the n largest of x [V], most likely first, the lower id first among equals (as ONNX
    TopK); `kth`: the n-th largest value, where the caller has it."""
    if n >= len(x):
        best = np.arange(len(x))
    else:
        if kth is None:
            kth = np.partition(x, len(x) - n)[len(x) - n]
        best = np.flatnonzero(x >= kth)      # every tie at the n-th value: the lower ids win below
    return best[np.lexsort((best, -x[best]))][:n]


def from_rows(logits: np.ndarray, tokens: list[int], ns: list[int]) -> list[TokenLogprob]:
    """from_logits for rows of logits [n, V] (row i: its token and top ns[i]) in one pass: the same
    numbers, row by row."""
    x = logits if logits.dtype == np.float32 else logits.astype(np.float32)
    m = x.max(axis=1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(x - m, dtype=np.float32).sum(axis=1, dtype=np.float32))).astype(np.float32)
    top, v = max(ns), x.shape[1]
    kth = np.partition(x, v - top, axis=1)[:, v - top] if 0 < top < v else None
    out = []
    for i, (token, n) in enumerate(zip(tokens, ns)):
        pairs = ()
        if n:
            ids = _top(x[i], n, None if kth is None or n != top else kth[i])
            pairs = tuple(zip(ids.tolist(), (x[i, ids] - lse[i]).tolist()))
        out.append(TokenLogprob(int(token), float(x[i, token] - lse[i]), pairs))
    return out


def from_verify(out: dict[str, np.ndarray], tokens: list[int], n: int) -> list[TokenLogprob]:
    """Rows 0..len(tokens)-1 of one sequence's verify outputs, the tokens they emitted."""
    lp, top, ids = out[c.TOKEN_LOGPROBS], out[c.TOP_LOGPROBS], out[c.TOP_LOGPROB_IDS]
    return [TokenLogprob(t, float(lp[i]), tuple(zip(ids[i, :n].tolist(), top[i, :n].tolist())))
            for i, t in enumerate(tokens)]


def prompt_logprobs(logits: np.ndarray, following: list[int], n: int) -> list[TokenLogprob]:
    """Row i of a prefill chunk's logits [R, V] scores the prompt token after it, following[i]."""
    return [from_logits(logits[i], t, n, rank=True) for i, t in enumerate(following)]
