"""`tandem inspect` prints the description or the refusal, through the installed console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cli import main
from tandem.testing.tiny_checkpoints import TINY_KINDS

from ..conftest import edit_json


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_inspect_prints_the_description(tiny_root, kind, capsys):
    assert main(["inspect", str(tiny_root / kind)]) == 0
    out = capsys.readouterr().out
    for field in ("family", "layers", "parameters", "mtp heads", "KV bytes/token", "state bytes/seq", "verdict"):
        assert field in out
    assert "OK: ready for speculative decoding, k=3" in out


def test_inspect_json(tiny_root, capsys):
    assert main(["inspect", str(tiny_root / "qwen3_5_moe"), "--json", "--spec-k", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["family"] == "qwen3_5_moe" and report["verdict"] == "ok"
    assert report["moe"]["experts"] == 4 and report["mtp"]["layers"] == 1
    assert report["speculative"] == {"enabled": True, "k": 2}
    assert report["parameters"]["trunk"] > 0 and report["kv_bytes_per_token"]["with_mtp"] == 768


def test_inspect_refuses_a_broken_checkpoint(tiny_copy, capsys):
    path = tiny_copy("qwen3_5_mtp3")
    edit_json(path / "config.json", intermediate_size=96)
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert "REFUSED" in err and "config.json implies [96, 64]" in err


def test_console_script_runs_without_torch(tiny_root):
    """The installed `tandem` script works, and the runtime path never imports torch."""
    script = Path(sys.executable).parent / "tandem"
    result = subprocess.run([str(script), "inspect", str(tiny_root / "qwen3_next")], capture_output=True, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0, result.stderr
    assert "qwen3_next" in result.stdout
    probe = ("import sys; from tandem.cli import main; rc = main(['inspect', sys.argv[1]]); "
             "assert 'torch' not in sys.modules and 'transformers' not in sys.modules; sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", probe, str(tiny_root / "qwen3_5_mtp1")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    bad = subprocess.run([str(script), "inspect", str(tiny_root / "nope")], capture_output=True, text=True)
    assert bad.returncode == 1 and "does not exist" in bad.stderr
