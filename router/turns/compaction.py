"""Counting a prompt's tokens and summarizing a conversation: what compaction needs.

Used by ``/v1/responses/compact``, ``/v1/responses/input_tokens`` and by a create's
``context_management`` (compact the older part when the prompt passes a threshold).
Harmony pools count exactly (the router renders the prompt); chat pools ask the
worker's ``POST /tokenize`` (vLLM), else read ``prompt_tokens`` of a ``max_tokens: 1`` call.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from backends.errors import NoHealthyWorker
from router.dialects.deltas import TextDelta, Usage
from router.dialects.turn import DialectTurn
from router.protocol.errors import NoCapacity, UpstreamError
from router.protocol.ids import new_id
from router.protocol.items import Item
from router.protocol.requests import CreateResponse, compact_threshold
from router.protocol.sealing import Sealer, expand_compactions, seal_compaction
from router.protocol.shapes import usage_object
from router.protocol.tools import ToolSet, build_toolset
from router.turns.prompt_ids import tokenize
from router.turns.route import ModelRoute
from router.turns.upstream import Upstream

log = logging.getLogger("router.turns")

SUMMARY_PROMPT = (
    "Summarize the conversation so far for yourself, so that it can continue from your summary alone: the user's "
    "goals and constraints, what was decided, facts and results established (tool results included), open "
    "questions, and where the work stands. Be concise and specific. Write only the summary."
)
# The summary's own output cap: a model that never stops gives a summary cut here (what the
# client's next turn reads), not a call that runs into the pool's read timeout.
SUMMARY_MAX_OUTPUT_TOKENS = 2048


async def summarize(route: ModelRoute, req: CreateResponse, items: list[Item], rid: str, *,
                    preferred: str | None = None, prefix_key: str | None = None) -> tuple[str, dict[str, Any]]:
    """One non-streamed model call over the conversation and the summarization prompt, of at most
    SUMMARY_MAX_OUTPUT_TOKENS (whatever the create's own cap for its answer)."""
    req = req.model_copy(update={"max_output_tokens": SUMMARY_MAX_OUTPUT_TOKENS})
    ask = {"type": "message", "id": new_id("msg"), "role": "user", "status": "completed",
           "content": [{"type": "input_text", "text": SUMMARY_PROMPT}]}
    turn = route.turn(req, build_toolset([], "none"), rid)
    upstream = Upstream(route.pool, req.model, truncate=False, preferred=preferred, prefix_key=prefix_key)
    answer, _ = await upstream.post(turn, [*items, ask])
    try:
        deltas = turn.completion(answer)
    except (ValueError, KeyError, TypeError) as exc:
        raise UpstreamError(f"the worker's answer could not be read: {exc}", code="upstream_error") from None
    text = "".join(d.text for d in deltas if isinstance(d, TextDelta)).strip()
    if not text:
        raise UpstreamError("the model returned no summary text", code="upstream_error")
    used = next((d for d in reversed(deltas) if isinstance(d, Usage)), None)
    usage = usage_object(used.input_tokens, used.output_tokens, used.cached_tokens, used.reasoning_tokens) \
        if used is not None else usage_object(0, 0)
    return text, usage


async def count_tokens(route: ModelRoute, req: CreateResponse, tools: ToolSet, items: list[Item]) -> int:
    """The prompt tokens a create with ``items`` would send."""
    if route.dialect == "harmony":
        return len(route.turn(req, tools, "count").prompt_ids(items))  # type: ignore[attr-defined]
    pool = route.pool
    turn = route.turn(req, tools, new_id("resp"))
    body = turn.request(items, stream=False)
    if pool.engine.name != "sglang":  # SGLang has no chat /tokenize
        count = await _tokenize(route, req, body)
        if count is not None:
            return count
    # Fallback: a one-token chat call; its usage says how long the prompt was.
    probe = {k: v for k, v in body.items() if k not in ("response_format", "logprobs", "top_logprobs", "stream_options")}
    probe["max_tokens"] = 1
    probe["stream"] = False
    upstream = Upstream(pool, req.model, truncate=False)
    answer, _ = await upstream.post(cast(DialectTurn, _Fixed(turn.path, probe)), items)
    prompt = (answer.get("usage") or {}).get("prompt_tokens") if isinstance(answer, dict) else None
    if not isinstance(prompt, int):
        raise UpstreamError("the worker's answer has no usage.prompt_tokens", code="upstream_error")
    return prompt


async def _tokenize(route: ModelRoute, req: CreateResponse, body: dict[str, Any]) -> int | None:
    """vLLM's chat /tokenize; None when no worker has it (or the call failed: the fallback then decides)."""
    try:
        answer = await tokenize(route.pool, body)
    except NoHealthyWorker:
        raise NoCapacity(f"no worker can serve model '{req.model}' now", code="no_healthy_worker") from None
    count = answer.get("count") if answer is not None else None
    return count if isinstance(count, int) else None


class _Fixed:
    """A DialectTurn-shaped request with a body made in advance (for Upstream's worker choice and errors)."""

    def __init__(self, path: str, body: dict[str, Any]) -> None:
        self.path = path
        self._body = body

    def request(self, items: list[Item], *, stream: bool) -> dict[str, Any]:
        return self._body


async def fold_history(route: ModelRoute, req: CreateResponse, tools: ToolSet, items: list[Item], *, sealer: Sealer,
                       owner: str, rid: str) -> tuple[Item, list[Item], Usage] | None:
    """``context_management``: past the threshold, the turns before the last user message become
    a summary. Returns the compaction item (emitted first), the prompt with it, and what the
    summary cost; None when there is nothing to fold."""
    threshold = compact_threshold(req)
    if threshold is None or await count_tokens(route, req, tools, items) <= threshold:
        return None
    users = [i for i, item in enumerate(items) if item["type"] == "message" and item["role"] == "user"]
    if len(users) < 2:
        return None  # only the current turn: nothing older to fold
    keep = users[-1]
    summary, usage = await summarize(route, req, items[:keep], rid + "-compact")
    compaction = seal_compaction(sealer, owner, req.model, summary, keep_from=items[keep]["id"])
    prompt = expand_compactions([*items[:keep + 1], *items[keep + 1:], compaction], sealer, owner, first_input=len(items) + 1)
    return compaction, prompt, Usage(usage["input_tokens"], usage["output_tokens"])
