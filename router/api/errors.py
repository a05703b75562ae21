"""Every error leaves in the OpenAI shape, including Starlette's own 404/405."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from router.api.http import error_response
from router.protocol.errors import APIError, internal_error

log = logging.getLogger("router.api")

_HTTP_TYPES = {404: ("not_found", "invalid_request_error"), 405: ("method_not_allowed", "invalid_request_error")}


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code, kind = _HTTP_TYPES.get(exc.status_code, (None, "invalid_request_error"))
    message = f"Unknown route: {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
    return error_response(APIError(message, status=exc.status_code, type=kind, code=code))


async def unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(internal_error())


HANDLERS = {APIError: api_error, HTTPException: http_error, Exception: unexpected_error}
