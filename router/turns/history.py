"""``previous_response_id`` -> the list of Responses items the next turn continues."""

from __future__ import annotations

from router.protocol.errors import InvalidRequest, NotFound
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


def resolve_input(history: list[Item], input_items: list[Item], stored: dict[str, Item] | None = None) -> list[Item]:
    """This turn's input with ``item_reference``s replaced by the items they name.

    References resolve against the history, this input, then ``stored``
    (items found in the store by id). A reference to an item already in the
    history is dropped (the model sees it once); one to an unknown item is a 400.
    """
    in_history = {item.get("id") for item in history}
    known = {**(stored or {}), **{item.get("id"): item for item in history}}
    out: list[Item] = []
    for i, item in enumerate(input_items):
        if item["type"] == "item_reference":
            target = known.get(item["id"])
            if target is None:
                raise InvalidRequest(f"Item with id '{item['id']}' not found.", param=f"input[{i}].id", code="item_not_found")
            if item["id"] in in_history:
                continue
            item = target
        known[item.get("id")] = item
        out.append(item)
    return out


def check_tool_outputs(items: list[Item]) -> None:
    """Every tool output answers a call made earlier in the conversation."""
    calls: set[str] = set()
    for item in items:
        kind = item["type"]
        if kind in ("function_call", "custom_tool_call"):
            calls.add(item["call_id"])
        elif kind in ("function_call_output", "custom_tool_call_output") and item["call_id"] not in calls:
            raise InvalidRequest(
                f"No tool call found for function call output with call_id {item['call_id']}.",
                param="input", code="tool_call_not_found",
            )
