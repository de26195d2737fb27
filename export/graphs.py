"""The graphs tandem runs, assembled from layers.py on the I/O contract of tandem.contract.

    target step   ids [B, W] --embed--> L x decoder layer --norm--> hidden [B, W, H] --lm_head--> logits
                  (+ new K/V rows per attention layer, new states after state_rows rows per GDN layer)
    verify        same trunk over [pending, d_1..d_k]; acceptance in-graph; GDN states and conv
                  windows selected after the accepted rows (row_states -> GatherND at `accepted`)
    MTP head j    fc form:    x = fc(cat[norm_e(embed(t_{i+1})), norm_h(h_i)]) -> mtp.layers.j -> mtp.norm
                  nextn form: x = eh_proj_j(cat[enorm_j(embed(t_{i+1})), hnorm_j(h_i)]) -> mtp.layers.j
                              -> shared_head.norm_j
                  -> hidden; row last_row -> lm_head (nextn with own heads: shared_head.head_j) -> greedy
                  draft, its probability, the hidden to chain (+ every row's hidden when the next head
                  anchors on this one)

Attention layers read the block table of their page group (sliding window) and the RoPE tables of
their own (rotary_dim, theta); a graph builds one table pair per distinct RoPE among its layers.
Sparse-MLA layers (MLASpec: DeepSeek-V3.2, GLM-5) run export/mla.py's piece instead; every
attention layer's new rows are named by its cache specs (K/V, or latent and index keys), and a
layer that reuses the previous layer's top-k (GLM-5 "shared") attends the last indexer's selection.

Dtypes follow the contract for the export dtype: the trunk and heads run in it (float32 or
float16); logits leave the lm_head as float32, so acceptance and drafting compare float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from tandem import contract as c
from tandem.checkpoint.cache_specs import KEY, VALUE
from tandem.checkpoint.description import AttentionSpec, LayerKind, ModelDescription, mixer_name
from tandem.checkpoint.mla_specs import INDEX_KEYS, LATENT, MLASpec
from tandem.export import acceptance
from tandem.export.builder import IR_VERSION, OPSET, TANDEM_DOMAIN, GraphBuilder, value_info
from tandem.export.layers import (
    Paging,
    attention,
    conv_windows_index,
    decoder_layer,
    gated_deltanet_layer,
    norm_scale,
    rope_key,
    rope_pair,
)
from tandem.export.mla import mla_attention
from tandem.export.ops import gated_deltanet, lightning_indexer, paged_sparse_attention
from tandem.export.primitives import Weights, cast, rms_norm
from tandem.graph_kinds import TARGET_STEP, GraphKind


def check_exportable(desc: ModelDescription) -> None:
    """Refuse, naming the layer, what the descriptions can say but the graphs do not build yet:
    MTP head layers that are not attention."""
    for j, layer in enumerate(desc.mtp.layers if desc.mtp else ()):
        if layer.kind != LayerKind.FULL_ATTENTION:
            raise ValueError(f"{desc.architecture} MTP head layer {j}: a {layer.kind.value} head layer is not "
                             f"implemented yet in the exporter")


def _paging(b: GraphBuilder, desc: ModelDescription, layers, ids: str, dtype: str) -> Paging:
    """Positions context_lens + w for the rows of `ids`, dense selection, and for the attention
    `layers` of the graph: the block table of each page group (contract.block_tables) and one
    cos/sin pair per distinct (rotary_dim, theta)."""
    check_exportable(desc)
    specs = [x.mixer for x in layers if x.kind == LayerKind.FULL_ATTENTION]     # AttentionSpec or MLASpec
    w = b.op("Range", b.const(0, np.int64), b.squeeze(b.shape_of(ids, 1, 2), [0]), b.const(1, np.int64))
    positions = b.op("Add", b.unsqueeze(c.CONTEXT_LENS, [1]), b.unsqueeze(w, [0]), name="positions")
    rotary = {}
    for a in specs:
        if rope_key(a) not in rotary:  # the first keeps the plain scope: single-RoPE graphs are unchanged
            scope = "rotary" if not rotary else "rotary." + ".".join(f"{k:g}" for k in rope_key(a)[:2])
            rotary[rope_key(a)] = rope_pair(b, a, positions, dtype, scope)
    tables = {a.window: c.block_tables(a.window) for a in specs}
    return Paging(c.CONTEXT_LENS, tables, rotary, b.const(np.zeros((1, 1, 0), np.int64)))


def _conv_windows_after(b: GraphBuilder, gdn: dict, desc: ModelDescription, rows: str) -> dict[str, str]:
    """new_conv_state.{i} of every Gated DeltaNet layer: padded [B, K-1+W, C] -> the K-1 conv inputs
    after `rows` [B] rows, padded[b, n_b : n_b+K-1, :], one GatherND per layer on an index built
    once per kernel size."""
    index, out = {}, {}
    for i, g in gdn.items():
        kernel = desc.layers[i].mixer.conv_kernel
        if kernel not in index:
            with b.scope("conv_windows_after"):
                index[kernel] = b.unsqueeze(b.op("Add", b.unsqueeze(rows, [1]), b.const(np.arange(kernel - 1)[None, :],
                                                                                     np.int64)), [2])  # [B, K-1, 1]
        with b.scope(f"model/layers.{i}/commit"):
            out[c.new_conv_state(i)] = b.op("GatherND", g.conv_padded, index[kernel], batch_dims=1)
    return out


def attention_layer(b: GraphBuilder, desc: ModelDescription, spec: AttentionSpec | MLASpec, w: Weights, xn: str,
                    p: str, paging: Paging, layer: int | str, selected: str | None = None
                    ) -> tuple[str, dict[str, str], str | None]:
    """Attention of layer `layer` (trunk index, or mtp_layer_name(j)) on its pools -> (output, the new
    rows by pool name (its cache specs'), the top-k it attended for the next layer to reuse or None).
    `selected` [B, W, K]: the top-k a sparse-MLA layer attends in place of its own indexer's: the
    previous layer's (GLM-5 "shared" layers) or the first draft step's (index share)."""
    pools = {s.name: c.pool_input(s, layer) for s in spec.cache_specs()}
    return _ATTENTION_LAYERS[mixer_name(spec)](b, desc, spec, w, xn, p, paging, pools, selected)


def _gqa_layer(b, desc, spec: AttentionSpec, w, xn, p, paging, pools, selected):
    out, k, v = attention(b, desc, spec, w, xn, p, paging, pools[KEY], pools[VALUE])
    return out, {KEY: k, VALUE: v}, None


def _mla_layer(b, desc, spec: MLASpec, w, xn, p, paging, pools, selected):
    cos, sin = paging.rope(spec)
    out = mla_attention(b, spec, w, p + "self_attn.", xn, cos, sin, paging.context_lens, paging.table(spec),
                        pools[LATENT], pools.get(INDEX_KEYS), selected)
    rows = {LATENT: out.latent_rows}
    if out.index_key_rows is not None:
        rows[INDEX_KEYS] = out.index_key_rows
    return out.output, rows, out.selected


# attention mixer (description.MIXERS' name) -> its layer: (output, new rows by pool name, top-k it attended)
_ATTENTION_LAYERS = {"attention": _gqa_layer, "mla": _mla_layer}


def attention_mixer(b: GraphBuilder, desc: ModelDescription, w: Weights, i: int, paging: Paging,
                    selected: str | None):
    """decoder_layer's mixer for trunk attention layer i: xn -> (output, (its new rows, the top-k
    it attended)). A sparse-MLA layer that reuses the previous indexer's top-k attends `selected`."""
    spec = desc.layers[i].mixer
    reuse = spec.reuses_previous_selection

    def mixer(xn):
        out, rows, picked = attention_layer(b, desc, spec, w, xn, f"layers.{i}.", paging, i,
                                            selected if reuse else None)
        return out, (rows, picked)
    return mixer


def gdn_mixer(b: GraphBuilder, desc: ModelDescription, w: Weights, i: int, ids: str, state_rows: str,
              row_states: bool, conv_index: dict, states: tuple[str, str] | None = None):
    """decoder_layer's mixer for trunk Gated DeltaNet layer i: xn -> (output, its GatedDeltaNetOutputs).
    It reads its recurrent state and conv window from `states` (state, conv) where given, else
    gathers them from its pools at the call's slots; `conv_index` holds one conv windows' index
    per kernel size for the whole graph (made by the first layer that needs it, from `ids`)."""
    spec = desc.layers[i].mixer

    def mixer(xn):
        if states is None:
            state = b.op("Gather", c.recurrent_pool(i), c.STATE_SLOTS, axis=0, name="gather_state")
            conv = b.op("Gather", c.conv_pool(i), c.STATE_SLOTS, axis=0, name="gather_conv")
        else:
            state, conv = states
        if spec.conv_kernel not in conv_index:
            conv_index[spec.conv_kernel] = conv_windows_index(b, ids, spec.conv_kernel)
        out = gated_deltanet_layer(b, desc, spec, w, xn, f"layers.{i}.", state, conv, state_rows,
                                   row_states=row_states, conv_index=conv_index[spec.conv_kernel])
        return out.output, out
    return mixer


def new_rows_outputs(spec: AttentionSpec | MLASpec, layer: int | str, rows: dict[str, str]) -> dict[str, str]:
    """The contract's output name of each new-rows tensor of attention layer `layer`."""
    return {c.pool_output(s, layer): rows[s.name] for s in spec.cache_specs()}


def _trunk(b: GraphBuilder, desc: ModelDescription, w: Weights, verify: bool):
    """Embed -> layers -> final norm. Returns (hidden, new paged rows per attention layer (pool name
    -> tensor), GDN pieces)."""
    paging = _paging(b, desc, desc.layers, c.INPUT_IDS, w.dtype)
    with b.scope("model/embed_tokens"):
        x = b.op("Gather", w.plain(b, "embed_tokens.weight"), c.INPUT_IDS, axis=0)
    state_rows = c.STATE_ROWS
    if verify:  # every row's state is kept; the accepted one is picked after acceptance
        state_rows = b.op("Expand", b.squeeze(b.shape_of(c.INPUT_IDS, 1, 2), [0]), b.shape_of(c.INPUT_IDS, 0, 1))
    kv, gdn, conv_index = {}, {}, {}    # conv_index: kernel -> the conv windows' index, one per graph
    selected = None     # the last indexer's top-k [B, W, K]: layers that reuse it attend to it
    for i, layer in enumerate(desc.layers):
        p = f"layers.{i}."
        with b.scope(f"model/layers.{i}"):
            if layer.kind == LayerKind.FULL_ATTENTION:
                mixer = attention_mixer(b, desc, w, i, paging, selected)
            else:
                mixer = gdn_mixer(b, desc, w, i, c.INPUT_IDS, state_rows, verify, conv_index)
            x, extra = decoder_layer(b, desc, w, x, p, layer, mixer)
        if layer.kind == LayerKind.FULL_ATTENTION:
            kv[i], selected = extra[0], extra[1] or selected
        else:
            gdn[i] = extra
    with b.scope("model/norm"):
        hidden = rms_norm(b, x, norm_scale(b, desc, w, "norm.weight"), desc.rms_norm_eps, "RMSNormalization")
    return hidden, kv, gdn


def _lm_head(b: GraphBuilder, w: Weights, hidden: str, name: str = "lm_head.weight") -> str:
    """hidden [.., H] -> float32 logits [.., V]: the product in the export dtype, then widened. On
    ONNX Runtime CPU this equals an fp32 product on the same fp16 hidden (measured: bit for bit),
    so no fp32 copy of lm_head is stored. An MTP head's pass hands in the weights' draft view
    (Weights.drafting): drafts only propose, the verify pass decides with the target's own."""
    with b.scope("lm_head"):
        return cast(b, b.op("MatMul", hidden, w.matmul_t(b, name), name="MatMul"), w.dtype, "float32")


def _finish(b: GraphBuilder, name: str, ins, outs, produced: dict[str, str], functions) -> onnx.ModelProto:
    """Wire produced tensors to the contract's output names and make the model."""
    for spec in outs:
        b.op("Identity", produced[spec.name], outputs=[spec.name], name=f"outputs/{spec.name}")
    graph = helper.make_graph(
        b.nodes, name, [value_info(s.name, s.dtype, s.shape) for s in ins],
        [value_info(s.name, s.dtype, s.shape) for s in outs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(TANDEM_DOMAIN, 1)],
                              functions=functions, producer_name="tandem")
    # weights go in one at a time: a list of them, then the graph, then the model each held a copy
    for n, a in b.initializers.items():
        model.graph.initializer.append(onnx.numpy_helper.from_array(a, n))
    for n, (shape, dtype) in b.stored.items():   # in weights.bin already: the exporter points them there
        tensor = onnx.TensorProto(name=n, dims=shape, data_type=helper.np_dtype_to_tensor_dtype(dtype),
                                  data_location=onnx.TensorProto.EXTERNAL)
        model.graph.initializer.append(tensor)
    model.ir_version = IR_VERSION
    return model


def target_step(desc: ModelDescription, w: Weights, gdn_chunk_size: int = 0) -> onnx.ModelProto:
    """gdn_chunk_size > 0 gives GatedDeltaNet the chunked body (long prefill chunks on runtimes
    without a native kernel); 0 the recurrent one."""
    ins, outs = c.target_step_io(desc, w.dtype)
    b = GraphBuilder()
    hidden, kv, gdn = _trunk(b, desc, w, verify=False)
    produced = {c.HIDDEN: hidden, c.LOGITS: _lm_head(b, w, hidden)}
    for i, rows in kv.items():
        produced.update(new_rows_outputs(desc.layers[i].mixer, i, rows))
    for i, g in gdn.items():
        produced[c.new_recurrent_state(i)] = g.state
    produced.update(_conv_windows_after(b, gdn, desc, c.STATE_ROWS))
    return _finish(b, TARGET_STEP.name, ins, outs, produced,
                   _functions(desc, row_states=False, chunk=gdn_chunk_size))


def verify_step(desc: ModelDescription, w: Weights, sampling: bool) -> onnx.ModelProto:
    kind = GraphKind.verify(sampling)
    ins, outs = c.graph_io(desc, kind, w.dtype)  # the greedy graph takes no sampling inputs
    b = GraphBuilder()
    produced = verify_body(b, desc, w, sampling)
    return _finish(b, kind.name, ins, outs, produced, _functions(desc, row_states=True))


def verify_body(b: GraphBuilder, desc: ModelDescription, w: Weights, sampling: bool,
                logprobs: bool = True) -> dict[str, str]:
    """The verify graph's outputs (contract name -> tensor) on the contract's input names: the
    trunk over input_ids, acceptance, new K/V rows, states after the accepted row."""
    hidden, kv, gdn = _trunk(b, desc, w, verify=True)
    logits = _lm_head(b, w, hidden)
    relaxed = acceptance.Relaxed(c.RELAXED_TOPK, c.RELAXED_DELTA, c.RELAXED_ROWS)
    edits = acceptance.Edits(c.LOGIT_EDIT_IDS, c.LOGIT_EDITS)
    if sampling:
        accepted, nxt = acceptance.sampled(b, logits, c.INPUT_IDS, c.TEMPERATURE, c.TOP_K, c.TOP_P, c.UNIFORMS,
                                           relaxed=relaxed, bitmask=c.TOKEN_BITMASK, edits=edits,
                                           min_p_log=c.MIN_P_LOG)
    else:
        accepted, nxt = acceptance.greedy(b, logits, c.INPUT_IDS, relaxed=relaxed, bitmask=c.TOKEN_BITMASK,
                                          edits=edits)
    produced = {c.ACCEPTED: accepted, c.NEXT_TOKEN: nxt, c.HIDDEN: hidden}
    if logprobs:    # (a unified round graph reports none: requests with logprobs take the verify graph)
        produced[c.TOKEN_LOGPROBS], produced[c.TOP_LOGPROBS], produced[c.TOP_LOGPROB_IDS] = acceptance.logprobs(
            b, logits, c.INPUT_IDS, accepted, nxt, c.WANT_LOGPROBS, c.top_logprobs(desc.vocab_size))
    for i, rows in kv.items():
        produced.update(new_rows_outputs(desc.layers[i].mixer, i, rows))
    kept = b.op("Add", accepted, b.const(1, np.int64), name="kept_rows")       # rows 0..accepted
    row = b.unsqueeze(accepted, [1])                                            # [B, 1]: the accepted row
    for i, g in gdn.items():
        with b.scope(f"model/layers.{i}/commit"):
            produced[c.new_recurrent_state(i)] = b.op("GatherND", g.state, row, batch_dims=1)
    produced.update(_conv_windows_after(b, gdn, desc, kept))
    return produced


def mtp_head(desc: ModelDescription, w: Weights, head: int) -> onnx.ModelProto:
    ins, outs = c.mtp_head_io(desc, head, w.dtype)
    b = GraphBuilder()
    run = head_pass(b, desc, w, head, c.INPUT_IDS, c.HIDDEN_IN, c.LAST_ROW, bitmask=c.TOKEN_BITMASK,
                    edits=acceptance.Edits(c.LOGIT_EDIT_IDS, c.LOGIT_EDITS))
    produced = {c.DRAFT_TOKEN: run.draft, c.DRAFT_PROB: run.prob, c.HIDDEN_OUT: run.hidden_last,
                **head_rows_outputs(desc, head, run.rows)}
    if run.hidden_rows is not None:
        produced[c.HIDDEN_ROWS] = run.hidden_rows
    return _finish(b, GraphKind.mtp_head(head).name, ins, outs, produced,
                   _functions(desc, row_states=False, gdn=False))


def head_rows_outputs(desc: ModelDescription, head: int, rows: dict[str, str]) -> dict[str, str]:
    """The contract's output names of MTP head `head`'s new rows (pool name -> tensor)."""
    return new_rows_outputs(desc.mtp.layers[head].mixer, c.mtp_layer_name(head), rows)


@dataclass(frozen=True)
class HeadPass:
    """One MTP head layer over R rows: the greedy draft at last_row [B], its probability [B], the
    head hidden at last_row [B, H] and at every row [B, R, H] (heads anchored on the previous head;
    else None: past attention only last_row runs), and the rows' new paged rows by
    pool name (K/V, or the latent and index keys), and the top-k its rows attended [B, R, K] (None
    without sparse attention)."""

    draft: str
    prob: str
    hidden_last: str
    hidden_rows: str | None
    rows: dict[str, str]
    selected: str | None = None


def head_pass(b: GraphBuilder, desc: ModelDescription, w: Weights, head: int, ids: str, hidden: str,
              last_row: str, selected: str | None = None, bitmask: str | None = None,
              edits: acceptance.Edits | None = None) -> HeadPass:
    """Head `head` over rows (ids [B, R], hidden [B, R, H]) at positions context_lens + r, on top
    of its committed pool (contract names key_pool.mtp{j}, the page group's block table).
    `selected` [B, R, K]: the positions a sparse-MLA head attends, its indexer skipped (index share).
    `bitmask` [B, R, words]: grammar masks; the draft is the best token last_row's mask allows, its
    probability the masked softmax's (a batch of all-ones masks runs the plain branch). `edits`
    ([B, R, N] ids, [B, R, N, 3] values): logits processors' edits, last_row's applied before the mask
    (with `bitmask` only: one If decides both)."""
    w = w.drafting()
    layer_name = c.mtp_layer_name(head)
    layer = desc.mtp.layers[head]
    p = f"mtp.layers.{head}."
    paging = _paging(b, desc, (layer,), ids, w.dtype)
    with b.scope(f"mtp/{layer_name}"):
        x = _head_input(b, desc, w, head, ids, hidden)

        def mixer(xn):
            out, rows, picked = attention_layer(b, desc, layer.mixer, w, xn, p, paging, layer_name, selected)
            return out, (rows, picked)

        # every row's new K/V goes to the pool, but only last_row's output is read, unless the next
        # head pairs with every row's hidden: the MLP and the norm then run on that row alone (a
        # re-anchor over 64 rows no longer pays 64 rows' MLP; rows are independent past attention)
        every_row = desc.mtp.anchor == "previous_head"
        last = None if every_row else (lambda h: b.op("GatherND", h, b.unsqueeze(last_row, [1, 2]), batch_dims=1,
                                                      name="last_row"))                       # [B, 1, H]
        x, (rows, picked) = decoder_layer(b, desc, w, x, p, layer, mixer, kept_rows=last)
        nextn = desc.mtp.form == "nextn"
        g = rms_norm(b, x, norm_scale(b, desc, w, p + "shared_head.norm.weight" if nextn else "mtp.norm.weight"),
                     desc.rms_norm_eps, "norm")                                            # [B, R or 1, H]
        if every_row:
            g_last = b.op("GatherND", g, b.unsqueeze(last_row, [1]), batch_dims=1, name="last_row")  # [B, H]
        else:
            g_last = b.squeeze(g, [1])
    logits = _lm_head(b, w, g_last, p + "shared_head.head.weight" if desc.mtp.own_lm_head else "lm_head.weight")
    with b.scope("draft"):
        if bitmask is None:
            draft, prob = _greedy_draft(b, logits)
        else:
            at_last = lambda x: b.unsqueeze(b.op("GatherND", x, b.unsqueeze(last_row, [1]), batch_dims=1), [1])  # noqa: E731
            draft, prob = acceptance.under_grammar(
                b, b.unsqueeze(logits, [1]), at_last(bitmask),                        # [B, 1, V], [B, 1, words]
                lambda g, lg, _: _greedy_draft(g, g.squeeze(lg, [1])), (TensorProto.INT64, TensorProto.FLOAT),
                edits=None if edits is None else acceptance.Edits(at_last(edits.ids), at_last(edits.values)))
    return HeadPass(draft, prob, g_last, g if every_row else None, rows, picked)


def _greedy_draft(b: GraphBuilder, logits: str) -> list[str]:
    """logits [B, V] -> [the argmax [B], its softmax probability [B]]."""
    draft = b.op("ArgMax", logits, axis=-1, keepdims=0)
    top = b.op("ReduceMax", logits, b.const([-1], np.int64), keepdims=1)
    denom = b.op("ReduceSum", b.op("Exp", b.op("Sub", logits, top)), b.const([-1], np.int64), keepdims=0)
    return [draft, b.op("Reciprocal", denom)]


def _head_input(b: GraphBuilder, desc: ModelDescription, w: Weights, head: int, ids: str, hidden: str) -> str:
    """The head layer's input [B, R, H] from the row tokens and their paired hidden, embedding first:
    fc form: mtp.fc(cat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)]) (shared by every head);
    nextn form: eh_proj(cat[enorm(e), hnorm(h)]) with head j's own mtp.layers.{j}.* weights."""
    eps = desc.rms_norm_eps
    if desc.mtp.form == "nextn":
        p = f"mtp.layers.{head}."
        names = (p + "enorm.weight", p + "hnorm.weight", p + "eh_proj.weight", "enorm", "hnorm", "eh_proj")
    else:
        names = ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight",
                 "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc")
    e_norm, h_norm, proj, e_scope, h_scope, proj_scope = names
    with b.scope("embed_tokens"):
        e = b.op("Gather", w.plain(b, "embed_tokens.weight"), ids, axis=0)
    e = rms_norm(b, e, norm_scale(b, desc, w, e_norm), eps, e_scope)
    h = rms_norm(b, hidden, norm_scale(b, desc, w, h_norm), eps, h_scope)
    return b.op("MatMul", b.concat([e, h], -1), w.matmul_t(b, proj), name=f"{proj_scope}/MatMul")


def _functions(desc: ModelDescription, row_states: bool, gdn: bool = True, chunk: int = 0
               ) -> list[onnx.FunctionProto]:
    """The ai.tandem functions a graph of `desc` may call: attention always, the lightning indexer
    when a layer has one, Gated DeltaNet unless `gdn` is False (heads)."""
    fns = [paged_sparse_attention.make_function()]
    if any(getattr(x.mixer, "indexer", None) is not None for x in desc.all_layers):
        fns.append(lightning_indexer.make_function())
    if gdn:
        fns.append(gated_deltanet.make_function(emit_row_states=row_states, chunk_size=chunk))
    return fns
