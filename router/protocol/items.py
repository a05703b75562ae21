"""Input items as clients send them -> canonical Responses items, as stored.

Lenient on what clients replay (missing ``type``, ``id``, ``status``,
``annotations``; null ids), strict on what cannot be served: an item type
the router cannot handle is a 400 that names it, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from router.protocol.errors import InvalidRequest
from router.protocol.ids import new_id

Item = dict[str, Any]

INPUT_ROLES = ("user", "system", "developer")
ROLES = (*INPUT_ROLES, "assistant")
STATUSES = ("in_progress", "completed", "incomplete")
PHASES = ("commentary", "final_answer")
IMAGE_DETAILS = ("low", "high", "auto", "original")
# Tool calls a client answers (with the words OpenAI's errors use for them), and their outputs.
CALLS = {"function_call": "function call", "custom_tool_call": "custom tool call"}
OUTPUTS = frozenset({"function_call_output", "custom_tool_call_output"})


def normalize_input(value: str | list[Any], make_id: Callable[[str], str] = new_id) -> list[Item]:
    """The request's ``input`` as canonical items, each with an ``id``: its own, else one from
    ``make_id`` (given the kind's prefix; a response's ``ItemIds`` in a create)."""
    if isinstance(value, str):
        item = _message("user", [{"type": "input_text", "text": value}], None)
        item["id"] = make_id("msg")
        return [item]
    return [normalize_item(raw, f"input[{i}]", make_id) for i, raw in enumerate(value)]


def normalize_item(raw: Any, where: str, make_id: Callable[[str], str] = new_id) -> Item:
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    kind = raw.get("type")
    if kind is None:
        if "role" in raw:
            kind = "message"
        elif set(raw) == {"id"}:
            kind = "item_reference"
        else:
            raise InvalidRequest(f"{where} has no 'type'", param=f"{where}.type")
    normalizer = _NORMALIZERS.get(kind) if isinstance(kind, str) else None
    if normalizer is None:
        raise InvalidRequest(
            f"input item type {kind!r} is not supported by this router", param=f"{where}.type", code="unsupported_item_type"
        )
    item = normalizer(raw, where)
    if item["id"] is None:
        item["id"] = make_id(_PREFIXES[kind])
    return item


# -- messages ------------------------------------------------------------------


def _normalize_message(raw: Item, where: str) -> Item:
    role = raw.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role must be one of {', '.join(ROLES)} (got {role!r})", param=f"{where}.role")
    content = raw.get("content")
    if isinstance(content, str):
        parts = [{"type": "output_text", "text": content, "annotations": []} if role == "assistant" else {"type": "input_text", "text": content}]
    elif isinstance(content, list):
        parts = [_normalize_part(part, role, f"{where}.content[{j}]") for j, part in enumerate(content)]
    else:
        raise InvalidRequest(f"{where}.content must be a string or a list of parts", param=f"{where}.content")
    item = _message(role, parts, raw.get("id"), raw.get("status"))
    phase = raw.get("phase")
    if phase is not None:
        if phase not in PHASES:
            raise InvalidRequest(f"{where}.phase must be one of {', '.join(PHASES)}", param=f"{where}.phase")
        item["phase"] = phase
    return item


def _normalize_part(part: Any, role: str, where: str) -> Item:
    if not isinstance(part, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    kind = part.get("type")
    if role == "assistant":
        if kind in ("output_text", "input_text", None):
            out: Item = {"type": "output_text", "text": _str(part, "text", where), "annotations": part.get("annotations") or []}
            if part.get("logprobs"):
                out["logprobs"] = part["logprobs"]
            return out
        if kind == "refusal":
            return {"type": "refusal", "refusal": _str(part, "refusal", where)}
    elif kind in ("input_text", None):
        return {"type": "input_text", "text": _str(part, "text", where)}
    elif kind == "input_image":
        return _image_part(part, where)
    elif kind == "input_file":
        return _file_part(part, where)
    raise InvalidRequest(
        f"content part type {kind!r} is not supported for role {role!r}", param=f"{where}.type", code="unsupported_content_type"
    )


def _image_part(part: Item, where: str) -> Item:
    url = part.get("image_url")
    if part.get("file_id") and not url:
        raise InvalidRequest("input_image by file_id needs the Files API, which this router does not serve; send image_url",
                             param=f"{where}.file_id", code="unsupported_parameter")
    if not isinstance(url, str) or not url.startswith(("http://", "https://", "data:")):
        raise InvalidRequest(f"{where}.image_url must be an http(s) or data: URL", param=f"{where}.image_url")
    detail = part.get("detail") or "auto"
    if detail not in IMAGE_DETAILS:
        raise InvalidRequest(f"{where}.detail must be one of {', '.join(IMAGE_DETAILS)}", param=f"{where}.detail")
    return {"type": "input_image", "image_url": url, "detail": detail}


def _file_part(part: Item, where: str) -> Item:
    if part.get("file_id") and not (part.get("file_data") or part.get("file_url")):
        raise InvalidRequest("input_file by file_id needs the Files API, which this router does not serve; send file_data or file_url",
                             param=f"{where}.file_id", code="unsupported_parameter")
    out: Item = {"type": "input_file"}
    for key in ("file_data", "file_url", "filename"):
        if part.get(key) is not None:
            out[key] = _str(part, key, where)
    if "file_data" not in out and "file_url" not in out:
        raise InvalidRequest(f"{where} needs file_data or file_url", param=where)
    return out


def _message(role: str, parts: list[Item], item_id: Any, status: Any = None) -> Item:
    return {
        "type": "message",
        "id": _id(item_id),
        "role": role,
        "status": status if status in STATUSES else "completed",
        "content": parts,
    }


# -- tool calls and their outputs ------------------------------------------------


def _normalize_function_call(raw: Item, where: str) -> Item:
    item: Item = {
        "type": "function_call",
        "id": _id(raw.get("id")),
        "call_id": _str(raw, "call_id", where),
        "name": _str(raw, "name", where),
        "arguments": _str(raw, "arguments", where),
        "status": raw.get("status") if raw.get("status") in STATUSES else "completed",
    }
    if raw.get("namespace"):
        item["namespace"] = _str(raw, "namespace", where)
    return item


def _normalize_function_call_output(raw: Item, where: str) -> Item:
    output = raw.get("output")
    if isinstance(output, list):
        output = [_output_part(part, f"{where}.output[{j}]") for j, part in enumerate(output)]
    elif not isinstance(output, str):
        raise InvalidRequest(f"{where}.output must be a string or a list of content parts", param=f"{where}.output")
    return {
        "type": raw["type"],
        "id": _id(raw.get("id")),
        "call_id": _str(raw, "call_id", where),
        "output": output,
        "status": raw.get("status") if raw.get("status") in STATUSES else "completed",
    }


def _output_part(part: Any, where: str) -> Item:
    if isinstance(part, dict) and part.get("type") in ("input_text", "output_text"):
        return {"type": "input_text", "text": _str(part, "text", where)}
    if isinstance(part, dict) and part.get("type") == "input_image":
        return _image_part(part, where)
    if isinstance(part, dict) and part.get("type") == "input_file":
        return _file_part(part, where)
    raise InvalidRequest(f"{where} must be an input_text, input_image or input_file part", param=f"{where}.type",
                         code="unsupported_content_type")


def _normalize_custom_tool_call(raw: Item, where: str) -> Item:
    return {
        "type": "custom_tool_call",
        "id": _id(raw.get("id")),
        "call_id": _str(raw, "call_id", where),
        "name": _str(raw, "name", where),
        "input": _str(raw, "input", where),
        "status": raw.get("status") if raw.get("status") in STATUSES else "completed",
    }


def _normalize_reasoning(raw: Item, where: str) -> Item:
    item: Item = {"type": "reasoning", "id": _id(raw.get("id")), "summary": []}
    for key, part_type in (("summary", "summary_text"), ("content", "reasoning_text")):
        parts = raw.get(key) or []
        if not isinstance(parts, list):
            raise InvalidRequest(f"{where}.{key} must be a list", param=f"{where}.{key}")
        item[key] = [{"type": part_type, "text": _str(p, "text", f"{where}.{key}[{j}]")} for j, p in enumerate(parts)]
    if raw.get("encrypted_content") is not None:
        item["encrypted_content"] = _str(raw, "encrypted_content", where)
    return item


def _normalize_reference(raw: Item, where: str) -> Item:
    return {"type": "item_reference", "id": _str(raw, "id", where)}


def _normalize_compaction(raw: Item, where: str) -> Item:
    """A compaction item from ``/v1/responses/compact``, replayed as sent (it is opened when the prompt is built)."""
    return {"type": "compaction", "id": _id(raw.get("id")), "encrypted_content": _str(raw, "encrypted_content", where)}


def _normalize_tool_item(required: tuple[str, ...]) -> Callable[[Item, str], Item]:
    """Router-run tool items replayed by a client: kept as sent, with an id and the fields the loop reads."""

    def normalize(raw: Item, where: str) -> Item:
        for key in required:
            _str(raw, key, where)
        item = dict(raw)
        item["id"] = _id(raw.get("id"))
        return item

    return normalize


# Each leaves ``id`` None when the client sent none; ``normalize_item`` names the item then.
_NORMALIZERS: dict[str, Callable[[Item, str], Item]] = {
    "mcp_list_tools": _normalize_tool_item(("server_label",)),
    "mcp_call": _normalize_tool_item(("server_label", "name", "arguments")),
    "mcp_approval_request": _normalize_tool_item(("server_label", "name", "arguments")),
    "mcp_approval_response": _normalize_tool_item(("approval_request_id",)),
    "web_search_call": _normalize_tool_item(()),
    "code_interpreter_call": _normalize_tool_item(()),
    "message": _normalize_message,
    "function_call": _normalize_function_call,
    "function_call_output": _normalize_function_call_output,
    "custom_tool_call": _normalize_custom_tool_call,
    "custom_tool_call_output": _normalize_function_call_output,
    "reasoning": _normalize_reasoning,
    "item_reference": _normalize_reference,
    "compaction": _normalize_compaction,
}


# -- helpers -------------------------------------------------------------------


def _str(obj: Any, key: str, where: str) -> str:
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, str):
        raise InvalidRequest(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def _id(value: Any) -> str | None:
    """The client's id for an item, when it sent a usable one."""
    return value if isinstance(value, str) and value else None


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


# The id prefix of each kind's items (OpenAI's own, where it has one).
_PREFIXES = {
    "mcp_list_tools": "mcpl", "mcp_call": "mcp", "mcp_approval_request": "mcpr", "mcp_approval_response": "mcpa",
    "web_search_call": "ws", "code_interpreter_call": "ci", "message": "msg", "function_call": "fc",
    "function_call_output": "fco", "custom_tool_call": "ctc", "custom_tool_call_output": "fco", "reasoning": "rs",
    "compaction": "cmpi",  # (an item_reference always has its id)
}
