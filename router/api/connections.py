"""Deadlines on reading a request, and a cap on open connections.

A client that opens a connection and never finishes its request (half a request
line, half the headers, half a body, or a header line every few seconds) would
otherwise hold a socket forever; a few thousand of them exhaust the process's
file descriptors and every other client is refused, ``/health`` included,
before any API key is read. So:

- a request's head must arrive within ``header_timeout_s`` of the connection's
  start (or of its first byte, after an idle keep-alive), and its body within
  ``body_timeout_s`` of the head. A drip of bytes does not reset either: they are
  deadlines, not idle timeouts. Past one, the client gets 408 and the connection
  closes. Time the router itself is not reading (a pipelined request waiting its
  turn, a body the handler has not asked for yet) does not count against the client.
- at most ``max_connections`` are open at once. A new one past the cap closes the
  connection that has waited longest for its client (a stalled request, an idle
  keep-alive); only when every connection is busy with a request being answered is
  the new one refused, with 503 ``too_many_connections``. An attacker's stalled
  connections are so pushed out by everyone else's instead of locking them out.

One ``ConnectionGuard`` per server holds the connections waiting for their client,
oldest first, and sweeps them twice a second: per request that is a few dict
operations, where a timer each would cost a timer handle per request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import resource
from dataclasses import dataclass
from http import HTTPStatus
from typing import Literal, Protocol

import orjson

from router.protocol.errors import APIError

__all__ = ["ConnectionGuard", "ConnectionLimits", "Guarded", "Phase", "connection_cap", "refusal"]

log = logging.getLogger("router.connections")

Phase = Literal["head", "body", "idle"]
SWEEP_S = 0.5
# File descriptors kept for what is not a client's connection: the store, logs, the workers' health checks.
FD_RESERVE = 64


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 1024


class Guarded(Protocol):
    """What the guard asks of a connection (the router's HTTP protocol)."""

    def read_timed_out(self, phase: Phase) -> None: ...

    def evict(self, phase: Phase) -> None: ...


class ConnectionGuard:
    """The connections waiting for their client, in the order they started waiting."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.waiting: dict[Guarded, tuple[float, Phase]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweep: asyncio.TimerHandle | None = None

    def expect(self, conn: Guarded, phase: Phase, loop: asyncio.AbstractEventLoop) -> None:
        """``conn`` now waits for its client: a request's head or body (with its deadline), or,
        ``idle``, the next request of a kept-alive connection (uvicorn's keep-alive timer closes
        it; here it is only first in line to be evicted)."""
        if phase == "head":
            deadline = loop.time() + self.limits.header_timeout_s
        elif phase == "body":
            deadline = loop.time() + self.limits.body_timeout_s
        else:
            deadline = math.inf
        waiting = self.waiting
        if phase != "body":  # a new wait goes to the end of the line; a body continues its head's place
            waiting.pop(conn, None)
        waiting[conn] = (deadline, phase)
        if self._sweep is None:
            self._loop = loop
            self._sweep = loop.call_later(SWEEP_S, self._sweep_expired)

    def served(self, conn: Guarded) -> None:
        """``conn`` no longer waits for its client (its request is read, it closed, it upgraded)."""
        self.waiting.pop(conn, None)

    def phase(self, conn: Guarded) -> Phase | None:
        entry = self.waiting.get(conn)
        return None if entry is None else entry[1]

    def admit(self, open_connections: int) -> bool:
        """Whether a new connection may stay: under the cap, or once the longest waiting one is evicted."""
        if open_connections < self.limits.max_connections:
            return True
        victim = next(iter(self.waiting), None)
        if victim is None:
            return False
        _, phase = self.waiting.pop(victim)
        victim.evict(phase)
        return True

    def _sweep_expired(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        expired: list[tuple[Guarded, Phase]] = [(conn, phase) for conn, (deadline, phase) in self.waiting.items() if deadline <= now]
        for conn, phase in expired:
            if self.waiting.pop(conn, None) is not None:
                try:
                    conn.read_timed_out(phase)
                except Exception:  # one connection's failure must not stop the sweep
                    log.exception("closing a timed-out connection failed")
        self._sweep = self._loop.call_later(SWEEP_S, self._sweep_expired) if self.waiting else None


def refusal(error: APIError, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A whole answer that ends its connection: the status line, the server's headers, the error."""
    body = orjson.dumps(error.body())
    head = [b"HTTP/1.1 %d %s\r\n" % (error.status, HTTPStatus(error.status).phrase.encode("ascii"))]
    for name, value in default_headers:
        head += (name, b": ", value, b"\r\n")
    head += (b"content-type: application/json\r\ncontent-length: ", b"%d" % len(body), b"\r\nconnection: close\r\n\r\n")
    return b"".join(head) + body


def connection_cap(configured: int | None) -> int:
    """The cap on open connections: what the config says, within what the file-descriptor limit allows.

    The soft limit is raised to the hard one first (a client connection being answered may hold
    a worker connection too, so half the descriptors go to clients). A configured cap above that
    is lowered, with a warning: past the descriptors, accept fails and nobody is served.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    allowed = max(16, (soft - FD_RESERVE) // 2) if soft != resource.RLIM_INFINITY else 1 << 20
    if configured is None:
        return allowed
    if configured > allowed:
        log.warning("[server] max_connections = %d is above what %d file descriptors allow; using %d",
                    configured, soft, allowed)
        return allowed
    return configured
