"""Kept-alive connections to a worker (backends/wire.py): one closed while idle is replaced, one
closed with nothing back is said (WorkerIdleClosed), and none is reused past IDLE_S."""

from __future__ import annotations

import asyncio

import pytest

from backends import wire
from backends.client import WorkerClient, WorkerStreamBroken
from backends.errors import WorkerIdleClosed
from tests.support.waits import async_wait_until
from tests.unit.test_wire import Server, _against_app, _client


def test_idle_connection_closed_by_the_worker_is_replaced() -> None:
    """A keep-alive connection the worker dropped while idle: the request goes on a new one."""

    async def main() -> None:
        accepted: list[asyncio.StreamWriter] = []
        answered = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(writer)
            await reader.readuntil(b"\r\n\r\n")
            body = b'{"ok":true}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            await writer.drain()
            await answered.wait()  # the client has its answer: the connection is idle in its pool
            writer.close()  # keep-alive promised, then closed while idle

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = await _client()
        for _ in range(3):
            answered.clear()
            assert await client.post_json(f"http://127.0.0.1:{port}/x", {}) == {"ok": True}
            answered.set()
            pool = client.wire._pools[("http", "127.0.0.1", port)]
            await async_wait_until(lambda: all(conn.closed for conn in pool.idle), 5,  # noqa: B023 - polled now
                                   "the worker's close of the idle connection seen by the client")
        assert len(accepted) == 3
        await client.close()
        server.close()

    asyncio.run(main())


def test_a_kept_alive_connection_closed_with_nothing_back_is_said_and_the_idle_ones_go() -> None:
    """The worker resets a kept-alive connection after reading the request (it crashed, or closed
    it as idle as the request came): WorkerIdleClosed, not resent here (backends/calls.py counts
    the attempt), and the worker's other idle connections are closed with it."""

    async def main() -> None:
        served = 0

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal served
            while True:
                try:
                    await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                served += 1
                if served > 3:
                    writer.transport.abort()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = await _client()
        url = f"http://127.0.0.1:{port}/x"
        await asyncio.gather(*(client.post_json(url, {}) for _ in range(3)))  # three connections, kept
        pool = client.wire._pools[("http", "127.0.0.1", port)]
        assert len(pool.idle) == 3
        with pytest.raises(WorkerIdleClosed, match="kept-alive"):
            await client.post_json(url, {})
        assert pool.idle == [] and served == 4
        with pytest.raises(WorkerStreamBroken) as fresh:  # a new connection's reset is the worker's failure
            await client.post_json(url, {})
        assert not isinstance(fresh.value, WorkerIdleClosed)
        await client.close()
        server.close()

    asyncio.run(main())


def test_a_connection_idle_past_idle_s_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle connection is reused only within IDLE_S of its last answer, before the worker's own
    keep-alive could close it under a request."""
    monkeypatch.setattr(wire, "IDLE_S", 0.0)

    async def main(server: Server, client: WorkerClient) -> None:
        before = server.connections
        for i in range(3):
            assert await client.post_json(server.url + "/echo", {"i": i}) == {"got": {"i": i}}
        assert server.connections == before + 3

    _against_app(main)
