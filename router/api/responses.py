"""``/v1/responses``: create (JSON or SSE), retrieve, delete, input items."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from router.api.auth import Authenticator
from router.api.http import json_response, parse_model, read_body
from router.api.sse import SSE_HEADERS, sse_body
from router.protocol.errors import InvalidRequest, NotFound
from router.protocol.ids import response_id
from router.protocol.items import normalize_input
from router.protocol.requests import CreateResponse, check_supported
from router.protocol.shapes import response_object
from router.state.store import Store
from router.protocol.tools import build_toolset
from router.turns.history import check_tool_outputs, load_history, resolve_input
from router.turns.route import ModelRoute
from router.turns.runner import ResponseRun


class ResponsesAPI:
    """The routes, bound to what they need: the store, the model routes and the key check."""

    def __init__(self, *, store: Store, models: dict[str, ModelRoute], auth: Authenticator, max_body_bytes: int,
                 ttl_s: int | None = None) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.models = models
        self.auth = auth
        self.max_body_bytes = max_body_bytes

    def routes(self) -> list[Route]:
        return [
            Route("/v1/responses", self.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/input_items", self.input_items, methods=["GET"]),
        ]

    async def create(self, request: Request) -> Response:
        owner = self.auth.owner(request)
        req = parse_model(CreateResponse, await read_body(request, self.max_body_bytes))
        check_supported(req)
        route = self.models.get(req.model)
        if route is None:
            raise NotFound(f"The model '{req.model}' does not exist.", param="model", code="model_not_found")
        tools = build_toolset(req.tools, req.tool_choice)
        input_items = normalize_input(req.input)
        history = await load_history(self.store, req.previous_response_id, owner)
        input_items = resolve_input(history, input_items)
        if not input_items and not history:
            raise InvalidRequest("'input' is empty: send at least one item.", param="input", code="empty_input")
        prompt_items = history + input_items
        check_tool_outputs(prompt_items)
        run = ResponseRun(
            req=req, owner=owner, route=route, store=self.store, tools=tools, prompt_items=prompt_items,
            input_items=input_items, response=response_object(req, response_id=response_id()), ttl_s=self.ttl_s,
        )
        if not req.stream:
            return json_response(await run.complete())
        await run.open_stream()
        return StreamingResponse(sse_body(run.events()), media_type="text/event-stream", headers=SSE_HEADERS)

    async def retrieve(self, request: Request) -> Response:
        owner = self.auth.owner(request)
        if request.query_params.get("stream") in ("true", "1"):
            raise InvalidRequest("replaying a response's stream is not supported yet", param="stream", code="unsupported_parameter")
        return json_response(await self._get(request.path_params["response_id"], owner))

    async def delete(self, request: Request) -> Response:
        owner = self.auth.owner(request)
        rid = request.path_params["response_id"]
        if not await self.store.delete_response(rid, owner):
            raise _not_found(rid)
        return json_response({"id": rid, "object": "response.deleted", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        owner = self.auth.owner(request)
        rid = request.path_params["response_id"]
        query = request.query_params
        limit = _int_param(query.get("limit", "20"), "limit", 1, 100)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequest("'order' must be 'asc' or 'desc'.", param="order", code="invalid_value")
        after = query.get("after") or None
        try:
            page = await self.store.list_input_items(rid, owner, after=after, limit=limit, order=order)  # type: ignore[arg-type]
        except KeyError:
            raise InvalidRequest(f"No input item with id '{after}' in response '{rid}'.", param="after", code="invalid_value") from None
        if page is None:
            raise _not_found(rid)
        data = page.data
        return json_response({
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": page.has_more,
        })

    async def _get(self, rid: str, owner: str) -> dict[str, Any]:
        body = await self.store.get_response(rid, owner)
        if body is None:
            raise _not_found(rid)
        return body


def _not_found(rid: str) -> NotFound:
    return NotFound(f"Response with id '{rid}' not found.", param="response_id", code="response_not_found")


def _int_param(raw: str, name: str, low: int, high: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be an integer from {low} to {high}.", param=name, code="invalid_value")
    return value
