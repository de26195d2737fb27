"""Connection limits a proxy would otherwise add (server/http_guard.py): a request head over
--max-header-bytes is a 431, one that trickles in (or never comes) a 408 after --header-timeout,
and the server keeps serving; heads of keep-alive requests are counted one by one."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from .test_server import Live

pytestmark = pytest.mark.slow

TIMEOUT_S = 1.0


@pytest.fixture(scope="module", params=["httptools", "h11"])
def live(engine_dirs, request):
    """A live server over each of uvicorn's HTTP parsers (h11: what a runtime-only install has)."""
    from tandem.server import http_guard

    real = http_guard.guarded_protocol
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(http_guard, "guarded_protocol", lambda *a: real(*a, prefer=request.param))
        mp.setattr("tandem.server.serve.guarded_protocol", http_guard.guarded_protocol)
        with Live(engine_dirs["qwen3_5_mtp3"], max_header_bytes=32 << 10, header_timeout_s=TIMEOUT_S) as server:
            base = server.server.config.http_protocol_class.__mro__[1].__name__
            assert base == {"httptools": "HttpToolsProtocol", "h11": "H11Protocol"}[request.param]
            yield server


def _answer(sock: socket.socket, wait_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(wait_s)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _status(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _connect(live) -> socket.socket:
    return socket.create_connection(("127.0.0.1", live.port))


def _completion_ok(live) -> bool:
    r = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2}, timeout=30)
    return r.status_code == 200


def test_a_huge_header_is_431(live):
    with _connect(live) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (3 << 20) + b"\r\n\r\n")
        status, body = _status(_answer(s))
    assert status == 431 and "--max-header-bytes" in body["error"]["message"]
    assert _completion_ok(live)


def test_a_head_split_over_many_packets_is_counted_whole(live):
    with _connect(live) as s:
        for _ in range(40):        # 40 x 1 KiB of headers: 40 KiB in all, each packet under the limit
            s.sendall(b"GET /health HTTP/1.1\r\n" if _ == 0 else b"X-Pad-%d: " % _ + b"b" * 1000 + b"\r\n")
        s.sendall(b"\r\n")
        status, _ = _status(_answer(s))
    assert status == 431


def test_a_trickled_head_is_cut_off_with_408(live):
    with _connect(live) as s:
        start = time.perf_counter()
        s.sendall(b"GET /health HTTP/1.1\r\n")
        for _ in range(30):        # a byte every 0.1 s: never a whole head within the timeout
            time.sleep(0.1)
            try:
                s.sendall(b"X")
            except OSError:
                break
        status, body = _status(_answer(s))
        took = time.perf_counter() - start
    assert status == 408 and "--header-timeout" in body["error"]["message"]
    assert TIMEOUT_S * 0.9 <= took <= TIMEOUT_S + 2.5
    with _connect(live) as s:       # a connection that sends nothing is closed too
        status, _ = _status(_answer(s))
    assert status == 408 and _completion_ok(live)


def test_keep_alive_requests_each_get_their_own_head_budget(live):
    """Three requests on one connection with 20 KiB of headers each (60 KiB over the connection, more
    than the 32 KiB limit), spaced by more than the header timeout: each is served."""
    with httpx.Client(base_url=live.url, timeout=30) as h:
        for _ in range(3):
            r = h.get("/health", headers={"x-pad": "c" * (20 << 10)})
            assert r.status_code == 200
            time.sleep(TIMEOUT_S * 1.2)
        assert h.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2}).status_code == 200


def test_a_body_sent_with_its_head_is_not_counted_as_head(live):
    """A 200 KiB body in the same writes as its head (more than the head limit): the head is small,
    so the request is answered by the endpoint (here a 400: the prompt is longer than the engines take)."""
    body = json.dumps({"model": "tiny", "prompt": "x" * (200 << 10), "max_tokens": 2}).encode()
    with _connect(live) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
        status, answer = _status(_answer(s))
    assert status == 400 and "prompt" in answer["error"]["message"]
