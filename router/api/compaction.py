"""``/v1/responses/compact`` and ``/v1/responses/input_tokens``.

Compaction: the model's pool summarizes the conversation (history and input,
as ``prepare`` builds it for a create) in one non-streamed call of at most
``SUMMARY_MAX_OUTPUT_TOKENS`` (router/turns/compaction.py: a model that never stops gives a summary cut there), and the
client gets back its user messages verbatim and a ``compaction``
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
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.routing import Route

from router.api.auth import Authenticator
from router.api.http import Body, json_response, parse_model, read_body
from router.protocol.errors import NotFound
from router.protocol.ids import new_id
from router.protocol.items import Item
from router.protocol.requests import CreateResponse
from router.protocol.sealing import Sealer, expand_compactions, seal_compaction
from router.state.store import Store
from router.tools.registry import RouterTools
from router.turns.compaction import count_tokens, summarize
from router.turns.prepare import prepare
from router.turns.routing import ModelTarget
from router.turns.runner import ResponseRun

__all__ = ["CompactRequest", "CompactionAPI", "expand_compactions"]

log = logging.getLogger("router.api")



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

    async def compact(self, request: Request) -> Body:
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
        # As OpenAI's CompactedResponse has it: every user message, verbatim, then one compaction item.
        output = [i for i in items if i["type"] == "message" and i["role"] == "user"]
        output.append(seal_compaction(self.sealer, owner, req.model, summary))
        return json_response({"id": cid, "object": "response.compaction", "created_at": created_at, "output": output,
                              "usage": usage})

    async def _summarize(self, run: ResponseRun, req: CreateResponse, items: list[Item], rid: str) -> tuple[str, dict[str, Any]]:
        routing = run.routing
        return await summarize(run.route, req, items, rid, preferred=routing.preferred_worker if routing else None,
                               prefix_key=routing.prefix_key if routing else None)

    # -- input_tokens --------------------------------------------------------------------

    async def _with_model(self, body: bytes, owner: str) -> bytes:
        """A count may leave out ``model`` when it continues a response (the SDK types it optional):
        the previous response's model, then. Anything else goes to validation as it is."""
        try:
            fields = orjson.loads(body)
        except orjson.JSONDecodeError:
            return body
        if not isinstance(fields, dict) or fields.get("model") is not None:
            return body
        previous = fields.get("previous_response_id")
        if not isinstance(previous, str):
            return body  # parse_model says what is missing
        stored = await self.store.get_response(previous, owner)
        if stored is None:
            raise NotFound(f"Previous response with id '{previous}' not found.", param="previous_response_id",
                           code="previous_response_not_found")
        return orjson.dumps({**fields, "model": stored.get("model")})

    async def input_tokens(self, request: Request) -> Body:
        owner = self.auth.owner(request)
        body = await self._with_model(await read_body(request, self.max_body_bytes), owner)
        req = parse_model(CreateResponse, body)
        req = req.model_copy(update={"stream": False, "background": False, "store": False})
        run, items = await self._prepare(req, owner)
        count = await count_tokens(run.route, req, run.tools, items)
        return json_response({"object": "response.input_tokens", "input_tokens": count})
