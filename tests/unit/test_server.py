"""The router's HTTP protocol (router/api/server.py) on raw sockets, beside stock uvicorn.

Every test runs twice: against ``RouterHttpProtocol``, which answers the hot
routes from the parser, and against uvicorn's own httptools protocol serving
the same ``FastPath`` app through ASGI. Both must answer alike: keep-alive,
pipelining, ``Expect: 100-continue``, bodies over the limit (declared or
chunked), failing handlers, HTTP/1.0, ``Connection: close``, streams, and a
client that leaves mid-body.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from router.api.fastpath import FastPath, HotRoute
from router.api.http import Body, Headers, decode_request
from router.api.server import RouterHttpProtocol
from router.api.sse import StreamBody
from router.protocol.errors import InvalidRequest

LIMIT = 1000


async def _echo(headers: Headers, raw: bytes) -> Any:
    body = orjson.loads(await decode_request(headers, raw, LIMIT) or b"{}")
    if body.get("fail") == "api":
        raise InvalidRequest("told to fail", param="fail", code="invalid_value")
    if body.get("fail") == "bug":
        raise RuntimeError("a bug")
    if body.get("sleep"):
        await asyncio.sleep(body["sleep"])
    if body.get("stream"):
        async def chunks() -> Any:
            for i in range(body["stream"]):
                yield b"data: %d\n\n" % i
        return StreamBody(chunks(), headers={"x-kind": "stream"})
    return Body(orjson.dumps({"got": body, "bytes": len(raw)}), headers={"x-served": "hot"})


async def _plain(request: Request) -> PlainTextResponse:
    return PlainTextResponse("plain " + request.url.path)


class CountingFastPath(FastPath):
    """Counts the requests that reach the app through ASGI."""

    calls = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.calls += 1
        await super().__call__(scope, receive, send)


def _app() -> CountingFastPath:
    starlette = Starlette(routes=[Route("/plain", _plain), Route("/echo", _plain, methods=["POST"])])
    return CountingFastPath(starlette, {"/echo": HotRoute(_echo, LIMIT)})


class Served:
    """A uvicorn server with ``http`` protocol in a thread, on a free port."""

    def __init__(self, http: Any) -> None:
        self.app = _app()
        self.hot_in_protocol = http is RouterHttpProtocol
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, http=http, lifespan="off",
                                access_log=False, log_level="warning", loop="asyncio",
                                proxy_headers=False)  # as router/cli.py runs it
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


@pytest.fixture(params=["router", "uvicorn"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    with Served(RouterHttpProtocol if request.param == "router" else "httptools") as s:
        yield s


def _post(body: bytes, *, path: str = "/echo", extra: str = "", version: str = "1.1") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


class Reader:
    """Reads HTTP/1.1 answers (content-length or chunked) off a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _more(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def _until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            assert self._more(), f"closed before {marker!r}; have {self.buf!r}"
        head, self.buf = self.buf.split(marker, 1)
        return head

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            assert self._more(), "closed mid-body"
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        head = self._until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(head[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size = int(self._until(b"\r\n"), 16)
                chunk = self._exactly(size + 2)[:-2]
                if size == 0:
                    break
                body += chunk
        else:
            body = self._exactly(int(headers.get("content-length", "0")))
        return status, headers, body

    def closed(self) -> bool:
        self.sock.settimeout(5)
        return not self.buf and not self._more()


def _json(body: bytes) -> dict[str, Any]:
    return orjson.loads(body)


def test_keep_alive_serves_many_requests_on_one_connection(served: Served) -> None:
    with served.connect() as sock:
        reader = Reader(sock)
        for i in range(5):
            sock.sendall(_post(orjson.dumps({"i": i})))
            status, headers, body = reader.answer()
            assert status == 200 and _json(body)["got"] == {"i": i}
            assert headers["content-type"] == "application/json" and headers["x-served"] == "hot"
            assert "date" in headers and "connection" not in headers
        # Our protocol answered those from the parser; stock uvicorn went through the ASGI app.
        assert served.app.calls == (0 if served.hot_in_protocol else 5)
        sock.sendall(b"GET /plain HTTP/1.1\r\nHost: t\r\n\r\n")  # a route that is not hot, same connection
        assert reader.answer()[2] == b"plain /plain"
        assert served.app.calls == (1 if served.hot_in_protocol else 6)


def test_pipelined_requests_are_answered_in_order(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(_post(b'{"sleep": 0.1, "n": 1}') + _post(b'{"n": 2}') + b"GET /plain HTTP/1.1\r\nHost: t\r\n\r\n"
                     + _post(b'{"n": 4}'))
        reader = Reader(sock)
        assert _json(reader.answer()[2])["got"] == {"sleep": 0.1, "n": 1}
        assert _json(reader.answer()[2])["got"] == {"n": 2}
        assert reader.answer()[2] == b"plain /plain"
        assert _json(reader.answer()[2])["got"] == {"n": 4}


def test_expect_100_continue_is_answered_before_the_body_is_sent(served: Served) -> None:
    body = b'{"x": 1}'
    with served.connect() as sock:
        sock.sendall(_post(b"", extra="Expect: 100-continue\r\n").replace(b"Content-Length: 0", b"Content-Length: 8"))
        reader = Reader(sock)
        assert reader._until(b"\r\n\r\n") == b"HTTP/1.1 100 Continue"
        sock.sendall(body)
        status, _, answer = reader.answer()
        assert status == 200 and _json(answer)["got"] == {"x": 1}


def test_a_declared_body_over_the_limit_is_refused_and_the_connection_goes_on(served: Served) -> None:
    big = b'{"pad": "' + b"x" * LIMIT + b'"}'
    with served.connect() as sock:
        reader = Reader(sock)
        sock.sendall(_post(big))
        status, headers, body = reader.answer()
        assert status == 413 and _json(body)["error"]["code"] == "request_too_large"
        assert _json(body)["error"]["type"] == "invalid_request_error" and "connection" not in headers
        sock.sendall(_post(b'{"after": 1}'))  # the big body was read and dropped
        status, _, body = reader.answer()
        assert status == 200 and _json(body)["got"] == {"after": 1}


def test_a_client_waiting_for_100_continue_with_too_large_a_body_is_refused_and_closed(served: Served) -> None:
    """It may never send the body the server would have to read past: no 100, a 413, and a close."""
    with served.connect() as sock:
        reader = Reader(sock)
        sock.sendall(f"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: {LIMIT + 1}\r\n"
                     "Expect: 100-continue\r\n\r\n".encode())
        status, headers, body = reader.answer()
        assert status == 413 and headers["connection"] == "close"
        assert _json(body)["error"]["code"] == "request_too_large" and reader.closed()


def test_a_body_over_the_limit_sent_with_connection_close_gets_its_answer_not_a_reset() -> None:
    """The 413 goes out before the body is read; closing then, with the body's bytes unread,
    makes the kernel reset the connection, and the client never reads the answer (urllib,
    which sends ``Connection: close``, saw a reset). The rest of the body is read first.

    The router's protocol only: uvicorn's own closes at once (the ``uvicorn`` variant of the
    other tests, the FastPath app under uvicorn's protocol, gets the reset here)."""
    big = b'{"pad": "' + b"x" * (8 << 20) + b'"}'  # far more than the sockets' buffers hold
    with Served(RouterHttpProtocol) as served:
        # The hot route, declared and chunked; the same route the ASGI way (a query string),
        # where uvicorn's own cycle answers and closes; a route that answers without reading.
        for how, path, status_wanted in (("declared", "/echo", 413), ("chunked", "/echo", 413),
                                         ("declared", "/echo?x=1", 413), ("declared", "/plain", 405)):
            with served.connect() as sock:
                reader = Reader(sock)
                if how == "declared":
                    sock.sendall(_post(big, path=path, extra="Connection: close\r\n"))
                else:
                    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n")
                    for start in range(0, len(big), 1 << 16):
                        piece = big[start:start + (1 << 16)]
                        sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                    sock.sendall(b"0\r\n\r\n")
                status, headers, body = reader.answer()
                assert (status, headers["connection"]) == (status_wanted, "close"), (how, path, status, headers)
                assert status == 405 or _json(body)["error"]["code"] == "request_too_large"
                assert reader.closed()
        with served.connect() as sock:  # and the server goes on serving
            sock.sendall(_post(b'{"after": 3}'))
            assert _json(Reader(sock).answer()[2])["got"] == {"after": 3}


def test_a_chunked_body_over_the_limit_is_refused(served: Served) -> None:
    chunk = b"x" * 400
    with served.connect() as sock:
        reader = Reader(sock)
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3)) + b"0\r\n\r\n")
        status, _, body = reader.answer()
        assert status == 413 and _json(body)["error"]["code"] == "request_too_large"
        sock.sendall(_post(b'{"after": 2}'))
        assert _json(reader.answer()[2])["got"] == {"after": 2}


def test_a_chunked_body_under_the_limit_is_read_whole(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"4\r\n{\"a\"\r\n3\r\n: 1\r\n1\r\n}\r\n0\r\n\r\n")
        status, _, body = Reader(sock).answer()
        assert status == 200 and _json(body) == {"got": {"a": 1}, "bytes": 8}


def test_failing_handlers_answer_in_the_openai_error_shape(served: Served) -> None:
    with served.connect() as sock:
        reader = Reader(sock)
        sock.sendall(_post(b'{"fail": "api"}'))
        status, _, body = reader.answer()
        assert status == 400 and _json(body)["error"] == {"message": "told to fail", "type": "invalid_request_error",
                                                          "param": "fail", "code": "invalid_value"}
        sock.sendall(_post(b'{"fail": "bug"}'))
        status, _, body = reader.answer()
        assert status == 500 and _json(body)["error"]["code"] == "internal_error"
        sock.sendall(_post(b'{"ok": 1}'))  # the connection survives both
        assert reader.answer()[0] == 200


def test_http_1_0_and_connection_close_end_the_connection(served: Served) -> None:
    for request in (_post(b'{"v": 0}', version="1.0"), _post(b'{"v": 1}', extra="Connection: close\r\n")):
        with served.connect() as sock:
            sock.sendall(request)
            reader = Reader(sock)
            status, headers, body = reader.answer()
            assert status == 200 and headers.get("connection") == "close" and "v" in _json(body)["got"]
            assert reader.closed()


def test_a_hot_route_can_answer_with_a_stream(served: Served) -> None:
    with served.connect() as sock:
        reader = Reader(sock)
        sock.sendall(_post(b'{"stream": 50}'))
        status, headers, body = reader.answer()
        assert status == 200 and headers["content-type"] == "text/event-stream" and headers["x-kind"] == "stream"
        assert body == b"".join(b"data: %d\n\n" % i for i in range(50))
        sock.sendall(_post(b'{"after": 3}'))  # keep-alive after a stream
        assert _json(reader.answer()[2])["got"] == {"after": 3}


def test_pipelined_streams_are_answered_in_order_each_with_its_own_chunks(served: Served) -> None:
    """The second request is parsed before the first stream starts: each stream's chunks still
    go to its own answer (a chunk writer is bound to its request, not the connection's latest)."""
    with served.connect() as sock:
        sock.sendall(_post(b'{"stream": 30}') + _post(b'{"stream": 20}') + _post(b'{"n": 3}'))
        reader = Reader(sock)
        assert reader.answer()[2] == b"".join(b"data: %d\n\n" % i for i in range(30))
        assert reader.answer()[2] == b"".join(b"data: %d\n\n" % i for i in range(20))
        assert _json(reader.answer()[2])["got"] == {"n": 3}


def test_a_query_string_or_other_method_is_served_the_asgi_way(served: Served) -> None:
    with served.connect() as sock:
        reader = Reader(sock)
        sock.sendall(_post(b'{"q": 1}', path="/echo?x=1"))
        status, _, body = reader.answer()
        assert status == 200 and _json(body)["got"] == {"q": 1}
        sock.sendall(b"PUT /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
        assert reader.answer()[0] == 405


def test_a_client_that_leaves_mid_body_does_not_hurt_the_next(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(_post(b'{"x": "' + b"y" * 500 + b'"}')[:-200])
    with served.connect() as sock:
        sock.sendall(_post(b'{"sleep": 0.05}'))
    with served.connect() as sock:  # left while its answer was being made
        sock.sendall(_post(b'{"next": 1}'))
        status, _, body = Reader(sock).answer()
        assert status == 200 and _json(body)["got"] == {"next": 1}


def test_start_up_names_what_uvicorn_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one adapter to uvicorn's internals checks them: the installed version passes, and one
    without a method the protocol overrides stops start-up with one line naming it."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base

    from router.api.server import require_uvicorn

    require_uvicorn()
    monkeypatch.delattr(Base, "_start_asgi_task")
    with pytest.raises(RuntimeError) as caught:
        require_uvicorn()
    message = str(caught.value)
    assert "\n" not in message and "HttpToolsProtocol._start_asgi_task" in message and uvicorn.__version__ in message
