"""ONNX Runtime backend (CPU, the embedded default), the serving side: sessions on one process-wide
thread pool and the pipeline's runner. What `tandem build-engines` does with it is onnxruntime_build.py.

Engine layout, chosen by measurement (bench/bucket_strategy.py, docs/engines.md): one dynamic
lowered model per graph kind (and per verify width, since the verify lowering unrolls W rows),
all sharing weights.bin; the pipeline binds preallocated buffers per (batch, width) bucket with
IOBinding. Per-call latency matched one optimised static-shape model per bucket within noise,
while those stored a full weights copy per bucket (570 MiB each for 150M parameters). Next to
each lowered graph the build saves ONNX Runtime's optimized form of it, which the CPU runner
opens with optimisation off (onnxruntime_optimized.py).

The optimized graphs run Gated DeltaNet and dense float32 attention on tandem's own CPU kernels
where they compile here (plugins/cpu_kernels.py, export/cpu_kernel_lowering.py): the build
optimizes a second lowering of each graph that uses them, and the engine dir carries the library
(cpu_kernels.so). The lowered graphs keep ONNX Runtime's LinearAttention and the graph lowering of
attention: they are the CUDA provider's input and the fallback on another CPU or runtime, where
the library is not loaded.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from tandem.engines.backends import onnxruntime_files
from tandem.engines.backends.memory import HostMemory, Transfers
from tandem.engines.backends.onnxruntime_files import engine_library, optimized_name
from tandem.engines.manifest import read_manifest
from tandem.plugins import cpu_kernels
from tandem.plugins.cpu_features import cpu_signature

NAME = "onnxruntime"
__all__ = ["NAME", "Runner", "open_served", "serving_files", "session", "versions"]


log = logging.getLogger(__name__)


def versions() -> dict[str, str]:
    """What the engines depend on; "cpu" because the saved optimized graphs do."""
    return {"onnxruntime": ort.__version__, "onnx": onnx.__version__, "numpy": np.__version__, "cpu": cpu_signature(),
            "cpu_kernels": cpu_kernels.version()}


def session(model, threads: int | None = None, profile_prefix: str | None = None,
            exact_quantized: bool = False, optimized: bool = False, kernels: Path | None = None
            ) -> ort.InferenceSession:
    """Every tandem session (a path or a ModelProto) runs on one process-wide thread pool.

    `optimized`: the model is a saved optimized graph (onnxruntime_optimized.py): opened with graph
    optimisation off, so it runs as saved and verified, and its load skips the optimizer.

    Weight-only int8 / int4 graphs (export/quantize.py): ONNX Runtime fuses DequantizeLinear +
    MatMul into MatMulNBits, which by default also quantizes the activations to int8 per block
    (accuracy level 4: the fast kernels). `exact_quantized` computes with the dequantized weights in
    float32 instead (level 0): the build's verification uses it on both sides, so it checks the
    lowering and not the int8 rounding of activations (which flips with any 1e-6 reordering).

    `kernels`: tandem's CPU kernel library (plugins/cpu_kernels.py), which an engine dir's optimized
    graphs need where it carries one.

    `profile_prefix` turns on ONNX Runtime's per-node profiler (off by default: it times every
    node of every run); `end_profiling()` on the session writes `<prefix>_<date>.json`.

    The pipeline's sessions (target, heads) take turns every round. With a pool each, the idle
    sessions' spinning threads steal the cores from the busy one (150M model, 2 cores: a 4-row
    verify took 36 ms instead of 22 ms, a round 64 ms instead of 40 ms). Once a process has the
    global pool, ONNX Runtime requires every session in it to use it.
    """
    _ensure_global_pool(threads)
    level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL if optimized else ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts = _options(level, exact_quantized, kernels)
    if profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    source = model.SerializeToString() if hasattr(model, "SerializeToString") else str(model)
    return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


def _options(level: ort.GraphOptimizationLevel, exact_quantized: bool = False, kernels: Path | None = None
             ) -> ort.SessionOptions:
    """The options every session shares (the build's optimizer pass too, so it saves what a serving
    session would have made)."""
    _ensure_global_pool(None)
    opts = ort.SessionOptions()
    if kernels is not None:
        opts.register_custom_ops_library(str(kernels))
    opts.graph_optimization_level = level
    opts.log_severity_level = 3
    opts.use_per_session_threads = False
    if exact_quantized:
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
        # the build's verification runs each session a few times: no packed copy of the weights beside the
        # memory-mapped ones (150M model: the verification's peak RSS was 2.7 GB with them)
        opts.add_session_config_entry("session.disable_prepacking", "1")
        # and no arena: it keeps its largest-ever blocks until the session closes (150M model, with
        # glibc's fixed mmap threshold, engines/malloc.py: the verification's peak anonymous memory
        # 851 -> 550 MiB on a unified round's engine file)
        opts.enable_cpu_mem_arena = False
    return opts


_GLOBAL_POOL: int | None = None


def _ensure_global_pool(threads: int | None) -> None:
    """The process-wide ONNX Runtime thread pool, sized once per process (the first caller's
    thread count wins)."""
    global _GLOBAL_POOL
    if _GLOBAL_POOL is None:
        _GLOBAL_POOL = threads or os.cpu_count() or 1
        ort.capi._pybind_state.set_global_thread_pool_sizes(_GLOBAL_POOL, 1)


def Runner(engine_dir: Path, files: list[str], threads: int | None = None,  # noqa: N802 (the protocol's name)
           profile_prefix: str | None = None, device: str | None = None):
    """The pipeline runner: host memory on the CPU provider (device None or "cpu", the default),
    or "cuda": ONNX Runtime's CUDA provider with device pools and CUDA graphs (onnxruntime_device.py)."""
    if device in (None, "cpu"):
        return HostRunner(engine_dir, files, threads, profile_prefix)
    from tandem.engines.backends.onnxruntime_device import DeviceRunner
    return DeviceRunner(engine_dir, files, threads, device=device)


class HostRunner:
    """The pipeline side: one session per engine file, and per (file, batch, rows, pages) a
    binding whose input and output buffers are allocated once, through `memory`, and reused
    every round.

    Pools are allocated by `memory` (HostMemory) and bound by reference: an OrtValue over a
    numpy array shares its buffer, so the engines read and the commits write the same bytes.
    `capture` is the CUDA-graph hook of the backend protocol; on the CPU there is nothing to
    capture, so it returns the plain run.
    """

    def __init__(self, engine_dir: Path, files: list[str], threads: int | None = None,
                 profile_prefix: str | None = None):
        """profile_prefix: profile every session with ONNX Runtime's profiler, one file per engine
        file named `<profile_prefix><engine file stem>_<date>.json` (bench/where_time_goes.py)."""
        # sessions open on first use: an engine dir holds graphs a run may never call (other widths, the
        # multi-call round's next to the unified one), and each costs ~0.3 s to open
        prefix = (lambda f: f"{profile_prefix}{Path(f).stem}") if profile_prefix else (lambda f: None)
        _ensure_global_pool(threads)   # here, before prefetch may open sessions in several threads at once
        opened = serving_files(Path(engine_dir), files)
        self.sessions = _Sessions(files, lambda f: open_served(Path(engine_dir), opened[f], threads, prefix(f)))
        self.memory = HostMemory()
        # the backend protocol's host kernels: the library the served graphs load, which also holds
        # the host sampler (pipeline/native_sampler.py); None where they are the lowered graphs
        served_optimized = any(f.endswith(".opt.onnx") for f in opened.values())
        self.host_kernels = engine_library(Path(engine_dir)) if served_optimized else None
        self._bindings: dict[tuple, _Binding] = {}
        # the fixed inputs (the pools, the same arrays in every binding) wrapped once: a verify's binding
        # wraps 30 of them, and a call of a new shape made its binding in 0.7-1.2 ms, most of it wrapping
        self._fixed_values: dict[int, tuple[np.ndarray, ort.OrtValue]] = {}

    def _fixed_value(self, arr: np.ndarray) -> ort.OrtValue:
        """The OrtValue wrapping a fixed input array (kept with it: its id is not reused while it lives)."""
        kept = self._fixed_values.get(id(arr))
        if kept is None or kept[0] is not arr:
            kept = self._fixed_values[id(arr)] = (arr, ort.OrtValue.ortvalue_from_numpy(arr))
        return kept[1]

    @property
    def transfers(self) -> Transfers:
        return self.memory.transfers

    def prefetch(self, files: list[str]) -> None:
        """Open these engine files' sessions in the background (the ones a first request calls),
        so that its first calls do not open them one after the other."""
        self.sessions.prefetch(files)

    def ready(self, files: list[str]) -> bool:
        """Whether these engine files' sessions are open (a background open that has finished counts)."""
        return all(self.sessions.is_open(f) for f in files)

    def end_profiling(self) -> dict[str, Path]:
        """Engine file -> the profile json ONNX Runtime wrote for its session (profiling sessions only)."""
        return {f: Path(s.end_profiling()) for f, s in self.sessions.items()}

    def binding(self, file: str, key: tuple, input_shapes: dict[str, tuple], output_shapes: dict[str, tuple],
                fixed: dict[str, np.ndarray], backend_outputs=frozenset()) -> _Binding:
        """backend_outputs: outputs only the backend reads (rows and states the commits scatter)."""
        b = self._bindings.get((file, key))
        if b is None:
            b = self._bindings[(file, key)] = _Binding(self.sessions[file], self.memory, f"{file}{key}",
                                                       input_shapes, output_shapes, fixed, backend_outputs,
                                                       self._fixed_value)
        return b

    def capture(self, binding: _Binding):
        return binding.run


def open_served(engine_dir: Path, served: str, threads: int | None = None, profile_prefix: str | None = None):
    """The session of `served` (an engine file or its saved optimized graph, as serving_files
    chose), opened as the pipeline opens it: an optimized graph with optimisation off and the engine
    dir's kernel library."""
    optimized = served.endswith(".opt.onnx")
    return session(engine_dir / served, threads, profile_prefix, optimized=optimized,
                   kernels=engine_library(engine_dir) if optimized else None)


def serving_files(engine_dir: Path, files: list[str]) -> dict[str, str]:
    """Engine file -> the file its session opens: the saved optimized graph when the manifest names
    one and it was made by this ONNX Runtime on a CPU like this one, else the lowered graph (the
    optimizer runs at load: slower, never wrong). Also the lowered graphs where the dir's CPU kernel
    library does not load here (all of them: the target step and the verify must compute alike)."""
    manifest = read_manifest(engine_dir)
    built, here = manifest.get("versions", {}), versions()
    differs = [f"{k} {built.get(k)} -> {here[k]}" for k in ("onnxruntime", "cpu") if built.get(k) != here[k]]
    saved = {f for f in files if optimized_name(f) in manifest["files"]}
    kernels = engine_library(engine_dir)
    if saved and not differs and kernels is not None and (error := onnxruntime_files.load_error(kernels)):
        differs = [f"its CPU kernel library does not load: {error}"]
    if differs and saved:
        log.warning("%s: its optimized graphs were saved for another runtime or CPU (%s); optimizing the lowered "
                    "graphs at load instead. Rebuild the engine dir here to load faster.", engine_dir,
                    "; ".join(differs))
    return {f: optimized_name(f) if f in saved and not differs else f for f in files}


class _Sessions(dict):
    """Engine file -> its session, opened when first asked for, or ahead of it in the background
    (`prefetch`); only the files given exist."""

    def __init__(self, files: list[str], open_session):
        super().__init__()
        self.files, self._open = frozenset(files), open_session
        self._pending: dict[str, Future] = {}
        self._pool: ThreadPoolExecutor | None = None

    def prefetch(self, files: list[str]) -> None:
        """Start opening `files` in background threads, as many at once as there are cores: each
        open is mostly single-threaded (reading the graph, packing its weights), and several open
        together in less time than one after the other (measured by bench/load_and_build.py)."""
        todo = [f for f in dict.fromkeys(files) if f in self.files and f not in self and f not in self._pending]
        if not todo:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="tandem-open")
        for f in todo:
            self._pending[f] = self._pool.submit(self._open, f)

    def is_open(self, file: str) -> bool:
        return file in self or (file in self._pending and self._pending[file].done())

    def __missing__(self, file: str):
        if file not in self.files:
            raise KeyError(file)
        pending = self._pending.pop(file, None)
        self[file] = pending.result() if pending is not None else self._open(file)
        return self[file]


_NUMPY_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
                "tensor(float16)": np.float16}


class _Binding:
    def __init__(self, sess: ort.InferenceSession, memory: HostMemory, prefix: str, input_shapes, output_shapes,
                 fixed: dict[str, np.ndarray], backend_outputs, fixed_value=ort.OrtValue.ortvalue_from_numpy):
        self.sess, self.transfers = sess, memory.transfers
        types = {i.name: i.type for i in sess.get_inputs()}
        alloc = lambda n, s, t: memory.allocate(f"{prefix}/{n}", s, _NUMPY_TYPES[t])  # noqa: E731
        self.inputs = {n: alloc(n, s, types[n]) for n, s in input_shapes.items() if n in types}
        out_types = {o.name: o.type for o in sess.get_outputs()}
        self.outputs = {n: alloc(n, s, out_types[n]) for n, s in output_shapes.items() if n in out_types}
        # what a call moves between host and backend: the inputs the host fills, the outputs it reads
        self.bytes_in = sum(a.nbytes for a in self.inputs.values())
        self.bytes_out = sum(a.nbytes for n, a in self.outputs.items() if n not in backend_outputs)
        self.io = sess.io_binding()
        self.values = {}  # name -> the OrtValue bound: it wraps the numpy buffer, it does not copy it
        for name, arr in self.inputs.items():
            self.values[name] = ort.OrtValue.ortvalue_from_numpy(arr)
            self.io.bind_ortvalue_input(name, self.values[name])
        for name, arr in fixed.items():
            if name in types:
                self.values[name] = fixed_value(arr)
                self.io.bind_ortvalue_input(name, self.values[name])
        for name, arr in self.outputs.items():
            self.values[name] = ort.OrtValue.ortvalue_from_numpy(arr)
            self.io.bind_ortvalue_output(name, self.values[name])
        self._own = self.outputs                  # the binding's own output buffers
        self._placed, self._placed_names = None, ()

    def place_outputs(self, key, views) -> None:
        """Write some outputs into arrays the caller owns from the next run on: views() -> name ->
        C-contiguous array of that output's shape and dtype (the state pools' rows of the call's
        slots, ModelRunner._place_states); others are ignored. `key` names the placement, so an
        unchanged one rebinds nothing; None: the own buffers again. `outputs` becomes a new dict on
        each change, so views and commit plans made over the old one are remade."""
        if key == self._placed:
            return
        own = self._own
        targets = {} if key is None else {
            n: a for n, a in views().items()
            if n in own and a.shape == own[n].shape and a.dtype == own[n].dtype and a.flags.c_contiguous}
        self.outputs = {**own, **targets}
        for name in {*self._placed_names, *targets}:
            self.values[name] = ort.OrtValue.ortvalue_from_numpy(self.outputs[name])
            self.io.bind_ortvalue_output(name, self.values[name])
        self._placed, self._placed_names = key, tuple(targets)

    def run(self) -> dict[str, np.ndarray]:
        self.sess.run_with_iobinding(self.io)
        self.transfers.calls += 1
        self.transfers.to_backend += self.bytes_in
        self.transfers.to_host += self.bytes_out
        return self.outputs
