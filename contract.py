"""The I/O contract of every graph: names, dtypes, shapes and meaning of each input and output.

The exporter builds graphs from these specs and the runtime binds buffers by them; no other
module spells a tensor name. Bump CONTRACT_VERSION on any change.

Symbolic dims: batch (B), rows (W: 1 decode, k+1 verify, a chunk for prefill; R for a head),
drafts (k = W - 1: a unified round's next drafts), steps (n: a multi-step decode's tokens),
max_pages (P, block-table width), num_pages (N, pool pages), page_size (S), num_slots (state
pool slots). Paged pools come in page groups, one per sliding window (None: full attention), each
with its own pages and block table (`block_tables` for full attention, `block_tables.window{w}`
for window w): a window group's pages that fall out of the window are released while the
sequence runs, their table entries pointing at the scratch page (never read: masked). Each
layer's pools come from its cache specs (checkpoint/cache_specs.py): paged rows live in pools
[N, S, *row] (row w of sequence b at position context_lens[b] + w), states in [num_slots, *state].
Engines are pure: they read pools and states and output new rows and new
states; the runtime commits what was accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.checkpoint.cache_specs import CONV, KEY, RECURRENT, VALUE, LayerCache, PagedKVSpec, StateSpec
from tandem.checkpoint.description import ModelDescription
from tandem.graph_kinds import GraphKind

TANDEM_DOMAIN = "ai.tandem"   # the ONNX domain of tandem's custom ops (export/ops/, plugins/)
CONTRACT_VERSION = 3   # 2: verify_sample samples each row from its position's uniform, then compares;
                       # 3: conv pools position-major [slots, K-1, C]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # "float32", "float16", "int64"
    shape: tuple[str | int, ...]
    doc: str


# ---- names ------------------------------------------------------------------------------
INPUT_IDS = "input_ids"
CONTEXT_LENS = "context_lens"
BLOCK_TABLES = "block_tables"
STATE_SLOTS = "state_slots"
STATE_ROWS = "state_rows"
HIDDEN_IN = "hidden_in"
LAST_ROW = "last_row"
TEMPERATURE, TOP_K, TOP_P, UNIFORMS = "temperature", "top_k", "top_p", "uniforms"
MAX_LOGPROBS = 20       # top logprobs a row reports at most (OpenAI's and vLLM's limit)
MIN_TEMPERATURE = 1e-5  # below it a row is greedy (as vLLM): logits / T would overflow float32
# a verify or round row past a sequence's drafts (a batch whose sequences drafted different counts
# runs at the widest): the embedding's Gather reads it as the last token (ONNX counts negative ids
# from the end) and no target token equals it, so acceptance stops before it
FILLER_DRAFT = -1
# relaxed acceptance (export/acceptance.py): verify inputs that engines built before them lack; the
# runtime binds them only where an engine has them (without: exact acceptance), so no version bump
RELAXED_TOPK, RELAXED_DELTA, RELAXED_ROWS = "relaxed_topk", "relaxed_delta", "relaxed_rows"
# grammar masks (structured outputs): a verify and MTP head input of the same kind, engines built before it lack it;
# the runtime binds it only where an engine has it and runs grammar requests without speculation where the verify
# engines lack it (heads without it draft unmasked)
TOKEN_BITMASK = "token_bitmask"
# logits processors (pipeline/logits_processors.py): sparse edits of each verify row's logits (and of an MTP head's
# last row: its draft), and min-p for sampled rows; optional inputs as the two above (verify engines without them run
# processed requests without speculation; heads without them draft unedited)
LOGIT_EDIT_IDS, LOGIT_EDITS, MIN_P_LOG = "logit_edit_ids", "logit_edits", "min_p_log"
WANT_LOGPROBS = "want_logprobs"    # verify: 1 where a row reports logprobs (optional, as the ones above)
TOKEN_LOGPROBS, TOP_LOGPROBS, TOP_LOGPROB_IDS = "token_logprobs", "top_logprobs", "top_logprob_ids"
MAX_LOGIT_BIAS_ENTRIES = 1024   # logit_bias entries a request may send (the edit lists' bound with max_seq_len)

HIDDEN = "hidden"
LOGITS = "logits"
ACCEPTED = "accepted"
NEXT_TOKEN = "next_token"
DRAFT_TOKEN, DRAFT_PROB, HIDDEN_OUT = "draft_token", "draft_prob", "hidden_out"
HIDDEN_ROWS = "hidden_rows"   # heads anchored on the previous head: every row's hidden
NEXT_DRAFTS, DRAFT_PROBS, DRAFT_HIDDEN = "next_drafts", "draft_probs", "draft_hidden"   # unified round
NEXT_TOKENS = "next_tokens"   # multi-step decode (a graph kind added beside the others: no version bump)


def mask_words(vocab_size: int) -> int:
    """int32 words of one row of TOKEN_BITMASK: one bit per token, ceil(vocab / 32)."""
    return (vocab_size + 31) // 32


def block_tables(window: int | None) -> str:
    """The block-table input of a page group: `block_tables` (full attention), `block_tables.window8`."""
    return BLOCK_TABLES if window is None else f"{BLOCK_TABLES}.window{window}"


def page_groups(caches) -> list[int | None]:
    """The page groups (sliding windows; None = full attention) of `caches`' paged pools, full first."""
    windows = {p.window for cache in caches for p in cache.paged}
    return sorted(windows, key=lambda w: -1 if w is None else w)


def _pool(name: str, layer: int | str) -> str:
    return f"{name}_pool.{layer}"


def _new_rows(name: str, layer: int | str) -> str:
    return f"new_{name}.{layer}"


def _new_state(name: str, layer: int | str) -> str:
    return f"new_{name}_state.{layer}"


def pool_input(spec: PagedKVSpec | StateSpec, layer: int | str) -> str:
    """The committed pool a graph reads: key_pool.3, conv_pool.0, key_pool.mtp0."""
    return _pool(spec.name, layer)


def pool_output(spec: PagedKVSpec | StateSpec, layer: int | str) -> str:
    """What a graph outputs for the runtime to commit: new rows (new_key.3) or a new state (new_conv_state.0)."""
    return (_new_rows if isinstance(spec, PagedKVSpec) else _new_state)(spec.name, layer)


def layer_id(cache: LayerCache) -> int | str:
    """A layer's name in pool names: its trunk index, or mtp_layer_name(j) for MTP head j."""
    return mtp_layer_name(cache.layer) if cache.head else cache.layer


def mtp_layer_name(head: int) -> str:
    """Pool names of MTP head `head` use this in place of a layer index: key_pool.mtp0."""
    return f"mtp{head}"


# the pools of attention and Gated DeltaNet layers, by name (the graphs that build those layers use them)
def key_pool(layer: int | str) -> str:
    return _pool(KEY, layer)


def value_pool(layer: int | str) -> str:
    return _pool(VALUE, layer)


def new_key(layer: int | str) -> str:
    return _new_rows(KEY, layer)


def new_value(layer: int | str) -> str:
    return _new_rows(VALUE, layer)


def recurrent_pool(layer: int) -> str:
    return _pool(RECURRENT, layer)


def conv_pool(layer: int) -> str:
    return _pool(CONV, layer)


def new_recurrent_state(layer: int) -> str:
    return _new_state(RECURRENT, layer)


def new_conv_state(layer: int) -> str:
    return _new_state(CONV, layer)


# ---- specs ------------------------------------------------------------------------------

def _paging_inputs(caches) -> list[TensorSpec]:
    """Context lengths and one block table per page group of `caches` (full attention if none)."""
    tables = [TensorSpec(block_tables(w), "int64", ("batch", "max_pages"),
                         "pool page of each page of a sequence" + (f" (window {w} pools; pages out of the window: "
                                                                   "the scratch page)" if w else ""))
              for w in page_groups(caches) or [None]]
    return [TensorSpec(CONTEXT_LENS, "int64", ("batch",), "committed tokens per sequence; row w is at position "
                                                          "context_lens + w"), *tables]


def pool_shape(spec: PagedKVSpec | StateSpec) -> tuple[str | int, ...]:
    """A committed pool: paged rows [num_pages, page_size, *row], states [num_slots, *state]."""
    if isinstance(spec, PagedKVSpec):
        return ("num_pages", "page_size", *spec.row_shape)
    return ("num_slots", *spec.shape)


def _pool_specs(caches: tuple[LayerCache, ...], dtype: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Pool inputs and new-row / new-state outputs of `caches`: every paged pool (layer order),
    then every state pool and, if there is one, the state slots."""
    ins, outs = [], []
    for cache in caches:
        for p in cache.paged:
            ins.append(TensorSpec(pool_input(p, layer_id(cache)), p.dtype_for(dtype), pool_shape(p),
                                  f"committed {p.doc}, paged"))
            outs.append(TensorSpec(pool_output(p, layer_id(cache)), p.dtype_for(dtype), ("batch", "rows", *p.row_shape),
                                   f"{p.doc} of the new rows, to commit for accepted rows"))
    for cache in caches:
        for s in cache.states:
            ins.append(TensorSpec(pool_input(s, layer_id(cache)), s.dtype_for(dtype), pool_shape(s),
                                  f"committed {s.doc}, one slot per sequence"))
            outs.append(TensorSpec(pool_output(s, layer_id(cache)), s.dtype_for(dtype), ("batch", *s.shape),
                                   f"{s.doc} after the committed rows of this step"))
    if any(cache.states for cache in caches):
        ins.append(TensorSpec(STATE_SLOTS, "int64", ("batch",), "state-pool slot of each sequence"))
    return ins, outs


def _trunk_layer_specs(desc: ModelDescription, dtype: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    return _pool_specs(desc.layer_caches(mtp_layers=0), dtype)


def target_step_io(desc: ModelDescription, dtype: str = "float32") -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Prefill chunk / decode: W rows per sequence -> hidden rows, logits, new K/V and states."""
    layer_in, layer_out = _trunk_layer_specs(desc, dtype)
    ins = [TensorSpec(INPUT_IDS, "int64", ("batch", "rows"), "token ids of the new rows"),
           *_paging_inputs(desc.layer_caches(mtp_layers=0)),
           TensorSpec(STATE_ROWS, "int64", ("batch",), "rows whose state to keep (1..W): later rows are padding"),
           *layer_in]
    outs = [TensorSpec(HIDDEN, dtype, ("batch", "rows", desc.hidden_size), "post-final-norm hidden of each row"),
            TensorSpec(LOGITS, "float32", ("batch", "rows", desc.vocab_size), "next-token logits of each row"),
            *layer_out]
    return ins, outs


def verify_step_io(desc: ModelDescription, dtype: str = "float32") -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Target over [pending, d_1..d_k] fused with acceptance; states kept after the accepted rows."""
    layer_in, layer_out = _trunk_layer_specs(desc, dtype)
    ins = [TensorSpec(INPUT_IDS, "int64", ("batch", "rows"), "[pending token, draft 1..k]; FILLER_DRAFT past a "
                      "row's drafts: never accepted"),
           *_paging_inputs(desc.layer_caches(mtp_layers=0)),
           TensorSpec(TEMPERATURE, "float32", ("batch",), "below MIN_TEMPERATURE: greedy; else sampling temperature"),
           TensorSpec(TOP_K, "int64", ("batch",), "top-k filter, 0 = off"),
           TensorSpec(TOP_P, "float32", ("batch",), "top-p filter, 1 = off"),
           TensorSpec(UNIFORMS, "float32", ("batch", "rows"), "uniform in [0,1) of the position row i's token fills"),
           TensorSpec(RELAXED_TOPK, "int64", ("batch",), "relaxed acceptance: draft in the target's top-k, 0 = off"),
           TensorSpec(RELAXED_DELTA, "float32", ("batch",), "relaxed acceptance: draft prob >= top prob - delta"),
           TensorSpec(RELAXED_ROWS, "int64", ("batch", "rows"), "1 where row i may relax (judging d_{i+1}), else 0"),
           TensorSpec(TOKEN_BITMASK, "int32", ("batch", "rows", mask_words(desc.vocab_size)),
                      "grammar mask of row i: bit t % 32 of word t // 32 set where token t is allowed (all ones: off)"),
           TensorSpec(LOGIT_EDIT_IDS, "int64", ("batch", "rows", "edits"), "tokens whose logit row i edits"),
           TensorSpec(LOGIT_EDITS, "float32", ("batch", "rows", "edits", 3),
                      "(bias, scale, post): x = x + bias; x = x / scale if x > 0 else x * scale; x = x + post"),
           TensorSpec(MIN_P_LOG, "float32", ("batch",), "log(min_p), -inf = off: sampled rows drop scaled logits "
                      "below their top one plus this"),
           TensorSpec(WANT_LOGPROBS, "int64", ("batch",), "1 where the row's logprobs are wanted (any: all computed)"),
           *layer_in]
    outs = [TensorSpec(ACCEPTED, "int64", ("batch",), "drafts accepted (0..k); rows 0..accepted are committed"),
            TensorSpec(NEXT_TOKEN, "int64", ("batch",), "the token after the accepted ones (correction or bonus)"),
            TensorSpec(HIDDEN, dtype, ("batch", "rows", desc.hidden_size), "post-final-norm hidden of each row"),
            TensorSpec(TOKEN_LOGPROBS, "float32", ("batch", "rows"),
                       "raw log-probability of the token row i emits (zeros unless wanted)"),
            TensorSpec(TOP_LOGPROBS, "float32", ("batch", "rows", top_logprobs(desc.vocab_size)),
                       "row i's largest raw log-probabilities, descending"),
            TensorSpec(TOP_LOGPROB_IDS, "int64", ("batch", "rows", top_logprobs(desc.vocab_size)), "their token ids"),
            *layer_out]
    return ins, outs


def top_logprobs(vocab_size: int) -> int:
    """Top log-probabilities a verify row reports: MAX_LOGPROBS, or the vocabulary when smaller."""
    return min(MAX_LOGPROBS, vocab_size)


def mtp_head_io(desc: ModelDescription, head: int, dtype: str = "float32") -> tuple[list[TensorSpec], list[TensorSpec]]:
    """One MTP head layer over R rows: row r pairs token t_{i+1} with hidden h_i (target or chained)."""
    kv_in, kv_out = _pool_specs((desc.head_cache(head),), dtype)
    ins = [TensorSpec(INPUT_IDS, "int64", ("batch", "rows"), "token t_{i+1} of each row"),
           TensorSpec(HIDDEN_IN, dtype, ("batch", "rows", desc.hidden_size), "hidden h_i paired with each row"),
           *_paging_inputs((desc.head_cache(head),)),
           TensorSpec(LAST_ROW, "int64", ("batch",), "the row whose draft and hidden to return"),
           TensorSpec(TOKEN_BITMASK, "int32", ("batch", "rows", mask_words(desc.vocab_size)),
                      "grammar mask of each row; the draft is the best token last_row's allows (all ones: off)"),
           TensorSpec(LOGIT_EDIT_IDS, "int64", ("batch", "rows", "edits"), "tokens whose logit row i edits"),
           TensorSpec(LOGIT_EDITS, "float32", ("batch", "rows", "edits", 3),
                      "(bias, scale, post) per edited token: the draft is last_row's edited argmax"),
           *kv_in]
    outs = [TensorSpec(DRAFT_TOKEN, "int64", ("batch",), "greedy draft at last_row"),
            TensorSpec(DRAFT_PROB, "float32", ("batch",), "the head's probability of that draft"),
            TensorSpec(HIDDEN_OUT, dtype, ("batch", desc.hidden_size),
                       "head hidden (after its final norm) at last_row"),
            *kv_out]
    if desc.mtp.anchor == "previous_head":  # the next head's rows pair with this head's hidden of every row
        outs.insert(3, TensorSpec(HIDDEN_ROWS, dtype, ("batch", "rows", desc.hidden_size),
                                  "head hidden (after its final norm) of every row"))
    return ins, outs


def round_heads(desc: ModelDescription, kind: GraphKind) -> tuple[int, ...]:
    """The MTP heads a unified round graph re-anchors (and whose pools it reads): head 0 when
    every draft step reuses it, else every head."""
    return (0,) if kind.reused else tuple(range(desc.mtp.num_layers))


def round_io(desc: ModelDescription, kind: GraphKind, dtype: str = "float32"
             ) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """One speculative round (export/round_graph.py): verify [pending, d_1..d_k] with acceptance,
    re-anchor the heads over the verified rows, draft the next k. Dim `drafts` = rows - 1 = k."""
    verify_in, verify_out = graph_io(desc, GraphKind.verify(kind.sampling), dtype)
    trunk = desc.layer_caches(mtp_layers=0)
    caches = (*trunk, *(desc.head_cache(j) for j in round_heads(desc, kind)))
    pool_in, pool_out = _pool_specs(caches, dtype)
    paging = _paging_inputs(caches)
    trunk_only = {s.name for s in (*_paging_inputs(trunk), *_pool_specs(trunk, dtype)[0])}
    acceptance = [s for s in verify_in if s.name not in trunk_only | {WANT_LOGPROBS}]   # input_ids, sampling, ...
    ins = [acceptance[0], *paging, *acceptance[1:], *pool_in]
    outs = [*verify_out[:2],
            TensorSpec(NEXT_DRAFTS, "int64", ("batch", "drafts"), "the next round's drafts d'_1..d'_k (greedy)"),
            TensorSpec(DRAFT_PROBS, "float32", ("batch", "drafts"), "each head's probability of its draft"),
            TensorSpec(DRAFT_HIDDEN, dtype, ("batch", "drafts", desc.hidden_size),
                       "head hidden g_0..g_{k-1} at each draft's row: the chain a further draft step pairs with"),
            *pool_out]
    return ins, outs


def decode_io(desc: ModelDescription, dtype: str = "float32") -> tuple[list[TensorSpec], list[TensorSpec]]:
    """n greedy decode steps in one call (export/decode_graph.py): the pending token of each
    sequence in, the n tokens after it out, with the n new rows (positions context_lens ..
    context_lens + n - 1: the pending token and the first n - 1 new ones) and the states after them.
    Dim `steps` = n."""
    step_in, step_out = target_step_io(desc, dtype)
    ins = [TensorSpec(INPUT_IDS, "int64", ("batch", 1), "the pending token of each sequence"),
           *(s for s in step_in if s.name not in (INPUT_IDS, STATE_ROWS))]
    layers = [TensorSpec(s.name, s.dtype, tuple("steps" if d == "rows" else d for d in s.shape), s.doc)
              for s in step_out if s.name not in (HIDDEN, LOGITS)]
    outs = [TensorSpec(NEXT_TOKENS, "int64", ("batch", "steps"), "the n greedy tokens after the pending one"),
            *layers]
    return ins, outs


def graph_io(desc: ModelDescription, kind: GraphKind, dtype: str = "float32"
             ) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs and outputs of a graph kind for engines of `dtype`; the greedy verify graph takes no
    sampling inputs."""
    if kind.is_target_step:
        return target_step_io(desc, dtype)
    if kind.is_round:
        return round_io(desc, kind, dtype)
    if kind.is_decode:
        return decode_io(desc, dtype)
    if kind.is_verify:
        ins, outs = verify_step_io(desc, dtype)
        if not kind.sampling:
            ins = [s for s in ins if s.name not in (TEMPERATURE, TOP_K, TOP_P, UNIFORMS, MIN_P_LOG)]
        return ins, outs
    return mtp_head_io(desc, kind.head, dtype)
