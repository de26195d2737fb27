"""bench/run.py, the bench harness: it lists every case with the first line of its docstring, runs
one case with its arguments passed through and writes the JSON shape every case shares, and
refuses a name that is no case; and the shared pieces it rests on (bench/common.py's interleaved
passes, bench/report.py's ratio printer)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.bench.common import interleaved
from tandem.bench.report import ratio_lines

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "bench" / "run.py"
HARNESS = {"__init__", "run", "common", "checkpoints", "report"}       # bench/'s own modules, not cases


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUN), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_list_names_every_case_with_its_docstring():
    done = _run("--list")
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    assert set(listed) == {p.stem for p in (ROOT / "bench").glob("*.py")} - HARNESS
    assert "Speculation against plain decoding on an engine dir's own heads" in listed["speculation_vs_plain"]
    assert _run().stdout == done.stdout                  # no arguments: the same list


def test_an_unknown_case_exits_non_zero_naming_the_cases():
    done = _run("no_such_case", "--tokens", "4")
    assert done.returncode != 0
    assert "no_such_case" in done.stderr and "speculation_vs_plain" in done.stderr and "versus" in done.stderr


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    """A tiny engine dir, made with the harness's own checkpoint and build helpers."""
    from tandem.bench.checkpoints import build, checkpoint

    work = tmp_path_factory.mktemp("bench_harness")
    return build(checkpoint("qwen3_5_mtp3", work), work / "engines", batch_sizes=(1,), spec_k=3, prefill_chunk=8,
                 max_seq_len=256, page_size=4).engine_dir


def test_a_case_run_through_the_harness_writes_the_common_json(engine_dir, tmp_path):
    """speculation_vs_plain with a few tokens: the arguments reach the case (its figures say 5 tokens,
    two setups, as asked) and --json before the name writes {case, argv, machine, commit, figures}."""
    out, own = tmp_path / "harness.json", tmp_path / "own.json"
    args = [str(engine_dir), "--tokens", "5", "--passes", "2", "--prompts", "2", "--setups", "k=1", "--json", str(own)]
    done = _run("--json", str(out), "speculation_vs_plain", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert list(data) == ["case", "argv", "machine", "commit", "figures"]
    assert data["case"] == "speculation_vs_plain" and data["argv"] == args
    assert "cores" in data["machine"]
    assert data["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", data["commit"])
    figures = data["figures"]
    assert figures["tokens"] == 5 and figures["batch"] == 1 and list(figures["setups"]) == ["plain", "k=1"]
    assert all(row["tokens_per_s"] > 0 for row in figures["setups"].values())
    assert figures["setups"]["plain"]["vs_plain"] == 1.0
    assert json.loads(own.read_text()) == figures          # the case's own --json: what it always wrote
    assert re.search(r"^  plain +[\d.]+ tok/s +1\.00x plain  accept length 1\.00$", done.stdout, re.M), done.stdout


def test_ratio_lines_give_each_row_against_the_baseline():
    lines = ratio_lines({"plain": 100.0, "default": 150.0}, "plain", extra={"default": "accept length 2.00"})
    assert lines == ["  plain       100.0 tok/s   1.00x plain",
                     "  default     150.0 tok/s   1.50x plain  accept length 2.00"]
    with pytest.raises(KeyError, match="nope"):
        ratio_lines({"plain": 1.0}, "nope")


def test_interleaved_runs_the_setups_in_turn():
    calls = []
    got = interleaved({"a": lambda i: calls.append(("a", i)) or i, "b": lambda i: calls.append(("b", i)) or -i}, 3,
                      warmup=1, alternate=True)
    assert calls == [("a", -1), ("b", -1), ("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert got == {"a": [0, 1, 2], "b": [0, -1, -2]}
    seen = []

    def check(this: dict) -> None:          # a check after each pass stops the run at the first bad one
        seen.append(this)
        if this["a"] == 1:
            raise SystemExit("pass 1 is bad")

    with pytest.raises(SystemExit, match="pass 1"):
        interleaved({"a": lambda i: i}, 3, each_pass=check)
    assert seen == [{"a": 0}, {"a": 1}]
