"""Shared fixtures: tiny checkpoints of every kind, written once per session."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tandem.checkpoint.safetensors_files import TensorIndex

# Triton kernels (tandem.plugins) run in Triton's interpreter unless a GPU is there; the choice
# is made when a kernel module is imported, so it is made here, before any test imports one.
try:
    import torch
    _HAS_GPU = torch.cuda.is_available()
except ImportError:
    _HAS_GPU = False
if not _HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
from tandem.testing.tiny_checkpoints import TINY_KINDS, write_tiny_checkpoint


@pytest.fixture(scope="session")
def library():
    """tandem's CPU kernel library (plugins/cpu_kernels.py), compiled once."""
    from tandem.plugins import cpu_kernels
    path = cpu_kernels.library()
    assert path is not None, "the CPU kernels did not compile (a C++ compiler is part of the test setup)"
    return path


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    for kind in TINY_KINDS:
        write_tiny_checkpoint(root / kind, kind)
    return root


@pytest.fixture(scope="session")
def torch_references(tiny_root):
    """kind -> (transformers text model, lm_head, torch MTPReference), loaded once per session."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tandem.checkpoint.families.qwen_hybrid.reference import MTPReference, load_target

    out = {}
    for kind in TINY_KINDS:
        text_model, lm_head, cfg = load_target(tiny_root / kind)
        out[kind] = (text_model, lm_head, MTPReference.from_checkpoint(tiny_root / kind, text_model, lm_head, cfg))
    return out


@pytest.fixture(scope="session")
def engine_dirs(tiny_root, tmp_path_factory):
    """Engine directories of two tiny kinds, built once per session (see pipeline_fixtures)."""
    from .pipeline_fixtures import build_test_engines

    return build_test_engines(tiny_root, tmp_path_factory)


@pytest.fixture(scope="session")
def quantized_dirs(tiny_root, tmp_path_factory):
    """Weight-only int8 and int4 engine directories of the tiny qwen3_5_mtp3, built once per session."""
    from tandem.engines.builder import build_engines
    from tandem.engines.options import BuildOptions

    out = {}
    for fmt in ("int8", "int4"):
        path = tmp_path_factory.mktemp("quantized") / fmt
        result = build_engines(tiny_root / "qwen3_5_mtp3", path, BuildOptions(weights=fmt, batch_sizes=(1, 8),
                                                                             prefill_chunk=8, max_seq_len=256),
                               show_progress=False)
        assert result.status == "built"                   # every engine verified against the export
        out[fmt] = path
    return out


@pytest.fixture
def tiny_copy(tiny_root, tmp_path):
    """copy(kind) -> a private copy of a tiny checkpoint that the test may break."""

    def copy(kind: str) -> Path:
        dst = tmp_path / kind
        shutil.copytree(tiny_root / kind, dst)
        return dst

    return copy


_REAL_READ = TensorIndex.read  # captured before any test patches it


def read_all(folder: Path) -> dict:
    """Every stored tensor of a folder as numpy (for tests that rewrite checkpoints)."""
    import numpy as np

    index = TensorIndex.open(folder)
    return {n: np.array(_REAL_READ(index, n)) for n in index.names()}


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Fail the test if any tensor data is read (config-time checks must use headers only)."""

    def refuse(self, name):
        raise AssertionError(f"tensor data of {name} was read during config-time validation")

    monkeypatch.setattr(TensorIndex, "read", refuse)


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    target = data.get("text_config", data)
    for key, value in changes.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value
    path.write_text(json.dumps(data))
