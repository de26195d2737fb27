"""`tandem serve`: load the engine directory, build the app, run uvicorn on loopback by default."""

from __future__ import annotations

from pathlib import Path

import uvicorn

from tandem.pipeline.llm import LLM, EngineConfig
from tandem.server.app import ServerSettings, create_app


def build(engine_dir: str | Path, settings: ServerSettings | None = None, config: EngineConfig | None = None):
    llm = LLM(engine_dir, config or EngineConfig())
    settings = settings or ServerSettings(model_name=Path(engine_dir).resolve().name)
    return create_app(llm, settings)


def serve(engine_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, settings: ServerSettings | None = None,
          config: EngineConfig | None = None) -> None:
    app = build(engine_dir, settings, config)
    # SIGTERM: uvicorn stops accepting, lets in-flight requests finish (up to the timeout), then
    # runs the app's shutdown, which waits for the engine loop to drain.
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=60)
