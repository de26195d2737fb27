"""What a reverse proxy would otherwise enforce on each connection, before any request is parsed:
a size limit on a request's head (request line + headers) and a time limit for it to arrive.

uvicorn takes a head of any size (3 MB headers were accepted) and waits for one as long as the
client trickles bytes. `guarded_protocol` wraps uvicorn's HTTP protocol class (httptools where it is
installed, else h11, as uvicorn's "auto" picks) so that:

    connection open, or the first byte of a later request's head
        |-- the header timer runs; the head's bytes are counted (the parser says where a head
        |   begins and ends: httptools' message-begin and headers-complete callbacks, h11's state)
        |       more than max_header_bytes -> 431 and close
        |       timer fires first           -> 408 and close
        '-- head complete: timer off; the body and the response as uvicorn does them

A count is of whole reads taken while a head is open, plus each header's own bytes as the parser
hands it over, so a head is refused within one read of the limit. The request body's own limit
stays in the ASGI guard (server/limits.py).
"""

from __future__ import annotations

import json

from tandem.server.protocol import error_body

REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
DRAIN_S, DRAIN_BYTES = 2.0, 16 << 20     # after a refusal: how long, and how much, is read and dropped


def _base_protocol(prefer: str = "httptools"):
    """uvicorn's protocol class and a function telling whether a request head is being read:
    httptools' where it is installed and preferred, else h11's."""
    try:
        if prefer != "httptools":
            raise ImportError(prefer)
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        import h11
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol, lambda self: self.conn.their_state is h11.IDLE
    return HttpToolsProtocol, lambda self: self._head_open


def guarded_protocol(max_header_bytes: int, header_timeout_s: float, prefer: str = "httptools"):
    """A uvicorn HTTP protocol class (pass as uvicorn.Config(http=...)) enforcing both limits, over
    httptools (where installed) or h11 (`prefer="h11"`, or without httptools)."""
    base, reading_head = _base_protocol(prefer)

    class GuardedProtocol(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_open, self._head_bytes, self._refused, self._dropped = True, 0, False, 0
            self._too_big = False       # a head over the limit, refused once the parser has returned
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_too_slow)

        def data_received(self, data: bytes) -> None:
            if self._refused:       # read and dropped, so that closing sends no reset ahead of the answer
                self._dropped += len(data)
                if self._dropped > DRAIN_BYTES:
                    self.transport.close()
                return
            if reading_head(self):
                self._count(len(data))
            if not self._too_big:
                super().data_received(data)
            if self._too_big:
                return self._refuse(431, f"the request's headers exceed {max_header_bytes} bytes; send smaller "
                                         "headers (the server's --max-header-bytes)")
            if self._refused:
                return
            if reading_head(self):      # a head began in (or still runs past) this read
                if self._head_timer is None:
                    self._head_timer = self.loop.call_later(header_timeout_s, self._head_too_slow)
            else:
                self._cancel_head_timer()
                self._head_bytes = 0

        # httptools' callbacks (h11 has none: its state says where a head is)
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_open, self._head_bytes = True, 0

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)      # "name: value\r\n"
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._head_open = False
            if not self._too_big:       # (a refused head starts no request)
                super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._too_big:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self._too_big:
                super().on_message_complete()

        def connection_lost(self, exc) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def _count(self, size: int) -> None:
            self._head_bytes += size
            self._too_big |= self._head_bytes > max_header_bytes

        def _cancel_head_timer(self) -> None:
            if getattr(self, "_head_timer", None) is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if reading_head(self) and not self._refused and not self.transport.is_closing():
                self._refuse(408, f"the request's headers did not arrive within {header_timeout_s:g} s; send "
                                  "the whole request head at once (the server's --header-timeout)")

        def _refuse(self, status: int, message: str) -> None:
            """Answer, end the sending side, and drop what the client still sends for a while: closing
            at once with its bytes unread would reset the connection, and the client could lose the
            answer."""
            if self._refused:
                return
            self._refused = True
            self._cancel_head_timer()
            body = json.dumps(error_body(message, "invalid_request_error", status)).encode()
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                 b"connection: close\r\n\r\n" % (status, REASONS[status], len(body)) + body)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(DRAIN_S, self.transport.close)

    return GuardedProtocol
