"""tandem's float32 matmul kernel (plugins/cpu/matmul_f32.cc): the panel layout against numpy, both
kernels (AVX-512 and the portable loop) bit for bit against each other and within float32 rounding
of a float64 product, row invariance bit for bit, bad inputs, and the build's lowering of
constant-weight MatMuls to it (export/cpu_matmul_lowering.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tandem.engines.backends import onnxruntime_backend
from tandem.engines.backends.onnxruntime_files import OPTIMIZED_WEIGHTS
from tandem.engines.builder import build_engines
from tandem.export.cpu_kernel_lowering import CPU_DOMAIN
from tandem.export.cpu_matmul_lowering import lower_matmul_to_kernel, swiglu_panels, weight_panels
from tandem.plugins import cpu_kernels

from ..engines.test_load_costs import SMALL

# (K, N): one input, N a multiple of 16 or not, several chunks of 4 panels, a last chunk of 1-3
CASES = [(1, 5), (37, 16), (64, 33), (200, 70), (96, 129), (130, 200)]


def _kernel_model(W: np.ndarray, a_shape=("M", "K")) -> onnx.ModelProto:
    node = helper.make_node("MatMul", ["A", "B"], ["Y"], domain=CPU_DOMAIN, N=W.shape[1])
    g = helper.make_graph([node], "mm", [helper.make_tensor_value_info("A", TensorProto.FLOAT, list(a_shape))],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(weight_panels(W), "B")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(CPU_DOMAIN, 1)])
    m.ir_version = 10
    return m


def _run(library, W, A, monkeypatch=None, portable=False):
    if monkeypatch is not None:
        monkeypatch.setenv("TANDEM_CPU_KERNELS_PORTABLE", "1" if portable else "0")   # read when the kernel is made
    return onnxruntime_backend.session(_kernel_model(W), kernels=library).run(None, {"A": A})[0]


def test_weight_panels_hold_16_columns_row_after_row():
    W = np.arange(3 * 37, dtype=np.float32).reshape(3, 37)
    B = weight_panels(W)
    assert B.shape == (3, 3, 16) and B.flags.c_contiguous
    for p in range(3):
        for k in range(3):
            for j in range(16):
                assert B[p, k, j] == (W[k, 16 * p + j] if 16 * p + j < 37 else 0.0)


@pytest.mark.parametrize("K,N", CASES, ids=[f"K{k}-N{n}" for k, n in CASES])
def test_both_kernels_equal_each_other_and_the_product(library, monkeypatch, K, N):
    fast_here = cpu_kernels.f32_matmul()                          # (before the portable switch below)
    rng = np.random.default_rng(K * 1000 + N)
    W = rng.standard_normal((K, N)).astype(np.float32)
    # past 8 rows, k in slices (kSlice 128) and rows in blocks (10 and 9), every K its slices
    A = rng.standard_normal((19, K)).astype(np.float32)
    A[4] = 0.0
    portable = _run(library, W, A, monkeypatch, portable=True)
    exact = A.astype(np.float64) @ W.astype(np.float64)
    scale = np.abs(A).astype(np.float64) @ np.abs(W).astype(np.float64)   # the rounding's own bound
    assert np.all(np.abs(portable - exact) <= 1e-6 * K * scale + 1e-30)
    assert not np.any(portable[4])
    if not fast_here:
        pytest.skip("no AVX-512 here: only the portable kernel runs")
    fast = _run(library, W, A, monkeypatch)
    assert np.array_equal(fast, portable)                          # the same fma chains, bit for bit


@pytest.mark.parametrize("portable", [False, True], ids=["avx512", "portable"])
def test_a_rows_result_does_not_depend_on_the_calls_rows(library, monkeypatch, portable):
    """Tiles of 8, 5-7, 4, 2-3 and 1 rows run other register blocks, and calls past 8 rows take k in
    slices (K = 300: three) and rows in blocks of up to 12 (25 rows: 9, 9, 7; 24: 12, 12; 16: 8, 8):
    every row of a call equals the same row alone, bit for bit (a verify row equals a decode step)."""
    if not portable and not cpu_kernels.f32_matmul():
        pytest.skip("no AVX-512 here")
    monkeypatch.setenv("TANDEM_CPU_KERNELS_PORTABLE", "1" if portable else "0")
    rng = np.random.default_rng(7)
    W = rng.standard_normal((300, 150)).astype(np.float32)
    sess = onnxruntime_backend.session(_kernel_model(W), kernels=library)
    A = rng.standard_normal((25, 300)).astype(np.float32)
    for rows in (25, 24, 21, 16, 13, 12, 9, 7, 5, 4, 3, 2):
        y = sess.run(None, {"A": A[:rows]})[0]
        for m in range(rows):
            assert np.array_equal(sess.run(None, {"A": A[m : m + 1]})[0][0], y[m]), (rows, m)
    ranked = onnxruntime_backend.session(_kernel_model(W, a_shape=("B", "T", 300)), kernels=library)
    batched = ranked.run(None, {"A": A[:12].reshape(3, 4, 300)})[0]   # [B, T, K] as the graphs call it
    assert batched.shape == (3, 4, 150) and np.array_equal(batched.reshape(12, 150), sess.run(None, {"A": A[:12]})[0])


def test_bad_inputs_fail_that_call_with_a_clear_error(library):
    W = np.ones((8, 20), np.float32)
    bad = _kernel_model(W)
    bad.graph.node[0].attribute[0].i = 40                            # N that the panels do not hold
    with pytest.raises(Exception, match="B is not panels"):
        onnxruntime_backend.session(bad, kernels=library).run(None, {"A": np.ones((1, 8), np.float32)})
    good = onnxruntime_backend.session(_kernel_model(W, a_shape=("M", "any")), kernels=library)
    with pytest.raises(Exception, match="A's last dimension is not B's K"):
        good.run(None, {"A": np.ones((1, 9), np.float32)})
    assert np.array_equal(good.run(None, {"A": np.ones((2, 8), np.float32)})[0], np.full((2, 20), 8, np.float32))


class _Tensors:
    """The saved graph's tensor store as lower_matmul_to_kernel sees it, in memory."""

    def array(self, tensor):
        return numpy_helper.to_array(tensor)

    def add(self, name, array):
        return numpy_helper.from_array(array, name)


def test_lowering_takes_constant_float_weights_and_drops_the_ones_left_unread(library):
    rng = np.random.default_rng(3)
    W1, W2 = (rng.standard_normal((24, 40)).astype(np.float32) for _ in range(2))
    nodes = [helper.make_node("MatMul", ["A", "W1"], ["Y1"]),          # constant: lowered, W1 dropped
             helper.make_node("MatMul", ["A", "W2"], ["Y2"]),          # constant, W2 also gathered: kept
             helper.make_node("Gather", ["W2", "idx"], ["G"]),
             helper.make_node("MatMul", ["Y1", "X"], ["Y3"])]          # B an input: ONNX Runtime's
    inits = [numpy_helper.from_array(W1, "W1"), numpy_helper.from_array(W2, "W2"),
             numpy_helper.from_array(np.array([1], np.int64), "idx")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", 24]),
                                       helper.make_tensor_value_info("X", TensorProto.FLOAT, [40, 5])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("Y2", "G", "Y3")],
                          inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    feeds = {"A": rng.standard_normal((3, 24)).astype(np.float32), "X": rng.standard_normal((40, 5)).astype(np.float32)}
    expected = onnxruntime_backend.session(model).run(None, feeds)
    assert lower_matmul_to_kernel(model, _Tensors())
    kinds = [(n.domain, n.op_type) for n in model.graph.node]
    assert kinds == [(CPU_DOMAIN, "MatMul"), (CPU_DOMAIN, "MatMul"), ("", "Gather"), ("", "MatMul")]
    assert {t.name for t in model.graph.initializer} == {"W2", "idx", "W1/panels", "W2/panels"}
    got = onnxruntime_backend.session(model, kernels=library).run(None, feeds)
    for e, o in zip(expected, got):
        assert np.allclose(e, o, rtol=1e-5, atol=1e-5)
    assert not lower_matmul_to_kernel(model, _Tensors())             # nothing left to lower


def test_float_engine_dir_serves_its_matmuls_on_the_kernel(tiny_root, tmp_path):
    """Built where the AVX-512 kernel runs: no saved graph keeps a constant-weight MatMul of ONNX
    Runtime's, the panels are in optimized.bin (the lowered graphs keep weights.bin's), the dir
    carries the library, and the build's verification passed."""
    if not cpu_kernels.f32_matmul():
        pytest.skip("no AVX-512 here: the build keeps ONNX Runtime's MatMul")
    out = build_engines(tiny_root / "qwen3_5_mtp1", tmp_path / "f32", SMALL, show_progress=False).engine_dir
    assert (out / cpu_kernels.LIBRARY_FILE).is_file() and (out / OPTIMIZED_WEIGHTS).is_file()
    for path in out.glob("*.opt.onnx"):
        model = onnx.load(str(path), load_external_data=False)
        inits = {t.name for t in model.graph.initializer}
        ours = [n for n in model.graph.node if (n.domain, n.op_type) == (CPU_DOMAIN, "MatMul")]
        assert ours and not [n for n in model.graph.node if n.op_type == "MatMul" and n.domain == ""
                             and n.input[1] in inits], path.name
        lowered = onnx.load(str(out / path.name.replace(".opt.onnx", ".onnx")), load_external_data=False)
        assert not any(n.domain == CPU_DOMAIN and n.op_type == "MatMul" for n in lowered.graph.node)


def _fused_model(W, residual: bool, epsilon: float = 1e-6, swiglu: bool = False, norm: bool = True) -> onnx.ModelProto:
    """One kernel node with the RMS norm folded (W given already scaled), optionally a residual, or
    the MLP's gate (W = [gate | up])."""
    ins = ["A", "B"] + (["R"] if residual else [])
    n = W.shape[1] // 2 if swiglu else W.shape[1]
    attrs = {"rms_norm": 1, "epsilon": epsilon} if norm else {}
    node = helper.make_node("MatMul", ins, ["Y"], domain=CPU_DOMAIN, N=n, **attrs, **({"swiglu": 1} if swiglu else {}))
    inputs = [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", W.shape[0]])]
    if residual:
        inputs.append(helper.make_tensor_value_info("R", TensorProto.FLOAT, ["M", "any"]))   # checked by the kernel
    g = helper.make_graph([node], "mm", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(swiglu_panels(W) if swiglu else weight_panels(W), "B")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(CPU_DOMAIN, 1)])
    m.ir_version = 10
    return m


@pytest.mark.parametrize("norm", [False, True], ids=["gate", "norm+gate"])
def test_swiglu_is_silu_of_the_gate_times_up(library, monkeypatch, norm):
    """y = silu(x W_gate) * (x W_up), x the row or its RMS-normalized form, against float64 (silu's
    own exp within 1e-5 of the largest output), both kernels bit for bit, every row as if alone;
    I = 40: its last panel pair is partly padding; 19 rows and K = 300: k in three slices."""
    fast_here = cpu_kernels.f32_matmul()
    rng = np.random.default_rng(13)
    K, I, eps = 300, 40, 1e-6
    W = (rng.standard_normal((K, 2 * I)) * 0.2).astype(np.float32)
    A = (rng.standard_normal((19, K)) * 2).astype(np.float32)
    A[2] *= 40                                                           # gates far into silu's tails
    x = A.astype(np.float64)
    if norm:
        x = x / np.sqrt((x**2).mean(axis=1, keepdims=True) + eps)
    g, u = x @ W[:, :I].astype(np.float64), x @ W[:, I:].astype(np.float64)
    exact = g * 0.5 * (1 + np.tanh(g / 2)) * u                            # silu, without overflow
    results = {}
    for portable in ([True, False] if fast_here else [True]):
        monkeypatch.setenv("TANDEM_CPU_KERNELS_PORTABLE", "1" if portable else "0")
        sess = onnxruntime_backend.session(_fused_model(W, False, eps, swiglu=True, norm=norm), kernels=library)
        y = results[portable] = sess.run(None, {"A": A})[0]
        assert y.shape == (19, I) and np.abs(y - exact).max() <= 1e-5 * np.abs(exact).max()
        for m in (0, 2, 9, 18):
            assert np.array_equal(sess.run(None, {"A": A[m : m + 1]})[0][0], y[m])
    if fast_here:
        assert np.array_equal(results[True], results[False])


@pytest.mark.parametrize("residual", [False, True], ids=["norm", "norm+residual"])
def test_rms_norm_and_residual_are_the_norm_the_product_and_the_add(library, monkeypatch, residual):
    """y = A / rms(A) . W + R against float64, both kernels bit for bit, every row as if alone (19
    rows, K = 300: k in slices, the norm and residual after the last)."""
    fast_here = cpu_kernels.f32_matmul()
    rng = np.random.default_rng(11)
    K, N, eps = 300, 45, 1e-6
    W = rng.standard_normal((K, N)).astype(np.float32)
    A = (rng.standard_normal((19, K)) * 3).astype(np.float32)
    feeds = {"A": A, **({"R": rng.standard_normal((19, N)).astype(np.float32)} if residual else {})}
    a64 = A.astype(np.float64)
    exact = (a64 / np.sqrt((a64**2).mean(axis=1, keepdims=True) + eps)) @ W.astype(np.float64)
    if residual:
        exact += feeds["R"]
    results = {}
    for portable in ([True, False] if fast_here else [True]):
        monkeypatch.setenv("TANDEM_CPU_KERNELS_PORTABLE", "1" if portable else "0")
        sess = onnxruntime_backend.session(_fused_model(W, residual, eps), kernels=library)
        y = results[portable] = sess.run(None, feeds)[0]
        assert np.abs(y - exact).max() <= 1e-5 * np.abs(exact).max()
        for m in (0, 5, 10, 18):
            alone = {k: v[m : m + 1] for k, v in feeds.items()}
            assert np.array_equal(sess.run(None, alone)[0][0], y[m])
    if fast_here:
        assert np.array_equal(results[True], results[False])
    if residual:                                                        # a residual of another shape: a clear error
        with pytest.raises(Exception, match="residual's shape"):
            sess.run(None, {"A": A, "R": feeds["R"][:, :40]})


def test_lowering_folds_norms_only_matmuls_read_and_fuses_residual_adds(library):
    """RMSNormalization(X) read by two MatMuls folds into both; a norm something else reads stays;
    a product only an Add of a computed tensor reads takes it as residual, placed where the Add was
    (its residual is computed after the matmul); a product read twice keeps its Add."""
    rng = np.random.default_rng(5)
    K, N = 32, 32
    s1, s2 = (rng.random(K).astype(np.float32) + 0.5 for _ in range(2))
    W1, W2, W3 = (rng.standard_normal((K, N)).astype(np.float32) for _ in range(3))
    nodes = [helper.make_node("RMSNormalization", ["X", "s1"], ["n1"], epsilon=1e-6),
             helper.make_node("MatMul", ["n1", "W1"], ["p1"]),
             helper.make_node("MatMul", ["n1", "W2"], ["p2"]),
             helper.make_node("Mul", ["X", "X"], ["R"]),              # the residual, after p1's matmul
             helper.make_node("Add", ["R", "p1"], ["y1"]),            # fused into p1's matmul
             helper.make_node("Add", ["p2", "X"], ["y2"]),            # p2 is read twice: not fused
             helper.make_node("RMSNormalization", ["y1", "s2"], ["n2"], epsilon=1e-6),
             helper.make_node("MatMul", ["n2", "W3"], ["p3"]),
             helper.make_node("Mul", ["n2", "p3"], ["y3"])]           # n2 read by a Mul: not folded
    inits = [numpy_helper.from_array(a, n) for a, n in ((s1, "s1"), (s2, "s2"), (W1, "W1"), (W2, "W2"), (W3, "W3"))]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", K])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y2", "p2", "y3")],
                          inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    feeds = {"X": rng.standard_normal((5, K)).astype(np.float32)}
    expected = onnxruntime_backend.session(model).run(None, feeds)
    assert lower_matmul_to_kernel(model, _Tensors())
    kinds = [(n.op_type, n.domain) for n in model.graph.node]
    assert kinds.count(("RMSNormalization", "")) == 1 and kinds.count(("Add", "")) == 1
    fused = [n for n in model.graph.node if n.domain == CPU_DOMAIN and len(n.input) == 3]
    assert [n.output[0] for n in fused] == ["y1"] and fused[0].input[0] == "X"
    seen = {"X"} | {t.name for t in model.graph.initializer}
    for node in model.graph.node:                                      # still topologically sorted
        assert set(node.input) <= seen, node.name
        seen.update(node.output)
    assert {"s1", "W1", "W2", "W3"}.isdisjoint(t.name for t in model.graph.initializer)
    got = onnxruntime_backend.session(model, kernels=library).run(None, feeds)
    for e, o in zip(expected, got):
        np.testing.assert_allclose(o, e, rtol=1e-4, atol=1e-4)


def test_lowering_takes_the_mlps_gate_into_the_matmul(library):
    """MatMul -> Split into halves -> QuickGelu(alpha 1) -> Mul becomes one swiglu node (after a
    folded norm too); a QuickGelu with another alpha (not silu) keeps its nodes (its Split goes
    into its matmul node, as any projection's)."""
    rng = np.random.default_rng(17)
    K, I = 32, 24
    s = rng.random(K).astype(np.float32) + 0.5
    W1, W2 = ((rng.standard_normal((K, 2 * I)) * 0.3).astype(np.float32) for _ in range(2))

    def mlp(i, w, alpha):
        return [helper.make_node("MatMul", [f"n{i}", w], [f"p{i}"]),
                helper.make_node("Split", [f"p{i}", "halves"], [f"g{i}", f"u{i}"], axis=-1),
                helper.make_node("QuickGelu", [f"g{i}"], [f"a{i}"], domain="com.microsoft", alpha=alpha),
                helper.make_node("Mul", [f"a{i}", f"u{i}"], [f"y{i}"])]

    nodes = [helper.make_node("RMSNormalization", ["X", "s"], ["n1"], epsilon=1e-6),
             helper.make_node("Identity", ["X"], ["n2"]), *mlp(1, "W1", 1.0), *mlp(2, "W2", 1.702)]
    inits = [numpy_helper.from_array(a, n) for a, n in ((s, "s"), (W1, "W1"), (W2, "W2"),
                                                         (np.array([I, I], np.int64), "halves"))]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", K])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y1", "y2")], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    feeds = {"X": rng.standard_normal((6, K)).astype(np.float32)}
    expected = onnxruntime_backend.session(model).run(None, feeds)
    assert lower_matmul_to_kernel(model, _Tensors())
    kinds = [(n.op_type, n.domain) for n in model.graph.node]
    assert kinds == [("Identity", ""), ("MatMul", CPU_DOMAIN), ("MatMul", CPU_DOMAIN),   # (the other's Split in it)
                     ("QuickGelu", "com.microsoft"), ("Mul", "")]
    gate = model.graph.node[1]
    assert list(gate.input) == ["X", "W1/swiglu_panels*s"] and list(gate.output) == ["y1"]
    got = onnxruntime_backend.session(model, kernels=library).run(None, feeds)
    for e, o in zip(expected, got):
        np.testing.assert_allclose(o, e, rtol=1e-4, atol=1e-5)


def _gated_norm_graph(W, H, G, matmul_node) -> onnx.ModelProto:
    """Gated DeltaNet's output norm before out_proj: Reshape(Mul(RMSNormalization(X, s), QuickGelu(Z)))
    into `matmul_node` (reading "A2", writing "Y"), X and Z [B, T, H, G]."""
    rng = np.random.default_rng(41)
    nodes = [helper.make_node("RMSNormalization", ["X", "s"], ["n"], epsilon=1e-6),
             helper.make_node("QuickGelu", ["Z"], ["a"], domain="com.microsoft", alpha=1.0),
             helper.make_node("Mul", ["n", "a"], ["g"]),
             helper.make_node("Reshape", ["g", "shape"], ["A2"]), matmul_node]
    inits = [numpy_helper.from_array(rng.random(G).astype(np.float32) + 0.5, "s"),
             numpy_helper.from_array(np.array([0, 0, H * G], np.int64), "shape"), *W]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "T", H, G]) for n in ("X", "Z")]
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    return m


def test_gated_norm_before_out_proj_folds_into_the_node(library, monkeypatch):
    """The norm per head, times silu of the gate, reshaped into out_proj: one node reading X and Z
    [B, T, H, G] and writing [B, T, N]; against ONNX Runtime's four nodes and MatMul, both kernels bit
    for bit, every (batch, position) row as if alone."""
    fast_here = cpu_kernels.f32_matmul()
    rng = np.random.default_rng(43)
    H, G, N = 3, 32, 40
    W = rng.standard_normal((H * G, N)).astype(np.float32)
    model = _gated_norm_graph([numpy_helper.from_array(W, "W")], H, G, helper.make_node("MatMul", ["A2", "W"], ["Y"]))
    feeds = {n: (rng.standard_normal((2, 3, H, G)) * 2).astype(np.float32) for n in ("X", "Z")}
    expected = onnxruntime_backend.session(model).run(None, feeds)[0]
    assert lower_matmul_to_kernel(model, _Tensors())
    (node,) = model.graph.node
    assert list(node.input) == ["X", "W/panels", "", "s", "Z"] and list(node.output) == ["Y"]
    results = {}
    for portable in ([True, False] if fast_here else [True]):
        monkeypatch.setenv("TANDEM_CPU_KERNELS_PORTABLE", "1" if portable else "0")
        sess = onnxruntime_backend.session(model, kernels=library)
        y = results[portable] = sess.run(None, feeds)[0]
        assert y.shape == (2, 3, N)
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
        alone = sess.run(None, {k: v[1:2, 2:3] for k, v in feeds.items()})[0]
        assert np.array_equal(alone[0, 0], y[1, 2])
    if fast_here:
        assert np.array_equal(results[True], results[False])
