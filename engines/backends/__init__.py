"""The engine backends, one module each, imported only when asked for (TensorRT is not
installable everywhere). Each module exports the same names: NAME, versions(), build(), run_check(),
and Runner for the pipeline."""

from __future__ import annotations

import importlib

BACKEND_MODULES = {
    "onnxruntime": "tandem.engines.backends.onnxruntime_backend",
    "tensorrt": "tandem.engines.backends.tensorrt_backend",
}


def get_backend(name: str):
    if name not in BACKEND_MODULES:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_MODULES)}")
    return importlib.import_module(BACKEND_MODULES[name])
