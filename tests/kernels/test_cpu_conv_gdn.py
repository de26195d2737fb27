"""A Gated DeltaNet layer from its in_proj outputs as one CPU kernel (ai.tandem.cpu::ConvGatedDeltaNet,
plugins/cpu/conv_gated_deltanet.cc; matched by export/cpu_prologues.py): equal to the exporter's
nodes and function body, the same bits in its portable and AVX-512 forms, a verify's pick replayed,
and every Gated DeltaNet layer of every graph of a built engine dir fused."""

from __future__ import annotations

import collections
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tandem.engines.backends import onnxruntime_backend
from tandem.export.builder import IR_VERSION, OPSET, TANDEM_DOMAIN, GraphBuilder
from tandem.export.cpu_kernel_lowering import CPU_DOMAIN
from tandem.export.layers import causal_conv, conv_windows_index, l2_norm
from tandem.export.lowering import lower_for_onnxruntime
from tandem.export.ops import gated_deltanet
from tandem.export.primitives import silu

F, I64 = TensorProto.FLOAT, TensorProto.INT64
HK, HV, DK, DV, KERNEL = 2, 4, 16, 8, 4
C = 2 * HK * DK + HV * DV
PROLOGUE_OPS = {"Concat", "ReduceSum", "Softplus", "Sigmoid", "RMSNormalization", "Slice"}


def _layer_graph(emit_rows: bool, beta_op: str = "Sigmoid", commit: str = "") -> onnx.ModelProto:
    """The exporter's Gated DeltaNet prologue (export/layers.py, gated_deltanet_layer, with its own
    helpers) -> GatedDeltaNet; outputs: its output, final state and the conv window; with emit_rows
    the verify's pick of the state after row a; with commit the graph's pick of the new conv state
    (export/graphs.py, _conv_windows_after) at rows `keep` given as an input ("input": decode,
    prefill) or made after the layer ("late": a verify's kept rows, from its logits)."""
    b = GraphBuilder()
    rng = np.random.default_rng(3)
    taps = b.weight("taps", (rng.standard_normal((KERNEL, C)) * 0.5).astype(np.float32))
    neg_a = b.weight("neg_a", -rng.random(HV).astype(np.float32) - 0.1)
    dt_bias = b.weight("dt_bias", rng.standard_normal(HV).astype(np.float32))
    beta = b.op(beta_op, "b_proj")
    decay = b.op("Mul", neg_a, b.op("Softplus", b.op("Add", "a_proj", dt_bias)))
    padded = b.concat([b.op("Gather", "conv_pool", "slots", axis=0), "qkv"], 1)
    mixed = silu(b, causal_conv(b, padded, taps, conv_windows_index(b, "qkv_ids", KERNEL)))
    kd = HK * DK
    qh = l2_norm(b, b.reshape(b.slice(mixed, [0], [kd], [2]), [0, 0, HK, DK]), DK)
    kh = l2_norm(b, b.reshape(b.slice(mixed, [kd], [2 * kd], [2]), [0, 0, HK, DK]), DK)
    vh = b.reshape(b.slice(mixed, [2 * kd], [C], [2]), [0, 0, HV, DV])
    state = b.op("Gather", "state_pool", "slots", axis=0)
    outs = ["o", "s"] + (["rs"] if emit_rows else [])
    b.op(gated_deltanet.OP_TYPE, qh, kh, vh, decay, beta, state, "n", domain=TANDEM_DOMAIN, outputs=outs,
         scale=DK ** -0.5, num_key_heads=HK, num_value_heads=HV, name="GatedDeltaNet")
    b.op("Identity", padded, outputs=["window"])
    info = helper.make_tensor_value_info
    inputs = [info("qkv", F, None), info("qkv_ids", I64, None), info("b_proj", F, None), info("a_proj", F, None),
              info("conv_pool", F, None), info("state_pool", F, None), info("slots", I64, None), info("n", I64, None)]
    outputs = [info(n, F, None) for n in ("o", "s", "window")]
    if emit_rows:
        b.op("GatherND", "rs", "a", batch_dims=1, outputs=["picked"])
        inputs.append(info("a", I64, None))
        outputs.append(info("picked", F, None))
    if commit:
        inputs.append(info("keep", I64, None))
        keep = "keep" if commit == "input" else b.op("Add", "keep", b.op("Cast", b.op("Mul", b.op(
            "ReduceMin", "o", keepdims=0), b.const(np.array(0, np.float32))), to=TensorProto.INT64))
        index = b.unsqueeze(b.op("Add", b.unsqueeze(keep, [1]), b.const(np.arange(KERNEL - 1)[None, :], np.int64)), [2])
        b.op("GatherND", padded, index, batch_dims=1, outputs=["new_conv"])
        outputs.append(info("new_conv", F, None))
    graph = helper.make_graph(b.nodes, "layer", inputs, outputs,
                              [onnx.numpy_helper.from_array(v, k) for k, v in b.initializers.items()])
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(TANDEM_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets,
                              functions=[gated_deltanet.make_function(emit_row_states=emit_rows)])
    model.ir_version = IR_VERSION
    return model


def _feeds(rng, B, W, pool_rows=5, emit_rows=False, commit=False):
    f = {"qkv": rng.standard_normal((B, W, C)).astype(np.float32), "qkv_ids": np.zeros((B, W), np.int64),
         "b_proj": rng.standard_normal((B, W, HV)).astype(np.float32),
         "a_proj": rng.standard_normal((B, W, HV)).astype(np.float32),
         "conv_pool": rng.standard_normal((pool_rows, KERNEL - 1, C)).astype(np.float32),
         "state_pool": (rng.standard_normal((pool_rows, HV, DK, DV)) * 0.3).astype(np.float32),
         "slots": rng.permutation(pool_rows)[:B].astype(np.int64),
         "n": rng.integers(0, W + 1, B).astype(np.int64)}
    if emit_rows:
        f["a"] = rng.integers(0, W, (B, 1)).astype(np.int64)
    if commit:
        f["keep"] = rng.integers(0, W + 1, B).astype(np.int64)
    return f


def _fused(model: onnx.ModelProto) -> onnx.ModelProto:
    lowered = lower_for_onnxruntime(model, cpu_kernels=True)
    ops = collections.Counter(n.op_type for n in lowered.graph.node)
    assert ops["ConvGatedDeltaNet"] >= 1 and not ops["GatedDeltaNet"], ops
    assert not PROLOGUE_OPS & set(ops), ops                      # the prologue's nodes went with it
    return lowered


@pytest.mark.parametrize("B,W,emit_rows,commit", [(1, 1, False, "input"), (3, 4, False, ""), (3, 4, True, "late"),
                                                  (2, 7, False, "input")],
                         ids=["decode", "verify", "verify-pick", "prefill"])
def test_fused_layer_equals_the_exporters_nodes(library, B, W, emit_rows, commit):
    """Output, final state, conv window, the replayed pick and the new conv state against ONNX Runtime
    running the exporter's nodes and the delta rule's function body. Where the kept rows are an
    input the node picks the new conv state itself (no GatherND); where they come after the layer
    the graph's GatherND stays and reads the node's window."""
    model = _layer_graph(emit_rows, commit=commit)
    lowered = _fused(model)
    assert sum(n.op_type == "ConvGatedDeltaNet" for n in lowered.graph.node) == 1 + emit_rows
    gathers = sum(n.op_type == "GatherND" for n in lowered.graph.node)
    assert gathers == (commit == "late"), [n.op_type for n in lowered.graph.node]
    f = _feeds(np.random.default_rng(B * 10 + W), B, W, emit_rows=emit_rows, commit=bool(commit))
    want = onnxruntime_backend.session(model).run(None, f)
    got = onnxruntime_backend.session(lowered, kernels=library).run(None, f)
    names = ["output", "final state", "conv window"] + ["pick"] * emit_rows + ["new conv state"] * bool(commit)
    for name, g, w in zip(names, got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=3e-5, err_msg=name)
    np.testing.assert_array_equal(got[2], want[2])                # the window is copied, not computed
    if commit:
        np.testing.assert_array_equal(got[-1], want[-1])


def test_a_row_of_a_call_equals_the_decode_steps_bit_for_bit(library):
    """Row t of a 4-row call equals the decode step that sees rows 0..t-1 committed (state and conv
    window carried by hand): the speculative == plain greedy contract."""
    session = onnxruntime_backend.session(_fused(_layer_graph(False)), kernels=library)
    f = _feeds(np.random.default_rng(5), 1, 4, pool_rows=1)
    f["n"] = np.array([4], np.int64)
    whole = session.run(None, f)[0]
    step = dict(f)
    for t in range(4):
        step.update(qkv=f["qkv"][:, t:t + 1], qkv_ids=f["qkv_ids"][:, :1], b_proj=f["b_proj"][:, t:t + 1],
                    a_proj=f["a_proj"][:, t:t + 1], n=np.array([1], np.int64))
        out, state, window = session.run(None, step)
        assert np.array_equal(out[0, 0], whole[0, t]), t
        step.update(state_pool=state, conv_pool=window[:, 1:])


def test_portable_and_avx512_forms_give_the_same_bits(library, monkeypatch):
    model = _fused(_layer_graph(True))
    f = _feeds(np.random.default_rng(8), 3, 4, emit_rows=True)
    fast = onnxruntime_backend.session(model, kernels=library).run(None, f)
    monkeypatch.setenv("TANDEM_CPU_KERNELS_PORTABLE", "1")        # read when a session makes its kernels
    portable = onnxruntime_backend.session(model, kernels=library).run(None, f)
    for a, b in zip(fast, portable):
        assert np.array_equal(a, b)


def test_a_layer_that_differs_keeps_the_unfused_kernel():
    """Anything but the exporter's prologue (here beta = Tanh(b)) stays as nodes before GatedDeltaNet."""
    lowered = lower_for_onnxruntime(_layer_graph(False, beta_op="Tanh"), cpu_kernels=True)
    ops = collections.Counter(n.op_type for n in lowered.graph.node if n.domain == CPU_DOMAIN)
    assert ops == {"GatedDeltaNet": 1}


def test_every_gated_deltanet_layer_of_a_built_dir_is_fused(engine_dirs, library):
    """All graphs of an engine dir, decode, verify and round alike, run the fused kernel: a verify
    row and a decode step must run the same code."""
    engine_dir = engine_dirs["qwen3_5_mtp3"]
    layers = sum(t == "linear_attention" for t in _config_layer_types(engine_dir))
    checked = 0
    for path in sorted(engine_dir.glob("*.opt.onnx")):
        nodes = onnx.load(str(path), load_external_data=False).graph.node
        ops = collections.Counter(n.op_type for n in nodes if n.domain == CPU_DOMAIN)
        assert not ops["GatedDeltaNet"], path.name
        # beside the kernels a layer keeps in_proj's Split only (out_proj reads z as it comes)
        left = {n.op_type for n in nodes if "linear_attn" in n.name and n.domain != CPU_DOMAIN}
        assert left <= {"Split"}, (path.name, left)
        if ops["ConvGatedDeltaNet"]:
            assert ops["ConvGatedDeltaNet"] % layers == 0, (path.name, ops)
            checked += 1
    assert checked >= 2


def _config_layer_types(engine_dir) -> list[str]:
    config = json.loads((engine_dir / "config.json").read_text())
    return config.get("text_config", config)["layer_types"]


def test_a_conv_row_outside_the_call_fails_that_call_with_a_clear_error(library):
    session = onnxruntime_backend.session(_fused(_layer_graph(False, commit="input")), kernels=library)
    f = _feeds(np.random.default_rng(2), 2, 3, commit=True)
    with pytest.raises(Exception, match="a conv row is outside the call's rows"):
        session.run(None, {**f, "keep": np.array([1, 4], np.int64)})
    assert session.run(None, f)[-1].shape == (2, KERNEL - 1, C)


@pytest.mark.parametrize("keep", [0, 1, 3])
def test_new_conv_state_written_over_its_own_pool_rows(library, keep):
    """The runtime binds the new conv state to the pool's rows where the slots allow
    (pipeline/model_runner.py): the node reads its window before it writes them."""
    import onnxruntime as ort
    session = onnxruntime_backend.session(_fused(_layer_graph(False, commit="input")), kernels=library)
    f = _feeds(np.random.default_rng(keep), 1, 3, pool_rows=1, commit=True)
    f.update(slots=np.zeros(1, np.int64), keep=np.array([keep], np.int64))
    want = session.run(None, f)
    pool = ort.OrtValue.ortvalue_from_numpy(f["conv_pool"].copy())
    binding = session.io_binding()
    for name, value in f.items():
        if name == "conv_pool":
            binding.bind_ortvalue_input(name, pool)
        else:
            binding.bind_cpu_input(name, value)
    for out in session.get_outputs():
        if out.name == "new_conv":
            binding.bind_ortvalue_output(out.name, pool)
        else:
            binding.bind_output(out.name)
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(pool.numpy(), want[-1])
    for got, expected in zip(binding.copy_outputs_to_cpu()[:3], want[:3]):
        np.testing.assert_array_equal(got, expected)
