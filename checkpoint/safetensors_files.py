"""Reads safetensors checkpoints lazily: headers first, tensor bytes only on request.

Why not `safetensors.safe_open`: its numpy framework cannot return bf16, and validation needs
only the JSON headers (names, dtypes, shapes), which this module parses without touching data.
Tensor data is memory-mapped, so reading one tensor pages in only its bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from tandem.checkpoint.errors import CheckpointError

# safetensors dtype tag -> numpy dtype. Quantized tags map to None: they are refused upstream.
_DTYPES: dict[str, np.dtype | None] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors caps the JSON header at 100 MB


@dataclass(frozen=True)
class TensorEntry:
    """Where one stored tensor lives: file, dtype tag, shape and byte range within the data."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse one .safetensors header into TensorEntry records; reads no tensor data."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise ValueError("file is shorter than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(_HEADER_LIMIT, size - 8):
                raise ValueError(f"header length {header_len} does not fit in a {size}-byte file")
            header = json.loads(f.read(header_len))
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({e}). Re-download or re-save the file."
        ) from e
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        entry = TensorEntry(path, info["dtype"], tuple(info["shape"]), data_start + begin, data_start + end)
        if entry.end > size:
            raise CheckpointError(
                f"{path}: tensor {name} ends at byte {entry.end} but the file has {size} bytes "
                "(truncated download?). Re-download the file."
            )
        entries[name] = entry
    return entries


class TensorIndex:
    """All stored tensors of a checkpoint folder (single file or sharded with an index json).

    Built from headers only. `read(name)` memory-maps the file and returns a numpy view.
    """

    def __init__(self, entries: dict[str, TensorEntry], files: list[Path]):
        self.entries = entries
        self.files = files
        self._maps: dict[Path, np.memmap] = {}

    @classmethod
    def open(cls, folder: Path) -> TensorIndex:
        files = weight_files(folder)
        entries: dict[str, TensorEntry] = {}
        for file in files:
            entries.update(read_header(file))
        return cls(entries, files)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def read(self, name: str) -> np.ndarray:
        """The tensor as stored (bf16 as ml_dtypes.bfloat16), a read-only memory-mapped view."""
        e = self.entries[name]
        dtype = _DTYPES.get(e.dtype)
        if dtype is None:
            raise CheckpointError(f"{e.file}: tensor {name} has dtype {e.dtype}, which tandem cannot read.")
        mm = self._maps.get(e.file)
        if mm is None:
            mm = self._maps[e.file] = np.memmap(e.file, dtype=np.uint8, mode="r")
        return mm[e.begin : e.end].view(dtype).reshape(e.shape)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: the index's shards, or model.safetensors.

    Raises a CheckpointError naming the missing file and what to do.
    """
    index_path = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{index_path}: not a valid safetensors index ({e}); it needs a 'weight_map' object. "
                "Re-download it."
            ) from e
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            raise CheckpointError(
                f"{index_path} names shard(s) that are not in {folder}: {', '.join(missing)}. "
                "Download every shard listed in the index."
            )
        return [folder / s for s in shards]
    if single.exists():
        return [single]
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    hint = f" (found {', '.join(others)} but no index naming them)" if others else ""
    raise CheckpointError(
        f"{folder}: no model.safetensors or model.safetensors.index.json{hint}. "
        "tandem reads Hugging Face safetensors checkpoints; save the model with save_pretrained()."
    )

