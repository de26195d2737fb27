"""The OpenAI-compatible HTTP API. Handlers only translate: HTTP -> checked request -> the engine
loop -> OpenAI-shaped JSON or SSE chunks. Errors use the OpenAI error shape, always as JSON.

A request is checked completely when it arrives (pydantic's strict types, then
LLM.check_request: token ids, integer bounds, valid Unicode, lengths), so the engine thread
only ever sees requests it can run. A watchdog notices if the engine thread ends: /health and
/ready turn 503 and `on_fatal` is called (`tandem serve` then exits 1).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
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
from tandem.server.chat_template import ChatTemplate, ChatTemplateError
from tandem.server.engine_loop import EngineError, EngineLoop
from tandem.server.limits import RequestGuard
from tandem.server.logprobs_format import LogprobText
from tandem.server.protocol import ChatRequest, CompletionRequest, error_body, json_bytes, unknown_field
from tandem.server.tool_calls import AnswerParser, check_tools, message, template_messages, tool_choice_grammar

log = logging.getLogger("tandem.server")
DISCONNECT_POLL_S = 0.1    # how often a non-streamed request checks that its client is still there
WATCHDOG_S = 0.2           # how often the engine thread is checked


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

    def __post_init__(self):
        check_text(self.model_name, "the model name")  # e.g. undecodable bytes on the command line
        if self.max_queued < 0 or self.max_body_bytes < 0 or self.default_max_tokens < 1 or self.stream_interval < 1:
            raise ValueError("max_queued and max_body_bytes must be >= 0, default_max_tokens and stream_interval >= 1")


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
    loop = EngineLoop(llm, settings.max_queued)
    chat_template = ChatTemplate.from_engine_dir(llm.engine_dir)
    formats = chat_formats(llm.manifest)   # the family's tool-call and reasoning syntax (server/tool_calls.py)
    state = {"ready": False, "draining": False}
    shown = LogprobText(llm.tokenizer, llm.token_bytes)

    async def watchdog():
        while loop.alive():
            await asyncio.sleep(WATCHDOG_S)
        state["ready"] = False
        log.critical("the engine thread is not running (%r): failing the requests in flight and stopping",
                     loop.fatal)
        loop.fail_everything(f"engine error: the engine thread stopped ({loop.fatal!r}); the server is restarting")
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
    app.state.engine_loop = loop
    app.add_middleware(RequestGuard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)

    # ---- errors in the OpenAI shape ----------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return _error(exc.status, exc.message, exc.kind, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = _field_path(first.get("loc", ()))
        # 400 for every malformed body, as OpenAI and vLLM answer it
        return _error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", "invalid_request_error",
                      where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        log.exception("unexpected error in a handler")
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    # ---- health, readiness, models, metrics --------------------------------------------
    @app.get("/health")
    async def health():
        if not loop.alive():  # the process cannot serve; it is exiting for its supervisor to restart it
            return AsciiJSON({"status": "engine thread not running"}, 503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if not state["ready"] or not loop.alive():
            return AsciiJSON({"status": "not ready"}, 503)
        return {"status": "ready", "model": settings.model_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "tandem", "max_model_len": llm.max_seq_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(m.REGISTRY).decode(), media_type=CONTENT_TYPE_LATEST)

    # ---- generation --------------------------------------------------------------------
    def check(req) -> None:
        try:
            req.check_text_fields()
        except ValueError as e:
            raise ApiError(400, str(e), param=getattr(e, "param", None)) from e
        if req.model != settings.model_name:
            raise ApiError(404, f"model '{req.model}' does not exist; this server serves '{settings.model_name}'",
                           "not_found_error", "model")
        if not settings.allow_extra_fields and (field := unknown_field(req)) is not None:
            raise ApiError(400, f"{field}: not a field of this endpoint; drop it (or start the server with "
                                "--allow-extra-fields to accept and ignore unknown fields)", param=field)
        if (refused := req.not_honoured()) is not None:
            raise ApiError(400, refused[1], param=refused[0])
        if state["draining"]:
            raise ApiError(503, "the server is shutting down", "server_error")
        if not loop.alive():
            raise ApiError(503, "the engine is not running; the server is restarting", "server_error")
        if loop.load() >= settings.max_queued:
            raise ApiError(429, f"too many requests in flight ({settings.max_queued}); retry shortly",
                           "rate_limit_error", headers={"Retry-After": "1"})

    async def start(prompt, req, grammar=None) -> tuple[str, asyncio.Queue]:
        try:
            params = req.sampling_params(settings.default_max_tokens)
            if grammar is not None:   # tool_choice required / named: the call's grammar
                if params.grammar is not None:
                    raise ApiError(400, f"tool_choice {req.tool_choice_value()!r} and {params.grammar.field} both "
                                        "constrain the output: send one of them", param="tool_choice")
                params = dataclasses.replace(params, grammar=grammar)
            checked = await asyncio.to_thread(llm.check_request, prompt, params)  # tokenizing may take a while
            return await loop.submit(checked.ids, params, settings.stream_interval if req.stream else None)
        except ValueError as e:
            raise ApiError(400, str(e), param=getattr(e, "param", None)) from e
        except EngineError as e:
            raise ApiError(500, str(e), "server_error") from e

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check(req)
        rid, out = await start(req.prompt, req)
        return await respond(request, rid, out, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        check(req)
        if chat_template is None:
            raise ApiError(400, "this model has no chat template (tokenizer_config.json); use /v1/completions")
        tools, choice = req.tool_dicts(), req.tool_choice_value()
        try:
            check_tools(formats.get("tool_calls"), tools, choice)
            prompt = chat_template.render(template_messages(req.messages), req.add_generation_prompt, tools,
                                          req.chat_template_kwargs)
            grammar = tool_choice_grammar(formats["tool_calls"], tools, choice, req.parallel_tool_calls) if tools \
                else None
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from e
        except ValueError as e:
            raise ApiError(400, str(e), param=getattr(e, "param", None)) from e
        answer = AnswerParser(formats, prompt, tools, parse_tools=choice != "none")
        rid, out = await start(prompt, req, grammar)
        return await respond(request, rid, out, req, chat=True, answer=answer)

    async def respond(request: Request, rid: str, out: asyncio.Queue, req, chat: bool,
                      answer: AnswerParser | None = None):
        created = int(time.time())
        if req.stream:
            return StreamingResponse(stream(rid, out, req, chat, created, answer), media_type="text/event-stream")
        text, finish, seq, scored = [], None, None, []
        gone = asyncio.create_task(_client_gone(request))
        try:
            while finish is None:
                get = asyncio.ensure_future(out.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():  # the client hung up: stop generating for it
                    get.cancel()
                    loop.abort(rid)
                    return AsciiJSON({}, 499)  # nobody reads it
                item = get.result()
                if isinstance(item, EngineError):
                    raise ApiError(500, str(item), "server_error")
                text.append(item.text)
                scored += item.logprobs or ()
                seq, finish = item.sequence, item.finish_reason if item.finished else None
        except asyncio.CancelledError:
            loop.abort(rid)
            raise
        finally:
            gone.cancel()
        usage = _usage(seq)
        body = "".join(text)
        if chat:
            msg = message(answer.feed(body) + answer.finish())
            finish = "tool_calls" if msg.get("tool_calls") and finish == "stop" else finish
            choice = {"index": 0, "message": msg, "logprobs": shown.chat(scored) if req.logprobs else None,
                      "finish_reason": finish}
            out = {"id": rid, "object": "chat.completion", "created": created, "model": settings.model_name,
                   "choices": [choice], "usage": usage}
            if req.prompt_logprobs is not None:     # vLLM: beside the choices in chat
                out["prompt_logprobs"] = shown.prompt_logprobs(seq.prompt, seq.prompt_logprobs)
            return out
        if req.echo:
            body = _echoed(llm, req, seq) + body
        logprobs = None
        if req.logprobs is not None:
            logprobs = shown.completion(scored, prompt=(seq.prompt, seq.prompt_logprobs) if req.echo else None)
            del logprobs["end"]
        choice = {"index": 0, "text": body, "logprobs": logprobs, "finish_reason": finish}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = shown.prompt_logprobs(seq.prompt, seq.prompt_logprobs)
        return {"id": rid, "object": "text_completion", "created": created, "model": settings.model_name,
                "choices": [choice], "usage": usage}

    async def stream(rid: str, out: asyncio.Queue, req, chat: bool, created: int, answer: AnswerParser | None):
        kind = "chat.completion.chunk" if chat else "text_completion"
        offset = 0      # completions: where the next token's text_offset starts
        extra = {}      # prompt_logprobs, on the first chunk after the prompt is scored

        def chunk(text: str | None, finish: str | None, first: bool = False, delta: dict | None = None,
                  scored: list | None = None, prompt: tuple | None = None) -> str:
            """`scored`: the logprobs of this chunk's tokens; `prompt`: the echoed prompt's ids and logprobs."""
            nonlocal offset
            if chat:
                delta = {"role": "assistant", "content": ""} if first else (delta or {})
                logprobs = shown.chat(scored) if req.logprobs and scored else None
                choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            else:
                logprobs = None
                if req.logprobs is not None and scored is not None:
                    logprobs = shown.completion(scored, offset, prompt)
                    offset = logprobs.pop("end")
                choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            body = {"id": rid, "object": kind, "created": created, "model": settings.model_name, "choices": [choice]}
            if "prompt_logprobs" in extra and not first:   # vLLM: in the choice (completions), beside them (chat)
                (body if chat else choice)["prompt_logprobs"] = extra.pop("prompt_logprobs")
            return f"data: {json.dumps(body)}\n\n"

        finished, echo = False, not chat and req.echo
        try:
            if chat:
                yield chunk(None, None, first=True)
            while True:
                item = await out.get()
                if isinstance(item, EngineError):
                    yield f"data: {json.dumps(error_body(str(item), 'server_error', 500))}\n\n"
                    break
                seq = item.sequence
                if req.prompt_logprobs is not None and "sent" not in extra:
                    extra.update(prompt_logprobs=shown.prompt_logprobs(seq.prompt, seq.prompt_logprobs), sent=True)
                if echo:   # the prompt first, with its logprobs
                    echo = False
                    yield chunk(_echoed(llm, req, seq), None, scored=[], prompt=(seq.prompt, seq.prompt_logprobs))
                if chat:   # reasoning, content and tool-call deltas (this output's logprobs on the first)
                    deltas = answer.feed(item.text) + (answer.finish() if item.finished else [])
                    if item.logprobs and req.logprobs and not deltas:
                        deltas = [{}]    # text the parser holds back: its tokens' logprobs still go now
                    for i, delta in enumerate(deltas):
                        yield chunk(None, None, delta=delta, scored=item.logprobs if i == 0 else None)
                    if item.finished:
                        stop = item.finish_reason
                        yield chunk(None, "tool_calls" if answer.calls and stop == "stop" else stop)
                elif item.text or item.finished or item.logprobs:
                    yield chunk(item.text, item.finish_reason if item.finished else None, scored=item.logprobs)
                if item.finished:
                    finished = True
                    if req.include_usage:
                        body = {"id": rid, "object": kind, "created": created, "model": settings.model_name,
                                "choices": [], "usage": _usage(seq)}
                        yield f"data: {json.dumps(body)}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the engine failed): free the request now
                loop.abort(rid)

    return app


async def _client_gone(request: Request) -> None:
    """Returns once the client has disconnected."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


def _field_path(loc) -> str:
    """pydantic's error location as a field path: ('body', 'messages', 0, 'content', 'str') ->
    'messages[0].content' (the union member tags such as 'str' or 'list[int]' dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "body" and part not in _UNION_TAGS and "[" not in part and not part[:1].isupper():
            out += f".{part}" if out else part
    return out


_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _echoed(llm: LLM, req, seq) -> str:
    """A completion's prompt as `echo` returns it: the text sent, or the token ids' text."""
    return req.prompt if isinstance(req.prompt, str) else llm.tokenizer.decode(seq.prompt)


def _usage(seq) -> dict:
    prompt, completion = len(seq.prompt), seq.num_generated
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "speculative": {"accept_length": round(seq.metrics.accept_length, 3), "verify_steps": seq.metrics.rounds}}
