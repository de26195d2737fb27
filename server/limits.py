"""What every HTTP request passes before a handler sees it: the API key on `/v1/*`, `/tokenize` and
`/detokenize`, and the body
size limit. A plain ASGI middleware, so it sees the body as it streams:

    client --chunks--> guard: count bytes --(over the limit)--> 413, rest of the body discarded
                             \\--(complete, within)--> handler gets the buffered body, then the
                                                       real receive (so it sees a disconnect)

The limit holds with or without a Content-Length header (chunked transfer encoding has none).
"""

from __future__ import annotations

import hmac
import json

from tandem.server.protocol import error_body

# After answering 413, read (and drop) at most this many times the limit so that a client still
# sending its body gets to read the answer; past that the connection is closed.
DRAIN_FACTOR = 8


_KEYED = {"/tokenize", "/detokenize"}   # beside /v1/*: what needs the API key


class RequestGuard:
    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        keyed = scope["path"].startswith("/v1/") or scope["path"] in _KEYED
        if keyed and self.api_key and not self._authorized(scope):
            return await _reply(send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                "authentication_error")
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._too_large(receive, send, f"{declared} bytes", more_body=True)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body was complete: nobody to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                return await self._too_large(receive, send, f"more than {self.max_body_bytes} bytes",
                                             message.get("more_body", False))
            chunks.append(body)
            if not message.get("more_body", False):
                break
        if (refused := _not_json_text(b"".join(chunks))) is not None:
            return await _reply(send, 400, refused, "invalid_request_error")
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:  # the body is consumed: from now on the handler learns of a disconnect
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    def _authorized(self, scope) -> bool:
        header = _header(scope, b"authorization") or ""
        token = header[7:] if header.lower().startswith("bearer ") else ""
        return hmac.compare_digest(token.encode("latin-1"), self.api_key.encode())

    async def _too_large(self, receive, send, what: str, more_body: bool) -> None:
        await _reply(send, 413, f"request body of {what} exceeds the limit of {self.max_body_bytes} bytes; send a "
                                "smaller body (the server's --max-body-bytes)", "invalid_request_error")
        drained = 0
        while more_body and drained < DRAIN_FACTOR * self.max_body_bytes:
            message = await receive()
            if message["type"] != "http.request":
                break
            drained += len(message.get("body", b""))
            more_body = message.get("more_body", False)


def _not_json_text(body: bytes) -> str | None:
    """Why a request body is not JSON text as RFC 8259 has it, for what the JSON parser would let
    through: bytes that are not UTF-8 (it also reads UTF-16 and UTF-32) and NaN / Infinity (not JSON
    numbers). None for a body that is (or that the parser refuses by itself)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"the request body is not UTF-8 (byte {e.start}): send the JSON encoded as UTF-8"
    if "NaN" in text or "Infinity" in text:     # cheap test first: most bodies have neither
        def refuse(name):
            raise ValueError(name)
        try:
            json.loads(text, parse_constant=refuse)
        except ValueError as e:
            if str(e) in ("NaN", "Infinity", "-Infinity"):
                return f"the request body holds {e}, which is not a JSON number: send finite numbers"
    return None


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _reply(send, status: int, message: str, kind: str) -> None:
    body = json.dumps(error_body(message, kind, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
