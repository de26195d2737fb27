"""`tandem build-engines` end to end on tiny checkpoints: manifest, verification, no-op reruns,
rebuilds on change, and nothing valid-looking left behind by a failure."""

from __future__ import annotations

import errno
import json
import os
import time
from dataclasses import replace

import pytest

from tandem.checkpoint import CheckpointError
from tandem.checkpoint.description import description_from_dict
from tandem.cli import main
from tandem.engines import builder as builder_module
from tandem.engines.atomic import OutputError
from tandem.engines.backends import onnxruntime_build
from tandem.engines.builder import BuildError, build_engines
from tandem.engines.manifest import read_manifest
from tandem.engines.options import BuildOptions

pytestmark = pytest.mark.slow

SMALL = BuildOptions(batch_sizes=(1, 2), prefill_chunk=8, max_seq_len=256, unified_round=False)  # fast builds


def leftovers(parent):
    return [p.name for p in parent.iterdir() if p.name.startswith(".tandem-build-")]


@pytest.mark.parametrize("kind", ["qwen3_5_mtp3", "qwen3_next"])
def test_build_lists_every_engine_with_its_verification(tiny_root, tmp_path, kind):
    out = tmp_path / "engines"
    result = build_engines(tiny_root / kind, out, replace(SMALL, unified_round=True), show_progress=False)
    assert result.status == "built" and not leftovers(tmp_path)
    m = read_manifest(out)
    heads = 3 if kind == "qwen3_5_mtp3" else 1
    # per batch size: decode, prefill, verify and unified round greedy+sample at widths 2..4, and the heads
    assert len(m["engines"]) == 2 * (2 + 2 * 3 + 2 * 3 + heads)
    assert {e["role"] for e in m["engines"]} == {"decode", "prefill", "verify", "round", "head"}
    for e in m["engines"]:
        v = e["verification"]
        assert v["passed"] and v["tolerance"] == 1e-4 and max(v["max_abs_diff"].values()) <= 1e-4
        assert (out / e["file"]).exists() and e["file"] in m["files"]
    assert m["backend"] == "onnxruntime" and "onnxruntime" in m["versions"]
    assert m["runtime"]["verify_width_per_batch"] == {"1": 4, "2": 4}
    assert description_from_dict(m["description"]).family == m["model"]["family"]
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json", "weights.bin"):
        assert (out / f).exists()


def test_second_run_is_a_noop_and_a_changed_weight_rebuilds(tiny_copy, tmp_path):
    src = tiny_copy("qwen3_5_mtp1")
    out = tmp_path / "engines"
    build_engines(src, out, SMALL, show_progress=False)
    stamp = (out / "manifest.json").stat().st_mtime_ns
    again = build_engines(src, out, SMALL, show_progress=False)
    assert again.status == "up-to-date" and (out / "manifest.json").stat().st_mtime_ns == stamp
    time.sleep(0.01)
    os.utime(src / "model.safetensors")  # touched, same content: the fingerprint is by content
    assert build_engines(src, out, SMALL, show_progress=False).status == "up-to-date"
    data = bytearray((src / "model.safetensors").read_bytes())
    data[-4:] = bytes(b ^ 0x5A for b in data[-4:])  # the last weight's bytes, same size
    (src / "model.safetensors").write_bytes(bytes(data))
    rebuilt = build_engines(src, out, SMALL, show_progress=False)
    assert rebuilt.status == "built" and not rebuilt.reused and rebuilt.rebuilt


def test_a_new_option_rebuilds_only_what_changed(tiny_root, tmp_path):
    out = tmp_path / "engines"
    first = build_engines(tiny_root / "qwen3_5_mtp1", out, SMALL, show_progress=False)
    wider = replace(SMALL, batch_sizes=(1, 2, 4))
    second = build_engines(tiny_root / "qwen3_5_mtp1", out, wider, show_progress=False)
    assert sorted(second.reused) == sorted(first.rebuilt)
    assert second.rebuilt and all(".b4." in n for n in second.rebuilt)
    assert len(second.rebuilt) + len(second.reused) == len(read_manifest(out)["engines"])


def test_failure_mid_build_leaves_no_valid_looking_directory(tiny_root, tmp_path, monkeypatch):
    out = tmp_path / "engines"
    calls = []

    def explode(self, path, feeds, optimized=False):  # every verification run, reference or engine
        calls.append(path)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return real(self, path, feeds, optimized)

    real = onnxruntime_build.ReferenceRunner.run
    monkeypatch.setattr(onnxruntime_build.ReferenceRunner, "run", explode)
    with pytest.raises(RuntimeError, match="injected"):
        build_engines(tiny_root / "qwen3_5_mtp1", out, SMALL, show_progress=False)
    assert not out.exists() and not leftovers(tmp_path)
    # with an engine directory already there, a failed rebuild leaves it as it was
    monkeypatch.setattr(onnxruntime_build.ReferenceRunner, "run", real)
    build_engines(tiny_root / "qwen3_5_mtp1", out, SMALL, show_progress=False)
    before = (out / "manifest.json").read_text()
    calls.clear()
    monkeypatch.setattr(onnxruntime_build.ReferenceRunner, "run", explode)
    with pytest.raises(RuntimeError):
        build_engines(tiny_root / "qwen3_5_mtp1", out, BuildOptions(batch_sizes=(4,), prefill_chunk=8,
                                                                      max_seq_len=256), show_progress=False)
    assert (out / "manifest.json").read_text() == before and not leftovers(tmp_path)


def test_a_failed_verification_writes_nothing(tiny_root, tmp_path, monkeypatch):
    from tandem.engines.verification import Verification

    monkeypatch.setattr(builder_module, "compare",
                        lambda ref, got, dtype, s, sampled=None: Verification(False, 1e-4, {"x": 1.0}, s))
    with pytest.raises(BuildError, match="disagree with the un-lowered graphs"):
        build_engines(tiny_root / "qwen3_5_mtp1", tmp_path / "e", SMALL, show_progress=False)
    assert not (tmp_path / "e").exists() and not leftovers(tmp_path)


def test_disk_full_during_build_is_a_clear_error(tiny_root, tmp_path, monkeypatch):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(builder_module, "export_checkpoint", full)
    with pytest.raises(OutputError, match="no space left"):
        build_engines(tiny_root / "qwen3_5_mtp1", tmp_path / "e", SMALL, show_progress=False)
    assert not leftovers(tmp_path)


def test_too_little_free_space_is_refused_up_front(tiny_root, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10, 10, 1000))
    with pytest.raises(OutputError, match="MiB free but the build needs about"):
        build_engines(tiny_root / "qwen3_5_mtp1", tmp_path / "e", SMALL, show_progress=False)


def test_output_location_that_is_a_file(tiny_root, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="file is not a directory"):
        build_engines(tiny_root / "qwen3_5_mtp1", tmp_path / "file" / "e", SMALL, show_progress=False)
    with pytest.raises(OutputError, match="file is not a directory"):
        build_engines(tiny_root / "qwen3_5_mtp1", tmp_path / "file" / "deeper" / "e", SMALL, show_progress=False)
    with pytest.raises(OutputError, match="is not a directory"):
        build_engines(tiny_root / "qwen3_5_mtp1", tmp_path / "file", SMALL, show_progress=False)


def test_bad_checkpoint_is_refused_before_anything_is_written(tiny_copy, tmp_path):
    src = tiny_copy("qwen3_5_mtp1")
    (src / "model.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        build_engines(src, tmp_path / "e", SMALL, show_progress=False)
    assert not (tmp_path / "e").exists() and not leftovers(tmp_path)


def test_no_mtp_builds_plain_decoding_engines(tiny_root, tmp_path):
    out = tmp_path / "e"
    build_engines(tiny_root / "qwen3_5_mtp1", out, BuildOptions(batch_sizes=(1,), prefill_chunk=8, max_seq_len=256,
                                                                no_mtp=True), show_progress=False)
    m = read_manifest(out)
    assert {e["role"] for e in m["engines"]} == {"decode", "prefill"} and m["runtime"]["spec_k"] is None


def test_cli_build_engines(tiny_root, tmp_path, capsys):
    args = ["build-engines", str(tiny_root / "qwen3_5_moe"), "--out", str(tmp_path / "e"), "--batch-sizes", "1",
            "--prefill-chunk", "8", "--max-seq-len", "256", "--quiet"]
    assert main(args) == 0 and "built" in capsys.readouterr().out
    assert main(args) == 0 and "up to date" in capsys.readouterr().out
    assert main(args[:-1] + ["--spec-k", "12"]) == 1
    assert "--spec-k 12 is out of range" in capsys.readouterr().err
    assert main(args + ["--no-mtp", "--draft", str(tmp_path)]) == 1
    assert "contradict" in capsys.readouterr().err
    assert main(args + ["--max-seq-len", "100000"]) == 1
    assert "max_position_embeddings" in capsys.readouterr().err
    assert json.loads((tmp_path / "e" / "manifest.json").read_text())["options"]["batch_sizes"] == [1]


def test_tensorrt_backend_without_tensorrt_is_a_clear_error(tiny_root, tmp_path, capsys):
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here; the missing-library error cannot be shown")
    except ImportError:
        pass
    assert main(["build-engines", str(tiny_root / "qwen3_5_mtp1"), "--out", str(tmp_path / "e"),
                 "--backend", "tensorrt", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "--backend tensorrt needs the TensorRT Python package" in err and "--backend onnxruntime" in err
    assert not (tmp_path / "e").exists()
