"""A Store that hands every call to another store: the base of views that change a few calls
(router/api/websocket.py's CachedStore answers some reads from a connection's cache).

Each member of the contract is forwarded by name, so a view is a Store to the type checkers
member by member (a ``__getattr__`` would hide a member the view lacks), and a call costs one
await more, not a failed attribute lookup first. Each call reads the wrapped store's method
when it is made, as a ``__getattr__`` would.
"""

from __future__ import annotations

from typing import Any

from router.state.store import Conversation, Item, ItemPage, Order, Settle, Store, StoredResponse


class ForwardingStore:
    """Every ``Store`` member, forwarded to ``self._store``."""

    def __init__(self, store: Store) -> None:
        self._store = store

    # -- ResponseStore

    async def open(self) -> None:
        await self._store.open()

    async def close(self) -> None:
        await self._store.close()

    async def ping(self) -> None:
        await self._store.ping()

    async def put_response(self, response: StoredResponse) -> None:
        await self._store.put_response(response)

    async def get_response(self, response_id: str, owner: str) -> dict[str, Any] | None:
        return await self._store.get_response(response_id, owner)

    async def load_history(self, response_id: str, owner: str) -> list[Item] | None:
        return await self._store.load_history(response_id, owner)

    async def delete_response(self, response_id: str, owner: str) -> bool:
        return await self._store.delete_response(response_id, owner)

    async def list_input_items(self, response_id: str, owner: str, *, after: str | None = None, limit: int = 20,
                               order: Order = "desc") -> ItemPage | None:
        return await self._store.list_input_items(response_id, owner, after=after, limit=limit, order=order)

    async def purge_expired(self, now: int) -> int:
        return await self._store.purge_expired(now)

    async def set_routing(self, response_id: str, routing: dict[str, Any]) -> None:
        await self._store.set_routing(response_id, routing)

    async def get_routing(self, response_id: str, owner: str) -> dict[str, Any] | None:
        return await self._store.get_routing(response_id, owner)

    async def get_items(self, item_ids: list[str], owner: str) -> dict[str, Item]:
        return await self._store.get_items(item_ids, owner)

    # -- ConversationStore

    async def create_conversation(self, conversation: Conversation, items: list[Item]) -> None:
        await self._store.create_conversation(conversation, items)

    async def get_conversation(self, conversation_id: str, owner: str) -> Conversation | None:
        return await self._store.get_conversation(conversation_id, owner)

    async def update_conversation(self, conversation_id: str, owner: str, metadata: dict[str, str]) -> Conversation | None:
        return await self._store.update_conversation(conversation_id, owner, metadata)

    async def delete_conversation(self, conversation_id: str, owner: str) -> bool:
        return await self._store.delete_conversation(conversation_id, owner)

    async def add_conversation_items(self, conversation_id: str, owner: str, items: list[Item]) -> int | None:
        return await self._store.add_conversation_items(conversation_id, owner, items)

    async def load_conversation(self, conversation_id: str, owner: str) -> list[Item] | None:
        return await self._store.load_conversation(conversation_id, owner)

    async def load_conversation_with_end(self, conversation_id: str, owner: str) -> tuple[list[Item], int] | None:
        return await self._store.load_conversation_with_end(conversation_id, owner)

    async def list_conversation_items(self, conversation_id: str, owner: str, *, after: str | None = None, limit: int = 20,
                                      order: Order = "desc") -> ItemPage | None:
        return await self._store.list_conversation_items(conversation_id, owner, after=after, limit=limit, order=order)

    async def get_conversation_item(self, conversation_id: str, owner: str, item_id: str) -> Item | None:
        return await self._store.get_conversation_item(conversation_id, owner, item_id)

    async def delete_conversation_item(self, conversation_id: str, owner: str, item_id: str) -> bool:
        return await self._store.delete_conversation_item(conversation_id, owner, item_id)

    # -- BackgroundStore

    def reachable_s(self) -> float:
        return self._store.reachable_s()

    async def append_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        await self._store.append_events(response_id, events)

    async def read_events(self, response_id: str, owner: str, *, after: int = -1, limit: int = 1000) -> list[dict[str, Any]] | None:
        return await self._store.read_events(response_id, owner, after=after, limit=limit)

    async def renew_leases(self, response_ids: list[str], holder: str, until: float) -> None:
        await self._store.renew_leases(response_ids, holder, until)

    async def request_cancel(self, response_id: str, owner: str) -> bool:
        return await self._store.request_cancel(response_id, owner)

    async def cancel_requested(self, response_ids: list[str]) -> set[str]:
        return await self._store.cancel_requested(response_ids)

    async def fail_abandoned(self, now: float, error: dict[str, Any], settle: Settle | None = None) -> list[str]:
        return await self._store.fail_abandoned(now, error, settle)
