"""The runtime's pools: the pools every layer's cache specs declare (paged rows per attention
layer and per MTP head, states per slot for recurrent layers), and the commits that write
accepted rows and states into them. The backend owns the memory (engines/backends/memory.py):
each pool is one allocation made through it, and a commit sends it two int64 index vectors per
pool (destination pool row, source output row); the rows themselves never pass through here.

Shapes and sizes come from the description's cache specs (checkpoint/cache_specs.py) and the
contract's pool names; nothing here knows a layer type. A byte budget sizes the pools: every
paged pool of the target and the heads is counted per page, every state pool per slot. Pools
whose spec leaves the dtype open are in the engines' dtype (float32 or float16); the others
keep theirs (Gated DeltaNet recurrent states: float32).

Page groups (contract.page_groups; pipeline/allocator.py): each group's pools have their own
page count, and a page's bytes count only that group's pools. One sequence of a sliding-window
group w keeps positions min_context - lag - w + 1 .. committed + rows - 1 (rows: the most rows one
step writes, a prefill chunk or a verify width; lag: how far the heads' contexts may trail the
target's), a span of n = w + rows + lag - 1 positions, which touches at most
floor((n + S - 2) / S) + 1 pages. plan_pools gives the group exactly that for max_seqs sequences
plus the scratch page, and every byte left to the full-attention group; a model with window
groups only splits what is left over them in proportion to their bytes per page.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem import contract as c
from tandem.checkpoint.cache_specs import LayerCache, page_bytes, slot_bytes
from tandem.checkpoint.description import ModelDescription
from tandem.engines.backends.memory import HostMemory, rows_view
from tandem.pipeline.allocator import group_tables


@dataclass(frozen=True)
class GroupSize:
    window: int | None      # None: full attention
    num_pages: int          # including the scratch page
    page_bytes: int         # one page across this group's pools


@dataclass(frozen=True)
class PoolSizes:
    groups: tuple[GroupSize, ...]   # contract.page_groups order: full attention first
    num_slots: int
    slot_bytes: int

    @property
    def num_pages(self) -> int:
        """The first group's pages (full attention when the model has any)."""
        return self.groups[0].num_pages

    @property
    def page_bytes(self) -> int:
        return self.groups[0].page_bytes

    def pages(self) -> dict[int | None, int]:
        """Pages per group, keyed by window."""
        return {g.window: g.num_pages for g in self.groups}


def window_pages(window: int, page_size: int, rows: int, lag: int) -> int:
    """The most pages of a window-w group one sequence holds: see the module docstring."""
    return (window + rows + lag - 1 + page_size - 2) // page_size + 1


def plan_pools(desc: ModelDescription, page_size: int, budget_bytes: int, max_seqs: int, mtp_layers: int,
               dtype_bytes: int = 4, rows: int = 1) -> PoolSizes:
    """Slots for max_seqs sequences (+ scratch); window groups' pages for max_seqs sequences
    writing up to `rows` rows a step (+ scratch); every remaining byte of the budget for the
    full-attention group (or split over the window groups by bytes per page if there is none)."""
    caches = desc.layer_caches(mtp_layers)
    per_slot, num_slots = slot_bytes(caches, dtype_bytes), max_seqs + 1
    windows = c.page_groups(caches) or [None]
    per_page = {w: page_bytes([LayerCache(x.layer, tuple(p for p in x.paged if p.window == w), x.head) for x in caches],
                              page_size, dtype_bytes) for w in windows}
    pages = {w: max_seqs * window_pages(w, page_size, rows, mtp_layers) + 1 for w in windows if w is not None}
    left = budget_bytes - num_slots * per_slot - sum(n * per_page[w] for w, n in pages.items())
    if None in windows:
        pages[None] = left // per_page[None] if per_page[None] else 2
    elif left > 0:  # window groups only: what is left, in proportion to bytes per page
        extra = left // sum(per_page.values())
        pages = {w: n + extra for w, n in pages.items()}
    if min(pages.values()) < 2 or left < 0:
        window_mib = sum(n * per_page[w] for w, n in pages.items() if w is not None) / 2**20
        raise ValueError(f"a memory budget of {budget_bytes / 2**20:.1f} MiB does not hold {max_seqs} sequences' "
                         f"states ({num_slots * per_slot / 2**20:.1f} MiB)"
                         + (f", their sliding-window KV pages ({window_mib:.1f} MiB)" if window_mib else "")
                         + (" and 2 KV pages" if None in windows else "") + "; raise the budget")
    return PoolSizes(tuple(GroupSize(w, int(pages[w]), per_page[w]) for w in windows), num_slots, per_slot)


class Pools:
    """paged[layer][name]: [num_pages, page_size, *row]; states[layer][name]: [num_slots, *state].
    `layer` is the contract's layer id (trunk index, or mtp_layer_name(j) for head j)."""

    def __init__(self, desc: ModelDescription, sizes: PoolSizes, page_size: int, mtp_layers: int,
                 dtype: str = "float32", memory=None, snapshots: int = 0):
        """memory: the backend runner's memory (allocate / scatter / zero_row); host numpy by default.
        snapshots: rows of the state snapshot pools (the prefix cache's recurrent states at a prefix
        end, pipeline/prefix_cache.py), one per state pool, beside the slots."""
        self.page_size = page_size
        self.memory = memory if memory is not None else HostMemory()
        alloc = self.memory.allocate
        self.paged: dict[int | str, dict[str, np.ndarray]] = {}
        self.states: dict[int | str, dict[str, np.ndarray]] = {}
        self._specs = {}  # layer -> its cache specs, for the contract names
        self._decode_plans: dict[tuple, _DecodeCommit] = {}   # (layers, n) -> the last bucket's plan
        self._row_plans: dict[tuple, _RowsCommit] = {}        # layers -> the last call's plan
        self._state_pairs: dict[int, tuple] = {}              # id(outputs) -> (outputs, state pool pairs)
        pages = sizes.pages()  # per page group
        for cache in desc.layer_caches(mtp_layers):
            layer = c.layer_id(cache)
            if cache.head and cache.states:  # the rounds commit states after trunk steps only
                names = ", ".join(s.name for s in cache.states)
                raise ValueError(f"MTP head {cache.layer} declares state pools ({names}); the pipeline keeps states "
                                 "for trunk layers only")
            self._specs[layer] = cache
            if cache.paged:
                self.paged[layer] = {p.name: alloc(c.pool_input(p, layer), (pages[p.window], page_size, *p.row_shape),
                                                   p.dtype_for(dtype)) for p in cache.paged}
            if cache.states:
                self.states[layer] = {s.name: alloc(c.pool_input(s, layer), (sizes.num_slots, *s.shape),
                                                    s.dtype_for(dtype)) for s in cache.states}
        self.trunk_paged = [layer for layer, cache in self._specs.items() if cache.paged and not cache.head]
        # snapshot row r of every state pool, and the pairs that copy between it and the slots
        self.snapshots = snapshots if self.states else 0
        self._snap_pairs = [(rows_view(alloc(f"snapshot.{c.pool_input(s, layer)}", (snapshots, *s.shape),
                                             pools[s.name].dtype), 1), rows_view(pools[s.name], 1))
                            for layer, pools in self.states.items() for s in self._specs[layer].states
                            if self.snapshots]
        self._page_pairs: dict[int | None, list] = {}   # window -> (pool, pool) [rows, row] views of its group
        self.snapshot_bytes = sum(snap[0].nbytes for snap, _ in self._snap_pairs)   # one snapshot row

    def memory_bytes(self) -> int:
        """Bytes of every pool together."""
        return sum(a.nbytes for d in (self.paged, self.states) for x in d.values() for a in x.values())

    def feeds(self, layers) -> dict[str, np.ndarray]:
        """The paged pools of `layers` under their contract input names (bound once, never copied)."""
        return {c.pool_input(p, layer): self.paged[layer][p.name] for layer in layers for p in self._specs[layer].paged}

    def state_feeds(self) -> dict[str, np.ndarray]:
        return {c.pool_input(s, layer): self.states[layer][s.name]
                for layer in self.states for s in self._specs[layer].states}

    def output_names(self, layers) -> set[str]:
        """The engine outputs the commits read for `layers` (they stay with the backend)."""
        return ({c.pool_output(p, layer) for layer in layers for p in self._specs[layer].paged}
                | {c.pool_output(s, layer) for layer in layers for s in self._specs[layer].states})

    def state_outputs(self) -> dict[str, np.ndarray]:
        """Each state pool under the name of the engine output that holds its new rows."""
        return {c.pool_output(s, layer): self.states[layer][s.name]
                for layer in self.states for s in self._specs[layer].states}

    def write_rows(self, layers, outputs: dict, batch_rows, counts, starts, tables: list) -> None:
        """For each batch row b (pool order), write new rows [0, counts[b]) at positions
        starts[b] + w, into the pages of each pool's group: `tables` holds each sequence's
        `seq.table.pages` (every group's table) or a plain list (one table for every group).
        A sequence's rows are contiguous in the output (row b x W + w) and, within a page, in the
        pool (page x S + offset): one run per (sequence, page it touches), copied into every pool
        of the page group by one memory.scatter_runs (the pools and outputs as [rows, row] views
        made once per bucket, _RowsCommit)."""
        plan = self._row_plans.get(tuple(layers))
        if plan is None or plan.outputs is not outputs:
            plan = self._row_plans[tuple(layers)] = _RowsCommit(self, layers, outputs)
        size = self.page_size
        for (name, width), pairs in plan.paged.items():
            runs = []
            for b, n, start, pages in zip(batch_rows, counts, starts, tables):
                table = (group_tables(pages) or {}).get(name, pages)
                n, pos, src = int(n), int(start), int(b) * width
                while n > 0:            # split where the rows cross into the next page
                    logical, offset = divmod(pos, size)
                    m = min(n, size - offset)
                    runs.append((table[logical] * size + offset, src, m))
                    n, pos, src = n - m, pos + m, src + m
            if runs:
                self.memory.scatter_runs(pairs, runs)

    def commit_decode(self, layers, outputs: dict, inputs: dict, n: int, burst: dict | None = None,
                      step: int = 0) -> None:
        """Plain decoding's commit, from the call's own inputs: each of its n sequences wrote one
        row at position context_lens[b], into the page its block table holds there, and its
        states go to state_slots[b]. The index work is a few vector ops for the whole batch, and
        the pools and outputs come as [rows, row] views made once per bucket (_DecodeCommit).
        `burst`: burst_destinations() of the burst this call is step `step` of (its rows' pool rows
        worked out once for the whole burst)."""
        plan = self._decode_plan(layers, outputs, n)
        size = self.page_size
        if burst is not None:   # (no index work: burst_destinations made it)
            for table, pairs in plan.paged.items():
                self.memory.scatter_many(pairs, burst[table][step], None)
        elif n == 1:    # batch 1: integer arithmetic into a kept index array, no array temporaries
            logical, offset = divmod(int(inputs[c.CONTEXT_LENS][0]), size)
            for table, pairs in plan.paged.items():
                plan.dst[0] = inputs[table][0, logical] * size + offset
                self.memory.scatter_many(pairs, plan.dst, None)
        else:
            positions = inputs[c.CONTEXT_LENS][:n]
            logical, offsets = positions // size, positions % size
            for table, pairs in plan.paged.items():
                self.memory.scatter_many(pairs, inputs[table][plan.rows, logical] * size + offsets, None)
        if plan.states:
            self.memory.scatter_many(plan.states, inputs[c.STATE_SLOTS][:n], None)

    def decode_copies(self, layers, outputs: dict, inputs: dict, n: int
                      ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, bool]]:
        """commit_decode's copies, for a burst's native step (pipeline/native_burst.py): (pool
        [rows, row], output [n, row], index, paged): a paged pool's rows are at the call's context
        lengths in the pages of its block-table input `index`; a state pool not written in place
        goes to the slots `index`."""
        plan = self._decode_plan(layers, outputs, n)
        copies = [(pool, out, inputs[table], True) for table, pairs in plan.paged.items() for pool, out in pairs]
        return copies + [(pool, out, inputs[c.STATE_SLOTS], False) for pool, out in plan.states]

    def _decode_plan(self, layers, outputs: dict, n: int) -> _DecodeCommit:
        plan = self._decode_plans.get((tuple(layers), n))
        if plan is None or plan.outputs is not outputs:
            plan = self._decode_plans[(tuple(layers), n)] = _DecodeCommit(self, layers, outputs, n)
        return plan

    def burst_destinations(self, layers, inputs: dict, n: int, steps: int) -> dict[str, np.ndarray]:
        """Per block-table name, the pool rows [steps, n] a burst of `steps` decode calls from these
        inputs writes: step s of row b is position context_lens[b] + s, in the page the row's table
        holds there (the scheduler reserved the burst's pages before it began). One vector
        computation per burst instead of one per call."""
        positions = inputs[c.CONTEXT_LENS][:n] + np.arange(steps)[:, None]
        logical, offsets = np.divmod(positions, self.page_size)
        tables = {c.block_tables(p.window) for layer in layers for p in self._specs[layer].paged}
        return {table: np.ascontiguousarray(inputs[table][np.arange(n), logical] * self.page_size + offsets)
                for table in tables}

    def commit_states(self, outputs: dict, batch_rows: np.ndarray, slots: np.ndarray) -> None:
        """Every state pool's row slots[i] <- the output's row batch_rows[i]: one scatter_many for
        all state pools, over [rows, row] views made once per bucket."""
        if not self.states:
            return
        pairs = self._state_pairs.get(id(outputs))
        if pairs is None or pairs[0] is not outputs:
            if len(self._state_pairs) > 64:       # a backend handing back new outputs per call: keep few
                self._state_pairs.clear()
            pairs = self._state_pairs[id(outputs)] = (outputs, _unplaced([
                (rows_view(pools[s.name], 1), rows_view(outputs[c.pool_output(s, layer)], 1))
                for layer, pools in self.states.items() for s in self._specs[layer].states]))
        self.memory.scatter_many(pairs[1], np.asarray(slots, np.int64), np.asarray(batch_rows, np.int64))

    @property
    def snapshot_pools(self) -> int:
        """Allocations the snapshot rows take (one per state pool; none without snapshots)."""
        return len(self._snap_pairs)

    def snapshot(self, slot: int, row: int) -> None:
        """Snapshot row `row` <- every state pool's slot `slot` (the states after a prefix)."""
        self.memory.scatter_many([(snap, pool) for snap, pool in self._snap_pairs], np.array([row], np.int64),
                                 np.array([slot], np.int64))

    def restore(self, row: int, slot: int) -> None:
        """Every state pool's slot `slot` <- snapshot row `row`."""
        self.memory.scatter_many([(pool, snap) for snap, pool in self._snap_pairs], np.array([slot], np.int64),
                                 np.array([row], np.int64))

    def copy_page_rows(self, window: int | None, src_page: int, dst_page: int, rows: int) -> None:
        """Positions [0, rows) of page `dst_page` <- those of `src_page`, in every paged pool of the page
        group (target layers and heads): a shared page's written part, for a sequence that writes on."""
        pairs = self._page_pairs.get(window)
        if pairs is None:
            pairs = self._page_pairs[window] = [(v, v) for layer, pools in self.paged.items()
                                                for p in self._specs[layer].paged if p.window == window
                                                for v in (rows_view(pools[p.name], 2),)]
        self.memory.scatter_runs(pairs, [(dst_page * self.page_size, src_page * self.page_size, rows)])

    def clear_slot(self, slot: int) -> None:
        for pools in self.states.values():
            for pool in pools.values():
                self.memory.zero_row(pool, slot)


class _RowsCommit:
    """write_rows' pairs for one call's outputs: per (block-table name, output width W), (pool as
    [pages x S, row], output as [B x W, row]) for each paged pool of the layers in that page group.
    Kept while the same outputs come back (the runner's output views are made once per bucket)."""

    def __init__(self, pools: Pools, layers, outputs: dict):
        self.outputs = outputs
        self.paged: dict[tuple[str, int], list] = {}
        for layer in layers:
            for p in pools._specs[layer].paged:
                out = outputs[c.pool_output(p, layer)]                       # [B, W, *row]
                self.paged.setdefault((c.block_tables(p.window), out.shape[1]), []).append(
                    (rows_view(pools.paged[layer][p.name], 2), rows_view(out, 2)))


class _DecodeCommit:
    """commit_decode's pairs for one call's outputs (one bucket, n sequences): per block-table
    name, (pool as [pages x S, row], output as [n, row]) for each paged pool of the layers in that
    page group; (pool as [slots, row], output as [n, row]) per state pool. Kept while the same
    outputs come back."""

    def __init__(self, pools: Pools, layers, outputs: dict, n: int):
        self.outputs, self.rows = outputs, np.arange(n, dtype=np.int64)
        self.dst = np.zeros(1, np.int64)    # batch 1's pool row, rewritten per page group
        specs = pools._specs
        self.paged: dict[str, list] = {}
        for layer in layers:
            for p in specs[layer].paged:
                self.paged.setdefault(c.block_tables(p.window), []).append(
                    (rows_view(pools.paged[layer][p.name], 2), rows_view(outputs[c.pool_output(p, layer)], 2)))
        self.states = _unplaced([(rows_view(pool[s.name], 1), rows_view(outputs[c.pool_output(s, layer)], 1))
                                 for layer, pool in pools.states.items() for s in specs[layer].states])


def _unplaced(pairs: list) -> list:
    """The (pool, output) pairs left to copy: an output the engine wrote into its pool's rows
    (ModelRunner._place_states) is committed already."""
    return [(pool, out) for pool, out in pairs if not np.may_share_memory(pool, out)]
