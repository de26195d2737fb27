"""Every test in tests/server is marked `server` (a live HTTP server, the FastAPI app, or the pieces the
server alone uses); tests elsewhere that start a live server carry the mark themselves."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)     # before `-m` deselects (the hook sees every collected item)
def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.server)
