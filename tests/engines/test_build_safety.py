"""`build-engines --out` replaces only what it may: a new path, an empty folder or a tandem engine
directory, never a user's folder or the checkpoint; stale temporaries are removed only when they
are provably a dead build's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tandem.cli import main
from tandem.engines import builder as builder_module
from tandem.engines.atomic import MARKER, OutputError
from tandem.engines.builder import build_engines
from tandem.engines.manifest import read_manifest
from tandem.engines.options import BuildOptions
from tandem.pipeline.runtime_settings import RUNTIME_SETTINGS

FAST = BuildOptions(batch_sizes=(1,), prefill_chunk=8, max_seq_len=256, no_mtp=True)  # two engines


def snapshot(folder) -> dict:
    """Every entry under `folder` (relative path -> bytes, or None for a folder)."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def leftovers(parent) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".tandem-build-"))


def cli_build(model, out, *extra) -> list[str]:
    return ["build-engines", str(model), "--out", str(out), "--batch-sizes", "1", "--prefill-chunk", "8",
            "--max-seq-len", "256", "--no-mtp", "--quiet", *extra]


def test_a_user_folder_is_refused_and_left_untouched(tiny_root, tmp_path, capsys):
    user = tmp_path / "photos"
    (user / "2024").mkdir(parents=True)
    (user / "notes.txt").write_text("mine")
    (user / "2024" / "a.jpg").write_bytes(os.urandom(64))
    before = snapshot(user)
    with pytest.raises(OutputError, match="is not a tandem engine directory") as info:
        build_engines(tiny_root / "qwen3_5_mtp1", user, FAST, show_progress=False)
    assert "2024, notes.txt" in str(info.value) and "pass a new or empty folder" in str(info.value)
    assert main(cli_build(tiny_root / "qwen3_5_mtp1", user)) == 1
    assert "is not a tandem engine directory" in capsys.readouterr().err
    assert snapshot(user) == before and not leftovers(tmp_path)


def test_out_as_the_model_dir_leaves_the_checkpoint_intact(tiny_copy, capsys):
    src = tiny_copy("qwen3_5_mtp1")
    before = snapshot(src)
    assert main(cli_build(src, src)) == 1
    assert "is the checkpoint folder; building there would replace the checkpoint" in capsys.readouterr().err
    with pytest.raises(OutputError, match="is the checkpoint folder"):
        build_engines(src / ".." / src.name, src, FAST, show_progress=False)  # another spelling of the same folder
    assert snapshot(src) == before and not leftovers(src.parent)


def test_out_inside_or_around_the_checkpoint_is_refused(tiny_copy, capsys):
    src = tiny_copy("qwen3_5_mtp1")
    before = snapshot(src)
    assert main(cli_build(src, src / "engines")) == 1
    assert "is inside the checkpoint folder" in capsys.readouterr().err
    with pytest.raises(OutputError, match="holds the checkpoint folder"):
        build_engines(src, src.parent, FAST, show_progress=False)
    assert snapshot(src) == before and not (src / "engines").exists()


def test_out_inside_the_draft_folder_is_refused(tiny_root, tiny_copy):
    """The draft is read-only input too (a copy of the checkpoint serves as its draft here)."""
    draft = tiny_copy("qwen3_5_mtp1")
    options = BuildOptions(batch_sizes=(1,), prefill_chunk=8, max_seq_len=256, draft=str(draft))
    with pytest.raises(OutputError, match="inside the draft folder"):
        build_engines(tiny_root / "qwen3_5_mtp1", draft / "engines", options, show_progress=False)
    assert not (draft / "engines").exists()


def test_an_empty_folder_is_used_and_a_previous_engine_dir_replaced(tiny_root, tmp_path):
    out = tmp_path / "engines"
    out.mkdir()
    first = build_engines(tiny_root / "qwen3_5_mtp1", out, FAST, show_progress=False)
    assert first.status == "built" and "(an empty folder)" in first.reasons[0]
    stale = out / RUNTIME_SETTINGS  # tandem's own extra file: goes with the directory it tuned
    stale.write_text("{}")
    wider = BuildOptions(batch_sizes=(1, 2), prefill_chunk=8, max_seq_len=256, no_mtp=True)
    second = build_engines(tiny_root / "qwen3_5_mtp1", out, wider, show_progress=False)
    assert second.status == "built" and read_manifest(out)["options"]["batch_sizes"] == [1, 2]
    assert not stale.exists() and MARKER not in os.listdir(out) and not leftovers(tmp_path)


def test_an_engine_dir_holding_a_users_file_is_not_replaced(tiny_root, tmp_path, capsys):
    out = tmp_path / "engines"
    build_engines(tiny_root / "qwen3_5_mtp1", out, FAST, show_progress=False)
    (out / "my-notes.md").write_text("benchmarks I ran")
    before = snapshot(out)
    assert main(cli_build(tiny_root / "qwen3_5_mtp1", out, "--page-size", "8")) == 1
    err = capsys.readouterr().err
    assert "is a tandem engine directory but also holds what tandem did not write there (my-notes.md)" in err
    assert snapshot(out) == before and not leftovers(tmp_path)


def test_a_folder_that_changes_during_the_build_is_not_replaced(tiny_root, tmp_path, monkeypatch):
    out = tmp_path / "engines"
    out.mkdir()
    real = builder_module.export_checkpoint

    def export_while_the_user_writes(*args, **kwargs):
        (out / "report.docx").write_text("written during the build")
        return real(*args, **kwargs)

    monkeypatch.setattr(builder_module, "export_checkpoint", export_while_the_user_writes)
    with pytest.raises(OutputError, match="not a tandem engine directory"):
        build_engines(tiny_root / "qwen3_5_mtp1", out, FAST, show_progress=False)
    assert os.listdir(out) == ["report.docx"] and not leftovers(tmp_path)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_cleanup_removes_only_a_dead_builds_folders(tiny_root, tmp_path):
    import socket

    host = socket.gethostname()
    made = {}
    for name, marker in {"dead": {"pid": _dead_pid(), "host": host}, "alive": {"pid": os.getpid(), "host": host},
                         "elsewhere": {"pid": 1, "host": host + "-other"}, "user": None, "empty": None}.items():
        folder = tmp_path / f".tandem-build-engines-{name}"
        folder.mkdir()
        if marker is not None:
            (folder / MARKER).write_text(json.dumps(marker))
            (folder / "engine.onnx").write_bytes(b"partial")
        elif name == "user":
            (folder / "thesis.tex").write_text("not tandem's")
        made[name] = folder
    (tmp_path / "elsewhere-target").mkdir()
    (tmp_path / ".tandem-build-engines-link").symlink_to(tmp_path / "elsewhere-target")
    build_engines(tiny_root / "qwen3_5_mtp1", tmp_path / "engines", FAST, show_progress=False)
    assert not made["dead"].exists() and not made["empty"].exists()
    assert (made["user"] / "thesis.tex").read_text() == "not tandem's"
    assert (made["alive"] / "engine.onnx").exists() and (made["elsewhere"] / "engine.onnx").exists()
    assert (tmp_path / ".tandem-build-engines-link").is_symlink() and (tmp_path / "elsewhere-target").is_dir()
