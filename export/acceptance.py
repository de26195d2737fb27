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

Relaxed acceptance (opt-in per row; off leaves every output above bit for bit the same). With
relaxed inputs (contract.RELAXED_TOPK / RELAXED_DELTA / RELAXED_ROWS), a greedy row i also accepts
a draft d_{i+1} != t_i when relaxing is allowed at that row (relaxed_rows[b, i] != 0, e.g. inside a
thinking span) and, with p_i = softmax(logits_i) (temperature 1):
    rank(d_{i+1}) < relaxed_topk[b]         rank = count of tokens whose logit is strictly greater
    p_i(d_{i+1}) >= p_i(t_i) - relaxed_delta[b]
This is TensorRT-LLM's rule for DeepSeek MTP (mtpRelaxedAcceptanceKernel in
cpp/tensorrt_llm/kernels/speculativeDecoding/mtpKernels.cu: the draft must be among the target's
top `relaxed_topk` probabilities and not below the top one's minus `relaxed_delta`); ties rank
as high as their best peer. The next token stays t_a, the target's argmax at the first rejected row.
relaxed_topk 0 turns it off. Sampled rows never relax: speculative sampling is already exact
in distribution, and relaxing would change the distribution it samples (TensorRT-LLM relaxes
greedy MTP only). The output is then no longer what plain greedy decoding gives: an opt-in
trade of exactness for accepted length.

Grammar masks (structured outputs, contract.TOKEN_BITMASK [B, W, ceil(V/32)] int32): row i's mask is
the grammar's state after the pending token and d_1..d_i; a token whose bit is clear gets logit -1e30
before anything above reads the logits, so t_i is the argmax / a sample of the masked distribution:
a forbidden draft never equals t_i (rejected), and the correction or bonus token obeys the grammar.
All-ones rows (requests without a grammar) leave the logits as they are, and a batch of them only
reads the masks (an If picks the plain branch: docs/structured_outputs.md has the costs).

Logit edits (penalties, logit_bias: contract.LOGIT_EDIT_IDS / LOGIT_EDITS, pipeline/logits_processors.py)
apply to row i's logits before its mask, in the host's float32 operations, inside the same If as the
masks (a batch without edits skips them).

Sampling order (pipeline/sampler.py does the same on the host): temperature, min-p (contract.MIN_P_LOG),
top-k, top-p on what top-k kept (the top token always stays); inverse-CDF over the vocabulary in id order, never past
the last token with non-zero probability.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper

from tandem.contract import MIN_TEMPERATURE
from tandem.export.builder import GraphBuilder

_NEG = -1e30
_ROW_TYPES = (TensorProto.INT64, TensorProto.BOOL)   # what acceptance reads from the logits: t_i, relaxed ok


@dataclass(frozen=True)
class Relaxed:
    """Names of the relaxed-acceptance inputs: top-k [B] int64 (0 = off), delta [B] float32, and
    where relaxing is allowed [B, W] int64 (row i: the draft d_{i+1} it judges)."""

    topk: str
    delta: str
    rows: str


@dataclass(frozen=True)
class Edits:
    """Names of the logit-edit inputs (pipeline/logits_processors.py): ids [B, W, N] int64 and values
    [B, W, N, 3] float32, (bias, scale, post) per edited token of row i."""

    ids: str
    values: str


def edited(b: GraphBuilder, logits: str, e: Edits) -> str:
    """logits [B, W, V] with each row's edit list applied, in the host's order of float32 operations:
        x = logits[ids] + bias;  x = x / scale where x > 0, else x * scale;  logits[ids] = x + post
    A row's list may name a token twice only with the same values (the same write twice)."""
    with b.scope("logit_edits"):
        part = lambda j: b.squeeze(b.slice(e.values, [j], [j + 1], [3]), [3])  # noqa: E731   [B, W, N]
        x = b.op("Add", b.op("GatherElements", logits, e.ids, axis=2), part(0))
        scale = part(1)
        x = b.op("Where", b.op("Greater", x, b.const(0.0, np.float32)), b.op("Div", x, scale), b.op("Mul", x, scale))
        return b.op("ScatterElements", logits, e.ids, b.op("Add", x, part(2)), axis=2)


def _leading_true(b: GraphBuilder, ok: str) -> str:
    """Count of leading True values along axis 1 of a [B, n] bool: sum(cumsum(!ok) == 0)."""
    misses = b.op("CumSum", b.op("Cast", b.op("Not", ok), to=TensorProto.INT64), b.const(1, np.int64))
    return b.op("ReduceSum", b.op("Cast", b.op("Equal", misses, b.const(0, np.int64)), to=TensorProto.INT64),
                b.const([1], np.int64), keepdims=0)


def _at_row(b: GraphBuilder, x: str, row: str) -> str:
    """x[b, row[b]] for x [B, W, ...] and row [B]."""
    return b.op("GatherND", x, b.unsqueeze(row, [1]), batch_dims=1)


def _drafts(b: GraphBuilder, ids: str) -> str:
    return b.slice(ids, [1], [np.iinfo(np.int64).max], [1])                       # [B, W-1]


def _compare(b: GraphBuilder, tokens: str, ids: str, also: str | None = None) -> tuple[str, str]:
    """tokens [B, W] (the target's t_i) against the drafts ids[:, 1:] -> (accepted [B], next token [B]);
    `also` [B, W-1] bool: drafts accepted even where they differ (relaxed)."""
    predicted = b.slice(tokens, [0], [-1], [1])
    ok = b.op("Equal", _drafts(b, ids), predicted)
    accepted = _leading_true(b, ok if also is None else b.op("Or", ok, also))
    return accepted, _at_row(b, tokens, accepted)


def _relaxed_ok(b: GraphBuilder, logits: str, ids: str, r: Relaxed) -> str:
    """[B, W-1] bool: row i's draft d_{i+1} passes the relaxed rule (module docstring). Every row is
    computed (the last one against the pending token, then dropped) so the [B, W, V] logits are not copied;
    ranks count in float32 (exact below 2^24 tokens), which ONNX Runtime sums ~25x faster than int64."""
    with b.scope("relaxed"):
        axis = b.const([-1], np.int64)
        padded = b.concat([_drafts(b, ids), b.slice(ids, [0], [1], [1])], 1)   # last row: any valid id
        drafted = b.op("GatherElements", logits, b.unsqueeze(padded, [2]), axis=2)      # [B, W, 1]
        top = b.op("ReduceMax", logits, axis, keepdims=1)
        total = b.op("ReduceSum", b.op("Exp", b.op("Sub", logits, top)), axis, keepdims=1)
        p_top = b.op("Reciprocal", total)                                         # softmax at the argmax
        p_draft = b.op("Div", b.op("Exp", b.op("Sub", drafted, top)), total)
        close = b.op("GreaterOrEqual", p_draft, b.op("Sub", p_top, b.unsqueeze(r.delta, [1, 2])))
        rank = b.op("ReduceSum", b.op("Cast", b.op("Greater", logits, drafted), to=TensorProto.FLOAT), axis,
                    keepdims=1)
        in_top = b.op("Less", rank, b.unsqueeze(b.op("Cast", r.topk, to=TensorProto.FLOAT), [1, 2]))
        ok = b.slice(b.squeeze(b.op("And", close, in_top), [2]), [0], [-1], [1])   # [B, W-1]
        allowed = b.op("Not", b.op("Equal", b.slice(r.rows, [0], [-1], [1]), b.const(0, np.int64)))
        return b.op("And", ok, allowed)


def masked(b: GraphBuilder, logits: str, bitmask: str) -> str:
    """logits [B, W, V] with -1e30 where bit t % 32 of bitmask[b, w, t // 32] is clear."""
    bits = b.const((np.int64(1) << np.arange(32)).astype(np.uint32).view(np.int32))               # [32]: 1 << j
    hit = b.op("BitwiseAnd", b.unsqueeze(bitmask, [3]), bits)                                   # [B, W, M, 32]
    allowed = b.reshape(b.op("Not", b.op("Equal", hit, b.const(0, np.int32))), [0, 0, -1])      # [B, W, 32 M]
    allowed = b.slice(allowed, [0], b.shape_of(logits, 2, 3), [2])                              # [B, W, V]
    return b.op("Where", allowed, logits, b.const(_NEG, np.float32))


def under_grammar(b: GraphBuilder, logits: str, bitmask: str | None, rows, types: tuple[int, ...],
                  relaxed: Relaxed | None = None, edits: Edits | None = None) -> list[str]:
    """rows(builder, logits, relax) -> the per-row results acceptance reads ([B, W] tokens, and with
    `relax` the relaxed flags [B, W-1]), from the logits masked by `bitmask`. One If picks the plain
    branch for a batch that needs neither the masks (all ones: no request has a grammar) nor the
    relaxed rule (no row may relax): there rows run on the logits as they are and the relaxed flags,
    all false, come from relaxed_rows alone, so no [B, W, V] pass runs for either. Only small
    results leave either branch.

        If(every word of bitmask == -1, every relaxed_rows == 0 and every edit the identity)
            -> rows(logits), flags false
          else -> rows(masked(edited(logits, edits), bitmask), relaxed)
    """
    if bitmask is None and relaxed is None and edits is None:
        return rows(b, logits, False)
    plain_cases = []
    if bitmask is not None:
        flat = b.reshape(bitmask, [-1])
        plain_cases += [b.op("Equal", b.op(r, flat, keepdims=1), b.const([-1], np.int32))
                        for r in ("ReduceMin", "ReduceMax")]
    if relaxed is not None:
        plain_cases.append(b.op("Equal", b.op("ReduceMax", b.reshape(relaxed.rows, [-1]), keepdims=1),
                                b.const([0], np.int64)))
    if edits is not None:   # identity edits are (0, 1, 0): |bias| + |scale - 1| + |post| sums to 0
        off = b.op("Abs", b.reshape(b.op("Sub", edits.values, b.const([0.0, 1.0, 0.0], np.float32)), [-1]))
        plain_cases.append(b.op("Equal", b.op("ReduceMax", off, keepdims=1), b.const([0.0], np.float32)))
    plain = plain_cases[0]
    for case in plain_cases[1:]:
        plain = b.op("And", plain, case)
    branches = []
    for name in ("plain", "masked"):
        sub = GraphBuilder(function=True, root=f"grammar_{name}")   # verify_body builds acceptance once per graph
        if name == "plain":
            outs = rows(sub, logits, False) + ([_relaxed_off(sub, relaxed)] if relaxed is not None else [])
        else:
            lg = edited(sub, logits, edits) if edits is not None else logits
            outs = rows(sub, masked(sub, lg, bitmask) if bitmask is not None else lg, relaxed is not None)
        branches.append(helper.make_graph(sub.nodes, f"grammar_{name}", [], [
            helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, types)]))
    out = b.op("If", plain, outputs=len(types), then_branch=branches[0], else_branch=branches[1])
    return [out] if isinstance(out, str) else list(out)


def _relaxed_off(b: GraphBuilder, r: Relaxed) -> str:
    """[B, W-1] bool: the relaxed flags where no row may relax (all false), from relaxed_rows alone."""
    return b.op("Not", b.op("Equal", b.slice(r.rows, [0], [-1], [1]), b.const(0, np.int64)))


def greedy(b: GraphBuilder, logits: str, ids: str, relaxed: Relaxed | None = None,
           bitmask: str | None = None, edits: Edits | None = None) -> tuple[str, str]:
    def rows(g: GraphBuilder, lg: str, relax: bool) -> list[str]:
        return [g.op("ArgMax", lg, axis=-1, keepdims=0), *([_relaxed_ok(g, lg, ids, relaxed)] if relax else [])]

    with b.scope("accept_greedy"):
        tokens, *also = under_grammar(b, logits, bitmask, rows, _ROW_TYPES[: 1 + bool(relaxed)], relaxed, edits)
        return _compare(b, tokens, ids, also[0] if also else None)   # t_i: [B, W]


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
            uniforms: str, relaxed: Relaxed | None = None, bitmask: str | None = None, edits: Edits | None = None,
            min_p_log: str | None = None) -> tuple[str, str]:
    def rows(g: GraphBuilder, lg: str, relax: bool) -> list[str]:
        f32 = lambda v: g.const(v, np.float32)  # noqa: E731
        is_sampled = g.op("GreaterOrEqual", temperature, f32(MIN_TEMPERATURE))    # [B]
        t = g.unsqueeze(g.op("Where", is_sampled, temperature, f32(1.0)), [1, 2])
        scaled = g.op("Div", lg, t)
        if min_p_log is not None:   # min-p: scaled logits below the row's top + log(min_p) out (-inf: none)
            floor = g.op("Add", g.op("ReduceMax", scaled, g.const([-1], np.int64), keepdims=1),
                         g.unsqueeze(min_p_log, [1, 2]))
            scaled = g.op("Where", g.op("Less", scaled, floor), f32(_NEG), scaled)
        probs = _filtered_probs(g, scaled, top_k, top_p)                          # [B, W, V]
        drawn = _inverse_cdf(g, probs, uniforms)                                  # [B, W]
        best = g.op("ArgMax", lg, axis=-1, keepdims=0)
        tokens = g.op("Where", g.unsqueeze(is_sampled, [1]), drawn, best)          # t_i: [B, W]
        if not relax:
            return [tokens]
        return [tokens, g.op("And", _relaxed_ok(g, lg, ids, relaxed), g.unsqueeze(g.op("Not", is_sampled), [1]))]

    with b.scope("accept_sampled"):   # relaxed: greedy rows only
        tokens, *also = under_grammar(b, logits, bitmask, rows, _ROW_TYPES[: 1 + bool(relaxed)], relaxed, edits)
        return _compare(b, tokens, ids, also[0] if also else None)


def logprobs(b: GraphBuilder, logits: str, ids: str, accepted: str, nxt: str, want: str, k: int
             ) -> tuple[str, str, str]:
    """The target's raw log-probabilities (log-softmax of the logits before any processor, as vLLM
    reports them by default) of each row: of the token the row emits (row i < accepted: the draft
    d_{i+1}; row accepted: the next token; later rows: the next token, unused) [B, W], and the top k
    [B, W, k] with their ids. One If: a batch where no row `want`s them [B] computes none (zeros).

        If(max(want) > 0) -> LogSoftmax(logits) -> (gathered at the emitted tokens, TopK k)
                    else -> zeros
    """
    with b.scope("logprobs"):
        want_any = b.op("Greater", b.op("ReduceMax", want, keepdims=1), b.const([0], np.int64))
        sub = GraphBuilder(function=True, root="logprobs_on")
        lsm = sub.op("LogSoftmax", logits, axis=-1)                                          # [B, W, V]
        top, top_ids = sub.op("TopK", lsm, sub.const([k], np.int64), outputs=2, axis=-1, largest=1, sorted=1)
        rows = sub.op("Range", sub.const(0, np.int64), sub.squeeze(sub.shape_of(ids, 1, 2), [0]),
                      sub.const(1, np.int64))                                                # [W]
        last = sub.unsqueeze(nxt, [1])                                                       # [B, 1]
        shifted = sub.concat([_drafts(sub, ids), last], 1)                                   # [B, W]
        emitted = sub.op("Where", sub.op("Less", sub.unsqueeze(rows, [0]), sub.unsqueeze(accepted, [1])),
                         shifted, last)
        token = sub.squeeze(sub.op("GatherElements", lsm, sub.unsqueeze(emitted, [2]), axis=2), [2])
        off = GraphBuilder(function=True, root="logprobs_off")
        shape = off.concat([off.shape_of(logits, 0, 2), off.const([k], np.int64)], 0)       # [B, W, k]
        zeros = lambda dims, kind: off.op("ConstantOfShape", dims, value=helper.make_tensor(  # noqa: E731
            "value", kind, [1], [0]))
        off_outs = [zeros(off.shape_of(ids), TensorProto.FLOAT), zeros(shape, TensorProto.FLOAT),
                    zeros(shape, TensorProto.INT64)]
        types = (TensorProto.FLOAT, TensorProto.FLOAT, TensorProto.INT64)
        branches = [helper.make_graph(g.nodes, name, [], [helper.make_tensor_value_info(o, t, None)
                                                          for o, t in zip(outs, types)])
                    for g, name, outs in ((sub, "logprobs_on", [token, top, top_ids]),
                                          (off, "logprobs_off", off_outs))]
        return tuple(b.op("If", want_any, outputs=3, then_branch=branches[0], else_branch=branches[1]))
