"""Hostile and corrupt safetensors headers are refused at config time, each naming the file and
the tensor and saying to re-download or re-save, before any tensor data is read."""

from __future__ import annotations

import json
import struct

import pytest

from tandem.checkpoint.safetensors_files import read_header
from tandem.cli import main

from ..checkpoint_fixtures import refusal

pytestmark = pytest.mark.usefixtures("no_weight_reads")

A = "model.language_model.layers.0.input_layernorm.weight"  # F32 [64] in the tiny checkpoints
B = "model.language_model.layers.0.post_attention_layernorm.weight"


def rewrite_header(path, edit) -> None:
    """Apply edit(header dict) and write the file back with the same data section."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def assert_named(msg: str, path, *tensors: str) -> None:
    assert str(path / "model.safetensors") in msg and "Re-download or re-save the file" in msg
    for t in tensors:
        assert t in msg


def test_overlapping_offsets_are_refused_naming_both_tensors(tiny_copy):
    """Today such a checkpoint builds engines that pass verification with B's weights read from A."""
    path = tiny_copy("qwen3_5_mtp1")

    def alias(h):
        h[B]["data_offsets"] = list(h[A]["data_offsets"])

    rewrite_header(path / "model.safetensors", alias)
    msg = refusal(path)
    assert_named(msg, path, A, B)
    assert "share bytes" in msg


def test_a_partial_overlap_is_refused(tiny_copy):
    path = tiny_copy("qwen3_5_mtp1")

    def shift(h):
        begin, end = h[A]["data_offsets"]
        h[B]["data_offsets"] = [begin + 8, end + 8]  # 8 bytes into A, past A's end into whatever follows

    rewrite_header(path / "model.safetensors", shift)
    assert "share bytes" in refusal(path)


def test_offsets_shorter_than_the_shape(tiny_copy):
    path = tiny_copy("qwen3_5_mtp1")

    def shorten(h):
        h[A]["data_offsets"][1] -= 4

    rewrite_header(path / "model.safetensors", shorten)
    msg = refusal(path)
    assert_named(msg, path, A)
    assert "F32 [64], which takes 256 bytes, but its data_offsets" in msg and "span 252 bytes" in msg


def test_a_dtype_that_disagrees_with_the_bytes(tiny_copy):
    path = tiny_copy("qwen3_5_mtp1")

    def narrow(h):
        h[A]["dtype"] = "F16"  # the bytes are F32: 256 bytes where F16 [64] takes 128

    rewrite_header(path / "model.safetensors", narrow)
    msg = refusal(path)
    assert_named(msg, path, A)
    assert "F16 [64], which takes 128 bytes" in msg


def test_offsets_past_the_end_of_the_file(tiny_copy):
    path = tiny_copy("qwen3_5_mtp1")

    def far(h):
        h[A]["data_offsets"] = [10**12, 10**12 + 256]

    rewrite_header(path / "model.safetensors", far)
    msg = refusal(path)
    assert_named(msg, path, A)
    assert "(truncated download?)" in msg


@pytest.mark.parametrize("shape", [[-64], [64.0], ["64"], [True] * 64, "64"])
def test_a_negative_or_non_integer_shape(tiny_copy, shape):
    path = tiny_copy("qwen3_5_mtp1")

    def bad(h):
        h[A]["shape"] = shape

    rewrite_header(path / "model.safetensors", bad)
    msg = refusal(path)
    assert_named(msg, path, A)
    assert "must be a list of non-negative integers" in msg


@pytest.mark.parametrize("offsets", [[256, 0], [-4, 252], [0, 256, 512], [0.0, 256.0], None])
def test_malformed_data_offsets(tiny_copy, offsets):
    path = tiny_copy("qwen3_5_mtp1")

    def bad(h):
        h[A]["data_offsets"] = offsets

    rewrite_header(path / "model.safetensors", bad)
    msg = refusal(path)
    assert_named(msg, path, A)
    assert "two non-negative integers [begin, end]" in msg


def test_an_unknown_dtype_tag_is_named(tiny_copy):
    path = tiny_copy("qwen3_5_mtp1")

    def odd(h):
        h[A]["dtype"] = "F12"

    rewrite_header(path / "model.safetensors", odd)
    msg = refusal(path)
    assert_named(msg, path, A)
    assert "dtype 'F12' is not a safetensors dtype tag" in msg


def test_a_tensor_stored_in_two_shards(tiny_copy):
    path = tiny_copy("qwen3_next")
    first = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    in_first = next(n for n, f in first.items() if f == "model-00001-of-00002.safetensors")

    def rename(h):
        name = next(n for n in h if n != "__metadata__")
        h[in_first] = h.pop(name)

    rewrite_header(path / "model-00002-of-00002.safetensors", rename)
    msg = refusal(path)
    assert in_first in msg and "stored in both model-00001-of-00002.safetensors and model-00002-of-00002" in msg


def test_a_duplicate_key_in_one_header(tiny_copy):
    path = tiny_copy("qwen3_5_mtp1")
    raw = (path / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8 : 8 + n].decode().rstrip()
    entry = json.dumps({"dtype": "F32", "shape": [64], "data_offsets": [0, 256]})
    text = text[:-1] + f', "{A}": {entry}}}'
    text = text.encode() + b" " * (-len(text) % 8)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    assert f"the header names {A!r} twice" in refusal(path)


def test_inspect_reports_a_hostile_header(tiny_copy, capsys):
    path = tiny_copy("qwen3_5_mtp1")
    rewrite_header(path / "model.safetensors", lambda h: h[B].update(data_offsets=list(h[A]["data_offsets"])))
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert "REFUSED" in err and "share bytes" in err and B in err


def test_an_empty_tensor_overlaps_nothing(tiny_copy):
    """A zero-element tensor holds no bytes: [x, x] inside another tensor's range is valid."""
    path = tiny_copy("qwen3_5_mtp1")

    def add_empty(h):
        begin = h[A]["data_offsets"][0] + 4
        h["empty"] = {"dtype": "F32", "shape": [0, 64], "data_offsets": [begin, begin]}

    rewrite_header(path / "model.safetensors", add_empty)
    entries = read_header(path / "model.safetensors")
    assert entries["empty"].numel == 0 and entries[A].numel == 64
