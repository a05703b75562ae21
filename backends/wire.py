"""The hot worker calls on a lean HTTP/1.1 client: one asyncio.Protocol per keep-alive connection.

Why not aiohttp here: measured on this machine (bench/RESULTS.md), aiohttp
spends ~300-370 us of router CPU per proxied request and ~40 us per streamed
token, most of it in layers this router does not need (cookie jars, tracing
signals, a StreamReader per response, a timer per read). Here a request is one
prebuilt head plus the body in one write, httptools parses the answer, body
bytes land in a list the reader drains, and one watchdog timer per request
enforces the read timeout. The periodic GETs (health checks, metrics scrapes)
take it too: on aiohttp they were half of an idle router's CPU. The pools of
connections per worker and the request heads are ``Wire``, in
backends/wire_targets.py; this module is the connection itself.

Failures are typed like the rest of backends/client.py: no connection is
WorkerUnavailable; a connection lost or a read timeout after the request went
out is WorkerStreamBroken. A kept-alive connection that closes with nothing back
is WorkerIdleClosed: most likely the worker closed it as idle while the request
was on its way, so the caller may send it again (backends/calls.py counts that
call as failed, blaming no one); the worker's other idle connections are closed
with it, so the next call opens a new one. Idle connections are kept only for
IDLE_S, less than the worker's own keep-alive, so that race is rare.

TLS: an ``https://`` worker is spoken to over asyncio's TLS transport (port 443 unless the URL
says), with the pool's ``ssl.SSLContext`` (its CA bundle and client certificate) or, without one,
the system's trust store; the host name is checked against the certificate. A handshake that
fails (a certificate not trusted, a plain-HTTP server on the port) is WorkerUnavailable, with
a message that says so. Only the connect differs: the request path is the same for both.

Limits (``WireLimits``, per pool): an answer read whole stops at ``max_answer_bytes``
(a Content-Length above it is refused before any of the body is read) and a stream's
first body byte must come within ``first_byte_timeout_s`` (a hung worker fails the
call then, not after the read timeout); both are WorkerStreamBroken: WorkerAnswerTooLarge
and WorkerTimedOut.

Headers of the request being served (its ``x-request-id``, a trace's ``traceparent``) come
from the context: ``REQUEST_HEADERS``, set by the router for the task answering a client,
go into every worker request made in it.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass

import httptools

from backends.errors import WorkerAnswerTooLarge, WorkerStreamBroken, WorkerTimedOut, WorkerUnavailable

# Header lines ("name: value\r\n" each) sent with every worker request made in this context.
REQUEST_HEADERS: ContextVar[bytes] = ContextVar("worker_request_headers", default=b"")
HIGH_WATER = 1 << 20  # body bytes buffered before the socket stops being read
MAX_IDLE = 512  # idle connections kept per worker
# An idle connection is reused this long after its last answer, no longer: less than the 5 s
# for which uvicorn, and so vLLM and SGLang, keep an idle connection open.
IDLE_S = 4.0

# ``Connection.state``: how far its request got, in order. Plain ints, not an Enum: two are compared per read.
IDLE, SENT, RECEIVING, HEAD, BODY, DRAINING, COMPLETE = range(7)


@dataclass(frozen=True)
class WireLimits:
    """What one worker answer may take: its bytes, one stream frame's bytes, the wait for a stream's first byte."""

    max_answer_bytes: int = 64 << 20
    max_frame_bytes: int = 8 << 20
    first_byte_timeout_s: float | None = 60.0


class Connection(asyncio.Protocol):
    """One keep-alive connection; serves one request at a time.

    ``state`` moves forward only, while a request holds the connection; every transition is in this class:
    IDLE       no request holds it: new, kept alive, or let go     send -> SENT
    SENT       the request is written, nothing came back yet       bytes -> RECEIVING
    RECEIVING  bytes came, the head is not whole yet               head -> HEAD
    HEAD       the head is in: status, content type, length        body -> BODY; end -> COMPLETE
    BODY       body bytes came (the first-byte timeout is met)     end -> COMPLETE; finish(drain) -> DRAINING
    DRAINING   the reader is done ([DONE]); the rest comes unread  end -> COMPLETE, and it is finished
    COMPLETE   the whole answer is in, the reader still holds it   finish -> IDLE
    Letting go (``finish``, ``abort``) makes any state IDLE: kept alive after a complete answer, else closed.
    Bytes on a connection nobody holds move nothing. A failure (a bad answer, a timeout, a head too large) sets
    ``error`` and closes the socket, keeping the state: the reader reads what came before it, then lets go.
    Kept apart, as each goes with any state: ``closed``, ``paused``, ``keep_alive`` (said where they are set).
    """

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False  # the socket is gone, in any state: a worker may close after a complete answer, still read
        self.gen = 0  # which request holds the connection: a late finish() of an earlier one does nothing
        self.state = IDLE
        self._begin()

    def _begin(self) -> None:
        # Push mode (SSEStream.push): data_received hands body bytes to this at once, waking no reader task per read.
        self.sink: Callable[[bytes], None] | None = None
        self.status = 0
        self.content_type = "application/json"
        self.length = -1  # Content-Length, when the answer has one
        self.first_byte_by: float | None = None  # a stream's first body byte must come by then
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.keep_alive = False  # the answer's own, as its status: set with COMPLETE, read by finish
        self.error: BaseException | None = None
        self.paused = False  # reading stopped (flow control: a slow reader), whatever the state
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.last_read = 0.0

    # ---------------------------------------------------------------- protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP connection's: an asyncio.Transport

    def data_received(self, data: bytes) -> None:
        if self.state == SENT:
            self.state = RECEIVING
        self.last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(WorkerStreamBroken(f"{self.pool.origin}: bad HTTP answer: {exc}"))
            self._close()
            return
        sink = self.sink
        if sink is not None and self.chunks:
            chunks = self.chunks
            self.chunks = []
            self.buffered = 0
            sink(chunks[0] if len(chunks) == 1 else b"".join(chunks))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.state != IDLE and self.state != COMPLETE:
            self._fail(WorkerStreamBroken(f"{self.pool.origin}: the connection closed ({exc!r})"))

    def pause_writing(self) -> None:  # a request body bigger than the socket buffer: the kernel catches up
        pass

    def resume_writing(self) -> None:
        pass

    # ---------------------------------------------------------------- parser callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 12 and name.lower() == b"content-type":
            self.content_type = value.decode("latin-1")
        elif len(name) == 14 and name.lower() == b"content-length" and value.isdigit():
            self.length = int(value)

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if SENT <= self.state < HEAD:
            self.state = HEAD
        limit = self.pool.limits.max_answer_bytes
        if self.length > limit:
            self._fail(WorkerAnswerTooLarge(f"the answer's {self.length} bytes pass max_answer_bytes ({limit})"))
            self._close()
        self.wake()

    def on_body(self, body: bytes) -> None:
        if self.state == HEAD:
            self.state = BODY
        self.chunks.append(body)
        if self.sink is not None:
            return  # data_received hands the read to the sink once the parser is done with it
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused:
            self.pause()
        self.wake()

    def on_message_complete(self) -> None:
        state = self.state
        if state != IDLE:
            self.state = COMPLETE
        self.keep_alive = self.parser.should_keep_alive()  # only valid inside the callback
        if state == DRAINING:
            self.chunks = []
            self.finish(self.gen)
        self.wake()

    # ---------------------------------------------------------------- request side

    def send(self, data: bytes, first_byte_timeout_s: float | None = None) -> None:
        self._begin()
        self.gen += 1
        self.state = SENT
        self.last_read = now = self.loop.time()
        due = now + self.pool.read_timeout_s
        if first_byte_timeout_s is not None:
            self.first_byte_by = now + first_byte_timeout_s
            due = min(due, self.first_byte_by)
        self._timer = self.loop.call_at(due, self._watch)
        assert self.transport is not None
        self.transport.write(data)

    def _watch(self) -> None:
        """The read timeout, checked coarsely: one timer per request, re-armed, not one per read."""
        if self.state == IDLE or self.state == COMPLETE or self.error is not None:
            return
        now = self.loop.time()
        if self.paused:  # the reader is slow, not the worker
            self.last_read = now
        first_byte_by = self.first_byte_by
        if first_byte_by is not None and self.state >= BODY:
            first_byte_by = self.first_byte_by = None
        if first_byte_by is not None and now >= first_byte_by:
            waited = self.pool.limits.first_byte_timeout_s
            self._fail(WorkerTimedOut(f"no answer began within {waited:g} s (first_byte_timeout_s)"))
            self._close()
            return
        idle = now - self.last_read
        if idle >= self.pool.read_timeout_s:
            self._fail(WorkerTimedOut(f"no data for {self.pool.read_timeout_s:g} s (read_timeout_s)"))
            self._close()
            return
        due = self.last_read + self.pool.read_timeout_s
        self._timer = self.loop.call_at(due if first_byte_by is None else min(due, first_byte_by), self._watch)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.wake()

    def wake(self) -> None:
        """Wake the task waiting in ``wait`` (a push consumer whose sink stopped reading wakes it too)."""
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        """Until something changes: headers, body bytes, the end, or a failure."""
        if self.error is not None:
            raise self.error
        waiter = self._waiter = self.loop.create_future()
        await waiter
        if self.error is not None and not self.chunks and self.state != COMPLETE:
            raise self.error

    def take(self) -> bytes:
        """Every body byte that arrived so far, and reading resumes."""
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        self.buffered = 0
        if self.paused:
            self.resume()
        return data

    def pause(self) -> None:
        """Stop reading the socket (the worker's writes back up); the read timeout waits too."""
        self.paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume(self) -> None:
        self.paused = False
        self.last_read = self.loop.time()
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    async def headers(self) -> None:
        while self.state < HEAD:
            await self.wait()

    async def until_complete(self) -> None:
        """The whole answer is in (a body over the high-water mark is read on in ``read``)."""
        while self.state != COMPLETE and not self.paused:
            await self.wait()

    async def read(self) -> bytes:
        """The whole body; the connection goes back to the pool."""
        gen = self.gen
        parts: list[bytes] = []
        size, limit = 0, self.pool.limits.max_answer_bytes
        try:
            while self.state != COMPLETE:
                if self.paused:  # a body over the high-water mark: keep it here, let the socket go on
                    parts.append(self.take())
                    size += len(parts[-1])
                    if size > limit:
                        raise WorkerAnswerTooLarge(f"the answer passed max_answer_bytes ({limit})")
                await self.wait()
        except BaseException:
            self.abort()
            raise
        if self.chunks:
            parts.append(self.take())
            if size + len(parts[-1]) > limit:
                self.abort()
                raise WorkerAnswerTooLarge(f"the answer passed max_answer_bytes ({limit})")
        self.finish(gen)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def body_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, one bytes object per wake-up."""
        gen = self.gen
        try:
            while True:
                if self.chunks:
                    yield self.take()
                elif self.state == COMPLETE:
                    break
                else:
                    await self.wait()
        finally:
            self.finish(gen)

    def finish(self, gen: int, *, drain: bool = False) -> None:
        """Request ``gen`` is done with the connection: after a complete answer it is kept
        alive, anything else closes it. ``drain``: the reader saw the end of its stream
        (``[DONE]``) and the last bytes of the body may still be on their way."""
        state = self.state
        if gen != self.gen or state == IDLE or state == DRAINING:
            return
        self.sink = None
        if drain and state != COMPLETE and self.error is None and not self.closed:
            self.state = DRAINING  # on_message_complete finishes it; the watchdog still runs
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if state == COMPLETE and self.error is None and not self.closed and self.keep_alive:
            self.state = IDLE
            self.pool.put(self)
        else:
            self.abort()

    def abort(self) -> None:
        """Let go of the connection and close it."""
        self.state = IDLE
        self._close()

    def _close(self) -> None:  # a failure's: the reader still holds the connection, in its state
        self.sink = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class HostPool:
    """Idle keep-alive connections to one worker, last in first out."""

    def __init__(self, loop: asyncio.AbstractEventLoop, host: str, port: int, *,
                 connect_timeout_s: float, read_timeout_s: float, limits: WireLimits | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.loop = loop
        self.limits = limits or WireLimits()
        self.host, self.port = host, port
        self.tls = tls  # https: the context its connections are made with
        self.origin = f"{'https' if tls is not None else 'http'}://{host}:{port}"
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle: list[Connection] = []
        self.closed = False  # forgotten: connections that come back are closed, not kept

    async def acquire(self) -> tuple[Connection, bool]:
        """A connection and whether it was kept alive from an earlier request."""
        idle = self.idle
        if idle:
            now = self.loop.time()
            while idle:
                conn = idle.pop()
                if conn.closed:
                    continue
                if now - conn.last_read < IDLE_S:
                    return conn, True
                conn.abort()
                self.close_idle()  # kept last in, first out: the rest are older still
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: Connection(self), self.host, self.port, ssl=self.tls),
                self.connect_timeout_s)
        except (TimeoutError, OSError) as exc:
            raise WorkerUnavailable(connect_failure(self.origin, exc)) from exc
        return conn, False

    def put(self, conn: Connection) -> None:
        if len(self.idle) < MAX_IDLE and not self.closed:
            self.idle.append(conn)
        else:
            conn.abort()

    def close_idle(self) -> None:
        for conn in self.idle:
            conn.abort()
        self.idle.clear()

    def close(self) -> None:
        self.closed = True
        self.close_idle()


def connect_failure(origin: str, exc: BaseException) -> str:
    """Why a connection to ``origin`` could not be made, in words an operator can act on."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (f"{origin}: TLS: the worker's certificate is not trusted ({exc.verify_message}); "
                "[[pools]] tls_ca_file names the CA bundle that signs it")
    if isinstance(exc, ssl.SSLError):
        hint = " (is the worker serving plain http?)" if exc.reason == "WRONG_VERSION_NUMBER" else ""
        return f"{origin}: TLS handshake failed: {exc.reason or exc}{hint}"
    if isinstance(exc, TimeoutError):
        return f"{origin}: no connection within the connect timeout"
    return f"{origin}: {exc!r}"
