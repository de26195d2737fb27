"""`tandem serve`: load the engine directory, build the app, run uvicorn on loopback by default.

With --ray the same app runs in replicas on Ray Serve (serve_ray, server/ray_app.py).
The exit status is what a supervisor needs: 0 after a normal shutdown, 1 when the serve-loop thread
ended and the server stopped itself so that it can be restarted."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import uvicorn

from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.server.app import ServerSettings, create_app
from tandem.server.http_guard import guarded_protocol

STARTUP_FAILURE = 3   # as uvicorn.run: the server never started (the port is taken, say)


def build(engine_dir: str | Path, settings: ServerSettings | None = None, config: RuntimeConfig | None = None,
          on_fatal: Callable[[BaseException | None], None] | None = None):
    llm = LLM(engine_dir, config or RuntimeConfig())
    settings = settings or ServerSettings(model_name=Path(engine_dir).resolve().name)
    return create_app(llm, settings, on_fatal)


def uvicorn_config(app, host: str, port: int) -> uvicorn.Config:
    """How uvicorn runs the app: its settings' header limits on every connection (server/http_guard.py);
    on SIGTERM uvicorn stops accepting, lets in-flight requests finish (up to the timeout), then runs
    the app's shutdown, which waits for the serve loop to drain."""
    settings = app.state.settings
    return uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=60,
                          http=guarded_protocol(settings.max_header_bytes, settings.header_timeout_s),
                          h11_max_incomplete_event_size=2 * settings.max_header_bytes)   # (h11's own: ours first)


def serve(engine_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, settings: ServerSettings | None = None,
          config: RuntimeConfig | None = None) -> int:
    died: list[BaseException | None] = []
    server: uvicorn.Server | None = None

    def on_fatal(error: BaseException | None) -> None:
        died.append(error)
        server.should_exit = True   # stop taking connections, close, return from run()

    server = uvicorn.Server(uvicorn_config(build(engine_dir, settings, config, on_fatal), host, port))
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if died:
        return 1
    return 0 if server.started else STARTUP_FAILURE


def serve_ray(engine_dir: str | Path, host: str = "127.0.0.1", port: int = 8000,
              settings: ServerSettings | None = None, config: RuntimeConfig | None = None, scaling=None,
              address: str | None = None) -> int:
    """`tandem serve --ray`: the same API from replicas on Ray Serve (server/ray_app.py). Without
    `address` a local Ray instance starts here and stops on exit; with one (`auto`, `ray://...`)
    the application joins that cluster and is deleted from it on exit. Returns 0 after SIGINT or
    SIGTERM, STARTUP_FAILURE when the application could not be deployed."""
    import signal
    import threading

    try:
        import ray
        from ray import serve as ray_serve
    except ImportError as e:
        raise ValueError("--ray needs Ray Serve: pip install 'tandem[ray]'") from e
    from tandem.server.ray_app import APP_NAME, application

    app = application(engine_dir, settings, config, scaling)   # checks the options before Ray starts
    stop = threading.Event()
    ray.init(address=address, include_dashboard=False, logging_level="warning")
    for sig in (signal.SIGINT, signal.SIGTERM):   # after ray.init, which installs its own (exit at once)
        signal.signal(sig, lambda *_: stop.set())
    try:
        ray_serve.start(http_options={"host": host, "port": port})
        ray_serve.run(app, name=APP_NAME, route_prefix="/")
    except Exception as e:  # noqa: BLE001 - a replica failed to start, the port is taken, ...
        print(f"serve --ray: the application did not start: {e}", file=sys.stderr)
        ray.shutdown()
        return STARTUP_FAILURE
    while not stop.wait(0.5):   # a timed wait, so that the signal handlers run promptly
        pass
    print("serve --ray: stopping; requests in flight finish first", file=sys.stderr, flush=True)
    ray_serve.delete(APP_NAME)   # replicas finish their requests (graceful_shutdown_timeout_s)
    ray.shutdown()
    return 0
