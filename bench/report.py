"""What a bench case reports: one JSON shape for every case, and the ratio printer.

JSON (bench/run.py --json PATH NAME ...): {"case": NAME, "argv": [the case's arguments], "machine":
"<cpu>, <n> cores", "commit": `git rev-parse HEAD` of the tree (null outside a git checkout),
"figures": {what the case's main() returned}}.

Ratio printer: rows of name -> value (tokens/s, say), each with its ratio to a named baseline row:

      plain       412.3 tok/s   1.00x plain
      default     655.0 tok/s   1.59x plain  accept length 2.31
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str | None:
    """The checkout's HEAD commit, or None (no git, or not a git checkout)."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def report(case: str, argv: list[str], figures: Mapping | None) -> dict:
    """The common JSON shape of one case's run."""
    from bench.common import machine

    return {"case": case, "argv": list(argv), "machine": machine(), "commit": commit(), "figures": dict(figures or {})}


def jsonable(value):
    """json.dumps' default= for figures: paths as strings, numpy scalars and arrays as numbers and
    lists, dataclasses and named tuples as dicts, sets as sorted lists."""
    if isinstance(value, Path):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "_asdict"):
        return value._asdict()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "tolist"):            # numpy arrays and scalars
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def write_json(path: str | Path, data, indent: int | None = 2) -> Path:
    """`data` as JSON at `path` (figures through jsonable), a newline at the end."""
    path = Path(path)
    path.write_text(json.dumps(data, indent=indent, default=jsonable) + "\n")
    return path


def ratio_lines(rows: Mapping[str, float], baseline: str, *, unit: str = "tok/s", against: str | None = None,
                fmt: str = "9.1f", width: int = 0, indent: str = "  ",
                extra: Mapping[str, str] | None = None) -> list[str]:
    """One line per row: its name (padded to `width` or the longest name), value in `fmt`, `unit`,
    and value / the baseline row's value as "1.23x <against>" (against: the baseline's name unless
    given), then the row's `extra` text."""
    if baseline not in rows:
        raise KeyError(f"the baseline row {baseline!r} is not among the rows ({', '.join(rows)})")
    base = rows[baseline]
    width = max([width, *(len(name) for name in rows)])
    lines = []
    for name, value in rows.items():
        ratio = f"{value / base:5.2f}x" if base else "    -"
        line = f"{indent}{name:<{width}} {value:{fmt}} {unit}  {ratio} {against or baseline}"
        if extra and extra.get(name):
            line += f"  {extra[name]}"
        lines.append(line)
    return lines


def print_ratios(rows: Mapping[str, float], baseline: str, **kwargs) -> dict[str, float]:
    """Print ratio_lines(rows, baseline, **kwargs); return each row's ratio to the baseline."""
    for line in ratio_lines(rows, baseline, **kwargs):
        print(line)
    base = rows[baseline]
    return {name: value / base if base else float("nan") for name, value in rows.items()}
