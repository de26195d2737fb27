"""float16 engines on ONNX Runtime CPU: the build verifies and records them, graphs keep the
contract's float16/float32 split, the pipeline keeps K/V and conv pools in float16 (recurrent
states float32), speculative greedy equals plain greedy on the same engines, and float16 logits
stay close to float32 ones. bfloat16 is refused before anything is built."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from tandem import contract as c
from tandem.cli import main
from tandem.engines.builder import build_engines
from tandem.engines.manifest import read_manifest
from tandem.engines.options import BuildOptions, OptionsError
from tandem.export.builder import ONNX_DTYPES
from tandem.export.ops import paged_sparse_attention
from tandem.graph_kinds import GraphKind
from tandem.pipeline.llm import LLM
from tandem.pipeline.model_runner import Rows
from tandem.pipeline.pools import plan_pools
from tandem.pipeline.sampling_params import SamplingParams
from tandem.testing import op_references as ref

from ..export.test_ops import attention_case
from ..op_harness import run as run_op
from ..op_harness import single_op_model
from ..pipeline.test_pipeline_contract import PROMPTS, run
from ..pipeline_fixtures import OPTIONS, install_drafter

pytestmark = pytest.mark.slow

KINDS = ("qwen3_5_mtp3", "qwen3_next")  # dense + 3 heads; MoE + interleaved GDN projections
FP16 = BuildOptions(batch_sizes=(1, 4), spec_k=3, prefill_chunk=OPTIONS.prefill_chunk, max_seq_len=256,
                    page_size=OPTIONS.page_size, dtype="float16")
# logits: max |fp16 - fp32| <= 3e-3 x max(1, max |fp32|), 3 fp16 eps (9.8e-4): rounding weights and
# activations through 6 layers measured 2.3e-4 on the shipped model; RoPE angles in fp16 cost 9e-3
LOGITS_RTOL = 3e-3
SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tandem-tiny-code"
CODE = ("import os\n\n\ndef list_files(root):\n    for name in os.listdir(root):\n"
        "        path = os.path.join(root, name)\n        if os.path.isdir(path):\n")


@pytest.fixture(scope="module")
def fp16_dirs(tiny_root, tmp_path_factory):
    out = {}
    for kind in KINDS:
        out[kind] = tmp_path_factory.mktemp("fp16") / kind
        build_engines(tiny_root / kind, out[kind], FP16, show_progress=False)
    return out


@pytest.fixture(scope="module")
def plain16(fp16_dirs):
    off = SamplingParams(max_tokens=24, ignore_eos=True, speculative=False)
    return {kind: run(path, PROMPTS, off)[0] for kind, path in fp16_dirs.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_build_records_float16_and_every_engine_passes_its_check(fp16_dirs, kind):
    m = read_manifest(fp16_dirs[kind])
    assert m["options"]["dtype"] == "float16"
    for e in m["engines"]:
        v = e["verification"]
        assert v["passed"] and v["tolerance"] == 1e-2 and v["integer_mismatches_allowed"] == 1, e["name"]
        for name, diff in v["max_abs_diff"].items():  # integer outputs have no scale: diff counts entries
            bound = v["tolerance"] * v["scale"][name] if name in v["scale"] else v["integer_mismatches_allowed"]
            assert diff <= bound, (e["name"], name)


def _contract_dtypes(desc, file: str) -> dict[str, int]:
    ins, outs = c.graph_io(desc, GraphKind.parse(file.split(".")[0]), "float16")
    return {s.name: ONNX_DTYPES[s.dtype] for s in ins + outs}


def test_graphs_match_the_float16_contract(fp16_dirs):
    """Engines load with the contract's dtypes: K/V, conv windows and hidden rows in float16;
    recurrent states, logits and acceptance inputs in float32. Weights are stored as float16
    except the GDN gate parameters (A_log, dt_bias) and the gated norm's scale, which act on the
    float32 recurrence."""
    path = fp16_dirs["qwen3_5_mtp3"]
    llm = LLM(path)
    f16, f32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    spec = _contract_dtypes(llm.desc, "target_step.onnx")
    assert (spec[c.key_pool(1)], spec[c.conv_pool(0)], spec[c.HIDDEN]) == (f16, f16, f16)
    assert (spec[c.recurrent_pool(0)], spec[c.LOGITS]) == (f32, f32)
    for file in {e["file"] for e in read_manifest(path)["engines"]}:
        model = onnx.load(str(path / file), load_external_data=False)
        got = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
        assert got == {n: t for n, t in _contract_dtypes(llm.desc, file).items() if n in got}, file
        weights = {t.name: t.data_type for t in model.graph.initializer if not t.name.startswith("/const/")}
        fp32 = {n for n, t in weights.items() if t == f32}
        assert all(n.endswith(("A_log.neg_exp", "dt_bias", "linear_attn.norm.weight")) for n in fp32), file
        assert sum(t == f16 for t in weights.values()) > len(fp32), file


def test_pools_and_buffers_take_the_engine_dtype(fp16_dirs):
    llm = LLM(fp16_dirs["qwen3_5_mtp3"])
    assert llm.dtype == "float16"
    paged = [pools[name] for pools in llm.pools.paged.values() for name in ("key", "value")]
    for pool in (*paged, *(states["conv"] for states in llm.pools.states.values())):
        assert pool.dtype == np.float16
    assert all(states["recurrent"].dtype == np.float32 for states in llm.pools.states.values())
    half = plan_pools(llm.desc, llm.page_size, 512 << 20, 4, llm.mtp_layers, dtype_bytes=2)
    full = plan_pools(llm.desc, llm.page_size, 512 << 20, 4, llm.mtp_layers, dtype_bytes=4)
    assert llm.pages.size == half.num_pages and half.page_bytes * 2 == full.page_bytes
    out = llm.runner.head(0, [Rows(ids=[5, 6], context=0, pages=[1], hidden=np.ones((2, llm.desc.hidden_size)))])
    assert out.arrays[c.HIDDEN_OUT].dtype == np.float16 and out.arrays[c.DRAFT_PROB].dtype == np.float32


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("drafter", ["heads", "oracle", "prefix:1", "random"])
def test_speculative_greedy_equals_plain_greedy_in_float16(fp16_dirs, plain16, monkeypatch, kind, drafter):
    if drafter != "heads":
        install_drafter(monkeypatch, drafter, {f"r{i}": out for i, out in plain16[kind].items()})
    outputs, llm = run(fp16_dirs[kind], PROMPTS, stagger=2)
    assert outputs == plain16[kind]
    if drafter == "oracle":
        metrics = [s.metrics for s in llm.test_sequences]
        assert sum(m.accepted for m in metrics) == sum(m.drafted for m in metrics) > 0


def test_sampling_runs_on_float16_engines(fp16_dirs):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=3, ignore_eos=True)
    a, _ = run(fp16_dirs["qwen3_next"], PROMPTS[:4], params)
    b, _ = run(fp16_dirs["qwen3_next"], PROMPTS[:4], params)
    assert a == b and all(len(v) == 12 for v in a.values())


def _prefill_logits(llm: LLM, prompt: list[int], chunk: int) -> np.ndarray:
    """Logits of every prompt row through target_step in chunks, committing K/V and states."""
    pages, slot, out = list(range(1, 9)), 1, []   # up to 128 positions at the default page size
    for start in range(0, len(prompt), chunk):
        ids = prompt[start : start + chunk]
        outs = llm.runner.target_step([Rows(ids=ids, context=start, pages=pages, slot=slot)])
        llm.pools.write_rows(llm.runner.trunk_kv, outs.arrays, np.arange(1), np.array([len(ids)]),
                             np.array([start]), [pages])
        llm.pools.commit_states(outs.arrays, np.arange(1), np.array([slot]))
        out.append(outs.arrays[c.LOGITS][0, : len(ids)].copy())
    return np.concatenate(out)


def test_float16_logits_are_close_to_float32(tmp_path):
    """The trained shipped model (random tiny weights are ill-conditioned: rounding them to fp16
    alone moves their logits by up to 3e-2), target step only: a prompt prefilled in chunks over
    pages, and a chunk at position 3000 (over empty pools: RoPE angles there need fp32)."""
    logits = {}
    for dtype in ("float32", "float16"):
        options = BuildOptions(batch_sizes=(1,), prefill_chunk=16, max_seq_len=4096, dtype=dtype, no_mtp=True)
        build_engines(SHIPPED, tmp_path / dtype, options, show_progress=False)
        llm = LLM(tmp_path / dtype)
        ids = llm.encode(CODE)
        # not committed: the prefill below starts from empty pools again
        far = llm.runner.target_step([Rows(ids=ids[:16], context=3000, pages=list(range(1, 190)), slot=1)])
        far = far.arrays[c.LOGITS][0, :16].copy()
        logits[dtype] = np.concatenate([_prefill_logits(llm, ids, options.prefill_chunk), far])
    l16, l32 = logits["float16"], logits["float32"]
    scale = max(1.0, float(np.abs(l32).max()))
    assert np.abs(l16 - l32).max() <= LOGITS_RTOL * scale
    top2 = np.sort(l32, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * LOGITS_RTOL * scale   # rows without a near tie
    assert clear.sum() >= len(l32) // 2 and (l16.argmax(-1) == l32.argmax(-1))[clear].all()


def test_paged_attention_takes_float16_and_computes_in_float32():
    rng = np.random.default_rng(5)
    q, k, v, kc, vc, tables, lens = (a.astype(np.float16) if a.dtype == np.float32 else a
                                     for a in attention_case(rng))
    inputs = [q, k, v, kc, vc, tables, lens, np.zeros((1, 1, 0), np.int64)]
    model = single_op_model(paged_sparse_attention.make_function(), "PagedSparseAttention", inputs, [4],
                            out_dtype=np.float16, scale=0.3, sliding_window=0)
    (out,) = run_op(model, inputs)
    expected = ref.paged_attention(q, k, v, kc, vc, tables, lens, 0.3)   # float64 on the fp16 inputs
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float64), expected, atol=2e-3)  # one fp16 rounding of O(1)


def test_bfloat16_is_refused_with_the_reason(tiny_root, tmp_path, capsys):
    with pytest.raises(OptionsError, match="no bfloat16 kernels.*float16 or float32"):
        BuildOptions(dtype="bfloat16")
    out = tmp_path / "e"
    assert main(["build-engines", str(tiny_root / "qwen3_5_mtp1"), "--out", str(out), "--dtype", "bfloat16",
                 "--quiet"]) == 1
    assert "ONNX Runtime's CPU provider has no bfloat16 kernels" in capsys.readouterr().err
    assert not out.exists()
