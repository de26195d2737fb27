"""Weight-only int8 / int4 engines (`--weights`): the quantization math, the exported pattern, the
build's verification, and the exactness contract inside quantized engines."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest

from tandem.checkpoint import open_checkpoint
from tandem.engines.options import BuildOptions, OptionsError
from tandem.export.exporter import ExportOptions, export_checkpoint
from tandem.export.nbits_tiles import fits_half, tile_weights
from tandem.export.quantize import WeightQuant, half_scales
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams

from ..pipeline_fixtures import run

PROMPTS = [[5, 17, 33, 200, 7], [9, 120, 77, 301, 15, 2, 88, 91, 14, 250, 3], [44]]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_block_quantization_error_is_at_most_half_a_step(fmt):
    rng = np.random.default_rng(0)
    wt = (rng.standard_normal((128, 48)) * rng.uniform(0.01, 3, (1, 48))).astype(np.float32)
    wt[32:64, 5] = 0.0                                      # an all-zero block keeps a usable scale
    quant = WeightQuant(fmt, block=32)
    q, scale, zero = quant.quantize(wt, np.float32)
    assert q.dtype == (np.int8 if fmt == "int8" else ml_dtypes.uint4) and scale.shape == (4, 48)
    if fmt == "int8":
        assert zero is None and np.abs(q.astype(np.int32)).max() <= 127
    else:   # asymmetric: 16 levels over [min(w, 0), max(w, 0)], zero exactly representable
        assert zero.shape == (4, 48) and q.astype(np.int32).max() <= 15
    assert fits_half(scale)          # the CPU kernel's tiles keep them as float16 (export/nbits_tiles.py)
    step = np.repeat(scale, 32, axis=0)
    deq = quant.dequantize(q, scale, zero)
    assert np.all(np.abs(deq - wt) <= step / 2 + 1e-6 * np.abs(wt).max())
    assert np.all(deq[32:64, 5] == 0.0)


def test_scales_round_up_to_float16_values():
    """Up, so a block's largest |w| still fits its levels; by at most 2^-10 in float16's normal
    range; subnormal and out-of-range scales clamp into what float16 holds."""
    rng = np.random.default_rng(1)
    s = np.concatenate([rng.uniform(1e-4, 10, 1000), [1e-3, 2.0**-14, 3e-6, 1e-9, 7e4]]).astype(np.float32)
    h = half_scales(s)
    assert h.dtype == np.float32 and fits_half(h)
    normal = (s >= 2.0**-14) & (s <= 65504)
    assert np.all(h[normal] >= s[normal]) and np.all(h[normal] <= s[normal] * (1 + 2.0**-10))
    assert h[-3] >= 3e-6 and h[-2] == np.finfo(np.float16).smallest_subnormal and h[-1] == 65504
    with pytest.raises(ValueError, match="float16 does not hold"):
        tile_weights(np.zeros((16, 1, 16), np.uint8), np.full(16, 0.1, np.float32), None, 16, 32, 4, 32)


def test_every_linear_layer_is_exported_as_blocked_dequantize_matmul(tiny_root, tmp_path):
    ckpt = open_checkpoint(tiny_root / "qwen3_5_mtp3")
    plain = export_checkpoint(ckpt, tmp_path / "f")
    int4 = export_checkpoint(ckpt, tmp_path / "q", ExportOptions(quant=WeightQuant("int4", 32)))
    f_graph = onnx.load(str(tmp_path / "f" / "target_step.onnx"), load_external_data=False)
    q_graph = onnx.load(str(tmp_path / "q" / "target_step.onnx"), load_external_data=False)
    float_weights = {n.input[1] for n in f_graph.graph.node if n.op_type == "MatMul" and n.input[1].endswith(".T")}
    dq = {n.output[0]: n for n in q_graph.graph.node if n.op_type == "DequantizeLinear"}
    quantized = [n for n in q_graph.graph.node if n.op_type == "MatMul" and n.input[1] in dq]
    assert len(quantized) == len(float_weights) > 10      # every nn.Linear, lm_head included
    assert all({a.name: a.i for a in dq[n.input[1]].attribute}["block_size"] == 32 for n in quantized)
    assert int4.weights_bytes < plain.weights_bytes * 0.6  # embeddings stay float32


def test_options_refuse_unknown_formats_and_blocks():
    with pytest.raises(OptionsError, match="--weights 'int3'"):
        BuildOptions(weights="int3")
    with pytest.raises(OptionsError, match="--quant-block 24"):
        BuildOptions(weights="int8", quant_block=24)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_speculative_equals_plain_inside_quantized_engines(quantized_dirs, fmt):
    """Batches 1 to 8: one prompt alone, then eight arriving one per step (staggered)."""
    alone = SamplingParams(max_tokens=16, ignore_eos=True, speculative=False)
    drafting = RuntimeConfig(adaptive_width=False)   # random heads: the adaptive width would turn drafting off
    llm = LLM(quantized_dirs[fmt], drafting)
    plain = llm.generate(PROMPTS[:1], alone)
    assert [o.token_ids for o in llm.generate(PROMPTS[:1], SamplingParams(max_tokens=16, ignore_eos=True))] == \
        [o.token_ids for o in plain]
    prompts = [PROMPTS[i % len(PROMPTS)][: 3 + i] + [i] for i in range(8)]
    plain, _ = run(quantized_dirs[fmt], prompts, alone, stagger=1)
    spec, llm = run(quantized_dirs[fmt], prompts, SamplingParams(max_tokens=16, ignore_eos=True), drafting, stagger=1)
    assert spec == plain
    assert all(s.metrics.rounds > 0 for s in llm.test_sequences)     # every sequence was verified


def test_int8_logits_stay_close_to_float(quantized_dirs, engine_dirs, monkeypatch):
    """int8 weights move the first token's logits by under 15% of their range on the tiny random
    model (hidden 64, no trained redundancy: measured 8%, half of it from the weights, half from
    MatMulNBits' int8 activations); the figures on a trained model are in docs/performance.md."""
    from tandem.pipeline import host_tokens

    def first_logits(path):
        rows = []
        real = host_tokens.next_token
        monkeypatch.setattr(host_tokens, "next_token",
                            lambda sampler, seq, row: rows.append(row.copy()) or real(sampler, seq, row))
        LLM(path).generate([PROMPTS[1]], SamplingParams(max_tokens=1, speculative=False))
        monkeypatch.setattr(host_tokens, "next_token", real)
        return rows[0]

    ref = first_logits(engine_dirs["qwen3_5_mtp3"])
    got = first_logits(quantized_dirs["int8"])
    assert np.abs(got - ref).max() < 0.15 * np.abs(ref).max()   # measured 8%
    assert not np.array_equal(got, ref)
