"""The runtime-owned memory: the pools every layer's cache specs declare (paged rows per
attention layer and per MTP head, states per slot for recurrent layers), and the commits that
write accepted rows and states into them.

Shapes and sizes come from the description's cache specs (checkpoint/cache_specs.py) and the
contract's pool names; nothing here knows a layer type. A byte budget sizes the pools: every
paged pool of the target and the heads is counted per page, every state pool per slot. Pools
whose spec leaves the dtype open are in the engines' dtype (float32 or float16); the others
keep theirs (Gated DeltaNet recurrent states: float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem import contract as c
from tandem.checkpoint.cache_specs import page_bytes, slot_bytes
from tandem.checkpoint.description import ModelDescription


@dataclass(frozen=True)
class PoolSizes:
    num_pages: int
    num_slots: int
    page_bytes: int
    slot_bytes: int


def plan_pools(desc: ModelDescription, page_size: int, budget_bytes: int, max_seqs: int, mtp_layers: int,
               dtype_bytes: int = 4) -> PoolSizes:
    """Slots for max_seqs sequences (+ scratch); every remaining byte of the budget for pages."""
    caches = desc.layer_caches(mtp_layers)
    per_page, per_slot = page_bytes(caches, page_size, dtype_bytes), slot_bytes(caches, dtype_bytes)
    num_slots = max_seqs + 1
    left = budget_bytes - num_slots * per_slot
    num_pages = left // per_page if per_page else 2
    if num_pages < 2:
        raise ValueError(f"a memory budget of {budget_bytes / 2**20:.1f} MiB does not hold {max_seqs} sequences' "
                         f"states ({num_slots * per_slot / 2**20:.1f} MiB) and 2 KV pages; raise the budget")
    return PoolSizes(int(num_pages), num_slots, per_page, per_slot)


class Pools:
    """paged[layer][name]: [num_pages, page_size, *row]; states[layer][name]: [num_slots, *state].
    `layer` is the contract's layer id (trunk index, or mtp_layer_name(j) for head j)."""

    def __init__(self, desc: ModelDescription, sizes: PoolSizes, page_size: int, mtp_layers: int,
                 dtype: str = "float32"):
        self.page_size = page_size
        self.paged: dict[int | str, dict[str, np.ndarray]] = {}
        self.states: dict[int | str, dict[str, np.ndarray]] = {}
        self._specs = {}  # layer -> its cache specs, for the contract names
        for cache in desc.layer_caches(mtp_layers):
            layer = c.layer_id(cache)
            if cache.head and cache.states:  # the rounds commit states after trunk steps only
                names = ", ".join(s.name for s in cache.states)
                raise ValueError(f"MTP head {cache.layer} declares state pools ({names}); the pipeline keeps states "
                                 "for trunk layers only")
            self._specs[layer] = cache
            if cache.paged:
                self.paged[layer] = {p.name: np.zeros((sizes.num_pages, page_size, *p.row_shape), p.dtype_for(dtype))
                                     for p in cache.paged}
            if cache.states:
                self.states[layer] = {s.name: np.zeros((sizes.num_slots, *s.shape), s.dtype_for(dtype))
                                      for s in cache.states}
        self.trunk_paged = [layer for layer, cache in self._specs.items() if cache.paged and not cache.head]

    def feeds(self, layers) -> dict[str, np.ndarray]:
        """The paged pools of `layers` under their contract input names (bound once, never copied)."""
        return {c.pool_input(p, layer): self.paged[layer][p.name] for layer in layers for p in self._specs[layer].paged}

    def state_feeds(self) -> dict[str, np.ndarray]:
        return {c.pool_input(s, layer): self.states[layer][s.name]
                for layer in self.states for s in self._specs[layer].states}

    def write_rows(self, layers, outputs: dict[str, np.ndarray], batch_rows: np.ndarray, counts: np.ndarray,
                   starts: np.ndarray, tables: list[list[int]]) -> None:
        """For each batch row b (pool order), write new rows [0, counts[b]) at positions
        starts[b] + w. One fancy-indexed assignment per pool, no loops over rows."""
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
            for p in self._specs[layer].paged:
                self.paged[layer][p.name][pages, offsets] = outputs[c.pool_output(p, layer)][b_idx, w_idx]

    def commit_states(self, outputs: dict[str, np.ndarray], batch_rows: np.ndarray, slots: np.ndarray) -> None:
        for layer, pools in self.states.items():
            for s in self._specs[layer].states:
                pools[s.name][slots] = outputs[c.pool_output(s, layer)][batch_rows]

    def clear_slot(self, slot: int) -> None:
        for pools in self.states.values():
            for pool in pools.values():
                pool[slot] = 0.0
