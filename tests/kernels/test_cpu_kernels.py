"""tandem's CPU kernel for Gated DeltaNet (plugins/cpu/gated_deltanet.cc) against a float64 numpy
reference of the delta rule, row by row; its lowering (export/cpu_kernel_lowering.py) against the
function body; and the engine dirs that carry it (or fall back without a compiler)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tandem.engines.backends import onnxruntime_backend, onnxruntime_files
from tandem.engines.backends.onnxruntime_files import optimized_name
from tandem.engines.builder import build_engines
from tandem.engines.manifest import read_manifest
from tandem.export.builder import OPSET, TANDEM_DOMAIN
from tandem.export.cpu_kernel_lowering import CPU_DOMAIN
from tandem.export.lowering import lower_for_onnxruntime
from tandem.export.ops import gated_deltanet
from tandem.export.ops import paged_sparse_attention as psa
from tandem.plugins import cpu_kernels

from ..engines.test_load_costs import SMALL

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _kernel_model(row_states: bool) -> onnx.ModelProto:
    info = helper.make_tensor_value_info
    outs = ["o", "s"] + (["rs"] if row_states else [])
    node = helper.make_node("GatedDeltaNet", ["q", "k", "v", "g", "b", "pool", "slots", "n"], outs, domain=CPU_DOMAIN,
                            scale=0.25)
    g = helper.make_graph([node], "k", [info("q", F, None), info("k", F, None), info("v", F, None),
                                        info("g", F, None), info("b", F, None), info("pool", F, None),
                                        info("slots", I64, None), info("n", I64, None)],
                          [info(o, F, None) for o in outs])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(CPU_DOMAIN, 1)])
    m.ir_version = 10
    return m


def _session(model: onnx.ModelProto, library):
    return onnxruntime_backend.session(model, kernels=library)


def _inputs(rng, B, W, hk, hv, dk, dv, pool_rows):
    unit = lambda x: (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)  # noqa: E731
    return {"q": unit(rng.standard_normal((B, W, hk, dk))), "k": unit(rng.standard_normal((B, W, hk, dk))),
            "v": rng.standard_normal((B, W, hv, dv)).astype(np.float32),
            "g": -rng.random((B, W, hv)).astype(np.float32), "b": rng.random((B, W, hv)).astype(np.float32),
            "pool": rng.standard_normal((pool_rows, hv, dk, dv)).astype(np.float32)}


def _reference(f, slots, rows, scale=0.25):
    """The delta rule in float64: (output, final state, state after each row)."""
    B, W, hk, _ = f["q"].shape
    hv = f["v"].shape[2]
    s = f["pool"][slots].astype(np.float64)
    out, per_row = np.zeros(f["v"].shape), np.zeros((B, W, *s.shape[1:]))
    for b in range(B):
        for t in range(W):
            for h in range(hv):
                q, k, v = f["q"][b, t, h // (hv // hk)], f["k"][b, t, h // (hv // hk)], f["v"][b, t, h]
                if t < rows[b]:
                    s[b, h] *= np.exp(f["g"][b, t, h])
                    s[b, h] += np.outer(k, f["b"][b, t, h] * (v - s[b, h].T @ k))
                out[b, t, h] = scale * s[b, h].T @ q
                per_row[b, t, h] = s[b, h]
    return out, s, per_row


@pytest.mark.parametrize("dims", [(3, 4, 2, 4, 16, 16), (2, 3, 1, 2, 8, 64), (2, 2, 2, 2, 4, 128)],
                         ids=["generic-dv", "dv64", "dv128"])
def test_kernel_equals_the_delta_rule(library, dims):
    """Slots read out of order from a larger pool; rows past state_rows (0 for one sequence) leave
    the state as it is and still produce outputs; value heads share key heads (Hv = 2 Hk)."""
    B, W, hk, hv, dk, dv = dims
    rng = np.random.default_rng(sum(dims))
    f = _inputs(rng, B, W, hk, hv, dk, dv, pool_rows=B + 2)
    slots, rows = np.arange(B + 1, 0, -1, dtype=np.int64)[:B], np.array([W, 1, 0][:B], np.int64)
    got = _session(_kernel_model(True), library).run(None, {**f, "slots": slots, "n": rows})
    for g, want in zip(got, _reference(f, slots, rows)):
        np.testing.assert_allclose(g, want, rtol=0, atol=2e-5)


def test_a_row_of_a_call_equals_single_row_calls_bit_for_bit(library):
    """Row invariance: the state and output of row t of a W-row call are those of t + 1 one-row calls."""
    rng = np.random.default_rng(7)
    f = _inputs(rng, 2, 4, 2, 4, 16, 128, pool_rows=2)
    sess, slots = _session(_kernel_model(True), library), np.arange(2, dtype=np.int64)
    out, _, per_row = sess.run(None, {**f, "slots": slots, "n": np.full(2, 4, np.int64)})
    pool = f["pool"].copy()
    for t in range(4):
        one = {k: v[:, t:t + 1] for k, v in f.items() if k != "pool"}
        o, pool, _ = sess.run(None, {**one, "pool": pool, "slots": slots, "n": np.ones(2, np.int64)})
        assert np.array_equal(o[:, 0], out[:, t]) and np.array_equal(pool, per_row[:, t])


@pytest.mark.parametrize("dv", [64, 128, 256])
@pytest.mark.parametrize("emit_output", [1, 0])
def test_delta_rule_rows_portable_and_avx512_give_the_same_bits(library, monkeypatch, dv, emit_output):
    """The AVX-512 rows (head dims 64, 128, 256) against the portable ones, operation for operation:
    updated rows, rows past state_rows (the output from the state as it is), the state-only replay."""
    if not cpu_kernels.f32_matmul():
        pytest.skip("no AVX-512 here: both runs would take the portable rows")
    rng = np.random.default_rng(dv + emit_output)
    f = _inputs(rng, 3, 3, 2, 4, 32, dv, pool_rows=4)
    feeds = {**f, "slots": np.array([3, 0, 2], np.int64), "n": np.array([3, 1, 0], np.int64)}
    model = _kernel_model(True)
    model.graph.node[0].attribute.append(helper.make_attribute("emit_output", emit_output))
    fast = _session(model, library).run(None, feeds)
    monkeypatch.setenv("TANDEM_CPU_KERNELS_PORTABLE", "1")        # read when a session makes its kernels
    portable = _session(model, library).run(None, feeds)
    kept = slice(0, 3) if emit_output else slice(1, 2)    # a replay writes its final state only
    for a, b in zip(fast[kept], portable[kept]):
        assert np.array_equal(a, b)
    if emit_output:
        for got, want in zip(fast, _reference(f, feeds["slots"], feeds["n"])):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_final_state_written_over_its_own_pool_rows(library):
    """The runtime binds a committing call's state output to the pool rows it reads (consecutive
    slots): updating in place gives the same state as a separate output buffer."""
    rng = np.random.default_rng(3)
    f = _inputs(rng, 2, 3, 2, 4, 16, 64, pool_rows=4)
    slots, rows = np.array([1, 2], np.int64), np.array([3, 2], np.int64)
    sess = _session(_kernel_model(False), library)
    want = sess.run(None, {**f, "slots": slots, "n": rows})
    pool = f["pool"].copy()
    binding = sess.io_binding()
    for name, value in {**f, "pool": pool, "slots": slots, "n": rows}.items():
        binding.bind_cpu_input(name, value)
    out = np.empty_like(want[0])
    binding.bind_output("o", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
    binding.bind_output("s", "cpu", 0, np.float32, [2, 4, 16, 64], pool[1:3].ctypes.data)   # the pool's rows
    sess.run_with_iobinding(binding)
    assert np.array_equal(out, want[0]) and np.array_equal(pool[1:3], want[1])
    assert np.array_equal(pool[[0, 3]], f["pool"][[0, 3]])                                   # other rows untouched


def test_a_bad_slot_fails_that_call_with_a_clear_error(library):
    rng = np.random.default_rng(1)
    f = _inputs(rng, 1, 1, 1, 1, 8, 16, pool_rows=2)
    sess = _session(_kernel_model(False), library)
    with pytest.raises(Exception, match="a state slot is outside the pool"):
        sess.run(None, {**f, "slots": np.array([5], np.int64), "n": np.ones(1, np.int64)})
    assert sess.run(None, {**f, "slots": np.array([1], np.int64), "n": np.ones(1, np.int64)})[0].shape == (1, 1, 1, 16)


def _gdn_graph(emit_rows: bool, final_read: bool = True) -> onnx.ModelProto:
    """GatedDeltaNet over Gather(pool, slots), and (emit_rows) the verify's pick of the state after
    row a: GatherND(row_states, a [B, 1], batch_dims=1); final_read False: nothing reads the final
    state (as in the verify graphs)."""
    info = helper.make_tensor_value_info
    fn = gated_deltanet.make_function(emit_row_states=emit_rows)
    nodes = [helper.make_node("Gather", ["pool", "slots"], ["s0"], axis=0),
             helper.make_node(gated_deltanet.OP_TYPE, ["q", "k", "v", "g", "b", "s0", "n"],
                              ["o", "s"] + (["rs"] if emit_rows else []), domain=TANDEM_DOMAIN, name="GatedDeltaNet",
                              scale=0.25, num_key_heads=2, num_value_heads=4)]
    outputs = [info("o", F, None)] + ([info("s", F, None)] if final_read else [])
    inputs = [info(n, F, None) for n in ("q", "k", "v", "g", "b", "pool")] + [info("slots", I64, None),
                                                                             info("n", I64, None)]
    if emit_rows:
        nodes.append(helper.make_node("GatherND", ["rs", "a"], ["picked"], batch_dims=1))
        inputs.append(info("a", I64, None))
        outputs.append(info("picked", F, None))
    m = helper.make_model(helper.make_graph(nodes, "gdn", inputs, outputs),
                          opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(TANDEM_DOMAIN, 1)],
                          functions=[fn])
    m.ir_version = 10
    return m


@pytest.mark.parametrize("emit_rows,final_read", [(False, True), (True, True), (True, False)],
                         ids=["decode", "verify-pick", "verify-pick-no-final"])
def test_lowering_to_the_kernel_equals_the_function_body(library, emit_rows, final_read):
    """The pick becomes a second kernel node over rows 0..a that computes the state only; no Gather
    of the states is left; a final state nothing reads is not written (scratch in the kernel)."""
    rng = np.random.default_rng(11)
    f = _inputs(rng, 3, 4, 2, 4, 16, 16, pool_rows=5)
    f.update(slots=np.array([4, 0, 2], np.int64), n=np.array([4, 3, 0], np.int64))
    if emit_rows:
        f["a"] = np.array([[2], [3], [0]], np.int64)
    model = _gdn_graph(emit_rows, final_read)
    lowered = lower_for_onnxruntime(model, cpu_kernels=True)
    kernels = [n for n in lowered.graph.node if n.domain == CPU_DOMAIN]
    assert [n.op_type for n in kernels] == ["GatedDeltaNet"] * (1 + emit_rows)
    assert (kernels[0].output[1] == "") == (not final_read)
    assert not any(n.op_type in ("Gather", "GatherND") for n in lowered.graph.node)
    body = onnxruntime_backend.session(model).run(None, f)
    got = _session(lowered, library).run(None, f)
    for g, want in zip(got, body):
        np.testing.assert_allclose(g, want, rtol=0, atol=2e-5)
    if emit_rows:   # the pick equals the kernel's own row state at row a, bit for bit
        _, _, per_row = _session(_kernel_model(True), library).run(
            None, {k: f[k] for k in ("q", "k", "v", "g", "b", "pool", "slots")} | {"n": f["n"]})
        assert np.array_equal(got[-1], per_row[np.arange(3), f["a"][:, 0]])


def test_engine_dir_carries_the_library_its_optimized_graphs_use(engine_dirs, library):
    engine_dir = engine_dirs["qwen3_5_mtp3"]
    manifest = read_manifest(engine_dir)
    assert cpu_kernels.LIBRARY_FILE in manifest["files"]
    with_gdn = 0
    for file in {r["file"] for r in manifest["engines"]}:
        served = onnx.load(str(engine_dir / optimized_name(file)), load_external_data=False)
        lowered = onnx.load(str(engine_dir / file), load_external_data=False)
        assert not any(n.domain == CPU_DOMAIN for n in lowered.graph.node)    # the CUDA provider's input
        if any(n.op_type == "LinearAttention" for n in lowered.graph.node):  # the graphs with Gated DeltaNet
            with_gdn += 1
            assert any(n.domain == CPU_DOMAIN for n in served.graph.node), file
            assert not any(n.op_type == "LinearAttention" for n in served.graph.node), file
    assert with_gdn >= 3   # the target step, verify and prefill graphs at least


def test_without_a_compiler_the_build_uses_onnxruntime_kernels(tiny_root, tmp_path, monkeypatch):
    """No C++ compiler: the build still verifies and serves, on LinearAttention, with no library."""
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    out = tmp_path / "out"
    build_engines(tiny_root / "qwen3_5_mtp1", out, SMALL, show_progress=False)
    assert not (out / cpu_kernels.LIBRARY_FILE).exists()
    served = onnx.load(str(out / optimized_name(read_manifest(out)["engines"][0]["file"])), load_external_data=False)
    assert not any(n.domain == CPU_DOMAIN for n in served.graph.node)
    assert any(n.op_type == "LinearAttention" for n in served.graph.node)
    assert onnxruntime_files.engine_library(out) is None


# ---- ai.tandem.cpu::PagedAttention ------------------------------------------------------------

PAGE = 4


def _attention_graph(kernel: bool, window: int) -> onnx.ModelProto:
    """Dense PagedSparseAttention (selected: a constant with K = 0) as the exporter emits it, or
    its kernel lowering (lower_for_onnxruntime(..., cpu_kernels=True))."""
    info = helper.make_tensor_value_info
    names = ["q", "k", "v", "kc", "vc", "tables", "ctx"]
    inputs = [info(n, F, None) for n in names[:5]] + [info("tables", I64, None), info("ctx", I64, None)]
    empty = helper.make_tensor("selected", I64, [1, 1, 0], [])
    node = helper.make_node(psa.OP_TYPE, [*names, "selected"], ["o"], domain=TANDEM_DOMAIN, name="attn",
                            scale=0.3, sliding_window=window)
    m = helper.make_model(helper.make_graph([node], "attn", inputs, [info("o", F, None)], [empty]),
                          opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(TANDEM_DOMAIN, 1)],
                          functions=[psa.make_function()])
    m.ir_version = 10
    return lower_for_onnxruntime(m, cpu_kernels=True) if kernel else m


def _attention_inputs(rng, ctx, W, hq=4, hkv=2, d=24, pages=16):
    B = len(ctx)
    table_width = max(-(-(c + W) // PAGE) for c in ctx)
    return {"q": rng.standard_normal((B, W, hq, d)).astype(np.float32),
            "k": rng.standard_normal((B, W, hkv, d)).astype(np.float32),
            "v": rng.standard_normal((B, W, hkv, d)).astype(np.float32),
            "kc": rng.standard_normal((pages, PAGE, hkv, d)).astype(np.float32),
            "vc": rng.standard_normal((pages, PAGE, hkv, d)).astype(np.float32),
            "tables": rng.permutation(pages)[:B * table_width].reshape(B, table_width).astype(np.int64),
            "ctx": np.array(ctx, np.int64)}


# head dim 24 and 2 query heads per KV head: the portable rows (not a multiple of 16); head dim 32
# and 4 per KV head: the AVX-512 rows where the CPU has them, over contexts past 16 positions and
# their tails
# "long": past the kernel's 512-position blocks, its row tests crossing a block boundary within the call
SHAPES = {"d24-g2": dict(hq=4, d=24, ctx=[0, 5, 9]), "d32-g4": dict(hq=8, d=32, ctx=[0, 21, 37]),
          "d48-g6": dict(hq=12, d=48, ctx=[0, 21, 37]),      # a group of 4 heads and one of 2; 48 values
          "long": dict(hq=8, d=32, ctx=[0, 530, 1100], rows_ctx=[510, 1022], pages=900)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [0, 3], ids=["full", "window3"])
@pytest.mark.parametrize("W", [1, 3])
def test_attention_kernel_equals_the_function_body(library, W, window, shape):
    """GQA, scattered pages, a sequence with no committed context."""
    s = SHAPES[shape]
    f = _attention_inputs(np.random.default_rng(W + window), ctx=s["ctx"], W=W, hq=s["hq"], d=s["d"],
                          pages=s.get("pages", 48))
    lowered = _attention_graph(True, window)
    assert [n.op_type for n in lowered.graph.node] == ["PagedAttention"]
    want = onnxruntime_backend.session(_attention_graph(False, window)).run(None, f)[0]
    got = _session(lowered, library).run(None, f)[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_attention_row_equals_the_decode_step_at_its_position_bit_for_bit(library, shape):
    """Row w of a 3-row call == a 1-row call at context + w with rows 0..w-1 committed to the pages."""
    s = SHAPES[shape]
    f = _attention_inputs(np.random.default_rng(5), ctx=s.get("rows_ctx", [6, 30]), W=3, hq=s["hq"], d=s["d"],
                          pages=s.get("pages", 32))
    sess = _session(_attention_graph(True, 0), library)
    rows = sess.run(None, f)[0]
    kc, vc = f["kc"].copy(), f["vc"].copy()
    for w in range(3):
        step = {**f, "q": f["q"][:, w:w + 1], "k": f["k"][:, w:w + 1], "v": f["v"][:, w:w + 1], "kc": kc, "vc": vc,
                "ctx": f["ctx"] + w}
        assert np.array_equal(sess.run(None, step)[0][:, 0], rows[:, w])
        for b, pos in enumerate(f["ctx"] + w):          # commit row w at its position
            page, slot = f["tables"][b, pos // PAGE], pos % PAGE
            kc[page, slot], vc[page, slot] = f["k"][b, w], f["v"][b, w]


@pytest.mark.parametrize("shape", ["d32-g4", "d48-g6", "long"])
@pytest.mark.parametrize("window", [0, 5], ids=["full", "window5"])
def test_attention_rows_portable_and_avx512_give_the_same_bits(library, monkeypatch, window, shape):
    """The AVX-512 rows (head dims of 16s) against the portable ones, operation for operation."""
    s = SHAPES[shape]
    f = _attention_inputs(np.random.default_rng(9), ctx=s["ctx"], W=3, hq=s["hq"], d=s["d"], pages=s.get("pages", 48))
    fast = _session(_attention_graph(True, window), library).run(None, f)[0]
    monkeypatch.setenv("TANDEM_CPU_KERNELS_PORTABLE", "1")
    portable = _session(_attention_graph(True, window), library).run(None, f)[0]
    assert np.array_equal(fast, portable)


def test_attention_kernel_refuses_a_page_outside_the_cache(library):
    f = _attention_inputs(np.random.default_rng(2), ctx=[5], W=1)
    sess = _session(_attention_graph(True, 0), library)
    with pytest.raises(Exception, match="a block table names a page outside the cache"):
        sess.run(None, {**f, "tables": np.full_like(f["tables"], 99)})
    assert sess.run(None, f)[0].shape == f["q"].shape


def test_a_library_that_does_not_load_here_serves_the_lowered_graphs(engine_dirs, library, tmp_path, monkeypatch,
                                                                     caplog):
    """Every graph falls back together (the target step and the verify must compute alike), with a
    warning that says why."""
    assert onnxruntime_files.load_error(library) is None
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"not a shared library")
    assert onnxruntime_files.load_error(junk)
    engine_dir = engine_dirs["qwen3_5_mtp3"]
    files = sorted({r["file"] for r in read_manifest(engine_dir)["engines"]})
    assert set(onnxruntime_backend.serving_files(engine_dir, files).values()) == {optimized_name(f) for f in files}
    monkeypatch.setattr(onnxruntime_files, "load_error", lambda path: "undefined symbol: _ZSt28__throw")
    with caplog.at_level("WARNING"):
        assert onnxruntime_backend.serving_files(engine_dir, files) == {f: f for f in files}
    assert "CPU kernel library does not load: undefined symbol" in caplog.text


def test_an_unwritable_kernel_cache_or_a_broken_compiler_builds_nothing_and_says_why(tmp_path, monkeypatch, caplog):
    """Either way library() is None (the build then serves ONNX Runtime's kernels), with a warning."""
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path / "file" / "cache"))
    (tmp_path / "file").write_text("not a folder")
    with caplog.at_level("WARNING"):
        assert cpu_kernels._library.__wrapped__() is None
    assert "cannot be built" in caplog.text and "TANDEM_KERNEL_CACHE" in caplog.text
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "false")          # a "compiler" that fails
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: "/bin/false" if name == "false" else None)
    with caplog.at_level("WARNING"):
        assert cpu_kernels._library.__wrapped__() is None
    assert "did not compile" in caplog.text
