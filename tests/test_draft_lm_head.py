"""The lm_head the MTP heads draft with (`--draft-lm-head`): int8 for float engines whose lm_head is
large, as the engines' weights otherwise. Drafts only propose, so the exactness contract is the
same: speculative greedy == plain greedy; and only the heads' lm_head changes, never the target's."""

from __future__ import annotations

import json

import onnx
import pytest

from tandem.engines.builder import build_engines
from tandem.engines.options import DRAFT_INT8_PARAMS, BuildOptions, OptionsError
from tandem.pipeline.llm import EngineConfig
from tandem.pipeline.sampling_params import SamplingParams

from .pipeline_fixtures import run

KIND = "qwen3_5_mtp3"
PROMPTS = [[5, 17, 33, 200, 7], [9, 120, 77, 301, 15, 2, 88, 91, 14, 250, 3], [44]]


def test_auto_drafts_with_int8_only_for_large_float_lm_heads():
    big, small = DRAFT_INT8_PARAMS, DRAFT_INT8_PARAMS - 1
    assert BuildOptions().draft_quant(big).format == "int8"
    assert BuildOptions().draft_quant(small) is None                       # as the float engines
    assert BuildOptions(draft_lm_head="same").draft_quant(big) is None
    assert BuildOptions(draft_lm_head="int8").draft_quant(small).format == "int8"
    assert BuildOptions(weights="int4").draft_quant(big).format == "int4"   # auto: as --weights
    assert BuildOptions(weights="int4", draft_lm_head="int8").draft_quant(small).format == "int8"
    with pytest.raises(OptionsError, match="--draft-lm-head 'int4'"):
        BuildOptions(draft_lm_head="int4")


@pytest.fixture(scope="module")
def int8_drafts(tiny_root, tmp_path_factory):
    path = tmp_path_factory.mktemp("draft_lm_head") / KIND
    options = BuildOptions(batch_sizes=(1, 8), spec_k=3, prefill_chunk=8, max_seq_len=256, draft_lm_head="int8")
    assert build_engines(tiny_root / KIND, path, options, show_progress=False).status == "built"
    return path


def test_only_the_heads_lm_head_is_int8(int8_drafts):
    manifest = json.loads((int8_drafts / "manifest.json").read_text())
    assert manifest["options"]["draft_lm_head"] == "int8" and manifest["options"]["weights"] == "float"
    for name in ("round_greedy_k3.w4", "mtp_head_0", "target_step"):
        graph = onnx.load(str(int8_drafts / f"{name}.opt.onnx"), load_external_data=False).graph
        heads = {n.name: n.op_type for n in graph.node if "lm_head" in n.name}
        drafting = {n: op for n, op in heads.items() if "/mtp" in n or "draft" in n or "reanchor" in n
                    or name.startswith("mtp_head")}
        target = {n: op for n, op in heads.items() if n not in drafting}
        assert all(op == "MatMulNBits" for op in drafting.values()) and (drafting or name == "target_step")
        assert all(op != "MatMulNBits" for op in target.values()) and (target or name.startswith("mtp_head"))


def test_speculative_equals_plain_with_int8_drafts(int8_drafts):
    """Batches 1 to 8, arriving one per step (staggered), drafting forced on."""
    prompts = [PROMPTS[i % len(PROMPTS)][: 3 + i] + [i] for i in range(8)]
    drafting = EngineConfig(adaptive_width=False)   # random heads: the adaptive width would turn drafting off
    plain, _ = run(int8_drafts, prompts, SamplingParams(max_tokens=16, ignore_eos=True, speculative=False),
                   stagger=1)
    spec, llm = run(int8_drafts, prompts, SamplingParams(max_tokens=16, ignore_eos=True), drafting, stagger=1)
    assert spec == plain
    assert all(s.metrics.rounds > 0 for s in llm.test_sequences)
