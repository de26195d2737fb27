"""An attention layer's query norm, query RoPE and output gate in tandem's CPU attention kernel
(ai.tandem.cpu::PagedAttention's optional inputs; matched by export/cpu_prologues.py): equal to the
exporter's nodes and function body; a row of a call equal to the decode step at its position bit
for bit; the same bits portable and AVX-512; the keys' norm and RoPE in a NormRope node of their
own (the graph commits the keys, and other graphs make them without attention: each makes them
with that node)."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tandem.checkpoint.description import AttentionSpec
from tandem.engines.backends import onnxruntime_backend
from tandem.export.builder import IR_VERSION, OPSET, TANDEM_DOMAIN, GraphBuilder
from tandem.export.layers import apply_rotary, rms_norm, rotary_tables
from tandem.export.lowering import lower_for_onnxruntime
from tandem.export.ops import paged_sparse_attention as psa

from .test_cpu_kernels import PAGE, _attention_inputs

F, I64 = TensorProto.FLOAT, TensorProto.INT64
HQ, HKV, D = 4, 2, 24
SPEC = AttentionSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D, rotary_dim=8, rope_theta=1e4)


def _layer_graph(norms: bool = True, gate: bool = True, packed: bool = False):
    """q, k [B, W, H, D] -> (norms) -> RoPE at context_lens + w -> PagedSparseAttention -> (gate)
    Reshape * sigmoid(g), written with the exporter's own helpers; outputs: the attention output and
    the new K rows (as the graph commits them). packed: q and the gate are the heads' halves of one
    input qg [B, W, Hq, 2 D], sliced as export/layers.py's attention does."""
    b = GraphBuilder()
    rng = np.random.default_rng(0)
    q, k = "q", "k"
    if packed:
        q = b.slice("qg", [0], [D], [3])
        gate_in = b.reshape(b.slice("qg", [D], [2 * D], [3]), [0, 0, HQ * D])
    if norms:
        q = rms_norm(b, q, b.weight("q_norm", (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)), 1e-6, "q_norm")
        k = rms_norm(b, k, b.weight("k_norm", (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)), 1e-6, "k_norm")
    positions = b.op("Add", b.unsqueeze("ctx", [1]), b.unsqueeze(b.op("Range", b.const(np.array(0, np.int64)),
                     b.squeeze(b.shape_of("k", 1, 2), [0]), b.const(np.array(1, np.int64))), [0]))
    cos, sin = rotary_tables(b, SPEC, positions)
    q = apply_rotary(b, q, cos, sin, D, SPEC.rotary_dim, "float32")
    k = apply_rotary(b, k, cos, sin, D, SPEC.rotary_dim, "float32")
    out = b.op(psa.OP_TYPE, q, k, "v", "kc", "vc", "tables", "ctx", b.const(np.zeros((1, 1, 0), np.int64)),
               domain=TANDEM_DOMAIN, scale=0.3, sliding_window=0, name="PagedSparseAttention")
    if gate:
        out = b.op("Mul", b.reshape(out, [0, 0, HQ * D]), b.op("Sigmoid", gate_in if packed else "g"))
    b.op("Identity", out, outputs=["o"])
    b.op("Identity", k, outputs=["k_rows"])
    info = helper.make_tensor_value_info
    inputs = [info(n, F, None) for n in ("qg" if packed else "q", "k", "v", "kc", "vc")] + [
        info("tables", I64, None), info("ctx", I64, None)]
    inputs += [info("g", F, None)] if gate and not packed else []
    graph = helper.make_graph(b.nodes, "attn", inputs, [info("o", F, None), info("k_rows", F, None)],
                              [numpy_helper.from_array(v, n) for n, v in b.initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(TANDEM_DOMAIN, 1)],
                              functions=[psa.make_function()])
    model.ir_version = IR_VERSION
    return model


def _fused(model, norms: bool = True, gate: bool = True, packed: bool = False):
    """The kernel lowering; the query's norm and RoPE and the gate are in the kernel node (packed: read
    from qg itself, no Slice or Reshape left), the keys' in a NormRope node of their own: no
    RMSNormalization, Gather or Sigmoid is left."""
    lowered = lower_for_onnxruntime(model, cpu_kernels=True)
    ops = collections.Counter(n.op_type for n in lowered.graph.node)
    (kernel,) = [n for n in lowered.graph.node if n.op_type == "PagedAttention"]
    (keys,) = [n for n in lowered.graph.node if n.op_type == "NormRope"]
    if packed:
        assert kernel.input[0] == "qg" and len(kernel.input) == 11 and not {"Slice", "Reshape"} & set(ops), ops
    else:
        assert kernel.input[0] == "q" and len(kernel.input) == 11 + gate, list(kernel.input)
    assert keys.input[0] == "k" and bool(keys.input[1]) == norms, list(keys.input)
    assert not {"RMSNormalization", "Gather", "Sigmoid", "Cos", "Sin"} & set(ops), ops
    (tables,) = [n for n in lowered.graph.node if n.op_type == "RotaryTables"]   # one node for both tables
    assert list(tables.input)[0::2] == ["", "ctx"], list(tables.input)          # positions ctx + w: in it
    return lowered


def _feeds(rng, ctx, W, pages=16, gate=True, packed=False):
    f = _attention_inputs(rng, ctx, W, hq=HQ, hkv=HKV, d=D, pages=pages)
    if packed:      # each head's query, then its gate
        f["qg"] = np.concatenate([f.pop("q"), rng.standard_normal((len(ctx), W, HQ, D)).astype(np.float32)], -1)
    elif gate:
        f["g"] = rng.standard_normal((len(ctx), W, HQ * D)).astype(np.float32)
    return f


@pytest.mark.parametrize("norms,gate,packed", [(True, True, False), (False, True, False), (True, False, False),
                                               (True, True, True)],
                         ids=["norms-gate", "rope-gate", "norms-no-gate", "packed-query-gate"])
@pytest.mark.parametrize("W", [1, 3])
def test_fused_attention_equals_the_exporters_nodes(library, W, norms, gate, packed):
    model = _layer_graph(norms, gate, packed)
    f = _feeds(np.random.default_rng(W), ctx=[0, 5, 9], W=W, gate=gate, packed=packed)
    want = onnxruntime_backend.session(model).run(None, f)
    got = onnxruntime_backend.session(_fused(model, norms, gate, packed), kernels=library).run(None, f)
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=5e-6, err_msg="output")
    np.testing.assert_allclose(got[1], want[1], rtol=0, atol=2e-6, err_msg="keys")


def test_a_row_equals_the_decode_step_at_its_position_bit_for_bit(library):
    """Row w of a 3-row call == a 1-row call at context + w with rows 0..w-1 committed to the pages
    as the graph outputs them (normed and rotated)."""
    f = _feeds(np.random.default_rng(5), ctx=[6, 1], W=3)
    sess = onnxruntime_backend.session(_fused(_layer_graph()), kernels=library)
    rows, k_rows = sess.run(None, f)
    kc, vc = f["kc"].copy(), f["vc"].copy()
    for w in range(3):
        step = {**f, "q": f["q"][:, w:w + 1], "k": f["k"][:, w:w + 1], "v": f["v"][:, w:w + 1], "g": f["g"][:, w:w + 1],
                "kc": kc, "vc": vc, "ctx": f["ctx"] + w}
        out, k_step = sess.run(None, step)
        assert np.array_equal(out[:, 0], rows[:, w]) and np.array_equal(k_step[:, 0], k_rows[:, w])
        for b, pos in enumerate(f["ctx"] + w):
            page, slot = f["tables"][b, pos // PAGE], pos % PAGE
            kc[page, slot], vc[page, slot] = k_rows[b, w], f["v"][b, w]


def test_portable_and_avx512_forms_give_the_same_bits(library, monkeypatch):
    model = _fused(_layer_graph())
    f = _feeds(np.random.default_rng(8), ctx=[3, 7], W=3)
    fast = onnxruntime_backend.session(model, kernels=library).run(None, f)
    monkeypatch.setenv("TANDEM_CPU_KERNELS_PORTABLE", "1")
    portable = onnxruntime_backend.session(model, kernels=library).run(None, f)
    assert all(np.array_equal(a, b) for a, b in zip(fast, portable))


def test_every_attention_layer_of_a_built_dir_takes_its_query_prologue_and_gate(engine_dirs):
    """Decode, verify, MTP head and round graphs alike: every PagedAttention node takes its query's
    norm and RoPE and its output gate (both from q_proj's packed heads), and no norm or RoPE node of
    a query or key is left (a verify
    row and a decode step, and every graph that makes a layer's keys, must run the same code)."""
    checked = 0
    for path in sorted(engine_dirs["qwen3_5_mtp3"].glob("*.opt.onnx")):
        nodes = onnx.load(str(path), load_external_data=False).graph.node
        kernels = [n for n in nodes if n.op_type == "PagedAttention"]
        packed = [a.i for n in kernels for a in n.attribute if a.name == "packed_gate"]
        assert all(len(n.input) == 11 for n in kernels) and packed == [1] * len(kernels), path.name
        left = [n.name for n in nodes if any(s in n.name for s in ("q_norm", "k_norm", "rotate_half"))
                or n.op_type in ("Cos", "Sin")]
        assert not left, (path.name, left)       # the keys' too, in round graphs' re-anchored heads as well
        checked += bool(kernels)
    assert checked >= 3


def test_rotary_tables_kernel_rotates_as_the_exporters_nodes_at_any_position(library):
    """RoPE at positions up to 10^6 (float32 angles of 10^6 radians): the kernel's tables (one
    float32 product, then cos and sin) rotate within 1e-6 of ONNX Runtime's Cast -> Mul -> Cos / Sin."""
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=128, rotary_dim=32, rope_theta=1e7)
    b = GraphBuilder()
    cos, sin = rotary_tables(b, spec, "pos")
    b.op("Identity", apply_rotary(b, "x", cos, sin, 128, 32, "float32"), outputs=["y"])
    info = helper.make_tensor_value_info
    graph = helper.make_graph(b.nodes, "g", [info("pos", I64, ["B", "W"]), info("x", F, ["B", "W", 2, 128])],
                              [info("y", F, None)], [numpy_helper.from_array(v, n) for n, v in b.initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    lowered = lower_for_onnxruntime(model, cpu_kernels=True)
    assert sorted(n.op_type for n in lowered.graph.node) == ["NormRope", "RotaryTables"]
    assert next(n for n in lowered.graph.node if n.op_type == "RotaryTables").input[0] == "pos"   # given
    feeds = {"pos": np.array([[0, 1, 7, 100, 1000, 32767, 131071, 1_000_000]], np.int64),
             "x": np.random.default_rng(0).standard_normal((1, 8, 2, 128)).astype(np.float32)}
    want = onnxruntime_backend.session(model).run(None, feeds)[0]
    got = onnxruntime_backend.session(lowered, kernels=library).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
