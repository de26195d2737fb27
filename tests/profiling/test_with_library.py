"""bench/with_library.py: an engine dir that differs from its source only in the kernel library, its
other files hard-linked (the same weight pages for an A/B run of two libraries)."""

from __future__ import annotations

import os
import shutil

import pytest

from tandem.bench.with_library import with_library
from tandem.engines.manifest import check_files, read_manifest
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams
from tandem.plugins import cpu_kernels


def _tokens(engine_dir) -> list[int]:
    llm = LLM(engine_dir, RuntimeConfig(speculative=False))
    return llm.generate([[5, 7, 11, 13]], SamplingParams(max_tokens=6, temperature=0.0))[0].token_ids


def test_the_new_dir_shares_every_file_but_the_library_and_decodes_the_same(engine_dirs, tmp_path):
    src = engine_dirs["qwen3_5_mtp3"]
    assert (src / cpu_kernels.LIBRARY_FILE).is_file()      # the premise: the dir carries a library
    other = tmp_path / "other.so"
    shutil.copyfile(src / cpu_kernels.LIBRARY_FILE, other)
    out = with_library(src, other, tmp_path / "swapped")
    for path in src.iterdir():
        if path.name not in (cpu_kernels.LIBRARY_FILE, "manifest.json") and path.is_file():
            assert os.stat(out / path.name).st_ino == os.stat(path).st_ino, path.name    # the same pages
    library = out / cpu_kernels.LIBRARY_FILE
    assert os.stat(library).st_ino != os.stat(src / cpu_kernels.LIBRARY_FILE).st_ino
    assert library.read_bytes() == other.read_bytes()
    assert check_files(out, read_manifest(out)) == []
    assert _tokens(out) == _tokens(src)


def test_an_existing_folder_is_refused_and_left_as_it_was(engine_dirs, tmp_path):
    src = engine_dirs["qwen3_5_mtp3"]
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(SystemExit, match="exists"):
        with_library(src, src / cpu_kernels.LIBRARY_FILE, out)
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and (out / "mine.txt").read_text() == "keep"
