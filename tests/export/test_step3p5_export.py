"""Step-3.5 graphs == transformers (target step) and == the torch NextN reference (heads), fp32.

The target runs through paged pools with one block table per page group: the window-8 layers'
table points pages that fell out of the window at a scratch page full of garbage, so a layer
that ignored its window, or read the wrong group's table, would see it. Prompts are longer than
the window; prefill is one chunk, and decode feeds the same prompt one row at a time."""

from __future__ import annotations

import numpy as np
import pytest

from tandem import contract as c
from tandem.checkpoint import open_checkpoint
from tandem.checkpoint.description import AttentionSpec
from tandem.engines.buckets import Bucket, io_specs
from tandem.engines.options import BuildOptions
from tandem.engines.verification import fixed_inputs
from tandem.export.graphs import mtp_head, target_step, verify_step
from tandem.export.layers import Weights
from tandem.graph_kinds import TARGET_STEP, VERIFY_GREEDY, GraphKind
from tandem.testing.tiny_checkpoints import write_tiny_checkpoint

from ..paged_driver import PagedState, run_in_chunks, session

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.step3p7")

from tandem.checkpoint.families.step3p5 import reference as ref  # noqa: E402

TOL = 1e-4
PROMPTS = [[5, 17, 33, 200, 7, 64, 91, 12, 40, 41, 99, 150, 3, 77, 250, 8, 19, 301, 44, 2],
           [9, 120, 77, 301, 15, 2, 66, 180, 23, 5, 311, 4, 90]]


class WindowedState(PagedState):
    """PagedState with one table per page group, as the pipeline keeps them: each window group's
    pages are its own permutation, and a sequence's pages wholly before the window of its first
    new row point at a scratch page (garbage, as released pages do)."""

    def __init__(self, desc, batch, **kwargs):
        super().__init__(desc, batch, **kwargs)
        assert not self.state_pools(), "commit() below writes paged rows only"
        rng = np.random.default_rng(1)
        unused = np.setdiff1d(np.arange(self.pools[next(iter(self.pools))].shape[0]), self.tables)
        self.scratch = int(unused[0])
        pages = np.setdiff1d(np.arange(self.pools[next(iter(self.pools))].shape[0]), [self.scratch])
        self.groups = {w: self.tables if w is None else rng.permutation(pages)[: self.tables.size].reshape(
            self.tables.shape) for w in c.page_groups(self.caches)}

    def feeds(self, names) -> dict:
        out = super().feeds(names)
        page_first = np.arange(self.tables.shape[1]) * self.page
        for w, table in self.groups.items():
            if w is not None:
                table = table.copy()
                table[page_first[None, :] + self.page <= self.lens[:, None] - w + 1] = self.scratch  # slots <= p - w
            out[c.block_tables(w)] = table
        return {n: out[n] for n in names if n in out}

    def commit(self, out: dict, rows: np.ndarray, commit_states: bool = True) -> None:
        for cache in self.caches:
            for p in cache.paged:
                pool, new = self.pools[c.pool_input(p, c.layer_id(cache))], out[c.pool_output(p, c.layer_id(cache))]
                table = self.groups[p.window]
                for b in range(self.batch):
                    for w in range(int(rows[b])):
                        pos = int(self.lens[b]) + w
                        pool[table[b, pos // self.page], pos % self.page] = new[b, w]
        self.lens += rows


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    """(description, target session, head sessions, transformers target, NextN reference)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("step") / "step3p5", "step3p5")
    ckpt = open_checkpoint(folder)
    desc, w = ckpt.description, Weights(ckpt)
    target = ref.load_target(folder)
    heads = [session(mtp_head(desc, w, j)) for j in range(desc.mtp.num_layers)]
    yield desc, session(target_step(desc, w)), heads, target, ref.NextNReference(target, folder), w
    torch.set_num_threads(threads)


def test_the_tiny_description_has_every_feature_the_graphs_build(step):
    desc = step[0]
    attn = [x.mixer for x in desc.layers]
    assert {a.window for a in attn} == {None, 8} and all(a.head_gate and not a.output_gate for a in attn)
    assert len({(a.rotary_dim, a.rope_theta) for a in attn}) == 2 and len({a.num_heads for a in attn}) == 2
    assert desc.moe.router == "sigmoid" and desc.moe.score_correction_bias and desc.moe.routed_scaling_factor != 1
    assert any(x.swiglu_limit for x in desc.layers) and any(x.shared_swiglu_limit for x in desc.layers)
    assert desc.mtp.form == "nextn" and desc.mtp.own_lm_head and desc.mtp.anchor == "previous_head"
    assert all(isinstance(x.mixer, AttentionSpec) for x in desc.mtp.layers)


def _transformers_logits(target, prompt):
    with torch.no_grad():
        return target(input_ids=torch.tensor([prompt])).logits[0].numpy()


def _run(desc, sess, prompts, chunk):
    """Feed the prompts `chunk` rows per step (padded batch) and return each prompt's logits."""
    return run_in_chunks(WindowedState(desc, len(prompts), pages_per_seq=8), sess, prompts, chunk)[c.LOGITS]


@pytest.mark.parametrize("chunk", [max(map(len, PROMPTS)), 1], ids=["prefill", "decode"])
def test_target_logits_match_transformers_past_the_window(step, chunk):
    desc, sess, _, target, _, _ = step
    for prompt, logits in zip(PROMPTS, _run(desc, sess, PROMPTS, chunk), strict=True):
        assert len(prompt) > 8
        assert np.abs(logits - _transformers_logits(target, prompt)).max() < TOL


def test_chained_nextn_heads_match_the_reference_with_their_own_lm_heads(step):
    """Full recomputation: head j runs over every row of the sequence rolled j+1 tokens, each row
    paired with head j-1's hidden of the row before (g^-1 = the target's); rows split in two steps
    over the head's paged KV. Every row's hidden and the draft (token, probability) at each row."""
    desc, _, heads, target, nextn, _ = step
    prompt = PROMPTS[0]
    with torch.no_grad():
        h = target.model(input_ids=torch.tensor([prompt])).last_hidden_state[0]      # [P, H]
    t_next = int(target.lm_head(h[-1]).argmax())
    tokens, hidden = prompt[1:] + [t_next], h.numpy()
    positions = torch.arange(1, len(prompt) + 1)
    n, split = len(tokens), 11     # the second step's rows see the first's through the pools
    for j, sess in enumerate(heads):
        with torch.no_grad():
            g_ref, logits_ref = nextn.head_step(j, torch.tensor(tokens), torch.from_numpy(hidden), positions,
                                                own_head=True)
        state = WindowedState(desc, 1, kv_layers=[c.mtp_layer_name(j)], pages_per_seq=8)
        rows = []
        for lo, hi in ((0, split), (split, n)):
            feed = {c.INPUT_IDS: np.array([tokens[lo:hi]]), c.HIDDEN_IN: hidden[None, lo:hi]}
            for last in range(hi - lo):
                out = state.run(sess, {**feed, c.LAST_ROW: np.array([last])})
                assert out[c.DRAFT_TOKEN][0] == int(logits_ref[lo + last].argmax())
                p_ref = torch.softmax(logits_ref[lo + last], -1).max().item()
                assert abs(out[c.DRAFT_PROB][0] - p_ref) < TOL
                assert np.abs(out[c.HIDDEN_OUT][0] - g_ref[lo + last].numpy()).max() < TOL
            assert np.abs(out[c.HIDDEN_ROWS][0] - g_ref[lo:hi].numpy()).max() < TOL
            rows.append(out[c.HIDDEN_ROWS][0])
            state.commit(out, np.array([hi - lo]), commit_states=False)
        draft = int(out[c.DRAFT_TOKEN][0])
        tokens, hidden, positions = tokens[1:] + [draft], np.concatenate(rows), positions + 1


def test_build_verification_feeds_every_input_of_every_graph(step):
    """The build's fixed inputs cover each graph's page-group tables, and the graphs run on them
    (the head outputs every row's hidden for the next head)."""
    desc, target, heads, _, _, w = step
    sessions = {TARGET_STEP: target, VERIFY_GREEDY: session(verify_step(desc, w, sampling=False)),
                **{GraphKind.mtp_head(j): s for j, s in enumerate(heads)}}
    for kind, sess in sessions.items():
        feeds = fixed_inputs(desc, Bucket(kind, 2, 3), BuildOptions(page_size=4))
        assert set(feeds) == {s.name for s in io_specs(desc, kind)}
        assert {c.BLOCK_TABLES, c.block_tables(8)} & set(feeds)
        outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
        assert all(np.isfinite(v).all() for v in outs.values())
        if kind.is_head:
            assert outs[c.HIDDEN_ROWS].shape == (2, 3, desc.hidden_size)
