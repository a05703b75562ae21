"""Input items as clients send them -> canonical Responses items, as stored.

Lenient on what clients replay (missing ``type``, ``id``, ``status``,
``annotations``; null ids), strict on what cannot be served: an item type
the router cannot handle is a 400 that names it, never silently dropped.
"""

from __future__ import annotations

from typing import Any

from router.protocol.errors import InvalidRequest
from router.protocol.ids import message_id

Item = dict[str, Any]

INPUT_ROLES = ("user", "system", "developer")
ROLES = (*INPUT_ROLES, "assistant")


def normalize_input(value: str | list[Any]) -> list[Item]:
    """The request's ``input`` as canonical items, each with an ``id``."""
    if isinstance(value, str):
        return [_message("user", [_text_part("input_text", value)], None)]
    return [normalize_item(raw, f"input[{i}]") for i, raw in enumerate(value)]


def normalize_item(raw: Any, where: str) -> Item:
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    kind = raw.get("type")
    if kind is None and "role" in raw:
        kind = "message"
    if kind == "message":
        return _normalize_message(raw, where)
    if kind is None:
        raise InvalidRequest(f"{where} has no 'type'", param=f"{where}.type")
    raise InvalidRequest(
        f"input item type {kind!r} is not supported by this router", param=f"{where}.type", code="unsupported_item_type"
    )


def _normalize_message(raw: Item, where: str) -> Item:
    role = raw.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role must be one of {', '.join(ROLES)} (got {role!r})", param=f"{where}.role")
    content = raw.get("content")
    if isinstance(content, str):
        parts = [_text_part("output_text" if role == "assistant" else "input_text", content)]
    elif isinstance(content, list):
        parts = [_normalize_part(part, role, f"{where}.content[{j}]") for j, part in enumerate(content)]
    else:
        raise InvalidRequest(f"{where}.content must be a string or a list of parts", param=f"{where}.content")
    return _message(role, parts, raw.get("id"), raw.get("status"))


def _normalize_part(part: Any, role: str, where: str) -> Item:
    if not isinstance(part, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    kind = part.get("type")
    text = part.get("text")
    if role == "assistant":
        if kind in ("output_text", "input_text", None) and isinstance(text, str):
            return _text_part("output_text", text, part.get("annotations"), part.get("logprobs"))
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            return {"type": "refusal", "refusal": part["refusal"]}
    elif kind in ("input_text", None) and isinstance(text, str):
        return _text_part("input_text", text)
    if kind in ("input_text", "output_text") and not isinstance(text, str):
        raise InvalidRequest(f"{where}.text must be a string", param=f"{where}.text")
    raise InvalidRequest(
        f"content part type {kind!r} is not supported for role {role!r}", param=f"{where}.type", code="unsupported_content_type"
    )


def _text_part(kind: str, text: str, annotations: Any = None, logprobs: Any = None) -> Item:
    if kind == "input_text":
        return {"type": "input_text", "text": text}
    part: Item = {"type": "output_text", "text": text, "annotations": annotations or []}
    if logprobs:
        part["logprobs"] = logprobs
    return part


def _message(role: str, parts: list[Item], item_id: Any, status: Any = None) -> Item:
    return {
        "type": "message",
        "id": item_id if isinstance(item_id, str) and item_id else message_id(),
        "role": role,
        "status": status if status in ("in_progress", "completed", "incomplete") else "completed",
        "content": parts,
    }


def message_text(item: Item) -> str:
    """The plain text of a message item's text parts (refusals included)."""
    out = []
    for part in item.get("content") or ():
        text = part.get("text")
        if text is None:
            text = part.get("refusal")
        if isinstance(text, str):
            out.append(text)
    return "".join(out)
