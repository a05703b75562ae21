"""``previous_response_id`` -> the list of Responses items the next turn continues."""

from __future__ import annotations

from router.protocol.errors import NotFound
from router.protocol.items import Item
from router.state.store import Store


async def load_history(store: Store, previous_response_id: str | None, owner: str) -> list[Item]:
    if previous_response_id is None:
        return []
    items = await store.load_history(previous_response_id, owner)
    if items is None:
        raise NotFound(
            f"Previous response with id '{previous_response_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return items
