"""The access log: one line per request (and per WebSocket ``response.create``), at info, on the
logger ``router.access``, once its answer has ended.

The server opens a record as a request starts (``begin``), in the request's
context; the layers that learn something fill it in as they go (the key's
name, the model, the run that served it); the server ends it with the
status and the time. Nothing of the body, and never a key, is in it.

``[server] log_format`` chooses how every log line of the router is written:
``text`` for a terminal (the access line as ``name=value`` pairs), ``json``
for a log pipeline (one object per line, the access fields as its keys).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import orjson

from router import telemetry

log = logging.getLogger("router.access")

# The record of the request being answered in this context (a request's task, and the tasks it starts).
_current: ContextVar[Access | None] = ContextVar("router_access", default=None)
_active = 0  # requests begun and not ended, in this process: the requests_in_flight gauge

# A field a client chose (the path, the model name) is cut to this many characters on the line,
# with a marker saying how many more there were: no request writes a line longer than a few KB.
FIELD_MAX = 1024


class Access:
    """What one request did; filled in as it runs, written once as it ends."""

    __slots__ = ("started", "request_id", "method", "path", "key", "model", "run", "status", "error", "first_byte",
                 "pool", "worker", "response_id")

    def __init__(self, method: str, path: str, request_id: str) -> None:
        self.started = time.monotonic()
        self.request_id = request_id
        self.method = method
        self.path = path
        self.key: str | None = None  # the API key's name: never the key
        self.model: str | None = None
        self.run: Any = None  # router.turns.runner.ResponseRun: read once it has ended
        self.status = 0
        self.error: str | None = None  # the OpenAI error code of a 4xx/5xx
        self.first_byte: float | None = None
        self.pool: str | None = None  # a passthrough's (a run says its own)
        self.worker: str | None = None
        self.response_id: str | None = None

    def answered(self, status: int) -> None:
        """The answer's head went out now."""
        self.status = status
        if self.first_byte is None:
            self.first_byte = time.monotonic()

    def fields(self) -> dict[str, Any]:
        """The line's fields, in order; absent ones are None."""
        now = time.monotonic()
        run, arm, pool, worker, rid = self.run, None, self.pool, self.worker, self.response_id
        tokens_in = tokens_out = None
        error = self.error
        if run is not None:
            served = run.served_by
            arm, pool, worker = served.get("x-router-arm"), served.get("x-router-pool"), served.get("x-router-worker")
            response = run.response
            rid = response["id"]
            usage = response.get("usage") or {}
            tokens_in, tokens_out = usage.get("input_tokens"), usage.get("output_tokens")
            if error is None and response.get("status") == "failed":  # a stream's 200 that ended failed
                error = (response.get("error") or {}).get("code")
        return {
            "request_id": self.request_id, "key": self.key, "method": self.method, "path": _cut(self.path),
            "model": _cut(self.model), "arm": arm, "pool": pool, "worker": worker, "status": self.status, "error": error,
            "response_id": rid, "response_status": run.response.get("status") if run is not None else None,
            "input_tokens": tokens_in, "output_tokens": tokens_out,
            "ttfb_ms": round((self.first_byte - self.started) * 1000, 1) if self.first_byte is not None else None,
            "duration_ms": round((now - self.started) * 1000, 1),
        }


def _cut(value: str | None) -> str | None:
    if value is None or len(value) <= FIELD_MAX:
        return value
    return f"{value[:FIELD_MAX]}...[{len(value) - FIELD_MAX} more]"


def begin(method: str, path: str, request_id: str) -> Access:
    """A request starts in this context: its record, which ``current`` returns until it ends."""
    global _active
    access = Access(method, path, request_id)
    _current.set(access)
    telemetry.begin_request(request_id)  # its id goes with every worker request made for it
    _active += 1
    return access


def active() -> int:
    """Requests being answered now (streams included)."""
    return _active


# The record of the request answered in this context, or None: the context variable's own ``get``,
# a C call, not a Python frame (a create asks twice).
current: Callable[[], Access | None] = _current.get


def end(access: Access) -> None:
    """Write the request's line (when info is logged)."""
    global _active
    _active -= 1
    if log.isEnabledFor(logging.INFO) or telemetry.tracing():
        fields = access.fields()
        telemetry.note(**{"http.response.status_code": fields["status"], "error.type": fields["error"],
                          **{f"router.{k}": fields[k] for k in ("key", "model", "arm", "pool", "worker", "response_id")}})
        log.info(_text(fields), extra={"access": fields})


def _text(fields: dict[str, Any]) -> str:
    parts = [f"{fields['method']} {_quote(fields['path'])} {fields['status']}"]
    parts += [f"{name}={_quote(value) if isinstance(value, str) else value}" for name, value in fields.items()
              if value is not None and name not in ("method", "path", "status")]
    return " ".join(parts)


# A value written bare: printable ASCII with no space, quote or backslash. Anything else is written
# as a JSON string with every non-ASCII character escaped, so that no client's byte (a newline, CR,
# ESC, NUL, U+2028) can end the line or start a forged one, and the value reads back exactly.
_BARE = re.compile(r"[!#-\[\]-~]+")


def _quote(value: str) -> str:
    if _BARE.fullmatch(value):
        return value
    return json.dumps(value).replace("\x7f", "\\u007f")


# Characters that orjson writes raw and that end a line for some readers (Python's splitlines,
# JavaScript), or a terminal acts on: escaped in every JSON line.
_LINE_BREAKS = {"\x7f": "\\u007f", "\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


class TextFormatter(logging.Formatter):
    """``time level logger: message``, with the control characters of a message escaped (its
    traceback, the router's own, keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        return line if line.isprintable() else "".join(c if c.isprintable() else _escape(c) for c in line)


def _escape(char: str) -> str:
    return json.dumps(char)[1:-1] if char != "\x7f" else "\\u007f"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and an access line's fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name}
        access = getattr(record, "access", None)
        if access is not None:
            line.update((k, v) for k, v in access.items() if v is not None)
        else:
            line["message"] = record.getMessage()
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        out = orjson.dumps(line).decode()
        if not out.isprintable():
            for char, escaped in _LINE_BREAKS.items():
                out = out.replace(char, escaped)
        return out

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


def configure(level: str, log_format: str, *, access_log: bool = True) -> None:
    """The router's logging: ``level`` for every logger (uvicorn's too: it is given no config of
    its own), lines as ``log_format`` says (text or json), and the access lines or not."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    log.setLevel(logging.NOTSET if access_log else logging.WARNING)


def failed(error: Any) -> None:
    """The request is answered with ``error`` (an APIError): its code goes on the line."""
    record = _current.get()
    if record is not None:
        record.error = getattr(error, "code", None) or getattr(error, "type", None) or "error"
