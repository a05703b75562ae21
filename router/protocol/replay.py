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


# The text fields of content parts that grow as a stream runs, and the delta event that grows each.
_PART_DELTAS = {"output_text": ("text", "response.output_text.delta"),
                "reasoning_text": ("text", "response.reasoning_text.delta"),
                "refusal": ("refusal", "response.refusal.delta")}


def growth(before: list[Item], after: list[Item]) -> list[Event]:
    """Events that take the output ``before`` to ``after`` for ``output_of``, with no
    ``sequence_number``: what a running stream's checkpoint appends to its log, rather than
    writing its whole output again (router/turns/record.py).

    A part whose text only grew gets one delta of what is new; an item new or changed in any
    other way is logged whole (``output_item.done`` once it is ``completed``, so later events
    leave it alone; ``added`` while it may still change). ``output_of(log + growth(before,
    after))`` is ``after`` when ``output_of(log)`` was ``before``, open items ``incomplete``.
    """
    events: list[Event] = []
    for index, item in enumerate(after):
        old = before[index] if index < len(before) else None
        if old == item:
            continue
        deltas = _deltas(old, item, index) if old is not None else None
        if deltas is None:
            kind = "response.output_item.done" if item.get("status") == "completed" else "response.output_item.added"
            events.append({"type": kind, "output_index": index, "item": item})
        else:
            events += deltas
    return events


def _deltas(old: Item, new: Item, index: int) -> list[Event] | None:
    """The deltas that make ``old`` into ``new`` when only its parts' texts grew, else None."""
    parts, was = new.get("content"), old.get("content")
    if (not isinstance(parts, list) or not isinstance(was, list) or len(parts) < len(was)
            or new.get("status") == "completed" or any(old.get(k) != v for k, v in new.items() if k != "content")
            or len(old) != len(new)):
        return None
    events: list[Event] = []
    for k, part in enumerate(parts):
        if k >= len(was):
            events.append({"type": "response.content_part.added", "output_index": index, "content_index": k,
                           "item_id": new.get("id"), "part": part})
            continue
        prior = was[k]
        if prior == part:
            continue
        grows = _PART_DELTAS.get(part.get("type") or "") if isinstance(part, dict) else None
        if grows is None or not isinstance(prior, dict) or len(prior) != len(part):
            return None
        field, kind = grows
        if any(prior.get(key) != value for key, value in part.items() if key != field):
            return None
        text, grown = prior.get(field), part.get(field)
        if not isinstance(text, str) or not isinstance(grown, str) or not grown.startswith(text):
            return None
        events.append({"type": kind, "output_index": index, "content_index": k, "item_id": new.get("id"),
                       "delta": grown[len(text):]})
    return events
