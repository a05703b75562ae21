"""Responses items <-> chat completions, as vLLM and SGLang speak them.

Pure translation: no I/O, so it is tested on plain data.
"""

from __future__ import annotations

from typing import Any

from router.dialects.deltas import Delta, Finish, TextDelta, Usage
from router.protocol.items import Item

# Roles a chat template reliably knows; "developer" is OpenAI's newer name for system.
_CHAT_ROLE = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def to_messages(items: list[Item], instructions: str | None) -> list[dict[str, Any]]:
    """Items (history + this turn's input) -> chat messages, instructions first."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        if item.get("type") == "message":
            messages.append({"role": _CHAT_ROLE[item["role"]], "content": _content(item["content"])})
    return messages


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    texts = [p["text"] if "text" in p else p.get("refusal", "") for p in parts]
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": text} for text in texts]


def chat_request(
    messages: list[dict[str, Any]],
    *,
    model: str,
    stream: bool,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    request_id: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    if top_p is not None:
        body["top_p"] = top_p
    if request_id is not None:
        body["request_id"] = request_id
    return body


def chunk_deltas(chunk: dict[str, Any]) -> list[Delta]:
    """One streamed ``chat.completion.chunk`` -> deltas."""
    out: list[Delta] = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if content:
            out.append(TextDelta(content))
        reason = choice.get("finish_reason")
        if reason:
            out.append(Finish(_finish(reason)))
    usage = chunk.get("usage")
    if usage:
        out.append(_usage(usage))
    return out


def completion_deltas(body: dict[str, Any]) -> list[Delta]:
    """A whole non-streamed ``chat.completion`` -> the same deltas a stream would give."""
    out: list[Delta] = []
    for choice in body.get("choices") or ():
        message = choice.get("message") or {}
        content = message.get("content")
        if content:
            out.append(TextDelta(content))
        out.append(Finish(_finish(choice.get("finish_reason") or "stop")))
    usage = body.get("usage")
    if usage:
        out.append(_usage(usage))
    return out


def _finish(reason: str) -> Any:
    return reason if reason in ("stop", "length", "tool_calls", "content_filter") else "stop"


def _usage(usage: dict[str, Any]) -> Usage:
    details = usage.get("prompt_tokens_details") or {}
    return Usage(
        input_tokens=int(usage.get("prompt_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
        reasoning_tokens=int(usage.get("reasoning_tokens") or 0),
    )
