"""The lean worker client (backends/wire.py) against real sockets: keep-alive, failures, flow control."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from backends.client import (
    TLSError,
    WorkerClient,
    WorkerError,
    WorkerHTTPError,
    WorkerStreamBroken,
    WorkerStreamError,
    WorkerUnavailable,
    tls_context,
)
from backends.wire_targets import origin_key
from harness import free_port
from tests.support.tls_certs import Pki, make_pki
from tests.support.waits import async_wait_until


class Server:
    """An aiohttp server that tells how many TCP connections its requests came on."""

    def __init__(self, app: web.Application, tls: ssl.SSLContext | None = None) -> None:
        self.app = app
        self.tls = tls  # serve https with it
        self.protocols: list[object] = []  # held, so no two connections share an id
        app.middlewares.append(self._count)
        self.runner: web.AppRunner | None = None
        self.url = ""

    @web.middleware
    async def _count(self, request: web.Request, handler):  # type: ignore[no-untyped-def]
        if not any(p is request.protocol for p in self.protocols):
            self.protocols.append(request.protocol)
        return await handler(request)

    @property
    def connections(self) -> int:
        return len(self.protocols)

    async def __aenter__(self) -> Server:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port, ssl_context=self.tls).start()
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


def _app() -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"got": await request.json()})

    async def fail(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "nope"}}, status=503)

    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = (await request.json())["n"]
        for i in range(n):
            await resp.write(b'data: {"i": %d}\n\n' % i)
            await asyncio.sleep(0)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def sse_error(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"i": 0}\n\ndata: {"error": {"message": "engine died"}}\n\n')
        await resp.write_eof()
        return resp

    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"i": 0}\n\n')
        assert request.transport is not None
        request.transport.abort()
        return resp

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({})

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * (3 << 20), content_type="application/octet-stream")

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_post("/fail", fail)
    app.router.add_post("/sse", sse)
    app.router.add_post("/sse_error", sse_error)
    app.router.add_post("/cut", cut)
    app.router.add_post("/slow", slow)
    app.router.add_post("/big", big)
    return app


async def _back_in_the_pool(client: WorkerClient, url: str) -> None:
    """Waits until a connection to ``url``'s worker is idle in the client's pool: a stream's is once
    its body's last chunk, which may come after [DONE], has been read."""
    await async_wait_until(lambda: client.wire._pools[origin_key(url)].idle, 5, f"a connection to {url} back in the pool")


async def _client(read_timeout_s: float = 5.0) -> WorkerClient:
    client = WorkerClient(connect_timeout_s=1.0, read_timeout_s=read_timeout_s)
    return client


def _against_app(main: Callable[[Server, WorkerClient], Awaitable[None]], read_timeout_s: float = 5.0) -> None:
    """Runs ``main`` with a fresh client against a fresh ``_app()`` server; closes both, also on failure."""
    async def run() -> None:
        async with Server(_app()) as server:
            client = await _client(read_timeout_s=read_timeout_s)
            try:
                await main(server, client)
            finally:
                await client.close()

    asyncio.run(run())


def test_keep_alive_reuses_one_connection() -> None:
    async def main(server: Server, client: WorkerClient) -> None:
        for i in range(20):
            assert await client.post_json(server.url + "/echo", {"i": i}) == {"got": {"i": i}}
        for n in (1, 5):
            stream = await client.open_sse(server.url + "/sse", {"n": n})
            got = [f["i"] async for batch in stream.batches() for f in batch]
            assert got == list(range(n))
        await _back_in_the_pool(client, server.url)  # a stream's last chunk may come after [DONE]
        assert await client.post_json(server.url + "/echo", {"x": 1}) == {"got": {"x": 1}}
        assert server.connections == 1

    _against_app(main)


def test_concurrent_requests_each_get_a_connection() -> None:
    async def main(server: Server, client: WorkerClient) -> None:
        answers = await asyncio.gather(*(client.post_json(server.url + "/echo", {"i": i}) for i in range(16)))
        assert answers == [{"got": {"i": i}} for i in range(16)]
        assert 1 <= server.connections <= 16
        before = server.connections
        await asyncio.gather(*(client.post_json(server.url + "/echo", {"i": i}) for i in range(16)))
        assert server.connections == before  # the idle ones were reused

    _against_app(main)


def test_error_status_and_error_frame() -> None:
    async def main(server: Server, client: WorkerClient) -> None:
        with pytest.raises(WorkerHTTPError) as info:
            await client.post_json(server.url + "/fail", {})
        assert info.value.status == 503 and info.value.message == "nope"
        with pytest.raises(WorkerHTTPError) as info:
            await client.open_sse(server.url + "/fail", {})
        assert info.value.status == 503
        stream = await client.open_sse(server.url + "/sse_error", {})
        seen = []
        with pytest.raises(WorkerStreamError, match="engine died"):
            async for batch in stream.batches():
                seen += batch
        assert seen == [{"i": 0}]
        assert await client.post_json(server.url + "/echo", {"a": 1}) == {"got": {"a": 1}}

    _against_app(main)


def test_unreachable_worker_is_unavailable() -> None:
    async def main() -> None:
        client = await _client()
        with pytest.raises(WorkerUnavailable):
            await client.post_json(f"http://127.0.0.1:{free_port()}/echo", {})
        await client.close()

    asyncio.run(main())


def test_a_get_is_unavailable_when_nothing_answers_in_time_and_reuses_kept_connections() -> None:
    """A health check's GET on the wire: the answer's status and body on a kept-alive connection; a
    worker that is gone, or that accepts and never answers within the check's timeout, is
    WorkerUnavailable (the connection of the hung one closed, not pooled)."""

    async def main() -> None:
        accepted: list[int] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(1)
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if b"GET /hang" in head:
                    await asyncio.sleep(5)
                    writer.close()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = await _client()
        assert await client.get(base + "/health") == (200, b"ok")
        assert await client.get(base + "/health") == (200, b"ok")
        assert len(accepted) == 1  # kept alive
        with pytest.raises(WorkerUnavailable, match=r"no answer within 0\.3 s"):
            await client.get(base + "/hang", timeout_s=0.3)
        assert client.wire._pools[origin_key(base)].idle == []
        with pytest.raises(WorkerUnavailable):
            await client.get(f"http://127.0.0.1:{free_port()}/health")
        await client.close()
        server.close()

    asyncio.run(main())


def test_cut_stream_and_read_timeout_are_broken() -> None:
    async def main(server: Server, client: WorkerClient) -> None:
        stream = await client.open_sse(server.url + "/cut", {})
        seen = []
        with pytest.raises(WorkerStreamBroken):
            async for batch in stream.batches():
                seen += batch
        assert seen == [{"i": 0}]
        with pytest.raises(WorkerStreamBroken, match="no data"):
            await client.post_json(server.url + "/slow", {})
        assert await client.post_json(server.url + "/echo", {"b": 2}) == {"got": {"b": 2}}

    _against_app(main, read_timeout_s=0.3)


def test_late_close_of_a_finished_stream_does_not_touch_the_next_request() -> None:
    async def main(server: Server, client: WorkerClient) -> None:
        stream = await client.open_sse(server.url + "/sse", {"n": 2})
        assert [f["i"] async for b in stream.batches() for f in b] == [0, 1]
        await _back_in_the_pool(client, server.url)
        pending = asyncio.ensure_future(client.post_json(server.url + "/echo", {"c": 3}))
        pool = client.wire._pools[origin_key(server.url)]
        # polled at every turn of the loop: it must be caught while it waits for its answer
        await async_wait_until(lambda: not pool.idle and not pending.done(), 5, "the next request on the kept connection",
                               interval=0)
        stream.close()  # the connection may now serve `pending`
        assert await pending == {"got": {"c": 3}}
        assert server.connections == 1

    _against_app(main)


def test_large_body_through_flow_control_and_relay() -> None:
    async def main(server: Server, client: WorkerClient) -> None:
        answer = await client.relay(server.url + "/big", b"{}")
        assert answer.status == 200 and answer.content_type == "application/octet-stream"
        total = 0
        async for chunk in answer.chunks():
            total += len(chunk)
            await asyncio.sleep(0.001)  # a slow reader: the socket is paused, not buffered without bound
        assert total == 3 << 20
        answer = await client.relay(server.url + "/big", b"{}")
        assert len(await answer.read()) == 3 << 20

    _against_app(main)


def test_abandoned_stream_closes_its_connection() -> None:
    async def main(server: Server, client: WorkerClient) -> None:
        stream = await client.open_sse(server.url + "/sse", {"n": 1000})
        batches = stream.batches()
        first = await batches.__anext__()
        assert first and first[0] == {"i": 0}
        await batches.aclose()  # the reader went away mid-stream
        assert await client.post_json(server.url + "/echo", {"d": 4}) == {"got": {"d": 4}}
        assert server.connections == 2  # the half-read connection was not reused

    _against_app(main)


def test_connection_close_and_a_hung_worker() -> None:
    """An answer with ``Connection: close`` is read whole and its connection is not reused; a worker
    that accepts and never answers is a read timeout, never retried on a fresh connection."""

    async def main() -> None:
        accepted: list[int] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(1)
            head = await reader.readuntil(b"\r\n\r\n")
            if b"POST /hang" in head:
                await asyncio.sleep(5)
                writer.close()
                return
            body = b'{"n":%d}' % len(accepted)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = await _client(read_timeout_s=0.3)
        assert await client.post_json(base + "/x", {}) == {"n": 1}
        assert await client.post_json(base + "/x", {}) == {"n": 2}  # a new connection each time
        assert client.wire._pools[("http", "127.0.0.1", int(base.rsplit(":", 1)[1]))].idle == []
        before = len(accepted)
        with pytest.raises(WorkerStreamBroken, match="no data"):
            await client.post_json(base + "/hang", {})
        assert len(accepted) == before + 1  # the timed-out request was not sent again
        await client.close()
        server.close()

    asyncio.run(main())


async def _pushed(stream, refuse: set[int] = frozenset()) -> tuple[list[int], int, int]:  # type: ignore[assignment,no-untyped-def]
    """Reads a stream in push mode; batches whose position is in ``refuse`` are refused (the consumer
    backs up). Returns the frames' ``i`` in order, how many batches came and how many times push yielded."""
    got: list[int] = []
    calls = 0

    def on_batch(batch: list[dict]) -> bool:
        nonlocal calls
        got.extend(f["i"] for f in batch)
        calls += 1
        return calls - 1 not in refuse

    yields = 0
    async for _ in stream.push(on_batch):
        yields += 1
    return got, calls, yields


def test_push_mode_delivers_in_order_and_pauses_when_refused() -> None:
    async def main(server: Server, client: WorkerClient) -> None:
        got, _, yields = await _pushed(await client.open_sse(server.url + "/sse", {"n": 50}))
        assert got == list(range(50)) and yields == 0
        refuse = {0, 2, 3}
        got, batches, yields = await _pushed(await client.open_sse(server.url + "/sse", {"n": 50}), refuse=refuse)
        # each refusal: reading stopped until the consumer came back for more
        assert got == list(range(50)) and yields == len(refuse & set(range(batches))) >= 1
        await _back_in_the_pool(client, server.url)
        assert await client.post_json(server.url + "/echo", {"x": 1}) == {"got": {"x": 1}}
        assert server.connections == 1  # push mode keeps the connection alive like the pull mode

    _against_app(main)


def test_push_mode_failures_reach_the_consumer_task() -> None:
    async def main(server: Server, client: WorkerClient) -> None:
        stream = await client.open_sse(server.url + "/sse_error", {})
        seen: list[dict] = []
        with pytest.raises(WorkerStreamError, match="engine died"):
            async for _ in stream.push(lambda batch: seen.extend(batch) is None):
                pass
        assert seen == [{"i": 0}]  # the frames before the error frame were delivered
        stream = await client.open_sse(server.url + "/cut", {})
        with pytest.raises(WorkerStreamBroken):
            async for _ in stream.push(lambda batch: True):
                pass

        def bad(batch: list[dict]) -> bool:
            raise ValueError("the dialect could not read a frame")

        stream = await client.open_sse(server.url + "/sse", {"n": 20})
        with pytest.raises(ValueError, match="could not read"):  # raised in this task, not in the loop's callback
            async for _ in stream.push(bad):
                pass
        assert await client.post_json(server.url + "/echo", {"a": 1}) == {"got": {"a": 1}}

    _against_app(main)


def test_a_forgotten_worker_keeps_no_connection_open() -> None:
    """Idle connections close at once; one busy with a stream closes when the stream ends."""
    async def main(server: Server, client: WorkerClient) -> None:
        stream = await client.open_sse(server.url + "/sse", {"n": 3})  # busy on one connection
        for i in range(3):  # on a second one, idle between them
            assert await client.post_json(server.url + "/echo", {"i": i}) == {"got": {"i": i}}
        pool = client.wire._pools[("http", "127.0.0.1", int(server.url.rsplit(":", 1)[1]))]
        idle = list(pool.idle)
        assert len(idle) == 1 and server.connections == 2
        client.forget(server.url)
        assert idle[0].closed or idle[0].transport.is_closing()
        assert [f["i"] async for batch in stream.batches() for f in batch] == [0, 1, 2]
        assert pool.idle == [] and not client.wire._pools
        assert await client.post_json(server.url + "/echo", {"again": 1}) == {"got": {"again": 1}}
        assert server.connections == 3  # a new connection: none of the old ones was kept

    _against_app(main)


# -- TLS -------------------------------------------------------------------------------------


def _server_tls(pki: Pki, *, client_ca: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki.server_cert, pki.server_key)
    if client_ca:  # the worker asks for the router's certificate
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(pki.ca)
    return ctx


def _against_tls(main: Callable[[Server, WorkerClient], Awaitable[None]], server_tls: ssl.SSLContext,
                 client_tls: ssl.SSLContext) -> None:
    async def run() -> None:
        async with Server(_app(), tls=server_tls) as server:
            client = WorkerClient(connect_timeout_s=2.0, read_timeout_s=5.0, tls=client_tls)
            try:
                await main(server, client)
            finally:
                await client.close()

    asyncio.run(run())


def test_https_workers_are_spoken_to_over_tls_with_keep_alive(tmp_path: Path) -> None:
    """JSON, SSE, a relay and a health GET over TLS, all on one kept-alive connection;
    with the router's client certificate for a worker that asks for one."""
    pki = make_pki(tmp_path)

    async def main(server: Server, client: WorkerClient) -> None:
        assert server.url.startswith("https://")
        for i in range(5):
            assert await client.post_json(server.url + "/echo", {"i": i}) == {"got": {"i": i}}
        stream = await client.open_sse(server.url + "/sse", {"n": 4})
        assert [f["i"] async for batch in stream.batches() for f in batch] == [0, 1, 2, 3]
        await _back_in_the_pool(client, server.url)
        answer = await client.relay(server.url + "/echo", b'{"raw": true}')
        assert answer.status == 200 and orjson.loads(await answer.read()) == {"got": {"raw": True}}
        with pytest.raises(WorkerHTTPError) as err:
            await client.post_json(server.url + "/fail", {})
        assert err.value.status == 503
        models = server.connections
        assert models == 1  # the wire's one connection, kept alive through all of it
        status, _ = await client.get(server.url + "/missing")  # a health check's GET: the wire too
        assert status == 404 and server.connections == 1
        pool = client.wire._pools[("https", "127.0.0.1", int(server.url.rsplit(":", 1)[1]))]
        assert pool.tls is client.tls and pool.origin == server.url
        client.forget(server.url)
        assert not client.wire._pools

    tls = tls_context(str(pki.ca), str(pki.client_cert), str(pki.client_key))
    _against_tls(main, _server_tls(pki, client_ca=True), tls)


def test_an_untrusted_worker_certificate_is_a_clear_unavailable(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)

    async def main(server: Server, client: WorkerClient) -> None:
        with pytest.raises(WorkerUnavailable, match=r"certificate is not trusted .*tls_ca_file") as err:
            await client.post_json(server.url + "/echo", {})
        assert server.url in str(err.value)
        with pytest.raises(WorkerUnavailable, match="certificate is not trusted"):
            await client.open_sse(server.url + "/sse", {"n": 1})
        with pytest.raises(WorkerUnavailable, match="certificate is not trusted"):
            await client.get(server.url + "/health")
        assert server.connections == 0  # nothing was ever sent

    _against_tls(main, _server_tls(pki), tls_context(str(pki.other_ca)))


def test_a_worker_that_wants_a_client_certificate_refuses_a_router_without_one(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)

    async def main(server: Server, client: WorkerClient) -> None:
        with pytest.raises(WorkerError):
            await client.post_json(server.url + "/echo", {})
        assert server.connections == 0

    _against_tls(main, _server_tls(pki, client_ca=True), tls_context(str(pki.ca)))


def test_https_defaults_to_port_443_and_http_to_80() -> None:
    assert origin_key("https://gpu-1.internal/v1/chat/completions") == ("https", "gpu-1.internal", 443)
    assert origin_key("http://gpu-1.internal/v1/chat/completions") == ("http", "gpu-1.internal", 80)
    assert origin_key("https://gpu-1.internal:8443") == ("https", "gpu-1.internal", 8443)


def test_tls_files_that_cannot_work_name_their_setting(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    cases = [
        ((str(tmp_path / "nope.pem"), None, None), "tls_ca_file", "cannot read"),
        ((str(pki.client_key), None, None), "tls_ca_file", "no PEM certificate"),
        ((str(pki.ca), str(pki.client_cert), str(pki.server_key)), "tls_cert_file", "does not match"),
        ((str(pki.ca), str(pki.client_cert), str(tmp_path / "nokey.pem")), "tls_key_file", "cannot read"),
        ((str(pki.ca), str(tmp_path / "nocert.pem"), None), "tls_cert_file", "cannot read"),
    ]
    from cryptography.hazmat.primitives import serialization

    key_pem = serialization.load_pem_private_key(pki.client_key.read_bytes(), None)
    encrypted = tmp_path / "encrypted-key.pem"
    encrypted.write_bytes(key_pem.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.BestAvailableEncryption(b"secret")))
    # OpenSSL would prompt on the terminal for the passphrase, and start-up would hang there.
    cases.append(((str(pki.ca), str(pki.client_cert), str(encrypted)), "tls_key_file", "the key is encrypted"))
    for args, key, words in cases:
        with pytest.raises(TLSError, match=words) as err:
            tls_context(*args)
        assert err.value.key == key, (args, err.value)
    assert tls_context(str(pki.ca), str(pki.client_cert), str(pki.client_key)).verify_mode == ssl.CERT_REQUIRED
    assert tls_context().check_hostname
