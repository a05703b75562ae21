"""The hot route without the framework's layers: ``POST /v1/responses`` dispatched directly.

Measured here, Starlette's routing and its two middlewares cost ~100 us per
request; this route is most of the traffic. Everything else goes through
the Starlette app unchanged. Errors leave in the same shape either way.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request

from router.api.http import error_response
from router.protocol.errors import APIError

log = logging.getLogger("router.api")

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class FastPath:
    def __init__(self, app: ASGIApp, create: Callable[[Request], Awaitable[Any]]) -> None:
        self.app = app
        self.create = create

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/responses" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await self.create(request)
        except APIError as exc:
            response = error_response(exc)
        except Exception:  # noqa: BLE001 - the same answer the app's error handler gives
            log.exception("unhandled error on POST /v1/responses")
            response = error_response(APIError("The router hit an internal error.", status=500, type="server_error",
                                               code="internal_error"))
        await response(scope, receive, send)
