"""The prepare stage: a validated request -> a ResponseRun ready to go: route, tools, history, prompt.

Everything that can be refused is refused here, before any worker is called
or anything is stored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from router import telemetry
from router.dialects.chat import refused_options
from router.dialects.engine_options import refused_on_generate
from router.protocol.errors import InvalidRequest, NotFound
from router.protocol.ids import ItemIds, response_id
from router.protocol.items import Item, message_text, normalize_input
from router.protocol.requests import CreateResponse, check_supported, engine_options
from router.protocol.sealing import Sealer, expand_compactions, open_reasoning, seal_reasoning
from router.protocol.shapes import response_object
from router.protocol.tools import build_toolset
from router.state.store import Store
from router.tools.registry import RouterTools
from router.turns.assembler import REASONING_EVENTS
from router.turns.history import check_tool_outputs, load_history, resolve_input
from router.turns.meters import Meters
from router.turns.prelude import build_prelude
from router.turns.record import Record
from router.turns.route import ModelRoute
from router.turns.routing import ModelTarget, Routing, prefix_hash
from router.turns.runner import ResponseRun


async def prepare(req: CreateResponse, owner: str, *, store: Store, models: dict[str, ModelTarget],
                  ttl_s: int | None, router_tools: RouterTools | None = None, metrics: Meters | None = None,
                  sealer: Sealer | None = None) -> ResponseRun:
    check_supported(req)
    target = models.get(req.model)
    if target is None:
        raise NotFound(f"The model '{req.model}' does not exist.", param="model", code="model_not_found")
    if req.background and not req.store:
        raise InvalidRequest("background responses must be stored: store cannot be false", param="store")
    tools = build_toolset(req.tools, req.tool_choice, router_tools.runnable if router_tools else frozenset())
    conversation_id = _conversation_id(req)
    seen_until = None  # the conversation's end as this response sees it
    if conversation_id is not None:
        if req.previous_response_id is not None:
            raise InvalidRequest("Use either conversation or previous_response_id, not both.", param="conversation")
        loaded = await store.load_conversation_with_end(conversation_id, owner)
        if loaded is None:
            raise NotFound(f"Conversation with id '{conversation_id}' not found.", param="conversation",
                           code="conversation_not_found")
        history, seen_until = loaded
    else:
        history = await load_history(store, req.previous_response_id, owner)
    rid = response_id()
    item_ids = ItemIds(rid)  # the input items the client did not name, then the output's
    written = input_items = normalize_input(req.input, item_ids)  # written: input[i] as sent
    input_items = resolve_input(history, input_items, await _referenced(store, input_items, owner))
    if not input_items and not history:
        raise InvalidRequest("'input' is empty: send at least one item.", param="input", code="empty_input")
    prompt_items = history + input_items
    if sealer is not None:
        prompt_items = expand_compactions(prompt_items, sealer, owner, first_input=len(history))
        prompt_items = open_reasoning(prompt_items, sealer, owner, first_input=len(history))
    check_tool_outputs(prompt_items)
    prelude = build_prelude(tools, router_tools, history, input_items)
    response = response_object(req, response_id=rid)
    if conversation_id is not None:
        response["conversation"] = {"id": conversation_id}
    with telemetry.span("route"):
        routing = await _routing(target, req, store, owner, conversation_id, response["id"], prompt_items, metrics)
        telemetry.note(**{"router.arm": routing.arm, "router.pool": routing.route.pool.name})
    if routing.route.dialect == "harmony" and (req.top_logprobs or "message.output_text.logprobs" in (req.include or ())):
        raise InvalidRequest("logprobs are not available for this model (it is served through harmony token ids)",
                             param="top_logprobs", code="unsupported_parameter")
    if routing.route.dialect == "harmony":  # gpt-oss reads text only: an image or file part is a 400 naming it
        from router.dialects.harmony import refuse_media  # loaded with openai-harmony, as route.py does

        refuse_media(written, input_items, history, model=req.model,
                     history_param="conversation" if conversation_id is not None else "previous_response_id")
    if req.service_tier is not None:  # the tier that serves it (OpenAI's meaning), not the one asked for
        response["service_tier"] = req.service_tier if routing.route.tier_priority(req.service_tier) is not None else "default"
    options = engine_options(req)
    if options:
        _check_engine_options(options, routing.route, req.model)
        if "request_id" in options:  # the engine's id for its calls: in the header vLLM reads first
            telemetry.worker_request_id(options["request_id"])
        response.update(options)  # recorded with the response (a later turn gets them only if it sends them again)
    record = Record(store=store, owner=owner, stored=bool(req.store), previous_response_id=req.previous_response_id,
                    input_items=input_items, background=bool(req.background), ttl_s=ttl_s,
                    conversation_id=conversation_id, conversation_position=seen_until)
    # The request's, else its key's, else the model's choice (docs/api.md "Reasoning event names").
    events = req.reasoning_events or target.key_events.get(owner) or target.reasoning_events
    return ResponseRun(
        req=req, owner=owner, route=routing.route, tools=tools, prompt_items=prompt_items, response=response,
        record=record, router_tools=router_tools, prelude=prelude, routing=routing, record_routing=target.records, metrics=metrics,
        encrypt_reasoning=_reasoning_sealer(req, sealer, owner), sealer=sealer, item_ids=item_ids, reasoning_events=REASONING_EVENTS[events],
        obfuscate=bool(req.stream) and (req.stream_options or {}).get("include_obfuscation") is True,
    )


def _check_engine_options(options: dict[str, Any], route: ModelRoute, model: str) -> None:
    """A 400 naming the first engine option the pool serving this request cannot take, the pool, and
    why: its engine lacks it, or (harmony pools: the generate call, router/dialects/engine_options.py)
    it cannot apply where the router renders and reads the tokens itself."""
    pool = route.pool
    if route.dialect == "harmony":
        refused = refused_on_generate(options, pool.engine.name)
        if refused is not None:
            name, why = refused
            raise InvalidRequest(f"'{name}' is not available for model '{model}' on pool '{pool.name}', which serves "
                                 f"gpt-oss through harmony: {why}", param=name, code="unsupported_parameter")
        return
    names = refused_options(options, pool.engine.name)
    if names:
        name = names[0]
        raise InvalidRequest(f"'{name}' is not available for model '{model}' on pool '{pool.name}': its engine "
                             f"({pool.engine.name}) does not take it", param=name, code="unsupported_parameter")


def _reasoning_sealer(req: CreateResponse, sealer: Sealer | None, owner: str) -> Callable[[str], str] | None:
    """When the client asked for encrypted reasoning: a function sealing reasoning text for it."""
    if sealer is None or "reasoning.encrypted_content" not in (req.include or ()):
        return None
    return lambda text: seal_reasoning(sealer, owner, text)


async def _routing(target: ModelTarget, req: CreateResponse, store: Store, owner: str, conversation_id: str | None,
                   rid: str, prompt: list[Item], metrics: Meters | None) -> Routing:
    """The arm and worker preference: sticky by conversation, or by the client's own key."""
    previous = None
    if target.records and req.previous_response_id is not None:
        previous = await store.get_routing(req.previous_response_id, owner)
    key = (conversation_id or (previous or {}).get("key") or req.prompt_cache_key or req.safety_identifier
           or req.user or rid)
    prefix_key = None
    if target.affinity and previous is None:
        first = next((message_text(i) for i in prompt if i["type"] == "message"), "")
        # The client's prompt_cache_key groups requests that share a prefix (OpenAI's meaning): one worker for them.
        prefix_key = conversation_id or req.prompt_cache_key or prefix_hash(req.instructions, first)
    routing = target.route(key, previous, prefix_key=prefix_key)
    if routing.home is not None and metrics is not None:
        metrics.failover(target.name, routing.home, routing.arm)
    return routing


def _conversation_id(req: CreateResponse) -> str | None:
    conv = req.conversation
    if conv is None:
        return None
    value = conv.get("id") if isinstance(conv, dict) else conv
    if not isinstance(value, str) or not value:
        raise InvalidRequest("conversation must be an id or {\"id\": ...}", param="conversation")
    return value


async def _referenced(store: Store, input_items: list[Item], owner: str) -> dict[str, Item]:
    """Stored items named by ``item_reference`` inputs (one store query, only when there are any)."""
    ids = [item["id"] for item in input_items if item["type"] == "item_reference"]
    if not ids:
        return {}
    return await store.get_items(ids, owner)
