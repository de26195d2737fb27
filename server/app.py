"""The OpenAI-compatible HTTP API. Handlers only translate: HTTP -> SamplingParams -> the engine
loop -> OpenAI-shaped JSON or SSE chunks. Errors use the OpenAI error shape."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.pipeline.llm import LLM
from tandem.server import metrics as m
from tandem.server.chat_template import ChatTemplate, ChatTemplateError
from tandem.server.engine_loop import EngineError, EngineLoop
from tandem.server.protocol import ChatRequest, CompletionRequest, error_body


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_queued: int = 64
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers


def create_app(llm: LLM, settings: ServerSettings) -> FastAPI:
    loop = EngineLoop(llm, settings.max_queued)
    chat_template = ChatTemplate.from_engine_dir(llm.engine_dir)
    state = {"ready": False, "draining": False}

    async def lifespan(app):
        loop.start()
        state["ready"] = True
        yield
        state["draining"], state["ready"] = True, False   # SIGTERM: uvicorn stops taking connections,
        for _ in range(600):                                # finishes in-flight requests; we wait for them
            if loop.idle():
                break
            await asyncio.sleep(0.05)
        loop.stop()

    app = FastAPI(title="tandem", lifespan=lifespan)
    app.state.engine_loop = loop

    # ---- errors in the OpenAI shape ----------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return JSONResponse(error_body(exc.message, exc.kind, exc.status, exc.param), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        kind = first.get("type", "")
        status = 400 if kind in ("json_invalid", "model_attributes_type") else 422
        return JSONResponse(error_body(f"{where or 'body'}: {first.get('msg', 'invalid request')}",
                                       "invalid_request_error", status, where or None), status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", exc.status_code), exc.status_code)

    # ---- security: API key and body size -----------------------------------------------
    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if request.url.path.startswith("/v1/") and settings.api_key:
            header = request.headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), settings.api_key.encode()):
                return JSONResponse(error_body("missing or wrong API key: send 'Authorization: Bearer <key>'",
                                               "authentication_error", 401), 401)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            return JSONResponse(error_body(f"request body of {length} bytes exceeds the limit of "
                                           f"{settings.max_body_bytes} bytes", "invalid_request_error", 413), 413)
        return await call_next(request)

    # ---- health, readiness, models, metrics --------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if not state["ready"]:
            return JSONResponse({"status": "not ready"}, 503)
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
        if req.model != settings.model_name:
            raise ApiError(404, f"model '{req.model}' does not exist; this server serves '{settings.model_name}'",
                           "not_found_error", "model")
        if req.n != 1:
            raise ApiError(400, f"n={req.n} is not supported: tandem returns one choice per request (n=1)",
                           param="n")
        if state["draining"]:
            raise ApiError(503, "the server is shutting down", "server_error")
        if loop.load() >= settings.max_queued:
            raise ApiError(429, f"too many requests in flight ({settings.max_queued}); retry shortly",
                           "rate_limit_error", headers={"Retry-After": "1"})

    async def start(prompt, req) -> tuple[str, asyncio.Queue]:
        try:
            params = req.sampling_params(settings.default_max_tokens)
            return await loop.submit(prompt, params)
        except ValueError as e:
            raise ApiError(400, str(e)) from e

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
        messages = [{"role": msg.role, "content": msg.text()} for msg in req.messages]
        try:
            prompt = chat_template.render(messages, req.add_generation_prompt)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from e
        rid, out = await start(prompt, req)
        return await respond(request, rid, out, req, chat=True)

    async def respond(request: Request, rid: str, out: asyncio.Queue, req, chat: bool):
        created = int(time.time())
        if req.stream:
            return StreamingResponse(stream(request, rid, out, req, chat, created), media_type="text/event-stream")
        text, finish, seq = [], None, None
        try:
            while True:
                item = await out.get()
                if isinstance(item, EngineError):
                    raise ApiError(500, str(item), "server_error")
                text.append(item.text)
                seq = item.sequence
                if item.finished:
                    finish = item.finish_reason
                    break
        except asyncio.CancelledError:
            loop.abort(rid)
            raise
        usage = _usage(seq)
        body = "".join(text)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": body}, "finish_reason": finish}
            return {"id": rid, "object": "chat.completion", "created": created, "model": settings.model_name,
                    "choices": [choice], "usage": usage}
        if getattr(req, "echo", False) and isinstance(req.prompt, str):
            body = req.prompt + body
        choice = {"index": 0, "text": body, "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": "text_completion", "created": created, "model": settings.model_name,
                "choices": [choice], "usage": usage}

    async def stream(request: Request, rid: str, out: asyncio.Queue, req, chat: bool, created: int):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            body = {"id": rid, "object": kind, "created": created, "model": settings.model_name, "choices": [choice]}
            return f"data: {json.dumps(body)}\n\n"

        finished = False
        try:
            if chat:
                yield chunk(None, None, first=True)
            while True:
                item = await out.get()
                if isinstance(item, EngineError):
                    yield f"data: {json.dumps(error_body(str(item), 'server_error', 500))}\n\n"
                    break
                if item.text or item.finished:
                    yield chunk(item.text, item.finish_reason if item.finished else None)
                if item.finished:
                    finished = True
                    if req.include_usage:
                        body = {"id": rid, "object": kind, "created": created, "model": settings.model_name,
                                "choices": [], "usage": _usage(item.sequence)}
                        yield f"data: {json.dumps(body)}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the engine failed): free the request now
                loop.abort(rid)

    return app


def _usage(seq) -> dict:
    prompt, completion = len(seq.prompt), seq.num_generated
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "speculative": {"accept_length": round(seq.metrics.accept_length, 3), "verify_steps": seq.metrics.rounds}}
