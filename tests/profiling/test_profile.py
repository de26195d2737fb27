"""`tandem profile` on a tiny engine directory: the files and their fields, the tuned widths
read back by the pipeline, re-rendering from report.json alone, and the tuning rule."""

from __future__ import annotations

import json
import shutil

import pytest

from tandem.cli import main
from tandem.pipeline.llm import LLM
from tandem.profiling.tuning import choose_widths, expected_tokens


@pytest.fixture
def engine_copy(engine_dirs, tmp_path):
    path = tmp_path / "engines"
    shutil.copytree(engine_dirs["qwen3_5_mtp3"], path)
    return path


def test_profile_writes_report_html_trace_and_tuned_widths(engine_copy, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in [
        {"category": "code_python", "prompt": "def add(a, b):"}, {"category": "qa_factual", "prompt": "# Q: 1+1?"},
        {"category": "code_python", "prompt": "class A:"}]))
    out = tmp_path / "report"
    assert main(["profile", str(engine_copy), "--out", str(out), "--prompts", str(prompts), "--batch-sizes", "1,2",
                 "--max-tokens", "6", "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    for key in ("device", "backend", "versions", "latency", "runs", "speedup", "aggregate", "tuning"):
        assert key in report
    assert report["device"]["cores"] >= 1 and report["backend"] == "onnxruntime"
    graphs = {(x["graph"], x["batch"], x["rows"]) for x in report["latency"]}
    assert {("target_step", 1, 1), ("verify_greedy", 2, 4), ("mtp_head_0", 1, 3)} <= graphs
    assert all(x["p90_ms"] >= x["median_ms"] > 0 for x in report["latency"])
    modes = {(r["batch"], r["mode"], r["constrained"]) for r in report["runs"]}
    assert modes == {(b, m, c) for b in (1, 2) for m in ("off", "on") for c in (False, True)}
    ruled = [r for r in report["runs"] if r["constrained"]]     # under a JSON schema: every token decoded
    assert sum(r["aggregate"]["total_predicted"] for r in ruled) == 4 * 3 * 6
    on = next(r for r in report["runs"] if r["mode"] == "on" and not r["constrained"])
    assert {"draft", "round"} <= set(on["phases_ms_per_round"])   # one-call rounds (first drafts: draft calls)
    assert len(on["acceptance_per_position"]) == 3 and set(on["per_category"]) == {"code_python", "qa_factual"}
    agg = report["aggregate"]
    assert agg["n_requests"] == 6 and agg["total_predicted"] == 36 and agg["total_draft"] > 0
    assert set(report["tuning"]) == {"1", "2"}
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert trace and {e["name"] for e in trace} >= {"prefill", "draft", "round"}
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3 and "speedup vs bound" in page
    # the pipeline reads the tuned widths back
    tuned = {int(b): t["width"] for b, t in report["tuning"].items()}
    llm = LLM(engine_copy)
    assert {b: llm.width_per_batch[b] for b in tuned} == tuned
    # and the measured round costs, which the adaptive width starts from
    costs = llm.runtime_settings.round_seconds
    assert set(costs) == {1, 2} and all(set(c) == {1, 2, 3, 4} and min(c.values()) > 0 for c in costs.values())
    assert llm.round_loop.width_control.estimates(1)[0].cost == costs[1][1]
    # and the costs of rounds under a schema, which a schema's rounds start from
    ruled_costs = llm.runtime_settings.constrained_round_seconds
    assert set(ruled_costs) == {1, 2} and all(set(c) == {1, 2, 3, 4} for c in ruled_costs.values())
    assert [e.cost for e in llm.round_loop.width_control.estimates(2, constrained=True)] == \
        [ruled_costs[2][w] for w in (1, 2, 3, 4)]
    # and the HTML can be made again from report.json alone
    (out / "report.html").unlink()
    assert main(["profile", "--out", str(out), "--render", str(out / "report.json")]) == 0
    assert (out / "report.html").exists()
    assert "verify width" in capsys.readouterr().out


def test_profile_refuses_bad_prompts_and_batch_sizes(engine_copy, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"category": "x"}\n')
    assert main(["profile", str(engine_copy), "--out", str(tmp_path / "o"), "--prompts", str(bad), "--quiet"]) == 1
    assert "must be a JSON object with a 'prompt'" in capsys.readouterr().err
    assert main(["profile", str(engine_copy), "--out", str(tmp_path / "o"), "--batch-sizes", "3", "--quiet"]) == 1
    assert "have no engines here" in capsys.readouterr().err


def test_tuning_picks_the_highest_expected_throughput():
    assert expected_tokens([0.8, 0.5, 0.2], 4) == pytest.approx(2.5)
    rounds = {(1, 1): 0.010, (1, 2): 0.012, (1, 3): 0.014, (1, 4): 0.030, (8, 1): 0.02, (8, 2): 0.05, (8, 3): 0.08}
    chosen = choose_widths([1, 8], [2, 3, 4], [0.8, 0.5, 0.2], rounds)
    assert chosen[1]["width"] == 3  # 2.3 tokens / 14 ms beats 1.8 / 12 ms and 2.5 / 30 ms
    assert chosen[8]["width"] == 1  # at batch 8 verifying costs more than drafting gains
    assert chosen[1]["gain_over_plain"] == pytest.approx((2.3 / 0.014) / (1 / 0.010), rel=1e-3)
