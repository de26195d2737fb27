"""A minimal test-only driver for the exported graphs: paged pools, sequential page
allocation, and the commit of accepted rows. The real block allocator and scheduler live in
tandem.pipeline; this keeps export tests independent of them."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from tandem import contract as c
from tandem.checkpoint.description import LayerKind, ModelDescription
from tandem.engines.backends.onnxruntime_backend import session as backend_session


def session(model) -> ort.InferenceSession:
    return backend_session(model)


class PagedState:
    """Pools for `batch` sequences, pages handed out in order; commit() writes accepted rows."""

    def __init__(self, desc: ModelDescription, batch: int, page_size: int = 4, pages_per_seq: int = 16,
                 kv_layers: list | None = None, seed: int = 0):
        a, g = desc.attention, desc.linear_attention
        self.desc, self.batch, self.page = desc, batch, page_size
        n_pages = batch * pages_per_seq + 3
        rng = np.random.default_rng(seed)
        # garbage in unused pages: reading past context_lens would show up in results
        pool = lambda: rng.standard_normal((n_pages, page_size, a.num_kv_heads, a.head_dim)).astype(np.float32)  # noqa
        layers = kv_layers if kv_layers is not None else desc.layer_indices(LayerKind.FULL_ATTENTION)
        self.kv = {i: (pool(), pool()) for i in layers}
        self.gdn_layers = [] if kv_layers is not None else desc.layer_indices(LayerKind.LINEAR_ATTENTION)
        slots = batch + 2
        self.rec = {i: np.zeros((slots, g.num_value_heads, g.key_head_dim, g.value_head_dim), np.float32)
                    for i in self.gdn_layers}
        self.conv = {i: np.zeros((slots, g.conv_dim, g.conv_kernel - 1), np.float32) for i in self.gdn_layers}
        perm = rng.permutation(n_pages)[: batch * pages_per_seq]       # scattered pages
        self.tables = perm.reshape(batch, pages_per_seq).astype(np.int64)
        self.slots = np.arange(2, 2 + batch, dtype=np.int64)             # not 0..B-1 on purpose
        self.lens = np.zeros(batch, np.int64)

    def feeds(self, names) -> dict:
        f = {c.CONTEXT_LENS: self.lens.copy(), c.BLOCK_TABLES: self.tables, c.STATE_SLOTS: self.slots}
        for i, (k, v) in self.kv.items():
            f[c.key_pool(i)], f[c.value_pool(i)] = k, v
        for i in self.gdn_layers:
            f[c.recurrent_pool(i)], f[c.conv_pool(i)] = self.rec[i], self.conv[i]
        return {n: f[n] for n in names if n in f}

    def commit(self, out: dict, rows: np.ndarray, commit_states: bool = True) -> None:
        """Write K/V of rows [0, rows[b]) of each sequence and its new states."""
        for i, (kp, vp) in self.kv.items():
            nk, nv = out[c.new_key(i)], out[c.new_value(i)]
            for b in range(self.batch):
                for w in range(int(rows[b])):
                    pos = int(self.lens[b]) + w
                    page = self.tables[b, pos // self.page]
                    kp[page, pos % self.page], vp[page, pos % self.page] = nk[b, w], nv[b, w]
        if commit_states:
            for i in self.gdn_layers:
                self.rec[i][self.slots] = out[c.new_recurrent_state(i)]
                self.conv[i][self.slots] = out[c.new_conv_state(i)]
        self.lens += rows

    def run(self, sess: ort.InferenceSession, extra: dict) -> dict:
        names = [i.name for i in sess.get_inputs()]
        feeds = {**self.feeds(names), **{k: v for k, v in extra.items() if k in names}}
        return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
