"""Writes every graph of a checkpoint into one folder, sharing one external weights file.

    out/
      target_step.onnx      prefill chunks and plain decode
      verify_greedy.onnx    target + greedy acceptance
      verify_sample.onnx    target + rejection sampling (temperature / top-k / top-p)
      mtp_head_{j}.onnx     one per MTP layer
      round_*.onnx          unified rounds, decode_greedy_n*.onnx multi-step decode (where asked for)
      weights.bin           every weight once, 4 KiB aligned (external data of all graphs)
      export.json           contract version, graphs with content hashes, sizes, timings

Exporting the same checkpoint twice gives byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from tandem import contract
from tandem.checkpoint.reader import Checkpoint
from tandem.engines.manifest import WEIGHTS_FILE, file_sha256
from tandem.export.decode_graph import decode_steps
from tandem.export.graphs import mtp_head, target_step, verify_step
from tandem.export.layers import Weights
from tandem.export.options import EXPORT_DTYPES, ExportOptions
from tandem.export.quantize import WeightQuant
from tandem.export.round_graph import round_step
from tandem.graph_kinds import GraphKind, exported_kinds

_ALIGN = 4096
_INLINE_BYTES = 1024  # small constants stay inside the graph


@dataclass(frozen=True)
class ExportResult:
    folder: Path
    graphs: dict[str, str]   # graph name -> file name
    seconds: float
    weights_bytes: int


class _SharedWeights:
    """Appends each named tensor once to weights.bin and points TensorProtos at it."""

    def __init__(self, path: Path):
        self.path = path
        self.offsets: dict[str, tuple[int, int]] = {}
        self._file = open(path, "wb")
        self._size = 0

    def write(self, name: str, array: np.ndarray) -> None:
        """Store a weight as the graphs will read it (Weights writes each one here as it derives it,
        so no graph carries weight bytes)."""
        if name not in self.offsets:
            self._append(name, onnx.numpy_helper.from_array(array, name).raw_data)   # (packs int4 pairs)

    def _append(self, name: str, raw: bytes) -> None:
        pad = -self._size % _ALIGN
        self._file.write(b"\0" * pad)
        self._size += pad
        self.offsets[name] = (self._size, len(raw))
        self._file.write(raw)
        self._size += len(raw)

    def externalize(self, model: onnx.ModelProto) -> None:
        for tensor in model.graph.initializer:
            if tensor.name.startswith("/const/") and len(tensor.raw_data) <= _INLINE_BYTES:
                continue
            if tensor.name not in self.offsets:
                self._append(tensor.name, tensor.raw_data)
            offset, length = self.offsets[tensor.name]
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
            del tensor.external_data[:]
            for key, value in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(length))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value

    def close(self) -> int:
        self._file.close()
        return self._size


def build_graphs(ckpt: Checkpoint, options: ExportOptions | None = None) -> dict[str, onnx.ModelProto]:
    """Every graph of `ckpt`, each carrying its own copy of the weights it reads (held in memory)."""
    return dict(_graphs(ckpt, options or ExportOptions()))


def _graphs(ckpt: Checkpoint, options: ExportOptions, sink: _SharedWeights | None = None):
    """(name, graph) one at a time. Without `sink` each graph carries its own copy of the weights it
    reads (build_graphs: graphs held in memory). With it every weight goes to weights.bin as it is
    derived and the graphs only reference it there, so an export holds one weight at a time beside
    the checkpoint (150M model: export peak 2.0 GB when graphs carried them, 6.9 GB when every graph
    was held at once)."""
    desc, w = ckpt.description, Weights(ckpt, options.dtype, options.quant, options.draft_quant, sink)
    for kind in exported_kinds(desc.mtp.num_layers if desc.mtp else 0, options.extra):
        yield kind.name, _graph(desc, w, kind, options)


def _graph(desc, w: Weights, kind: GraphKind, options: ExportOptions) -> onnx.ModelProto:
    if kind.is_target_step:
        return target_step(desc, w, options.gdn_chunk_size)
    if kind.is_verify:
        return verify_step(desc, w, sampling=kind.sampling)
    if kind.is_round:
        return round_step(desc, w, kind, options.index_share)
    if kind.is_decode:
        return decode_steps(desc, w, kind)
    return mtp_head(desc, w, kind.head)


def _format(quant: WeightQuant | None) -> str:
    return quant.format if quant else "float"


def export_checkpoint(ckpt: Checkpoint, out_dir: str | Path, options: ExportOptions | None = None) -> ExportResult:
    """Export all graphs of `ckpt` into `out_dir` (created; existing graph files are replaced), their
    weights in one weights.bin, and export.json describing them (default options: float32, no extras)."""
    options = options or ExportOptions()
    start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shared = _SharedWeights(out / WEIGHTS_FILE)
    files, hashes, nodes = {}, {}, {}
    try:
        for name, model in _graphs(ckpt, replace(options, gdn_chunk_size=0), sink=shared):
            shared.externalize(model)
            data = model.SerializeToString(deterministic=True)
            files[name], nodes[name] = f"{name}.onnx", len(model.graph.node)
            del model  # its weights are in weights.bin now; the next graph brings its own
            (out / files[name]).write_bytes(data)
            hashes[name] = hashlib.sha256(data).hexdigest()
    finally:
        weights_bytes = shared.close()
    seconds = time.perf_counter() - start
    manifest = {
        "contract_version": contract.CONTRACT_VERSION,
        "dtype": options.dtype,
        "weights_format": _format(options.quant),
        "draft_weights": _format(options.quant if options.draft_quant == "same" else options.draft_quant),
        "family": ckpt.description.family,
        "mtp_layers": ckpt.description.mtp.num_layers if ckpt.description.mtp else 0,
        "graphs": {n: {"file": files[n], "sha256": hashes[n], "nodes": nodes[n]} for n in files},
        "weights": {"file": WEIGHTS_FILE, "bytes": weights_bytes,
                    "sha256": file_sha256(out / WEIGHTS_FILE)},
    }
    (out / "export.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return ExportResult(out, files, seconds, weights_bytes)


__all__ = ["EXPORT_DTYPES", "ExportOptions", "ExportResult", "build_graphs", "export_checkpoint"]
