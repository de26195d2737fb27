"""bench/versus.py's own machinery, run with tandem alone (the other runtimes need an interpreter
with onnxruntime-genai and llama-cpp-python, not part of the test environment; docs/performance.md
has the figures of a run with them): its workers, their protocol, the agreement it reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tandem.bench.versus import agreement

BENCH = Path(__file__).resolve().parents[2] / "bench" / "versus.py"


def test_agreement_is_the_common_prefix_share():
    assert agreement([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == 1.0
    assert agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.5       # equal again after a difference: not counted
    assert agreement([[1, 2], [5, 6, 7, 8]], [[7, 2], [5, 6, 7]]) == (0.0 + 0.75) / 2


def test_tandem_workers_plain_and_speculative_agree(engine_dirs, tiny_root, tmp_path):
    """Two workers (plain and speculative decoding of one dir) in turn: greedy tokens equal, token for
    token, as the report's agreement says; every figure is a measured rate."""
    out = tmp_path / "versus.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), str(tiny_root / "qwen3_5_mtp3"), "--tandem", str(engine_dirs["qwen3_5_mtp3"]),
         "--formats", "--spec", "--batch", "1", "2", "--tokens", "12", "--rounds", "1", "--work", str(tmp_path),
         "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["batch"], r["runtime"].endswith("(speculative)")) for r in rows] == \
        [(1, False), (1, True), (2, False), (2, True)]
    assert all(r["agreement"] == 1.0 and r["tokens_per_s"] > 0 for r in rows)
