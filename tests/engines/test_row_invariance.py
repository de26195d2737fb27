"""Row invariance of the engines ONNX Runtime runs: each row of a many-row call (prefill chunk,
verify) gives bit for bit what a one-row decode step at that position gives after the rows before
it were committed. This is what makes speculative greedy == plain greedy hold at near-ties too,
and with int8 activations (MatMulNBits) a 1e-7 difference upstream can move a logit by 1e-2.

Guards export/attention_lowering.py (keys by position, two query rows at least),
export/layers.py causal_conv (no Conv), export/lowering.py (every quantized MatMul fused)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from tandem import contract as c
from tandem.checkpoint import open_checkpoint
from tandem.engines.backends.onnxruntime_backend import open_served

from ..paged_driver import PagedState, prefilled

PROMPTS = [[5, 17, 33, 200, 7, 64, 91], [9, 120, 77, 301, 15]]
ROWS = 4


@pytest.fixture(scope="module", params=["float", "int8", "int4"])
def engine_dir(request, engine_dirs, quantized_dirs) -> Path:
    return engine_dirs["qwen3_5_mtp3"] if request.param == "float" else quantized_dirs[request.param]


def _opened(engine_dir: Path, name: str):
    return open_served(engine_dir, f"{name}.opt.onnx")   # what the runtime opens


def _prefilled(desc, target) -> tuple[PagedState, np.ndarray]:
    return prefilled(desc, target, PROMPTS)


def test_each_row_of_a_call_equals_the_decode_step_bit_for_bit(engine_dir, tiny_root):
    desc = open_checkpoint(tiny_root / "qwen3_5_mtp3").description
    target = _opened(engine_dir, "target_step")
    one = np.ones(len(PROMPTS), np.int64)
    state, token = _prefilled(desc, target)
    tokens, logits, hidden = [token], [], []
    for _ in range(ROWS):                                    # plain greedy: one row per call, committed
        out = state.run(target, {c.INPUT_IDS: tokens[-1][:, None], c.STATE_ROWS: one})
        state.commit(out, one)
        logits.append(out[c.LOGITS][:, 0])
        hidden.append(out[c.HIDDEN][:, 0])
        tokens.append(out[c.LOGITS][:, 0].argmax(-1))
    ids = np.stack(tokens[:ROWS], 1)                         # [pending, g_1 .. g_{ROWS-1}]

    state, _ = _prefilled(desc, target)                      # the same rows in one prefill-chunk call
    out = state.run(target, {c.INPUT_IDS: ids, c.STATE_ROWS: one * ROWS})
    for r in range(ROWS):
        assert np.array_equal(out[c.LOGITS][:, r], logits[r]), f"chunk row {r}"

    verify = _opened(engine_dir, f"verify_greedy.w{ROWS}")   # and in one verify call
    state, _ = _prefilled(desc, target)
    out = state.run(verify, {c.INPUT_IDS: ids})
    assert (out[c.ACCEPTED] == ROWS - 1).all()
    for r in range(ROWS):
        assert np.array_equal(out[c.HIDDEN][:, r], hidden[r]), f"verify row {r}"


def test_every_quantized_matmul_runs_as_matmulnbits(quantized_dirs):
    """A DequantizeLinear left in a saved graph computes that MatMul in float32 (other numerics
    than MatMulNBits in the decode step); the unified round reads the lm_head in several passes."""
    for fmt, folder in quantized_dirs.items():
        for path in sorted(folder.glob("*.opt.onnx")):
            graph = onnx.load(str(path), load_external_data=False).graph
            left = [n.name for n in graph.node if n.op_type == "DequantizeLinear"]
            assert not left, f"{fmt} {path.name}: {left[:4]}"
            assert any(n.op_type == "MatMulNBits" for n in graph.node), path.name
