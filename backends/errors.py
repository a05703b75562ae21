"""What a worker call can fail with, typed by what the router must do about it."""

from __future__ import annotations

from typing import Any


class WorkerError(Exception):
    """Base of everything a worker call can fail with."""


class NoHealthyWorker(Exception):
    """No worker can take a call now. ``code`` says why: ``no_healthy_worker`` (none passes its
    health checks) or ``circuit_open`` (healthy ones exist, but every one's circuit is open)."""

    def __init__(self, message: str, code: str = "no_healthy_worker") -> None:
        super().__init__(message)
        self.code = code


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

    @property
    def says_bad_request(self) -> bool:
        """The engine's error body calls the request bad (its type or code), whatever the status."""
        body = self.body
        err = body.get("error", body) if isinstance(body, dict) else None
        if not isinstance(err, dict):
            return False
        return err.get("type") in ("BadRequestError", "invalid_request_error") or err.get("code") in (400, "400")


class WorkerRequestFailed(WorkerHTTPError):
    """Two workers answered the same request with a 5xx error: a failure that follows the request
    from worker to worker is the request's (a body that crashes the engine), not the workers'. It is
    not retried further and counts against no circuit, so requests cannot shut a pool."""

    def __init__(self, status: int, body: Any, workers: int) -> None:
        super().__init__(status, body)
        self.workers = workers


class WorkerStreamBroken(WorkerError):
    """The request went out and its answer broke off or never came (connection closed or reset,
    read timeout, bad frame)."""


class WorkerIdleClosed(WorkerStreamBroken):
    """A kept-alive connection closed after the request went out, with nothing back: the worker
    may have closed it as idle while the request was on its way (nothing done), or crashed on
    the request. A failed call that blames no one (backends/calls.py)."""


class WorkerStreamError(WorkerStreamBroken):
    """The worker said so itself, after its 200: a ``data: {"error": ...}`` frame (vLLM, SGLang)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class WorkerTimedOut(WorkerStreamBroken):
    """The answer did not begin within the first-byte timeout, or stopped for the read timeout."""


class WorkerAnswerTooLarge(WorkerStreamBroken):
    """The worker's answer, or one frame of its stream, passed the pool's size limit
    (``max_answer_bytes`` / ``max_frame_bytes``): the answer is dropped, never buffered on."""


class QueueRefused(Exception):
    """A saturated pool's fair queue did not take the call, or gave up on it (backends/gate.py).

    ``reason``: ``key_full`` (the key has its share waiting: the router answers 429),
    ``queue_full`` or ``timeout`` (the pool is overloaded for everyone: 503), ``client_left`` (its
    client left while it waited: the answer goes nowhere)."""

    def __init__(self, message: str, *, reason: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s
