"""Acceptance inside the verify graph, so vocab-sized logits never leave the engine.

Rows: logits[:, i] scores the token after input_ids[:, i]; draft d_{i+1} = input_ids[:, i+1].
Each row picks the target's own token t_i, then acceptance compares (a = accepted drafts, 0..k):
    t_i = argmax(logits_i)                            greedy rows (temperature < MIN_TEMPERATURE)
    t_i = inverse-CDF(p_i, u_i)                       sampled rows, p_i = softmax(top_p(top_k(logits_i / T)))
    a = count of leading i with d_{i+1} == t_i;       next token = t_a

u_i is the uniform of the position row i's token fills (context + i + 1), so a request's tokens
are a function of its seed and positions: the same whatever the batch, the verify width, and
whether speculation is on (plain decode draws the same token from the same uniform).

Why this is exact speculative sampling. The heads draft greedily, so q = one-hot(d):
    P(accept d) = P(t = d) = p(d) = min(1, p(d) / q(d))
    on rejection  t ~ p(. | t != d) = p without d, normalised = norm(max(0, p - q))
which is the standard rule. More directly: every emitted token t_0..t_a is inverse-CDF of the
target's distribution given the emitted prefix (rows 0..a see exactly the accepted drafts) at a
fresh position's uniform, i.e. ancestral sampling. Rows past a are discarded and never decided
anything, so their positions' uniforms stay unseen until a later round uses them.

Sampling order (pipeline/sampler.py does the same on the host): temperature, top-k, top-p on what
top-k kept (the top token always stays); inverse-CDF over the vocabulary in id order, never past
the last token with non-zero probability.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from tandem.contract import MIN_TEMPERATURE
from tandem.export.builder import GraphBuilder

_NEG = -1e30


def _leading_true(b: GraphBuilder, ok: str) -> str:
    """Count of leading True values along axis 1 of a [B, n] bool: sum(cumsum(!ok) == 0)."""
    misses = b.op("CumSum", b.op("Cast", b.op("Not", ok), to=TensorProto.INT64), b.const(1, np.int64))
    return b.op("ReduceSum", b.op("Cast", b.op("Equal", misses, b.const(0, np.int64)), to=TensorProto.INT64),
                b.const([1], np.int64), keepdims=0)


def _at_row(b: GraphBuilder, x: str, row: str) -> str:
    """x[b, row[b]] for x [B, W, ...] and row [B]."""
    return b.op("GatherND", x, b.unsqueeze(row, [1]), batch_dims=1)


def _compare(b: GraphBuilder, tokens: str, ids: str) -> tuple[str, str]:
    """tokens [B, W] (the target's t_i) against the drafts ids[:, 1:] -> (accepted [B], next token [B])."""
    drafts = b.slice(ids, [1], [np.iinfo(np.int64).max], [1])                     # [B, W-1]
    predicted = b.slice(tokens, [0], [-1], [1])
    accepted = _leading_true(b, b.op("Equal", drafts, predicted))
    return accepted, _at_row(b, tokens, accepted)


def greedy(b: GraphBuilder, logits: str, ids: str) -> tuple[str, str]:
    with b.scope("accept_greedy"):
        return _compare(b, b.op("ArgMax", logits, axis=-1, keepdims=0), ids)     # t_i: [B, W]


def _filtered_probs(b: GraphBuilder, scaled: str, top_k: str, top_p: str) -> str:
    """softmax over the top-k of scaled [B, W, V], then over the top-p nucleus of that."""
    f32 = lambda v: b.const(v, np.float32)  # noqa: E731
    vocab = b.shape_of(scaled, 2, 3)
    sorted_v = b.op("TopK", scaled, vocab, outputs=2, axis=-1, largest=1, sorted=1)[0]
    rank = b.op("Range", b.const(0, np.int64), b.squeeze(vocab, [0]), b.const(1, np.int64))   # [V]
    k_eff = b.op("Where", b.op("Greater", top_k, b.const(0, np.int64)), top_k, b.squeeze(vocab, [0]))
    keep_k = b.op("Less", rank, b.unsqueeze(k_eff, [1, 2]))                       # [B, 1, V]
    p_sorted = b.op("Softmax", b.op("Where", keep_k, sorted_v, f32(_NEG)), axis=-1)
    before = b.op("Sub", b.op("CumSum", p_sorted, b.const(-1, np.int64)), p_sorted)
    p_off = b.unsqueeze(b.op("GreaterOrEqual", top_p, f32(1.0)), [1, 2])          # float32 sums may reach 1
    keep_p = b.op("Or", b.op("Less", before, b.unsqueeze(top_p, [1, 2])), p_off)
    keep = b.op("Or", b.op("And", keep_k, keep_p), b.op("Equal", rank, b.const(0, np.int64)))
    threshold = b.op("ReduceMin", b.op("Where", keep, sorted_v, f32(-_NEG)), b.const([-1], np.int64),
                     keepdims=1)                                                   # [B, W, 1]
    return b.op("Softmax", b.op("Where", b.op("GreaterOrEqual", scaled, threshold), scaled, f32(_NEG)), axis=-1)


def _inverse_cdf(b: GraphBuilder, probs: str, uniforms: str) -> str:
    """probs [B, W, V], uniforms [B, W] -> [B, W]: the first id whose cumulative probability
    exceeds u, capped at the last id with non-zero probability (a float32 total may end below u)."""
    cdf = b.op("CumSum", probs, b.const(-1, np.int64))
    count = b.op("ReduceSum", b.op("Cast", b.op("LessOrEqual", cdf, b.unsqueeze(uniforms, [2])),
                                   to=TensorProto.INT64), b.const([-1], np.int64), keepdims=0)
    ids = b.op("Range", b.const(0, np.int64), b.squeeze(b.shape_of(probs, 2, 3), [0]), b.const(1, np.int64))
    last = b.op("ReduceMax", b.op("Where", b.op("Greater", probs, b.const(0.0, np.float32)), ids,
                                  b.const(0, np.int64)), b.const([-1], np.int64), keepdims=0)
    return b.op("Min", count, last)


def sampled(b: GraphBuilder, logits: str, ids: str, temperature: str, top_k: str, top_p: str,
            uniforms: str) -> tuple[str, str]:
    with b.scope("accept_sampled"):
        f32 = lambda v: b.const(v, np.float32)  # noqa: E731
        is_sampled = b.op("GreaterOrEqual", temperature, f32(MIN_TEMPERATURE))    # [B]
        t = b.unsqueeze(b.op("Where", is_sampled, temperature, f32(1.0)), [1, 2])
        probs = _filtered_probs(b, b.op("Div", logits, t), top_k, top_p)          # [B, W, V]
        drawn = _inverse_cdf(b, probs, uniforms)                                  # [B, W]
        best = b.op("ArgMax", logits, axis=-1, keepdims=0)
        tokens = b.op("Where", b.unsqueeze(is_sampled, [1]), drawn, best)          # t_i: [B, W]
        return _compare(b, tokens, ids)
