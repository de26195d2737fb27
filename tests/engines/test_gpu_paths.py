"""The GPU paths' logic on CPU. ONNX Runtime's device runner (onnxruntime_device.py: OrtValue
pools, commits by an in-place ScatterND commit graph) on the CPU provider: tokens and pools equal
the host runner's. The TensorRT pipeline runner (engines/backends/tensorrt_runner.py) and its
device memory (cuda_memory.py) over stand-ins for TensorRT and CUDA (tests/fake_tensorrt.py,
tests/fake_cuda.py) whose engines are the ONNX Runtime engine files and whose "device" is host
memory: the buffer plan, one allocation per pool and per bucket, the call sequence per bucket,
capture once and replay, address stability, device commits by index, and tokens and pools equal
to the ONNX Runtime runner's. Also: the commit kernel (Triton interpreter) against its reference."""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest

from tandem.engines.backends import onnxruntime_backend, tensorrt_backend
from tandem.engines.backends.cuda_memory import DeviceArray, pinned_view
from tandem.engines.backends.memory import Replay, plan_buffers
from tandem.engines.backends.onnxruntime_device import DeviceRunner
from tandem.engines.backends.tensorrt_runner import Runner
from tandem.engines.manifest import signed
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams

from ..fake_cuda import FakeCuda, copy_rows
from ..fake_tensorrt import make_runtime

pytestmark = pytest.mark.slow

KIND = "qwen3_5_mtp3"
PROMPTS = [[5, 17, 33, 200, 7], [9, 120, 77, 301, 15, 2, 88, 91, 14, 250, 3], [44]]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True, k=3)   # a fixed width: the same calls on both runners


def _tensorrt_dir(src, dst):
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    (dst / "manifest.json").write_text(json.dumps(signed({**manifest, "backend": "tensorrt"})))
    return dst


@pytest.fixture(autouse=True)
def host_serves_the_lowered_graphs(monkeypatch):
    """The host runner opens the lowered graphs, as the device runners do: the saved optimized
    graphs run Gated DeltaNet on tandem's CPU kernel, whose rounding differs from LinearAttention's,
    and these tests compare the runners' pools bit for bit."""
    monkeypatch.setattr(onnxruntime_backend, "serving_files", lambda engine_dir, files: {f: f for f in files})


@pytest.fixture
def fake_gpu(engine_dirs, tmp_path, monkeypatch):
    path = _tensorrt_dir(engine_dirs[KIND], tmp_path / "trt")
    cuda = FakeCuda()
    runner = functools.partial(Runner, trt=make_runtime(cuda, path), cuda=cuda, kernels=copy_rows)
    monkeypatch.setattr(tensorrt_backend, "Runner", runner)
    return path, cuda


def _device_pools(llm: LLM) -> dict[str, bytes]:
    """Every pool's bytes, read where it lives (device memory is host memory in these tests)."""
    out = {}
    for kind, groups in (("paged", llm.pools.paged), ("state", llm.pools.states)):
        for layer, pools in groups.items():
            for name, a in pools.items():
                host = a if isinstance(a, np.ndarray) else pinned_view(a.ptr, a.nbytes, a.shape, a.dtype)
                out[f"{kind} {layer}/{name}"] = host.tobytes()
    return out


def test_tensorrt_engine_dirs_serve_through_the_runner_like_onnxruntime(engine_dirs, fake_gpu):
    path, cuda = fake_gpu
    config = RuntimeConfig(max_num_seqs=4, memory_budget_bytes=2 << 20)
    ort_llm = LLM(engine_dirs[KIND], config)
    want = [r.token_ids for r in ort_llm.generate(PROMPTS, GREEDY)]
    llm = LLM(path, config)
    assert all(isinstance(a, DeviceArray) for d in llm.pools.paged.values() for a in d.values())
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == want
    assert _device_pools(llm) == _device_pools(ort_llm)            # device commits == host commits, bitwise
    bindings = llm.runner.runner._bindings
    pools = sum(len(d) for d in (*llm.pools.paged.values(), *llm.pools.states.values())) + llm.pools.snapshot_pools
    assert cuda.mallocs == pools + len(bindings) + 1                # + the commit index staging
    for b in bindings.values():                                     # plain once, captured, replayed after
        assert b.replay.log[:2] == ["run", "capture"] or b.replay.log == ["run"]
        assert set(b.replay.log[2:]) <= {"replay"} and b.replay.captures <= 1
    assert all(graph and [op for op, _ in graph] == ["h2d", "enqueue", "d2h"] for graph in cuda.captures)
    assert len(cuda.captures) == sum(b.replay.captures for b in bindings.values()) > 0
    assert "commit" in cuda.log and llm.runner.runner.transfers.commits > 0


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["batch1", "batch3"])
def test_plain_decoding_commits_on_the_device_like_the_host(engine_dirs, fake_gpu, monkeypatch, prompts):
    """Plain decoding's lean commit (Pools.commit_decode -> memory.scatter_many: one index pair per
    page group, batch 1 by integer index) on CUDA device memory and on ONNX Runtime's device
    runner: tokens and every pool equal the host runner's, bitwise."""
    path, _ = fake_gpu
    config = RuntimeConfig(max_num_seqs=4, memory_budget_bytes=2 << 20)
    plain = SamplingParams(max_tokens=12, ignore_eos=True, speculative=False)
    host = LLM(engine_dirs[KIND], config)
    want = [r.token_ids for r in host.generate(prompts, plain)]
    trt = LLM(path, config)
    assert [r.token_ids for r in trt.generate(prompts, plain)] == want
    assert _device_pools(trt) == _device_pools(host)
    device = lambda *a, **k: DeviceRunner(*a, **{**k, "device": "cpu", "cuda_graph": False})  # noqa: E731
    monkeypatch.setattr(onnxruntime_backend, "Runner", device)
    ort_device = LLM(engine_dirs[KIND], config)
    assert [r.token_ids for r in ort_device.generate(prompts, plain)] == want
    assert _device_pools(ort_device) == _device_pools(host)


def test_bucket_buffers_follow_their_plan_and_keep_their_addresses(fake_gpu):
    path, cuda = fake_gpu
    llm = LLM(path, RuntimeConfig(max_num_seqs=2, memory_budget_bytes=2 << 20))
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    before = {k: (b.device, b.host, dict(b.addresses)) for k, b in llm.runner.runner._bindings.items()}
    mallocs = cuda.mallocs
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    after = {k: (b.device, b.host, dict(b.addresses)) for k, b in llm.runner.runner._bindings.items()}
    assert {k: after[k] for k in before} == before
    assert cuda.mallocs - mallocs == len(after) - len(before)        # new buckets only, one allocation each
    for b in llm.runner.runner._bindings.values():
        plan = b.plan
        assert all(p.offset % plan.alignment == 0 for p in plan.placements)
        ins = [p for p in plan.placements if p.name in b.inputs]
        assert b.upload == (0, max(p.offset + p.nbytes for p in ins))   # inputs first: one copy uploads them
        for name, arr in b.inputs.items():                               # host mirrors are pinned views
            assert arr.ctypes.data == b.host + plan[name].offset


def test_buffer_plan_aligns_and_never_overlaps():
    plan = plan_buffers([("a", (3,), "int64"), ("b", (5, 7), "float16"), ("c", (0,), "float32"),
                         ("d", (2, 3), "float32")], alignment=256)
    spans = sorted((p.offset, p.offset + p.nbytes) for p in plan.placements)
    assert all(s % 256 == 0 for s, _ in spans) and all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
    assert plan["b"].nbytes == 70 and plan.total % 256 == 0 and plan.total >= spans[-1][1]
    assert plan.span(["a", "b"]) == (0, 256 + 70)
    with pytest.raises(ValueError, match="power of two"):
        plan_buffers([("a", (1,), "int64")], alignment=48)


def test_replay_captures_once_after_warmup_and_refuses_moved_buffers():
    replay, calls = Replay(warmup=1), []
    run = functools.partial(replay.run, plain=lambda: calls.append("plain"), capture=lambda: "graph",
                            replay=lambda g: calls.append(g))
    for _ in range(4):
        run((1, 2))
    assert replay.log == ["run", "capture", "replay", "replay", "replay"]
    assert calls == ["plain", "graph", "graph", "graph"] and replay.captures == 1 and replay.replays == 3
    with pytest.raises(RuntimeError, match="buffers moved"):
        run((1, 3))


def test_device_arrays_slice_as_views():
    a = DeviceArray(1024, (4, 3, 2), np.float16)
    assert a[1:3].ptr == 1024 + 12 and a[1:3].shape == (2, 3, 2) and a[2].ptr == 1024 + 24
    assert a[-1].ptr == 1024 + 36 and a.row_bytes(1) == 12 and a.nbytes == 48
    with pytest.raises(IndexError):
        a[4]


# ---- the commit kernel -------------------------------------------------------------------------------------
def test_commit_kernel_copies_rows_by_index_like_its_reference():
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from tandem.engines.backends.commit_kernel import copy_rows_plan, reference
    from tandem.plugins.kernel_plan import launch

    rng = np.random.default_rng(0)
    pool = rng.standard_normal((40, 2, 3, 5)).astype(np.float16)       # rows of 30 halves = 60 bytes
    src = rng.standard_normal((4, 3, 2, 3, 5)).astype(np.float16)
    dst_rows, src_rows = np.array([7, 0, 39, 12]), np.array([11, 0, 5, 2])
    want = pool.reshape(40, -1).copy()                                 # pool rows: [40, 30]; output rows: [12, 30]
    reference(want, dst_rows, src.reshape(12, -1), src_rows)
    got = torch.from_numpy(pool.reshape(40, -1).view(np.int8).copy())
    launch(copy_rows_plan(4, 60), [torch.from_numpy(src.view(np.int8).reshape(-1)), torch.from_numpy(dst_rows),
                                   torch.from_numpy(src_rows)], [got])
    assert got.numpy().view(np.float16).tobytes() == want.tobytes()


# ---- ONNX Runtime's device path, on the CPU provider --------------------------------------------------------
def test_onnxruntime_device_runner_commits_in_place_with_the_commit_graph(engine_dirs, monkeypatch):
    config = RuntimeConfig(max_num_seqs=4, memory_budget_bytes=2 << 20)
    host = LLM(engine_dirs[KIND], config)
    want = [r.token_ids for r in host.generate(PROMPTS, GREEDY)]
    device = lambda *a, **k: DeviceRunner(*a, **{**k, "device": "cpu", "cuda_graph": False})  # noqa: E731
    monkeypatch.setattr(onnxruntime_backend, "Runner", device)
    llm = LLM(engine_dirs[KIND], config)
    memory = llm.runner.runner.memory
    pools = {id(v): v for v in memory.allocations.values()}
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == want
    assert _device_pools(llm) == _device_pools(host)                # in-place ScatterND == numpy commits
    assert {id(v): v for v in memory.allocations.values() if id(v) in pools} == pools
    assert memory.transfers.commits > 0 and len(memory._commit) == 1   # one commit graph per pool dtype (float32)
