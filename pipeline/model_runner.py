"""Turns sequences' rows into engine calls: picks the bucket, fills its preallocated buffers in
place, runs, and hands back views of the outputs. The one place that knows tensor layouts.

A call with n sequences runs at the smallest built batch size >= n (more than the largest are
split); padding rows point at the scratch page and slot and are never committed. The block
table width is the batch's page count rounded up to a power of two, so attention gathers only
pages that may hold context. A graph takes one block table per page group its pools belong to
(contract.page_groups); all have the same logical length, so one width serves them all, and
each is filled from the sequence's table of that group (`seq.table.pages.tables`; a plain list
of pages fills every table alike).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tandem import contract as c
from tandem.checkpoint.description import ModelDescription
from tandem.graph_kinds import TARGET_STEP, GraphKind
from tandem.pipeline.allocator import SCRATCH, group_tables
from tandem.pipeline.pools import Pools


@dataclass
class Rows:
    """One sequence's part of a call."""

    ids: list[int]
    context: int                # committed positions before these rows
    pages: list[int]            # seq.table.pages (every page group's table) or one plain table for all
    slot: int = SCRATCH
    state_rows: int = 0         # target step: rows whose state to keep (default: all)
    hidden: np.ndarray | None = None   # heads: [R, H] hidden paired with each row
    last_row: int = -1          # heads: the row whose draft to return (default: last)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    uniforms: np.ndarray | None = None
    relaxed_topk: int = 0                  # verify: relaxed acceptance (pipeline/relaxed.py), 0 = off
    relaxed_delta: float = 0.0
    relaxed_rows: list[int] | None = None  # 1 where row i may relax
    bitmask: np.ndarray | None = None      # verify, heads: grammar masks [n, words] (pipeline/grammar.py); None: all
    edits: tuple[np.ndarray, np.ndarray] | None = None  # verify, heads: logit edits, ids [n, N], values [n, N, 3]
    min_p_log: float = -np.inf             # verify, sampled rows: log(min_p) (-inf: off)
    logprobs: bool = False                 # verify: report the rows' log-probabilities


@dataclass
class Outputs:
    """One call's outputs: name -> [n, ...] for its n sequences, as views of the bound buffers
    (valid until the same bucket runs again). Commits read `arrays` directly: no copies."""

    arrays: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def row(self, i: int) -> dict[str, np.ndarray]:
        return {name: arr[i] for name, arr in self.arrays.items()}

    def rows(self):
        return (self.row(i) for i in range(len(self)))


FIRST_RUNS = 2      # an engine's calls that run slower than its steady ones (ModelRunner.first_runs)


def _consecutive(slots: np.ndarray | None) -> bool:
    """Whether a call's state slots are s, s + 1, ... (its states can be written into their pool rows)."""
    return slots is not None and (len(slots) == 1 or bool((slots[1:] - slots[:-1] == 1).all()))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class ModelRunner:
    def __init__(self, desc: ModelDescription, backend_runner, pools: Pools, files: dict[str, str],
                 batch_sizes: list[int], max_pages: int, mtp_layers: int, dtype: str = "float32"):
        self.desc, self.runner, self.pools = desc, backend_runner, pools
        self.dtype = dtype                      # engine dtype: which contract specs to bind
        self.files = files                      # engine key (GraphKind.engine_key) -> engine file
        self.batch_sizes = sorted(batch_sizes)
        self.max_pages = max_pages
        self.max_positions = max_pages * pools.page_size   # rows past it have no block-table entry
        self.trunk_kv = pools.trunk_paged
        self.fixed = {**pools.feeds(self.trunk_kv), **pools.state_feeds()}
        self.head_fixed = {j: pools.feeds([c.mtp_layer_name(j)]) for j in range(mtp_layers)}
        # outputs only the commits read: they stay with the backend, never copied to the host
        self.backend_outputs = frozenset(pools.output_names([*pools.paged, *pools.states]))
        self._state_pools = pools.state_outputs()   # state output name -> its pool [slots, *state]
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}     # engine time per graph kind
        self.engine_seconds = 0.0
        # calls among an engine's FIRST_RUNS: ONNX Runtime's first run of a session took 4-11 ms more than
        # the shipped model's 1.3-1.7 ms round, its second 1.6 ms more (a new shape of a session that ran,
        # a batch size or a table's pages, 0.2-0.8 ms more), so the adaptive width does not take those
        # rounds' times as their width's cost
        self.first_runs = 0
        self._engine_runs: dict[str, int] = {}     # engine file -> its calls, up to FIRST_RUNS
        self._engine_of: dict[tuple, str] = {}     # binding key -> its engine file
        self._bindings: dict[tuple, object] = {}   # (graph kind, batch, width, pages) -> backend binding
        self._tables: dict[GraphKind, tuple[str, ...]] = {}
        self._io: dict[GraphKind, tuple] = {}      # graph kind -> its contract specs (a new binding's shapes)
        self._views: dict[tuple, tuple] = {}       # (binding key, n) -> (outputs, their first n rows)
        self._decode_fills: dict[tuple, list] = {}  # binding key -> what decode() last wrote per batch row
        self._consecutive: dict[tuple, bool | None] = {}   # binding key -> whether decode's slots are consecutive
        self._last_decode: tuple | None = None     # (binding key, binding, n, outputs, views) of the last decode()
        self._batch_for = [next((b for b in self.batch_sizes if b >= n), None) for n in range(self.batch_sizes[-1] + 1)]

    # ---- public calls ------------------------------------------------------------------
    # `commits`: the caller commits every sequence's output states to its slot after the call (the
    # engine does, after each call with states): the engine may then write them there itself
    # (_place_states). Without it a call leaves the pools as they were.
    def target_step(self, rows: list[Rows], commits: bool = False) -> Outputs:
        return self._call(TARGET_STEP, rows, self.fixed, commits)

    def verify(self, rows: list[Rows], sampling: bool, commits: bool = False) -> Outputs:
        return self._call(GraphKind.verify(sampling), rows, self.fixed, commits)

    def round(self, kind: GraphKind, rows: list[Rows], commits: bool = False) -> Outputs:
        """A unified round (export/round_graph.py): it reads the trunk's pools and every head's."""
        return self._call(kind, rows, {**self.fixed, **{k: v for f in self.head_fixed.values() for k, v in f.items()}},
                          commits)

    def decode_steps(self, kind: GraphKind, seqs: list) -> Outputs:
        """A multi-step decode call (export/decode_graph.py): each sequence's pending token in, the
        `kind.steps` greedy tokens after it out, with the rows and states to commit (the caller
        commits them: its states may be in their pools already, _place_states)."""
        rows = [Rows(ids=[s.tokens[-1]], context=s.committed, pages=s.table.pages, slot=s.slot) for s in seqs]
        return self._call(kind, rows, self.fixed, commits=True)

    def verify_has(self, name: str, width: int, sampling: tuple[bool, ...] = (False, True)) -> bool:
        """Whether the width-`width` verify engines (greedy, sampled or both) take input `name` (an optional
        one such as contract.TOKEN_BITMASK, which engines built before it lack); asks the smallest bucket's
        binding."""
        return all(name in self._binding(GraphKind.verify(s), self.batch_sizes[0], width, 1, self.fixed).inputs
                   for s in sampling if GraphKind.verify(s).engine_key(width) in self.files)

    def prefetch(self, kinds: list[tuple[GraphKind, int]]) -> None:
        """Have the backend open the engines of these (graph kind, rows) ahead of their first call."""
        keys = [kind.engine_key(rows) for kind, rows in kinds]
        self.runner.prefetch([self.files[k] for k in keys if k in self.files])

    def ready(self, kinds: list[tuple[GraphKind, int]], start: bool = True) -> bool:
        """Whether the engines of these (graph kind, rows) are open (an engine the dir lacks counts as
        ready: its call fails with its own message); `start`: begin opening the others in the
        background."""
        files = [self.files[k] for k in (kind.engine_key(rows) for kind, rows in kinds) if k in self.files]
        ready = self.runner.ready(files)
        if not ready and start:
            self.runner.prefetch(files)
        return ready

    def head(self, j: int, rows: list[Rows]) -> Outputs:
        return self._call(GraphKind.mtp_head(j), rows, self.head_fixed[j])

    def decode(self, seqs: list) -> tuple[Outputs, dict[str, np.ndarray]]:
        """The target step of plain decoding, one new token per sequence (its last), and the inputs
        it ran with (block tables and context lengths, for the commit, which the caller makes: its
        states may be in their pools already, _place_states). The lean path of the hot loop: while
        the same sequences decode in the same bucket, a step writes only each row's token and
        context, and a block-table row only when that sequence's tables changed (a new page, a
        window release, a preemption); no per-sequence objects are made."""
        n = len(seqs)
        if n > self.batch_sizes[-1]:        # split over several calls: the general path
            out = self.target_step([Rows(ids=[s.tokens[-1]], context=s.committed, pages=s.table.pages, slot=s.slot)
                                    for s in seqs], commits=True)
            return out, None
        pages = min(self.max_pages, _pow2(max(1, max(len(s.table.pages) for s in seqs))))
        key = (TARGET_STEP, self._batch_for[n], 1, pages)
        binding = self._binding(*key, self.fixed)
        buf, tables = binding.inputs, self._table_names(TARGET_STEP)
        # per batch row: (table version, state slot) last written; versions are unique to one table's
        # state in the process, so a row written for another sequence never matches
        written = self._decode_fills.get(key)
        if written is None or len(written) != n:
            self._fill(buf, [Rows(ids=[s.tokens[-1]], context=s.committed, pages=s.table.pages, slot=s.slot)
                             for s in seqs], key[1], 1, pages, tables)
            self._decode_fills[key] = [(s.table.version, s.slot) for s in seqs]
            self._consecutive[key] = None
        else:
            buf[c.INPUT_IDS][:n, 0] = [s.tokens[-1] for s in seqs]
            buf[c.CONTEXT_LENS][:n] = [s.committed for s in seqs]
            for b, (s, w) in enumerate(zip(seqs, written)):
                if s.table.version != w[0] or s.slot != w[1]:
                    self._fill_table_row(buf, b, s.table.pages, pages, tables)
                    if c.STATE_SLOTS in buf:
                        buf[c.STATE_SLOTS][b] = s.slot
                    if s.slot != w[1]:
                        self._consecutive[key] = None
                    written[b] = (s.table.version, s.slot)
        consecutive = self._consecutive.get(key)
        if consecutive is None:     # only when a row's slot changed: the slots' check is numpy work
            consecutive = self._consecutive[key] = _consecutive(buf.get(c.STATE_SLOTS))
        outputs = self._run(TARGET_STEP, binding, commits=True, consecutive=consecutive)
        views = self._first_rows(key, outputs, n)
        self._last_decode = (key, binding, n, outputs, views)
        return views, buf

    def decode_again(self) -> Outputs:
        """The last decode() call's bucket run again, after its caller wrote each row's next token
        and context into the inputs decode() handed back (a decode burst, pipeline/decode_burst.py:
        nothing else runs in between). Its rows' tables and slots are those decode() wrote, so the
        state placement decode() made holds: the call alone, timed, and the same views where the
        runner hands back the same arrays (a few µs less a call than _run on the tiny model)."""
        key, binding, n, outputs, views = self._last_decode
        t = time.perf_counter()
        again = self.runner.capture(binding)()
        elapsed = time.perf_counter() - t
        self.engine_seconds += elapsed
        self.seconds[TARGET_STEP.name] += elapsed
        self.calls[TARGET_STEP.name] += 1
        return views if again is outputs else self._first_rows(key, again, n)

    # ---- machinery ---------------------------------------------------------------------
    def _call(self, graph: GraphKind, rows: list[Rows], fixed: dict, commits: bool = False) -> Outputs:
        """Outputs as views of the bound buffers (valid until the same bucket runs again)."""
        parts = []
        largest = self.batch_sizes[-1]
        split = len(rows) > largest   # parts may share one binding: keep copies, not views
        for start in range(0, len(rows), largest):
            part = rows[start : start + largest]
            batch = next(b for b in self.batch_sizes if b >= len(part))
            width = max(len(r.ids) for r in part)
            pages = min(self.max_pages, _pow2(max(1, max(len(r.pages) for r in part))))
            # the edit lists' length, rounded up to a power of two (one binding per bucket of it)
            edits = _pow2(max((r.edits[0].shape[1] for r in part if r.edits is not None), default=1))
            binding = self._binding(graph, batch, width, pages, fixed, edits)
            # (a head without them drafts unedited; the target step's logits are edited on the host)
            if (graph != TARGET_STEP and not graph.is_head and c.LOGIT_EDIT_IDS not in binding.inputs
                    and any(r.edits is not None for r in part)):
                raise ValueError(f"{graph.name}: logit edits for an engine built before them; rebuild the engine dir "
                                 "(`tandem build-engines`), or run these requests without speculation")
            if (graph != TARGET_STEP and not graph.is_head and c.TOKEN_BITMASK not in binding.inputs
                    and any(r.bitmask is not None for r in part)):   # (a head without it drafts unmasked)
                raise ValueError(f"{graph.name}: a grammar mask for an engine built before grammar masks; rebuild the "
                                 "engine dir (`tandem build-engines`), or run grammar requests without speculation")
            self._decode_fills.pop((graph, batch, width, pages), None)   # decode() must refill it
            self._fill(binding.inputs, part, batch, width, pages, self._table_names(graph))
            outputs = self._run(graph, binding, commits)
            if not split:
                return self._first_rows((graph, batch, width, pages, edits), outputs, len(part))
            if not all(isinstance(a, np.ndarray) for a in outputs.values()):
                raise ValueError(f"{len(rows)} sequences in one call, more than the largest built batch ({largest}): "
                                 "outputs kept in device memory are not joined; set max_num_seqs <= the largest batch")
            parts.append({name: arr[: len(part)].copy() for name, arr in outputs.items()})
        # more sequences than the largest batch: the parts are copies (a later part may rerun the same binding)
        return Outputs({name: np.concatenate([p[name] for p in parts]) for name in parts[0]})

    def _run(self, graph: GraphKind, binding, commits: bool = False, consecutive: bool | None = None) -> dict:
        self._place_states(binding, commits, consecutive)
        t = time.perf_counter()
        outputs = self.runner.capture(binding)()
        elapsed = time.perf_counter() - t
        self.engine_seconds += elapsed
        self.seconds[graph.name] = self.seconds.get(graph.name, 0.0) + elapsed
        self.calls[graph.name] = self.calls.get(graph.name, 0) + 1
        return outputs

    def _place_states(self, binding, commits: bool, consecutive: bool | None = None) -> None:
        """State outputs written straight into their pools' rows when the call's slots are
        consecutive (batch 1 always; a batch whose rows hold slots s..s+B-1) and the caller `commits`
        them: the commit then has nothing to copy (150M model, batch 8: 36 MB of Gated DeltaNet
        states a step). The engine commits every output state to its slot after each call
        (pipeline/round_loop.py), so writing them there during the call is that commit, made earlier; a
        call that does not commit (a probe) keeps the binding's own buffers. A padded batch holds
        the scratch slot in its padding rows, is not consecutive, and keeps them too. The graph
        reads a layer's pool (its Gather of the slots' rows) before it writes that layer's new
        state. Backends whose bindings cannot place outputs skip this. `consecutive`: whether the
        slots are, where the caller knows (decode keeps it while its rows' slots stay)."""
        place = getattr(binding, "place_outputs", None)
        slots = binding.inputs.get(c.STATE_SLOTS) if place is not None and self._state_pools else None
        if slots is None:
            return
        first, n = int(slots[0]), len(slots)
        if not commits or not (_consecutive(slots) if consecutive is None else consecutive):
            place(None, None)
        else:
            place((first, n), lambda: {name: pool[first : first + n] for name, pool in self._state_pools.items()})

    def _first_rows(self, key: tuple, outputs: dict, n: int) -> Outputs:
        """The outputs' first n rows, as views made once per bucket and n (the buffers are fixed)."""
        source, views = self._views.get((key, n), (None, None))
        if source is not outputs:   # a backend that hands back new arrays per call gets new views
            views = Outputs({name: arr[:n] for name, arr in outputs.items()})
            self._views[(key, n)] = (outputs, views)
        return views

    def _table_names(self, graph: GraphKind) -> tuple[str, ...]:
        """The block-table inputs of `graph`, one per page group of its pools."""
        names = self._tables.get(graph)
        if names is None:
            caches = (self.desc.head_cache(graph.head),) if graph.is_head else self.desc.layer_caches(mtp_layers=0)
            names = self._tables[graph] = tuple(c.block_tables(w) for w in c.page_groups(caches) or [None])
        return names

    def _binding(self, graph: GraphKind, batch, width, pages, fixed, edits: int = 1):
        """The bucket's binding; its shapes are worked out from the contract once, on its first call."""
        key = (graph, batch, width, pages) if edits == 1 else (graph, batch, width, pages, edits)
        binding = self._bindings.get(key)
        if binding is None:
            binding = self._bindings[key] = self._new_binding(graph, batch, width, pages, fixed, edits)
            self._engine_of[key] = self.files[graph.engine_key(width)]
        engine = self._engine_of[key]
        runs = self._engine_runs.get(engine, 0)
        if runs < FIRST_RUNS:       # (every caller of _binding runs the binding once)
            self._engine_runs[engine] = runs + 1
            self.first_runs += 1
        return binding

    def _new_binding(self, graph: GraphKind, batch, width, pages, fixed, edits: int = 1):
        dims = {"batch": batch, "rows": width, "drafts": width - 1, "steps": graph.steps, "max_pages": pages,
                "edits": edits}
        shape = lambda spec: tuple(dims.get(d, d) if isinstance(d, str) else d for d in spec.shape)  # noqa: E731
        io = self._io.get(graph)
        if io is None:
            io = self._io[graph] = c.graph_io(self.desc, graph, self.dtype)
        ins, outs = io
        ins = {s.name: shape(s) for s in ins if s.name not in fixed}
        outs = {s.name: shape(s) for s in outs}
        bucket = (batch, width, pages) if edits == 1 else (batch, width, pages, edits)
        return self.runner.binding(self.files[graph.engine_key(width)], bucket, ins, outs, fixed,
                                   backend_outputs=self.backend_outputs)

    def _fill(self, buf: dict[str, np.ndarray], part: list[Rows], batch: int, width: int, pages: int,
              tables: tuple[str, ...] = (c.BLOCK_TABLES,)) -> None:
        ids = buf[c.INPUT_IDS]
        ids.fill(0)
        buf[c.CONTEXT_LENS].fill(0)
        for name in tables:
            buf[name].fill(SCRATCH)
        for name, value in ((c.STATE_SLOTS, SCRATCH), (c.STATE_ROWS, 1), (c.LAST_ROW, 0), (c.TEMPERATURE, 0.0),
                            (c.TOP_K, 0), (c.TOP_P, 1.0), (c.UNIFORMS, 0.5), (c.HIDDEN_IN, 0.0),
                            (c.RELAXED_TOPK, 0), (c.RELAXED_DELTA, 0.0), (c.RELAXED_ROWS, 0), (c.TOKEN_BITMASK, -1),
                            (c.LOGIT_EDIT_IDS, 0), (c.LOGIT_EDITS, 0.0), (c.MIN_P_LOG, -np.inf), (c.WANT_LOGPROBS, 0)):
            if name in buf:
                buf[name].fill(value)
        if c.LOGIT_EDITS in buf:
            buf[c.LOGIT_EDITS][..., 1] = 1.0      # every row edits token 0 by nothing
        for b, r in enumerate(part):
            n = len(r.ids)
            if r.context + n > self.max_positions:   # (invariant: the scheduler and round_k keep rows inside)
                raise ValueError(f"rows up to position {r.context + n - 1} passed the block tables' "
                                 f"{self.max_positions} positions")
            ids[b, :n] = r.ids
            buf[c.CONTEXT_LENS][b] = r.context
            self._fill_table_row(buf, b, r.pages, pages, tables)
            if c.STATE_SLOTS in buf:
                buf[c.STATE_SLOTS][b] = r.slot
            if c.STATE_ROWS in buf:
                buf[c.STATE_ROWS][b] = r.state_rows or n
            if c.HIDDEN_IN in buf:
                buf[c.HIDDEN_IN][b, :n] = r.hidden
                buf[c.LAST_ROW][b] = r.last_row if r.last_row >= 0 else n - 1
            if c.TEMPERATURE in buf:
                buf[c.TEMPERATURE][b], buf[c.TOP_K][b], buf[c.TOP_P][b] = r.temperature, r.top_k, r.top_p
                buf[c.UNIFORMS][b, :n] = r.uniforms
            if c.RELAXED_TOPK in buf and r.relaxed_topk:   # engines built before relaxed acceptance lack it
                buf[c.RELAXED_TOPK][b], buf[c.RELAXED_DELTA][b] = r.relaxed_topk, r.relaxed_delta
                buf[c.RELAXED_ROWS][b, :n] = r.relaxed_rows
            if r.bitmask is not None and c.TOKEN_BITMASK in buf:   # the target step's logits are masked on the host
                buf[c.TOKEN_BITMASK][b, : len(r.bitmask)] = r.bitmask
            if r.edits is not None and c.LOGIT_EDIT_IDS in buf:
                edit_ids, values = r.edits      # the bucket's longer lists repeat each row's first entry
                rows, m = edit_ids.shape
                buf[c.LOGIT_EDIT_IDS][b, :rows] = edit_ids[:, :1]
                buf[c.LOGIT_EDITS][b, :rows] = values[:, :1]
                buf[c.LOGIT_EDIT_IDS][b, :rows, :m], buf[c.LOGIT_EDITS][b, :rows, :m] = edit_ids, values
            if c.MIN_P_LOG in buf:
                buf[c.MIN_P_LOG][b] = r.min_p_log
            if r.logprobs and c.WANT_LOGPROBS in buf:
                buf[c.WANT_LOGPROBS][b] = 1

    @staticmethod
    def _fill_table_row(buf: dict[str, np.ndarray], b: int, pages, width: int, tables: tuple[str, ...]) -> None:
        """Batch row b of every block-table input: the sequence's pages, SCRATCH past them."""
        by_name = group_tables(pages)
        for name in tables:
            table = pages if by_name is None else by_name[name]
            row = buf[name][b]
            row.fill(SCRATCH)
            row[: min(len(table), width)] = table[:width]
