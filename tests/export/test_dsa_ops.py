"""DeepSeek Sparse Attention pieces: the LightningIndexer op against numpy, PagedSparseAttention's
select_new_rows, and the absorbed sparse-MLA graph piece against transformers' DeepseekV32 and
GLM-MoE-DSA attention (dense and sparse, prefill and decode over a paged committed context)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tandem.checkpoint.families.deepseek_dsa import reference as dsa_reference
from tandem.checkpoint.mla_specs import IndexerSpec, MLASpec, YarnSpec
from tandem.export.builder import IR_VERSION, OPSET, TANDEM_DOMAIN, GraphBuilder
from tandem.export.mla import mla_attention, rope_tables
from tandem.export.ops import lightning_indexer, paged_sparse_attention
from tandem.export.primitives import Weights
from tandem.testing import op_references as ref

from ..op_harness import run, single_op_model


def indexer_case(rng, b=3, w=4, hi=4, d=8, n_pages=12, page=4, max_pages=4):
    q = rng.standard_normal((b, w, hi, d)).astype(np.float32)
    wts = rng.standard_normal((b, w, hi)).astype(np.float32)
    k = rng.standard_normal((b, w, d)).astype(np.float32)
    kc = rng.standard_normal((n_pages, page, d)).astype(np.float32)
    tables = rng.permutation(n_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int64)
    lens = np.array([0, 3, 14][:b], np.int64)  # nothing committed, shorter and longer than top-k
    return [q, wts, k, kc, tables, lens]


def run_indexer(inputs, top_k, scale=0.35):
    model = single_op_model(lightning_indexer.make_function(), "LightningIndexer", inputs, [3], out_dtype=np.int64,
                            scale=scale, top_k=top_k)
    return run(model, inputs)[0]


@pytest.mark.parametrize("top_k,dtype", [(1, np.float32), (6, np.float32), (40, np.float32), (6, np.float16)])
def test_lightning_indexer_matches_numpy(top_k, dtype):
    inputs = indexer_case(np.random.default_rng(top_k))
    inputs = [a.astype(dtype) if a.dtype == np.float32 else a for a in inputs]  # fp16: the rounded values
    got = run_indexer(inputs, top_k)
    expected, scores = dsa_reference.lightning_indexer(*inputs, 0.35, top_k)
    assert got.shape == expected.shape == (3, 4, top_k)
    for b in range(3):
        for i in range(4):
            assert not dsa_reference.boundary_ties(scores[b, i], top_k, 1e-5)  # the order is then unique
    np.testing.assert_array_equal(got, expected)
    # a row sees ctx + w + 1 positions: all of them (dense) when that is <= top_k, the rest -1
    visible = inputs[5][:, None] + np.arange(4)[None, :] + 1
    np.testing.assert_array_equal((got >= 0).sum(-1), np.minimum(visible, top_k))


def test_lightning_indexer_equal_scores_take_lower_positions():
    inputs = indexer_case(np.random.default_rng(5))
    inputs[1] = np.zeros_like(inputs[1])  # every score 0
    got = run_indexer(inputs, 6)
    expected, _ = dsa_reference.lightning_indexer(*inputs, 0.35, 6)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got[2, 0], np.arange(6))


def test_paged_attention_select_new_rows():
    from .test_ops import attention_case

    rng = np.random.default_rng(7)
    q, k, v, kc, vc, tables, lens = attention_case(rng)
    sel = rng.integers(-1, 20, (3, 4, 6)).astype(np.int64)
    sel[:, :, 0] = lens[:, None] + np.arange(4)[None, :]  # each row keeps itself
    inputs = [q, k, v, kc, vc, tables, lens, sel]
    fn = paged_sparse_attention.make_function()
    (filtered,) = run(single_op_model(fn, "PagedSparseAttention", inputs, [4], scale=0.3, sliding_window=0,
                                      select_new_rows=1), inputs)
    np.testing.assert_allclose(filtered, ref.paged_attention(q, k, v, kc, vc, tables, lens, 0.3, 0, sel, True),
                               atol=1e-5)
    (default,) = run(single_op_model(fn, "PagedSparseAttention", inputs, [4], scale=0.3, sliding_window=0), inputs)
    np.testing.assert_allclose(default, ref.paged_attention(q, k, v, kc, vc, tables, lens, 0.3, 0, sel), atol=1e-5)
    assert np.abs(filtered - default).max() > 1e-3  # the selection of new rows matters here


# ---- absorbed sparse MLA against transformers ---------------------------------------------------

torch = pytest.importorskip("torch")

FAMILIES = {
    "deepseek_v32": ("transformers.models.deepseek_v32.configuration_deepseek_v32", "DeepseekV32Config",
                     "transformers.models.deepseek_v32.modeling_deepseek_v32", "DeepseekV32"),
    "glm_moe_dsa": ("transformers.models.glm_moe_dsa.configuration_glm_moe_dsa", "GlmMoeDsaConfig",
                    "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsa"),
    "deepseek_v3": ("transformers.models.deepseek_v3.configuration_deepseek_v3", "DeepseekV3Config",
                    "transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3"),
}
PAGE, N_PAGES, MAX_PAGES = 4, 16, 6
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}


class _Dict:
    def __init__(self, tensors):
        self.tensors = tensors

    def weight(self, name):
        return self.tensors[name]


def tiny_attention(family, top_k, yarn, layer=0, seed=0, **extra):
    import importlib

    cfg_mod, cfg_cls, model_mod, prefix = FAMILIES[family]
    dims = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12,
                qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10, index_n_heads=8, index_head_dim=10,
                index_topk=top_k, max_position_embeddings=64, num_hidden_layers=1, attn_implementation="eager",
                rope_parameters=dict(YARN) if yarn else {"rope_type": "default", "rope_theta": 10000.0})
    config = getattr(importlib.import_module(cfg_mod), cfg_cls)(**{**dims, **extra})
    config._attn_implementation = "eager"
    mod = importlib.import_module(model_mod)
    torch.manual_seed(seed)
    attn = getattr(mod, prefix + "Attention")(config, layer).eval()
    with torch.no_grad():
        for name, param in attn.named_parameters():
            param.copy_(torch.randn_like(param) * (0.3 if name.endswith("weight") and param.ndim == 2 else 0.5)
                        + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    return config, attn, getattr(mod, prefix + "RotaryEmbedding")(config)


def mla_spec(config, q_lora=16, top_k=None, interleave_indexer=False, reuse=False, bias=False, interleave=True):
    """The MLASpec of tiny_attention's dims (heads 4, q LoRA 16, kv LoRA 12, nope 8 + rope 6, v 10;
    indexer 8 heads x 10) and the config's RoPE; top_k None: no indexer."""
    params = dict(config.rope_parameters)
    yarn = None
    if params.get("rope_type") == "yarn":
        yarn = YarnSpec(factor=params["factor"], original_max_position_embeddings=params[
            "original_max_position_embeddings"], beta_fast=params.get("beta_fast") or 32,
            beta_slow=params.get("beta_slow") or 1, mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"), attention_factor=params.get("attention_factor"),
            truncate=params.get("truncate", True))
    indexer = None if top_k is None else IndexerSpec(8, 10, top_k, interleave_indexer, reuse)
    return MLASpec(4, q_lora, 12, 8, 6, 10, rope_theta=params["rope_theta"], rope_interleave=interleave, yarn=yarn,
                   indexer=indexer, bias=bias, norm_eps=config.rms_norm_eps)


def transformers_rows(config, attn, rotary, x, **kwargs):
    """Attention output [1, L, H] and the indexer's selection [1, L, k] (None without one) over x."""
    seq = x.shape[1]
    pos = torch.arange(seq)[None]
    mask = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)[None, None]
    picked = {}
    indexer = getattr(attn, "indexer", None)
    hook = indexer.register_forward_hook(lambda _m, _i, out: picked.setdefault("sel", out)) if indexer else None
    with torch.no_grad():
        out = attn(x, rotary(x, pos), mask, position_ids=pos, **kwargs)[0]
    if hook:
        hook.remove()
    return out.numpy(), picked["sel"].numpy() if hook else None


def mla_step(spec, attn, dtype="float32"):
    """The MLA piece as an ONNX Runtime session: feeds -> {out, rows, index_rows, selected}; a
    spec whose indexer reuses the previous layer's takes the selection as a graph input (GLM-5
    "shared" layers). Activations, pools and weights in `dtype`."""
    tensors = {"a." + n: t.detach().numpy() for n, t in attn.state_dict().items()}
    own = spec.indexer is not None and not spec.indexer.reuse_previous
    reused = spec.indexer is not None and spec.indexer.reuse_previous
    b = GraphBuilder()
    w = Weights(_Dict(tensors), dtype)
    cos, sin = rope_tables(b, spec, "positions", dtype)
    out = mla_attention(b, spec, w, "a.", "x", cos, sin, "context_lens", "block_tables", "latent_pool",
                        "index_pool" if own else None, "selected" if reused else None)
    f32, i64 = TensorProto.FLOAT if dtype == "float32" else TensorProto.FLOAT16, TensorProto.INT64
    ins = [helper.make_tensor_value_info(n, t, s) for n, t, s in (
        ("x", f32, ["B", "W", 32]), ("positions", i64, ["B", "W"]), ("context_lens", i64, ["B"]),
        ("block_tables", i64, ["B", "P"]), ("latent_pool", f32, ["N", PAGE, 1, spec.latent_dim]))]
    if own:
        ins.append(helper.make_tensor_value_info("index_pool", f32, ["N", PAGE, spec.indexer.head_dim]))
    if reused:
        ins.append(helper.make_tensor_value_info("selected", i64, ["B", "W", "K"]))
    keys = ["out", "rows", "index_rows", "selected"][: 4 if own else 2]
    names = [out.output, out.latent_rows, out.index_key_rows, out.selected][: len(keys)]
    outs = [helper.make_tensor_value_info(n, t, [None] * r)
            for n, t, r in zip(names, (f32, f32, f32, i64), (3, 4, 3, 3))]
    inits = [onnx.numpy_helper.from_array(a, n) for n, a in b.initializers.items()]
    graph = helper.make_graph(b.nodes, "mla", ins, outs, initializer=inits)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(TANDEM_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets,
                              functions=[paged_sparse_attention.make_function(), lightning_indexer.make_function()])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    from tandem.engines.backends.onnxruntime_backend import session

    sess = session(model)
    return lambda feeds: dict(zip(keys, sess.run(names, feeds)))


def run_against_transformers(config, attn, rotary, spec, w_rows, dtype="float32", atol=1e-4):
    """Prefill two committed contexts (13 and 7 tokens) alone, commit their rows into shuffled
    pages, then run W new rows of both over them; compare with transformers on the full sequences."""
    step = mla_step(spec, attn, dtype=dtype)
    idx = spec.indexer
    ctx = np.array([13, 7], np.int64)
    xs = [torch.randn(1, int(n) + w_rows, 32, generator=torch.Generator().manual_seed(s)) for s, n in enumerate(ctx)]
    pools = {"latent_pool": np.zeros((N_PAGES, PAGE, 1, spec.latent_dim), dtype)}
    if idx:
        pools["index_pool"] = np.zeros((N_PAGES, PAGE, idx.head_dim), dtype)
    tables = np.random.default_rng(1).permutation(N_PAGES)[: 2 * MAX_PAGES].reshape(2, MAX_PAGES).astype(np.int64)
    for s, n in enumerate(ctx):
        got = step({"x": xs[s][:, :n].numpy().astype(dtype), "positions": np.arange(n)[None],
                    "context_lens": np.zeros(1, np.int64), "block_tables": tables[s : s + 1], **pools})
        for j in range(n):
            pools["latent_pool"][tables[s, j // PAGE], j % PAGE] = got["rows"][0, j]
            if idx:
                pools["index_pool"][tables[s, j // PAGE], j % PAGE] = got["index_rows"][0, j]
    new = np.concatenate([x[:, -w_rows:].numpy() for x in xs]).astype(dtype)
    got = step({"x": new, "positions": ctx[:, None] + np.arange(w_rows)[None], "context_lens": ctx,
                "block_tables": tables, **pools})
    for s, n in enumerate(ctx):
        want, picked = transformers_rows(config, attn, rotary, xs[s])
        np.testing.assert_allclose(got["out"][s].astype(np.float32), want[0, n:], atol=atol)
        for i in range(w_rows if idx else 0):
            pos = n + i
            theirs = {int(j) for j in picked[0, pos] if j <= pos}       # past the row: masked anyway
            ours = {int(j) for j in got["selected"][s, i] if j >= 0}
            assert ours == theirs, (s, i)
            assert len(ours) == min(idx.topk, pos + 1)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("top_k,yarn", [(64, True), (8, True), (8, False)])
@pytest.mark.parametrize("w_rows", [5, 1])
def test_absorbed_mla_equals_transformers(family, top_k, yarn, w_rows):
    config, attn, rotary = tiny_attention(family, top_k, yarn)
    spec = mla_spec(config, top_k=top_k, interleave_indexer=family == "glm_moe_dsa")
    run_against_transformers(config, attn, rotary, spec, w_rows)


def test_absorbed_mla_with_attention_bias_equals_transformers():
    config, attn, rotary = tiny_attention("deepseek_v32", 8, True, attention_bias=True)
    assert attn.kv_a_proj_with_mqa.bias is not None
    run_against_transformers(config, attn, rotary, mla_spec(config, top_k=8, bias=True), 5)


def test_absorbed_mla_float16_is_close_to_transformers():
    """float16 weights, activations and pools (dense: fp16 rounding may reorder close index scores)."""
    config, attn, rotary = tiny_attention("deepseek_v32", 64, True)
    run_against_transformers(config, attn, rotary, mla_spec(config, top_k=64), 5, "float16", atol=1e-2)


def test_glm_shared_layer_attends_the_previous_layers_selection():
    kinds = dict(indexer_types=["full", "shared"], num_hidden_layers=2)
    config, full, rotary = tiny_attention("glm_moe_dsa", 8, True, **kinds)
    _, shared, _ = tiny_attention("glm_moe_dsa", 8, True, layer=1, seed=1, **kinds)
    assert shared.indexer is None
    x = torch.randn(1, 17, 32, generator=torch.Generator().manual_seed(3))
    _, picked = transformers_rows(config, full, rotary, x)
    want, _ = transformers_rows(config, shared, rotary, x, prev_topk_indices=torch.from_numpy(picked))
    feeds = {"x": x.numpy(), "positions": np.arange(17)[None], "context_lens": np.zeros(1, np.int64),
             "block_tables": np.arange(MAX_PAGES)[None], "latent_pool": np.zeros((N_PAGES, PAGE, 1, 18), np.float32)}
    ours = mla_step(mla_spec(config, top_k=8, interleave_indexer=True), full)(
        {**feeds, "index_pool": np.zeros((N_PAGES, PAGE, 10), np.float32)})["selected"]
    reuse = mla_spec(config, top_k=8, interleave_indexer=True, reuse=True)
    got = mla_step(reuse, shared)({**feeds, "selected": ours})["out"]
    np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("interleave", [True, False])
def test_absorbed_mla_without_q_lora_equals_deepseek_v3(interleave):
    config, attn, rotary = tiny_attention("deepseek_v3", 0, True, q_lora_rank=None, rope_interleave=interleave)
    run_against_transformers(config, attn, rotary, mla_spec(config, q_lora=None, interleave=interleave), 5)


@pytest.mark.parametrize("params", [
    {}, {"attention_factor": 1.3}, {"mscale": None, "mscale_all_dim": None},
    {"truncate": False, "factor": 40.0, "original_max_position_embeddings": 4096},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 16}])
def test_spec_rope_and_scale_equal_transformers_yarn(params):
    """MLASpec's YaRN inverse frequencies, cos/sin factor and softmax scale (what rope_tables and
    the attention use) against transformers' for the tiny dims."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config, _, rotary = tiny_attention("deepseek_v32", 8, True)
    config.rope_parameters = {**YARN, **params}
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    spec = mla_spec(config, top_k=8)
    np.testing.assert_allclose(spec.inv_freq(), inv_freq.numpy(), rtol=1e-6)
    assert spec.rope_attention_factor == pytest.approx(factor, rel=1e-7)
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import yarn_apply_mscale

    assert spec.scale == pytest.approx(yarn_apply_mscale(config.rope_parameters, 14 ** -0.5), rel=1e-7)
