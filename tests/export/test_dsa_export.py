"""DeepSeek-V3.2 / GLM-5 target graphs == transformers (fp32), through paged pools.

The tiny checkpoints keep the indexer's top 8 positions and the prompts are 20 and 13 tokens, so
most rows attend to a strict subset of their context; prefill is one chunk, decode one row at a
time, and a 3-row chunking sits between. The indexer's selection is read from the exported graph
itself (its LightningIndexer outputs exposed) and compared with transformers' for every layer."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from tandem import contract as c
from tandem.checkpoint import open_checkpoint
from tandem.checkpoint.families.deepseek_dsa.tiny import DSA_KINDS
from tandem.export.graphs import target_step
from tandem.export.ops import lightning_indexer
from tandem.export.primitives import Weights
from tandem.testing.tiny_checkpoints import write_tiny_checkpoint

from ..paged_driver import PagedState, run_in_chunks, session

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
TOP_K = 8
PROMPTS = [[5, 17, 33, 200, 7, 64, 91, 12, 40, 41, 99, 150, 3, 77, 250, 8, 19, 301, 44, 2],
           [9, 120, 77, 301, 15, 2, 66, 180, 23, 5, 311, 4, 90]]
KINDS = ("deepseek_v32", "glm_moe_dsa")


def with_selections(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """The graph with every LightningIndexer's `selected` [B, W, top_k] as an extra output (layer order)."""
    names = [n.output[0] for n in model.graph.node if n.op_type == lightning_indexer.OP_TYPE]
    model.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.INT64, None) for n in names)
    return model, names


@pytest.fixture(scope="module", params=KINDS)
def dsa(request, tmp_path_factory):
    """(kind, description, target session with selections, their names, transformers model, checkpoint)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    kind = request.param
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("dsa") / kind, kind)
    ckpt = open_checkpoint(folder)
    model, selections = with_selections(target_step(ckpt.description, Weights(ckpt)))
    reference = getattr(transformers, DSA_KINDS[kind][0]).from_pretrained(folder, dtype=torch.float32).eval()
    yield kind, ckpt.description, session(model), selections, reference, ckpt
    torch.set_num_threads(threads)


def transformers_run(reference, prompt: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Logits [P, V] and each indexer's top-k [P, top_k] (layers with an indexer, in order)."""
    picked = []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda _m, _i, out: picked.append(out[0].numpy()))
             for layer in reference.model.layers if getattr(layer.self_attn, "indexer", None) is not None]
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([prompt])).logits[0].numpy()
    for h in hooks:
        h.remove()
    return logits, picked


def run_chunks(desc, sess, selections, prompts, chunk):
    """Feed the prompts `chunk` rows per step (padded batch) -> each prompt's logits [P, V] and
    selections per indexer [P, top_k]."""
    got = run_in_chunks(PagedState(desc, len(prompts), pages_per_seq=8), sess, prompts, chunk,
                        (c.LOGITS, *selections))
    return got[c.LOGITS], [[got[name][b] for name in selections] for b in range(len(prompts))]


def test_the_tiny_models_exercise_every_feature(dsa):
    kind, desc, _, selections, _, _ = dsa
    reuse = [x.mixer.indexer.reuse_previous for x in desc.layers]
    assert len(selections) == reuse.count(False) and (kind == "glm_moe_dsa") == any(reuse)
    assert (desc.moe.n_group > 1) == (kind == "deepseek_v32") and not desc.norm_zero_centred
    assert all(x.mixer.indexer.topk == TOP_K for x in desc.all_layers) and min(map(len, PROMPTS)) > TOP_K


@pytest.mark.parametrize("chunk", [20, 3, 1], ids=["prefill", "chunks", "decode"])
def test_target_logits_and_selections_equal_transformers(dsa, chunk):
    """Logits within 1e-4 at every row; each indexer's selected set == transformers' (positions past
    the row are masked in transformers' scores, so its top-k lists them only when the row sees
    fewer than top_k positions)."""
    _, desc, sess, selections, reference, _ = dsa
    logits, picked = run_chunks(desc, sess, selections, PROMPTS, chunk)
    for prompt, ours, sel in zip(PROMPTS, logits, picked, strict=True):
        want, theirs = transformers_run(reference, prompt)
        assert np.abs(ours - want).max() < TOL
        assert len(theirs) == len(sel)
        for mine, their in zip(sel, theirs, strict=True):
            for pos in range(len(prompt)):
                expected = {int(t) for t in their[pos] if t <= pos}
                assert {int(t) for t in mine[pos] if t >= 0} == expected, pos
                assert len(expected) == min(TOP_K, pos + 1)


def test_sparsity_changes_the_output(dsa):
    """The same model attending densely gives other logits: the match above depends on top-k."""
    reference = dsa[4]
    want, _ = transformers_run(reference, PROMPTS[0])
    for layer in reference.model.layers:
        if getattr(layer.self_attn, "indexer", None) is not None:
            layer.self_attn.indexer.index_topk = 10 ** 6
    try:
        dense, _ = transformers_run(reference, PROMPTS[0])
    finally:
        for layer in reference.model.layers:
            if getattr(layer.self_attn, "indexer", None) is not None:
                layer.self_attn.indexer.index_topk = TOP_K
    assert np.abs(dense[:TOP_K] - want[:TOP_K]).max() < 1e-5       # rows that see <= top_k positions
    assert np.abs(dense[TOP_K:] - want[TOP_K:]).max() > 1e-2


def test_tensorrt_keeps_the_sparse_mla_attention_as_its_function_body(dsa):
    """The TensorRT plugin kernel ignores select_new_rows: MLA's attention nodes must not be tagged
    for it (the parser then inlines their function body); the indexer has no plugin either."""
    from tandem.plugins.tensorrt_plugins import mark_for_plugins

    desc, ckpt = dsa[1], dsa[5]
    marked = mark_for_plugins(target_step(desc, Weights(ckpt)))
    attention = [n for n in marked.graph.node if n.op_type == "PagedSparseAttention"]
    assert len(attention) == desc.num_layers
    assert not any(a.name == "plugin_namespace" for n in marked.graph.node for a in n.attribute)


def dequantized_copy(src, dst):
    """The fp8 checkpoint with each block-quantized weight dequantized by torch (float32 weight times
    its 128x128 block's scale_inv) and the quantization_config dropped: what transformers loads."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    stored = load_file(dst / "model.safetensors")
    out = {}
    for name, t in stored.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = stored[name + "_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
            t = t.to(torch.float32) * s[: t.shape[0], : t.shape[1]]
        out[name] = t
    save_file(out, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_fp8_checkpoint_greedy_equals_the_dequantized_transformers_model(tmp_path):
    """The fp8 kind's target graph, decoding greedily through the paged pools (prefill then one row
    per step), == transformers' greedy on torch's dequantization of the same checkpoint."""
    torch.set_num_threads(1)
    folder = write_tiny_checkpoint(tmp_path / "fp8", "deepseek_v32_fp8")
    ckpt = open_checkpoint(folder)
    sess = session(target_step(ckpt.description, Weights(ckpt)))
    reference = transformers.DeepseekV32ForCausalLM.from_pretrained(
        dequantized_copy(folder, tmp_path / "dequantized"), dtype=torch.float32).eval()
    prompt, steps = PROMPTS[1], 16
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps,
                                  do_sample=False, output_logits=True, return_dict_in_generate=True)
    state, ids, tokens, logits = PagedState(ckpt.description, 1, pages_per_seq=8), list(prompt), [], []
    for _ in range(steps):
        out = state.run(sess, {c.INPUT_IDS: np.array([ids]), c.STATE_ROWS: np.array([len(ids)])})
        state.commit(out, np.array([len(ids)]))
        logits.append(out[c.LOGITS][0, -1])
        ids = [int(logits[-1].argmax())]
        tokens += ids
    assert tokens == want.sequences[0, len(prompt):].tolist()
    np.testing.assert_allclose(np.stack(logits), torch.cat(want.logits).numpy(), atol=TOL, rtol=0)
