"""The build fingerprint covers exactly what the engines are made from, by content and relative
name; a no-op rerun hashes nothing; a rebuild says which input changed."""

from __future__ import annotations

import os
import shutil

import pytest

from tandem.checkpoint import open_checkpoint
from tandem.cli import main
from tandem.engines import fingerprint as fingerprint_module
from tandem.engines.builder import build_engines
from tandem.engines.manifest import CHECKPOINT_FILES, read_manifest
from tandem.engines.options import BuildOptions

FAST = BuildOptions(batch_sizes=(1,), prefill_chunk=8, max_seq_len=256, no_mtp=True)  # two engines


@pytest.fixture(scope="module")
def built_once(tiny_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("fingerprint")
    shutil.copytree(tiny_root / "qwen3_5_mtp1", root / "model")
    assert build_engines(root / "model", root / "engines", FAST, show_progress=False).status == "built"
    return root


@pytest.fixture
def built(built_once, tmp_path):
    """(a private checkpoint copy, its engine dir): copies of one build, their stats recorded."""
    src, out = tmp_path / "model", tmp_path / "engines"
    shutil.copytree(built_once / "model", src)
    shutil.copytree(built_once / "engines", out)
    assert build_engines(src, out, FAST, show_progress=False).status == "up-to-date"
    return src, out


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    """Names of the input files the fingerprint hashes (not taken from the previous manifest)."""
    names = []
    real = fingerprint_module.file_sha256

    def spy(path):
        names.append(path.name)
        return real(path)

    monkeypatch.setattr(fingerprint_module, "file_sha256", spy)
    return names


def test_a_noop_rerun_hashes_no_input(built, hashed):
    src, out = built
    assert build_engines(src, out, FAST, show_progress=False).status == "up-to-date"
    assert hashed == []


def test_an_unrelated_file_in_the_checkpoint_changes_nothing(built, hashed):
    src, out = built
    (src / "notes.json").write_text('{"todo": "try k=4"}')
    (src / "consolidated.safetensors").write_bytes((src / "model.safetensors").read_bytes())  # not read
    (src / "tokenizer.model").write_bytes(b"sentencepiece, not read")
    assert build_engines(src, out, FAST, show_progress=False).status == "up-to-date"
    assert hashed == []


def test_a_moved_or_copied_checkpoint_is_up_to_date(built, tmp_path, hashed):
    src, out = built
    moved = tmp_path / "elsewhere" / "model"
    moved.parent.mkdir()
    shutil.move(src, moved)
    assert build_engines(moved, out, FAST, show_progress=False).status == "up-to-date" and hashed == []
    copied = tmp_path / "copy"
    shutil.copytree(moved, copied)  # new files: hashed once, same content, their stats recorded
    assert build_engines(copied, out, FAST, show_progress=False).status == "up-to-date" and hashed
    hashed.clear()
    assert build_engines(copied, out, FAST, show_progress=False).status == "up-to-date" and hashed == []
    assert read_manifest(out)["fingerprint"]["inputs"]["config.json"]["ctime_ns"] == (
        (copied / "config.json").stat().st_ctime_ns)


def test_a_touched_file_is_hashed_again_and_still_up_to_date(built, hashed):
    src, out = built
    os.utime(src / "config.json", ns=(1, 1))
    assert build_engines(src, out, FAST, show_progress=False).status == "up-to-date"
    assert hashed == ["config.json"]


def test_a_weight_changed_with_the_same_size_rebuilds_naming_it(built, capsys):
    src, out = built
    data = bytearray((src / "model.safetensors").read_bytes())
    size = len(data)
    data[-4:] = bytes(b ^ 0x5A for b in data[-4:])
    (src / "model.safetensors").write_bytes(bytes(data))
    assert (src / "model.safetensors").stat().st_size == size
    result = build_engines(src, out, FAST, show_progress=False)
    assert result.status == "built" and result.reasons == ["model.safetensors changed"] and not result.reused


def test_a_rewrite_with_its_mtime_set_back_is_still_seen(built):
    """Size and mtime alone would miss it; ctime, which no program can set back, does not."""
    src, out = built
    path = src / "tokenizer_config.json"
    st = path.stat()
    path.write_text(path.read_text().replace('"eos_token"', '"eos_tokeN"'))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    assert build_engines(src, out, FAST, show_progress=False).reasons == ["tokenizer_config.json changed"]


def test_an_option_change_is_named_and_printed(built, capsys):
    src, out = built
    args = ["build-engines", str(src), "--out", str(out), "--batch-sizes", "1", "--prefill-chunk", "8",
            "--max-seq-len", "256", "--no-mtp", "--quiet", "--page-size", "8"]
    assert main(args) == 0
    assert "because: option page_size 16 -> 8" in capsys.readouterr().out
    (src / "generation_config.json").unlink()
    assert main(args + ["--max-seq-len", "128"]) == 0
    printed = capsys.readouterr().out
    assert "because: generation_config.json removed; option max_seq_len 256 -> 128" in printed


def test_the_inputs_are_the_files_the_reader_uses(tiny_root, tmp_path):
    """Relative names; a sharded checkpoint's shards and index; a draft folder's files under draft/."""
    ckpt = open_checkpoint(tiny_root / "qwen3_next")
    names = set(fingerprint_module.input_files(ckpt, CHECKPOINT_FILES))
    assert names == {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                     "model-00002-of-00002.safetensors"}
    draft = tmp_path / "draft"
    shutil.copytree(tiny_root / "qwen3_5_mtp1", draft)
    ckpt = open_checkpoint(tiny_root / "qwen3_5_mtp1", draft=draft)
    names = set(fingerprint_module.input_files(ckpt, CHECKPOINT_FILES))
    assert {"model.safetensors", "draft/model.safetensors", "draft/config.json"} <= names
    assert not any(n.startswith("draft/tokenizer") for n in names)  # the draft's tokenizer is never read


def test_changes_name_versions_and_older_fingerprints():
    new = fingerprint_module.fingerprint({"a.json": {"sha256": "1"}}, {"page_size": 16, "draft": "/x"},
                                         {"onnxruntime": "1.32.0"})
    assert "draft" not in new["options"]  # its files are inputs; where it lives is not
    old = {**new, "tandem": "0.0.9", "backend": {"onnxruntime": "1.31.0"}, "contract_version": -1}
    assert fingerprint_module.changes(old, new) == [
        f"tandem version 0.0.9 -> {new['tandem']}", "onnxruntime 1.31.0 -> 1.32.0",
        f"graph contract version -1 -> {new['contract_version']}"]
    older = {"checkpoint": {"/abs/model.safetensors": [1, 2]}, "options": new["options"]}
    assert fingerprint_module.changes(older, new) == ["the previous build recorded its inputs in an older form"]
