"""The hot routes: handlers of ``(headers, body)``, answered without the framework's layers.

``POST /v1/responses`` and the chat passthrough are most of the traffic. Their
handlers take the request's raw headers and its whole body as sent (still
compressed, at most ``max_body_bytes``) and return a ``Body`` or, for a
stream, an ASGI app. Two servers drive them:

- the router's HTTP protocol (router/api/server.py) calls them straight from
  the parser and writes a ``Body`` itself, head and body in one write: no ASGI
  scope, request object, receive/send messages or response object per request;
- ``FastPath``, the ASGI app, for any other ASGI server: it reads the body and
  calls the same handler, so behaviour does not depend on the server.

Measured here, Starlette's routing and middlewares cost ~100 us per request
and uvicorn's ASGI cycle another ~25 us at c=32 (bench/RESULTS.md). Every
other route goes through the Starlette app unchanged. Errors leave in the
same shape either way.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from router import telemetry
from router.api import access
from router.api.http import Body, Headers, error_body, read_raw
from router.protocol.errors import APIError, internal_error
from router.protocol.ids import request_id

log = logging.getLogger("router.api")

# Whether the client of the request answered in this context has left (its connection closed):
# set by the router's HTTP protocol (router/api/server.py); a request waiting in a saturated
# pool's queue leaves it then.
_gone: ContextVar[Callable[[], bool] | None] = ContextVar("router_client_gone", default=None)


def client_gone() -> Callable[[], bool] | None:
    return _gone.get()


def watch_client(gone: Callable[[], bool]) -> None:
    _gone.set(gone)


ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
Handler = Callable[[Headers, bytes], Awaitable["Body | ASGIApp"]]


@dataclass(frozen=True, slots=True)
class HotRoute:
    """A ``POST`` route answered from ``(headers, body)``."""

    handler: Handler
    max_body_bytes: int


async def answer(route: HotRoute, path: str, headers: Headers, body: bytes) -> Body | ASGIApp:
    """The handler's answer; an error, expected or not, as a Body in the OpenAI shape."""
    try:
        return await route.handler(headers, body)
    except APIError as exc:
        return error_body(exc)
    except Exception:  # the same answer the app's error handler gives
        log.exception("unhandled error on POST %s", path)
        return error_body(internal_error())


def refused_body(error: APIError, headers: Headers) -> Body:
    """An answer given before the body was read to its end (it is too large).

    The rest of the body is read and dropped, and the connection goes on, as
    uvicorn does (or, after ``Connection: close``, the router's protocol closes
    it once the body is read), except for a client waiting for ``100 Continue``:
    it may never send the body the server now expects, so that connection
    closes after the answer (RFC 9110 10.1.1).
    """
    waiting = any(name == b"expect" and value.lower() == b"100-continue" for name, value in headers)
    return error_body(error, {"connection": "close"} if waiting else None)


class FastPath:
    """The router's ASGI app: hot routes dispatched directly, the rest to ``app`` (Starlette)."""

    def __init__(self, app: ASGIApp, hot_routes: dict[str, HotRoute]) -> None:
        self.app = app
        self.hot_routes = hot_routes  # by path; POST only
        # The HTTP protocol looks routes up by the request target's raw bytes.
        self.hot_by_target = {path.encode("ascii"): route for path, route in hot_routes.items()}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # a WebSocket: its frames write their own access lines
            await self.app(scope, receive, send)
            return
        rid = (scope.get("extensions") or {}).get("router.request_id") or request_id()
        record = access.begin(scope["method"], scope["path"], rid)

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                record.answered(message["status"])
            await send(message)

        with telemetry.request_span(scope["method"], scope["path"], scope["headers"], rid):
            try:
                await self._answer(scope, receive, sending)
            finally:
                access.end(record)

    async def _answer(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        route = self.hot_routes.get(scope["path"]) if scope["method"] == "POST" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        try:
            body = await read_raw(Request(scope, receive), route.max_body_bytes)
        except APIError as exc:
            response: Body | ASGIApp = refused_body(exc, scope["headers"])
        else:
            response = await answer(route, scope["path"], scope["headers"], body)
        await response(scope, receive, send)
