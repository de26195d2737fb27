"""A build killed with SIGKILL at any point leaves nothing that outlives the next build in the same
parent folder, and never touches a user's file; `--out` creates its missing parents; only a
manifest that proves tandem wrote a folder lets a build replace it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cli import main
from tandem.engines import builder as builder_module
from tandem.engines.atomic import OutputError, is_engine_dir
from tandem.engines.builder import build_engines
from tandem.engines.integrity import verify_engine_dir
from tandem.engines.manifest import DIGEST, MANIFEST, read_manifest
from tandem.engines.options import BuildOptions

FAST = BuildOptions(batch_sizes=(1,), prefill_chunk=8, max_seq_len=256, no_mtp=True)  # two engines
CLI_FAST = ["--batch-sizes", "1", "--prefill-chunk", "8", "--max-seq-len", "256", "--no-mtp", "--quiet"]

# Run a build in a child that SIGKILLs itself at one point (argv[1]); the rest of argv is the CLI's.
KILLED_BUILD = r"""
import os, signal, sys
from tandem.engines import atomic, builder

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def wrap(module, name, when, after=False):
    real = getattr(module, name)
    def wrapped(*args, **kwargs):
        if not after and when(*args):
            die()
        result = real(*args, **kwargs)
        if after and when(*args):
            die()
        return result
    setattr(module, name, wrapped)

def remove_half_then_die(folder):
    if "-old-" in folder.name:                  # the replaced engine dir, after the swap
        for path in sorted(folder.iterdir())[:3]:
            if path.name != atomic.MARKER:
                path.unlink()
        die()
    return real_remove(folder)

point = sys.argv[1]
if point == "before-marker":                    # mkdtemp done, marker not yet written: an empty folder
    wrap(atomic, "_mark", lambda folder: True)
elif point == "exported":                       # the ONNX export written into the temporary folder
    wrap(builder, "export_checkpoint", lambda *a: True, after=True)
elif point == "verifying":                      # engines built, the first verification running
    wrap(builder, "compare", lambda *a: True)
elif point == "set-aside":                      # the old engine dir renamed aside, the new one not moved in
    wrap(atomic, "_mark", lambda folder: "-old-" in folder.name)
elif point == "removing-old":                   # swapped; the old engine dir half removed
    real_remove = atomic._remove
    atomic._remove = remove_half_then_die
from tandem.cli import main
sys.exit(main(sys.argv[2:]))
"""


def tree(folder: Path) -> dict:
    """Every entry under `folder`: relative path -> (bytes, mtime_ns), None for a folder."""
    return {str(p.relative_to(folder)): ((p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def temporaries(parent: Path) -> list[str]:
    names = (p.name for p in parent.iterdir())
    return sorted(n for n in names if n.startswith(".tandem-build-") and n != ".tandem-build-mine")


def test_a_build_killed_at_five_points_leaves_nothing_after_the_next_build(tiny_root, tmp_path):
    model = tiny_root / "qwen3_5_mtp1"
    parent = tmp_path / "engines"
    (parent / "photos").mkdir(parents=True)
    (parent / "notes.txt").write_text("mine")
    (parent / "photos" / "a.jpg").write_bytes(os.urandom(64))
    (parent / ".tandem-build-mine").mkdir()      # a user's folder that happens to carry the prefix
    (parent / ".tandem-build-mine" / "thesis.tex").write_text("not tandem's")
    build_engines(model, parent / "a", FAST, show_progress=False)
    build_engines(model, parent / "next", FAST, show_progress=False)
    first_a = read_manifest(parent / "a")
    users = {name: tree(parent / name) for name in ("photos", ".tandem-build-mine")}
    notes = (parent / "notes.txt").stat().st_mtime_ns

    for point, out, extra in [("before-marker", "b", []), ("exported", "b", []), ("verifying", "b", []),
                              ("set-aside", "a", ["--page-size", "8"]), ("removing-old", "a", ["--page-size", "8"])]:
        args = ["build-engines", str(model), "--out", str(parent / out), *CLI_FAST, *extra]
        child = subprocess.run([sys.executable, "-c", KILLED_BUILD, point, *args], capture_output=True, text=True)
        assert child.returncode == -9, (point, child.stderr[-2000:])
        assert temporaries(parent), f"the build killed at {point} left nothing to sweep"
        if point == "set-aside":
            assert not (parent / "a").exists()   # the engine dir it was replacing is set aside

        result = build_engines(model, parent / "next", FAST, show_progress=False)   # the next build, same parent
        assert result.status == "up-to-date" and result.swept, point
        assert temporaries(parent) == [], point
        assert {name: tree(parent / name) for name in users} == users, point
        assert (parent / "notes.txt").read_text() == "mine" and (parent / "notes.txt").stat().st_mtime_ns == notes
        assert not (parent / "b").exists(), point   # a killed first build never shows its name
        if point == "set-aside":   # put back as it was: the kill came before its replacement moved in
            assert "put back" in " ".join(result.swept)
            assert read_manifest(parent / "a") == first_a
        verify_engine_dir(parent / "a", read_manifest(parent / "a"))
    assert read_manifest(parent / "a")["options"]["page_size"] == 8   # the last build got as far as its swap


def test_the_cli_says_what_it_swept(tiny_root, tmp_path, capsys):
    stale = tmp_path / ".tandem-build-other-x1y2"   # a dead build of another --out in the same parent
    stale.mkdir()
    (stale / ".tandem-build.json").write_text(json.dumps({"pid": 2**22 + 7, "host": os.uname().nodename}))
    (stale / "weights.bin").write_bytes(b"\0" * 1024)
    assert main(["build-engines", str(tiny_root / "qwen3_5_mtp1"), "--out", str(tmp_path / "e"), *CLI_FAST]) == 0
    assert f"removed {stale} (the temporary folder of a build that no longer runs)" in capsys.readouterr().out
    assert not stale.exists()


def test_missing_parents_of_out_are_created_and_removed_again_when_the_build_fails(tiny_root, tmp_path,
                                                                                  monkeypatch):
    out = tmp_path / "a" / "b" / "c"
    assert build_engines(tiny_root / "qwen3_5_mtp1", out, FAST, show_progress=False).status == "built"
    verify_engine_dir(out, read_manifest(out))

    def export_fails(*args, **kwargs):
        raise RuntimeError("export failed")

    monkeypatch.setattr(builder_module, "export_checkpoint", export_fails)
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError, match="export failed"):
        build_engines(tiny_root / "qwen3_5_mtp1", tmp_path / "kept" / "x" / "y", FAST, show_progress=False)
    assert os.listdir(tmp_path / "kept") == []   # x and y were made by the build and go with it; kept stays


def _fake(folder: Path, manifest: dict) -> dict:
    folder.mkdir()
    (folder / MANIFEST).write_text(json.dumps(manifest))
    (folder / "notes.txt").write_text("my notes")
    return tree(folder)


def test_a_manifest_that_proves_nothing_lets_no_build_replace_its_folder(tiny_root, tmp_path):
    built = tmp_path / "built"
    build_engines(tiny_root / "qwen3_5_mtp1", built, FAST, show_progress=False)
    real = read_manifest(built)
    edited = {**real, "files": {**real["files"], "notes.txt": "0" * 64}}          # digest no longer matches
    legacy_lie = {k: v for k, v in edited.items() if k != DIGEST}                 # no digest: files must match
    for name, manifest in {"bare": {"format": "tandem-engines"}, "edited": edited, "legacy": legacy_lie}.items():
        before = _fake(tmp_path / name, manifest)
        assert not is_engine_dir(tmp_path / name)
        with pytest.raises(OutputError, match="no manifest.json that proves tandem wrote it"):
            build_engines(tiny_root / "qwen3_5_mtp1", tmp_path / name, FAST, show_progress=False)
        assert tree(tmp_path / name) == before, name


def test_an_older_build_without_a_manifest_digest_is_still_replaced(tiny_root, tmp_path):
    out = tmp_path / "e"
    build_engines(tiny_root / "qwen3_5_mtp1", out, FAST, show_progress=False)
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest[DIGEST]
    (out / MANIFEST).write_text(json.dumps(manifest))        # as builds wrote it before the digest
    assert is_engine_dir(out)
    wider = BuildOptions(batch_sizes=(1, 2), prefill_chunk=8, max_seq_len=256, no_mtp=True)
    assert build_engines(tiny_root / "qwen3_5_mtp1", out, wider, show_progress=False).status == "built"
    assert DIGEST in json.loads((out / MANIFEST).read_text())
