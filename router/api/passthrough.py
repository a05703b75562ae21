"""``/v1/chat/completions`` and ``/v1/completions``: relayed to a worker of the model's pool.

The body is parsed only to find and rewrite ``model``; the answer, streamed
or not, goes back byte for byte. The pool's worker call (backends/calls.py)
picks the worker and skips, for the next one, a worker that cannot be reached
or that closes the connection before its answer's head, as for a Responses
turn (a 502 when none is left). An answer, an error status included, goes
back as it came: a 5xx relayed counts neither for nor against the worker. A
whole answer that breaks off after its head is a 502, counted against the
worker; a stream that does just ends, cut, as the worker cut it.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.routing import Route

from backends.calls import WorkerCall
from backends.client import WorkerError
from backends.errors import NoHealthyWorker, QueueRefused
from router import telemetry
from router.api import access
from router.api.auth import Authenticator
from router.api.fastpath import HotRoute, client_gone
from router.api.http import Body, Headers, decode_request, read_raw
from router.api.sse import StreamBody
from router.limits import Admission, Ticket
from router.limits.estimate import BYTES_PER_TOKEN
from router.metrics import RouterMetrics
from router.protocol.errors import APIError, InvalidRequest, NotFound
from router.turns.routing import ModelTarget
from router.turns.upstream import api_error, no_capacity, queue_refused


class PassthroughAPI:
    def __init__(self, *, models: dict[str, ModelTarget], auth: Authenticator, max_body_bytes: int,
                 metrics: RouterMetrics | None = None, limits: Admission | None = None) -> None:
        self.limits = limits
        self.models = models
        self.auth = auth
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ]

    def hot_routes(self) -> dict[str, HotRoute]:
        return {"/v1/chat/completions": HotRoute(self.chat_from, self.max_body_bytes),
                "/v1/completions": HotRoute(self.completions_from, self.max_body_bytes)}

    async def chat(self, request: Request) -> Body | StreamBody:
        """The Starlette route; the servers call ``chat_from`` directly (router/api/fastpath.py)."""
        return await self.chat_from(request.scope["headers"], await read_raw(request, self.max_body_bytes))

    async def completions(self, request: Request) -> Body | StreamBody:
        return await self.completions_from(request.scope["headers"], await read_raw(request, self.max_body_bytes))

    async def chat_from(self, headers: Headers, raw: bytes) -> Body | StreamBody:
        return await self._relay(headers, raw, "chat_path")

    async def completions_from(self, headers: Headers, raw: bytes) -> Body | StreamBody:
        return await self._relay(headers, raw, "completions_path")

    async def _relay(self, headers: Headers, raw: bytes, path_attr: str) -> Body | StreamBody:
        owner = self.auth.owner_of(headers)
        body = _json_object(await decode_request(headers, raw, self.max_body_bytes))
        target = self.models.get(body.get("model"))  # type: ignore[arg-type]
        if target is None:
            raise NotFound(f"The model '{body.get('model')}' does not exist.", param="model", code="model_not_found")
        # A request that names no user goes to an arm by chance: a non-cryptographic draw (os.urandom
        # was a getrandom syscall for every request, ~3% of a passthrough's CPU).
        key = str(body.get("user") or body.get("safety_identifier") or f"{random.getrandbits(64):016x}")
        routing = target.route(key, None, prefix_key=None)
        pool = routing.route.pool
        done = _Done(self.metrics, (target.name, routing.arm, pool.name, path_attr.removesuffix("_path")))
        record = access.current()
        if record is not None:
            record.model, record.pool = target.name, pool.name
        if self.limits is not None:  # the key's limits: admitted, or 429 (router/limits/)
            done.ticket = await self._admit(owner, target.name, body, len(raw))
        body["model"] = pool.model
        data = orjson.dumps(body)
        path = getattr(pool.engine, path_attr)
        call = pool.call(relayed=True)
        if done.ticket is not None:
            call.tenant = done.ticket.tenant
        done.span = telemetry.start("worker call", **{"router.pool": pool.name, "router.model": target.name})
        telemetry.inject(done.span)  # the relayed request carries the call's trace context
        try:
            answer = await call.send(pool.client.relay, path, data, hold=True)
        except NoHealthyWorker as exc:
            refused: APIError = no_capacity(target.name, exc)
            done(refused.status)
            raise refused from None
        except QueueRefused as exc:  # a saturated pool's queue: not counted against the key's rates
            if done.ticket is not None:
                done.ticket.refuse()
            refused = queue_refused(pool.name, exc)
            done(refused.status)
            raise refused from None
        except WorkerError as exc:  # what relay can raise: unreachable or broken, on every worker tried
            refused = api_error(exc)
            done(refused.status)
            raise refused from None
        worker = call.last.url if call.last is not None else ""
        if record is not None:
            record.worker = worker
        # Where it went, as a Responses answer says it (x-router-*); the worker's own headers are not relayed.
        served = {"x-router-pool": pool.name, "x-router-arm": routing.arm, "x-router-worker": worker}
        if done.ticket is not None:
            served.update(done.ticket.headers())
        if body.get("stream"):
            return StreamBody(_Relayed(answer.chunks(), call, done, answer.status), status=answer.status,
                              media_type=answer.content_type, headers=served)
        try:
            raw = await answer.read()
        except WorkerError as exc:  # its head came, its body broke off: the worker's failure, too late to retry
            call.broke(str(exc))
            error = api_error(exc)
            done(error.status)
            raise error from None
        finally:
            call.release()
        done(answer.status, _usage(raw) if answer.status == 200 else None)
        return Body(raw, answer.status, answer.content_type, headers=served)

    async def _admit(self, owner: str, model: str, body: dict[str, Any], size: int) -> Ticket:
        """Admitted under the key's limits, its tokens reserved: the request's bytes over four (its
        prompt, estimated) and what the answer may use."""
        assert self.limits is not None
        tier = body.get("service_tier")
        ticket = await self.limits.admit(owner, model, stream=bool(body.get("stream")),
                                         service_tier=tier if isinstance(tier, str) else None, gone=client_gone())
        most = body.get("max_completion_tokens", body.get("max_tokens"))
        await ticket.reserve(size // BYTES_PER_TOKEN + self.limits.output_tokens(most if type(most) is int else None))
        return ticket


class _Done:
    """Records a relayed request's end into the metrics (passthrough_*) and ends its worker-call
    span, once."""

    __slots__ = ("metrics", "labels", "start", "span", "ticket")

    def __init__(self, metrics: RouterMetrics | None, labels: tuple[str, str, str, str]) -> None:
        self.metrics = metrics
        self.labels = labels
        self.start = time.perf_counter()
        self.span: object | None = None  # the worker call's trace span (router/telemetry.py)
        self.ticket: Ticket | None = None  # the key's limits: settled on the usage seen

    def __call__(self, status: int, usage: dict[str, Any] | None = None) -> None:
        if self.ticket is not None:
            self.ticket.settle(usage)
            self.ticket = None
        if self.metrics is not None:
            self.metrics.passthrough(self.labels, status, time.perf_counter() - self.start, usage)
            self.metrics = None
        if self.span is not None:
            telemetry.end(self.span, **{"http.response.status_code": status})
            self.span = None


def _usage(raw: bytes) -> dict[str, Any] | None:
    """The ``usage`` of a chat/completions answer or stream chunk (a ``data:`` line), if it has one.

    Only the usage object is parsed, found by its key (an unescaped quote cannot be inside a JSON
    string, so ``"usage":{`` is a key): parsing the whole answer was ~9% of a passthrough's
    instructions (bench/RESULTS.md), for three numbers. A prefix of an object that ends at any
    brace but its own is no JSON, so the first brace after it that parses is its end."""
    start = raw.rfind(b'"usage":{')
    if start < 0:
        return None
    start += 8
    end = raw.find(b"}", start)
    for _ in range(_USAGE_TRIES):  # the first brace after it that makes a whole object closes it
        if end < 0:
            return None
        try:
            usage = orjson.loads(raw[start:end + 1])
            break
        except orjson.JSONDecodeError:  # a nested object's, or one in a string
            end = raw.find(b"}", end + 1)
    else:  # braces in strings past counting: parse it all
        try:
            usage = orjson.loads(raw.removeprefix(b"data: ")).get("usage")
        except (orjson.JSONDecodeError, AttributeError):
            return None
    return usage if isinstance(usage, dict) else None


# Closing braces tried before the whole answer is parsed instead (a usage has one or two nested objects).
_USAGE_TRIES = 8


class _Relayed:
    """A relayed stream's chunks; the worker stays counted until they end or the answer is closed,
    whether or not it was ever iterated (an unstarted async generator's ``finally`` never runs)."""

    __slots__ = ("_chunks", "_call", "_done", "_status")

    def __init__(self, chunks: AsyncIterator[bytes], call: WorkerCall, done: _Done, status: int) -> None:
        self._chunks = _counted(chunks, call, done, status)
        self._call = call
        self._done = done
        self._status = status

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks  # each chunk straight from the generator: nothing added per chunk

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()  # type: ignore[attr-defined]
        finally:
            self._call.release()
            self._done(self._status)  # never iterated: no usage seen


async def _counted(chunks: AsyncIterator[bytes], call: WorkerCall, done: _Done, status: int) -> AsyncIterator[bytes]:
    """The chunks as they came; the last one holding a usage (``stream_options.include_usage``) is
    kept for the metrics (one bytes search per chunk)."""
    last = b""
    try:
        async for chunk in chunks:
            if b'"usage":{' in chunk:
                last = chunk
            yield chunk
    finally:
        call.release()
        usage = None
        for line in last.splitlines():
            usage = _usage(line) or usage
        done(status, usage)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    if not isinstance(body.get("model"), str):
        raise InvalidRequest("Missing required parameter: 'model'.", param="model", code="missing_required_parameter")
    return body
