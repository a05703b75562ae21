"""``previous_response_id`` -> the list of Responses items the next turn continues."""

from __future__ import annotations

from typing import Any

from router.protocol.errors import InvalidRequest, NotFound
from router.protocol.items import CALLS, OUTPUTS, Item
from router.state.store import ResponseInProgress, Store


async def load_history(store: Store, previous_response_id: str | None, owner: str) -> list[Item]:
    if previous_response_id is None:
        return []
    try:
        items = await store.load_history(previous_response_id, owner)
    except ResponseInProgress:
        raise InvalidRequest(
            f"Previous response with id '{previous_response_id}' is still in progress; continue from it once it has "
            "finished (or cancel it).", param="previous_response_id", code="previous_response_in_progress") from None
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
    An item whose id the history or an earlier input item already has is a 400,
    as OpenAI answers it: the model would see it twice (a client resending the
    previous response's output along with ``previous_response_id``, say).
    """
    in_history = {item.get("id") for item in history}
    known: dict[Any, Item] = {**(stored or {}), **{item.get("id"): item for item in history}}
    seen = set(in_history)
    out: list[Item] = []
    for i, item in enumerate(input_items):
        if item["type"] == "item_reference":
            target = known.get(item["id"])
            if target is None:
                raise InvalidRequest(f"Item with id '{item['id']}' not found.", param=f"input[{i}].id", code="item_not_found")
            if item["id"] in in_history:
                continue
            item = target
        item_id = item.get("id")
        if item_id is not None:
            if item_id in seen:
                raise InvalidRequest(f"Duplicate item found with id {item_id}. Remove duplicate items from your input and "
                                     "try again.", param=f"input[{i}].id", code="duplicate_item")
            seen.add(item_id)
            known[item_id] = item
        out.append(item)
    return out


def check_tool_outputs(items: list[Item]) -> None:
    """Every tool output answers a call made earlier in the conversation, and every call has its
    output, as OpenAI checks both: a call left unanswered would reach the engine as an assistant
    turn without its tool result (which many chat templates refuse). Calls that cannot be answered
    are exempt: one cut off (``incomplete``) and one to a built-in tool of gpt-oss's that nothing
    here ran (``browser.search``, ``python``: the response ended ``tool_not_available``)."""
    made: set[str] = set()
    unanswered: dict[str, str] = {}  # call_id -> the kind of call
    for item in items:
        kind = item["type"]
        if kind in CALLS:
            call_id = item["call_id"]
            made.add(call_id)
            name = item.get("name") or ""
            if item.get("status") != "incomplete" and "." not in name and name != "python":
                unanswered[call_id] = kind
        elif kind in OUTPUTS:
            if item["call_id"] not in made:
                raise InvalidRequest(
                    f"No tool call found for function call output with call_id {item['call_id']}.",
                    param="input", code="tool_call_not_found",
                )
            unanswered.pop(item["call_id"], None)
    if unanswered:
        call_id, kind = next(iter(unanswered.items()))
        raise InvalidRequest(f"No tool output found for {CALLS[kind]} {call_id}.", param="input",
                             code="tool_output_not_found")
