"""What a reverse proxy would otherwise enforce on each connection, before any request is parsed:
a size limit on a request's head (request line + headers) and a time limit for it to arrive.

uvicorn takes a head of any size (3 MB headers were accepted) and waits for one as long as the
client trickles bytes. `guarded_protocol` wraps uvicorn's HTTP protocol class (httptools where it is
installed, else h11, as uvicorn's "auto" picks) so that:

    connection open / previous response done
        |-- first byte of a head: the header timer starts (at open: already running)
        |-- head bytes counted until the blank line that ends them
        |       more than max_header_bytes -> 431 and close
        |       timer fires first           -> 408 and close
        '-- blank line: timer off; the body and the response as uvicorn does them

The request body's own limit stays in the ASGI guard (server/limits.py).
"""

from __future__ import annotations

import json

from tandem.server.protocol import error_body

HEAD_END = b"\r\n\r\n"
REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
DRAIN_S, DRAIN_BYTES = 2.0, 16 << 20     # after a refusal: how long, and how much, is read and dropped


def _base_protocol():
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return base


def guarded_protocol(max_header_bytes: int, header_timeout_s: float):
    """A uvicorn HTTP protocol class (pass as uvicorn.Config(http=...)) enforcing both limits."""
    base = _base_protocol()

    class GuardedProtocol(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_bytes, self._in_head, self._tail = 0, True, b""
            self._refused, self._dropped = False, 0
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_too_slow)

        def data_received(self, data: bytes) -> None:
            if self._refused:       # read and dropped, so that closing sends no reset ahead of the answer
                self._dropped += len(data)
                if self._dropped > DRAIN_BYTES:
                    self.transport.close()
                return
            if self._in_head:
                if self._head_timer is None:
                    self._head_timer = self.loop.call_later(header_timeout_s, self._head_too_slow)
                end = (self._tail + data).find(HEAD_END)
                size = self._head_bytes + (len(data) if end < 0 else end + len(HEAD_END) - len(self._tail))
                if size > max_header_bytes:
                    return self._refuse(431, f"the request's headers exceed {max_header_bytes} bytes; send "
                                             "smaller headers (the server's --max-header-bytes)")
                if end < 0:
                    self._head_bytes, self._tail = size, (self._tail + data)[-(len(HEAD_END) - 1):]
                else:
                    self._in_head = False
                    self._cancel_head_timer()
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._head_bytes, self._in_head, self._tail = 0, True, b""   # the next request's head (keep-alive)

        def connection_lost(self, exc) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def _cancel_head_timer(self) -> None:
            if getattr(self, "_head_timer", None) is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if self._in_head and not self.transport.is_closing():
                self._refuse(408, f"the request's headers did not arrive within {header_timeout_s:g} s; send "
                                  "the whole request head at once (the server's --header-timeout)")

        def _refuse(self, status: int, message: str) -> None:
            """Answer, end the sending side, and drop what the client still sends for a while: closing
            at once with its bytes unread would reset the connection, and the client could lose the
            answer."""
            self._in_head, self._refused = False, True
            self._cancel_head_timer()
            body = json.dumps(error_body(message, "invalid_request_error", status)).encode()
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                 b"connection: close\r\n\r\n" % (status, REASONS[status], len(body)) + body)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(DRAIN_S, self.transport.close)

    return GuardedProtocol
