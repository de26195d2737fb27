"""The wheel holds every package of the source tree: pyproject.toml's package list is the set of
folders with an __init__.py (the repository root is the `tandem` package; bench/ and tests/ are not
shipped). A non-editable install is then whole; .ci/run builds the wheel, installs it into a fresh
environment and runs it (tools/check_wheel.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_SHIPPED = {"bench", "tests", "build"}   # (build/: what a wheel build leaves, ignored by git)


def test_the_package_list_is_every_package_of_the_tree():
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = {"tandem"} | {"tandem." + ".".join(p.parent.relative_to(ROOT).parts) for p in ROOT.rglob("__init__.py")
                          if p.parent != ROOT and p.parent.relative_to(ROOT).parts[0] not in NOT_SHIPPED | {".venv"}
                          and not any(part.startswith(".") for part in p.parent.relative_to(ROOT).parts)}
    found |= set(setuptools["package-data"])      # data-only packages (the kernels' sources): no __init__
    assert listed == found, (f"not in pyproject.toml: {sorted(found - listed)}; "
                             f"listed, not in the tree: {sorted(listed - found)}")
