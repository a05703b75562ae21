"""``/v1/responses/compact`` and ``/v1/responses/input_tokens``.

Compaction: the model's pool summarizes the conversation (history and input,
as ``prepare`` builds it for a create) in one non-streamed call, and the
client gets back the most recent user message verbatim and a ``compaction``
item whose ``encrypted_content`` is the summary sealed by the router
(purpose ``compaction``, with the model and the owner inside). Sent back as
input, the item is opened by ``expand_compactions`` (router/protocol/sealing.py)
and the model sees the summary as a developer message.

Input tokens: the prompt a create with the same body would send, counted.
Harmony pools: exactly, the router renders it. Chat pools: the worker's
``POST /tokenize`` (vLLM; chat form with ``messages`` and
``add_generation_prompt``), else the ``prompt_tokens`` of a ``max_tokens: 1``
chat call (SGLang, the sim, a vLLM without /tokenize).
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from backends.client import WorkerError, WorkerHTTPError, WorkerUnavailable
from backends.pools import NoHealthyWorker
from router.api.auth import Authenticator
from router.api.http import json_response, parse_model, read_body
from router.dialects.deltas import TextDelta, Usage
from router.dialects.turn import DialectTurn
from router.protocol.errors import NoCapacity, UpstreamError
from router.protocol.ids import new_id
from router.protocol.items import Item
from router.protocol.requests import CreateResponse
from router.protocol.sealing import COMPACTION, Sealer, expand_compactions
from router.protocol.shapes import usage_object
from router.protocol.tools import build_toolset
from router.state.store import Store
from router.tools.registry import RouterTools
from router.turns.prepare import prepare
from router.turns.routing import ModelTarget
from router.turns.runner import ResponseRun
from router.turns.upstream import Upstream

__all__ = ["CompactRequest", "CompactionAPI", "expand_compactions"]

log = logging.getLogger("router.api")

SUMMARY_PROMPT = (
    "Summarize the conversation so far for yourself, so that it can continue from your summary alone: the user's "
    "goals and constraints, what was decided, facts and results established (tool results included), open "
    "questions, and where the work stands. Be concise and specific. Write only the summary."
)
TOKENIZE_PATH = "/tokenize"  # vLLM's, at the server root


class CompactRequest(BaseModel):
    """The body of ``POST /v1/responses/compact``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    input: str | list[Any] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None  # a hint for OpenAI's cache; nothing to do here
    service_tier: str | None = None  # likewise


class CompactionAPI:
    def __init__(self, *, store: Store, models: dict[str, ModelTarget], auth: Authenticator, max_body_bytes: int,
                 sealer: Sealer, ttl_s: int | None = None, router_tools: RouterTools | None = None) -> None:
        self.store = store
        self.models = models
        self.auth = auth
        self.max_body_bytes = max_body_bytes
        self.sealer = sealer
        self.ttl_s = ttl_s
        self.router_tools = router_tools
        self._no_tokenize: set[str] = set()  # worker urls that answered /tokenize with 404/405/501

    def routes(self) -> list[Route]:
        return [
            Route("/v1/responses/compact", self.compact, methods=["POST"]),
            Route("/v1/responses/input_tokens", self.input_tokens, methods=["POST"]),
        ]

    async def _prepare(self, req: CreateResponse, owner: str) -> tuple[ResponseRun, list[Item]]:
        """The run a create would make, and its prompt (compactions and encrypted reasoning opened by prepare)."""
        run = await prepare(req, owner, store=self.store, models=self.models, ttl_s=self.ttl_s,
                            router_tools=self.router_tools, sealer=self.sealer)
        return run, run.prompt_items

    # -- compact -----------------------------------------------------------------------

    async def compact(self, request: Request) -> Response:
        owner = self.auth.owner(request)
        body = parse_model(CompactRequest, await read_body(request, self.max_body_bytes))
        req = CreateResponse.model_validate({
            "model": body.model, "input": body.input, "instructions": body.instructions,
            "previous_response_id": body.previous_response_id, "prompt_cache_key": body.prompt_cache_key, "store": False,
        })
        run, items = await self._prepare(req, owner)
        cid = new_id("cmp")
        summary, usage = await self._summarize(run, req, items, cid)
        created_at = int(time.time())
        item_id = new_id("cmpi")
        sealed = self.sealer.seal(COMPACTION, {"summary": summary, "model": req.model, "owner": owner,
                                               "id": item_id, "created_at": created_at})
        last_user = next((i for i in reversed(items) if i["type"] == "message" and i["role"] == "user"), None)
        output = [last_user] if last_user is not None else []
        output.append({"id": item_id, "type": "compaction", "encrypted_content": sealed})
        return json_response({"id": cid, "object": "response.compaction", "created_at": created_at, "output": output,
                              "usage": usage})

    async def _summarize(self, run: ResponseRun, req: CreateResponse, items: list[Item], rid: str) -> tuple[str, dict[str, Any]]:
        """One non-streamed model call over the conversation and the summarization prompt."""
        ask = {"type": "message", "id": new_id("msg"), "role": "user", "status": "completed",
               "content": [{"type": "input_text", "text": SUMMARY_PROMPT}]}
        turn = run.route.turn(req, build_toolset([], "none"), rid)
        routing = run.routing
        upstream = Upstream(run.route.pool, req.model, truncate=False,
                            preferred=routing.preferred_worker if routing else None,
                            prefix_key=routing.prefix_key if routing else None)
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

    # -- input_tokens --------------------------------------------------------------------

    async def input_tokens(self, request: Request) -> Response:
        owner = self.auth.owner(request)
        req = parse_model(CreateResponse, await read_body(request, self.max_body_bytes))
        req = req.model_copy(update={"stream": False, "background": False, "store": False})
        run, items = await self._prepare(req, owner)
        if run.route.dialect == "harmony":
            count = _harmony_count(run, req, items)
        else:
            count = await self._chat_count(run, req, items)
        return json_response({"object": "response.input_tokens", "input_tokens": count})

    async def _chat_count(self, run: ResponseRun, req: CreateResponse, items: list[Item]) -> int:
        pool = run.route.pool
        turn = run.route.turn(req, run.tools, new_id("resp"))
        body = turn.request(items, stream=False)
        if pool.engine.name != "sglang":  # SGLang has no chat /tokenize
            count = await self._tokenize(run, body)
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

    async def _tokenize(self, run: ResponseRun, body: dict[str, Any]) -> int | None:
        """vLLM's chat /tokenize; None when the worker has none (or failed: the fallback then decides)."""
        pool = run.route.pool
        try:
            worker = pool.pick(exclude=[w for w in pool.workers if w.url in self._no_tokenize])
        except NoHealthyWorker:
            if not any(w.healthy for w in pool.workers):
                raise NoCapacity(f"no worker can serve model '{run.req.model}' now", code="no_healthy_worker") from None
            return None  # healthy workers, none with /tokenize
        tokenize = {"model": body["model"], "messages": body["messages"], "add_generation_prompt": True}
        for key in ("tools", "chat_template_kwargs"):
            if key in body:
                tokenize[key] = body[key]
        worker.in_flight += 1
        try:
            answer = await pool.client.post_json(worker.url + TOKENIZE_PATH, tokenize)
        except WorkerHTTPError as exc:
            if exc.status in (404, 405, 501):
                self._no_tokenize.add(worker.url)
                log.info("pool %s: %s has no %s; counting input tokens with a one-token call",
                         pool.name, worker.url, TOKENIZE_PATH)
            return None
        except WorkerUnavailable as exc:
            pool.mark_down(worker, str(exc))
            return None
        except WorkerError:
            return None
        finally:
            worker.in_flight -= 1
        count = answer.get("count") if isinstance(answer, dict) else None
        return count if isinstance(count, int) else None


class _Fixed:
    """A DialectTurn-shaped request with a body made in advance (for Upstream's worker choice and errors)."""

    def __init__(self, path: str, body: dict[str, Any]) -> None:
        self.path = path
        self._body = body

    def request(self, items: list[Item], *, stream: bool) -> dict[str, Any]:
        return self._body


def _harmony_count(run: ResponseRun, req: CreateResponse, items: list[Item]) -> int:
    """Exactly what a harmony turn would render for these items."""
    return len(run.route.turn(req, run.tools, "count").prompt_ids(items))  # type: ignore[attr-defined]
