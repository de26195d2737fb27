"""The runtime-owned memory: paged K/V pools per attention layer and per MTP head, Gated
DeltaNet state pools per slot, and the commits that write accepted rows into them.

Sizes come from a byte budget: the KV of every target attention layer and every MTP head is
counted per page, the states per slot. K/V and conv pools are in the engines' dtype (float32 or
float16); Gated DeltaNet recurrent states are always float32 (the contract's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem import contract as c
from tandem.checkpoint.description import LayerKind, ModelDescription


@dataclass(frozen=True)
class PoolSizes:
    num_pages: int
    num_slots: int
    page_bytes: int
    slot_bytes: int


def plan_pools(desc: ModelDescription, page_size: int, budget_bytes: int, max_seqs: int, mtp_layers: int,
               dtype_bytes: int = 4) -> PoolSizes:
    """Slots for max_seqs sequences (+ scratch); every remaining byte of the budget for pages."""
    a, g = desc.attention, desc.linear_attention
    kv_layers = len(desc.layer_indices(LayerKind.FULL_ATTENTION)) + mtp_layers
    page_bytes = kv_layers * 2 * page_size * a.num_kv_heads * a.head_dim * dtype_bytes
    gdn = len(desc.layer_indices(LayerKind.LINEAR_ATTENTION))
    slot_bytes = gdn * (g.num_value_heads * g.key_head_dim * g.value_head_dim * 4
                        + g.conv_dim * (g.conv_kernel - 1) * dtype_bytes)
    num_slots = max_seqs + 1
    left = budget_bytes - num_slots * slot_bytes
    num_pages = left // page_bytes if page_bytes else 2
    if num_pages < 2:
        raise ValueError(f"a memory budget of {budget_bytes / 2**20:.1f} MiB does not hold {max_seqs} sequences' "
                         f"states ({num_slots * slot_bytes / 2**20:.1f} MiB) and 2 KV pages; raise the budget")
    return PoolSizes(int(num_pages), num_slots, page_bytes, slot_bytes)


class Pools:
    def __init__(self, desc: ModelDescription, sizes: PoolSizes, page_size: int, mtp_layers: int,
                 dtype: str = "float32"):
        a, g = desc.attention, desc.linear_attention
        self.page_size = page_size
        kv_shape = (sizes.num_pages, page_size, a.num_kv_heads, a.head_dim)
        layers = [*desc.layer_indices(LayerKind.FULL_ATTENTION), *(c.mtp_layer_name(j) for j in range(mtp_layers))]
        self.keys = {layer: np.zeros(kv_shape, dtype) for layer in layers}
        self.values = {layer: np.zeros(kv_shape, dtype) for layer in layers}
        self.gdn_layers = desc.layer_indices(LayerKind.LINEAR_ATTENTION)
        self.recurrent = {i: np.zeros((sizes.num_slots, g.num_value_heads, g.key_head_dim, g.value_head_dim),
                                      np.float32) for i in self.gdn_layers}
        self.conv = {i: np.zeros((sizes.num_slots, g.conv_dim, g.conv_kernel - 1), dtype)
                     for i in self.gdn_layers}

    def feeds(self, layers) -> dict[str, np.ndarray]:
        """The pool arrays under their contract input names (bound once, never copied)."""
        out = {}
        for layer in layers:
            out[c.key_pool(layer)], out[c.value_pool(layer)] = self.keys[layer], self.values[layer]
        return out

    def state_feeds(self) -> dict[str, np.ndarray]:
        out = {}
        for i in self.gdn_layers:
            out[c.recurrent_pool(i)], out[c.conv_pool(i)] = self.recurrent[i], self.conv[i]
        return out

    def write_rows(self, layers, outputs: dict[str, np.ndarray], batch_rows: np.ndarray, counts: np.ndarray,
                   starts: np.ndarray, tables: list[list[int]]) -> None:
        """For each batch row b (pool order), write new K/V rows [0, counts[b]) at positions
        starts[b] + w. One fancy-indexed assignment per layer, no loops over rows."""
        b_idx, w_idx, pages, offsets = [], [], [], []
        for b, n, start, table in zip(batch_rows, counts, starts, tables):
            pos = start + np.arange(n)
            b_idx.append(np.full(n, b))
            w_idx.append(np.arange(n))
            pages.append(np.asarray(table, np.int64)[pos // self.page_size])
            offsets.append(pos % self.page_size)
        if not b_idx:
            return
        b_idx, w_idx = np.concatenate(b_idx), np.concatenate(w_idx)
        pages, offsets = np.concatenate(pages), np.concatenate(offsets)
        for layer in layers:
            self.keys[layer][pages, offsets] = outputs[c.new_key(layer)][b_idx, w_idx]
            self.values[layer][pages, offsets] = outputs[c.new_value(layer)][b_idx, w_idx]

    def commit_states(self, outputs: dict[str, np.ndarray], batch_rows: np.ndarray, slots: np.ndarray) -> None:
        for i in self.gdn_layers:
            self.recurrent[i][slots] = outputs[c.new_recurrent_state(i)][batch_rows]
            self.conv[i][slots] = outputs[c.new_conv_state(i)][batch_rows]

    def clear_slot(self, slot: int) -> None:
        for i in self.gdn_layers:
            self.recurrent[i][slot] = 0.0
            self.conv[i][slot] = 0.0
