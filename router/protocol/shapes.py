"""The Response object and its parts, as plain dicts (hot paths skip pydantic)."""

from __future__ import annotations

import time
from typing import Any

from router.protocol.requests import CreateResponse
from router.protocol.tools import echo_tools


def response_object(req: CreateResponse, *, response_id: str, created_at: int | None = None) -> dict[str, Any]:
    """A Response in ``in_progress`` state, echoing the request's settings.

    Every key the SDK requires and the Open Responses schema lists is present,
    with numbers (not nulls) for sampling settings.
    """
    text = dict(req.text) if req.text else {}
    text.setdefault("format", {"type": "text"})
    text.setdefault("verbosity", req.verbosity or "medium")
    return {
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


def usage_object(input_tokens: int, output_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }
