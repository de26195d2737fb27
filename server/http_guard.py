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

Under h11 a head is what arrives between requests up to its blank line, counted before h11 buffers
it. httptools parses as it goes: there a head is measured two ways and the larger counts, the reads
that end with it still open (a read that completes it may carry a body too, so it is not counted
whole) and what the parser hands over (the url and each header). The request body's own limit
stays in the ASGI guard (server/limits.py).
"""

from __future__ import annotations

import json

from tandem.server.protocol import error_body

HEAD_END = b"\r\n\r\n"
REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
DRAIN_S, DRAIN_BYTES = 2.0, 16 << 20     # after a refusal: how long, and how much, is read and dropped


def _base_protocol(prefer: str = "httptools"):
    """uvicorn's protocol class, and whether its parser reports a head's pieces as it parses them
    (httptools' callbacks; h11 hands over a whole head at once)."""
    try:
        if prefer != "httptools":
            raise ImportError(prefer)
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol, False
    return HttpToolsProtocol, True


def guarded_protocol(max_header_bytes: int, header_timeout_s: float, prefer: str = "httptools"):
    """A uvicorn HTTP protocol class (pass as uvicorn.Config(http=...)) enforcing both limits, over
    httptools (where installed) or h11 (`prefer="h11"`, or without httptools)."""
    base, callbacks = _base_protocol(prefer)

    def reading_head(self) -> bool:
        if callbacks:
            return self._head_open
        import h11

        return self.conn.their_state is h11.IDLE    # between requests: what comes is a head

    class GuardedProtocol(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_open, self._refused, self._dropped = True, False, 0
            # the head's size two ways: the reads taken while it was open (a read that ends it is left to
            # the parser's count), and what the parser handed over (httptools: url and headers)
            self._read_bytes = self._parsed_bytes = 0
            self._tail = b""            # h11: the last bytes of the head so far (its end may straddle two reads)
            self._too_big = False       # a head over the limit, refused once the parser has returned
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_too_slow)

        def data_received(self, data: bytes) -> None:
            if self._refused:       # read and dropped, so that closing sends no reset ahead of the answer
                self._dropped += len(data)
                if self._dropped > DRAIN_BYTES:
                    self.transport.close()
                return
            if not callbacks and reading_head(self):     # h11: the head's bytes in this read, before h11 buffers them
                end = (self._tail + data).find(HEAD_END)
                self._read_bytes += len(data) if end < 0 else end + len(HEAD_END) - len(self._tail)
                self._tail = (self._tail + data)[-(len(HEAD_END) - 1):] if end < 0 else b""
                self._too_big |= self._read_bytes > max_header_bytes
            if not self._too_big:
                super().data_received(data)
            if callbacks and not self._refused and reading_head(self):    # the head goes on past this read
                self._read_bytes += len(data)
                self._too_big |= self._read_bytes > max_header_bytes
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
                self._read_bytes = self._parsed_bytes = 0
                self._tail = b""

        # httptools' callbacks (h11 has none: its state says where a head is)
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_open, self._parsed_bytes = True, 0

        def on_url(self, url: bytes) -> None:
            self._parsed(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._parsed(len(name) + len(value) + 4)      # "name: value\r\n"
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

        def _parsed(self, size: int) -> None:
            self._parsed_bytes += size
            self._too_big |= self._parsed_bytes > max_header_bytes

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
