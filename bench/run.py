"""The bench harness: runs one case, bench/NAME.py, with its arguments, or lists the cases.

    .venv/bin/python bench/run.py [--list]                        every case, with what it measures
    .venv/bin/python bench/run.py [--json OUT.json] NAME [ARGS ...]
    .venv/bin/python bench/run.py NAME --help                     the case's own options

ARGS go to the case unchanged: `bench/run.py versus CKPT --tandem DIR` runs what
`python bench/versus.py CKPT --tandem DIR` runs (each case still runs on its own that way). Through
the harness a case's main(argv) returns its figures, and `--json` (before NAME) writes them in the
shape every case shares (bench/report.py): {"case", "argv", "machine", "commit", "figures"}. A case's
own `--json` (after NAME), where it has one, still writes what it always wrote.

Shared pieces, not cases: bench/common.py (timing: median / p90, setups interleaved pass by pass;
decode tokens/s, accept length), bench/checkpoints.py (tiny / 150M checkpoints written on the fly,
engine dirs built from them), bench/report.py (the JSON shape, the ratio printer).
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
HARNESS = ("__init__", "run", "common", "checkpoints", "report")   # bench/'s own modules, not cases


def cases() -> dict[str, str]:
    """Case name -> the first line of its module docstring, for every bench/*.py but the harness's own
    modules (read without importing: a case's imports may need what this interpreter lacks)."""
    out = {}
    for path in sorted(BENCH.glob("*.py")):
        if path.stem in HARNESS:
            continue
        doc = (ast.get_docstring(ast.parse(path.read_text(), str(path))) or "").strip()
        out[path.stem] = doc.splitlines()[0] if doc else ""
    return out


def listing() -> str:
    known = cases()
    width = max(len(name) for name in known)
    return "\n".join(f"  {name:<{width}}  {line}" for name, line in known.items())


def run_case(name: str, argv: list[str]) -> dict:
    """Import bench/NAME.py and return what its main(argv) returns (its figures; {} for None). While it
    runs, sys.argv reads as if the case had been started on its own."""
    if name not in cases():
        raise SystemExit(f"bench/run.py: no case {name!r}; the cases (bench/NAME.py):\n{listing()}")
    if str(ROOT) not in sys.path[:1]:
        sys.path.insert(0, str(ROOT))
    module = importlib.import_module(f"bench.{name}")
    main = getattr(module, "main", None)
    if main is None:
        raise SystemExit(f"bench/{name}.py has no main(argv): not a case the harness can run")
    saved, sys.argv = sys.argv, [str(BENCH / f"{name}.py"), *argv]
    try:
        figures = main(list(argv))
    finally:
        sys.argv = saved
    if figures is None:
        return {}
    if not isinstance(figures, dict):
        raise SystemExit(f"bench/{name}.py: main() returned a {type(figures).__name__}, not a dict of figures")
    return figures


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    json_path, i = None, 0
    while i < len(argv) and argv[i].startswith("-"):
        arg = argv[i]
        if arg == "--list":
            print(listing())
            return 0
        if arg in ("-h", "--help"):
            print(__doc__.strip() + "\n\ncases:\n" + listing())
            return 0
        if arg == "--json" and i + 1 < len(argv):
            json_path, i = argv[i + 1], i + 2
        elif arg.startswith("--json="):
            json_path, i = arg.split("=", 1)[1], i + 1
        else:
            raise SystemExit(f"bench/run.py: unknown option {arg!r} (before NAME: --list, --json PATH; "
                             "after NAME: the case's own)")
    if i == len(argv):
        if json_path is not None:
            raise SystemExit("bench/run.py: --json needs a case to run: bench/run.py --json OUT.json NAME [ARGS ...]")
        print(listing())
        return 0
    name, rest = argv[i], argv[i + 1:]
    figures = run_case(name, rest)
    if json_path is not None:
        from bench.report import report, write_json

        write_json(json_path, report(name, rest, figures))
        print(f"wrote {json_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
