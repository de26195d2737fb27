"""`tandem serve`: load the engine directory, build the app, run uvicorn on loopback by default.

The exit status is what a supervisor needs: 0 after a normal shutdown, 1 when the engine thread
ended and the server stopped itself so that it can be restarted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import uvicorn

from tandem.pipeline.llm import LLM, EngineConfig
from tandem.server.app import ServerSettings, create_app

STARTUP_FAILURE = 3   # as uvicorn.run: the server never started (the port is taken, say)


def build(engine_dir: str | Path, settings: ServerSettings | None = None, config: EngineConfig | None = None,
          on_fatal: Callable[[BaseException | None], None] | None = None):
    llm = LLM(engine_dir, config or EngineConfig())
    settings = settings or ServerSettings(model_name=Path(engine_dir).resolve().name)
    return create_app(llm, settings, on_fatal)


def serve(engine_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, settings: ServerSettings | None = None,
          config: EngineConfig | None = None) -> int:
    died: list[BaseException | None] = []
    server: uvicorn.Server | None = None

    def on_fatal(error: BaseException | None) -> None:
        died.append(error)
        server.should_exit = True   # stop taking connections, close, return from run()

    app = build(engine_dir, settings, config, on_fatal)
    # SIGTERM: uvicorn stops accepting, lets in-flight requests finish (up to the timeout), then
    # runs the app's shutdown, which waits for the engine loop to drain.
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=60))
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if died:
        return 1
    return 0 if server.started else STARTUP_FAILURE
