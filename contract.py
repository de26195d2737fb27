"""The I/O contract of every graph: names, dtypes, shapes and meaning of each input and output.

The exporter builds graphs from these specs and the runtime binds buffers by them; no other
module spells a tensor name. Bump CONTRACT_VERSION on any change.

Symbolic dims: batch (B), rows (W: 1 decode, k+1 verify, a chunk for prefill; R for a head),
max_pages (P, block-table width), num_pages (N, pool pages), page_size (S), num_slots (state
pool slots). Committed K/V live in paged pools [N, S, Hkv, D]; row w of sequence b sits at
position context_lens[b] + w. Engines are pure: they read pools and states and output new K/V
rows and new states; the runtime commits what was accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.checkpoint.description import LayerKind, ModelDescription
from tandem.graph_kinds import GraphKind

CONTRACT_VERSION = 2   # 2: verify_sample samples each row from its position's uniform, then compares


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
MIN_TEMPERATURE = 1e-5  # below it a row is greedy (as vLLM): logits / T would overflow float32

HIDDEN = "hidden"
LOGITS = "logits"
ACCEPTED = "accepted"
NEXT_TOKEN = "next_token"
DRAFT_TOKEN, DRAFT_PROB, HIDDEN_OUT = "draft_token", "draft_prob", "hidden_out"


def key_pool(layer: int | str) -> str:
    return f"key_pool.{layer}"


def value_pool(layer: int | str) -> str:
    return f"value_pool.{layer}"


def new_key(layer: int | str) -> str:
    return f"new_key.{layer}"


def new_value(layer: int | str) -> str:
    return f"new_value.{layer}"


def recurrent_pool(layer: int) -> str:
    return f"recurrent_pool.{layer}"


def conv_pool(layer: int) -> str:
    return f"conv_pool.{layer}"


def new_recurrent_state(layer: int) -> str:
    return f"new_recurrent_state.{layer}"


def new_conv_state(layer: int) -> str:
    return f"new_conv_state.{layer}"


def mtp_layer_name(head: int) -> str:
    """Pool names of MTP head `head` use this in place of a layer index: key_pool.mtp0."""
    return f"mtp{head}"


# ---- specs ------------------------------------------------------------------------------

def _paging_inputs() -> list[TensorSpec]:
    return [
        TensorSpec(CONTEXT_LENS, "int64", ("batch",), "committed tokens per sequence; row w is at position "
                                                      "context_lens + w"),
        TensorSpec(BLOCK_TABLES, "int64", ("batch", "max_pages"), "pool page of each committed page of a sequence"),
    ]


def _kv_specs(desc: ModelDescription, layer: int | str, dtype: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    a = desc.attention
    ins = [TensorSpec(key_pool(layer), dtype, ("num_pages", "page_size", a.num_kv_heads, a.head_dim),
                      "committed keys (post-RoPE), paged"),
           TensorSpec(value_pool(layer), dtype, ("num_pages", "page_size", a.num_kv_heads, a.head_dim),
                      "committed values, paged")]
    outs = [TensorSpec(new_key(layer), dtype, ("batch", "rows", a.num_kv_heads, a.head_dim),
                       "keys of the new rows (post-RoPE), to commit for accepted rows"),
            TensorSpec(new_value(layer), dtype, ("batch", "rows", a.num_kv_heads, a.head_dim),
                       "values of the new rows")]
    return ins, outs


def _trunk_layer_specs(desc: ModelDescription, dtype: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    g = desc.linear_attention
    ins, outs = [], []
    for i in desc.layer_indices(LayerKind.FULL_ATTENTION):
        kv_in, kv_out = _kv_specs(desc, i, dtype)
        ins += kv_in
        outs += kv_out
    for i in desc.layer_indices(LayerKind.LINEAR_ATTENTION):
        ins += [TensorSpec(recurrent_pool(i), "float32",
                           ("num_slots", g.num_value_heads, g.key_head_dim, g.value_head_dim),
                           "committed Gated DeltaNet states, one slot per sequence"),
                TensorSpec(conv_pool(i), dtype, ("num_slots", g.conv_dim, g.conv_kernel - 1),
                           "committed conv windows: the last K-1 conv inputs")]
        outs += [TensorSpec(new_recurrent_state(i), "float32",
                            ("batch", g.num_value_heads, g.key_head_dim, g.value_head_dim),
                            "state after the committed rows of this step"),
                 TensorSpec(new_conv_state(i), dtype, ("batch", g.conv_dim, g.conv_kernel - 1),
                            "conv window after the committed rows of this step")]
    if ins and desc.layer_indices(LayerKind.LINEAR_ATTENTION):
        ins.append(TensorSpec(STATE_SLOTS, "int64", ("batch",), "state-pool slot of each sequence"))
    return ins, outs


def target_step_io(desc: ModelDescription, dtype: str = "float32") -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Prefill chunk / decode: W rows per sequence -> hidden rows, logits, new K/V and states."""
    layer_in, layer_out = _trunk_layer_specs(desc, dtype)
    ins = [TensorSpec(INPUT_IDS, "int64", ("batch", "rows"), "token ids of the new rows"),
           *_paging_inputs(),
           TensorSpec(STATE_ROWS, "int64", ("batch",), "rows whose state to keep (1..W): later rows are padding"),
           *layer_in]
    outs = [TensorSpec(HIDDEN, dtype, ("batch", "rows", desc.hidden_size), "post-final-norm hidden of each row"),
            TensorSpec(LOGITS, "float32", ("batch", "rows", desc.vocab_size), "next-token logits of each row"),
            *layer_out]
    return ins, outs


def verify_step_io(desc: ModelDescription, dtype: str = "float32") -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Target over [pending, d_1..d_k] fused with acceptance; states kept after the accepted rows."""
    layer_in, layer_out = _trunk_layer_specs(desc, dtype)
    ins = [TensorSpec(INPUT_IDS, "int64", ("batch", "rows"), "[pending token, draft 1..k]"),
           *_paging_inputs(),
           TensorSpec(TEMPERATURE, "float32", ("batch",), "below MIN_TEMPERATURE: greedy; else sampling temperature"),
           TensorSpec(TOP_K, "int64", ("batch",), "top-k filter, 0 = off"),
           TensorSpec(TOP_P, "float32", ("batch",), "top-p filter, 1 = off"),
           TensorSpec(UNIFORMS, "float32", ("batch", "rows"), "uniform in [0,1) of the position row i's token fills"),
           *layer_in]
    outs = [TensorSpec(ACCEPTED, "int64", ("batch",), "drafts accepted (0..k); rows 0..accepted are committed"),
            TensorSpec(NEXT_TOKEN, "int64", ("batch",), "the token after the accepted ones (correction or bonus)"),
            TensorSpec(HIDDEN, dtype, ("batch", "rows", desc.hidden_size), "post-final-norm hidden of each row"),
            *layer_out]
    return ins, outs


def mtp_head_io(desc: ModelDescription, head: int, dtype: str = "float32") -> tuple[list[TensorSpec], list[TensorSpec]]:
    """One MTP head layer over R rows: row r pairs token t_{i+1} with hidden h_i (target or chained)."""
    kv_in, kv_out = _kv_specs(desc, mtp_layer_name(head), dtype)
    ins = [TensorSpec(INPUT_IDS, "int64", ("batch", "rows"), "token t_{i+1} of each row"),
           TensorSpec(HIDDEN_IN, dtype, ("batch", "rows", desc.hidden_size), "hidden h_i paired with each row"),
           *_paging_inputs(),
           TensorSpec(LAST_ROW, "int64", ("batch",), "the row whose draft and hidden to return"),
           *kv_in]
    outs = [TensorSpec(DRAFT_TOKEN, "int64", ("batch",), "greedy draft at last_row"),
            TensorSpec(DRAFT_PROB, "float32", ("batch",), "the head's probability of that draft"),
            TensorSpec(HIDDEN_OUT, dtype, ("batch", desc.hidden_size), "head hidden (after mtp.norm) at last_row"),
            *kv_out]
    return ins, outs


def graph_io(desc: ModelDescription, kind: GraphKind, dtype: str = "float32"
             ) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs and outputs of a graph kind for engines of `dtype`; the greedy verify graph takes no
    sampling inputs."""
    if kind.is_target_step:
        return target_step_io(desc, dtype)
    if kind.is_verify:
        ins, outs = verify_step_io(desc, dtype)
        if not kind.sampling:
            ins = [s for s in ins if s.name not in (TEMPERATURE, TOP_K, TOP_P, UNIFORMS)]
        return ins, outs
    return mtp_head_io(desc, kind.head, dtype)
