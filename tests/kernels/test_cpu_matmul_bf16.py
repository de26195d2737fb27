"""`--weights bf16`: tandem's float32 matmul over bfloat16 panels (plugins/cpu/matmul_f32.cc, bf16 = 1).
The kernel widens each weight exactly, so it must equal the float32 panels of the same weights bit for
bit (both kernels); a norm's scale the build cannot fold into bfloat16 panels goes in as input 3; an
engine dir built so serves its matmuls on them, keeps speculative greedy == plain greedy, and on a
bfloat16 checkpoint computes with the checkpoint's own weights (a float build's tokens)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tandem.engines.backends import onnxruntime_backend
from tandem.engines.builder import build_engines
from tandem.engines.options import BuildOptions, OptionsError
from tandem.export.cpu_kernel_lowering import CPU_DOMAIN
from tandem.export.cpu_matmul_lowering import bf16_bits, lower_matmul_to_kernel, swiglu_panels, weight_panels
from tandem.export.quantize import Bf16Weights
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams
from tandem.plugins import cpu_kernels
from tandem.testing.tiny_checkpoints import write_tiny_checkpoint

from .test_cpu_matmul_f32 import CASES, _Tensors


def _model(B: np.ndarray, n: int, bf16: bool, swiglu: bool = False, scale: np.ndarray | None = None):
    """One kernel node over panels B (float32, or their bfloat16 bits); with `scale`: an RMS norm whose
    scale comes as input 3 (not folded)."""
    ins = ["A", "B"] + (["", "s"] if scale is not None else [])
    attrs = {"N": n, **({"bf16": 1} if bf16 else {}), **({"swiglu": 1} if swiglu else {}),
             **({"rms_norm": 1, "epsilon": 1e-6} if scale is not None else {})}
    inits = [numpy_helper.from_array(B, "B")] + ([numpy_helper.from_array(scale, "s")] if scale is not None else [])
    g = helper.make_graph([helper.make_node("MatMul", ins, ["Y"], domain=CPU_DOMAIN, **attrs)], "mm",
                          [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", B.shape[1]])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(CPU_DOMAIN, 1)])
    m.ir_version = 10
    return m


def _kernels():
    """(portable?) for each kernel that runs here."""
    return [True, False] if cpu_kernels.f32_matmul() else [True]


def test_bf16_bits_round_to_nearest_even_and_keep_bfloat16_values():
    w = np.array([1.0, 1.00390625, 1.01171875, -3.5e-3, 0.0], np.float32)   # 1 + 2^-8 ties to 1; 1 + 3 2^-8 up
    bits = bf16_bits(w)
    assert bits.dtype == np.uint16
    back = (bits.astype(np.uint32) << 16).view(np.float32)
    assert back[0] == 1.0 and back[1] == 1.0 and back[2] == 1.015625 and back[4] == 0.0
    assert np.array_equal(back, Bf16Weights.round(w))
    assert np.array_equal(bf16_bits(back), bits)                                 # exact on bfloat16 values


@pytest.mark.parametrize("K,N", CASES, ids=[f"K{k}-N{n}" for k, n in CASES])
def test_bf16_panels_equal_float32_panels_of_the_same_weights(library, monkeypatch, K, N):
    rng = np.random.default_rng(K * 31 + N)
    W = Bf16Weights.round(rng.standard_normal((K, N)).astype(np.float32))
    A = rng.standard_normal((19, K)).astype(np.float32)    # blocks of 10 and 9 rows, k in slices past 128
    for portable in _kernels():
        monkeypatch.setenv("TANDEM_CPU_KERNELS_PORTABLE", "1" if portable else "0")
        full = onnxruntime_backend.session(_model(weight_panels(W), N, False), kernels=library).run(None, {"A": A})[0]
        half = onnxruntime_backend.session(_model(bf16_bits(weight_panels(W)), N, True), kernels=library)
        y = half.run(None, {"A": A})[0]
        assert np.array_equal(y, full), "portable" if portable else "avx512"
        for m in (3, 17):                                                       # a row as if alone
            assert np.array_equal(half.run(None, {"A": A[m : m + 1]})[0][0], y[m])


def test_bf16_swiglu_and_a_norm_scale_as_input(library, monkeypatch):
    """swiglu over bfloat16 gate / up panels equals the float32 panels'; an RMS norm's scale as input 3
    gives (A / rms(A)) diag(s) W against float64."""
    rng = np.random.default_rng(3)
    K, I = 300, 40      # k in three slices past 8 rows
    W = Bf16Weights.round((rng.standard_normal((K, 2 * I)) * 0.2).astype(np.float32))
    A = (rng.standard_normal((17, K)) * 2).astype(np.float32)
    s = (rng.random(K) + 0.5).astype(np.float32)
    a64 = A.astype(np.float64)
    exact = (a64 / np.sqrt((a64**2).mean(axis=1, keepdims=True) + 1e-6) * s) @ W[:, :I].astype(np.float64)
    for portable in _kernels():
        monkeypatch.setenv("TANDEM_CPU_KERNELS_PORTABLE", "1" if portable else "0")
        full = onnxruntime_backend.session(_model(swiglu_panels(W), I, False, swiglu=True), kernels=library)
        half = onnxruntime_backend.session(_model(bf16_bits(swiglu_panels(W)), I, True, swiglu=True), kernels=library)
        assert np.array_equal(half.run(None, {"A": A})[0], full.run(None, {"A": A})[0])
        normed = onnxruntime_backend.session(_model(bf16_bits(weight_panels(W[:, :I])), I, True, scale=s),
                                             kernels=library)
        y = normed.run(None, {"A": A})[0]
        assert np.abs(y - exact).max() <= 1e-5 * np.abs(exact).max()


def test_lowering_with_bf16_keeps_norm_scales_as_inputs(library):
    """RMSNormalization(X, s) -> MatMul(W): bf16 panels (half the bytes), the scale read by the node
    (not folded: diag(s) W is not bfloat16), the norm gone; the result the graph's within rounding."""
    rng = np.random.default_rng(5)
    K, N = 64, 40
    s = (rng.random(K) + 0.5).astype(np.float32)
    W = Bf16Weights.round(rng.standard_normal((K, N)).astype(np.float32))
    nodes = [helper.make_node("RMSNormalization", ["X", "s"], ["n"], epsilon=1e-6),
             helper.make_node("MatMul", ["n", "W"], ["Y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", K])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(s, "s"), numpy_helper.from_array(W, "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    feeds = {"X": rng.standard_normal((5, K)).astype(np.float32)}
    expected = onnxruntime_backend.session(model).run(None, feeds)[0]
    assert lower_matmul_to_kernel(model, _Tensors(), bf16=True)
    [node] = model.graph.node
    inits = {t.name: t for t in model.graph.initializer}
    assert node.input[0] == "X" and node.input[3] == "s" and inits[node.input[1]].data_type == TensorProto.UINT16
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["bf16"] == 1
    got = onnxruntime_backend.session(model, kernels=library).run(None, feeds)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_bf16_weights_need_float32_activations():
    with pytest.raises(OptionsError, match="--weights bf16 with --dtype float16"):
        BuildOptions(weights="bf16", dtype="float16")


OPTIONS = dict(batch_sizes=(1, 2), spec_k=2, prefill_chunk=8, max_seq_len=128)
PROMPTS = [[5, 17, 33, 200, 7], [9, 120, 77, 301, 15, 2, 88, 91, 14, 250, 3]]


def test_bf16_engines_on_a_bfloat16_checkpoint_decode_as_float_ones(tmp_path):
    """A bfloat16 checkpoint: the bf16 build's weights are the float build's, so greedy tokens agree
    (the norms' scales apply in another order: rounding only); its matmuls run on bfloat16 panels where
    the kernel is fast here; speculative greedy == plain greedy at batches 1 and 2."""
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5_mtp3", dtype="bfloat16")
    dirs = {w: build_engines(ckpt, tmp_path / w, BuildOptions(weights=w, **OPTIONS), show_progress=False).engine_dir
            for w in ("float", "bf16")}
    assert json.loads((dirs["bf16"] / "manifest.json").read_text())["options"]["weights"] == "bf16"
    if cpu_kernels.f32_matmul():
        model = onnx.load(str(dirs["bf16"] / "target_step.opt.onnx"), load_external_data=False)
        ours = [n for n in model.graph.node if (n.domain, n.op_type) == (CPU_DOMAIN, "MatMul")]
        assert ours and all(any(a.name == "bf16" and a.i == 1 for a in n.attribute) for n in ours)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    tokens = {}
    for w, d in dirs.items():
        for spec in (False, True):
            llm = LLM(d, RuntimeConfig(speculative=spec, adaptive_width=False))
            tokens[w, spec] = [r.token_ids for r in llm.generate(PROMPTS, params)]
            tokens[w, spec, 1] = [r.token_ids for r in llm.generate(PROMPTS[:1], params)]
    assert tokens["bf16", True] == tokens["bf16", False] and tokens["bf16", True, 1] == tokens["bf16", False, 1]
    assert tokens["bf16", False] == tokens["float", False]
