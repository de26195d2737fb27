"""The linear layers the MTP heads draft with (`--draft-weights`: each head's own and the lm_head they
project with): int8 for float engines whose draft passes read many weights, as the engines' weights
otherwise. Drafts only propose, so the exactness contract is the same: speculative greedy == plain
greedy; and only the heads' weights change, never the target's (its verify step decides)."""

from __future__ import annotations

import json

import onnx
import pytest

from tandem.engines.builder import build_engines
from tandem.engines.options import DRAFT_INT8_PARAMS, BuildOptions, OptionsError
from tandem.pipeline.llm import RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams

from ..pipeline_fixtures import run

KIND = "qwen3_5_mtp3"
PROMPTS = [[5, 17, 33, 200, 7], [9, 120, 77, 301, 15, 2, 88, 91, 14, 250, 3], [44]]


def test_auto_drafts_with_int8_only_for_large_float_heads():
    big, small = DRAFT_INT8_PARAMS, DRAFT_INT8_PARAMS - 1
    assert BuildOptions().draft_quant(big).format == "int8"
    assert BuildOptions().draft_quant(small) is None                       # as the float engines
    assert BuildOptions(draft_weights="same").draft_quant(big) is None
    assert BuildOptions(draft_weights="int8").draft_quant(small).format == "int8"
    assert BuildOptions(weights="int4").draft_quant(big).format == "int4"   # auto: as --weights
    assert BuildOptions(weights="int4", draft_weights="int8").draft_quant(small).format == "int8"
    with pytest.raises(OptionsError, match="--draft-weights 'int4'"):
        BuildOptions(draft_weights="int4")


@pytest.fixture(scope="module")
def int8_drafts(tiny_root, tmp_path_factory):
    path = tmp_path_factory.mktemp("draft_weights") / KIND
    options = BuildOptions(batch_sizes=(1, 8), spec_k=3, prefill_chunk=8, max_seq_len=256, draft_weights="int8")
    assert build_engines(tiny_root / KIND, path, options, show_progress=False).status == "built"
    return path


def test_every_draft_matmul_is_int8_and_no_target_one(int8_drafts):
    """Each head's layers (attention, MLP, input projection) and its lm_head run int8 kernels; the
    verify and target steps keep float weights."""
    manifest = json.loads((int8_drafts / "manifest.json").read_text())
    assert manifest["options"]["draft_weights"] == "int8" and manifest["options"]["weights"] == "float"
    for name in ("round_greedy_k3.w4", "mtp_head_0", "target_step"):
        graph = onnx.load(str(int8_drafts / f"{name}.opt.onnx"), load_external_data=False).graph
        matmuls = {n.name: n.op_type for n in graph.node if n.op_type.startswith("MatMul")}
        drafting = {n: op for n, op in matmuls.items() if "/mtp" in n or "draft" in n or "reanchor" in n
                    or name.startswith("mtp_head")}
        target = {n: op for n, op in matmuls.items() if n not in drafting}
        assert all(op == "MatMulNBits" for op in drafting.values()), (name, drafting)
        assert all(op != "MatMulNBits" for op in target.values()), (name, target)
        assert (len(drafting) > 2) != (name == "target_step") and (target or name.startswith("mtp_head"))


def test_speculative_equals_plain_with_int8_drafts(int8_drafts):
    """Batches 1 to 8, arriving one per step (staggered), drafting forced on."""
    prompts = [PROMPTS[i % len(PROMPTS)][: 3 + i] + [i] for i in range(8)]
    drafting = RuntimeConfig(adaptive_width=False)   # random heads: the adaptive width would turn drafting off
    plain, _ = run(int8_drafts, prompts, SamplingParams(max_tokens=16, ignore_eos=True, speculative=False),
                   stagger=1)
    spec, llm = run(int8_drafts, prompts, SamplingParams(max_tokens=16, ignore_eos=True), drafting, stagger=1)
    assert spec == plain
    assert all(s.metrics.rounds > 0 for s in llm.test_sequences)
