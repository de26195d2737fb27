"""The OpenAI-compatible HTTP API. Handlers only translate: HTTP -> checked request -> the engine
loop -> OpenAI-shaped JSON or SSE chunks. Errors use the OpenAI error shape, always as JSON.

A request is checked completely when it arrives (pydantic's strict types, then
LLM.check_request: token ids, integer bounds, valid Unicode, lengths), so the serve-loop thread
only ever sees requests it can run. A watchdog notices if the serve-loop thread ends: /health and
/ready turn 503 and `on_fatal` is called (`tandem serve` then exits 1).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.engines.manifest import chat_formats
from tandem.pipeline.llm import LLM
from tandem.pipeline.request_checks import check_text
from tandem.server import metrics as m
from tandem.server import tokenize_api
from tandem.server.chat_template import ChatTemplate, ChatTemplateError
from tandem.server.limits import RequestGuard
from tandem.server.protocol import ChatRequest, CompletionRequest, error_body, json_bytes, unknown_field
from tandem.server.responses import GenerationFailed, Responses, best, candidate_params, collect
from tandem.server.serve_loop import ServeLoop, ServeLoopError
from tandem.server.tokenize_api import Detokenize, TokenizeBody
from tandem.server.tool_calls import AnswerParser, check_tools, template_messages, tool_choice_grammar
from tandem.server.validation_errors import describe

log = logging.getLogger("tandem.server")
DISCONNECT_POLL_S = 0.1    # how often a non-streamed request checks that its client is still there
WATCHDOG_S = 0.2           # how often the serve-loop thread is checked


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_queued: int = 64
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256
    openapi: bool = False          # serve /docs, /redoc and /openapi.json
    stream_interval: int = 1       # tokens a streamed event holds (after the first); more: less host work per token
    allow_extra_fields: bool = False   # accept (and ignore) request fields tandem does not know; off: 400
    max_header_bytes: int = 64 << 10   # a request's line and headers at most (431 past it; server/http_guard.py)
    header_timeout_s: float = 10.0     # for them to arrive once the first byte has (408 past it)

    def __post_init__(self):
        check_text(self.model_name, "the model name")  # e.g. undecodable bytes on the command line
        if self.max_queued < 0 or self.max_body_bytes < 0 or self.default_max_tokens < 1 or self.stream_interval < 1:
            raise ValueError("max_queued and max_body_bytes must be >= 0, default_max_tokens and stream_interval >= 1")
        if self.max_header_bytes < 1024 or not self.header_timeout_s > 0:
            raise ValueError(f"max_header_bytes must be >= 1024 and header_timeout a number of seconds > 0, got "
                             f"{self.max_header_bytes} and {self.header_timeout_s}")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers


class AsciiJSON(JSONResponse):
    def render(self, content) -> bytes:
        return json_bytes(content)


def _error(status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None):
    return AsciiJSON(error_body(message, kind, status, param), status, headers=headers)


def create_app(llm: LLM, settings: ServerSettings,
               on_fatal: Callable[[BaseException | None], None] | None = None) -> FastAPI:
    loop = ServeLoop(llm, settings.max_queued, settings.model_name)
    chat_template = ChatTemplate.from_engine_dir(llm.engine_dir)
    formats = chat_formats(llm.manifest)   # the family's tool-call and reasoning syntax (server/tool_calls.py)
    state = {"ready": False, "draining": False}
    responses = Responses(llm, settings.model_name)

    async def watchdog():
        while loop.alive():
            await asyncio.sleep(WATCHDOG_S)
        state["ready"] = False
        log.critical("the serve-loop thread is not running (%r): failing the requests in flight and stopping",
                     loop.fatal)
        loop.fail_everything(f"engine error: the serve-loop thread stopped ({loop.fatal!r}); the server is restarting")
        if on_fatal is not None:
            on_fatal(loop.fatal)

    async def lifespan(app):
        loop.start()
        state["ready"] = True
        watch = asyncio.create_task(watchdog())
        yield
        watch.cancel()
        state["draining"], state["ready"] = True, False   # SIGTERM: uvicorn stops taking connections,
        for _ in range(600):                                # finishes in-flight requests; we wait for them
            if loop.idle() or not loop.alive():
                break
            await asyncio.sleep(0.05)
        loop.stop()

    docs = {} if settings.openapi else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="tandem", lifespan=lifespan, default_response_class=AsciiJSON, **docs)
    app.state.serve_loop, app.state.settings = loop, settings
    app.add_middleware(RequestGuard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)

    # ---- errors in the OpenAI shape ----------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return _error(exc.status, exc.message, exc.kind, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        # 400 for every malformed body, as OpenAI and vLLM answer it; the first problem, in words
        where, message = describe(exc.errors()[0]) if exc.errors() else (None, "body: invalid request")
        return _error(400, message, "invalid_request_error", where)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        log.exception("unexpected error in a handler")
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    # ---- health, readiness, models, metrics --------------------------------------------
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not loop.alive():  # the process cannot serve; it is exiting for its supervisor to restart it
            return AsciiJSON({"status": "serve-loop thread not running"}, 503)
        return {"status": "ok"}

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready():
        if not state["ready"] or not loop.alive():
            return AsciiJSON({"status": "not ready"}, 503)
        return {"status": "ready", "model": settings.model_name}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "tandem", "max_model_len": llm.max_seq_len}]}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        return PlainTextResponse(generate_latest(m.REGISTRY).decode(), media_type=CONTENT_TYPE_LATEST)

    # ---- tokenizer -------------------------------------------------------------------
    def check_body(req) -> None:
        """What every body is checked for: the model it names and fields nobody declares."""
        if req.model is not None and req.model != settings.model_name:
            raise ApiError(404, f"model '{req.model}' does not exist; this server serves '{settings.model_name}'",
                           "not_found_error", "model")
        if not settings.allow_extra_fields and (field := unknown_field(req)) is not None:
            raise ApiError(400, f"{field}: not a field of this endpoint; drop it (or start the server with "
                                "--allow-extra-fields to accept and ignore unknown fields)", param=field)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeBody):
        check_body(req)
        try:
            return await asyncio.to_thread(tokenize_api.tokenize, llm, chat_template, req)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from e
        except ValueError as e:
            raise ApiError(400, str(e), param=getattr(e, "param", None)) from e

    @app.post("/detokenize")
    async def detokenize(req: Detokenize):
        check_body(req)
        try:
            return tokenize_api.detokenize(llm, req)
        except ValueError as e:
            raise ApiError(400, str(e), param=getattr(e, "param", None)) from e

    # ---- generation --------------------------------------------------------------------
    def check(req, prompts: int = 1) -> None:
        """Everything a generation request is checked for before it starts (`prompts`: how many it sends)."""
        try:
            req.check_text_fields()
        except ValueError as e:
            raise ApiError(400, str(e), param=getattr(e, "param", None)) from e
        check_body(req)
        if (refused := req.not_honoured()) is not None:
            raise ApiError(400, refused[1], param=refused[0])
        if state["draining"]:
            raise ApiError(503, "the server is shutting down", "server_error")
        if not loop.alive():
            raise ApiError(503, "the engine is not running; the server is restarting", "server_error")
        wanted = prompts * req.candidates()
        if wanted > max(settings.max_queued, 1):
            field = "prompt" if prompts > 1 else "best_of" if req.best_of else "n"
            raise ApiError(400, f"{prompts} prompt(s) x {req.candidates()} candidate(s): each is a request of its own "
                                f"and this server runs at most {settings.max_queued} (--max-queued); ask for fewer",
                           param=field)
        if loop.load() + wanted > settings.max_queued:
            raise ApiError(429, f"too many requests in flight ({settings.max_queued}); retry shortly",
                           "rate_limit_error", headers={"Retry-After": "1"})

    async def start(prompt, req, grammar=None) -> tuple[list[int], list[tuple[str, asyncio.Queue]]]:
        """The prompt's token ids and its generations, one per candidate (n, or best_of), started."""
        try:
            params = req.sampling_params(settings.default_max_tokens)
            if grammar is not None:   # tool_choice required / named: the call's grammar
                if params.grammar is not None:
                    raise ApiError(400, f"tool_choice {req.tool_choice_value()!r} and {params.grammar.field} both "
                                        "constrain the output: send one of them", param="tool_choice")
                params = dataclasses.replace(params, grammar=grammar)
            checked = await asyncio.to_thread(llm.check_request, prompt, params)  # tokenizing may take a while
            started = []
            try:
                for p in candidate_params(params, req.n, req.candidates()):
                    started.append(await loop.submit(checked.ids, p, settings.stream_interval if req.stream
                                                     else None))
            except BaseException:
                for rid, _ in started:
                    loop.abort(rid)
                raise
            return checked.ids, started
        except ValueError as e:
            raise ApiError(400, str(e), param=getattr(e, "param", None)) from e
        except ServeLoopError as e:
            raise ApiError(500, str(e), "server_error") from e

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        prompts = req.prompts()
        check(req, len(prompts))
        ids, started = [], []
        try:
            for prompt in prompts:      # prompt p's candidates, then p + 1's
                prompt_ids, candidates = await start(prompt, req)
                ids.append(prompt_ids)
                started += candidates
        except BaseException:
            for rid, _ in started:
                loop.abort(rid)
            raise
        return await respond(request, started, req, chat=False, prompts=prompts, prompt_ids=ids)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        check(req)
        if chat_template is None:
            raise ApiError(400, "this model has no chat template (tokenizer_config.json); use /v1/completions")
        tools, choice = req.tool_dicts(), req.tool_choice_value()
        try:
            check_tools(formats.get("tool_calls"), tools, choice)
            prompt = await chat_template.render_async(template_messages(req.messages), req.add_generation_prompt,
                                                      tools, req.chat_template_kwargs)
            grammar = tool_choice_grammar(formats["tool_calls"], tools, choice, req.parallel_tool_calls) if tools \
                else None
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from e
        except ValueError as e:
            raise ApiError(400, str(e), param=getattr(e, "param", None)) from e
        answers = [AnswerParser(formats, prompt, tools, parse_tools=choice != "none") for _ in range(req.candidates())]
        ids, started = await start(prompt, req, grammar)
        return await respond(request, started, req, chat=True, answers=answers, prompts=[prompt], prompt_ids=[ids])

    async def respond(request: Request, started: list[tuple[str, asyncio.Queue]], req, chat: bool,
                      prompts: list, prompt_ids: list[list[int]], answers: list[AnswerParser] | None = None):
        """The response of every prompt's candidates (`started`, prompt by prompt), whole or streamed."""
        created, rids = int(time.time()), [rid for rid, _ in started]
        outs = [out for _, out in started]
        if req.stream:
            def unfinished(indices: list[int]) -> None:   # the client went away (or the engine failed)
                for i in indices:
                    loop.abort(rids[i])
            return StreamingResponse(responses.chunks(rids[0], created, req, chat, outs, answers, ServeLoopError,
                                                      unfinished, prompts, prompt_ids),
                                     media_type="text/event-stream")
        gone = asyncio.create_task(_client_gone(request))
        everything = asyncio.ensure_future(asyncio.gather(*(collect(out, ServeLoopError) for out in outs)))
        try:
            await asyncio.wait({everything, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not everything.done():  # the client hung up: stop generating for it
                everything.cancel()
                for rid in rids:
                    loop.abort(rid)
                return AsciiJSON({}, 499)  # nobody reads it
            results = everything.result()
        except GenerationFailed as e:
            for rid in rids:   # the other candidates too (aborting a finished request does nothing)
                loop.abort(rid)
            raise ApiError(e.status, str(e), "server_error" if e.status >= 500 else "invalid_request_error",
                           param=e.param) from e
        except asyncio.CancelledError:
            for rid in rids:
                loop.abort(rid)
            raise
        finally:
            gone.cancel()
        return responses.whole(rids[0], created, req, chat, results, answers,
                               best(results, req.n, len(results) // len(prompts)), prompts)

    return app


async def _client_gone(request: Request) -> None:
    """Returns once the client has disconnected."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
