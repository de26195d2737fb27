"""The multi-step decode graph: n greedy decode steps in one engine call.

    input_ids [B, 1] = [T]: the pending token at position c = context_lens
        |
    step i      token t_i (t_0 = T) at position c + i: embed -> layers -> final norm -> lm_head
    i = 0..n-1  -> t_{i+1} = argmax. Every op runs on that one row, as in a plain decode step,
                except each attention layer's block, which runs over rows 0..i: its input rows
                of the earlier steps (kept) and this one's, so the attention op sees rows 0..i-1
                among its own new rows (nothing is committed inside a call) and this row's output
                is the block's row i. Gated DeltaNet layers carry their state and conv window
                from step to step (step 0 reads them from the pools).
        v
    next_tokens [B, n] = t_1 .. t_n; the last step's attention rows [B, n] (positions c .. c+n-1)
    and the states after row n - 1: exactly what n plain decode steps commit

Why it exists: on a small model the host's work between engine calls (scheduler, commit,
detokenizer, stop checks) and each call's own overhead cost as much as the step; one call per n
tokens pays them once. The attention blocks' extra rows cost little: their projections read the
same weights whatever the row count.

Exactness: each row's result does not depend on how many rows its call has (row-invariant
engines, tests/engines/test_row_invariance.py), and every one-row part is a decode step's, so step i's row
is plain decoding's and t_{i+1} the argmax the host would take (ArgMax and numpy both pick the
first of equal maxima); tests/pipeline/test_decode_steps.py holds the tokens, rows and states to n decode
steps bit for bit. A sequence that stops at t_j (j < n) has finished: what the call computed past
it is never read.
"""

from __future__ import annotations

import numpy as np
import onnx

from tandem import contract as c
from tandem.checkpoint.description import LayerKind, ModelDescription
from tandem.export.builder import GraphBuilder
from tandem.export.graphs import (
    _conv_windows_after,
    _finish,
    _functions,
    _lm_head,
    _paging,
    attention_mixer,
    gdn_mixer,
    new_rows_outputs,
)
from tandem.export.layers import decoder_layer, norm_scale
from tandem.export.primitives import Weights, rms_norm
from tandem.graph_kinds import GraphKind


def decode_steps(desc: ModelDescription, w: Weights, kind: GraphKind) -> onnx.ModelProto:
    if not kind.is_decode:
        raise ValueError(f"decode_steps builds multi-step decode graphs, not {kind.name}")
    ins, outs = c.graph_io(desc, kind, w.dtype)
    b = GraphBuilder()
    one = b.op("Expand", b.const(np.array([1], np.int64)), b.shape_of(c.INPUT_IDS, 0, 1), name="one_row")  # [B]
    token, ids, carry, tokens = c.INPUT_IDS, c.INPUT_IDS, {}, []     # ids [B, i + 1]: the tokens of rows 0..i
    for i in range(kind.steps):
        with b.scope(f"step{i}"):
            hidden, rows = _step(b, desc, w, token, ids, one, carry)
            token = b.op("ArgMax", _lm_head(b, w, hidden), axis=-1, keepdims=0, name="greedy")      # [B, 1]
        tokens.append(token)
        if i + 1 < kind.steps:
            ids = b.concat([ids, token], 1)
    produced = {c.NEXT_TOKENS: b.concat(tokens, 1)}
    for i, new in rows.items():             # the last step's attention rows: positions c .. c + n - 1
        produced.update(new_rows_outputs(desc.layers[i].mixer, i, new))
    for i in range(len(desc.layers)):
        if i not in rows:
            produced[c.new_recurrent_state(i)], produced[c.new_conv_state(i)] = carry[i]
    return _finish(b, kind.name, ins, outs, produced, _functions(desc, row_states=False))


def _step(b: GraphBuilder, desc: ModelDescription, w: Weights, token: str, ids: str, one: str, carry: dict
          ) -> tuple[str, dict[int, dict[str, str]]]:
    """One decode step over `token` [B, 1] at position c + i (ids [B, i + 1]: rows 0..i, for the
    attention blocks' positions). carry, per layer, updated: an attention layer's input rows so far
    [B, i + 1, H] (the residual stream before its norm: the norm stays fused into the projections'
    kernel, whose rounding is not RMSNormalization's); a Gated DeltaNet layer's (state, conv window)
    after this row. Returns the final norm's hidden [B, 1, H] and each attention layer's new rows over
    rows 0..i (pool name -> tensor)."""
    paging = _paging(b, desc, desc.layers, ids, w.dtype)
    with b.scope("model/embed_tokens"):
        x = b.op("Gather", w.plain(b, "embed_tokens.weight"), token, axis=0)                     # [B, 1, H]
    rows, conv_index = {}, {}
    selected = None     # the last indexer's top-k: layers that reuse it attend to it (as graphs._trunk)
    last = None if carry else (lambda h: h)                                  # step 0: one row already
    for i, layer in enumerate(desc.layers):
        p = f"layers.{i}."
        with b.scope(f"model/layers.{i}"):
            if layer.kind == LayerKind.FULL_ATTENTION:
                mixer = attention_mixer(b, desc, w, i, paging, selected)
                block = b.concat([carry[i], x], 1) if i in carry else x                           # [B, i+1, H]
                carry[i] = block
                x, extra = decoder_layer(b, desc, w, block, p, layer, mixer, kept_rows=last or (
                    lambda h: b.slice(h, [-1], [np.iinfo(np.int64).max], [1])))                   # row i: the MLP's
            else:
                states = None
                if i in carry:      # the last step's, as pools over slots 0..B-1 (the kernel reads them so)
                    local = b.op("Range", b.const(0, np.int64), b.squeeze(b.shape_of(one), [0]), b.const(1, np.int64))
                    states = tuple(b.op("Gather", t, local, axis=0) for t in carry[i])
                mixer = gdn_mixer(b, desc, w, i, token, one, False, conv_index, states)
                x, extra = decoder_layer(b, desc, w, x, p, layer, mixer)
        if layer.kind == LayerKind.FULL_ATTENTION:
            rows[i], selected = extra[0], extra[1] or selected
        else:
            window = _conv_windows_after(b, {i: extra}, desc, one)[c.new_conv_state(i)]
            carry[i] = (extra.state, window)
    with b.scope("model/norm"):
        hidden = rms_norm(b, x, norm_scale(b, desc, w, "norm.weight"), desc.rms_norm_eps, "RMSNormalization")
    return hidden, rows


__all__ = ["decode_steps"]
