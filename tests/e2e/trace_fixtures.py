"""For the tracing tests: an OTLP/HTTP trace collector and a proxy that records the headers a worker
receives, each an aiohttp server on loopback in a thread of the test process."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from harness import free_port


class _Server:
    """An aiohttp app served on 127.0.0.1 from its own thread and event loop."""

    def __init__(self, app: web.Application) -> None:
        self.port = free_port()
        self._app = app
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def start(self) -> Any:
        self._thread.start()
        assert self._ready.wait(10), "test server did not start"
        return self

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(self._app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class Collector(_Server):
    """Takes OTLP/HTTP protobuf trace exports at /v1/traces; ``spans`` holds every span, as dicts."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        app = web.Application()
        app.router.add_post("/v1/traces", self._export)
        super().__init__(app)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    async def _export(self, request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest.FromString(await request.read())
        for resource in export.resource_spans:
            service = next((a.value.string_value for a in resource.resource.attributes if a.key == "service.name"), "")
            for scope in resource.scope_spans:
                for span in scope.spans:
                    self.spans.append({
                        "service": service, "name": span.name, "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(), "parent_id": span.parent_span_id.hex(),
                        "attributes": {a.key: _value(a.value) for a in span.attributes},
                    })
        return web.Response(body=b"", content_type="application/x-protobuf")


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


class HeaderProxy(_Server):
    """Forwards every request to ``upstream`` and back, streams included; ``seen`` holds each
    request's (path, headers)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.seen: list[tuple[str, dict[str, str]]] = []
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        super().__init__(app)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((request.path, {k.lower(): v for k, v in request.headers.items()}))
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with aiohttp.ClientSession() as session, session.request(
                request.method, self.upstream + request.path_qs, data=body, headers=headers) as answer:
            out = web.StreamResponse(status=answer.status, headers={"Content-Type": answer.headers.get("Content-Type", "")})
            await out.prepare(request)
            async for chunk in answer.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out
