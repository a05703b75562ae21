"""One error shape for every failure: ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error the client sees, with its HTTP status and OpenAI error fields."""

    status: int = 500
    type: str = "server_error"
    headers: dict[str, str] | None = None  # sent with the answer (Retry-After, x-ratelimit-*)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type

    def body(self) -> dict[str, Any]:
        return {"error": self.fields()}

    def fields(self) -> dict[str, Any]:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}


class InvalidRequest(APIError):
    status = 400
    type = "invalid_request_error"


class NotFound(APIError):
    status = 404
    type = "invalid_request_error"


class Unauthorized(APIError):
    status = 401
    type = "authentication_error"


class PayloadTooLarge(APIError):
    status = 413
    type = "invalid_request_error"


class UpstreamError(APIError):
    """A worker failed (500, dropped connection, bad answer): 502 unless said otherwise."""

    status = 502
    type = "server_error"


class NoCapacity(APIError):
    """No healthy worker can take the request."""

    status = 503
    type = "server_error"


class RateLimited(APIError):
    """A key is over one of its limits (type ``requests`` or ``tokens``, as OpenAI's 429s), or a
    pool's queue is full (503). ``retry_after_s``: when to try again; sent as Retry-After."""

    status = 429
    type = "requests"

    def __init__(self, message: str, *, retry_after_s: float, code: str = "rate_limit_exceeded", type: str = "requests",
                 status: int = 429, headers: dict[str, str] | None = None) -> None:
        super().__init__(message, code=code, status=status, type=type)
        self.retry_after_s = retry_after_s
        self.headers = {**(headers or {}), **retry_headers(retry_after_s)}


def retry_headers(seconds: float) -> dict[str, str]:
    """Retry-After (whole seconds, rounded up, as RFC 9110 has it) and the openai SDKs' precise
    ``retry-after-ms``."""
    ms = max(1, int(seconds * 1000 + 0.999))
    return {"retry-after": str(max(1, -(-ms // 1000))), "retry-after-ms": str(ms)}


def internal_error() -> APIError:
    """What a client sees when the router itself failed (the details go to the log)."""
    return APIError("The router hit an internal error.", status=500, type="server_error", code="internal_error")
