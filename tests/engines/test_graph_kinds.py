"""Graph kinds as a type: names stay the strings engine dirs already hold, parse is their exact
inverse, anything else is refused, and a manifest naming an unknown kind is refused at load."""

from __future__ import annotations

import json
import shutil

import pytest

from tandem.engines.buckets import plan
from tandem.engines.manifest import ManifestError, signed
from tandem.engines.options import BuildOptions
from tandem.graph_kinds import (
    TARGET_STEP,
    VERIFY_GREEDY,
    VERIFY_SAMPLE,
    GraphKind,
    Role,
    exported_kinds,
    round_kinds,
)
from tandem.pipeline.llm import LLM


def test_names_are_the_file_and_manifest_strings_and_parse_inverts_them():
    kinds = exported_kinds(3)
    assert [k.name for k in kinds] == ["target_step", "verify_greedy", "verify_sample",
                                       "mtp_head_0", "mtp_head_1", "mtp_head_2"]
    assert [GraphKind.parse(k.name) for k in kinds] == kinds
    assert GraphKind.parse("mtp_head_12") == GraphKind.mtp_head(12)
    rounds = round_kinds(reused=True, widths=(2, 4))
    assert [k.name for k in rounds] == ["round_greedy_reused_k1", "round_sample_reused_k1",
                                        "round_greedy_reused_k3", "round_sample_reused_k3"]
    assert [GraphKind.parse(k.name) for k in rounds] == rounds
    assert rounds[3].engine_key(4) == "round_sample_reused_k3.w4"
    decode = GraphKind.decode(4)
    assert decode.name == "decode_greedy_n4" and GraphKind.parse("decode_greedy_n12") == GraphKind.decode(12)
    assert decode.is_decode and not decode.per_width and decode.engine_key(1) == "decode_greedy_n4"


def test_properties_say_what_callers_ask():
    assert TARGET_STEP.is_target_step and not TARGET_STEP.is_verify and not TARGET_STEP.is_head
    assert VERIFY_GREEDY.is_verify and not VERIFY_GREEDY.sampling and VERIFY_SAMPLE.sampling
    head = GraphKind.parse("mtp_head_2")
    assert head.is_head and head.head == 2 and head.role == Role.MTP_HEAD
    # only verify engines are lowered per width, so only their key carries it
    assert VERIFY_SAMPLE.engine_key(3) == "verify_sample.w3"
    assert TARGET_STEP.engine_key(32) == "target_step" and head.engine_key(4) == "mtp_head_2"


@pytest.mark.parametrize("name", ["verify", "mtp_head_", "mtp_head_01", "mtp_head_-1", "mtp_head_x",
                                  "decode_greedy_n1", "decode_greedy_n04", "decode_sample_n4",
                                  "target_step.w1", "verify_greedy.w3", "Target_Step", "", 3, None])
def test_other_strings_are_refused_naming_the_kinds(name):
    with pytest.raises(ValueError, match="is not a graph kind: expected target_step, verify_greedy"):
        GraphKind.parse(name)


@pytest.mark.parametrize("role, sampling, head", [(Role.MTP_HEAD, False, None), (Role.VERIFY, False, 0),
                                                  (Role.TARGET_STEP, True, None), (Role.MTP_HEAD, False, -1)])
def test_inconsistent_kinds_cannot_be_made(role, sampling, head):
    with pytest.raises(ValueError):
        GraphKind(role, sampling, head)


def test_plan_buckets_carry_kinds(tiny_root):
    from tandem.checkpoint import open_checkpoint

    desc = open_checkpoint(tiny_root / "qwen3_5_mtp3").description
    buckets = plan(desc, BuildOptions(batch_sizes=(1,), spec_k=2))
    assert {b.graph for b in buckets} == set(exported_kinds(3, tuple(round_kinds(reused=False, widths=(2, 3)))))
    assert all(b.name.startswith(b.graph.name + ".b") for b in buckets)


def test_manifest_naming_an_unknown_graph_kind_is_refused(engine_dirs, tmp_path):
    path = tmp_path / "engines"
    shutil.copytree(engine_dirs["qwen3_5_mtp3"], path)
    m = json.loads((path / "manifest.json").read_text())
    m["engines"][-1]["graph"] = "mtp_head"
    (path / "manifest.json").write_text(json.dumps(signed(m)))
    last = len(m["engines"]) - 1
    with pytest.raises(ManifestError, match=rf"{path / 'manifest.json'} is damaged.*engines\[{last}\] \(a graph kind"):
        LLM(path)
