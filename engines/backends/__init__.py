"""The engine backends, imported only when asked for (TensorRT is not installable everywhere). Each
has a serving module (NAME, versions(), Runner: what the pipeline loads) and a build module (NAME,
versions(), engine_file(), build(), Checker: what `tandem build-engines` loads), so serving an engine
dir never imports the build side."""

from __future__ import annotations

import importlib

BACKEND_MODULES = {
    "onnxruntime": "tandem.engines.backends.onnxruntime_backend",
    "tensorrt": "tandem.engines.backends.tensorrt_backend",
}
BUILD_MODULES = {
    "onnxruntime": "tandem.engines.backends.onnxruntime_build",
    "tensorrt": "tandem.engines.backends.tensorrt_build",
}


def _module(table: dict[str, str], name: str):
    if name not in table:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(table)}")
    return importlib.import_module(table[name])


def get_backend(name: str):
    """The serving side of backend `name`."""
    return _module(BACKEND_MODULES, name)


def get_builder(name: str):
    """The build side of backend `name`."""
    return _module(BUILD_MODULES, name)
