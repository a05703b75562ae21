"""What a worker call can fail with, typed by what the router must do about it."""

from __future__ import annotations

from typing import Any


class WorkerError(Exception):
    """Base of everything a worker call can fail with."""


class WorkerUnavailable(WorkerError):
    """No connection at all (refused, connect timeout): nothing was sent, safe to retry elsewhere."""


class WorkerHTTPError(WorkerError):
    """The worker answered with an error status."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"worker answered {status}")
        self.status = status
        self.body = body

    @property
    def message(self) -> str:
        body = self.body
        if isinstance(body, dict):
            err = body.get("error", body)
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                return err["message"]
        return str(body)[:500] or f"worker answered {self.status}"


class WorkerStreamBroken(WorkerError):
    """The request went out and its answer broke off or never came (connection closed or reset,
    read timeout, bad frame)."""


class WorkerStreamError(WorkerStreamBroken):
    """The worker said so itself, after its 200: a ``data: {"error": ...}`` frame (vLLM, SGLang)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
