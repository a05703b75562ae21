"""WebSocket mode: ``/v1/responses`` upgraded to a WebSocket, as ``client.responses.connect()`` speaks it.

The client sends JSON text frames ``{"type": "response.create", ...}`` with the
fields of ``POST /v1/responses`` (``stream`` is implied, ``background`` is
refused) plus the WebSocket-only ``stream_id`` (a lane) and ``generate``. The
router answers with the events it would stream over SSE, one JSON text frame
per event, in order, each carrying the create's ``stream_id`` when it had one.

- One response runs at a time per lane (``stream_id``; absent is the default
  lane); a lane's creates run in the order they arrived. Lanes run side by
  side, up to ``max_lanes``; each lane queues at most ``max_queued`` creates.
- ``store: false`` responses stay usable on their connection: a bounded LRU
  of their items (history + input + output, what the store's
  ``load_history`` would give) answers ``previous_response_id`` before the
  store does. A continuation that fails evicts the id it continued from.
- ``generate: false`` prepares state without calling a worker: the response
  completes at once, empty, and the next turn can continue from it.
- Errors are ``{"type": "error", "error": {type, code, message, param}}``
  (the SDK's ``ResponseWsError``; ``status`` is the HTTP status the same
  failure has over HTTP). A failure inside a response is ``error`` then
  ``response.failed``; the connection stays usable. Malformed frames get an
  ``error`` and the connection stays open.
- Authentication is the HTTP one, on the upgrade request: a bad key is
  refused with the HTTP 401 JSON error (the WebSocket denial response), so
  the client's connect fails with that status instead of opening a socket.
- A connection lives at most ``max_age_s``: then it takes no new creates,
  lets running responses end (up to ``close_grace_s``), sends an ``error``
  with code ``websocket_connection_limit_reached`` and closes with 1000.
- Every send is awaited: a slow reader slows its own connection only, and
  the frames read ahead of it are bounded by the lane limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import ValidationError
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from router import telemetry
from router.api import access
from router.api.auth import Authenticator
from router.api.create import Creator
from router.api.http import error_response, validation_error
from router.protocol.errors import APIError, InvalidRequest, PayloadTooLarge, internal_error
from router.protocol.ids import request_id
from router.protocol.items import Item
from router.protocol.requests import CreateResponse
from router.protocol.shapes import usage_object
from router.state.forward import ForwardingStore
from router.state.store import Store
from router.turns.leases import Leases
from router.turns.runner import ResponseRun

log = logging.getLogger("router.websocket")

Event = dict[str, Any]

DEFAULT_MAX_AGE_S = 60 * 60.0
AGE_LIMIT_CODE = "websocket_connection_limit_reached"


class ResponsesWebSocket:
    """The ``/v1/responses`` WebSocket route, bound to what the HTTP create route also uses."""

    def __init__(self, *, creator: Creator, auth: Authenticator, max_body_bytes: int, leases: Leases,
                 max_age_s: float = DEFAULT_MAX_AGE_S, close_grace_s: float = 60.0, cache_size: int = 64,
                 max_lanes: int = 8, max_queued: int = 8) -> None:
        self.creator = creator  # the create sequence HTTP's create uses too (router/api/create.py)
        self.leases = leases  # a stored response is leased while it streams, as on HTTP
        self.auth = auth
        self.max_body_bytes = max_body_bytes
        self.max_age_s = max_age_s
        self.close_grace_s = close_grace_s
        self.cache_size = cache_size
        self.max_lanes = max_lanes
        self.max_queued = max_queued

    def routes(self) -> list[WebSocketRoute]:
        return [WebSocketRoute("/v1/responses", self.endpoint)]

    async def endpoint(self, ws: WebSocket) -> None:
        try:
            owner = self.auth.owner(ws)
        except APIError as exc:
            await _refuse(ws, exc)
            return
        await ws.accept()
        await _Connection(self, ws, owner).serve()


async def _refuse(ws: WebSocket, exc: APIError) -> None:
    """Refuse the upgrade with the HTTP error itself (status and JSON body); a plain 1008 close without the extension."""
    try:
        await ws.send_denial_response(error_response(exc))
    except RuntimeError:  # the server lacks the websocket.http.response extension
        await ws.close(code=1008, reason=exc.message[:120])


# -- the connection-local cache ------------------------------------------------


class ResponseCache:
    """The items of responses made on one connection, by response id, least recently used dropped first.

    Each item is kept as its JSON bytes: nothing later can change a cached
    item in place, and a chain's items are shared between its responses.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[str, tuple[bytes, ...]] = OrderedDict()

    def get(self, rid: str) -> tuple[bytes, ...] | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def put(self, rid: str, entry: tuple[bytes, ...]) -> None:
        self._entries[rid] = entry
        self._entries.move_to_end(rid)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def evict(self, rid: str) -> None:
        self._entries.pop(rid, None)

    def find_items(self, ids: list[str]) -> dict[str, Item]:
        wanted = set(ids)
        found: dict[str, Item] = {}
        for entry in reversed(self._entries.values()):
            for raw in entry:
                item = orjson.loads(raw)
                if item.get("id") in wanted and item["id"] not in found:
                    found[item["id"]] = item
            if len(found) == len(wanted):
                break
        return found

    def __contains__(self, rid: object) -> bool:
        return rid in self._entries


def _frozen(items: list[Item]) -> tuple[bytes, ...]:
    return tuple(orjson.dumps(item) for item in items)


class CachedStore(ForwardingStore):
    """The store as one request on a connection sees it: ``load_history`` and ``get_items`` ask the
    connection's cache first; everything else is the store's. It also remembers the history it gave
    out, so the response's own cache entry can be built on it."""

    def __init__(self, store: Store, cache: ResponseCache) -> None:
        super().__init__(store)
        self._cache = cache
        self.base: tuple[bytes, ...] | None = None  # the history handed to prepare, frozen
        self.from_cache = False

    async def load_history(self, response_id: str, owner: str) -> list[Item] | None:
        entry = self._cache.get(response_id)
        if entry is not None:
            self.base, self.from_cache = entry, True
            return [orjson.loads(raw) for raw in entry]
        items = await self._store.load_history(response_id, owner)
        if items is not None:
            self.base = _frozen(items)
        return items

    async def load_conversation_with_end(self, conversation_id: str, owner: str) -> tuple[list[Item], int] | None:
        loaded = await self._store.load_conversation_with_end(conversation_id, owner)
        if loaded is not None:
            self.base = _frozen(loaded[0])
        return loaded

    async def get_items(self, item_ids: list[str], owner: str) -> dict[str, Item]:
        found = self._cache.find_items(item_ids)
        rest = [i for i in item_ids if i not in found]
        if rest:
            found.update(await self._store.get_items(rest, owner))
        return found


# -- one connection --------------------------------------------------------------


@dataclass(eq=False)
class _Lane:
    frames: deque[dict[str, Any]] = field(default_factory=deque)
    task: asyncio.Task[None] | None = None


class _Connection:
    """Per-connection state: its owner, its lanes, its cache. Nothing here is shared with other connections."""

    def __init__(self, api: ResponsesWebSocket, ws: WebSocket, owner: str) -> None:
        self.api = api
        self.ws = ws
        self.owner = owner
        self.cache = ResponseCache(api.cache_size)
        self.lanes: dict[str | None, _Lane] = {}
        self.closing = False

    async def serve(self) -> None:
        reader = asyncio.create_task(self._read(), name="ws-reader")
        try:
            done, _ = await asyncio.wait({reader}, timeout=self.api.max_age_s)
            if reader in done:  # the client left (or the socket broke)
                if not reader.cancelled() and reader.exception() is not None:
                    log.error("websocket: reading failed", exc_info=reader.exception())
                    with contextlib.suppress(Exception):
                        await self.ws.close(code=1011, reason="internal error")
                return
            self.closing = True
            busy = [lane.task for lane in self.lanes.values() if lane.task is not None]
            if busy:
                await asyncio.wait(busy, timeout=self.api.close_grace_s)
            reader.cancel()
            await self._cancel_lanes()
            age = round(self.api.max_age_s)
            with contextlib.suppress(Exception):
                await self._error(InvalidRequest(
                    f"This WebSocket connection reached its maximum age of {age} seconds; open a new connection to continue.",
                    code=AGE_LIMIT_CODE), None)
                await self.ws.close(code=1000, reason=f"maximum connection age ({age} s) reached")
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            await self._cancel_lanes()

    async def _cancel_lanes(self) -> None:
        tasks = [lane.task for lane in self.lanes.values() if lane.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("text")
            if data is None:
                data = message.get("bytes") or b""
            try:
                await self._dispatch(data)
            except WebSocketDisconnect:
                return

    async def _dispatch(self, data: str | bytes) -> None:
        if len(data) > self.api.max_body_bytes:
            await self._error(PayloadTooLarge(f"The event is larger than the limit of {self.api.max_body_bytes} bytes.",
                                              code="request_too_large"), None)
            return
        try:
            frame = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            await self._error(InvalidRequest(f"We could not parse the JSON of your event: {exc}", code="invalid_json"), None)
            return
        if not isinstance(frame, dict):
            await self._error(InvalidRequest("Each event must be a JSON object.", code="invalid_json"), None)
            return
        sid = frame.get("stream_id")
        if sid is not None and (not isinstance(sid, str) or not 1 <= len(sid) <= 256):
            await self._error(InvalidRequest("'stream_id' must be a string of 1 to 256 characters.", param="stream_id",
                                             code="invalid_value"), None)
            return
        kind = frame.get("type")
        if kind != "response.create":
            if kind is None:
                error = InvalidRequest("Missing required parameter: 'type'.", param="type", code="missing_required_parameter")
            elif not isinstance(kind, str):
                error = InvalidRequest("'type' must be a string.", param="type", code="invalid_value")
            else:
                error = InvalidRequest(f"Unsupported event type {kind[:64]!r}: this server accepts 'response.create'.",
                                       param="type", code="unknown_event_type")
            await self._error(error, sid)
            return
        if self.closing:
            await self._closing_error(sid)
            return
        lane = self.lanes.get(sid)
        if lane is None:
            if len(self.lanes) >= self.api.max_lanes:
                await self._error(InvalidRequest(
                    f"At most {self.api.max_lanes} stream_id lanes can be busy at once on one connection.",
                    param="stream_id", code="too_many_streams"), sid)
                return
            lane = self.lanes[sid] = _Lane()
        if len(lane.frames) >= self.api.max_queued:
            await self._error(InvalidRequest(
                f"At most {self.api.max_queued} response.create events can wait on one lane.",
                param="stream_id", code="too_many_queued"), sid)
            return
        lane.frames.append(frame)
        if lane.task is None:
            lane.task = asyncio.create_task(self._drain(sid, lane), name=f"ws-lane:{sid}")

    async def _drain(self, sid: str | None, lane: _Lane) -> None:
        """Run a lane's creates one after another; the lane goes away when it has nothing left."""
        try:
            while lane.frames:
                frame = lane.frames.popleft()
                if self.closing:
                    await self._closing_error(sid)
                    continue
                rid = request_id()
                record = access.begin("WS", "/v1/responses", rid)  # one access line (and span) per response.create
                record.key = self.owner or None
                with telemetry.request_span("WS", "/v1/responses", self.ws.scope["headers"], rid):
                    try:
                        await self._respond(frame, sid)
                    except (WebSocketDisconnect, asyncio.CancelledError):
                        record.error = record.error or "client_disconnected"
                        raise
                    except Exception:  # keep the connection usable after a bug in one response
                        log.exception("websocket: response.create failed")
                        _evict_from(frame, self.cache)
                        await self._error(internal_error(), sid)
                    finally:
                        access.end(record)
        except WebSocketDisconnect:
            pass
        finally:
            lane.task = None
            if self.lanes.get(sid) is lane and not lane.frames:
                del self.lanes[sid]

    async def _closing_error(self, sid: str | None) -> None:
        await self._error(InvalidRequest("This WebSocket connection reached its maximum age and takes no new responses.",
                                         code=AGE_LIMIT_CODE), sid)

    # -- one response --------------------------------------------------------------

    async def _respond(self, frame: dict[str, Any], sid: str | None) -> None:
        api = self.api
        view = CachedStore(api.creator.store, self.cache)
        try:
            req, generate = _parse_create(frame)
            run = await api.creator.prepared(req, self.owner, store=view, mirror=generate)
            if generate:
                await run.open_stream()
        except APIError as exc:
            _evict_from(frame, self.cache)
            await self._error(exc, sid)
            return
        if not generate:
            await self._prepared_only(run, sid)
        else:
            events = api.leases.stream(run)
            try:
                async for batch in events:
                    for event in batch:
                        await self._send_event(event, sid)
            finally:
                await events.aclose()  # an async generator: closed at once, even when cancelled
        self._remember(run, view)

    async def _prepared_only(self, run: ResponseRun, sid: str | None) -> None:
        """``generate: false``: the response completes at once, empty; its input is kept for the next turn."""
        response = run.response
        created = {"type": "response.created", "sequence_number": 0, "response": dict(response)}
        response["status"] = "completed"
        response["completed_at"] = int(time.time())
        response["usage"] = usage_object(0, 0)
        await run.persist()
        await self._send_event(created, sid)
        await self._send_event({"type": "response.completed", "sequence_number": 1, "response": dict(response)}, sid)

    def _remember(self, run: ResponseRun, view: CachedStore) -> None:
        """Keep a finished response's items on the connection; a failed continuation evicts its parent."""
        req, response = run.req, run.response
        if response["status"] not in ("completed", "incomplete"):
            if req.previous_response_id is not None:
                self.cache.evict(req.previous_response_id)
            return
        if req.store and not view.from_cache:
            return  # the store has the whole chain
        self.cache.put(response["id"], (view.base or ()) + _frozen(run.record.input_items) + _frozen(response["output"]))

    # -- frames ----------------------------------------------------------------

    async def _send_event(self, event: Event, sid: str | None) -> None:
        if event["type"] == "error" and "error" not in event:
            # The runner's SSE error event is flat; WebSocket clients read it nested.
            event = {
                "type": "error",
                "sequence_number": event.get("sequence_number"),
                "error": {"type": "server_error", "code": event.get("code"), "message": event.get("message", ""),
                          "param": event.get("param")},
            }
        await self._send(event, sid)

    async def _error(self, exc: APIError, sid: str | None) -> None:
        record = access.current()
        if record is not None:
            record.answered(exc.status)
            access.failed(exc)
        await self._send({"type": "error", "status": exc.status, "error": {
            "type": exc.type, "code": exc.code, "message": exc.message, "param": exc.param}}, sid)

    async def _send(self, event: Event, sid: str | None) -> None:
        record = access.current()
        if record is not None and record.first_byte is None:
            record.answered(200)
        data = orjson.dumps(event)
        if sid is not None:
            data = data[:-1] + b',"stream_id":' + orjson.dumps(sid) + b"}"
        await self.ws.send_text(data.decode())


def _parse_create(frame: dict[str, Any]) -> tuple[CreateResponse, bool]:
    """A ``response.create`` frame -> the request (as POST /v1/responses would take it) and ``generate``."""
    body = {k: v for k, v in frame.items() if k not in ("type", "stream_id", "generate")}
    generate = frame.get("generate", True)
    if not isinstance(generate, bool):
        raise InvalidRequest("'generate' must be a boolean.", param="generate", code="invalid_value")
    if body.get("background"):
        raise InvalidRequest("background responses are not supported over WebSocket; use POST /v1/responses.",
                             param="background", code="unsupported_parameter")
    body["stream"] = True
    try:
        return CreateResponse.model_validate(body), generate
    except ValidationError as exc:
        raise validation_error(exc) from None


def _evict_from(frame: dict[str, Any], cache: ResponseCache) -> None:
    previous = frame.get("previous_response_id")
    if isinstance(previous, str):
        cache.evict(previous)
