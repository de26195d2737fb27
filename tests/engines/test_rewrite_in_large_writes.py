"""engines/backends/common.py rewrite_in_large_writes: a built weights file written anew in large
pieces (its page-cache pages in large folios), the same bytes, and on failure left as it was."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tandem.engines.backends import common
from tandem.engines.backends.common import rewrite_in_large_writes
from tandem.engines.backends.onnxruntime_files import OPTIMIZED_WEIGHTS


def test_the_file_is_written_anew_with_the_same_bytes(tmp_path):
    path = tmp_path / "optimized.bin"
    data = np.random.default_rng(0).integers(0, 256, (3 << 20) + 123, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    path.chmod(0o640)
    before = os.stat(path)
    rewrite_in_large_writes(path, chunk=1 << 20)
    after = os.stat(path)
    assert path.read_bytes() == data
    assert after.st_ino != before.st_ino                 # a new file (its own pages), not the old one kept
    assert after.st_mode == before.st_mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimized.bin"]


def test_a_failure_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "optimized.bin"
    path.write_bytes(b"weights" * 1000)
    inode = os.stat(path).st_ino

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(common.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        rewrite_in_large_writes(path)
    assert path.read_bytes() == b"weights" * 1000 and os.stat(path).st_ino == inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimized.bin"]


def test_a_build_writes_its_optimized_weights_anew_once_they_are_complete(tiny_root, tmp_path, monkeypatch):
    """The build's last write of optimized.bin is the rewrite, over the whole file: the spy sees the
    complete file (the bytes the dir serves) and nothing writes it after."""
    from tandem.engines.backends import onnxruntime_optimized
    from tandem.engines.builder import build_engines
    from tandem.engines.options import BuildOptions

    seen = []

    def spy(path, chunk=8 << 20):
        seen.append((path.name, path.read_bytes()))
        rewrite_in_large_writes(path, chunk)
    monkeypatch.setattr(onnxruntime_optimized, "rewrite_in_large_writes", spy)
    out = tmp_path / "int4"
    result = build_engines(tiny_root / "qwen3_5_mtp3", out, BuildOptions(weights="int4", batch_sizes=(1,),
                                                                         prefill_chunk=8, max_seq_len=128,
                                                                         no_mtp=True), show_progress=False)
    assert result.status == "built"
    assert [name for name, _ in seen] == [OPTIMIZED_WEIGHTS]
    assert seen[0][1] == (out / OPTIMIZED_WEIGHTS).read_bytes()
