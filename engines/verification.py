"""The check every build ends with: each engine runs once on a fixed input and must agree with
the un-lowered exported graph run by ONNX Runtime. Inputs are seeded per bucket, so a rebuild
checks the same thing. Backend-neutral: a backend supplies `run(bucket, feeds) -> outputs`.

A float output passes when max |engine - reference| <= tolerance x scale, scale = max(1, max
|reference|): absolute for small tensors, relative to the tensor's range for large ones (keys and
logits of real models reach tens). Integer outputs (tokens, accept counts) must be equal, except
that a float16 build tolerates one differing sequence per output (both graphs round logits through
fp16, and an argmax whose top two logits are within an ulp can go either way), and any build one
differing sequence among those whose tokens are sampled (a uniform within float rounding of a CDF
boundary); in a sequence whose decisions differ, the float outputs are not compared (a unified
round's later draft steps run on the other token)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tandem import contract as c
from tandem.checkpoint.description import ModelDescription
from tandem.engines.buckets import Bucket, io_specs

if TYPE_CHECKING:     # build options: the engine dir's runtime reads none of them
    from tandem.engines.options import BuildOptions

# float outputs: max abs difference / scale. float16: ~10 ulps (eps 9.8e-4) of the tensor's range; the
# lowering's fp32 reordering flips single fp16 roundings, measured up to 9.6e-4 (docs/engines.md)
TOLERANCE = {"float32": 1e-4, "float16": 1e-2}
INTEGER_MISMATCHES = {"float32": 0, "float16": 1}  # differing entries allowed per integer output
# a draw within float rounding of a CDF boundary or of the top-k / top-p cut takes the neighbouring
# token in one graph: about once in 10,000 draws with the fixed inputs' top-k (tests/engines/test_verification_compare)
SAMPLED_MISMATCHES = 1
_CHECK_PAGES = 3               # committed context of up to 3 pages per sequence


@dataclass(frozen=True)
class Verification:
    passed: bool
    tolerance: float
    max_abs_diff: dict[str, float]      # float outputs; integer outputs: count of differing entries
    seconds: float
    scale: dict[str, float] = field(default_factory=dict)   # float outputs: max(1, max |reference|)
    integer_mismatches_allowed: int = 0  # per integer output

    def to_json(self) -> dict:
        return asdict(self)


_CHECK_EDITS = 4      # logit edits per verify row in the build's check


def fixed_inputs(desc: ModelDescription, bucket: Bucket, options: BuildOptions) -> dict[str, np.ndarray]:
    """A valid input for the bucket: random tokens, scattered pages (a table per page group), partly
    filled contexts."""
    rng = np.random.default_rng(_seed(bucket.name))
    b, w, page = bucket.batch, bucket.rows, options.page_size
    n_pages = b * _CHECK_PAGES + 1
    n_slots = b + 1
    dims = {"batch": b, "rows": w, "max_pages": _CHECK_PAGES, "num_pages": n_pages, "page_size": page,
            "num_slots": n_slots, "edits": _CHECK_EDITS}
    out = {}
    specs = io_specs(desc, bucket.graph, options.dtype)
    for spec in specs:
        shape = tuple(dims[d] if isinstance(d, str) else d for d in spec.shape)
        if spec.dtype != "int64" and spec.name not in (c.LOGIT_EDITS, c.MIN_P_LOG):   # (set below)
            out[spec.name] = (0.5 * rng.standard_normal(shape)).astype(spec.dtype)
    out[c.INPUT_IDS] = rng.integers(0, desc.vocab_size, (b, w)).astype(np.int64)
    out[c.CONTEXT_LENS] = rng.integers(0, _CHECK_PAGES * page + 1, b).astype(np.int64)
    out[c.BLOCK_TABLES] = rng.permutation(n_pages)[: b * _CHECK_PAGES].reshape(b, _CHECK_PAGES).astype(np.int64)
    out[c.STATE_SLOTS] = rng.permutation(n_slots)[:b].astype(np.int64)
    out[c.STATE_ROWS] = rng.integers(1, w + 1, b).astype(np.int64)
    out[c.LAST_ROW] = rng.integers(0, w, b).astype(np.int64)
    out[c.TEMPERATURE] = rng.choice([0.0, 0.8], b).astype(np.float32)
    # top-k on every sampled row: a draw over a whole vocabulary of near-uniform logits (random-weight
    # checkpoints, V = 32000: p ~ 3e-5 a token) lands within float rounding of a CDF boundary about
    # once in 80 draws, and the engine and the reference, both right, take neighbouring tokens. With
    # k <= 20 the boundaries are ~1/k apart. top_k = 0 (off) runs the same nodes (k = V), and the
    # lowering does not touch the sampler: it is verified on the floats it is fed.
    out[c.TOP_K] = rng.choice([4, 20], b).astype(np.int64)
    out[c.TOP_P] = rng.choice([1.0, 0.9], b).astype(np.float32)
    out[c.UNIFORMS] = rng.random((b, w)).astype(np.float32)
    for window in c.page_groups(desc.layer_caches()):  # sliding-window groups: tables of their own pages
        if window is not None:
            out[c.block_tables(window)] = (rng.permutation(n_pages)[: b * _CHECK_PAGES]
                                           .reshape(b, _CHECK_PAGES).astype(np.int64))
    out[c.RELAXED_TOPK] = rng.choice([0, 1, 8], b).astype(np.int64)        # verify: relaxed acceptance
    out[c.RELAXED_DELTA] = rng.choice([0.0, 0.5], b).astype(np.float32)
    out[c.RELAXED_ROWS] = rng.integers(0, 2, (b, w)).astype(np.int64)
    words = c.mask_words(desc.vocab_size)   # verify: grammar masks, half the rows all ones (no grammar)
    out[c.TOKEN_BITMASK] = np.where(rng.random((b, w, 1)) < 0.5, -1,
                                    rng.integers(-(2**31), 2**31, (b, w, words))).astype(np.int32)
    # verify: logit edits on distinct tokens of each row (bias, scale, post), half the rows none; min-p
    out[c.LOGIT_EDIT_IDS] = np.stack([rng.permutation(desc.vocab_size)[:_CHECK_EDITS] for _ in range(b * w)]
                                     ).reshape(b, w, _CHECK_EDITS).astype(np.int64)
    edits = np.stack([rng.normal(0, 2, (b, w, _CHECK_EDITS)), rng.uniform(0.5, 1.5, (b, w, _CHECK_EDITS)),
                      rng.normal(0, 2, (b, w, _CHECK_EDITS))], -1)
    out[c.LOGIT_EDITS] = np.where(rng.random((b, w, 1, 1)) < 0.5, [0.0, 1.0, 0.0], edits).astype(np.float32)
    out[c.MIN_P_LOG] = rng.choice([-np.inf, np.log(0.05)], b).astype(np.float32)
    out[c.WANT_LOGPROBS] = np.ones(b, np.int64)     # verify: logprobs computed (their If's on branch)
    names = {s.name for s in specs}
    return {k: v for k, v in out.items() if k in names}


def compare(reference: dict[str, np.ndarray], engine: dict[str, np.ndarray], dtype: str,
            seconds: float, sampled: np.ndarray | None = None) -> Verification:
    """sampled: [B] bool, the sequences whose tokens the graph draws (temperature > 0); one of them
    may take another token than the reference (SAMPLED_MISMATCHES) when no greedy one does."""
    tol, allowed = TOLERANCE[dtype], INTEGER_MISMATCHES[dtype]
    flipped = _flipped(reference, engine)
    if sampled is not None and len(flipped) == len(sampled) and not (flipped & ~sampled).any():
        allowed = max(allowed, SAMPLED_MISMATCHES)
    if not allowed:
        flipped = np.zeros(0, bool)
    diffs, scales, passed = {}, {}, True
    for name, ref in reference.items():
        got = engine[name]
        if name in _TIE_ORDERED:     # checked through their values (TOP_LOGPROBS), which are sorted
            continue
        if ref.dtype.kind in "iub":
            diffs[name] = float((ref != got).reshape(len(ref), -1).any(axis=1).sum() if ref.ndim else ref != got)
            passed &= diffs[name] <= allowed
        else:
            keep = ~flipped if ref.ndim and len(ref) == len(flipped) else None
            diffs[name], top = _max_abs(ref, got, keep)
            scales[name] = max(1.0, top)
            passed &= diffs[name] <= tol * scales[name]  # NaN fails
    return Verification(bool(passed), tol, diffs, round(seconds, 4), scales, allowed)


# integer outputs that order near-equal values (the top logprobs' ids): two backends' rounding may
# swap two tokens whose logprobs tie to 1e-6, which is no disagreement; their values are compared
_TIE_ORDERED = frozenset({c.TOP_LOGPROB_IDS})


def sampled_rows(feeds: dict[str, np.ndarray]) -> np.ndarray | None:
    """[B] bool: the sequences a sampled graph draws tokens for (temperature >= MIN_TEMPERATURE);
    None for graphs without a temperature input (greedy ones)."""
    t = feeds.get(c.TEMPERATURE)
    return None if t is None else np.asarray(t) >= c.MIN_TEMPERATURE


def _flipped(reference: dict[str, np.ndarray], engine: dict[str, np.ndarray]) -> np.ndarray:
    """[B] sequences (outputs are batch-first) where an integer decision differs: what a graph
    computes after it (a unified round's next draft steps) follows the other token, so their float
    outputs are not compared; the decisions themselves are, within the allowance."""
    rows = [(ref != engine[n]).reshape(len(ref), -1).any(axis=1) for n, ref in reference.items()
            if ref.dtype.kind in "iu" and ref.ndim and n not in _TIE_ORDERED]
    return np.logical_or.reduce(rows) if rows and len({len(r) for r in rows}) == 1 else np.zeros(0, bool)


def _max_abs(ref: np.ndarray, got: np.ndarray, keep: np.ndarray | None) -> tuple[float, float]:
    """(max |ref - got|, max |ref|) in float64 over the kept batch rows, one row at a time: a
    prefill bucket's logits ([8, 64, 32000] float32 on a 150M model, 65 MB) would otherwise take
    four float64 copies at once, the largest part of the build's peak memory."""
    if not ref.ndim:
        return float(abs(np.float64(ref) - np.float64(got))), float(abs(np.float64(ref)))
    diff = top = 0.0
    for i in range(len(ref)) if keep is None else np.flatnonzero(keep):
        r, g = ref[i].astype(np.float64), got[i].astype(np.float64)
        if r.size:
            d = np.abs(r - g).max()
            diff = d if np.isnan(d) else max(diff, float(d))    # NaN fails and stays
            top = max(top, float(np.abs(r).max()))
    return float(diff), top


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def _seed(name: str) -> int:
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
