"""Every test in tests/server is marked `server` (a live HTTP server, the FastAPI app, or the pieces the
server alone uses); tests elsewhere that start a live server carry the mark themselves.

The fixtures most server modules share, one instance per module: `live` (a server over the tiny
qwen3_5_mtp3 engines, drafting with its heads), `client` (the official openai client to it) and
`plain` (the offline plain-decoding pipeline answers are compared with). A module that needs a
server started otherwise defines its own `live`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.pipeline.llm import LLM, RuntimeConfig

from .test_server import Live
from .test_server import client as openai_client

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)     # before `-m` deselects (the hook sees every collected item)
def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.server)


@pytest.fixture(scope="module")
def live(engine_dirs):
    with Live(engine_dirs["qwen3_5_mtp3"]) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai_client(live, timeout=60)


@pytest.fixture(scope="module")
def plain(engine_dirs):
    return LLM(engine_dirs["qwen3_5_mtp3"], RuntimeConfig(speculative=False))
