"""Load and build costs: saved optimized graphs (built, verified, served, refused on another
runtime or CPU) and an export that holds one graph's weights at a time."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import onnx
import pytest
from onnx import helper

from tandem.checkpoint import open_checkpoint
from tandem.engines.backends import (
    onnxruntime_backend,
    onnxruntime_build,
    onnxruntime_kernel_files,
    onnxruntime_optimized,
)
from tandem.engines.backends.onnxruntime_files import OPTIMIZED_WEIGHTS, optimized_name
from tandem.engines.buckets import plan
from tandem.engines.builder import BuildError, build_engines
from tandem.engines.manifest import MANIFEST, WEIGHTS_FILE, read_manifest, signed
from tandem.engines.options import BuildOptions
from tandem.engines.verification import fixed_inputs
from tandem.export import exporter
from tandem.export.cpu_kernel_lowering import CPU_DOMAIN
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams
from tandem.plugins import cpu_kernels

SMALL = BuildOptions(batch_sizes=(1, 2), spec_k=1, prefill_chunk=8, max_seq_len=128, unified_round=False)
PROMPTS = [[5, 17, 33, 200, 7], [9, 120, 77, 301, 15, 2, 88, 91, 14, 250, 3]]


@pytest.fixture(scope="module")
def built(tiny_root, tmp_path_factory):
    """weights format -> a tiny engine dir (float and int8)."""
    root = tmp_path_factory.mktemp("load")
    return {fmt: build_engines(tiny_root / "qwen3_5_mtp1", root / fmt, BuildOptions(**{**SMALL.to_json(),
                                                                                      "weights": fmt}),
                               show_progress=False).engine_dir
            for fmt in ("float", "int8")}


def _engine_files(folder) -> list[str]:
    return sorted({e["file"] for e in read_manifest(folder)["engines"]})


@pytest.mark.parametrize("fmt", ["float", "int8"])
def test_optimized_graphs_are_saved_share_weights_and_run_like_the_lowered_ones(built, tiny_root, fmt):
    folder, m = built[fmt], read_manifest(built[fmt])
    locations = set()
    for file in _engine_files(folder):
        assert optimized_name(file) in m["files"]          # integrity-checked like every engine file
        saved = onnx.load(str(folder / optimized_name(file)), load_external_data=False)
        locations |= {e.value for t in saved.graph.initializer for e in t.external_data if e.key == "location"}
    # float: the optimizer changes no weight, so no second copy but tandem's float matmul's weight
    # panels (where it runs); int8: MatMulNBits' packed weights, once
    second = fmt == "int8" or cpu_kernels.f32_matmul()
    assert locations == ({WEIGHTS_FILE, OPTIMIZED_WEIGHTS} if second else {WEIGHTS_FILE})
    assert (OPTIMIZED_WEIGHTS in m["files"]) == second
    desc = open_checkpoint(tiny_root / "qwen3_5_mtp1").description
    opts = BuildOptions(**{**SMALL.to_json(), "weights": fmt})
    for bucket_record in m["engines"]:
        file = bucket_record["file"]
        lowered = onnxruntime_backend.session(folder / file)
        saved = onnxruntime_backend.open_served(folder, optimized_name(file))
        bucket = next(b for b in plan(desc, opts) if b.name == bucket_record["name"])
        feeds = fixed_inputs(desc, bucket, opts)
        # the same computation, bit for bit, but where the saved graph runs Gated DeltaNet on tandem's
        # CPU kernel and the lowered one on LinearAttention (other rounding: tests/kernels/test_cpu_kernels.py)
        kernel = any(n.domain == CPU_DOMAIN for n in onnx.load(str(folder / optimized_name(file)),
                                                                 load_external_data=False).graph.node)
        for a, b in zip(lowered.run(None, feeds), saved.run(None, feeds)):
            if kernel and a.dtype == np.float32:
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
            else:
                np.testing.assert_array_equal(a, b)


def test_the_runner_serves_the_saved_graphs_and_generates_the_same_tokens(built, caplog):
    folder = built["float"]
    files = _engine_files(folder)
    assert onnxruntime_backend.serving_files(folder, files) == {f: optimized_name(f) for f in files}
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    served = [o.token_ids for o in LLM(folder, RuntimeConfig(memory_budget_bytes=8 << 20)).generate(PROMPTS, params)]
    m = read_manifest(folder)
    # a manifest from another CPU: the lowered graphs, optimized at load, with a warning saying why
    (folder / MANIFEST).write_text(json.dumps(signed({**m, "versions": {**m["versions"], "cpu": "riscv64:"}})))
    try:
        with caplog.at_level(logging.WARNING):
            assert onnxruntime_backend.serving_files(folder, files) == {f: f for f in files}
        assert "cpu riscv64: ->" in caplog.text and "Rebuild the engine dir" in caplog.text
        fallback = LLM(folder, RuntimeConfig(memory_budget_bytes=8 << 20)).generate(PROMPTS, params)
    finally:
        (folder / MANIFEST).write_text(json.dumps(signed(m)))
    assert [o.token_ids for o in fallback] == served


def test_a_rebuild_on_another_cpu_says_so(built, tiny_root, tmp_path, monkeypatch):
    """The CPU is part of the backend's versions, so the fingerprint sees it and the build reruns."""
    out = tmp_path / "engines"
    shutil.copytree(built["float"], out)
    assert build_engines(tiny_root / "qwen3_5_mtp1", out, SMALL, show_progress=False).status == "up-to-date"
    monkeypatch.setattr(onnxruntime_backend, "cpu_signature", lambda: "riscv64:")
    result = build_engines(tiny_root / "qwen3_5_mtp1", out, SMALL, show_progress=False)
    assert result.status == "built" and any(r.startswith("cpu ") and r.endswith("-> riscv64:") for r in result.reasons)
    assert read_manifest(out)["versions"]["cpu"] == "riscv64:"


def test_the_build_verifies_the_saved_graphs_it_serves(tiny_root, tmp_path, monkeypatch):
    """A saved graph that computes something else (here: its first float output scaled by 1.5)
    fails the build's verification."""
    real = onnxruntime_optimized.save_optimized

    def wrong(folder, files, options, progress=None, sources=None, rewrite=None):
        rewritten = real(folder, files, options, progress, sources, rewrite)
        for file in files:
            path = folder / optimized_name(file)
            model = onnx.load(str(path), load_external_data=False)
            out = next(o for o in model.graph.output if o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT)
            producer = next(n for n in model.graph.node if out.name in n.output)
            producer.output[list(producer.output).index(out.name)] = out.name + "/unscaled"
            model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1.5, np.float32), "/test/scale"))
            model.graph.node.append(helper.make_node("Mul", [out.name + "/unscaled", "/test/scale"], [out.name]))
            onnx.save(model, str(path))
        return rewritten

    monkeypatch.setattr(onnxruntime_kernel_files, "save_optimized", wrong)
    with pytest.raises(BuildError, match="disagree with the un-lowered graphs"):
        build_engines(tiny_root / "qwen3_5_mtp1", tmp_path / "out", SMALL, show_progress=False)


def test_export_writes_and_drops_each_graph_before_building_the_next(tiny_root, tmp_path, monkeypatch):
    """Each graph carries a copy of its weights until they move to weights.bin: building the next
    one while the previous still holds them is what took a 150M build to 6.9 GB."""
    real, made = exporter._graph, []

    def tracked(*args, **kwargs):
        for previous in made:
            held = sum(len(t.raw_data) for t in previous.graph.initializer if not t.name.startswith("/const/"))
            assert held == 0, "a graph still held its weights when the next one was built"
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(exporter, "_graph", tracked)
    result = exporter.export_checkpoint(open_checkpoint(tiny_root / "qwen3_5_mtp3"), tmp_path / "export")
    assert len(made) == len(result.graphs) > 3


def test_verification_opens_one_session_at_a_time(tiny_root, tmp_path, monkeypatch):
    """Each session holds a packed copy of the weights it reads: the reference and the engine of
    a bucket are never open together (two were: 150M build peak 2.5 GB instead of 1.9 GB)."""
    import gc
    import weakref

    real, live, most = onnxruntime_backend.session, [], []

    def counted(*args, **kwargs):
        gc.collect()
        live[:] = [r for r in live if r() is not None]
        sess = real(*args, **kwargs)
        live.append(weakref.ref(sess))
        most.append(len(live))
        return sess

    monkeypatch.setattr(onnxruntime_backend, "session", counted)
    build_engines(tiny_root / "qwen3_5_mtp1", tmp_path / "out", SMALL, show_progress=False)
    assert most and max(most) == 1


def test_a_checker_without_run_group_is_run_bucket_by_bucket(tiny_root, tmp_path, monkeypatch):
    """The TensorRT backend's Checker has only run(bucket, engine, feeds): the build still verifies
    every bucket through it."""
    monkeypatch.delattr(onnxruntime_build.Checker, "run_group")
    seen = []
    real = onnxruntime_build.Checker.run

    def run(self, bucket, engine, feeds):
        seen.append(bucket.name)
        return real(self, bucket, engine, feeds)

    monkeypatch.setattr(onnxruntime_build.Checker, "run", run)
    build_engines(tiny_root / "qwen3_5_mtp1", tmp_path / "out", SMALL, show_progress=False)
    engines = read_manifest(tmp_path / "out")["engines"]
    assert sorted(seen) == sorted(e["name"] for e in engines) and all(e["verification"]["passed"] for e in engines)


@pytest.mark.parametrize("kind", ["qwen3_5_mtp3", "qwen3_next"])
def test_llm_opens_in_the_background_exactly_the_engines_a_first_request_calls(engine_dirs, kind):
    """LLM() starts opening sessions (several at once) for the target step, the drafting heads and
    each batch size's starting width's round engine; a first greedy request then opens nothing else."""
    llm = LLM(engine_dirs[kind], RuntimeConfig(adaptive_width=False))
    sessions = llm.runner.runner.sessions
    started = set(sessions._pending) | set(sessions)
    width = llm.width_per_batch[1]
    assert llm.runner.files[llm.round_loop.round_engine(width, False)[0].engine_key(width)] in started
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert out[0].metrics.rounds > 0                      # it drafted and verified
    assert set(sessions) <= started and not any("sample" in f for f in started)


def test_an_adaptive_round_never_waits_for_a_session_to_open(engine_dirs):
    """A width whose round engine is not open (nor one LLM() began opening): the round takes the
    widest open width below it while the wanted one opens in the background; once open, rounds
    take it."""
    llm = LLM(engine_dirs["qwen3_5_mtp3"])
    runner, engine, sessions = llm.runner, llm.round_loop, llm.runner.runner.sessions
    seq = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True))
    llm.step()                                            # the prefill
    file_of = {w: runner.files[engine.round_engine(w, False)[0].engine_key(w)]
               for w in engine.width_control.widths if w > 1}
    for file in file_of.values():                         # every width open ...
        sessions[file]
    wanted = max(file_of)
    del sessions[file_of[wanted]]                         # ... but the widest, as before its first use
    engine.waits_for.discard(engine.round_engine(wanted, False))
    assert engine._open_width([seq], wanted) == wanted - 1
    assert file_of[wanted] in sessions._pending           # opening in the background
    sessions[file_of[wanted]]                             # (wait for it here)
    assert engine._open_width([seq], wanted) == wanted
