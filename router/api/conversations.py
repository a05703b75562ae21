"""``/v1/conversations``: a durable list of items that responses read and extend."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.routing import Route

from router.api.auth import Authenticator
from router.api.http import Body, int_param, json_response, list_page, order_param, parse_model, read_body
from router.api.include import include_query, shown_items
from router.protocol.errors import InvalidRequest, NotFound
from router.protocol.ids import new_id
from router.protocol.items import CALLS, OUTPUTS, normalize_item
from router.protocol.requests import Metadata, check_encodable
from router.protocol.sealing import Sealer
from router.state.store import Conversation, ConversationStore


class CreateConversation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[Any] | None = Field(default=None, max_length=20)
    metadata: Metadata = None


class UpdateConversation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metadata: Metadata  # required, as the SDK has it (null clears): an empty body must not wipe it


class AddItems(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[Any] = Field(min_length=1, max_length=20)


class ConversationsAPI:
    def __init__(self, *, store: ConversationStore, auth: Authenticator, max_body_bytes: int,
                 sealer: Sealer | None = None) -> None:
        self.store = store
        self.auth = auth
        self.max_body_bytes = max_body_bytes
        self.sealer = sealer  # reasoning's encrypted_content, when a listing's include asks for it

    def routes(self) -> list[Route]:
        return [
            Route("/v1/conversations", self.create, methods=["POST"]),
            Route("/v1/conversations/{conversation_id}", self.retrieve, methods=["GET"]),
            Route("/v1/conversations/{conversation_id}", self.update, methods=["POST"]),
            Route("/v1/conversations/{conversation_id}", self.delete, methods=["DELETE"]),
            Route("/v1/conversations/{conversation_id}/items", self.list_items, methods=["GET"]),
            Route("/v1/conversations/{conversation_id}/items", self.add_items, methods=["POST"]),
            Route("/v1/conversations/{conversation_id}/items/{item_id}", self.get_item, methods=["GET"]),
            Route("/v1/conversations/{conversation_id}/items/{item_id}", self.delete_item, methods=["DELETE"]),
        ]

    async def create(self, request: Request) -> Body:
        owner = self.auth.owner(request)
        body = parse_model(CreateConversation, await read_body(request, self.max_body_bytes) or b"{}")
        items = [normalize_item(raw, f"items[{i}]") for i, raw in enumerate(body.items or [])]
        _no_references(items, "items")
        check_encodable(items, "items")
        await self._no_duplicates(None, owner, items)
        _outputs_answer_calls(items, [])
        conversation = Conversation(new_id("conv"), owner, int(time.time()), body.metadata or {})
        await self.store.create_conversation(conversation, items)
        return json_response(_shape(conversation))

    async def retrieve(self, request: Request) -> Body:
        owner = self.auth.owner(request)
        return json_response(_shape(await self._get(request, owner)))

    async def update(self, request: Request) -> Body:
        owner = self.auth.owner(request)
        body = parse_model(UpdateConversation, await read_body(request, self.max_body_bytes))
        conversation = await self.store.update_conversation(request.path_params["conversation_id"], owner, body.metadata or {})
        if conversation is None:
            raise _not_found(request.path_params["conversation_id"])
        return json_response(_shape(conversation))

    async def delete(self, request: Request) -> Body:
        owner = self.auth.owner(request)
        cid = request.path_params["conversation_id"]
        if not await self.store.delete_conversation(cid, owner):
            raise _not_found(cid)
        return json_response({"id": cid, "object": "conversation.deleted", "deleted": True})

    async def list_items(self, request: Request) -> Body:
        owner = self.auth.owner(request)
        cid = request.path_params["conversation_id"]
        query = request.query_params
        after = query.get("after") or None
        include = include_query(request)
        try:
            page = await self.store.list_conversation_items(
                cid, owner, after=after, limit=int_param(query.get("limit", "20"), "limit", 1, 100),
                order=order_param(query.get("order", "desc")),
            )
        except KeyError:
            raise InvalidRequest(f"No item with id '{after}' in conversation '{cid}'.", param="after", code="invalid_value") from None
        if page is None:
            raise _not_found(cid)
        listed = list_page(page)
        listed["data"] = shown_items(listed["data"], include, self.sealer, owner)
        return json_response(listed)

    async def add_items(self, request: Request) -> Body:
        owner = self.auth.owner(request)
        cid = request.path_params["conversation_id"]
        include = include_query(request)
        body = parse_model(AddItems, await read_body(request, self.max_body_bytes))
        items = [normalize_item(raw, f"items[{i}]") for i, raw in enumerate(body.items)]
        _no_references(items, "items")
        check_encodable(items, "items")
        await self._no_duplicates(cid, owner, items)
        batch_calls = _call_ids(items)
        if any(item["type"] in OUTPUTS and item["call_id"] not in batch_calls for item in items):
            _outputs_answer_calls(items, await self.store.load_conversation(cid, owner) or [])
        if await self.store.add_conversation_items(cid, owner, items) is None:
            raise _not_found(cid)
        shown = shown_items([dict(item) for item in items], include, self.sealer, owner)
        return json_response({"object": "list", "data": shown, "first_id": items[0]["id"], "last_id": items[-1]["id"],
                              "has_more": False})

    async def get_item(self, request: Request) -> Body:
        owner = self.auth.owner(request)
        cid, item_id = request.path_params["conversation_id"], request.path_params["item_id"]
        include = include_query(request)
        item = await self.store.get_conversation_item(cid, owner, item_id)
        if item is None:
            await self._get(request, owner)  # 404 for the conversation itself first
            raise NotFound(f"Item with id '{item_id}' not found.", param="item_id", code="item_not_found")
        return json_response(shown_items([item], include, self.sealer, owner)[0])

    async def delete_item(self, request: Request) -> Body:
        owner = self.auth.owner(request)
        cid, item_id = request.path_params["conversation_id"], request.path_params["item_id"]
        conversation = await self._get(request, owner)
        if not await self.store.delete_conversation_item(cid, owner, item_id):
            raise NotFound(f"Item with id '{item_id}' not found.", param="item_id", code="item_not_found")
        return json_response(_shape(conversation))

    async def _no_duplicates(self, cid: str | None, owner: str, items: list[dict[str, Any]]) -> None:
        """An id the conversation ``cid`` (None: a new one) or an earlier item of the batch has already
        is a 400, as OpenAI answers it: two items under one id would make ``after`` pages repeat and
        one delete remove both."""
        seen: set[str] = set()
        for i, item in enumerate(items):
            item_id = item.get("id")
            if item_id is None:
                continue
            if item_id in seen or (cid is not None and await self.store.get_conversation_item(cid, owner, item_id) is not None):
                raise InvalidRequest(f"Duplicate item found with id {item_id}. Remove duplicate items from your input "
                                     "and try again.", param=f"items[{i}].id", code="duplicate_item")
            seen.add(item_id)

    async def _get(self, request: Request, owner: str) -> Conversation:
        cid = request.path_params["conversation_id"]
        conversation = await self.store.get_conversation(cid, owner)
        if conversation is None:
            raise _not_found(cid)
        return conversation


def _shape(conversation: Conversation) -> dict[str, Any]:
    return {"id": conversation.id, "object": "conversation", "created_at": conversation.created_at,
            "metadata": conversation.metadata}


def _call_ids(items: list[dict[str, Any]]) -> set[str]:
    return {item["call_id"] for item in items if item["type"] in CALLS}


def _outputs_answer_calls(items: list[dict[str, Any]], earlier: list[dict[str, Any]]) -> None:
    """A tool output must answer a call of the conversation (earlier, or in the same batch): one that
    answers nothing would make every later response on the conversation a 400."""
    calls = _call_ids(earlier)
    for i, item in enumerate(items):
        if item["type"] in CALLS:
            calls.add(item["call_id"])
        elif item["type"] in OUTPUTS and item["call_id"] not in calls:
            raise InvalidRequest(f"No tool call found for function call output with call_id {item['call_id']}.",
                                 param=f"items[{i}].call_id", code="tool_call_not_found")


def _no_references(items: list[dict[str, Any]], where: str) -> None:
    for i, item in enumerate(items):
        if item["type"] == "item_reference":
            raise InvalidRequest("item_reference cannot be stored in a conversation; send the item itself",
                                 param=f"{where}[{i}]")


def _not_found(cid: str) -> NotFound:
    return NotFound(f"Conversation with id '{cid}' not found.", param="conversation_id", code="conversation_not_found")

