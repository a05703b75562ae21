"""Requests to workers over backends/wire.py: a connection pool per worker origin, and each
request's head built once per URL.

A request is its prebuilt head, the headers of the request being served (``REQUEST_HEADERS``)
and the body, in one write on a kept-alive connection (``HostPool``); the answer is read by the
connection itself (``Connection``). Kept apart from the connection's protocol, which is the
per-token path: this runs once per request.
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

from backends.errors import WorkerIdleClosed, WorkerStreamBroken, WorkerTimedOut
from backends.wire import RECEIVING, REQUEST_HEADERS, Connection, HostPool, WireLimits


def origin_key(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a worker URL, the port defaulting as the scheme's (80, 443)."""
    parts = urlsplit(url)
    https = parts.scheme == "https"
    return ("https" if https else "http", parts.hostname or "127.0.0.1", parts.port or (443 if https else 80))


class Wire:
    """Connection pools per worker origin, and requests with prebuilt heads.

    ``tls``: the context of https workers' connections; None: the system's trust store, made when
    the first https worker is called."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float, limits: WireLimits | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.limits = limits or WireLimits()
        self.tls = tls
        self._pools: dict[tuple[str, str, int], HostPool] = {}
        self._heads: dict[tuple[str, str], tuple[HostPool, bytes]] = {}

    def _target(self, url: str, kind: str) -> tuple[HostPool, bytes]:
        """The pool of ``url``'s origin and the head of a request to it: ``kind`` "json" (a POST),
        "sse" (a POST whose answer is a stream) or "get"."""
        key = (url, kind)
        found = self._heads.get(key)
        if found is not None:
            return found
        parts = urlsplit(url)
        origin = origin_key(url)
        pool = self._pools.get(origin)
        if pool is None:
            tls = None
            if origin[0] == "https":
                if self.tls is None:
                    self.tls = ssl.create_default_context()
                tls = self.tls
            pool = self._pools[origin] = HostPool(
                asyncio.get_running_loop(), origin[1], origin[2],
                connect_timeout_s=self.connect_timeout_s, read_timeout_s=self.read_timeout_s, limits=self.limits,
                tls=tls)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        if kind == "get":
            head = f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n".encode("latin-1")
        else:
            accept = "Accept: text/event-stream\r\n" if kind == "sse" else ""
            head = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                    f"{accept}").encode("latin-1")
        if len(self._heads) > 4096:
            self._heads.clear()
        found = self._heads[key] = (pool, head)
        return found

    async def post(self, url: str, body: bytes, *, sse: bool = False, whole: bool = False) -> Connection:
        """Send a POST; returns the connection once the answer's headers are in, or with
        ``whole`` once all of it is (one wake-up when a worker writes head and body apart)."""
        pool, head = self._target(url, "sse" if sse else "json")
        data = b"%s%sContent-Length: %d\r\n\r\n%s" % (head, REQUEST_HEADERS.get(), len(body), body)
        return await self._send(pool, data, sse=sse, whole=whole)

    async def get(self, url: str) -> Connection:
        """Send a GET (health checks, metrics scrapes, model lists); returns the connection once
        the whole answer is in."""
        pool, head = self._target(url, "get")
        return await self._send(pool, head + b"\r\n", sse=False, whole=True)

    async def _send(self, pool: HostPool, data: bytes, *, sse: bool, whole: bool) -> Connection:
        conn, reused = await pool.acquire()
        conn.send(data, self.limits.first_byte_timeout_s if sse else None)
        try:
            await (conn.until_complete() if whole else conn.headers())
        except WorkerStreamBroken as exc:
            stale = reused and conn.state < RECEIVING and not isinstance(conn.error, WorkerTimedOut)
            conn.abort()
            if stale:
                pool.close_idle()  # closed by the worker while idle, or it restarted: so may the rest be
                raise WorkerIdleClosed(f"{exc} (a kept-alive connection, with nothing back)") from None
            raise
        except BaseException:
            conn.abort()
            raise
        return conn

    def forget(self, origin: str) -> None:
        """Close the idle connections to ``origin`` (``http(s)://host:port``), and the busy ones as
        their requests end: a worker taken out of service keeps no sockets open here."""
        pool = self._pools.pop(origin_key(origin), None)
        if pool is not None:
            pool.close()
            self._heads = {key: found for key, found in self._heads.items() if found[0] is not pool}

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._heads.clear()
