"""Acceptance inside the verify graph, so vocab-sized logits never leave the engine.

Rows: logits[:, i] scores the token after input_ids[:, i]; draft d_{i+1} = input_ids[:, i+1].
    greedy:   accept d_{i+1} while it equals argmax(logits[:, i]); next = argmax at row a
    sampled:  p_i = softmax(top_p(top_k(logits_i / T))); drafts are the heads' greedy choices,
              so q = one-hot(d) and "accept with min(1, p(d)/q(d))" is: accept while u_i < p_i(d_{i+1}).
              On the first rejection at row a, sample from norm(max(0, p_a - q_a)) = p_a without d_{a+1};
              if all k are accepted, sample the bonus token from p_k. Sampling is inverse-CDF with
              the last uniform. This keeps the target distribution exactly (rejection sampling).
Rows with temperature 0 take the greedy result. a = accepted drafts (0..k).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

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


def greedy(b: GraphBuilder, logits: str, ids: str) -> tuple[str, str]:
    with b.scope("accept_greedy"):
        best = b.op("ArgMax", logits, axis=-1, keepdims=0)                       # [B, W]
        drafts = b.slice(ids, [1], [np.iinfo(np.int64).max], [1])                 # [B, W-1]
        predicted = b.slice(best, [0], [-1], [1])
        accepted = _leading_true(b, b.op("Equal", drafts, predicted))
        return accepted, _at_row(b, best, accepted)


def sampled(b: GraphBuilder, logits: str, ids: str, temperature: str, top_k: str, top_p: str,
            uniforms: str) -> tuple[str, str]:
    g_accepted, g_next = greedy(b, logits, ids)
    with b.scope("accept_sampled"):
        f32 = lambda v: b.const(v, np.float32)  # noqa: E731
        is_sampled = b.op("Greater", temperature, f32(0.0))                       # [B]
        t = b.unsqueeze(b.op("Where", is_sampled, temperature, f32(1.0)), [1, 2])
        scaled = b.op("Div", logits, t)                                           # [B, W, V]
        vocab = b.shape_of(logits, 2, 3)
        sorted_v = b.op("TopK", scaled, vocab, outputs=2, axis=-1, largest=1, sorted=1)[0]
        rank = b.op("Range", b.const(0, np.int64), b.squeeze(vocab, [0]), b.const(1, np.int64))   # [V]
        k_eff = b.op("Where", b.op("Greater", top_k, b.const(0, np.int64)), top_k, b.squeeze(vocab, [0]))
        keep_k = b.op("Less", rank, b.unsqueeze(k_eff, [1, 2]))                   # [B, 1, V]
        p_sorted = b.op("Softmax", b.op("Where", keep_k, sorted_v, f32(_NEG)), axis=-1)
        before = b.op("Sub", b.op("CumSum", p_sorted, b.const(-1, np.int64)), p_sorted)
        keep_p = b.op("Less", before, b.unsqueeze(top_p, [1, 2]))
        keep = b.op("Or", b.op("And", keep_k, keep_p), b.op("Equal", rank, b.const(0, np.int64)))
        threshold = b.op("ReduceMin", b.op("Where", keep, sorted_v, f32(-_NEG)), b.const([-1], np.int64),
                         keepdims=1)                                               # [B, W, 1]
        probs = b.op("Softmax", b.op("Where", b.op("GreaterOrEqual", scaled, threshold), scaled, f32(_NEG)),
                     axis=-1)
        # accept tests: u_i < p_i(d_{i+1})
        drafts = b.slice(ids, [1], [np.iinfo(np.int64).max], [1])                 # [B, W-1]
        p_rows = b.slice(probs, [0], [-1], [1])                                   # [B, W-1, V]
        p_draft = b.squeeze(b.op("GatherElements", p_rows, b.unsqueeze(drafts, [2]), axis=2), [2])
        u_tests = b.slice(uniforms, [0], [-1], [1])
        accepted = _leading_true(b, b.op("Less", u_tests, p_draft))
        # the final token: residual at the rejected row, or the bonus row
        w_len = b.shape_of(ids, 1, 2)
        p_a = _at_row(b, probs, accepted)                                         # [B, V]
        rejected = b.op("Less", accepted, b.squeeze(b.op("Sub", w_len, b.const([1], np.int64)), [0]))
        next_row = b.op("Min", b.op("Add", accepted, b.const(1, np.int64)),
                        b.squeeze(b.op("Sub", w_len, b.const([1], np.int64)), [0]))
        d_next = _at_row(b, ids, next_row)                                        # [B]
        drop = b.op("And", b.op("Equal", b.unsqueeze(rank, [0]), b.unsqueeze(d_next, [1])),
                    b.unsqueeze(rejected, [1]))                                   # [B, V]
        residual = b.op("Where", drop, f32(0.0), p_a)
        cdf = b.op("CumSum", residual, b.const(-1, np.int64))
        total = b.op("ReduceSum", residual, b.const([-1], np.int64), keepdims=1)
        u_last = b.slice(uniforms, [-1], [np.iinfo(np.int64).max], [1])            # [B, 1]
        below = b.op("LessOrEqual", cdf, b.op("Mul", u_last, total))
        token = b.op("ReduceSum", b.op("Cast", below, to=TensorProto.INT64), b.const([-1], np.int64), keepdims=0)
        token = b.op("Min", token, b.squeeze(b.op("Sub", vocab, b.const([1], np.int64)), [0]))
        return (b.op("Where", is_sampled, accepted, g_accepted, name="accepted"),
                b.op("Where", is_sampled, token, g_next, name="next_token"))
