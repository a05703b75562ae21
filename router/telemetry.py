"""OpenTelemetry traces, and the headers a worker request carries for the request it serves.

With ``[telemetry] otlp_endpoint`` set (and the optional extra installed:
``pip install 'responses-router[otel]'``), each request is a span (a child of
the client's ``traceparent`` when it sends one) with child spans for prepare,
route, each worker call, each tool call and persist, exported over OTLP/HTTP.
Without it every function here is a no-op: no OpenTelemetry import, one
``None`` check per call.

Every worker request made for a client carries that request's ``x-request-id``
and, while traced, a W3C ``traceparent`` naming its worker-call span: vLLM and
SGLang started with their OTLP flags continue the trace inside the engine.
The header lines go down to the wire through a context variable
(backends/wire.py ``REQUEST_HEADERS``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from contextvars import ContextVar
from typing import Any

from backends.wire import REQUEST_HEADERS
from router.config import ConfigError, TelemetryConfig

_tracer: Any = None  # opentelemetry Tracer once ``setup`` found an endpoint
_provider: Any = None
_NOOP = contextlib.nullcontext()
_request_line: ContextVar[bytes] = ContextVar("request_id_line", default=b"")
EXPORT_DELAY_MS = 500  # how long finished spans wait to be sent together
FLUSH_S = 1.0  # at the router's stop, the most it waits for the collector to take the last spans


def setup(cfg: TelemetryConfig) -> None:
    """Install the SDK's tracer provider and OTLP exporter, when an endpoint is configured."""
    global _tracer, _provider
    if not cfg.otlp_endpoint:
        return
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as exc:
        raise ConfigError(f"telemetry.otlp_endpoint: traces need the otel extra (pip install 'responses-router[otel]'): {exc}") from None
    _provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}),
                               sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.otlp_endpoint),
                                                    schedule_delay_millis=EXPORT_DELAY_MS))
    _tracer = _provider.get_tracer("responses-router")


def shutdown() -> None:
    """Send what is left (at the router's stop), waiting at most FLUSH_S for the collector."""
    global _tracer, _provider
    if _provider is not None:
        _provider.force_flush(timeout_millis=int(FLUSH_S * 1000))
        _provider.shutdown()
    _tracer = _provider = None


def tracing() -> bool:
    return _tracer is not None


def begin_request(request_id: str) -> None:
    """The request answered in this context: its id goes to every worker request made for it."""
    line = b"x-request-id: " + request_id.encode("ascii") + b"\r\n"
    _request_line.set(line)
    REQUEST_HEADERS.set(line)


def worker_request_id(request_id: str) -> None:
    """From now, worker requests made in this context carry ``request_id`` as their x-request-id
    (``begin_request`` set the router's own): a client's engine ``request_id``, which vLLM takes from
    this header before its body (vllm/entrypoints/serve/engine/serving.py ``_base_request_id``), so
    the body's alone would be ignored. Checked as visible ASCII (requests.py ``check_supported``)."""
    begin_request(request_id)


def request_span(method: str, path: str, headers: Iterable[tuple[bytes, bytes]], request_id: str) -> Any:
    """The span of one request (a context manager), the client's ``traceparent`` its parent."""
    if _tracer is None:
        return _NOOP
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in (b"traceparent", b"tracestate")}
    parent = TraceContextTextMapPropagator().extract(carrier) if carrier else None
    return _tracer.start_as_current_span(f"{method} {path}", context=parent, kind=SpanKind.SERVER,
                                         attributes={"http.request.method": method, "url.path": path,
                                                     "router.request_id": request_id})


def span(name: str, **attributes: Any) -> Any:
    """A child span of the current one, as a context manager (a no-op when not tracing)."""
    if _tracer is None:
        return _NOOP
    return _tracer.start_as_current_span(name, attributes=attributes)


def start(name: str, **attributes: Any) -> Any:
    """A child span of the current one, ended by ``end`` (for spans that outlive a ``with``: a
    worker call whose stream is read later); None when not tracing."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(name, attributes=attributes, kind=SpanKind.CLIENT)


def end(started: Any, **attributes: Any) -> None:
    if started is not None:
        if attributes:
            started.set_attributes({k: v for k, v in attributes.items() if v is not None})
        started.end()


def note(**attributes: Any) -> None:
    """Attributes of the current span (what became known as it ran)."""
    if _tracer is None:
        return
    from opentelemetry import trace

    trace.get_current_span().set_attributes({k: v for k, v in attributes.items() if v is not None})


def inject(started: Any) -> None:
    """The next worker requests in this context carry ``started``'s trace context (``traceparent``)."""
    if started is None:
        return
    ctx = started.get_span_context()
    if not ctx.is_valid:
        return
    traceparent = b"traceparent: 00-%032x-%016x-%02x\r\n" % (ctx.trace_id, ctx.span_id, int(ctx.trace_flags))
    REQUEST_HEADERS.set(_request_line.get() + traceparent)
