"""One response: prompt -> model turns (with router-run tools between them) -> persist -> events.

The worker is chosen and answers with its status BEFORE the client sees a
byte, so "no worker" and worker errors get a real HTTP status even for
streams; once streaming, a failure ends the response as ``failed`` (an
``error`` event, then ``response.failed``). When a turn ends with calls to
tools the router runs (MCP, web search, code interpreter), they run
concurrently and the next turn starts; function calls end the response. The
response is persisted before its terminal event leaves; a stream its client
leaves is persisted as ``cancelled``, with what it had produced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from backends.client import SSEStream, WorkerStreamBroken, WorkerStreamError
from backends.errors import WorkerAnswerTooLarge, WorkerTimedOut
from router.dialects.deltas import Usage
from router.dialects.turn import DialectTurn
from router.protocol.errors import APIError, NoCapacity, UpstreamError
from router.protocol.ids import ItemIds
from router.protocol.items import Item
from router.protocol.requests import CreateResponse, compact_threshold
from router.protocol.sealing import expand_compactions, seal_compaction
from router.protocol.tools import ToolSet
from router.state.store import ResponseDeleted, Store, StoredResponse, StoreUnavailable
from router.tools.registry import Browsing, RouterTools, gather_outcomes
from router.turns.assembler import Assembler, Event
from router.turns.compaction import count_tokens, summarize
from router.turns.prelude import Prelude
from router.turns.reader import reader
from router.turns.route import ModelRoute
from router.turns.routing import Routing
from router.turns.tool_items import RouterCallItem
from router.turns.upstream import Upstream

log = logging.getLogger("router.turns")

# The message the router cancels its request tasks with once a stop's grace is over (router/cli.py):
# a run seeing it ends as failed, code router_stopped, and says so to its client, instead of being cut.
STOPPING = "the router is stopping"


def _stopped(exc: BaseException) -> NoCapacity | None:
    """The error to end with when ``exc`` is the router's stop (see STOPPING), else None."""
    if not (isinstance(exc, asyncio.CancelledError) and exc.args and exc.args[0] == STOPPING):
        return None
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()  # handled here: the run goes on long enough to record and say it
    return NoCapacity("The router stopped before the response was complete; send it again.", code="router_stopped")


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
    conversation_position: int | None = None  # its end when the turn loaded it: the turn saw what is before
    router_tools: RouterTools | None = None
    prelude: Prelude | None = None  # MCP listings and approved calls, run before the first turn
    routing: Routing | None = None  # the arm, and the worker preference for affinity pools
    record_routing: bool = False  # remember where it was served, for the next turn
    metrics: Any = None  # router.metrics.RouterMetrics
    seal: Any = None  # seals reasoning text into encrypted_content, when the client asked for it
    sealer: Any = None  # router.protocol.sealing.Sealer, for context_management compaction
    item_ids: ItemIds | None = None  # names the output items (prepare named the input's with it)
    # Background responses and leased streams: the replica running it, how long its lease lasts per renewal.
    lease_holder: str | None = None
    lease_s: float = 30.0
    failure_events: list[Event] = field(default_factory=list)  # set when the run failed before streaming
    # Writes an event batch to the client at once (True) or cannot now (False); set by the SSE answer.
    direct: Callable[[list[Event]], bool] | None = None
    _tool_calls_run: int = 0
    _persisted: bool = False  # stored once already: later puts only update it (a background run, a leased stream)
    _put_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _checkpointed: int = -1  # the event sequence number of the last checkpoint
    # Its end could not be stored (the store stayed unreachable past its retries): ``persist`` again later.
    unstored: bool = False
    _timer: Any = None
    _compaction: dict[str, Any] | None = None  # made before the first turn, emitted first
    _stream: SSEStream | None = None
    _assembler: Assembler = field(init=False)
    _turn: DialectTurn = field(init=False)
    _upstream: Upstream = field(init=False)

    def __post_init__(self) -> None:
        summaries = bool((self.req.reasoning or {}).get("summary"))
        self._assembler = Assembler(self.response, tools=self.tools, summaries=summaries, seal=self.seal, ids=self.item_ids,
                                    include=self.req.include or ())
        self._turn = self.route.turn(self.req, self.tools, self.response["id"])
        routing = self.routing
        arm = routing.arm if routing else self.route.pool.name
        self._timer = self.metrics.timer(self.req.model, arm, self.route.pool.name) if self.metrics is not None else None
        self._upstream = Upstream(self.route.pool, self.req.model, truncate=self.req.truncation == "auto",
                                  preferred=routing.preferred_worker if routing else None,
                                  prefix_key=routing.prefix_key if routing else None)

    @property
    def _loops(self) -> bool:
        """Whether the router may run tools between turns (else one plain worker call does)."""
        return self.prelude is not None or any(t.kind in ("mcp", "web_search", "code_interpreter") for t in self.tools.offered)

    # -- non-streaming -----------------------------------------------------

    async def complete(self) -> dict[str, Any]:
        """Run to the end and return the final Response object."""
        if self._loops:  # the same machine as a stream, events dropped
            await self.open_stream()
            async for _ in self.events():
                pass
            if self.unstored:  # made, but the store stayed unreachable: 503, as a plain create's put says
                raise StoreUnavailable()
            error = self.response.get("error")
            if self.response["status"] == "failed" and error:
                raise UpstreamError(error["message"], code=error["code"])
            return self.response
        try:
            await self._compact()
            answer, self.prompt_items = await self._upstream.post(self._turn, self.prompt_items)
        except APIError as exc:
            raise await self._failed(exc) from None
        except asyncio.CancelledError as exc:
            stopped = _stopped(exc)
            if stopped is None:
                raise
            raise await self._failed(stopped) from None
        if self._compaction is not None:
            self._assembler.add_done(self._compaction)
        try:
            deltas = self._turn.completion(answer)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # a wrong-shaped answer
            raise await self._failed(UpstreamError(f"the worker's answer could not be read: {exc}", code="upstream_error")) from None
        asm = self._assembler
        asm.feed(deltas)
        asm.finish(self._unrunnable_call())
        await self._persist()
        return self.response

    # -- streaming ---------------------------------------------------------

    async def open_stream(self) -> None:
        """Run the prelude and reach a worker; its 200 comes before anything is sent to the client."""
        if self.prelude is not None:
            self.prompt_items = await self.prelude.run(self.tools, self.prompt_items)
        try:
            await self._compact()
            self._stream, self.prompt_items = await self._upstream.open(self._turn, self.prompt_items)
        except APIError as exc:
            raise await self._failed(exc) from None

    async def events(self, *, background: bool = False) -> AsyncGenerator[list[Event], None]:
        """Batches of events; one batch per upstream read."""
        asm = self._assembler
        try:
            if background:
                events = asm.begin()
                await self._persist()
                yield events
            else:
                not_kept = None
                if self.lease_holder is not None and self.req.store:
                    # Stored before the client sees its id; the worker is already at work meanwhile.
                    not_kept = await self._put_opening()
                yield asm.start()
                if not_kept is not None:  # the store stayed unreachable past its retries: it could not be kept
                    yield await self._fail(not_kept)
                    return
            if self._compaction is not None:
                yield asm.add_done(self._compaction)
            if self.prelude is not None:
                yield self.prelude.emit(asm)
            reason = None
            for turn_no in range(self._max_turns):
                if turn_no:
                    self._turn = self.route.turn(self.req, self.tools, self.response["id"])
                    try:
                        self._stream, self.prompt_items = await self._upstream.open(self._turn, self.prompt_items)
                    except APIError as exc:
                        yield await self._fail(exc)
                        return
                start = len(asm.output)
                try:
                    async for events in self._read_turn():
                        yield events
                except (WorkerStreamBroken, ValueError, KeyError, TypeError, AttributeError) as exc:
                    log.warning("pool %s: stream from %s broke: %s", self.route.pool.name, self._upstream.worker_url, exc)
                    self._upstream.broke()
                    if isinstance(exc, WorkerStreamError):
                        error = UpstreamError(f"the worker failed: {exc.message}", code="upstream_error")
                    elif isinstance(exc, WorkerAnswerTooLarge | WorkerTimedOut):
                        error = UpstreamError(f"the worker's stream broke off: {exc}", code="upstream_stream_broken")
                    elif not isinstance(exc, WorkerStreamBroken):  # a frame of the wrong shape
                        error = UpstreamError(f"the worker's stream could not be read: {exc}", code="upstream_error")
                    else:
                        error = UpstreamError("the worker's stream broke off before the response was complete",
                                              code="upstream_stream_broken")
                    yield await self._fail(error)
                    return
                calls = [c for c in asm.last_turn_calls if isinstance(c, RouterCallItem) and c.pending]
                ends = any(not isinstance(c, RouterCallItem) for c in asm.last_turn_calls)  # client calls, approvals
                if not calls:
                    break
                if self._over_tool_budget(len(calls)):
                    for call in calls:
                        call.abandon()
                    reason = "max_tool_calls"
                    break
                yield await self._run_calls(calls, start)
                if ends:
                    break
                self.tools.relax()
            else:
                reason = "max_turns"
            events = asm.finish(reason or self._unrunnable_call())
            try:
                await self._persist()
            except StoreUnavailable as exc:  # made but not kept: the end the client sees says so
                events = self._unstored(events, exc)
            yield events
        except (asyncio.CancelledError, GeneratorExit) as exc:
            # The client left a foreground stream before its end: what it produced is stored as
            # cancelled (open items incomplete), so the id it saw in response.created can be
            # retrieved and chained on, not a 404. Background runs are not tied to a client.
            # The router stopping is not the client leaving: the stream ends failed, and says so.
            if not background and self.response["status"] == "in_progress":
                stopped = _stopped(exc)
                if stopped is not None:
                    yield await self._fail(stopped)
                    return
                await self.cancelled()
            raise
        finally:
            self._close_stream()

    def attach_writer(self, write: Callable[[list[Event]], bool] | None) -> None:
        """The SSE answer's direct writer (router/api/sse.py), for as long as it sends."""
        self.direct = write

    async def _compact(self) -> None:
        """``context_management``: past the threshold, the turns before the last user message become a summary."""
        threshold = compact_threshold(self.req)
        if threshold is None or self.sealer is None:
            return
        if await count_tokens(self.route, self.req, self.tools, self.prompt_items) <= threshold:
            return
        items = self.prompt_items
        users = [i for i, item in enumerate(items) if item["type"] == "message" and item["role"] == "user"]
        if len(users) < 2:
            return  # only the current turn: nothing older to fold
        keep = users[-1]
        summary, usage = await summarize(self.route, self.req, items[:keep], self.response["id"] + "-compact")
        self._assembler.add_usage(Usage(usage["input_tokens"], usage["output_tokens"]))
        self._compaction = seal_compaction(self.sealer, self.owner, self.req.model, summary, keep_from=items[keep]["id"])
        self.prompt_items = expand_compactions([*items[:keep + 1], *items[keep + 1:], self._compaction], self.sealer,
                                               self.owner, first_input=len(items) + 1)

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

    async def _run_calls(self, calls: list[RouterCallItem], turn_start: int) -> list[Event]:
        """Run this turn's router calls; the model's turn and the results join the prompt."""
        assert self.router_tools is not None
        servers = self.prelude.servers if self.prelude is not None else {}
        outcomes = await gather_outcomes(calls, self.router_tools, servers, self._browsing(), owner=self.owner)
        events: list[Event] = []
        by_id: dict[str, str] = {}
        for call, outcome in zip(calls, outcomes):
            sources = [{"type": "url", "url": s["url"]} for s in outcome.sources or ()] if outcome.sources is not None else None
            call.finish(events, output=outcome.output, error=outcome.error, outputs=outcome.outputs, sources=sources)
            for source in outcome.sources or ():
                self._assembler.sources[source["url"]] = source.get("title") or source["url"]
            by_id[call.item["id"]] = outcome.prompt_text
        self._tool_calls_run += len(calls)
        for item in self._assembler.output[turn_start:]:
            text = by_id.get(item["id"])
            self.prompt_items.append({**item, "_output": text} if text is not None else item)
        return events

    def _browsing(self) -> Browsing:
        """The conversation's browser (the newest search's links, the page read last), from its items so far."""
        return Browsing.from_items(self.prompt_items)

    @property
    def _max_turns(self) -> int:
        return self.router_tools.max_turns if self.router_tools is not None and self._loops else 1

    def _over_tool_budget(self, more: int) -> bool:
        cap = self.req.max_tool_calls
        return cap is not None and self._tool_calls_run + more > cap

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self._upstream.release()

    async def _fail(self, error: APIError) -> list[Event]:
        self._close_stream()
        events = self._assembler.fail(error)
        # A store that has just given up is not asked again: that would only hold the client's end.
        await self._persist_or_log(error.code or error.type, write=not isinstance(error, StoreUnavailable))
        return events

    # -- background ----------------------------------------------------------

    def queue(self) -> list[Event]:
        """The first events of a background response (created, queued)."""
        return self._assembler.queued()

    async def cancelled(self) -> list[Event]:
        """Stopped on request, or left by its client: record ``cancelled`` (not appended to a
        conversation) and return the last events."""
        self._close_stream()  # the worker sees the disconnect and stops generating
        events = self._assembler.cancel()
        await self._persist_or_log()
        return events

    async def failed(self, error: APIError) -> list[Event]:
        """Stopped by an error outside the stream (a crash of the task): record ``failed``."""
        return await self._fail(error)

    def _unrunnable_call(self) -> str | None:
        """A call to a built-in tool (harmony's browser.*, python, container.*) that nothing here can run."""
        for item in self.response["output"]:
            name = item.get("name", "")
            if item["type"] == "function_call" and self.tools.lookup(name) is None and ("." in name or name == "python"):
                return "tool_not_available"
        return None

    async def _failed(self, error: APIError) -> APIError:
        """Record a response that failed before streaming began; returns the error to raise."""
        self.failure_events = self._assembler.fail(error)
        await self._persist_or_log(error.code or error.type)
        return error

    async def _persist_or_log(self, error_code: str | None = None, *, write: bool = True) -> None:
        """``_persist`` of an end that goes to the client whether or not it is stored (failed,
        cancelled): a store that stays unreachable past its retries is logged, not raised."""
        try:
            await self._persist(error_code, write=write)
        except StoreUnavailable:
            write = False
        if not write and self.req.store:
            self.unstored = True
            log.warning("response %s ended %s and could not be stored: the store is unavailable",
                        self.response["id"], self.response["status"])

    def _unstored(self, end: list[Event], error: StoreUnavailable) -> list[Event]:
        """A response's last events (``asm.finish``'s), its terminal one replaced by ``error`` and
        ``response.failed``, numbered on from it: it was made, but could not be stored."""
        terminal = end.pop()
        self.response["completed_at"] = None  # it did not complete after all
        failed = self._assembler.fail(error)
        for number, event in enumerate(failed, terminal["sequence_number"]):
            event["sequence_number"] = number
        if self._timer is not None:
            self._timer.error(error.code or error.type)
        self.unstored = bool(self.req.store)
        return end + failed

    async def _persist(self, error_code: str | None = None, *, write: bool = True) -> None:
        """Record the response; ``error_code``: why it failed, as precisely as the router knows (the
        Response's own code is one of OpenAI's closed set), for the metrics. ``write=False`` only
        counts it (the store is known to be unavailable)."""
        response = self.response
        status = response["status"]
        if self._timer is not None and status not in ("queued", "in_progress"):
            if status == "failed":
                self._timer.error(error_code or (response.get("error") or {}).get("code") or "failed")
            self._timer.finish(status, response.get("usage"))
        if self.conversation_id is not None and status in ("completed", "incomplete"):
            await self.store.add_conversation_items(
                self.conversation_id, self.owner, self.input_items + response["output"]
            )
        if not self.req.store or not write:
            return
        try:
            await self._put(response)
        except ResponseDeleted:
            if self.lease_holder is None or self.req.background:
                raise
            # A stream its client deleted while it ran: it stays deleted, and the stream ends as it would.
            log.info("streamed response %s was deleted while it ran; not stored again", response["id"])
            return
        if self.record_routing and self.routing is not None and status not in ("queued", "in_progress"):
            await self.store.set_routing(response["id"], self.routing.record(self._upstream.last_url))

    async def checkpoint(self) -> bool:
        """A leased stream's output so far, stored with it ``in_progress`` (open items as they would
        end now, ``incomplete``): if this replica dies, the sweep fails it with what its client had
        seen up to the last checkpoint, not with nothing. Nothing when no event came since the last
        one, or once the response ended (its own put, under the same lock, comes first). True: stored."""
        seq = self._assembler.sequence
        if seq == self._checkpointed or self.response["status"] != "in_progress" or not self._persisted:
            return False
        async with self._put_lock:
            if self.response["status"] != "in_progress":
                return False
            self._checkpointed = seq
            put = asyncio.ensure_future(self._store({**self.response, "output": self._assembler.checkpoint()}))
            try:
                await asyncio.shield(put)
            except asyncio.CancelledError:  # the stream ended: the lock is kept until this put is done
                await asyncio.wait({put})
                if not put.cancelled():
                    put.exception()  # retrieved: a failed checkpoint only means an older one stands
                raise
        return True

    async def _put(self, body: dict[str, Any]) -> None:
        async with self._put_lock:  # never under a checkpoint's put, which would overwrite it
            await self._store(body)

    async def _store(self, body: dict[str, Any]) -> None:
        response = self.response
        status = body["status"]
        running = status in ("queued", "in_progress") and self.lease_holder is not None
        await self.store.put_response(
            StoredResponse(
                id=response["id"],
                owner=self.owner,
                previous_response_id=self.req.previous_response_id,
                created_at=response["created_at"],
                status=status,
                body=body,
                input_items=self.input_items,
                expires_at=response["created_at"] + self.ttl_s if self.ttl_s else None,
                lease_holder=self.lease_holder if running else None,
                lease_until=time.time() + self.lease_s if running else None,
                existing=self._persisted,
                conversation_id=self.conversation_id,
                conversation_position=self.conversation_position,
            )
        )
        self._persisted = True

    async def _put_opening(self) -> StoreUnavailable | None:
        """A leased stream's first put: ``in_progress``, no output yet, so it can be retrieved (and is
        not chained on) while it runs, and is failed by the sweep if this replica dies. A failure
        here is logged; the put at the end tries again. A store unreachable past its retries is
        returned: the stream ends failed at once (its end could not be stored either)."""
        try:
            await self._put({**self.response, "output": []})
        except StoreUnavailable as exc:
            return exc
        except Exception:  # the stream goes on; its last put stores it
            log.warning("could not store streamed response %s as it started", self.response["id"], exc_info=True)
        return None

    @property
    def served_by(self) -> dict[str, str]:
        """Response headers naming where the request went."""
        headers = {"x-router-pool": self.route.pool.name}
        if self.routing is not None:
            headers["x-router-arm"] = self.routing.arm
        if self._upstream.last_url:
            headers["x-router-worker"] = self._upstream.last_url
        return headers

    async def persist(self) -> None:
        await self._persist()
