"""A minimal test-only driver for the exported graphs: paged pools, sequential page
allocation, and the commit of accepted rows. The real block allocator and scheduler live in
tandem.pipeline; this keeps export tests independent of them."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from tandem import contract as c
from tandem.checkpoint.description import ModelDescription
from tandem.engines.backends.onnxruntime_backend import session as backend_session


def session(model) -> ort.InferenceSession:
    return backend_session(model)


class PagedState:
    """Pools for `batch` sequences, pages handed out in order; commit() writes accepted rows.
    Pools of the trunk's layers, or of `kv_layers` (contract layer ids, e.g. an MTP head's)."""

    def __init__(self, desc: ModelDescription, batch: int, page_size: int = 4, pages_per_seq: int = 16,
                 kv_layers: list | None = None, seed: int = 0):
        self.desc, self.batch, self.page = desc, batch, page_size
        n_pages = batch * pages_per_seq + 3
        rng = np.random.default_rng(seed)
        caches = desc.layer_caches(0 if kv_layers is None else None)
        self.caches = [cache for cache in caches if kv_layers is None or c.layer_id(cache) in kv_layers]
        slots = batch + 2
        self.pools = {}   # contract input name -> pool
        for cache in self.caches:
            for p in cache.paged:  # garbage in unused pages: reading past context_lens would show up in results
                shape = (n_pages, page_size, *p.row_shape)
                self.pools[c.pool_input(p, c.layer_id(cache))] = rng.standard_normal(shape).astype(np.float32)
            for s in cache.states:
                self.pools[c.pool_input(s, c.layer_id(cache))] = np.zeros((slots, *s.shape), np.float32)
        perm = rng.permutation(n_pages)[: batch * pages_per_seq]       # scattered pages
        self.tables = perm.reshape(batch, pages_per_seq).astype(np.int64)
        self.slots = np.arange(2, 2 + batch, dtype=np.int64)             # not 0..B-1 on purpose
        self.lens = np.zeros(batch, np.int64)

    @property
    def kv_layers(self) -> list:
        return [c.layer_id(cache) for cache in self.caches if cache.paged]

    def state_pools(self) -> dict[str, np.ndarray]:
        return {c.pool_input(s, c.layer_id(cache)): self.pools[c.pool_input(s, c.layer_id(cache))]
                for cache in self.caches for s in cache.states}

    def feeds(self, names) -> dict:
        f = {c.CONTEXT_LENS: self.lens.copy(), c.BLOCK_TABLES: self.tables, c.STATE_SLOTS: self.slots, **self.pools}
        # every page group (block_tables.window{w}) reads the same table: the driver's pools are all of one size
        f.update({n: self.tables for n in names if n.startswith(c.BLOCK_TABLES + ".")})
        return {n: f[n] for n in names if n in f}

    def commit(self, out: dict, rows: np.ndarray, commit_states: bool = True) -> None:
        """Write paged rows [0, rows[b]) of each sequence and its new states."""
        for cache in self.caches:
            layer = c.layer_id(cache)
            for p in cache.paged:
                pool, new = self.pools[c.pool_input(p, layer)], out[c.pool_output(p, layer)]
                for b in range(self.batch):
                    for w in range(int(rows[b])):
                        pos = int(self.lens[b]) + w
                        pool[self.tables[b, pos // self.page], pos % self.page] = new[b, w]
            for s in cache.states if commit_states else ():
                self.pools[c.pool_input(s, layer)][self.slots] = out[c.pool_output(s, layer)]
        self.lens += rows

    def run(self, sess: ort.InferenceSession, extra: dict) -> dict:
        names = [i.name for i in sess.get_inputs()]
        shape = extra[c.INPUT_IDS].shape if c.INPUT_IDS in extra else None
        off = {**relaxed_off(shape), **grammar_off(shape, self.desc.vocab_size), **processors_off(shape)
               } if shape is not None else {}
        feeds = {**self.feeds(names), **off, **extra}
        feeds = {k: v for k, v in feeds.items() if k in names}
        return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))


def prefilled(desc: ModelDescription, target: ort.InferenceSession, prompts: list[list[int]]
              ) -> tuple[PagedState, np.ndarray]:
    """Pools after one padded prefill call over `prompts` (committed), and each prompt's greedy next token."""
    state = PagedState(desc, len(prompts))
    ids = np.zeros((len(prompts), max(map(len, prompts))), np.int64)
    rows = np.array([len(p) for p in prompts], np.int64)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    out = state.run(target, {c.INPUT_IDS: ids, c.STATE_ROWS: rows})
    state.commit(out, rows)
    return state, np.array([out[c.LOGITS][b, rows[b] - 1].argmax() for b in range(len(prompts))])


def run_in_chunks(state: PagedState, sess: ort.InferenceSession, prompts: list[list[int]], chunk: int,
                  outputs: tuple[str, ...] = (c.LOGITS,)) -> dict[str, list[np.ndarray]]:
    """Feed the prompts `chunk` rows per call (a padded batch), committing each call's rows: output
    name -> per prompt, that output's rows over the whole prompt ([len(prompt), ...])."""
    got = {name: [[] for _ in prompts] for name in outputs}
    for lo in range(0, max(map(len, prompts)), chunk):
        rows = np.array([max(0, min(chunk, len(p) - lo)) for p in prompts], np.int64)
        ids = np.zeros((len(prompts), chunk), np.int64)
        for b, p in enumerate(prompts):
            ids[b, : rows[b]] = p[lo: lo + rows[b]]
        out = state.run(sess, {c.INPUT_IDS: ids, c.STATE_ROWS: np.maximum(rows, 1)})
        state.commit(out, rows)
        for name in outputs:
            for b in range(len(prompts)):
                got[name][b].append(out[name][b, : rows[b]])
    return {name: [np.concatenate(x) for x in per_prompt] for name, per_prompt in got.items()}


def function_body_graphs(folder) -> tuple[ModelDescription, ort.InferenceSession, ort.InferenceSession,
                                          ort.InferenceSession]:
    """(description, target step, greedy verify, sampled verify) of a checkpoint, exported and run
    as their function bodies (no lowering)."""
    from tandem.checkpoint import open_checkpoint
    from tandem.export.graphs import target_step, verify_step
    from tandem.export.layers import Weights

    ckpt = open_checkpoint(folder)
    w, d = Weights(ckpt), ckpt.description
    return d, session(target_step(d, w)), session(verify_step(d, w, False)), session(verify_step(d, w, True))


def grammar_off(shape: tuple[int, int], vocab_size: int) -> dict[str, np.ndarray]:
    """The verify graphs' grammar mask for ids of `shape`, every token allowed."""
    return {c.TOKEN_BITMASK: np.full((*shape, c.mask_words(vocab_size)), -1, np.int32)}


def processors_off(shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """Verify inputs for rows without logits processors: identity edits of token 0, min-p off."""
    return {c.LOGIT_EDIT_IDS: np.zeros((*shape, 1), np.int64),
            c.LOGIT_EDITS: np.tile(np.array([0.0, 1.0, 0.0], np.float32), (*shape, 1, 1)),
            c.MIN_P_LOG: np.full(shape[0], -np.inf, np.float32), c.WANT_LOGPROBS: np.zeros(shape[0], np.int64)}


def relaxed_off(shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """The verify graphs' relaxed-acceptance inputs for ids of `shape`, turned off (exact acceptance)."""
    return {c.RELAXED_TOPK: np.zeros(shape[0], np.int64), c.RELAXED_DELTA: np.zeros(shape[0], np.float32),
            c.RELAXED_ROWS: np.zeros(shape, np.int64)}
