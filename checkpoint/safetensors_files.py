"""Reads safetensors checkpoints lazily: headers first, tensor bytes only on request.

Why not `safetensors.safe_open`: its numpy framework cannot return bf16, and validation needs
only the JSON headers (names, dtypes, shapes), which this module parses without touching data.
Tensor data is memory-mapped, so reading one tensor pages in only its bytes.

Headers are checked in full before anything uses them: every dtype tag known, shapes of
non-negative ints, offsets inside the data section and spanning exactly numel x itemsize bytes,
and no two tensors sharing bytes (a hostile or corrupt header must not build engines from the
wrong weights). Each problem names the file and the tensor.

FP8 block-quantized weights (DeepSeek's format, checked by validation.block_fp8_scales) are read
dequantized: float8_e4m3fn values (ml_dtypes decodes them exactly) times their `weight_scale_inv`
entry, one float32 scale per block x block tile, edge tiles partial.
"""

from __future__ import annotations

import json
import math
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
# bits per element of every safetensors dtype tag (sub-byte tags pack; the total must be whole bytes)
_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6,
         "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
         "F64": 64, "I64": 64, "U64": 64, "C64": 64}
_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors caps the JSON header at 100 MB
_FIX = "Re-download or re-save the file."
_MAX_PROBLEMS = 8  # a hostile header can hold millions of bad entries: report the first few


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
    """Parse and check one .safetensors header into TensorEntry records; reads no tensor data."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise ValueError("file is shorter than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(_HEADER_LIMIT, size - 8):
                raise ValueError(f"header length {header_len} does not fit in a {size}-byte file")
            header = json.loads(f.read(header_len), object_pairs_hook=_no_duplicate_keys)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}). {_FIX}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object. {_FIX}")
    data_start = 8 + header_len
    entries, problems = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entry = _entry(path, name, info, data_start, size, problems)
        if entry is not None:
            entries[name] = entry
    problems += _overlaps(path, entries, data_start)
    if problems:
        extra = len(problems) - _MAX_PROBLEMS
        more = [f"{path}: {extra} more header problems like these"] if extra > 0 else []
        raise CheckpointError(problems[:_MAX_PROBLEMS] + more)
    return entries


def _no_duplicate_keys(pairs: list[tuple]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"the header names {dup!r} twice")
    return dict(pairs)


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entry(path: Path, name: str, info, data_start: int, size: int, problems: list[str]) -> TensorEntry | None:
    """One header entry as a TensorEntry, or None with the reason appended to `problems`."""
    where = f"{path}: tensor {name}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        problems.append(f"{where}: its header entry needs 'dtype', 'shape' and 'data_offsets'. {_FIX}")
        return None
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in _BITS:
        problems.append(f"{where}: dtype {dtype!r} is not a safetensors dtype tag (known: "
                        f"{', '.join(sorted(_BITS))}). {_FIX}")
        return None
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        problems.append(f"{where}: shape {shape!r} must be a list of non-negative integers. {_FIX}")
        return None
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets)
            or offsets[0] > offsets[1]):
        problems.append(f"{where}: data_offsets {offsets!r} must be two non-negative integers [begin, end] "
                        f"with begin <= end. {_FIX}")
        return None
    begin, end = offsets
    if data_start + end > size:
        problems.append(f"{where} ends at byte {data_start + end} but the file has {size} bytes "
                        f"(truncated download?). {_FIX}")
        return None
    bits = math.prod(shape) * _BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        need = f"{bits / 8:g}"
        problems.append(f"{where} is {dtype} {shape}, which takes {need} bytes, but its data_offsets "
                        f"[{begin}, {end}] span {end - begin} bytes: the header disagrees with the data. {_FIX}")
        return None
    return TensorEntry(path, dtype, tuple(shape), data_start + begin, data_start + end)


def _overlaps(path: Path, entries: dict[str, TensorEntry], data_start: int) -> list[str]:
    """Pairs of tensors whose byte ranges intersect (empty tensors hold no bytes)."""
    spans = sorted((e.begin, e.end, n) for n, e in entries.items() if e.end > e.begin)
    problems, last_end, last_name = [], -1, ""
    for begin, end, name in spans:
        if begin < last_end:
            problems.append(f"{path}: tensors {last_name} and {name} share bytes {begin - data_start}.."
                            f"{min(end, last_end) - data_start} of the data section, so one of them would read "
                            f"the other's weights. {_FIX}")
        if end > last_end:
            last_end, last_name = end, name
    return problems


class TensorIndex:
    """All stored tensors of a checkpoint folder (single file or sharded with an index json).

    Built from headers only. `read(name)` memory-maps the file and returns a numpy view.
    """

    def __init__(self, entries: dict[str, TensorEntry], files: list[Path], index_file: Path | None = None):
        self.entries = entries
        self.files = files
        self.index_file = index_file  # model.safetensors.index.json when sharded
        self._maps: dict[Path, np.memmap] = {}
        self._scales: dict[str, TensorEntry] = {}  # fp8 weight -> its weight_scale_inv (see dequantizing)
        self.block: tuple[int, int] | None = None

    @classmethod
    def open(cls, folder: Path) -> TensorIndex:
        files = weight_files(folder)
        index_file = folder / "model.safetensors.index.json"
        entries: dict[str, TensorEntry] = {}
        for file in files:
            for name, entry in read_header(file).items():
                if name in entries:
                    raise CheckpointError(f"{folder}: tensor {name} is stored in both {entries[name].file.name} and "
                                          f"{file.name}. Re-download the shards of one release.")
                entries[name] = entry
        return cls(entries, files, index_file if index_file.exists() else None)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def dequantizing(self, scales: dict[str, str], block: tuple[int, int]) -> TensorIndex:
        """This index with each fp8 weight in `scales` (weight -> its weight_scale_inv) read as float32
        and the scale tensors gone from `entries` (they belong to their weights, not to the layout)."""
        scale_names = set(scales.values())
        out = TensorIndex({n: e for n, e in self.entries.items() if n not in scale_names}, self.files, self.index_file)
        out._scales, out.block = {w: self.entries[s] for w, s in scales.items()}, block
        return out

    def read(self, name: str) -> np.ndarray:
        """The tensor as stored (bf16 as ml_dtypes.bfloat16), a read-only memory-mapped view; an fp8
        block-quantized weight as a float32 array dequantized with its scales."""
        if name in self._scales:
            try:
                return dequantize_fp8_blocks(self._view(name, self.entries[name]),
                                             self._view(name + "_scale_inv", self._scales[name]), self.block)
            except ValueError as e:
                raise CheckpointError(f"{self.entries[name].file}: tensor {name}: {e}. {_FIX}") from e
        return self._view(name, self.entries[name])

    def release(self) -> None:
        """Drop the file mappings (a later read maps again): pages read through them count in the
        process's RSS for as long as they stay mapped."""
        self._maps.clear()

    def _view(self, name: str, e: TensorEntry) -> np.ndarray:
        dtype = _DTYPES.get(e.dtype)
        if dtype is None:
            raise CheckpointError(f"{e.file}: tensor {name} has dtype {e.dtype}, which tandem cannot read.")
        mm = self._maps.get(e.file)
        if mm is None:
            mm = self._maps[e.file] = np.memmap(e.file, dtype=np.uint8, mode="r")
        return mm[e.begin : e.end].view(dtype).reshape(e.shape)


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """[ceil(rows / block rows), ceil(cols / block cols)]: one scale per tile, edge tiles partial."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 weight[r, c] * scale_inv[r // block rows, c // block cols] (one rounding: exact as torch's
    reference dequantization)."""
    rows, cols = weight.shape
    if scale_inv.shape != fp8_scale_shape(weight.shape, block):
        raise ValueError(f"scale shape {list(scale_inv.shape)} does not tile a {rows}x{cols} weight in "
                         f"{block[0]}x{block[1]} blocks")
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], axis=0), block[1], axis=1)
    return weight.astype(np.float32) * scale[:rows, :cols]


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

