"""The Response object and its parts, as plain dicts (hot paths skip pydantic)."""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

from router.protocol.requests import CreateResponse
from router.protocol.tools import echo_tools

ECHOED_HINTS = ("prompt_cache_retention", "prompt_cache_options", "background_options", "client_metadata")


def response_object(req: CreateResponse, *, response_id: str, created_at: int | None = None) -> dict[str, Any]:
    """A Response in ``in_progress`` state, echoing the request's settings.

    Every key the SDK requires and the Open Responses schema lists is present,
    with numbers (not nulls) for sampling settings.
    """
    text = dict(req.text) if req.text else {}
    text.setdefault("format", {"type": "text"})
    text.setdefault("verbosity", req.verbosity or "medium")
    response: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at if created_at is not None else int(time.time()),
        "completed_at": None,
        "status": "in_progress",
        "background": req.background,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "model": req.model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "conversation": None,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": (req.reasoning or {}).get("summary")},
        "service_tier": req.service_tier or "default",
        "store": req.store,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": text,
        "tool_choice": req.tool_choice,
        "tools": echo_tools(req.tools),
        "top_logprobs": req.top_logprobs or 0,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "truncation": req.truncation or "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
        "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key,
    }
    # Hints for OpenAI's own cache and scheduling, with no effect here: returned as sent, so the
    # client sees they were taken as they were (router/protocol/fields.py says so per field).
    for name in ECHOED_HINTS:
        value = getattr(req, name)
        if value is not None:
            response[name] = value
    generate_summary = (req.reasoning or {}).get("generate_summary")
    if generate_summary is not None:
        response["reasoning"] = {**response["reasoning"], "generate_summary": generate_summary}
    return response


# The codes a Response's ``error`` has in OpenAI's API (the SDK's ``ResponseError.code``, a closed
# set). A failure of the router's own (``upstream_error``, ``router_stopped``, ...) is a
# ``server_error`` there; the streamed ``error`` event, whose code is free, keeps the precise one.
RESPONSE_ERROR_CODES = frozenset({
    "server_error", "rate_limit_exceeded", "invalid_prompt", "data_residency_mismatch", "bio_policy",
    "misalignment_policy_violation", "vector_store_timeout", "invalid_image", "invalid_image_format",
    "invalid_base64_image", "invalid_image_url", "image_too_large", "image_too_small", "image_parse_error",
    "image_content_policy_violation", "invalid_image_mode", "image_file_too_large", "unsupported_image_media_type",
    "empty_image_file", "failed_to_download_image", "image_file_not_found",
})


def response_error(code: str | None, message: str) -> dict[str, Any]:
    """A failed Response's ``error``."""
    return {"code": code if code in RESPONSE_ERROR_CODES else "server_error", "message": message}


def usage_object(input_tokens: int, output_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0) -> dict[str, Any]:
    # No engine reports what it wrote to its prefix cache: cache_write_tokens (required by the SDK's type) is 0.
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cache_write_tokens": 0, "cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


# -- what ``include`` adds ---------------------------------------------------------
# The stored response keeps all of it (a later retrieve that asks sees it; the next turn's
# prompt gives the model its tools' results); a create, its events and a retrieve show it
# only when ``include`` names it, as OpenAI's do.

OUTPUTS = "code_interpreter_call.outputs"
# web_search_call.results: the search's results, which here are the sources it returned.
SOURCES = frozenset({"web_search_call.action.sources", "web_search_call.results"})
IMAGE_URLS = "message.input_image.image_url"


# The item types ``include`` can hide parts of, and mcp_list_tools (an ``error`` stored as an object
# is shown as the string the API types it): any other item is shown whole, without a call.
VIEWED = frozenset({"code_interpreter_call", "web_search_call", "mcp_list_tools"})


def listing_error(error: Any) -> str | None:
    """An ``mcp_list_tools.error`` as the API types it, a string. Earlier versions of this router
    stored an object there (``{"type": "http_error", "code": 502, "message": ...}``): its message."""
    if error is None or isinstance(error, str):
        return error
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) and message else str(error)


def item_view(item: dict[str, Any], include: Collection[str]) -> dict[str, Any]:
    """An output item as a client sees it: a code_interpreter_call's ``outputs`` null and a
    search's ``action.sources`` left out unless ``include`` names them, an mcp_list_tools ``error``
    a string (``listing_error``). ``item`` itself when
    nothing is left out; else a copy (``item`` is never changed)."""
    kind = item.get("type")
    if kind == "code_interpreter_call":
        if item.get("outputs") is not None and OUTPUTS not in include:
            return {**item, "outputs": None}
    elif kind == "web_search_call":
        action = item.get("action")
        if isinstance(action, dict) and "sources" in action and SOURCES.isdisjoint(include):
            return {**item, "action": {key: value for key, value in action.items() if key != "sources"}}
    elif kind == "mcp_list_tools":
        error = item.get("error")
        if error is not None and not isinstance(error, str):
            return {**item, "error": listing_error(error)}
    return item


def response_view(body: dict[str, Any], include: Collection[str]) -> dict[str, Any]:
    """A Response as a client sees it (``item_view`` of each output item); ``body`` itself when
    nothing is left out."""
    output = body.get("output") or []
    if not any(item.get("type") in VIEWED for item in output):  # nothing to hide: the usual answer
        return body
    shown = [item_view(item, include) for item in output]
    if all(a is b for a, b in zip(shown, output)):
        return body
    return {**body, "output": shown}


def input_item_view(item: dict[str, Any], include: Collection[str]) -> dict[str, Any]:
    """An input item as a listing shows it: a message's ``input_image`` parts without their
    ``image_url`` (null) unless ``include`` names ``message.input_image.image_url``."""
    if IMAGE_URLS in include or item.get("type") != "message":
        return item
    parts = item.get("content")
    if not isinstance(parts, list) or not any(isinstance(p, dict) and p.get("type") == "input_image" for p in parts):
        return item
    return {**item, "content": [{**p, "image_url": None} if isinstance(p, dict) and p.get("type") == "input_image" else p
                                for p in parts]}
