"""A worker connection's state (backends/wire.py ``Connection.state``) walked with plain bytes: no sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from backends import wire
from backends.errors import WorkerStreamBroken, WorkerTimedOut
from backends.wire import BODY, COMPLETE, DRAINING, HEAD, IDLE, RECEIVING, SENT, Connection


class Transport:
    """Takes the request; remembers what was done to it."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.aborts = 0
        self.reading = True

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def abort(self) -> None:
        self.aborts += 1

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def connection(loop: asyncio.AbstractEventLoop) -> tuple[Connection, list[Connection], Transport]:
    kept: list[Connection] = []
    pool = SimpleNamespace(loop=loop, origin="http://worker", limits=wire.WireLimits(), read_timeout_s=30.0,
                           put=kept.append)
    conn = Connection(pool)  # type: ignore[arg-type]
    transport = Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, kept, transport


def test_an_answer_walks_every_state_and_the_connection_is_kept(loop: asyncio.AbstractEventLoop) -> None:
    conn, kept, transport = connection(loop)
    assert conn.state == IDLE
    conn.send(b"POST / HTTP/1.1\r\n\r\n")
    gen = conn.gen
    assert conn.state == SENT and transport.writes == [b"POST / HTTP/1.1\r\n\r\n"]
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-")
    assert conn.state == RECEIVING
    conn.data_received(b"Length: 5\r\n\r\n")
    assert conn.state == HEAD and conn.status == 200 and conn.length == 5
    conn.data_received(b"he")
    assert conn.state == BODY and conn.take() == b"he"
    conn.data_received(b"llo")
    assert conn.state == COMPLETE and conn.keep_alive and conn.take() == b"llo"
    conn.finish(gen)
    assert conn.state == IDLE and kept == [conn] and transport.aborts == 0
    conn.finish(gen)  # late: nothing
    assert kept == [conn] and transport.aborts == 0
    conn.data_received(b"HTTP/1.1 200 OK\r\n")  # bytes nobody asked for move nothing
    assert conn.state == IDLE
    conn.send(b"again")
    assert conn.gen == gen + 1 and conn.state == SENT
    conn.finish(gen)  # the earlier request's: nothing
    assert conn.state == SENT and transport.aborts == 0
    conn.connection_lost(None)
    assert conn.closed and isinstance(conn.error, WorkerStreamBroken)
    conn.finish(gen + 1)
    assert conn.state == IDLE and kept == [conn] and transport.aborts == 1


def test_a_head_without_body_completes_and_a_close_after_it_is_no_failure(loop: asyncio.AbstractEventLoop) -> None:
    conn, kept, transport = connection(loop)
    conn.send(b"req")
    conn.data_received(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
    assert conn.state == COMPLETE and not conn.keep_alive
    conn.connection_lost(None)
    assert conn.closed and conn.error is None and conn.state == COMPLETE
    conn.finish(conn.gen)
    assert conn.state == IDLE and kept == [] and transport.aborts == 1


def test_a_drained_stream_is_finished_by_its_end(loop: asyncio.AbstractEventLoop) -> None:
    conn, kept, _ = connection(loop)
    conn.send(b"req", first_byte_timeout_s=5.0)
    conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert conn.state == HEAD
    conn.data_received(b"e\r\ndata: [DONE]\n\n\r\n")
    assert conn.state == BODY
    conn.take()
    conn.finish(conn.gen, drain=True)
    assert conn.state == DRAINING and kept == []
    conn.finish(conn.gen)  # the stream closed after it: the drain still finishes it
    assert conn.state == DRAINING
    conn.data_received(b"0\r\n\r\n")
    assert conn.state == IDLE and kept == [conn] and conn.chunks == []


def test_a_failure_keeps_the_state_for_the_reader(loop: asyncio.AbstractEventLoop) -> None:
    conn, kept, transport = connection(loop)
    conn.send(b"req")
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi")
    conn.data_received(b"not http")
    assert isinstance(conn.error, WorkerStreamBroken) and conn.closed and transport.aborts == 1
    assert conn.state == COMPLETE and conn.take() == b"hi"  # what came before the failure is read
    conn.finish(conn.gen)
    assert conn.state == IDLE and kept == []


def test_the_first_byte_timeout_is_a_timeout_and_leaves_nothing_received(loop: asyncio.AbstractEventLoop) -> None:
    conn, _, transport = connection(loop)
    conn.send(b"req", first_byte_timeout_s=0.0)
    conn._watch()
    assert isinstance(conn.error, WorkerTimedOut) and conn.state == SENT and transport.aborts == 1
    conn.abort()
    assert conn.state == IDLE
