"""tandem's int4 / int8 matmul kernel (plugins/cpu/matmul_nbits*.cc) against a numpy reference of
its math (the same int8 activations, exact integer dots, float64 sums), both of its kernels (AVX-512
VNNI and the portable loop), row invariance bit for bit, bad inputs, and the build's lowering of
4-bit MatMulNBits to it (export/cpu_kernel_lowering.py) with the exact copy the verification uses."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tandem.engines.backends import onnxruntime_backend
from tandem.engines.backends.onnxruntime_optimized import exact_copy
from tandem.engines.builder import build_engines
from tandem.export.builder import MS_DOMAIN
from tandem.export.cpu_kernel_lowering import CPU_DOMAIN, lower_matmul_nbits_to_kernel
from tandem.export.cpu_matmul_lowering import lower_matmul_to_kernel
from tandem.export.nbits_tiles import tile_weights
from tandem.export.quantize import half_scales
from tandem.plugins import cpu_kernels

from ..engines.test_load_costs import SMALL

# (K, N, bits, block_size, zero points): odd group counts (K 96: 3 groups), blocks of 2 groups,
# N not a multiple of the kernel's 4 or 16 columns, 8 bits with and without zero points; the last
# two over 128 KB of weights, so their tiles go to the pool in several tasks
CASES = [(96, 40, 4, 32, True), (96, 37, 4, 32, False), (256, 70, 4, 64, True), (128, 33, 4, 128, True),
         (96, 40, 8, 32, False), (256, 19, 8, 64, True), (512, 1037, 4, 32, True), (512, 1037, 8, 32, False)]


def _packed(rng, K, N, bits, bs, zero_points):
    """Random weights in MatMulNBits' layout: (q [N, K], scales [N, nb], zeros [N, nb], B, packed zeros)."""
    nb = K // bs
    q = rng.integers(0, 2**bits, size=(N, K)).astype(np.uint8)
    scales = half_scales(rng.random((N, nb)) * 0.02 + 0.001)          # as the quantizer makes them
    zeros = rng.integers(0, 2**bits, size=(N, nb)).astype(np.uint8) if zero_points else None
    if bits == 8:
        return q, scales, zeros, q.reshape(N, nb, bs), None if zeros is None else zeros.reshape(-1)
    B = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(N, nb, bs // 2)        # input 2j low nibble, 2j + 1 high
    packed = None
    if zeros is not None:
        padded = np.zeros((N, (nb + 1) // 2 * 2), np.uint8)
        padded[:, :nb] = zeros
        packed = (padded[:, 0::2] | (padded[:, 1::2] << 4)).reshape(-1)  # block 2i low nibble
    return q, scales, zeros, B, packed


def _model(K, N, bits, bs, B, scales, zeros, domain=CPU_DOMAIN, a_shape=("M", "K")) -> onnx.ModelProto:
    """One MatMulNBits node, ONNX Runtime's (MatMulNBits' layout) or tandem's (its column tiles)."""
    scales = scales.reshape(-1)
    if domain == CPU_DOMAIN:
        B, scales, zeros = tile_weights(B, scales, zeros, N, K, bits, bs)
    inits = [numpy_helper.from_array(B, "B"), numpy_helper.from_array(scales, "scales")]
    if zeros is not None:
        inits.append(numpy_helper.from_array(zeros, "zeros"))
    attrs = dict(K=K, N=N, bits=bits, block_size=bs, **({"accuracy_level": 4} if domain == MS_DOMAIN else {}))
    node = helper.make_node("MatMulNBits", ["A"] + [t.name for t in inits], ["Y"], domain=domain, **attrs)
    g = helper.make_graph([node], "mm", [helper.make_tensor_value_info("A", TensorProto.FLOAT, list(a_shape))],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)])
    m.ir_version = 10
    return m


_TILES = ["B/tiles", "scales/tiles", "zeros/tiles"]      # the lowering's column tiles of B, scales, zeros


def _without_untiling(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """An exact copy's nodes but those that put the weights back in MatMulNBits' layout."""
    return [n for n in model.graph.node if "/untiled_" not in n.name]


def _reference(A, q, scales, zeros, bits, bs) -> np.ndarray:
    """The op's math: A quantized per group of 32 (round half to even of x * 127 / max |x|), exact
    integer dots with the weights less their zero points, scaled in float64."""
    M, K = A.shape
    groups = A.reshape(M, K // 32, 32)
    amax = np.abs(groups).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.rint(groups * inv).astype(np.int64).reshape(M, K)
    sx = (amax / np.float32(127)).astype(np.float32)[:, :, 0].astype(np.float64)        # [M, K / 32]
    z = np.full(scales.shape, 2 ** (bits - 1)) if zeros is None else zeros
    w = q.astype(np.int64) - np.repeat(z.astype(np.int64), bs, axis=1)                  # [N, K]
    dots = np.einsum("mgi,ngi->mng", xq.reshape(M, -1, 32), w.reshape(w.shape[0], -1, 32))   # exact
    ws = np.repeat(scales.astype(np.float64), bs // 32, axis=1)                          # [N, K / 32]
    return np.einsum("mng,ng,mg->mn", dots.astype(np.float64), ws, sx)


@pytest.mark.parametrize("portable", [False, True], ids=["avx512", "portable"])
@pytest.mark.parametrize("K,N,bits,bs,zero_points", CASES, ids=[f"K{c[0]}-N{c[1]}-{c[2]}bit-b{c[3]}-z{int(c[4])}"
                                                                 for c in CASES])
def test_kernel_equals_its_math(library, monkeypatch, portable, K, N, bits, bs, zero_points):
    if not portable and not cpu_kernels.nbits_matmul():
        pytest.skip("no AVX-512 VNNI here: only the portable kernel runs")
    if portable:
        monkeypatch.setenv("TANDEM_CPU_KERNELS_PORTABLE", "1")    # read when the session makes the kernel
    rng = np.random.default_rng(K + N + bits)
    q, scales, zeros, B, packed = _packed(rng, K, N, bits, bs, zero_points)
    sess = onnxruntime_backend.session(_model(K, N, bits, bs, B, scales, packed), kernels=library)
    A = rng.standard_normal((9, K)).astype(np.float32)
    A[3] = 0.0                                                      # an all-zero row: scale 0
    y = sess.run(None, {"A": A})[0]
    ref = _reference(A, q, scales, zeros, bits, bs)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    # rows of a call equal single-row calls bit for bit (tiles of 4 rows and their remainders)
    for m in range(9):
        assert np.array_equal(sess.run(None, {"A": A[m : m + 1]})[0][0], y[m])


def _weights_as_inputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The model with its initializers turned into graph inputs, and the feeds that give them."""
    fed = onnx.ModelProto()
    fed.CopyFrom(model)
    feeds = {t.name: numpy_helper.to_array(t) for t in fed.graph.initializer}
    for name, value in feeds.items():
        fed.graph.input.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype),
                                                             list(value.shape)))
    del fed.graph.initializer[:]
    return fed, feeds


@pytest.mark.parametrize("bits,zero_points", [(4, True), (8, False)])
def test_weights_read_once_equal_weights_read_each_call(library, bits, zero_points):
    """A kernel reads constant inputs once, when it is made (NodeApi, plugins/cpu/kernel_common.h);
    the same weights fed as graph inputs are read through the context each call: the same bits."""
    rng = np.random.default_rng(5)
    q, scales, zeros, B, packed = _packed(rng, 256, 70, bits, 64, zero_points)
    model = _model(256, 70, bits, 64, B, scales, packed)
    fed, feeds = _weights_as_inputs(model)
    A = rng.standard_normal((3, 256)).astype(np.float32)
    once = onnxruntime_backend.session(model, kernels=library).run(None, {"A": A})[0]
    each = onnxruntime_backend.session(fed, kernels=library).run(None, {"A": A, **feeds})[0]
    assert np.array_equal(once, each)
    assert np.abs(once - _reference(A, q, scales, zeros, bits, 64)).max() <= 1e-5 * np.abs(once).max()


@pytest.mark.parametrize("portable", [False, True], ids=["avx512", "portable"])
def test_float16_scales_across_their_range(library, monkeypatch, portable):
    """Scales from float16's subnormals (6e-8) to its normal range, as tiny weights make them: both
    kernels read the float16 tiles to the same values as the reference's float32 scales."""
    if not portable and not cpu_kernels.nbits_matmul():
        pytest.skip("no AVX-512 VNNI here: only the portable kernel runs")
    if portable:
        monkeypatch.setenv("TANDEM_CPU_KERNELS_PORTABLE", "1")
    rng = np.random.default_rng(11)
    q, _, zeros, B, packed = _packed(rng, 128, 40, 4, 32, True)
    scales = half_scales(10.0 ** rng.uniform(-7.5, -2, (40, 4)))
    assert (scales < 2.0**-14).any() and (scales >= 2.0**-14).any()     # subnormal and normal float16s
    A = rng.standard_normal((3, 128)).astype(np.float32)
    y = onnxruntime_backend.session(_model(128, 40, 4, 32, B, scales, packed), kernels=library).run(None, {"A": A})[0]
    ref = _reference(A, q, scales, zeros, 4, 32)
    assert np.all(np.abs(y - ref) <= 1e-5 * np.abs(ref).max(axis=0, keepdims=True) + 1e-30)


def test_kernel_is_as_close_to_float_weights_as_onnxruntimes(library):
    """The same activation quantization as MLAS's at block 32: the error against float32 weights is
    the same to three digits."""
    rng = np.random.default_rng(1)
    K, N = 256, 96
    q, scales, zeros, B, packed = _packed(rng, K, N, 4, 32, True)
    A = rng.standard_normal((4, K)).astype(np.float32)
    exact = A.astype(np.float64) @ ((q.astype(np.float64) - np.repeat(zeros, 32, axis=1))
                                    * np.repeat(scales, 32, axis=1)).T
    ours = onnxruntime_backend.session(_model(K, N, 4, 32, B, scales, packed), kernels=library).run(None, {"A": A})[0]
    mlas = onnxruntime_backend.session(_model(K, N, 4, 32, B, scales, packed, MS_DOMAIN)).run(None, {"A": A})[0]
    err = [np.abs(y - exact).max() / np.abs(exact).max() for y in (ours, mlas)]
    assert err[0] < 2e-2 and abs(err[0] - err[1]) <= 1e-3 * err[1] + 1e-7


def test_bad_weights_fail_that_call_with_a_clear_error(library):
    rng = np.random.default_rng(2)
    q, scales, zeros, B, packed = _packed(rng, 96, 40, 4, 32, True)
    bad = _model(96, 40, 4, 32, B, scales, packed)
    tiles = numpy_helper.to_array(bad.graph.initializer[0])
    bad.graph.initializer[0].CopyFrom(numpy_helper.from_array(tiles[:, :8], "B"))   # 2 of the 3 blocks
    with pytest.raises(Exception, match="B is not"):
        onnxruntime_backend.session(bad, kernels=library).run(None, {"A": np.ones((1, 96), np.float32)})
    good = onnxruntime_backend.session(_model(96, 40, 4, 32, B, scales, packed, a_shape=("M", "any")),
                                       kernels=library)
    with pytest.raises(Exception, match="last dimension is not the node's K"):
        good.run(None, {"A": np.ones((1, 64), np.float32)})
    assert good.run(None, {"A": np.ones((2, 96), np.float32)})[0].shape == (2, 40)   # the next call works


def test_lowering_takes_level4_nodes_and_the_exact_copy_undoes_it(tmp_path):
    """The lowering tiles the weights (ONNX Runtime's layout leaves the graph); the exact copy
    untiles them for ONNX Runtime's node at level 0: equal to that node on the original weights."""
    rng = np.random.default_rng(3)
    models, exact = {}, {}
    for name, bits in (("int4", 4), ("int8", 8), ("level0", 8)):
        q, scales, zeros, B, packed = _packed(rng, 96, 40, bits, 32, bits == 4)
        models[name], exact[name] = (_model(96, 40, bits, 32, B, scales, packed, MS_DOMAIN) for _ in range(2))
        next(a for a in exact[name].graph.node[0].attribute if a.name == "accuracy_level").i = 0
    level = next(a for a in models["level0"].graph.node[0].attribute if a.name == "accuracy_level")
    level.i = 0                                                      # float compute: not the kernel's math
    assert lower_matmul_nbits_to_kernel(models["int4"]) and lower_matmul_nbits_to_kernel(models["int8"])
    assert not lower_matmul_nbits_to_kernel(models["level0"])
    # scales float16 does not hold (not tandem's quantizer): the kernel's tiles could not keep them
    _, scales, _, B, _ = _packed(rng, 96, 40, 8, 32, False)
    foreign = _model(96, 40, 8, 32, B, scales * np.float32(1 + 2**-12), None, MS_DOMAIN)
    assert not lower_matmul_nbits_to_kernel(foreign) and foreign.graph.node[0].domain == MS_DOMAIN
    for name, bits in (("int4", 4), ("int8", 8)):
        node = models[name].graph.node[0]
        assert node.domain == CPU_DOMAIN and {a.name for a in node.attribute} == {"K", "N", "bits", "block_size"}
        weights = ("B", "scales", "zeros")[: len(node.input) - 1]
        assert {t.name for t in models[name].graph.initializer} == {f"{w}/tiles" for w in weights}
        path = tmp_path / f"{name}.opt.onnx"
        onnx.save(models[name], str(path))
        copy = onnx.load(str(exact_copy(path)))
        (mm,) = [n for n in copy.graph.node if n.op_type == "MatMulNBits"]
        attrs = {a.name: a.i for a in mm.attribute}
        assert mm.domain == MS_DOMAIN and attrs["accuracy_level"] == 0 and attrs["bits"] == bits
        A = {"A": rng.standard_normal((3, 96)).astype(np.float32)}
        np.testing.assert_array_equal(onnxruntime_backend.session(copy, optimized=True).run(None, A)[0],
                                      onnxruntime_backend.session(exact[name]).run(None, A)[0])


def test_leaving_int4_to_onnxruntime_is_part_of_the_backends_versions(monkeypatch):
    """TANDEM_CPU_KERNELS_PORTABLE=1 changes what the build makes (MLAS's int4 matmuls), not the
    library: the versions must differ, or a later build would reuse the other kind of dir."""
    if not cpu_kernels.nbits_matmul():
        pytest.skip("no AVX-512 VNNI here: the build never moves int4 matmuls")
    before = onnxruntime_backend.versions()["cpu_kernels"]
    monkeypatch.setenv("TANDEM_CPU_KERNELS_PORTABLE", "1")
    assert onnxruntime_backend.versions()["cpu_kernels"] == f"{before}-portable"


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_quantized_engine_dir_serves_its_matmuls_on_the_kernel(tiny_root, tmp_path, weights):
    """Built where the fast kernel runs: every MatMulNBits of every saved graph is the kernel's,
    the dir carries the library, and the build's verification passed."""
    if not cpu_kernels.nbits_matmul():
        pytest.skip("no AVX-512 VNNI here: the build keeps ONNX Runtime's MatMulNBits")
    out = tmp_path / weights
    build_engines(tiny_root / "qwen3_5_mtp1", out, SMALL.__class__(**{**SMALL.__dict__, "weights": weights}),
                  show_progress=False)
    assert (out / cpu_kernels.LIBRARY_FILE).is_file()
    for path in out.glob("*.opt.onnx"):
        kinds = {(n.domain, n.op_type) for n in onnx.load(str(path), load_external_data=False).graph.node}
        assert (CPU_DOMAIN, "MatMulNBits") in kinds and (MS_DOMAIN, "MatMulNBits") not in kinds, path.name


def _fused_nbits(K, N, B, scales, zeros, norm: bool, residual: bool) -> onnx.ModelProto:
    """tandem's 4-bit node with the RMS norm before it (scale input 5) and / or a residual (input 4)."""
    model = _model(K, N, 4, 32, B, scales, zeros)
    node, graph = model.graph.node[0], model.graph
    node.input.extend([""] * (6 - len(node.input)))
    if residual:
        node.input[4] = "R"
        graph.input.append(helper.make_tensor_value_info("R", TensorProto.FLOAT, ["M", "any"]))
    if norm:
        node.input[5] = "w"
        node.attribute.extend([helper.make_attribute("rms_norm", 1), helper.make_attribute("epsilon", 1e-6)])
        graph.initializer.append(numpy_helper.from_array((np.arange(K) % 127 + 1).astype(np.float32) / 127, "w"))
    return model


def test_norm_and_residual_in_the_int4_node(library):
    """The norm: rows of equal magnitude and a scale of j / 127 make the int8 activations of A / rms
    times the scale exact whatever r's last bit, so the result is the op's math on the float64
    normalized rows. The residual: the same node without it, plus the residual, bit for bit."""
    if not cpu_kernels.nbits_matmul():
        pytest.skip("no AVX-512 VNNI here: the build never makes these nodes")
    rng = np.random.default_rng(21)
    K, N = 128, 40
    q, scales, zeros, B, packed = _packed(rng, K, N, 4, 32, True)
    A = (np.where(rng.random((5, K)) < 0.5, -1.0, 1.0) * rng.uniform(0.5, 3, (5, 1))).astype(np.float32)
    R = rng.standard_normal((5, N)).astype(np.float32)
    w = (np.arange(K) % 127 + 1).astype(np.float64) / 127
    normed = A.astype(np.float64) / np.sqrt((A.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
    ref = _reference(normed.astype(np.float32), q, scales, zeros, 4, 32)
    sess = onnxruntime_backend.session(_fused_nbits(K, N, B, scales, packed, True, True), kernels=library)
    y = sess.run(None, {"A": A, "R": R})[0]
    assert np.abs(y - R - ref).max() <= 1e-5 * np.abs(ref).max()
    plain = onnxruntime_backend.session(_fused_nbits(K, N, B, scales, packed, True, False), kernels=library)
    assert np.array_equal(y, plain.run(None, {"A": A})[0] + R)
    for m in range(5):                                               # every row as if alone
        assert np.array_equal(sess.run(None, {"A": A[m : m + 1], "R": R[m : m + 1]})[0][0], y[m])
    with pytest.raises(Exception, match="residual's shape"):
        sess.run(None, {"A": A, "R": R[:, :7]})


def test_lowering_folds_norms_and_residuals_into_int4_nodes_and_the_exact_copy_undoes_it(library, tmp_path):
    rng = np.random.default_rng(23)
    K, N = 64, 64
    q, scales, zeros, B, packed = _packed(rng, K, N, 4, 32, True)
    norm_scale = rng.random(K).astype(np.float32) + 0.5

    def graph(level):
        mm = helper.make_node("MatMulNBits", ["n", "B", "scales", "zeros"], ["p"], domain=MS_DOMAIN, K=K, N=N, bits=4,
                              block_size=32, accuracy_level=level)
        nodes = [helper.make_node("RMSNormalization", ["X", "s"], ["n"], epsilon=1e-6), mm,
                 helper.make_node("Add", ["X", "p"], ["Y"])]
        inits = [numpy_helper.from_array(B, "B"), numpy_helper.from_array(scales.reshape(-1), "scales"),
                 numpy_helper.from_array(packed, "zeros"),
                 numpy_helper.from_array(norm_scale, "s")]
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", K])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(MS_DOMAIN, 1)])
        m.ir_version = 10
        return m

    model, exact = graph(4), graph(0)                                  # exact: the same weights, at level 0
    assert lower_matmul_nbits_to_kernel(model)
    assert lower_matmul_to_kernel(model, None)                        # no float matmul: tensors unused
    (node,) = model.graph.node
    assert node.domain == CPU_DOMAIN and list(node.input) == ["X", *_TILES, "X", "s"]
    assert list(node.output) == ["Y"]
    path = tmp_path / "g.opt.onnx"
    onnx.save(model, str(path))
    copy = onnx.load(str(exact_copy(path)))
    assert [(n.op_type, n.domain) for n in _without_untiling(copy)] == [
        ("RMSNormalization", ""), ("MatMulNBits", MS_DOMAIN), ("Add", "")]
    feeds = {"X": rng.standard_normal((3, K)).astype(np.float32)}
    np.testing.assert_array_equal(onnxruntime_backend.session(copy).run(None, feeds)[0],
                                  onnxruntime_backend.session(exact).run(None, feeds)[0])
    fused = onnxruntime_backend.session(model, kernels=library).run(None, feeds)[0]   # int8 activations: close
    reference = onnxruntime_backend.session(exact).run(None, feeds)[0]
    np.testing.assert_allclose(fused, reference, atol=0.05 * np.abs(fused).max())


def test_the_mlps_gate_in_the_int4_node_and_back(library, tmp_path):
    """MatMulNBits -> Split into halves -> QuickGelu(alpha 1) -> Mul becomes one node with swiglu:
    its output is silu(gate) * up of the plain node's product (every row as if alone); the exact
    copy restores the four nodes, equal to the original at level 0 bit for bit."""
    if not cpu_kernels.nbits_matmul():
        pytest.skip("no AVX-512 VNNI here: the build never makes these nodes")
    rng = np.random.default_rng(29)
    K, I = 64, 24
    q, scales, zeros, B, packed = _packed(rng, K, 2 * I, 4, 32, True)

    def graph(level):
        nodes = [helper.make_node("MatMulNBits", ["X", "B", "scales", "zeros"], ["p"], domain=MS_DOMAIN, K=K,
                                  N=2 * I, bits=4, block_size=32, accuracy_level=level),
                 helper.make_node("Split", ["p", "halves"], ["g", "u"], axis=-1),
                 helper.make_node("QuickGelu", ["g"], ["a"], domain=MS_DOMAIN, alpha=1.0),
                 helper.make_node("Mul", ["a", "u"], ["Y"])]
        inits = [numpy_helper.from_array(B, "B"), numpy_helper.from_array(scales.reshape(-1), "scales"),
                 numpy_helper.from_array(packed, "zeros"),
                 numpy_helper.from_array(np.array([I, I], np.int64), "halves")]
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", K])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS_DOMAIN, 1)])
        m.ir_version = 10
        return m

    model, exact = graph(4), graph(0)
    assert lower_matmul_nbits_to_kernel(model) and lower_matmul_to_kernel(model, None)
    (node,) = model.graph.node
    assert node.output[0] == "Y" and any(a.name == "swiglu" and a.i == 1 for a in node.attribute)
    X = (rng.standard_normal((5, K)) * 2).astype(np.float32)
    y = onnxruntime_backend.session(model, kernels=library).run(None, {"X": X})[0]
    plain = _model(K, 2 * I, 4, 32, B, scales, packed)
    product = onnxruntime_backend.session(plain, kernels=library).run(None, {"A": X})[0].astype(np.float64)
    g, u = product[:, :I], product[:, I:]
    assert y.shape == (5, I) and np.abs(y - g * 0.5 * (1 + np.tanh(g / 2)) * u).max() <= 1e-5 * np.abs(y).max()
    sess = onnxruntime_backend.session(model, kernels=library)
    for m in range(5):
        assert np.array_equal(sess.run(None, {"X": X[m : m + 1]})[0][0], y[m])
    path = tmp_path / "g.opt.onnx"
    onnx.save(model, str(path))
    copy = onnx.load(str(exact_copy(path)))
    assert [n.op_type for n in _without_untiling(copy)] == ["MatMulNBits", "Split", "QuickGelu", "Mul"]
    np.testing.assert_array_equal(onnxruntime_backend.session(copy).run(None, {"X": X})[0],
                                  onnxruntime_backend.session(exact).run(None, {"X": X})[0])


def test_gated_norm_before_an_int4_out_proj_and_back(library, tmp_path):
    """The same fold into tandem's MatMulNBits: the node reads X and Z; the exact copy restores the
    norm, QuickGelu, Mul and a Reshape to [..., K], equal to the original at level 0 bit for bit."""
    if not cpu_kernels.nbits_matmul():
        pytest.skip("no AVX-512 VNNI here: the build never makes these nodes")
    from .test_cpu_matmul_f32 import _gated_norm_graph
    rng = np.random.default_rng(47)
    H, G, N = 2, 32, 40
    q, scales, zeros, B, packed = _packed(rng, H * G, N, 4, 32, True)
    weights = [numpy_helper.from_array(B, "B"), numpy_helper.from_array(scales.reshape(-1), "scales"),
               numpy_helper.from_array(packed, "zeros")]

    def graph(level):
        mm = helper.make_node("MatMulNBits", ["A2", "B", "scales", "zeros"], ["Y"], domain=MS_DOMAIN, K=H * G, N=N,
                              bits=4, block_size=32, accuracy_level=level)
        return _gated_norm_graph(weights, H, G, mm)

    model, exact = graph(4), graph(0)
    assert lower_matmul_nbits_to_kernel(model) and lower_matmul_to_kernel(model, None)
    (node,) = model.graph.node
    assert list(node.input) == ["X", *_TILES, "", "s", "Z"]
    feeds = {n: (rng.standard_normal((2, 3, H, G)) * 2).astype(np.float32) for n in ("X", "Z")}
    y = onnxruntime_backend.session(model, kernels=library).run(None, feeds)[0]
    path = tmp_path / "g.opt.onnx"
    onnx.save(model, str(path))
    copy = onnx.load(str(exact_copy(path)))
    reference = onnxruntime_backend.session(exact).run(None, feeds)[0]
    np.testing.assert_array_equal(onnxruntime_backend.session(copy).run(None, feeds)[0], reference)
    assert y.shape == reference.shape == (2, 3, N)
    np.testing.assert_allclose(y, reference, atol=0.05 * np.abs(reference).max())   # int8 activations: close
