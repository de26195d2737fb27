"""Exported graphs == transformers (target) and == the torch MTP reference (heads), fp32."""

from __future__ import annotations

import numpy as np
import pytest

from tandem import contract as c
from tandem.checkpoint import open_checkpoint
from tandem.export.graphs import mtp_head, target_step
from tandem.export.layers import Weights
from tandem.testing.tiny_checkpoints import TINY_KINDS

from ..paged_driver import PagedState, session

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TOL = 1e-4
PROMPTS = [[5, 17, 33, 200, 7, 64, 91, 12, 250, 3, 44], [9, 120, 77, 301, 15, 2]]


@pytest.fixture(scope="module")
def exported(tiny_root):
    out = {}
    for kind in TINY_KINDS:
        ckpt = open_checkpoint(tiny_root / kind)
        w = Weights(ckpt)
        heads = [session(mtp_head(ckpt.description, w, j)) for j in range(ckpt.description.mtp.num_layers)]
        out[kind] = (ckpt.description, session(target_step(ckpt.description, w)), heads)
    return out


@pytest.fixture(scope="module")
def references(torch_references):
    return torch_references


def hf_forward(ref, tokens):
    text_model, lm_head, _ = ref
    with torch.no_grad():
        h = text_model(input_ids=torch.tensor([tokens])).last_hidden_state
        return h[0].numpy(), lm_head(h)[0].numpy()


def run_chunks(desc, sess, prompts, chunks):
    """Feed each prompt in the given chunk sizes (padded batch); return per-prompt logits/hidden."""
    state = PagedState(desc, len(prompts))
    logits = [[] for _ in prompts]
    hidden = [[] for _ in prompts]
    done = [0] * len(prompts)
    for size in chunks:
        rows = np.array([max(0, min(size, len(p) - d)) for p, d in zip(prompts, done, strict=True)], np.int64)
        if rows.max() == 0:
            break
        ids = np.zeros((len(prompts), size), np.int64)
        for b, p in enumerate(prompts):
            ids[b, : rows[b]] = p[done[b] : done[b] + rows[b]]
        out = state.run(sess, {c.INPUT_IDS: ids, c.STATE_ROWS: np.maximum(rows, 1)})
        # a sequence with no rows this step keeps its state: commit nothing for it
        state.commit(out, rows, commit_states=True) if rows.min() > 0 else _commit_some(state, out, rows)
        for b in range(len(prompts)):
            logits[b].append(out[c.LOGITS][b, : rows[b]])
            hidden[b].append(out[c.HIDDEN][b, : rows[b]])
            done[b] += int(rows[b])
    return [np.concatenate(x) for x in logits], [np.concatenate(x) for x in hidden]


def _commit_some(state, out, rows):
    keep = {name: pool[state.slots].copy() for name, pool in state.state_pools().items()}
    state.commit(out, rows)
    for name, saved in keep.items():
        for b in np.flatnonzero(rows == 0):
            state.pools[name][state.slots[b]] = saved[b]


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_target_logits_match_transformers_on_every_row(exported, references, kind):
    desc, sess, _ = exported[kind]
    logits, hidden = run_chunks(desc, sess, PROMPTS, [16])
    for b, prompt in enumerate(PROMPTS):
        ref_h, ref_logits = hf_forward(references[kind], prompt)
        assert np.abs(logits[b] - ref_logits).max() < TOL
        assert np.abs(hidden[b] - ref_h).max() < TOL


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_chunked_prefill_then_decode_equals_one_forward(exported, kind):
    desc, sess, _ = exported[kind]
    full, _ = run_chunks(desc, sess, PROMPTS, [16])
    # chunks of 3 and 4 (padding where a prompt runs out), then single-row decode steps
    chunked, _ = run_chunks(desc, sess, PROMPTS, [3, 4] + [1] * 10)
    for b in range(len(PROMPTS)):
        assert np.abs(chunked[b] - full[b]).max() < TOL


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_mtp_heads_match_the_torch_reference(exported, references, kind):
    desc, _, heads = exported[kind]
    text_model, lm_head, ref = references[kind]
    tokens = PROMPTS[0]
    with torch.no_grad():
        h = text_model(input_ids=torch.tensor([tokens])).last_hidden_state       # [1, T, H]
    rows_tok, rows_h = tokens[1:], h[:, :-1]                                      # row i: (t_{i+1}, h_i)
    n = len(rows_tok)
    for j, sess in enumerate(heads):
        with torch.no_grad():
            g_ref, logits_ref = ref(torch.tensor([rows_tok]), rows_h, layer=j,
                                    positions=torch.arange(n)[None])            # slot i at position i
        state = PagedState(desc, 1, kv_layers=[c.mtp_layer_name(j)])
        split = 4  # commit rows 0..3, then run rows 4.. on top of the paged KV
        for lo, hi in ((0, split), (split, n)):
            out = state.run(sess, {c.INPUT_IDS: np.array([rows_tok[lo:hi]]), c.HIDDEN_IN: rows_h[:, lo:hi].numpy(),
                                   c.LAST_ROW: np.array([hi - lo - 1])})
            assert np.abs(out[c.HIDDEN_OUT][0] - g_ref[0, hi - 1].numpy()).max() < TOL
            assert out[c.DRAFT_TOKEN][0] == int(logits_ref[0, hi - 1].argmax())
            p_ref = torch.softmax(logits_ref[0, hi - 1], -1).max().item()
            assert abs(out[c.DRAFT_PROB][0] - p_ref) < TOL
            state.commit(out, np.array([hi - lo]), commit_states=False)


def test_chunked_gdn_body_gives_the_same_target_step(tiny_root, exported):
    desc, sess, _ = exported["qwen3_next"]
    ckpt = open_checkpoint(tiny_root / "qwen3_next")
    chunked = session(target_step(desc, Weights(ckpt), gdn_chunk_size=4))
    a, _ = run_chunks(desc, sess, PROMPTS, [7, 16])
    b, _ = run_chunks(desc, chunked, PROMPTS, [7, 16])
    for x, y in zip(a, b):
        assert np.abs(x - y).max() < TOL


@pytest.mark.parametrize("chained", [True, False])
def test_head_graphs_reproduce_reference_drafting(exported, references, chained):
    """Re-anchor every head over the prompt rows (t_{i+1}, h_i), then draft k tokens: step s runs
    head s % n (chained) or head 0 (reused) over (d_1, g_0) .. (d_s, g_{s-1}) on top of its KV."""
    from tandem.checkpoint.families.qwen_hybrid.reference import greedy_draft

    desc, target, heads = exported["qwen3_5_mtp3"]
    text_model, lm_head, ref = references["qwen3_5_mtp3"]
    tokens, k = PROMPTS[0], 3
    t_next_ref, drafts_ref = greedy_draft(text_model, lm_head, ref, tokens, k, chained=chained)

    state = PagedState(desc, 1)
    n = len(tokens)
    out = state.run(target, {c.INPUT_IDS: np.array([tokens]), c.STATE_ROWS: np.array([n])})
    hidden, t_next = out[c.HIDDEN], int(out[c.LOGITS][0, -1].argmax())
    assert t_next == t_next_ref
    used = list(range(len(heads))) if chained else [0]
    head_state = {}
    for j in used:  # re-anchor (process): rows (t_{i+1}, h_i), i = 0..n-1, all committed
        st = PagedState(desc, 1, kv_layers=[c.mtp_layer_name(j)])
        o = st.run(heads[j], {c.INPUT_IDS: np.array([tokens[1:] + [t_next]]), c.HIDDEN_IN: hidden,
                              c.LAST_ROW: np.array([n - 1])})
        st.commit(o, np.array([n]), commit_states=False)
        head_state[j] = st
        if j == 0:
            drafts, chain_h = [int(o[c.DRAFT_TOKEN][0])], [o[c.HIDDEN_OUT][0]]
    for s in range(1, k):
        j = s % len(heads) if chained else 0
        o = head_state[j].run(heads[j], {c.INPUT_IDS: np.array([drafts]), c.HIDDEN_IN: np.stack(chain_h)[None],
                                         c.LAST_ROW: np.array([s - 1])})
        drafts.append(int(o[c.DRAFT_TOKEN][0]))
        chain_h.append(o[c.HIDDEN_OUT][0])
    assert drafts == drafts_ref


def test_attention_biases_match_transformers(tmp_path):
    """q/k/v/o biases (`attention_bias`) are part of the exported attention: a tiny Qwen3.5 with them
    gives transformers' logits; without the bias Adds the graph is the bias-free model's."""
    from tandem.checkpoint.families.qwen_hybrid.reference import load_target
    from tandem.testing.tiny_checkpoints import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "biased", "qwen3_5_mtp3", overrides={"attention_bias": True})
    ckpt = open_checkpoint(folder)
    desc = ckpt.description
    assert desc.layers[1].mixer.bias and desc.layers[1].mixer.o_bias
    logits, hidden = run_chunks(desc, session(target_step(desc, Weights(ckpt))), PROMPTS, [16])
    ref = load_target(folder)
    for b, prompt in enumerate(PROMPTS):
        ref_h, ref_logits = hf_forward(ref, prompt)
        assert np.abs(logits[b] - ref_logits).max() < TOL
        assert np.abs(hidden[b] - ref_h).max() < TOL
