"""``/v1/responses``: create (JSON or SSE, in the foreground or background), retrieve
(or replay its stream), cancel, delete, input items."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.routing import Route

from router.api.auth import Authenticator
from router.api.create import Creator
from router.api.fastpath import HotRoute, client_gone
from router.api.http import (
    Body,
    Headers,
    decode_request,
    int_param,
    json_response,
    list_page,
    order_param,
    parse_model,
    read_raw,
)
from router.api.include import include_query, seal, shown_items
from router.api.sse import StreamBody, event_stream
from router.limits import Admission
from router.limits.estimate import prompt_estimate
from router.protocol.errors import InvalidRequest, NotFound, RateLimited
from router.protocol.replay import output_of
from router.protocol.requests import CreateResponse
from router.protocol.shapes import response_view
from router.turns.background import BackgroundRuns
from router.turns.leases import Leases
from router.turns.runner import ResponseRun


class ResponsesAPI:
    """The routes, bound to what they need: the store, the model routes, the key check, background runs, leases."""

    def __init__(self, *, creator: Creator, auth: Authenticator, max_body_bytes: int, background: BackgroundRuns,
                 leases: Leases, limits: Admission | None = None) -> None:
        self.creator = creator
        self.store = creator.store
        self.sealer = creator.sealer
        self.auth = auth
        self.max_body_bytes = max_body_bytes
        self.background = background
        self.leases = leases
        self.limits = limits

    def routes(self) -> list[Route]:
        return [
            Route("/v1/responses", self.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"]),
            Route("/v1/responses/{response_id}/input_items", self.input_items, methods=["GET"]),
        ]

    def hot_routes(self) -> dict[str, HotRoute]:
        return {"/v1/responses": HotRoute(self.create_from, self.max_body_bytes)}

    async def create(self, request: Request) -> Body | StreamBody:
        """The Starlette route; the servers call ``create_from`` directly (router/api/fastpath.py)."""
        return await self.create_from(request.scope["headers"], await read_raw(request, self.max_body_bytes))

    async def create_from(self, headers: Headers, raw: bytes) -> Body | StreamBody:
        """A create's stages, in order (docs/ARCHITECTURE.md "A response's way")."""
        # read: the key, then the request, validated whole
        owner = self.auth.owner_of(headers)
        req = parse_model(CreateResponse, await decode_request(headers, raw, self.max_body_bytes))
        if self.limits is not None:  # the key's limits: admitted, or 429 (router/limits/)
            return await self._limited(req, owner)
        # prepare and route: everything that can be refused is, before a worker call or a write (as on WebSocket)
        run = await self.creator.prepared(req, owner)
        # build request, execute, assemble, persist (turns/runner.py), then respond
        return await self._answer(req, owner, run)

    async def _answer(self, req: CreateResponse, owner: str, run: ResponseRun,
                      limited: dict[str, str] | None = None) -> Body | StreamBody:
        """Execute and respond; ``limited``: the x-ratelimit-* headers that go with the answer."""
        if req.background:  # run detached; the client gets it queued, or its replayed events
            queued = await self.background.submit(run)
            if not req.stream:
                return json_response(queued, headers=limited)
            return event_stream(self.background.replay(queued["id"], owner, -1), limited)
        if not req.stream:  # run to the end: stored whole, answered as the request's include shows it
            body = await run.complete()
            return json_response(response_view(body, req.include or ()), headers={**run.served_by, **limited} if limited else run.served_by)
        await run.open_stream()  # a worker has taken it: the 200 can go out
        return event_stream(self.leases.stream(run), {**run.served_by, **limited} if limited else run.served_by,
                            attach=run.attach_writer)

    async def _limited(self, req: CreateResponse, owner: str) -> Body | StreamBody:
        """A create under its key's limits: admitted (concurrency, requests per minute) before it is
        prepared, its tokens reserved once its prompt is known, settled as it ends (the run's
        ``on_end``, whatever the ending); refused, it takes nothing and is not counted."""
        assert self.limits is not None
        ticket = await self.limits.admit(owner, req.model, stream=bool(req.stream) and not req.background,
                                         service_tier=req.service_tier, gone=None if req.background else client_gone())
        try:
            run = await self.creator.prepared(req, owner)
            await ticket.reserve(prompt_estimate(run.prompt_items) + self.limits.output_tokens(req.max_output_tokens))
        except BaseException:
            ticket.refuse()
            raise
        run.on_end = ticket.settle
        run.queue_as(ticket.tenant)
        try:
            answer = await self._answer(req, owner, run, ticket.headers())
        except RateLimited:  # a saturated pool's queue refused it: not counted
            ticket.refuse()
            raise
        except BaseException:
            ticket.settle(run.response.get("usage"))
            raise
        if req.background or not req.stream:  # a background run holds no slot; it settles as it ends
            ticket.release()
        return answer

    async def retrieve(self, request: Request) -> Body | StreamBody:
        owner = self.auth.owner(request)
        rid = request.path_params["response_id"]
        body = await self._get(rid, owner)
        query = request.query_params
        if body.get("status") == "in_progress" and not body.get("background"):
            body["output"] = await self._checkpointed(rid, owner, body.get("output") or [])
        if query.get("stream") not in ("true", "1"):
            include = include_query(request)
            seal(body.get("output") or [], include, self.sealer, owner)
            return json_response(response_view(body, include))
        if not body.get("background"):
            raise InvalidRequest("Only responses created with background set to true can be streamed again.",
                                 param="stream", code="stream_not_available")
        after = int_param(query.get("starting_after", "-1"), "starting_after", -1, 2**62)
        return event_stream(self.background.replay(rid, owner, after))

    async def cancel(self, request: Request) -> Body:
        owner = self.auth.owner(request)
        rid = request.path_params["response_id"]
        await self.background.cancel(await self._get(rid, owner), owner)
        return json_response(response_view(await self._get(rid, owner), ()))

    async def delete(self, request: Request) -> Body:
        owner = self.auth.owner(request)
        rid = request.path_params["response_id"]
        if not await self.store.delete_response(rid, owner):
            raise _not_found(rid)
        self.background.deleted(rid)
        return json_response({"id": rid, "object": "response.deleted", "deleted": True})

    async def input_items(self, request: Request) -> Body:
        owner = self.auth.owner(request)
        rid = request.path_params["response_id"]
        query = request.query_params
        limit = int_param(query.get("limit", "20"), "limit", 1, 100)
        order = order_param(query.get("order", "desc"))
        after = query.get("after") or None
        include = include_query(request)
        try:
            page = await self.store.list_input_items(rid, owner, after=after, limit=limit, order=order)
        except KeyError:
            raise InvalidRequest(f"No input item with id '{after}' in response '{rid}'.", param="after", code="invalid_value") from None
        if page is None:
            raise _not_found(rid)
        listed = list_page(page)
        listed["data"] = shown_items(listed["data"], include, self.sealer, owner)
        return json_response(listed)

    async def _checkpointed(self, rid: str, owner: str, output: list[Any]) -> list[Any]:
        """A running stream's output as its checkpoints logged it (router/turns/record.py), or
        ``output`` (as stored) before its first checkpoint."""
        events: list[dict[str, Any]] = []
        while len(events) < MAX_CHECKPOINT_EVENTS:
            page = await self.store.read_events(rid, owner, after=events[-1]["sequence_number"] if events else -1)
            if not page:
                break
            events += page
        return output_of(events) if events else output

    async def _get(self, rid: str, owner: str) -> dict[str, Any]:
        body = await self.store.get_response(rid, owner)
        if body is None:
            raise _not_found(rid)
        return body


# A running stream logs a few events a second (router/protocol/replay.py ``growth``): hours of them.
MAX_CHECKPOINT_EVENTS = 100_000


def _not_found(rid: str) -> NotFound:
    return NotFound(f"Response with id '{rid}' not found.", param="response_id", code="response_not_found")
