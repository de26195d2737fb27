"""The model shipped in models/tandem-tiny-code: valid for tandem, and its greedy generation
through tandem (speculative on and off) equals transformers' greedy generation of the trunk."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.checkpoint import open_checkpoint
from tandem.engines.builder import build_engines
from tandem.engines.options import BuildOptions
from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.pipeline.sampling_params import SamplingParams

MODEL = Path(__file__).resolve().parents[2] / "models" / "tandem-tiny-code"
PROMPTS = ["def fibonacci(n):\n    ", "import os\n\n\ndef list_files(root):\n    ", "class Stack:\n    def "]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    out = tmp_path_factory.mktemp("shipped") / "engines"
    build_engines(MODEL, out, BuildOptions(batch_sizes=(1, 4), spec_k=3, prefill_chunk=32, max_seq_len=256),
                  show_progress=False)
    return out


def test_shipped_model_is_valid_with_three_mtp_layers():
    desc = open_checkpoint(MODEL).description
    assert desc.mtp.num_layers == 3 and desc.dtype == "bfloat16"
    assert (MODEL / "model.safetensors").stat().st_size <= 30 * 2**20
    assert (MODEL / "README.md").read_text().count("Held-out") == 1


@pytest.mark.parametrize("mode", ["chained", "reused"])
def test_shipped_model_greedy_equals_transformers(engines, mode):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(MODEL)
    llm = LLM(engines, RuntimeConfig(mtp_mode=mode))
    spec = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True, speculative=False))
    for prompt, s, p in zip(PROMPTS, spec, plain):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert ids[0].tolist() == s.prompt_token_ids
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert s.token_ids == ref[0, ids.shape[1]:].tolist()
        assert p.token_ids == s.token_ids
    assert sum(r.metrics.accepted for r in spec) > 0  # a trained model's heads get drafts accepted
