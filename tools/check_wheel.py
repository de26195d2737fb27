"""What a user of the wheel gets (.ci/run runs this after the tests): build the wheel with
`python -m build`, install it into a fresh virtual environment (runtime dependencies only, no
editable source tree on the path), then run `tandem inspect` and one generation from it on the
shipped model. Exit status 0 when all of it works; the failing step's output otherwise.

    .venv/bin/python tools/check_wheel.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tandem-tiny-code"
MUST_SHIP = ("tandem/cli.py", "tandem/contract.py", "tandem/engines/backends/onnxruntime_backend.py",
             "tandem/export/ops/__init__.py", "tandem/plugins/cpu/sampler.cc", "tandem/profiling/prompts.jsonl")


def step(what: str, cmd: list, cwd: Path) -> str:
    print(f"[wheel] {what}: {' '.join(map(str, cmd))}", flush=True)
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"[wheel] {what} failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, default=None, help="work here and keep it (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        left = (ROOT / "build").exists()
        step("build", [sys.executable, "-m", "build", "--wheel", "--outdir", work / "dist", ROOT], work)
        if not left:        # setuptools' staging folder in the source tree: not ours to keep
            shutil.rmtree(ROOT / "build", ignore_errors=True)
        wheel = next((work / "dist").glob("tandem-*.whl"))
        names = set(zipfile.ZipFile(wheel).namelist())
        missing = [n for n in MUST_SHIP if n not in names]
        if missing:
            sys.exit(f"[wheel] {wheel.name} lacks {missing}")
        venv = work / "venv"
        step("venv", [sys.executable, "-m", "venv", venv], work)
        step("install", [venv / "bin" / "python", "-m", "pip", "install", "-q", wheel], work)
        # from `work`, not the source tree: the installed package is what runs
        step("inspect", [venv / "bin" / "tandem", "inspect", MODEL], work)
        step("build-engines", [venv / "bin" / "tandem", "build-engines", MODEL, "--out", work / "engines",
                               "--batch-sizes", "1", "--max-seq-len", "256"], work)
        out = step("generate", [venv / "bin" / "tandem", "generate", work / "engines", "--prompt", "def add(a, b):",
                                "--max-tokens", "8"], work)
        where = step("import", [venv / "bin" / "python", "-c", "import tandem; print(tandem.__file__)"], work)
        if str(ROOT) in where:
            sys.exit(f"[wheel] the source tree was imported ({where.strip()}), not the installed wheel")
        print(f"[wheel] ok: {wheel.name}, installed at {where.strip()}\n{out[-600:]}")


if __name__ == "__main__":
    main()
