"""The unified round graph: a whole speculative round in one engine call, for heads anchored on
the target (MTPSpec.anchor "target"), built from graphs.py's verify body and head passes.

    input_ids [B, W] = [T, d_1..d_k] at positions c .. c+k      (c = context_lens: target and heads)
        |
    verify      target + fused acceptance (graphs.verify_body) -> a [B], T' [B], hidden h [B, W, H],
                new trunk K/V rows, states after row a
        |
    re-anchor   row i pairs token ids[i+1] (i < a) or T' (i = a) with h_i; rows past a: anything
                (causal: rows 0..a never see them; the runtime commits rows 0..a only)
                head 0 over the W rows -> new K/V rows; at row a: d'_1, p_1, g_0
        |
    draft s     head l_s (chained: s mod n, reused: 0) over W + s rows: re-anchor rows 0..a, then
    s = 1..k-1  (d'_1, g_0) .. (d'_s, g_{s-1}) (compacted: gathered per batch row), then padding;
                positions c + t; row a+s -> d'_{s+1}, p_{s+1}, g_s. Its rows 0..a ARE the re-anchor
                rows (K/V rows depend on their own row only), so head l_s's rows to commit are its first W
        |
    re-anchor   heads no draft step ran: one W-row pass each, for their rows to commit
        v
    accepted, next_token, next_drafts [B, k], draft_probs [B, k], draft_hidden [B, k, H] (g_0..g_{k-1}),
    trunk new rows and states, new K/V rows [B, W] of every head it re-anchors

Re-running rows 0..a inside each draft step costs little on a memory-bound decode (the weights are
read once whatever the row count) and needs no change to the attention op: every pass reads the
committed pool below c and its own rows above it, exactly as the multi-call round's calls do.
"""

from __future__ import annotations

import numpy as np
import onnx

from tandem import contract as c
from tandem.checkpoint.description import ModelDescription
from tandem.export.builder import GraphBuilder
from tandem.export.graphs import _finish, _functions, head_pass, head_rows_outputs, verify_body
from tandem.export.primitives import Weights
from tandem.graph_kinds import GraphKind


def unified_refusal(desc: ModelDescription) -> str | None:
    """Why the round graph cannot be built for `desc` (None: it can)."""
    if desc.mtp is None:
        return "the model has no MTP head"
    if desc.mtp.anchor != "target":
        return (f"its MTP heads are anchored on the previous head ({desc.mtp.anchor}): head j pairs head j-1's "
                "hidden, which the round graph does not chain yet; rounds use the multi-call path")
    trunk = set(c.page_groups(desc.layer_caches(mtp_layers=0)))
    heads = set(c.page_groups([desc.head_cache(j) for j in range(desc.mtp.num_layers)]))
    if not heads <= trunk:
        return "its MTP heads use a sliding window the trunk does not have"
    return None


def round_step(desc: ModelDescription, w: Weights, kind: GraphKind, index_share: bool = False) -> onnx.ModelProto:
    """index_share: draft steps s >= 1 of head 0 attend the top-k its re-anchor pass selected
    (_shared_selection) instead of running its lightning indexer again (sparse-MLA heads only)."""
    reason = unified_refusal(desc)
    if reason:
        raise ValueError(f"{desc.architecture}: no unified round graph: {reason}")
    ins, outs = c.graph_io(desc, kind, w.dtype)
    heads = c.round_heads(desc, kind)
    b = GraphBuilder()
    produced = verify_body(b, desc, w, kind.sampling, logprobs=False)
    hidden, accepted, nxt = produced.pop(c.HIDDEN), produced[c.ACCEPTED], produced[c.NEXT_TOKEN]
    width = kind.drafts + 1
    with b.scope("reanchor"):
        rows = b.const(np.arange(width)[None, :], np.int64)                                  # [1, W]
        shifted = b.concat([b.slice(c.INPUT_IDS, [1], [width], [1]), b.unsqueeze(nxt, [1])], 1)
        ids = b.op("Where", b.op("Equal", rows, b.unsqueeze(accepted, [1])), b.unsqueeze(nxt, [1]), shifted)
    committed: dict[int, dict[str, str]] = {}      # head -> its new rows [B, W, ...] by pool name
    drafts, probs, chain = [], [], []              # d'_s [B], p_s [B], g_{s-1} [B, H]
    with b.scope("reanchor/head0"):
        run = head_pass(b, desc, w, 0, ids, hidden, accepted)
    committed[0] = run.rows
    first = run.selected if index_share else None      # head 0's top-k of the re-anchor rows [B, W, K]
    drafts.append(run.draft), probs.append(run.prob), chain.append(run.hidden_last)
    for s in range(1, kind.drafts):
        head = 0 if kind.reused else s % desc.mtp.num_layers
        with b.scope(f"draft{s}"):
            step_ids, step_hidden, last = _compacted(b, ids, hidden, accepted, drafts, chain, width)
            shared = _shared_selection(b, first, accepted, s, width) if first is not None and head == 0 else None
            run = head_pass(b, desc, w, head, step_ids, step_hidden, last, shared)
            if head not in committed:
                committed[head] = {n: b.slice(t, [0], [width], [1]) for n, t in run.rows.items()}
        drafts.append(run.draft), probs.append(run.prob), chain.append(run.hidden_last)
    for head in heads:
        if head not in committed:
            with b.scope(f"reanchor/head{head}"):
                run = head_pass(b, desc, w, head, ids, hidden, accepted)
            committed[head] = run.rows
    with b.scope("outputs"):
        produced[c.NEXT_DRAFTS] = b.concat([b.unsqueeze(d, [1]) for d in drafts], 1)
        produced[c.DRAFT_PROBS] = b.concat([b.unsqueeze(p, [1]) for p in probs], 1)
        produced[c.DRAFT_HIDDEN] = b.concat([b.unsqueeze(g, [1]) for g in chain], 1)
    for head, rows in committed.items():
        produced.update(head_rows_outputs(desc, head, rows))
    return _finish(b, kind.name, ins, outs, produced, _functions(desc, row_states=True))


def _shared_selection(b: GraphBuilder, first: str, accepted: str, s: int, width: int) -> str:
    """Index share at draft step s: row t of W + s attends re-anchor row min(t, a)'s top-k (rows
    t <= a ARE the re-anchor rows: theirs is exact) plus the draft positions c+a+1 .. c+a+s (the
    op ignores those after the row). first [B, W, K] -> [B, W + s, K + s]."""
    with b.scope("index_share"):
        a = b.unsqueeze(accepted, [1])                                                      # [B, 1]
        src = b.op("Min", b.const(np.arange(width + s)[None, :], np.int64), a)               # [B, W+s]
        shape = b.concat([b.shape_of(src), b.shape_of(first, 2, 3)], 0)
        picked = b.op("GatherElements", first, b.op("Expand", b.unsqueeze(src, [2]), shape), axis=1)
        drafts = b.op("Add", b.op("Add", b.unsqueeze(c.CONTEXT_LENS, [1]), a),
                      b.const(np.arange(1, s + 1)[None, :], np.int64))                     # [B, s]
        extra = b.op("Expand", b.unsqueeze(drafts, [1]), b.concat([b.shape_of(src), b.const([s], np.int64)], 0))
        return b.concat([picked, extra], -1)


def _compacted(b: GraphBuilder, ids: str, hidden: str, accepted: str, drafts: list[str], chain: list[str],
               width: int) -> tuple[str, str, str]:
    """Draft step s = len(drafts): rows t of W + s, gathered per batch row from [re-anchor rows | draft rows]:
    t <= a: re-anchor row t;  a < t <= a + s: draft row t - a - 1 (source index W + t - a - 1);
    past a + s: row t (padding after the last row, never seen). Returns (ids, hidden, last row a + s)."""
    s = len(drafts)
    t = b.const(np.arange(width + s)[None, :], np.int64)                                     # [1, W+s]
    a = b.unsqueeze(accepted, [1])                                                           # [B, 1]
    past = b.op("Sub", t, a)                                                                 # t - a
    is_draft = b.op("And", b.op("Greater", past, b.const(0, np.int64)),
                    b.op("LessOrEqual", past, b.const(s, np.int64)))
    idx = b.op("Where", is_draft, b.op("Add", past, b.const(width - 1, np.int64)), t)         # [B, W+s]
    src_ids = b.concat([ids, *(b.unsqueeze(d, [1]) for d in drafts)], 1)                     # [B, W+s]
    src_hidden = b.concat([hidden, *(b.unsqueeze(g, [1]) for g in chain)], 1)                # [B, W+s, H]
    step_ids = b.op("GatherElements", src_ids, idx, axis=1)
    hidden_idx = b.op("Expand", b.unsqueeze(idx, [2]), b.shape_of(src_hidden))
    step_hidden = b.op("GatherElements", src_hidden, hidden_idx, axis=1)
    last = b.op("Add", accepted, b.const(s, np.int64))
    return step_ids, step_hidden, last


__all__ = ["round_step", "unified_refusal"]
