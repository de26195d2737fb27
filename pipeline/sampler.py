"""Host-side sampling (the first token after prefill, plain decode) and the per-request random stream.

The stream is counter-based: the uniform that decides the token at absolute position x of a
request (its index in seq.tokens) is U(seed, x), a pure function. Nothing is consumed, so which
other requests share a batch, the verify width and whether speculation is on cannot shift it.
    key = mix(seed ^ SALT);   U(seed, x) = top 24 bits of mix(key + (x + 1) * GOLDEN) / 2^24
mix is splitmix64's finaliser; 24 bits make every uniform exact in float32, so the verify graph
and this sampler read the same number.

Sampling is the verify graph's (export/acceptance.py), step for step: temperature, then min-p
(vLLM's order), then top-k, then top-p on what top-k kept; then inverse-CDF over the vocabulary
in id order, never past the last token with non-zero probability. The host never sorts a vocabulary: a threshold is a
partition, a nucleus is searched among the largest logits, and a filtered row exponentiates and
accumulates only the tokens it keeps (tests/pipeline/test_sampling_reproducible.py holds every setting to
the sorted computation bit for bit).
"""

from __future__ import annotations

import math
import threading

import numpy as np

from tandem.pipeline.logprobs import TokenLogprob, from_rows
from tandem.pipeline.sampling_params import SamplingParams


def min_p_log(min_p: float) -> np.float32:
    """log(min_p) in float32 (-inf: off): a sampled row keeps the tokens whose scaled logit is at least
    its top one's plus this (p >= min_p * p_top). The host and the verify graph add this same number."""
    return np.float32(math.log(min_p)) if min_p > 0 else np.float32(-np.inf)

_MASK = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SALT = 0x5DEECE66D2545F49
_NUCLEUS_CANDIDATES = 256   # a top-p nucleus is looked for first among the 256 largest logits


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


def sample_rows(logits: np.ndarray, params: list[SamplingParams], u: np.ndarray) -> np.ndarray:
    """Tokens for rows of logits [n, V], row i by params[i] with the uniform u[i] of the position it
    fills: greedy rows by one argmax; sampled rows together, in one pass of numpy calls over the
    batch (at a small vocabulary the calls' overhead is most of a token's host time), rows with a
    top-k or top-p filter drawn over the tokens they keep. Every row is computed from its own
    logits alone (elementwise, or reduced along its own row), so its token does not depend on the
    rows beside it."""
    tokens = np.argmax(logits, axis=-1)
    vocab = logits.shape[-1]
    full, filtered = [], []
    for i, p in enumerate(params):
        if not p.greedy:
            (full if _unfiltered(p.top_k, p.top_p, vocab) and not p.min_p else filtered).append(i)
    if full:
        probs = _softmax_rows(logits if len(full) == len(params) else logits[full],
                              [params[i].temperature for i in full])
        for i, row in zip(full, probs):
            tokens[i] = _inverse_cdf(None, row, float(u[i]))
    if filtered:
        chosen = logits if len(filtered) == len(params) else logits[filtered]
        for i, (kept, probs) in zip(filtered, _filtered_rows(chosen, [params[i] for i in filtered])):
            tokens[i] = _inverse_cdf(kept, probs, float(u[i]))
    return tokens


class HostSampler:
    """A pipeline's host draws: the engine dir's native sampler (pipeline/native_sampler.py) where
    its kernel library has one, else numpy's (sample_rows). One per LLM, so every host draw of a
    request is the same arithmetic: the first token, plain steps, bursts, grammar rows."""

    def __init__(self, native=None):
        self.native = native        # a NativeSampler, or None

    def rows(self, logits: np.ndarray, params: list[SamplingParams], u) -> np.ndarray:
        """sample_rows' tokens for rows of logits [n, V] (greedy rows by one argmax; the pipeline
        passes sampled rows only, which skip it)."""
        if self.native is None or any(p.min_p for p in params):   # (the native sampler has no min-p)
            return sample_rows(logits, params, u)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if len(sampled) == len(params):
            return self.native.sample(logits, params, u)
        tokens = np.argmax(logits, axis=-1)
        if sampled:
            tokens[sampled] = self.native.sample(logits[sampled], [params[i] for i in sampled], np.asarray(u)[sampled])
        return tokens

    def logprobs(self, logits: np.ndarray, tokens: list[int], ns: list[int]) -> list:
        """A pipeline.logprobs.TokenLogprob for each row of logits [rows, V]: its token's raw
        log-probability and its ns[i] most likely (the native library's where it has them, else numpy's)."""
        got = self.native.logprobs(logits, tokens, max(ns)) if self.native is not None else None
        if got is None:
            return from_rows(logits, tokens, ns)
        token_lp, top_ids, top_lp = got
        return [TokenLogprob(int(t), float(token_lp[i]), tuple(zip(top_ids[i, :n].tolist(), top_lp[i, :n].tolist())))
                for i, (t, n) in enumerate(zip(tokens, ns))]

    def one(self, logits: np.ndarray, params: SamplingParams, u: float) -> int:
        """The token for one row of logits [V], decided by the uniform of the position it fills."""
        if params.greedy:
            return int(np.argmax(logits))
        return int(self.rows(logits[None], [params], (u,))[0])


def sample(logits: np.ndarray, params: SamplingParams, u: float) -> int:
    """HostSampler.one with numpy's sampler."""
    return _NUMPY.one(logits, params, u)


_NUMPY = HostSampler()


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The probabilities a sampled row draws from, over the whole vocabulary [V] (float64):
    softmax(logits / T) over the top-k, then over the top-p nucleus of that (the top token always
    stays). The numbers sample_rows draws from, laid out over the vocabulary (a copy)."""
    if _unfiltered(top_k, top_p, len(logits)):
        return _softmax_rows(logits[None], [temperature])[0].copy()
    ((kept, probs),) = _filtered_rows(logits[None], [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)])
    out = np.zeros(len(logits))
    out[kept] = probs
    return out


# ---- the arithmetic ------------------------------------------------------------------------------
# logits / T and the exponentials are float32, as the verify graph computes them (numpy's float64
# exp costs 1.4 ms over 150k logits, float32 0.15); the sums and cumulative sums that decide the
# token are float64. Large temporaries live in per-thread scratch buffers: a fresh 150k-logit
# float64 row (1.2 MB) is mapped and unmapped by malloc each time, about 300 page faults (1 ms).
_F32_MAX = float(np.finfo(np.float32).max)
_scratch_buffers = threading.local()
_SCRATCH_FROM = 1 << 16        # bytes: smaller temporaries come from the heap (malloc maps 128 KiB and more)


def _scratch(name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A reused buffer of this thread, viewed as `shape`, for a large temporary (its contents are
    whatever was left)."""
    size = math.prod(shape)
    if size * np.dtype(dtype).itemsize < _SCRATCH_FROM:
        return np.empty(shape, dtype)
    buffers = _scratch_buffers.__dict__.setdefault("buffers", {})
    buf = buffers.get(name)
    if buf is None or buf.size < size or buf.dtype != dtype:
        buf = buffers[name] = np.empty(size, dtype)
    return buf[:size].reshape(shape)


def clamped_temperature(t: float) -> float:
    """T as the engines take it: at most float32's largest (still near-uniform, and no overflow
    filling a float32 input); the host samplers use the same."""
    return min(t, _F32_MAX)


def _temperature(t: float) -> np.float32:
    return np.float32(clamped_temperature(t))     # the graph's input is float32 too


def _scaled_rows(logits: np.ndarray, temperatures: list[float], name: str) -> np.ndarray:
    """logits / T of rows [n, V], float32 (the scratch buffer `name`)."""
    t = np.array([_temperature(x) for x in temperatures], np.float32)[:, None]
    return np.divide(logits, t, out=_scratch(name, logits.shape, np.float32))


def _softmax_rows(logits: np.ndarray, temperatures: list[float]) -> np.ndarray:
    """softmax(logits / T) of rows [n, V] -> float64 [n, V] (a scratch buffer)."""
    w = _scaled_rows(logits, temperatures, "weights")
    w -= w.max(1, keepdims=True)
    np.exp(w, out=w)
    probs = _scratch("probs", w.shape, np.float64)
    probs[...] = w
    probs /= probs.sum(1, keepdims=True)
    return probs


def _unfiltered(top_k: int, top_p: float, vocab: int) -> bool:
    """Whether a sampled row keeps its whole vocabulary (no top-k below it, no nucleus)."""
    return top_p >= 1.0 and not 0 < top_k < vocab


def _inverse_cdf(ids: np.ndarray | None, probs: np.ndarray, u: float) -> int:
    """ids[j] (j itself for None) for the first j whose cumulative probability exceeds u; rounding
    never lands on a zero (j is capped at the last non-zero probability). Accumulates in place:
    probs is left holding the cumulative sums."""
    last = len(probs) - 1 if probs[-1] > 0 else int(np.flatnonzero(probs)[-1])
    j = min(int(np.searchsorted(np.cumsum(probs, out=probs), u, side="right")), last)
    return j if ids is None else int(ids[j])


def _filtered_rows(logits: np.ndarray, params: list[SamplingParams]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per row of logits [n, V] with a top-k or top-p filter: the ids it keeps, in id order, and
    their probabilities (float64), the softmax over them of logits / T. Only the kept tokens are
    exponentiated, summed and accumulated: a top-k of 50 out of 150k logits costs a partition, not
    passes over the vocabulary."""
    scaled = _scaled_rows(logits, [p.temperature for p in params], "scaled")
    top = scaled.max(1)
    for row, best, p in zip(scaled, top, params):   # min-p first, as the verify graph: below top + log(min_p) out
        if p.min_p:
            row[row < best + min_p_log(p.min_p)] = -np.inf
    thresholds = _thresholds(scaled, top, [p.top_k for p in params], [p.top_p for p in params])
    out = []
    for row, best, threshold in zip(scaled, top, thresholds):
        kept = np.flatnonzero(np.greater_equal(row, threshold, out=_scratch("mask", row.shape, bool)))
        probs = np.exp(row[kept] - best).astype(np.float64)
        out.append((kept, probs / probs.sum()))
    return out


def _thresholds(scaled: np.ndarray, top: np.ndarray, top_k: list[int], top_p: list[float]) -> np.ndarray:
    """The least scaled logit each row of scaled [n, V] keeps (float32 [n]), found without sorting
    the vocabulary (a sort of 150k logits costs tens of milliseconds a token). A top-k alone: the
    k-th largest, a partition. A nucleus is the verify graph's (export/acceptance.py): over the
    top-k sorted, p = exp(s[:k] - s[0]) / sum, the leading tokens whose mass before them is below
    top_p (at least one). Its candidates are the top m logits, partitioned out and sorted, m
    growing 4x from 256 until the nucleus ends inside them; their p are normalised by the top-k's
    own sum when they are the top-k, else by the row's whole mass (the same up to rounding). Rows
    with the same top-k go through each numpy call together; the candidates, sums and cumulative
    sums are along each row, so a row's threshold does not depend on the rows beside it."""
    n, vocab = scaled.shape
    out = np.empty(n, np.float32)
    groups: dict[tuple[int, bool], list[int]] = {}     # (top-k, nucleus) -> its rows
    for i, (k, p) in enumerate(zip(top_k, top_p)):
        groups.setdefault((k if 0 < k < vocab else vocab, p < 1.0), []).append(i)
    ps = np.array(top_p, np.float64)
    for (k, nucleus), rows in groups.items():
        rows = np.array(rows)
        if not nucleus:
            out[rows] = _rows_of(scaled, rows, vocab - k)[:, vocab - k]
            continue
        mass = None
        if k == vocab:      # the top-k's mass is the whole row's: float64 sums of float32 exps
            w = _rows_of(scaled, rows, None)
            mass = np.exp(np.subtract(w, top[rows, None], out=w), out=w).sum(1, dtype=np.float64)
        m = k if k < vocab else min(vocab, _NUCLEUS_CANDIDATES)
        while len(rows):
            s = np.sort(_rows_of(scaled, rows, vocab - m if m < vocab else None)[:, vocab - m:], axis=1)[:, ::-1]
            p = np.exp(s - top[rows, None]).astype(np.float64)          # s: [rows, m], each row descending
            p /= p.sum(1, keepdims=True) if m == k else mass[:, None]
            before = np.cumsum(p, axis=1) - p
            left = []
            for j, (i, x) in enumerate(zip(rows.tolist(), ps[rows].tolist())):
                keep = int(np.searchsorted(before[j], x, side="left"))
                if keep < m or m == k:
                    out[i] = s[j, max(1, min(keep, k)) - 1]
                else:
                    left.append(j)          # its nucleus runs past the candidates
            rows, mass = rows[left], None if mass is None else mass[left]
            m = min(k, 4 * m)
    return out


def _rows_of(scaled: np.ndarray, rows: np.ndarray, kth: int | None) -> np.ndarray:
    """scaled[rows] in a scratch buffer, partitioned along each row at `kth` (None: as they are)."""
    buf = _scratch("partition", (len(rows), scaled.shape[1]), np.float32)
    for j, r in enumerate(rows.tolist()):     # (np.take with out= is several times slower than the copies)
        buf[j] = scaled[r]
    if kth is not None:
        buf.partition(kth, axis=1)
    return buf
