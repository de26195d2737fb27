"""ONNX Runtime's optimized graphs, saved at build time so a load skips graph optimisation.

    engine dir/
      target_step.onnx          lowered graph (kept: the fallback, and the CUDA provider's input)
      target_step.opt.onnx      what ONNX Runtime's CPU optimizer (ORT_ENABLE_ALL) made of it; a
                                load opens it with optimisation off
      weights.bin               every tensor the optimizer left unchanged (all of a float build)
      optimized.bin             tensors the optimizer made (MatMulNBits' packed int8 / int4
                                weights) or a rewrite added (tandem's float matmuls' weight
                                panels), each distinct one once, shared by every .opt.onnx

Measured on the shipped model (2 cores): a session on a lowered graph took ~400 ms to create,
on its saved optimized graph 50-140 ms. The optimizer's output depends on the ONNX Runtime
version and on the CPU's instruction sets (fusions that exist only where MLAS has the kernel),
so both are part of the backend's versions (manifest and build fingerprint): a load on another
version or CPU opens the lowered graphs instead (engines/backends/onnxruntime_backend.py), and a
rebuild there says what changed. This module owns saving and the verification copy; the
backend decides which file a session opens.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from tandem.engines.backends.common import rewrite_in_large_writes
from tandem.engines.backends.onnxruntime_files import OPTIMIZED_WEIGHTS, optimized_name
from tandem.engines.manifest import WEIGHTS_FILE

_ALIGN = 4096                  # as weights.bin: ONNX Runtime maps page-aligned external data
_EXTERNAL_MIN_BYTES = 1024     # smaller initializers stay inside the graph (as the exporter's constants)
def save_optimized(folder: Path, files: list[str], options, progress=None, sources: dict[str, Path] | None = None,
                   rewrite=None) -> set[str]:
    """Write `optimized_name(f)` for each engine file `f` in `folder`, its tensors in weights.bin
    (unchanged ones) or optimized.bin. `options(level)` gives the serving SessionOptions.
    `sources`: engine file -> the graph to optimize in its place (a lowering for the CPU provider
    only, in `folder`, with the same weights), where it is not the engine file itself.
    `rewrite(model, tensors) -> bool`: a change to each optimizer output before it is saved (nodes
    to tandem's kernels), with `tensors` to read its initializers and add new ones
    (_GraphTensors); returns the engine files it changed."""
    sources, rewritten = sources or {}, set()
    store = _OptimizedWeights(folder)
    try:
        for name in files:
            with tempfile.TemporaryDirectory(dir=folder, prefix=".tandem-opt-") as scratch:
                saved = Path(scratch) / name
                opts = options(ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
                opts.optimized_model_filepath = str(saved)
                opts.add_session_config_entry("session.disable_prepacking", "1")  # never run: no packed copy needed
                opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "data.bin")
                opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                              str(_EXTERNAL_MIN_BYTES))
                ort.InferenceSession(str(sources.get(name, folder / name)), opts, providers=["CPUExecutionProvider"])
                model = onnx.load(str(saved), load_external_data=False)
                if rewrite is not None and rewrite(model, _GraphTensors(saved.parent, store)):
                    rewritten.add(name)
                store.rehome(model, onnx.load(str(folder / name), load_external_data=False), saved.parent / "data.bin")
                onnx.save(model, str(folder / optimized_name(name)))
            if progress:
                progress.step(optimized_name(name))
    finally:
        store.close()
    if (folder / OPTIMIZED_WEIGHTS).is_file():      # its pages in large folios (rewrite_in_large_writes)
        rewrite_in_large_writes(folder / OPTIMIZED_WEIGHTS)
    return rewritten


def exact_copy(path: Path) -> Path:
    """A sibling of the optimized graph `path` whose MatMulNBits (ONNX Runtime's, or tandem's int4
    kernel) compute in float32 (accuracy level 0) instead of int8 activations: the build verifies
    the saved graph with it (the level is fixed in the saved nodes, so the session option the
    lowered graphs use has no effect here). The caller deletes it once its session is open."""
    from tandem.export.cpu_kernel_lowering import exact_matmul_nbits  # (the build side, as above)

    model = onnx.load(str(path), load_external_data=False)
    exact_matmul_nbits(model)
    copy = path.with_name(f".tandem-exact-{path.name}")
    onnx.save(model, str(copy))
    return copy


def _external(tensor: onnx.TensorProto) -> tuple[str, int, int] | None:
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    entries = {e.key: e.value for e in tensor.external_data}
    return entries["location"], int(entries.get("offset", 0)), int(entries["length"])


def _point(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _read(f, offset: int, length: int) -> bytes:
    f.seek(offset)
    return f.read(length)


class _GraphTensors:
    """A rewrite's access to the tensors of one optimizer output (saved in `folder`, external data
    relative to it): array() reads one; add() writes a new one into optimized.bin at once (so a
    graph's new tensors are never all in memory together) and returns it, pointing there."""

    def __init__(self, folder: Path, store: _OptimizedWeights):
        self.folder, self.store = folder, store

    def array(self, tensor: onnx.TensorProto) -> np.ndarray:
        ref = _external(tensor)
        if ref is None:
            return numpy_helper.to_array(tensor)
        location, offset, length = ref
        with open(self.folder / location, "rb") as f:
            blob = _read(f, offset, length)
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
        return np.frombuffer(blob, dtype=dtype).reshape(tuple(tensor.dims))

    def add(self, name: str, array: np.ndarray) -> onnx.TensorProto:
        blob = np.ascontiguousarray(array).tobytes()
        tensor = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        _point(tensor, OPTIMIZED_WEIGHTS, self.store.append(blob), len(blob))
        return tensor


class _OptimizedWeights:
    """Points each external tensor of a saved graph at weights.bin where the lowered graph has a
    tensor of the same name and bytes there, else at optimized.bin (appended once per content).
    Reads one tensor at a time (no file is mapped: mapped pages count in the build's RSS, and the
    optimizer's own session maps weights.bin already)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.weights = open(folder / WEIGHTS_FILE, "rb") if (folder / WEIGHTS_FILE).is_file() else None
        self._file = open(folder / OPTIMIZED_WEIGHTS, "wb")
        self._size = 0
        self._offsets: dict[str, int] = {}   # sha256 -> offset in optimized.bin

    def rehome(self, model: onnx.ModelProto, lowered: onnx.ModelProto, data_path: Path) -> None:
        known = {t.name: ref for t in lowered.graph.initializer if (ref := _external(t))}
        tensors = [(t, ref) for t in model.graph.initializer if (ref := _external(t)) and ref[0] != OPTIMIZED_WEIGHTS]
        if not tensors:
            return
        with open(data_path, "rb") as data:
            for tensor, (_, offset, length) in tensors:
                blob = _read(data, offset, length)
                same = known.get(tensor.name)
                if same and same[0] == WEIGHTS_FILE and same[2] == length and self.weights is not None \
                        and _read(self.weights, same[1], length) == blob:
                    _point(tensor, WEIGHTS_FILE, same[1], length)
                else:
                    _point(tensor, OPTIMIZED_WEIGHTS, self.append(blob), length)

    def append(self, blob: bytes) -> int:
        digest = hashlib.sha256(blob).hexdigest()
        if digest not in self._offsets:
            pad = -self._size % _ALIGN
            self._file.write(b"\0" * pad)
            self._offsets[digest] = self._size + pad
            self._file.write(blob)
            self._size += pad + len(blob)
        return self._offsets[digest]

    def close(self) -> None:
        self._file.close()
        if self.weights is not None:
            self.weights.close()
        if not self._size:  # a float build: every tensor is in weights.bin
            (self.folder / OPTIMIZED_WEIGHTS).unlink()
