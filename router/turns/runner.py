"""One response: prompt -> worker call -> assembler -> persist -> events.

The worker is chosen and answers with its status BEFORE the client sees a
byte, so "no worker" and worker errors get a real HTTP status even for
streams; once streaming, a failure ends the response as ``failed`` (an
``error`` event, then ``response.failed``). The response is persisted
before its terminal event leaves, so a client can chain on it at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from backends.client import SSEStream, WorkerError, WorkerHTTPError, WorkerStreamBroken, WorkerUnavailable
from backends.engines import is_context_overflow
from backends.pools import NoHealthyWorker, Pool, Worker
from router.dialects.turn import DialectTurn
from router.protocol.errors import APIError, InvalidRequest, NoCapacity, UpstreamError
from router.protocol.items import Item
from router.protocol.requests import CreateResponse
from router.protocol.tools import ToolSet
from router.state.store import Store, StoredResponse
from router.turns.assembler import Assembler, Event
from router.turns.route import ModelRoute

log = logging.getLogger("router.turns")


@dataclass(eq=False)
class ResponseRun:
    """Per-request state of one response; nothing here is shared between requests."""

    req: CreateResponse
    owner: str
    route: ModelRoute
    store: Store
    tools: ToolSet
    # What the model sees: history, then this turn's input, references resolved.
    prompt_items: list[Item]
    # What is stored as this response's input: the request's items as sent (normalized).
    input_items: list[Item]
    response: dict[str, Any]
    ttl_s: int | None = None  # stored responses expire this long after creation
    conversation_id: str | None = None  # the turn's input and output are appended to it
    # Background responses: the replica running it, and how long its lease lasts per renewal.
    lease_holder: str | None = None
    lease_s: float = 30.0
    failure_events: list[Event] = field(default_factory=list)  # set when the run failed before streaming
    _worker: Worker | None = None
    _stream: SSEStream | None = None
    _assembler: Assembler = field(init=False)
    _turn: DialectTurn = field(init=False)

    def __post_init__(self) -> None:
        summaries = bool((self.req.reasoning or {}).get("summary"))
        self._assembler = Assembler(self.response, tools=self.tools, summaries=summaries)
        self._turn = self.route.turn(self.req, self.tools, self.response["id"])

    @property
    def pool(self) -> Pool:
        return self.route.pool

    # -- non-streaming -----------------------------------------------------

    async def complete(self) -> dict[str, Any]:
        """Run to the end and return the final Response object."""
        answer = await self._call(lambda url, body: self.pool.client.post_json(url, body), stream=False)
        asm = self._assembler
        try:
            deltas = self._turn.completion(answer)
        except (ValueError, KeyError, TypeError) as exc:
            raise await self._failed(UpstreamError(f"the worker's answer could not be read: {exc}", code="upstream_error")) from None
        asm.feed(deltas)
        asm.finish(self._unrunnable_call())
        await self._persist()
        return self.response

    # -- streaming ---------------------------------------------------------

    async def open_stream(self) -> None:
        """Reach a worker and get its 200 before anything is sent to the client."""
        self._stream = await self._call(lambda url, body: self.pool.client.open_sse(url, body), stream=True, release=False)

    async def events(self, *, background: bool = False) -> AsyncIterator[list[Event]]:
        """Batches of events; one batch per upstream read."""
        assert self._stream is not None, "open_stream() first"
        asm = self._assembler
        try:
            if background:
                events = asm.begin()
                await self._persist()
                yield events
            else:
                yield asm.start()
            try:
                decode = self._turn.chunk
                async for batch in self._stream.batches():
                    events = asm.feed([d for frame in batch for d in decode(frame)])
                    if events:
                        yield events
                tail = asm.feed(self._turn.end())
            except (WorkerStreamBroken, ValueError, KeyError, TypeError) as exc:
                log.warning("pool %s: stream from %s broke: %s", self.pool.name, self._worker_url, exc)
                error = UpstreamError("the worker's stream broke off before the response was complete", code="upstream_stream_broken")
                events = asm.fail(error)
                await self._persist()
                yield events
                return
            events = tail + asm.finish(self._unrunnable_call())
            await self._persist()
            yield events
        finally:
            self._stream.close()
            self._release()

    # -- background ----------------------------------------------------------

    def queue(self) -> list[Event]:
        """The first events of a background response (created, queued)."""
        return self._assembler.queued()

    async def cancelled(self) -> list[Event]:
        """Stopped on request: record ``cancelled`` and return the last events."""
        if self._stream is not None:
            self._stream.close()  # the worker sees the disconnect and stops generating
        self._release()
        events = self._assembler.cancel()
        await self._persist()
        return events

    async def failed(self, error: APIError) -> list[Event]:
        """Stopped by an error outside the stream (a crash of the task): record ``failed``."""
        if self._stream is not None:
            self._stream.close()
        self._release()
        events = self._assembler.fail(error)
        await self._persist()
        return events

    def _unrunnable_call(self) -> str | None:
        """A call to a built-in tool (harmony's browser.*, python, container.*) that nothing here can run yet."""
        for item in self.response["output"]:
            name = item.get("name", "")
            if item["type"] == "function_call" and self.tools.lookup(name) is None and ("." in name or name == "python"):
                return "tool_not_available"
        return None

    # -- worker calls ------------------------------------------------------

    def _worker_request(self, *, stream: bool) -> dict[str, Any]:
        return self._turn.request(self.prompt_items, stream=stream)

    async def _call(self, send: Any, *, stream: bool, release: bool = True) -> Any:
        """Send the turn; with ``truncation: auto``, drop the oldest turns until the prompt fits."""
        while True:
            body = self._worker_request(stream=stream)
            try:
                return await self._send(send, body, release)
            except WorkerHTTPError as exc:
                if self.req.truncation == "auto" and is_context_overflow(exc.status, exc.message) and self._drop_oldest_turn():
                    log.info("pool %s: prompt too long, dropped the oldest turn", self.pool.name)
                    continue
                raise await self._failed(_api_error(exc)) from None
            except WorkerError as exc:
                raise await self._failed(_api_error(exc)) from None

    async def _send(self, send: Any, body: dict[str, Any], release: bool) -> Any:
        """Send to a healthy worker; an unreachable worker is skipped for the next one."""
        url = self._turn.path
        tried: list[Worker] = []
        while True:
            try:
                worker = self.pool.pick(exclude=tried)
            except NoHealthyWorker as exc:
                error = NoCapacity(f"no worker can serve model '{self.req.model}' now: {exc}", code="no_healthy_worker")
                raise await self._failed(error) from None
            tried.append(worker)
            self._acquire(worker)
            try:
                result = await send(worker.url + url, body)
            except WorkerUnavailable as exc:
                self.pool.mark_down(worker, str(exc))
                self._release()
                continue
            except BaseException:
                self._release()
                raise
            if release:
                self._release()
            return result

    def _drop_oldest_turn(self) -> bool:
        """Remove the oldest turn (a user message up to the next one) from the prompt; the store keeps it."""
        items = self.prompt_items
        users = [i for i, item in enumerate(items) if item["type"] == "message" and item["role"] == "user"]
        if len(users) < 2:
            return False
        cut = users[1]
        keep_system = [item for item in items[:cut] if item["type"] == "message" and item["role"] in ("system", "developer")]
        self.prompt_items = keep_system + items[cut:]
        return True

    def _acquire(self, worker: Worker) -> None:
        worker.in_flight += 1
        self._worker = worker

    def _release(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.in_flight -= 1
            worker.served += 1

    @property
    def _worker_url(self) -> str:
        return self._worker.url if self._worker else "?"

    async def _failed(self, error: APIError) -> APIError:
        """Record a response that failed before streaming began; returns the error to raise."""
        self.failure_events = self._assembler.fail(error)
        await self._persist()
        return error

    async def _persist(self) -> None:
        response = self.response
        status = response["status"]
        if self.conversation_id is not None and status in ("completed", "incomplete"):
            await self.store.add_conversation_items(  # type: ignore[attr-defined]
                self.conversation_id, self.owner, self.input_items + response["output"]
            )
        if not self.req.store:
            return
        running = status in ("queued", "in_progress") and self.lease_holder is not None
        await self.store.put_response(
            StoredResponse(
                id=response["id"],
                owner=self.owner,
                previous_response_id=self.req.previous_response_id,
                created_at=response["created_at"],
                status=status,
                body=response,
                input_items=self.input_items,
                expires_at=response["created_at"] + self.ttl_s if self.ttl_s else None,
                lease_holder=self.lease_holder if running else None,
                lease_until=time.time() + self.lease_s if running else None,
            )
        )

    async def persist(self) -> None:
        await self._persist()


def _api_error(exc: WorkerError) -> APIError:
    """How a worker's failure looks to the client."""
    if isinstance(exc, WorkerHTTPError):
        if is_context_overflow(exc.status, exc.message):
            return InvalidRequest(f"The input is too long for the model: {exc.message}", param="input",
                                  code="context_length_exceeded")
        if exc.status in (429, 503):
            return NoCapacity(f"the worker is overloaded: {exc.message}", code="worker_overloaded")
        if 400 <= exc.status < 500:
            # The request itself is at fault (e.g. longer than the model's context).
            return InvalidRequest(exc.message, code="upstream_rejected")
        return UpstreamError(f"the worker failed with status {exc.status}: {exc.message}", code="upstream_error")
    return UpstreamError(f"the worker failed: {exc}", code="upstream_error")
