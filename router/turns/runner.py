"""The execute and assemble stages of one prepared response: its model turns, with router-run
tools between them, to its end, for a JSON answer, a stream and a background run alike.

A response's stages, in order (docs/ARCHITECTURE.md "A response's way" says where each lives):

1. read: the body read, the key checked, the request validated (router/api/);
2. prepare: what can be refused is refused before a worker call or a write (turns/prepare.py);
3. route: the arm and the worker preference (turns/routing.py), chosen in prepare;
4. build request: items -> the engine's request (the dialect's turn, router/dialects/);
5. execute: ``context_management`` folded (turns/compaction.py), the MCP prelude
   (turns/prelude.py), the worker call (turns/upstream.py -> backends/calls.py), and the
   router's tools between turns (turns/tool_loop.py): here, ``ResponseRun``;
6. assemble: the worker's deltas -> items and events (turns/reader.py, turns/assembler.py);
7. persist: stored before its terminal event leaves (turns/record.py), a stored stream also
   as it starts and every second, leased (turns/leases.py);
8. respond: JSON, SSE or WebSocket frames (router/api/), a background run's event log
   (turns/background.py).

The worker answers with its status BEFORE the client sees a byte, so "no worker"
and worker errors get a real HTTP status even for streams; once streaming, a
failure ends the response as ``failed`` (an ``error`` event, then ``response.failed``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from backends.client import SSEStream, WorkerStreamBroken, WorkerStreamError
from backends.errors import WorkerAnswerTooLarge, WorkerTimedOut
from policies.tenant import Tenant
from router import telemetry
from router.dialects.turn import DialectTurn
from router.protocol.errors import APIError, NoCapacity, UpstreamError
from router.protocol.ids import ItemIds
from router.protocol.items import Item
from router.protocol.requests import CreateResponse
from router.protocol.sealing import Sealer
from router.protocol.tools import ToolSet
from router.state.store import StoreUnavailable
from router.tools.registry import RouterTools
from router.turns.assembler import OPENAI_REASONING, Assembler, Event
from router.turns.compaction import fold_history
from router.turns.meters import Meters, Timer
from router.turns.prelude import Prelude
from router.turns.reader import reader
from router.turns.record import Record
from router.turns.route import ModelRoute
from router.turns.routing import Routing
from router.turns.tool_items import RouterCallItem
from router.turns.tool_loop import ToolLoop
from router.turns.upstream import Upstream

log = logging.getLogger("router.turns")

# The message the router cancels its request tasks with once a stop's grace is over (router/cli.py):
# a run seeing it ends as failed, code router_stopped, and says so to its client, instead of being cut.
STOPPING = "the router is stopping"
# What a worker's stream can raise as it is read: it broke off, or a frame had the wrong shape.
STREAM_FAILURES = (WorkerStreamBroken, ValueError, KeyError, TypeError, AttributeError)


def _stopped(exc: BaseException) -> NoCapacity | None:
    """The error to end with when ``exc`` is the router's stop (see STOPPING), else None."""
    if not (isinstance(exc, asyncio.CancelledError) and exc.args and exc.args[0] == STOPPING):
        return None
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()  # handled here: the run goes on long enough to record and say it
    return NoCapacity("The router stopped before the response was complete; send it again.", code="router_stopped")


def stream_error(exc: BaseException) -> UpstreamError:
    """The error a response ends with when its worker's stream fails with ``exc`` (STREAM_FAILURES)."""
    if isinstance(exc, WorkerStreamError):
        return UpstreamError(f"the worker failed: {exc.message}", code="upstream_error")
    if isinstance(exc, WorkerAnswerTooLarge | WorkerTimedOut):
        return UpstreamError(f"the worker's stream broke off: {exc}", code="upstream_stream_broken")
    if not isinstance(exc, WorkerStreamBroken):  # a frame of the wrong shape
        return UpstreamError(f"the worker's stream could not be read: {exc}", code="upstream_error")
    return UpstreamError("the worker's stream broke off before the response was complete", code="upstream_stream_broken")


@dataclass(eq=False)
class ResponseRun:
    """One response from its first worker call to its end; nothing here is shared between requests.

    What it was prepared with comes first; the per-run state after. However it ends, the end
    goes through ``_end``, whose table says what is sent, stored and counted for each ending.
    """

    req: CreateResponse
    owner: str
    route: ModelRoute
    tools: ToolSet
    # What the model sees: history, then this turn's input, references resolved.
    prompt_items: list[Item]
    response: dict[str, Any]
    record: Record  # where and how it is stored
    router_tools: RouterTools | None = None
    prelude: Prelude | None = None  # MCP listings and approved calls, run before the first turn
    routing: Routing | None = None  # the arm, and the worker preference for affinity pools
    record_routing: bool = False  # remember where it was served, for the next turn
    metrics: Meters | None = None
    encrypt_reasoning: Callable[[str], str] | None = None  # reasoning text -> encrypted_content, when asked for
    sealer: Sealer | None = None  # for context_management compaction
    item_ids: ItemIds | None = None  # names the output items (prepare named the input's with it)
    reasoning_events: tuple[str, str] = OPENAI_REASONING  # the streamed reasoning events' names (delta, done)
    obfuscate: bool = False  # stream_options.include_obfuscation: pad text deltas (turns/assembler.py)
    refused_events: list[Event] = field(default_factory=list)  # set when the run was refused before streaming
    # Writes an event batch to the client at once (True) or cannot now (False); set by the SSE answer.
    direct: Callable[[list[Event]], bool] | None = None
    # Told the Response's usage once it has ended, whatever the ending (a key's limits settle on it).
    on_end: Callable[[Mapping[str, Any] | None], None] | None = None
    _timer: Timer | None = None
    _compaction: dict[str, Any] | None = None  # made before the first turn, emitted first
    _stream: SSEStream | None = None
    _call_span: object | None = None  # the worker call's trace span (router/telemetry.py), while it runs
    _assembler: Assembler = field(init=False)
    _turn: DialectTurn = field(init=False)
    _upstream: Upstream = field(init=False)
    _tool_loop: ToolLoop = field(init=False)

    def __post_init__(self) -> None:
        summaries = bool((self.req.reasoning or {}).get("summary"))
        self._assembler = Assembler(self.response, tools=self.tools, summaries=summaries, encrypt_reasoning=self.encrypt_reasoning, ids=self.item_ids,
                                    include=self.req.include or ())
        self._assembler.reasoning_events = self.reasoning_events
        if self.obfuscate:
            self._assembler.obfuscate()
        self._turn = self.route.turn(self.req, self.tools, self.response["id"])
        routing = self.routing
        arm = routing.arm if routing else self.route.pool.name
        self._timer = self.metrics.timer(self.req.model, arm, self.route.pool.name) if self.metrics is not None else None
        self._upstream = Upstream(self.route.pool, self.req.model, truncate=self.req.truncation == "auto",
                                  preferred=routing.preferred_worker if routing else None,
                                  prefix_key=routing.prefix_key if routing else None)
        self._tool_loop = ToolLoop(self.tools, self.router_tools, self.prelude, self.owner, self.req.max_tool_calls,
                                   self.metrics)

    # -- a whole answer ------------------------------------------------------

    async def complete(self) -> dict[str, Any]:
        """Run to the end and return the final Response object."""
        if self._tool_loop.loops:  # the same machine as a stream, events dropped
            await self.open_stream()
            async for _ in self.events():
                pass
            if self.record.unstored:  # made, but the store stayed unreachable: 503, as a plain create's put says
                raise StoreUnavailable()
            error = self.response.get("error")
            if self.response["status"] == "failed" and error:
                raise UpstreamError(error["message"], code=error["code"])
            return self.response
        try:
            await self._compact()
            self._begin_call()
            answer, self.prompt_items = await self._upstream.post(self._turn, self.prompt_items)
            self._end_call()
        except APIError as exc:
            raise await self._refused(exc) from None
        except asyncio.CancelledError as exc:
            stopped = _stopped(exc)
            if stopped is None:
                raise
            raise await self._refused(stopped) from None
        if self._compaction is not None:
            self._assembler.add_done(self._compaction)
        try:
            deltas = self._turn.completion(answer)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # a wrong-shaped answer
            raise await self._refused(UpstreamError(f"the worker's answer could not be read: {exc}", code="upstream_error")) from None
        self._assembler.feed(deltas)
        await self._end("finish", reason=self._tool_loop.unrunnable_call(self.response["output"]), streamed=False)
        return self.response

    # -- a stream ------------------------------------------------------------

    async def open_stream(self) -> None:
        """Run the prelude and reach a worker; its 200 comes before anything is sent to the client."""
        if self.prelude is not None:
            self.prompt_items = await self.prelude.run(self.tools, self.prompt_items)
        try:
            await self._compact()
            self._begin_call()
            self._stream, self.prompt_items = await self._upstream.open(self._turn, self.prompt_items)
        except APIError as exc:
            raise await self._refused(exc) from None

    async def events(self, *, background: bool = False) -> AsyncGenerator[list[Event], None]:
        """Batches of events; one batch per upstream read."""
        asm = self._assembler
        try:
            if background:
                events = asm.begin()
                await self.persist()
                yield events
            else:
                not_kept = None
                if self.record.lease_holder is not None and self.record.stored:
                    # Stored before the client sees its id; the worker is already at work meanwhile.
                    not_kept = await self.record.opening(self.response)
                yield asm.start()
                if not_kept is not None:  # the store stayed unreachable past its retries: it could not be kept
                    yield await self.fail(not_kept)
                    return
            if self._compaction is not None:
                yield asm.add_done(self._compaction)
            if self.prelude is not None:
                yield self.prelude.emit(asm)
            async for events in self._turns():
                yield events
        except (asyncio.CancelledError, GeneratorExit) as exc:
            # The client left a foreground stream before its end: what it produced is stored as
            # cancelled (open items incomplete), so the id it saw in response.created can be
            # retrieved and chained on, not a 404. Background runs are not tied to a client.
            # The router stopping is not the client leaving: the stream ends failed, and says so.
            if not background and self.response["status"] == "in_progress":
                stopped = _stopped(exc)
                if stopped is not None:
                    yield await self.fail(stopped)
                    return
                await self.cancelled()
            raise
        finally:
            self._close_stream()

    async def _turns(self) -> AsyncGenerator[list[Event], None]:
        """Model turns, router tools run between them, until one ends without such calls; then the end."""
        asm = self._assembler
        reason = None
        loop = self._tool_loop
        for turn_no in range(loop.max_turns):
            if turn_no:
                self._turn = self.route.turn(self.req, self.tools, self.response["id"])
                try:
                    self._begin_call()
                    self._stream, self.prompt_items = await self._upstream.open(self._turn, self.prompt_items)
                except APIError as exc:
                    yield await self.fail(exc)
                    return
            start = len(asm.output)
            try:
                async for events in self._read_turn():
                    yield events
            except STREAM_FAILURES as exc:
                log.warning("pool %s: stream from %s broke: %s", self.route.pool.name, self._upstream.worker_url, exc)
                self._upstream.broke()
                yield await self.fail(stream_error(exc))
                return
            calls = [c for c in asm.last_turn_calls if isinstance(c, RouterCallItem) and c.pending]
            ends = any(not isinstance(c, RouterCallItem) for c in asm.last_turn_calls)  # client calls, approvals
            if not calls:
                break
            if loop.over_budget(len(calls)):
                for call in calls:
                    call.abandon()
                reason = "max_tool_calls"
                break
            yield await loop.run(calls, asm, start, self.prompt_items)
            if ends:
                break
            self.tools.relax()
        else:
            reason = "max_turns"
        yield await self._end("finish", reason=reason or loop.unrunnable_call(self.response["output"]))

    def queue_as(self, tenant: Tenant) -> None:
        """Whom its worker calls are for, in a saturated pool's fair queue (backends/gate.py)."""
        self._upstream.call.tenant = tenant

    def attach_writer(self, write: Callable[[list[Event]], bool] | None) -> None:
        """The SSE answer's direct writer (router/api/sse.py), for as long as it sends."""
        self.direct = write

    async def _compact(self) -> None:
        if self.sealer is None or self.req.context_management is None:  # nothing to fold: no coroutine made
            return
        folded = await fold_history(self.route, self.req, self.tools, self.prompt_items, sealer=self.sealer,
                                    owner=self.owner, rid=self.response["id"])
        if folded is not None:
            self._compaction, self.prompt_items, usage = folded
            self._assembler.add_usage(usage)

    async def _read_turn(self) -> AsyncGenerator[list[Event], None]:
        """One model turn's stream -> event batches; closes the turn.

        With ``direct`` (a streaming HTTP answer), each upstream read becomes
        events and is written to the client inside the worker connection's
        ``data_received``; batches come out of here only when the client's
        socket is backed up (they then go through the ASGI send, which waits).
        """
        stream = self._stream
        assert stream is not None
        asm = self._assembler
        held: list[list[Event]] = []  # event batches not written yet, in order
        on_batch = reader(asm, self._turn, self._timer, self.direct, held)
        payloads = self._turn.decode
        if self.direct is None:
            async for batch in stream.batches(payloads):
                on_batch(batch)
                while held:
                    yield held.pop(0)
        else:
            async for _ in stream.push(on_batch, payloads):
                while held:
                    yield held.pop(0)
        events = asm.feed(self._turn.end()) + asm.close_turn()
        self._close_stream()
        yield events

    def _begin_call(self) -> None:
        """A worker call's span, ended with the call (its answer read, its stream closed, or its
        failure); the worker requests made for it carry its trace context."""
        if not telemetry.tracing():
            return
        self._call_span = telemetry.start("worker call", **{"router.pool": self.route.pool.name, "router.model": self.req.model})
        telemetry.inject(self._call_span)

    def _end_call(self, error: str | None = None) -> None:
        if self._call_span is not None:
            telemetry.end(self._call_span, **{"router.worker": self._upstream.last_url or None, "error.type": error})
            self._call_span = None

    def _close_stream(self) -> None:
        self._end_call()
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self._upstream.release()

    # -- its end, whichever it is ----------------------------------------------

    def queue(self) -> list[Event]:
        """The first events of a background response (created, queued)."""
        return self._assembler.queued()

    async def fail(self, error: APIError) -> list[Event]:
        """End it failed, at any point after it was accepted: the events that say so."""
        return await self._end("fail", error)

    async def cancelled(self) -> list[Event]:
        """Stopped on request, or left by its client: the last events."""
        return await self._end("cancel")

    async def _refused(self, error: APIError) -> APIError:
        """End it failed before anything was streamed; the error to raise (its events, for a
        background run's log, in ``refused_events``)."""
        await self._end("refuse", error)
        return error

    async def _end(self, how: Literal["finish", "fail", "refuse", "cancel"], error: APIError | None = None, *,
                   reason: str | None = None, streamed: bool = True) -> list[Event]:
        """End the run ``how``: the one place that says, for each ending, what the client is sent,
        what is stored and what is counted. Returns the events that say it.

        - finish: the Response is completed, or incomplete (``reason``). Sent: response.completed
          or .incomplete (JSON: the response). Stored: it must be; when the store stays
          unreachable, a stream's end becomes error + response.failed, kept as ``unstored`` and
          stored failed once the store is back (turns/leases.py), and a JSON create is a 503.
          Counted: its status, or failed (store_unavailable) when it was not kept.
        - fail: failed. Sent: error + response.failed. Stored when the store can (else logged).
          Counted: failed, or rejected when the error is the request's (a 4xx).
        - refuse: failed before anything was streamed. Sent: the error, as the HTTP answer (a
          background run: into its log). Stored and counted as fail.
        - cancel: cancelled (open items incomplete; not appended to a conversation). Sent:
          response.cancelled (a client that left sees nothing). Stored as fail. Counted: cancelled.

        The router stopping ends a run fail or refuse, code router_stopped (``_stopped``).
        """
        asm = self._assembler
        if how == "finish":
            events = asm.finish(reason)
            try:
                await self.persist()
            except StoreUnavailable as exc:  # made but not kept: the end the client sees says so
                if not streamed:
                    raise
                events = self._unstored(events, exc)
            return events
        if error is None:  # cancel
            self._close_stream()  # the worker sees the disconnect and stops generating
            events = asm.cancel()
            await self._end_or_log()
            return events
        code = error.code or error.type
        if how == "refuse":
            self._end_call(code)
            events = self.refused_events = asm.fail(error)
        else:
            self._close_stream()
            events = asm.fail(error)
        # A store that has just given up is not asked again: that would only hold the client's end.
        await self._end_or_log(code, write=not isinstance(error, StoreUnavailable), rejected=error.status < 500)
        return events

    def _unstored(self, end: list[Event], error: StoreUnavailable) -> list[Event]:
        """A response's last events (``asm.finish``'s), its terminal one replaced by ``error`` and
        ``response.failed``, numbered on from it: it was made, but could not be stored."""
        terminal = end.pop()
        self.response["completed_at"] = None  # it did not complete after all
        failed = self._assembler.fail(error)
        for number, event in enumerate(failed, terminal["sequence_number"]):
            event["sequence_number"] = number  # counted failed already, by ``persist``
        self.record.unstored = self.record.stored
        return end + failed

    async def persist(self, error_code: str | None = None) -> None:
        """Record and count the response as it is now. ``error_code``: why it failed, as precisely as
        the router knows (the Response's own code is one of OpenAI's closed set), for the metrics.
        An end the store could not keep is counted failed (``store_unavailable``), whatever it was:
        the client is told so (a 503, or ``response.failed``)."""
        try:
            with telemetry.span("persist", **{"router.status": self.response["status"]}):
                await self.store_again()
        except StoreUnavailable as exc:
            if self.response["status"] not in ("queued", "in_progress"):
                if self._timer is not None:
                    self._timer.error(exc.code or exc.type)
                    self._timer.finish("failed", self.response.get("usage"))
                if self.on_end is not None:
                    self.on_end(self.response.get("usage"))
            raise
        self._count(error_code)

    async def store_again(self) -> None:
        """Record it as it is now, not counted again (its end, once the store is back)."""
        if await self.record.end(self.response):
            await self._record_routing()

    async def _end_or_log(self, error_code: str | None = None, *, write: bool = True, rejected: bool = False) -> None:
        """Count and record an end that goes to the client whether or not it is stored. ``rejected``:
        it failed through the request's fault (a 4xx: the engine called it bad, it did not fit)."""
        self._count(error_code, rejected)
        with telemetry.span("persist", **{"router.status": self.response["status"]}):
            if await self.record.end_or_log(self.response, write=write):
                try:
                    await self._record_routing()
                except StoreUnavailable:  # the response is stored; only the next turn's stickiness is lost
                    log.warning("response %s: where it was served could not be stored", self.response["id"])

    async def _record_routing(self) -> None:
        """Where it was served, for the next turn of its chain (sticky arms, worker affinity)."""
        if self.record_routing and self.routing is not None and self.response["status"] not in ("queued", "in_progress"):
            await self.record.routing(self.response["id"], self.routing.record(self._upstream.last_url))

    def _count(self, error_code: str | None, rejected: bool = False) -> None:
        """Into the metrics, at its end: a failure through the request's fault as ``rejected``, which
        the arm's error rate leaves out (router/report.py)."""
        response = self.response
        status = response["status"]
        if self._timer is not None and status not in ("queued", "in_progress"):
            if status == "failed" and rejected:
                status = "rejected"  # its code is on its access line, not among the arm's errors
            elif status == "failed":
                self._timer.error(error_code or (response.get("error") or {}).get("code") or "failed")
            self._timer.finish(status, response.get("usage"))
        if self.on_end is not None and status not in ("queued", "in_progress"):
            self.on_end(response.get("usage"))

    async def checkpoint(self) -> bool:
        """A leased stream's output so far, stored ``in_progress`` (turns/record.py)."""
        return await self.record.checkpoint(self.response, self._assembler.sequence, self._assembler.checkpoint)

    @property
    def served_by(self) -> dict[str, str]:
        """Response headers naming where the request went."""
        headers = {"x-router-pool": self.route.pool.name}
        if self.routing is not None:
            headers["x-router-arm"] = self.routing.arm
        if self._upstream.last_url:
            headers["x-router-worker"] = self._upstream.last_url
        return headers
