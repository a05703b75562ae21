"""The router's HTTP protocol: uvicorn's httptools protocol, with the hot routes answered from the parser.

A hot route (router/api/fastpath.py) is a ``POST`` whose handler takes the raw
headers and the whole body. For one, this protocol collects the body itself
(refusing it with 413 as soon as it passes the route's limit), runs the
handler in a task, and writes a ``Body`` answer (head and body) in one write.
None of uvicorn's per-request ASGI machinery runs for it: no request-body
messages, no ``Request``, no ``send`` messages, no header checks per answer.
A stream answer (an ASGI app) runs through uvicorn's own cycle as any other.
Everything else (other routes, upgrades to WebSocket) is uvicorn's code.

Keep-alive, pipelining (a request that arrives while the previous answer is
still being made waits its turn), ``Expect: 100-continue``, client
disconnects and graceful shutdown behave as in uvicorn; tests/unit/test_server.py
checks each on a raw socket. One difference: a connection that closes after an
answer given before its request's body was all read (a 413) closes only once
that body is read (``RouterHttpProtocol._linger``), where uvicorn's close
makes a reset that loses the answer.

Stream chunks without the ASGI round trip: ``scope["extensions"]["router.chunk_writer"]``
takes the scope and an encoder and gives a writer for that streamed response: it
encodes an item, frames it as a chunk and writes it at once (~3 us per streamed
token less than an ASGI ``send``). It writes only while the response is
streaming, the client is there and the socket keeps up; otherwise it returns
False, encoding nothing, and the caller sends the item through ASGI, which
waits for the socket.

This module is the router's one adapter to uvicorn's internals (its httptools
protocol, request cycle and sans-I/O WebSocket protocol): ``pyproject.toml``
pins uvicorn to the versions it was tested on, and ``require_uvicorn()`` stops
start-up in one line when what it uses is missing.

Every connection is held to the deadlines and the cap of router/api/connections.py:
a request's head and body must arrive in time, and past ``max_connections`` the
connection that has waited longest for its client makes room.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httptools
import uvicorn
from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from router import telemetry
from router.api import access
from router.api.coalesce import HeadHoldingTransport
from router.api.connections import ConnectionGuard, ConnectionLimits, Phase, refusal
from router.api.fastpath import HotRoute, answer, refused_body, watch_client
from router.api.http import Body, declared_length, error_body, too_large
from router.protocol.errors import APIError, internal_error
from router.protocol.ids import request_id

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# How long the rest of a refused body is read, at most, before a ``Connection: close`` answer's
# connection closes anyway (nginx's lingering_time is 30 s too). A pause of more than the
# keep-alive timeout (``[server] keep_alive_s``) in the client's sending ends it sooner.
LINGER_S = 30.0
# A connection refused past the cap gets its 503 at once and is closed this much later (its
# request, arriving meanwhile, is read and dropped, so the close does not reset the answer away).
REFUSED_LINGER_S = 1.0


class LingeringTransport(HeadHoldingTransport):
    """The protocol's transport: ``close()`` asks ``linger`` first (``RouterHttpProtocol._linger``)."""

    __slots__ = ("linger",)

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 linger: Callable[[], bool]) -> None:
        super().__init__(transport, loop)
        self.linger: Callable[[], bool] | None = linger

    def close(self) -> None:
        if self.linger is None or not self.linger():
            super().close()


class RouterHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through a HeadHoldingTransport, with hot routes."""

    limits = ConnectionLimits()  # the server's own, set by ``with_limits``
    # uvicorn assigns these without declaring them: its parser is None only once the connection is
    # lost, and its app is the config's loaded app, an ASGI 3 one by then (uvicorn wraps the others).
    parser: httptools.HttpRequestParser
    app: ASGI3Application

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[RouterHttpProtocol]:
        """The protocol class a server with these deadlines and this cap gives uvicorn."""
        return type(cls.__name__, (cls,), {"limits": limits})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Looked up by the request target's exact bytes: a query string, or any other
        # spelling of the path, goes the ASGI way (where the same handler answers).
        self.hot: dict[bytes, HotRoute] = getattr(self.app, "hot_by_target", None) or {}
        state = self.server_state  # one guard per server, shared by its connections
        guard = getattr(state, "connection_guard", None)
        if guard is None:
            guard = state.connection_guard = ConnectionGuard(self.limits)  # type: ignore[attr-defined]
        self.guard: ConnectionGuard = guard
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.raw = transport  # the socket's own transport, for stream chunks
        self._lingering: asyncio.TimerHandle | None = None
        self._shutting_down = False
        admitted = self.guard.admit(len(self.connections))
        super().connection_made(LingeringTransport(transport, self.loop, self._linger))  # type: ignore[arg-type]
        if admitted:
            self.guard.expect(self, "head", self.loop)
        else:
            self._refuse()

    def _refuse(self) -> None:
        """Past the cap with every connection busy: 503 now, the connection closed soon after."""
        self._refused = True
        cap = self.guard.limits.max_connections
        error = APIError(f"The router has too many open connections ({cap}); try again shortly.", status=503,
                         code="too_many_connections")
        access.log.debug("connection refused: 503 too_many_connections (cap %d)", cap)
        self.raw.write(refusal(error, self.server_state.default_headers))
        if self.raw.can_write_eof():
            self.raw.write_eof()
        self.loop.call_later(REFUSED_LINGER_S, self.raw.close)

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def read_timed_out(self, phase: Phase) -> None:
        """The guard's deadline for this request's head or body passed: 408, and the connection closes."""
        cycle = self.cycle
        if self.flow.read_paused or (phase == "body" and cycle is not None and cycle.waiting_for_100_continue):
            self.guard.expect(self, phase, self.loop)  # the router, not the client, holds the reading: a new term
            return
        if phase == "head" and cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False  # the answer being made on this connection closes it when it is done
            return
        limit = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
        what = "head" if phase == "head" else "body"
        self._end(phase, APIError(f"The request's {what} did not arrive within {limit:g} s.", status=408,
                                  type="invalid_request_error", code="request_timeout"))

    def evict(self, phase: Phase) -> None:
        """Make room past the cap: this connection waited longest for its client."""
        self._end(phase, APIError("The router has too many open connections and closed this one, which "
                                  "waited longest for its request.", status=503, code="too_many_connections"))

    def _end(self, phase: Phase, error: APIError) -> None:
        """Close now, with ``error`` as the answer when the request waited for has none yet. Not a
        request's access line (none came, or not all of it): a debug line, so a flood of stalled
        connections cannot flood the log."""
        access.log.debug("connection closed waiting for a request's %s: %d %s", phase, error.status, error.code)
        cycle = self.cycle
        if phase == "head":
            answer_now = cycle is None or cycle.response_complete
        else:
            answer_now = phase == "body" and cycle is not None and not cycle.response_started
        if answer_now:
            self.transport.write_chunk(refusal(error, self.server_state.default_headers))  # type: ignore[attr-defined]
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # a handler reading the body gets a disconnect; its answer goes nowhere
            cycle.message_event.set()
        self.transport.linger = None  # type: ignore[attr-defined]  # a close now is a close now
        self.transport.close()

    def handle_websocket_upgrade(self) -> None:
        self.guard.served(self)  # the WebSocket protocol keeps its own time
        super().handle_websocket_upgrade()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.timeout_keep_alive_task is not None and self.guard.phase(self) is None:
            self.guard.expect(self, "idle", self.loop)  # kept alive: first in line to make room past the cap

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.served(self)
        self.transport.linger = None  # type: ignore[attr-defined]  # the protocol <-> transport cycle ends here
        if self._lingering is not None:
            self._lingering.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        self._shutting_down = True  # a close now is a close now
        super().shutdown()

    def _linger(self) -> bool:
        """Whether to put off a close: when an answer that ends the connection came
        before its request's body was all read (a 413, a 401 on an upload).

        Closing with the body's bytes unread makes the kernel reset the connection,
        and a client still sending (urllib sends ``Connection: close``) gets the
        reset instead of the answer. So the rest of the body is read and dropped,
        and the close comes at its end, or after ``LINGER_S`` (a pause longer than
        the keep-alive timeout ends it sooner). A client waiting for ``100 Continue``
        may never send the body: closed at once, as is every other close.
        """
        cycle = self.cycle
        if (self._lingering is not None or self._shutting_down or cycle is None or not cycle.response_complete
                or not cycle.more_body or cycle.waiting_for_100_continue):
            return False
        self._lingering = self.loop.call_later(LINGER_S, self._close_now)
        return True

    def _close_now(self) -> None:
        """The close put off by ``_linger`` (which, once lingering, lets every close through)."""
        if self._lingering is not None:
            self._lingering.cancel()
        self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.guard.phase(self) != "head":  # after an idle keep-alive: the head's term starts with its first byte
            self.guard.expect(self, "head", self.loop)
        # ASGI types an extension's value as a dict; the router's own extensions: its writer, the request's id
        self.scope["extensions"] = {"router.chunk_writer": self.chunk_writer, "router.request_id": request_id()}  # type: ignore[dict-item]

    def on_headers_complete(self) -> None:
        self.guard.expect(self, "body", self.loop)
        route = self.hot.get(self.url)
        parser = self.parser
        if route is None or parser.get_method() != b"POST" or parser.should_upgrade() or self.limit_concurrency:
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.scope is self.scope:  # this request's (an upgrade makes none)
                cycle.default_headers = [*cycle.default_headers, _request_id_header(self.scope)]
            return
        http_version = parser.get_http_version()
        scope = self.scope
        scope["method"] = "POST"
        if http_version != "1.1":
            scope["http_version"] = http_version
        scope["path"] = self.root_path + self.url.decode("ascii")
        scope["raw_path"] = self.root_path.encode("ascii") + self.url
        scope["query_string"] = b""
        cycle = HotCycle(self, route, self.cycle, keep_alive=http_version != "1.0" and parser.should_keep_alive())
        self.cycle = cycle
        if declared_length(self.headers) > route.max_body_bytes:
            cycle.too_large = True  # answered now; whatever body follows is read and dropped
            self._start_hot(cycle)
        elif self.expect_100_continue:
            cycle.waiting_for_100_continue = False
            self.transport.write_chunk(_CONTINUE)  # type: ignore[attr-defined]

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if type(cycle) is not HotCycle:
            super().on_body(body)
            return
        if cycle.started:
            return
        cycle.body += body
        if len(cycle.body) > cycle.route.max_body_bytes:
            cycle.too_large = True
            cycle.body = bytearray()
            self._start_hot(cycle)

    def on_message_complete(self) -> None:
        self.guard.served(self)
        cycle = self.cycle
        if type(cycle) is not HotCycle:
            super().on_message_complete()
            if self._lingering is not None:
                self._close_now()
            return
        cycle.more_body = False
        if self._lingering is not None:  # the body after an early answer is all read: the close resets nothing now
            self._close_now()
        elif not cycle.started:
            self._start_hot(cycle)

    def _start_hot(self, cycle: HotCycle) -> None:
        """Run now, or after the answer being made on this connection (pipelining), as uvicorn does."""
        cycle.started = True
        previous, cycle.previous = cycle.previous, None
        if previous is None or previous.response_complete:
            self._start_asgi_task(cycle, self.app)
        else:
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, self.app))

    def chunk_writer(self, scope: dict[str, Any], encode: Callable[[Any], bytes]) -> Callable[[Any], bool] | None:
        """A writer of the stream items of ``scope``'s response: each encoded and written now as
        one chunk (True), or left alone (False: send it through ASGI). None when ``scope`` is
        not the current request's (a pipelined request already parsed): send everything then.

        Called once per streamed token, so it holds what it checks (this request's cycle,
        the socket's own transport) and checks the fewest things that say "streaming,
        client there, socket keeping up" (``chunked_encoding`` is set only once the head
        went out; ``write_paused`` once the socket's transport holds more than its high-water
        mark, 64 KiB). The frame goes to the socket's own transport unless a head is still held.
        """
        cycle, raw, holder = self.cycle, self.raw, self.transport
        if cycle is None or cycle.scope is not scope:
            return None
        flow = cycle.flow

        def write(item: Any) -> bool:
            if not cycle.chunked_encoding or cycle.response_complete or cycle.disconnected or flow.write_paused:
                return False
            data = encode(item)
            if data:
                frame = b"%x\r\n%s\r\n" % (len(data), data)
                if holder.held is None:  # type: ignore[attr-defined]
                    raw.write(frame)
                else:
                    holder.write(frame)
            return True

        return write


class HotCycle(RequestResponseCycle):
    """One hot-route request: its body collected by the protocol, its answer made by the route's handler."""

    def __init__(self, protocol: RouterHttpProtocol, route: HotRoute, previous: RequestResponseCycle | None,
                 keep_alive: bool) -> None:
        super().__init__(
            scope=protocol.scope, transport=protocol.transport, flow=protocol.flow, logger=protocol.logger,
            access_logger=protocol.access_logger, access_log=protocol.access_log,
            default_headers=[*protocol.server_state.default_headers, _request_id_header(protocol.scope)],
            message_event=asyncio.Event(),
            expect_100_continue=protocol.expect_100_continue, keep_alive=keep_alive,
            on_response=protocol.on_response_complete,
        )
        self.route = route
        self.previous = previous  # the cycle before it on this connection, until this one starts
        self.started = False
        self.too_large = False

    async def run_asgi(self, app: Any) -> None:
        """The handler's answer: a Body written here, a stream run through uvicorn's cycle. Its
        access line is written once the answer has ended (router/api/access.py). One coroutine
        for all of it: each more is ~2k instructions of every request."""
        scope: Any = self.scope  # uvicorn types its extensions' values as dicts; the router's id is a str
        rid = scope["extensions"]["router.request_id"]
        record = access.begin("POST", scope["path"], rid)
        watch_client(self._gone)
        with telemetry.request_span("POST", scope["path"], scope["headers"], rid):
            try:
                if self.too_large:
                    # uvicorn types scope["headers"] as an iterable; its httptools protocol makes it a list
                    response: Any = refused_body(too_large(self.route.max_body_bytes), scope["headers"])
                else:
                    body, self.body = bytes(self.body), bytearray()
                    response = await answer(self.route, scope["path"], scope["headers"], body)
                if type(response) is not Body:
                    self.message_event.set()  # the stream's first receive(): the (already read, empty) body
                    await super().run_asgi(response)
                    return
                self._write(response)
            except BaseException as exc:  # as uvicorn does when an app fails: log, 500 if nothing was sent yet
                self.logger.error("Exception in ASGI application\n", exc_info=exc)
                if self.response_started:
                    self.transport.close()
                else:
                    self.keep_alive = False
                    self._write(error_body(internal_error()))
            finally:
                self.on_response = lambda: None
                if self.disconnected and not self.response_complete:
                    record.error = record.error or "client_disconnected"
                access.end(record)

    def _gone(self) -> bool:
        return self.disconnected

    def _write(self, response: Body) -> None:
        """Head and body in one write (the base class's ``send`` does two and checks each header)."""
        if self.disconnected:
            return
        self.response_started = True
        record = access.current()
        if record is not None:
            record.answered(response.status_code)
        parts = [STATUS_LINE[response.status_code]]
        for name, raw in self.default_headers:  # date and server, as uvicorn sends them
            parts += (name, b": ", raw, b"\r\n")
        parts += (b"content-type: ", response.content_type.encode("latin-1"), b"\r\ncontent-length: ",
                  b"%d" % len(response.body), b"\r\n")
        extra = response.headers
        if extra:
            key = tuple(extra.items())
            lines = _HEADER_LINES.get(key)
            if lines is None:
                lines, connection = _header_lines(extra)
                if connection is not None:  # the answer's own say on the connection: not cached
                    self.keep_alive = self.keep_alive and connection != "close"
                else:
                    if len(_HEADER_LINES) >= 1024:
                        _HEADER_LINES.clear()
                    _HEADER_LINES[key] = lines
            parts.append(lines)
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts += (b"\r\n", response.body)
        self.transport.write_chunk(b"".join(parts))  # type: ignore[attr-defined]
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()


# The header lines of the extra headers answers carry (the x-router-* names of where a request was
# served: a few per pool, arm and worker), rendered once: rendering each was ~3% of a passthrough.
_HEADER_LINES: dict[tuple[tuple[str, str], ...], bytes] = {}


def _header_lines(headers: dict[str, str]) -> tuple[bytes, str | None]:
    """The headers' lines, and the value of ``connection`` (lowered) when they name it: that one is
    not written (the server says ``connection: close`` itself when it closes). A value with a line
    break raises: no value from config may split a head."""
    lines = []
    connection = None
    for key, value in headers.items():
        if "\r" in value or "\n" in value:
            raise ValueError(f"header {key!r} has a line break")
        if key.lower() == "connection":
            connection = value.lower()
            continue
        lines.append(b"%s: %s\r\n" % (key.lower().encode("latin-1"), value.encode("latin-1")))
    return b"".join(lines), connection


def _request_id_header(scope: Any) -> tuple[bytes, bytes]:
    """``x-request-id``, new for every request, as OpenAI sends it: the SDK's ``_request_id``,
    what a user quotes when something went wrong (and what its access line names)."""
    return b"x-request-id", scope["extensions"]["router.request_id"].encode("ascii")


class RouterWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol, without an ERROR line for every refused upgrade.

    A WebSocket the router refuses (no key, a wrong one) gets the HTTP error itself
    as a denial response (router/api/websocket.py). uvicorn's sans-I/O protocol
    sends it, but its ``run_asgi`` then checks only ``handshake_complete``, which a
    denial never sets, and logs "ASGI callable returned without completing
    handshake." at ERROR: anyone could fill the router's log by knocking. Here a
    denial whose body has gone out counts as an answered handshake.
    """

    async def send(self, message: Any) -> None:
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            self.handshake_complete = True  # answered (refused): nothing is left to complete


# What of uvicorn's internals the classes above use: methods (looked up on the classes) and
# instance attributes (set in their __init__).
_NEEDED = {
    HttpToolsProtocol: ("connection_made", "connection_lost", "data_received", "on_message_begin",
                        "on_headers_complete", "on_body", "on_message_complete", "on_response_complete",
                        "handle_websocket_upgrade", "shutdown", "_start_asgi_task"),
    RequestResponseCycle: ("run_asgi", "send", "receive"),
    WebSocketsSansIOProtocol: ("send",),
}
_NEEDED_STATE: dict[type[Any], tuple[str, ...]] = {
    HttpToolsProtocol: ("self.pipeline", "self.timeout_keep_alive_task", "self.limit_concurrency", "self.connections",
                        "self.server_state", "self.expect_100_continue", "self.cycle"),
    RequestResponseCycle: ("self.response_started", "self.response_complete", "self.chunked_encoding",
                           "self.disconnected", "self.more_body", "self.waiting_for_100_continue", "self.keep_alive",
                           "self.default_headers", "self.message_event", "self.on_response", "self.flow"),
}


def require_uvicorn() -> None:
    """Raise RuntimeError, one line, when the installed uvicorn lacks what this module uses."""
    import inspect

    missing = [f"{cls.__name__}.{name}" for cls, names in _NEEDED.items() for name in names if not hasattr(cls, name)]
    for cls, names in _NEEDED_STATE.items():
        source = inspect.getsource(cls.__init__)
        missing += [f"{cls.__name__}.{name[5:]}" for name in names if name not in source]
    if not isinstance(STATUS_LINE, dict) or 408 not in STATUS_LINE:
        missing.append("STATUS_LINE")
    if missing:
        raise RuntimeError(f"uvicorn {uvicorn.__version__} lacks what the router's HTTP protocol uses "
                           f"({', '.join(missing)}); install the version pyproject.toml names")
