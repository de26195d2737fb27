"""What an ONNX Runtime engine dir holds beside its lowered graphs, by name: each graph's saved
optimized form (`optimized_name`) with its weights in optimized.bin, and the CPU kernel library
those graphs use. The serving side reads these; the build side (onnxruntime_optimized.py,
onnxruntime_kernel_files.py) writes them."""

from __future__ import annotations

import functools
from pathlib import Path

import onnxruntime as ort

from tandem.plugins import cpu_kernels

OPTIMIZED_WEIGHTS = "optimized.bin"


def optimized_name(engine_file: str) -> str:
    """"verify_greedy.w4.onnx" -> "verify_greedy.w4.opt.onnx"."""
    return f"{engine_file.removesuffix('.onnx')}.opt.onnx"


def engine_library(engine_dir: Path) -> Path | None:
    """The engine dir's copy of the kernel library, which its optimized graphs use; None where it has none."""
    path = engine_dir / cpu_kernels.LIBRARY_FILE
    return path if path.is_file() else None


@functools.lru_cache(maxsize=8)
def load_error(library: Path) -> str | None:
    """Why ONNX Runtime cannot load the kernel library here (a C++ runtime older than the build
    machine's, say); None where it loads."""
    try:
        ort.SessionOptions().register_custom_ops_library(str(library))
    except Exception as e:  # noqa: BLE001 (ONNX Runtime raises its own Fail / RuntimeError types)
        return str(e).splitlines()[0][:300]
    return None
