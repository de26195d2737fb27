"""ONNX Runtime backend, the build side (`tandem build-engines`): the lowered graph per graph kind
and verify width, ONNX Runtime's saved optimized form of each (with tandem's CPU kernels where they
compile here), and the check of every bucket's engine against the exported graph it came from.
The serving side, which the pipeline loads, is onnxruntime_backend.py.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from tandem.engines.backends import onnxruntime_backend as serving
from tandem.engines.backends.common import link_or_copy
from tandem.engines.backends.onnxruntime_backend import NAME, versions
from tandem.engines.backends.onnxruntime_files import engine_library, optimized_name
from tandem.engines.backends.onnxruntime_kernel_files import save_served_graphs
from tandem.engines.backends.onnxruntime_optimized import exact_copy
from tandem.engines.buckets import Bucket
from tandem.engines.manifest import WEIGHTS_FILE
from tandem.engines.verification import timed

__all__ = ["NAME", "Checker", "ReferenceRunner", "build", "engine_file", "versions"]


def engine_file(bucket: Bucket) -> str:
    return f"{bucket.graph.engine_key(bucket.rows)}.onnx"


def build(export_dir: Path, out_dir: Path, buckets: list[Bucket], desc=None, options=None,
          progress=None) -> dict[str, tuple[str, int]]:
    """Write the lowered graphs the buckets need; returns bucket name -> (engine file, profile 0)."""
    from tandem.export import lowering  # the build side: serving an engine dir never loads the exporter

    if not (out_dir / WEIGHTS_FILE).exists():
        link_or_copy(export_dir / WEIGHTS_FILE, out_dir / WEIGHTS_FILE)
    files, graphs = {}, {}
    for bucket in buckets:
        name = engine_file(bucket)
        graphs[name] = (bucket.graph.name, bucket.rows if bucket.graph.per_width else None)
        if not (out_dir / name).exists():
            model = onnx.load(str(export_dir / f"{bucket.graph.name}.onnx"), load_external_data=False)
            onnx.save(lowering.lower_for_onnxruntime(model, rows=graphs[name][1]), str(out_dir / name))
        files[bucket.name] = (name, 0)
        if progress:
            progress.step(bucket.name)
    # every file, reused ones too: optimized.bin is written afresh, never shared with a previous build
    save_served_graphs(export_dir, out_dir, graphs, lambda level, kernels: serving._options(level, kernels=kernels),
                       bf16=options is not None and options.weights == "bf16")
    return files



class ReferenceRunner:
    """Runs exported (un-lowered) graphs with ONNX Runtime: the reference every backend's
    engines are checked against. One session per file; `optimized` for a saved optimized graph,
    run through its exact copy (onnxruntime_optimized.exact_copy), with the engine dir's kernel
    library where it has one."""

    def __init__(self, kernels: Path | None = None):
        self._sessions: dict[Path, ort.InferenceSession] = {}
        self.kernels = kernels

    def run(self, path: Path, feeds: dict[str, np.ndarray], optimized: bool = False) -> dict[str, np.ndarray]:
        if path not in self._sessions:
            if len(self._sessions) >= 2:  # a reference and an engine at a time: weights are large
                del self._sessions[next(iter(self._sessions))]  # before the next one opens: one less copy
            if optimized:
                copy = exact_copy(path)
                try:
                    self._sessions[path] = serving.session(copy, exact_quantized=True, optimized=True,
                                                           kernels=self.kernels)
                finally:
                    copy.unlink()
            else:
                self._sessions[path] = serving.session(path, exact_quantized=True)
        sess = self._sessions[path]
        return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


class Checker:
    """(reference outputs, engine outputs) for a bucket's fixed input; the engine side is the saved
    optimized graph the CPU runner serves."""

    def __init__(self, engine_dir: Path, export_dir: Path):
        self.engine_dir, self.export_dir = engine_dir, export_dir
        self.kernels = engine_library(engine_dir)
        self.runner = ReferenceRunner(self.kernels)

    def run(self, bucket: Bucket, engine: tuple[str, int], feeds: dict[str, np.ndarray]) -> tuple[dict, dict]:
        reference = self.runner.run(self.export_dir / f"{bucket.graph.name}.onnx", feeds)
        return reference, self.runner.run(self.engine_dir / optimized_name(engine[0]), feeds, optimized=True)

    def run_group(self, items: list[tuple[Bucket, tuple[str, int], dict]]):
        """Buckets of one engine file -> (reference outputs, engine outputs, seconds) per bucket, in
        order: every reference run first, then the engine, one session open at a time (each maps the
        weights; 150M model, build peak 2.5 GB with two open). The reference outputs wait on disk,
        memory-mapped back one bucket at a time (150M model: 268 MB for the target step's buckets).
        Yields each engine result as it comes, letting go of that bucket's outputs before the next runs."""
        spill = self.export_dir / "_references"      # inside the build's staging dir, removed with it
        spill.mkdir(exist_ok=True)
        refs = deque()
        for i, (b, _, f) in enumerate(items):
            out, seconds = timed(lambda b=b, f=f: self.runner.run(self.export_dir / f"{b.graph.name}.onnx", f))
            refs.append((_spill(spill, i, out), seconds))
            del out
        self.runner = ReferenceRunner(self.kernels)  # the reference's session closes before the engine's opens
        for _, e, f in items:
            out, seconds = timed(lambda e=e, f=f: self.runner.run(self.engine_dir / optimized_name(e[0]), f,
                                                                  optimized=True))
            files, ref_seconds = refs.popleft()
            yield {name: np.load(path, mmap_mode="r") for name, path in files.items()}, out, ref_seconds + seconds
            for path in files.values():
                path.unlink()
        self.runner = ReferenceRunner(self.kernels)


def _spill(directory: Path, index: int, outputs: dict[str, np.ndarray]) -> dict[str, Path]:
    """Each output to `<index>.<j>.npy` (output names may hold any character)."""
    files = {}
    for j, (name, value) in enumerate(outputs.items()):
        files[name] = directory / f"{index}.{j}.npy"
        np.save(files[name], value)
    return files
