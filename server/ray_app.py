"""tandem on Ray Serve: replicas of one engine dir behind one OpenAI-compatible endpoint.

    client --HTTP--> Serve proxy --> Gateway --(handle, streamed; LeastLoadedRouter)--> Replica x N
                                       |                                                 |
                     /metrics <-- MetricsBoard <------ each replica's /metrics text ------+

- Replica owns one pipeline: LLM + ServeLoop inside `create_app`, the app of `tandem serve`,
  run in-process. Handlers, errors, auth, limits and metric names are that app's; nothing here
  re-implements them. It reports its load to the router (`record_routing_stats`); if its engine
  thread stops, the process exits (as `tandem serve` exits 1) and Serve replaces it.
- Gateway is the HTTP ingress. It hands each request to a replica and relays the ASGI messages the
  replica's app sends back. When a replica dies, a request that has sent nothing yet is retried on
  another replica; a stream already under way ends with an OpenAI-shaped 503 error event and
  `data: [DONE]` (the client sees why, instead of a cut connection).
- MetricsBoard keeps every replica's latest Prometheus text: `/metrics` is their aggregate under the
  single-process names, `/metrics/replicas` every series with a `replica` label.

Run it with `tandem serve ENGINE_DIR --ray` (server/serve.py) or
`serve run tandem.server.ray_app:build engine_dir=ENGINE_DIR replicas=2` (docs/ray.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from tandem.pipeline.llm import LLM, RuntimeConfig
from tandem.server import metrics as m
from tandem.server.app import ServerSettings, create_app
from tandem.server.protocol import error_body, json_bytes
from tandem.server.ray_routing import ROUTING_STATS_PERIOD_S, ROUTING_STATS_TIMEOUT_S, LeastLoadedRouter

log = logging.getLogger("tandem.server")
APP_NAME = "tandem"
REPLICA_HEADER = "x-tandem-replica"   # which replica served a response
RETRIED_HEADER = "x-tandem-retried"   # how many times a request was sent again after its replica died
METRICS_PUSH_S = 0.5                  # how often a replica sends its metrics to the board
METRICS_STALE_S = 5.0                 # a replica silent this long (dead, replaced) leaves /metrics
RETRIES = 2                           # other replicas tried for a request whose replica died before it sent anything
_QUIET = {"enable_access_log": False}  # no log line per metrics push or routing-stats poll


@dataclass(frozen=True)
class Scaling:
    """A fixed number of replicas, or autoscaling between min and max on requests in flight."""
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 4.0   # per replica, what the autoscaler aims at
    cpus_per_replica: float = 1.0          # Ray's reservation; also the replica's ONNX Runtime threads

    def __post_init__(self):
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("give both --min-replicas and --max-replicas (autoscaling), or neither")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.autoscaling and not (0 <= self.min_replicas <= self.max_replicas and self.max_replicas >= 1):
            raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                             f"{self.min_replicas} and {self.max_replicas}")
        if self.target_ongoing_requests <= 0 or self.cpus_per_replica <= 0:
            raise ValueError("target_ongoing_requests and cpus_per_replica must be > 0")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None


@dataclass(frozen=True)
class HttpRequest:
    """What the gateway passes to a replica: one HTTP request, its body read (up to the limit + 1
    byte, so the replica's own body limit still answers 413)."""
    method: str
    path: str
    raw_path: bytes
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None

    def scope(self) -> dict:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.raw_path,
                "query_string": self.query_string, "root_path": "", "headers": self.headers,
                "client": self.client, "server": None}


class Replica:
    """One pipeline and the app of `tandem serve` around it."""

    async def __init__(self, engine_dir: str, settings: ServerSettings, config: RuntimeConfig, board: DeploymentHandle):
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        self.app = create_app(LLM(engine_dir, config), settings, on_fatal=self._engine_stopped)
        self.loop = self.app.state.serve_loop
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()       # starts the serve-loop thread and its watchdog
        self._board = board
        self._push = asyncio.create_task(self._push_metrics())

    async def handle(self, request: HttpRequest):
        """Runs the request through the app; yields the ASGI messages it sends (start, body chunks)."""
        out: asyncio.Queue = asyncio.Queue()
        left = asyncio.Event()
        body = [request.body]

        async def receive():
            if body:
                return {"type": "http.request", "body": body.pop(), "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REPLICA_HEADER.encode(), self.name.encode())]}
            out.put_nowait(message)

        app = asyncio.create_task(self.app(request.scope(), receive, send))
        app.add_done_callback(lambda _: out.put_nowait(None))
        try:
            while (message := await out.get()) is not None:
                yield message
            app.result()
        finally:
            left.set()   # the gateway stopped reading (its client left): the app sees a disconnect, aborts

    def _engine_stopped(self, error: BaseException | None) -> None:
        """The serve-loop thread ended (where `tandem serve` exits 1): end the process now. Ray replaces
        the replica sooner than after failed health checks (5 s against 10 s here), and the gateway
        sends the requests that had received nothing to another replica instead of their 503."""
        log.critical("replica %s: the serve-loop thread stopped (%r); exiting for Ray to replace it", self.name, error)
        os._exit(1)

    def record_routing_stats(self) -> dict[str, int]:
        return self.loop.load_stats()

    def check_health(self) -> None:
        if not self.loop.alive():   # Serve replaces a replica whose health check raises
            raise RuntimeError(f"the serve-loop thread of replica {self.name} stopped ({self.loop.fatal!r})")

    async def _push_metrics(self) -> None:
        while True:
            try:
                await self._board.report.remote(self.name, generate_latest(m.REGISTRY).decode())
            except Exception as e:  # noqa: BLE001 - the board restarting must not stop the replica
                log.warning("could not send metrics to the board: %s", e)
            await asyncio.sleep(METRICS_PUSH_S)

    async def __del__(self):
        self._push.cancel()
        await self._lifespan.__aexit__(None, None, None)   # in-flight requests finish, the engine stops


class MetricsBoard:
    """The latest Prometheus text of every live replica."""

    def __init__(self):
        self.texts: dict[str, tuple[float, str]] = {}

    def report(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def exposition(self, per_replica: bool) -> str:
        now = time.monotonic()
        self.texts = {r: (at, t) for r, (at, t) in self.texts.items() if now - at < METRICS_STALE_S}
        return m.merged_exposition({r: t for r, (_, t) in self.texts.items()}, per_replica)


class Gateway:
    """The HTTP ingress: a plain ASGI app that relays each request to a replica."""

    def __init__(self, engine: DeploymentHandle, board: DeploymentHandle, max_body_bytes: int):
        self.engine = engine.options(stream=True)
        self.board = board
        self.max_body_bytes = max_body_bytes

    def __serve_build_asgi_app__(self):
        async def app(scope, receive, send):   # a plain function: uvicorn takes a bound method for ASGI 2
            await self.asgi(scope, receive, send)
        return app

    async def asgi(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        if scope["method"] == "GET" and scope["path"] in ("/metrics", "/metrics/replicas"):
            text = await self.board.exposition.remote(per_replica=scope["path"] == "/metrics/replicas")
            return await _respond(send, 200, text.encode(), CONTENT_TYPE_LATEST)
        body = await _read_body(receive, self.max_body_bytes + 1)
        request = HttpRequest(scope["method"], scope["path"], scope.get("raw_path") or scope["path"].encode(),
                              scope.get("query_string", b""), list(scope.get("headers", [])), body,
                              scope.get("client"))
        await self.relay(request, send)

    async def relay(self, request: HttpRequest, send) -> None:
        died = None
        for attempt in range(RETRIES + 1):
            stream, started, sse = self.engine.handle.remote(request), False, False
            try:
                async for message in stream:
                    if message["type"] == "http.response.start":
                        sse = dict(message.get("headers", [])).get(b"content-type", b"").startswith(
                            b"text/event-stream")
                        if attempt:   # the client may want to know its request ran twice
                            message = {**message, "headers": [*message.get("headers", []),
                                                              (RETRIED_HEADER.encode(), str(attempt).encode())]}
                    await send(message)
                    started = True
                return
            except RayActorError as e:   # the replica died (or cannot be reached) mid-request
                log.warning("replica died while serving %s %s (%s)", request.method, request.path, e)
                if not started:
                    died = e
                    continue    # nothing reached the client: another replica takes the request
                if sse:
                    error = error_body(f"the replica serving this request stopped ({type(e).__name__}); the output "
                                       "above is incomplete: send the request again", "server_error", 503)
                    await send({"type": "http.response.body", "more_body": True,
                                "body": f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            except BackPressureError:
                return await _error(send, 429, "too many requests queued for the replicas; retry shortly",
                                    "rate_limit_error", {"retry-after": "1"})
            finally:
                stream.cancel()   # a no-op when finished; Serve cancels it too when the client leaves
        await _error(send, 503, f"no replica could serve the request: {RETRIES + 1} replicas stopped while it "
                                f"waited ({type(died).__name__}); retry shortly", "server_error", {"retry-after": "1"})


async def _read_body(receive, limit: int) -> bytes:
    chunks, size = [], 0
    while size < limit:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if not message.get("more_body", False):
            break
    return b"".join(chunks)[:limit]


async def _respond(send, status: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
    extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), *extra]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _error(send, status: int, message: str, kind: str, headers: dict | None = None) -> None:
    await _respond(send, status, json_bytes(error_body(message, kind, status)), "application/json", headers)


def application(engine_dir: str | Path, settings: ServerSettings | None = None, config: RuntimeConfig | None = None,
                scaling: Scaling | None = None):
    """The Serve application: Gateway -> Replica (scaled, load-routed), MetricsBoard."""
    engine_dir = str(Path(engine_dir).resolve())
    settings = settings or ServerSettings(model_name=Path(engine_dir).name)
    scaling = scaling or Scaling()
    config = config or RuntimeConfig()
    config = replace(config, threads=config.threads or max(1, int(scaling.cpus_per_replica)))
    limit = max(1, settings.max_queued)
    replicas = {"autoscaling_config": AutoscalingConfig(
        min_replicas=scaling.min_replicas, max_replicas=scaling.max_replicas,
        target_ongoing_requests=scaling.target_ongoing_requests)} if scaling.autoscaling else \
        {"num_replicas": scaling.replicas}
    engine = serve.deployment(Replica, name="TandemEngine").options(
        max_ongoing_requests=limit,     # the replica's own 429 limit; beyond it requests wait in the router
        max_queued_requests=limit,      # ... up to this many, then 429 at the gateway
        ray_actor_options={"num_cpus": scaling.cpus_per_replica},
        health_check_period_s=2.0, graceful_shutdown_timeout_s=60.0, logging_config=_QUIET,
        request_router_config=RequestRouterConfig(request_router_class=LeastLoadedRouter,
                                                  request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
                                                  request_routing_stats_timeout_s=ROUTING_STATS_TIMEOUT_S),
        **replicas)
    board = serve.deployment(MetricsBoard, name="TandemMetrics", ray_actor_options={"num_cpus": 0},
                             logging_config=_QUIET).bind()
    gateway = serve.deployment(serve.ingress()(Gateway), name="TandemGateway", max_ongoing_requests=100_000,
                               ray_actor_options={"num_cpus": 0})
    return gateway.bind(engine.bind(engine_dir, settings, config, board), board, settings.max_body_bytes)


def build(args: dict):
    """`serve run tandem.server.ray_app:build engine_dir=DIR [replicas=N | min_replicas=A max_replicas=B]
    [model_name= api_key= allow_extra_fields=true max_queued= max_body_bytes= default_max_tokens= stream_interval=
    memory_budget_mb= threads= cpus_per_replica= target_ongoing_requests=]`: the same options as
    `tandem serve --ray`."""
    args = dict(args)
    if "engine_dir" not in args:
        raise ValueError("give engine_dir=ENGINE_DIR (a folder written by `tandem build-engines`)")
    engine_dir = args.pop("engine_dir")
    known = {"model_name", "api_key", "allow_extra_fields", "max_queued", "max_body_bytes", "default_max_tokens",
             "stream_interval", "memory_budget_mb", "threads", "replicas", "min_replicas", "max_replicas",
             "cpus_per_replica",
             "target_ongoing_requests"}
    if unknown := sorted(set(args) - known):
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}; known: engine_dir, {', '.join(sorted(known))}")
    num = {k: float(args[k]) if k in ("memory_budget_mb", "cpus_per_replica", "target_ongoing_requests")
           else int(args[k]) for k in known - {"model_name", "api_key", "allow_extra_fields"} if k in args}
    settings = ServerSettings(model_name=args.get("model_name") or Path(engine_dir).resolve().name,
                              api_key=args.get("api_key"),
                              allow_extra_fields=str(args.get("allow_extra_fields", "")).lower() in ("1", "true"),
                              **{k: num[k] for k in ("max_queued", "max_body_bytes", "default_max_tokens",
                                                     "stream_interval") if k in num})
    config = RuntimeConfig(threads=num.get("threads"),
                          **({"memory_budget_bytes": int(num["memory_budget_mb"] * 2**20)}
                             if "memory_budget_mb" in num else {}))
    scaling = Scaling(**{k: num[k] for k in ("replicas", "min_replicas", "max_replicas", "cpus_per_replica",
                                             "target_ongoing_requests") if k in num})
    return application(engine_dir, settings, config, scaling)

