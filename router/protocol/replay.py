"""A response's output items rebuilt from its stream events, as a client accumulating them would.

For a background response whose router died mid-run: the event log holds what it
had produced, the stored response only what was put before (``output: []`` at
``in_progress``). The sweep that marks it failed keeps this instead, so the
response and its log agree ("with what it had", as for a stopped stream). Items
that were still open are ``incomplete``, as the assembler leaves an item cut
off. Pure: events in, items out.
"""

from __future__ import annotations

import copy
from typing import Any

Event = dict[str, Any]
Item = dict[str, Any]

# Delta events: (the list of the item holding the part, or None for the item itself; the field).
_DELTAS: dict[str, tuple[str | None, str]] = {
    "response.output_text.delta": ("content", "text"),
    "response.refusal.delta": ("content", "refusal"),
    "response.reasoning_text.delta": ("content", "text"),
    "response.reasoning.delta": ("content", "text"),  # the Open Responses name (a request's reasoning_events)
    "response.reasoning_summary_text.delta": ("summary", "text"),
    "response.function_call_arguments.delta": (None, "arguments"),
    "response.mcp_call_arguments.delta": (None, "arguments"),
    "response.custom_tool_call_input.delta": (None, "input"),
    "response.code_interpreter_call_code.delta": (None, "code"),
}
# Their ``.done`` events carry the whole value under the same field (``arguments``, ``text``, ...).
_DONES = {kind.removesuffix(".delta") + ".done": where for kind, where in _DELTAS.items()}


def output_of(events: list[Event]) -> list[Item]:
    """The output the events built; an item added but never done is ``incomplete``."""
    output: dict[int, Item] = {}
    done: set[int] = set()
    for event in events:
        kind = event.get("type")
        index: Any = event.get("output_index")  # the logged JSON: an int on the events that carry one
        if kind == "response.output_item.added" or kind == "response.output_item.done":
            output[index] = copy.deepcopy(event["item"])
            if kind == "response.output_item.done":
                done.add(index)
            continue
        item = output.get(index) if isinstance(index, int) else None
        if item is None or index in done:
            continue
        if kind in ("response.content_part.added", "response.content_part.done"):
            _put(item.setdefault("content", []), event.get("content_index"), copy.deepcopy(event["part"]))
        elif kind in ("response.reasoning_summary_part.added", "response.reasoning_summary_part.done"):
            _put(item.setdefault("summary", []), event.get("summary_index"), copy.deepcopy(event["part"]))
        elif kind == "response.output_text.annotation.added":
            part = _part(item, "content", event.get("content_index"))
            if part is not None:
                part.setdefault("annotations", []).append(copy.deepcopy(event["annotation"]))
        elif kind in _DELTAS:
            _grow(item, event, *_DELTAS[kind], event.get("delta", ""), append=True)
        elif kind in _DONES:
            where, field = _DONES[kind]
            _grow(item, event, where, field, event.get(field, ""), append=False)
    items = [output[i] for i in sorted(output)]
    for i, item in zip(sorted(output), items):
        if i not in done and "status" in item:
            item["status"] = "incomplete"
    return items


def _grow(item: Item, event: Event, where: str | None, field: str, value: Any, *, append: bool) -> None:
    target = item if where is None else _part(item, where, event.get("summary_index" if where == "summary" else "content_index"))
    if target is None or not isinstance(value, str):
        return
    target[field] = (target.get(field) or "") + value if append else value


def _part(item: Item, where: str, index: Any) -> dict[str, Any] | None:
    parts = item.get(where)
    if not isinstance(parts, list) or not isinstance(index, int) or not 0 <= index < len(parts):
        return None
    part = parts[index]
    return part if isinstance(part, dict) else None


def _put(parts: list[Any], index: Any, part: Any) -> None:
    if not isinstance(index, int) or index < 0:
        return
    if index < len(parts):
        parts[index] = part
    elif index == len(parts):
        parts.append(part)
