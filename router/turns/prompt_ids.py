"""A prompt's token ids as its engine will see them, for a kv_aware pool's pick (backends/pools.py).

Harmony pools: the router renders the prompt's tokens itself (the turn's ``prompt_ids``). Chat
pools: the engine's chat template decides, so the engine is asked: vLLM's ``POST /tokenize`` in
its chat form (the messages, tools and template options the request carries, and the generation
prompt), through a worker call of its own (counted, retried, picked by load). A worker without
it is marked (``Worker.lacks``) and not asked again; without ids the pick goes by load alone.
One call more per model turn: llm-d's way (its render endpoints), not the router tokenizing.
``tokenize`` is also the input-token count's (turns/compaction.py).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from backends.client import WorkerClient
from backends.errors import NoHealthyWorker, WorkerError, WorkerHTTPError
from backends.pools import Pool
from router.dialects.turn import DialectTurn
from router.protocol.items import Item

log = logging.getLogger("router.turns")

TOKENIZE_PATH = "/tokenize"  # vLLM's, at the server root; a worker without it is marked in ``Worker.lacks``
LACKING = (404, 405, 501)  # a worker's answers that say it has no such endpoint (all made a 404)


async def prompt_ids(pool: Pool, turn: DialectTurn, items: list[Item], body: dict[str, Any]) -> list[int] | None:
    """The prompt's ids, or None when they cannot be had (the pick then goes by load)."""
    render = getattr(turn, "prompt_ids", None)
    if render is not None:
        ids: list[int] = render(items)
        return ids
    if "messages" not in body:
        return None
    try:
        answer = await tokenize(pool, body)
    except NoHealthyWorker:
        return None
    tokens = answer.get("tokens") if answer is not None else None
    if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
        return tokens
    return None


async def tokenize(pool: Pool, body: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's chat ``POST /tokenize`` of a chat request body (its messages, tools and template
    options, and the generation prompt): the engine's answer (``count``, ``tokens``), or None when
    no worker has the endpoint or the call failed. NoHealthyWorker when no worker is healthy."""
    request = {"model": body["model"], "messages": body["messages"], "add_generation_prompt": True}
    for key in ("tools", "chat_template_kwargs"):
        if key in body:
            request[key] = body[key]
    call = pool.call(exclude=[w for w in pool.workers if TOKENIZE_PATH in w.lacks])
    try:
        answer = await call.send(partial(_post_tokenize, pool.client), TOKENIZE_PATH, request)
    except NoHealthyWorker:
        if not any(w.healthy for w in pool.workers):
            raise
        return None  # healthy workers, none with /tokenize (or every circuit open)
    except WorkerHTTPError as exc:
        if exc.status == 404 and call.last is not None:
            call.last.lacks.add(TOKENIZE_PATH)
            log.info("pool %s: %s has no %s; it is not asked again", pool.name, call.last.url, TOKENIZE_PATH)
        return None
    except WorkerError:
        return None
    return answer if isinstance(answer, dict) else None


async def _post_tokenize(client: WorkerClient, url: str, body: dict[str, Any]) -> Any:
    """POST /tokenize; a worker without it answers 404 whatever status it used: not found is the
    request's, neither retried nor counted against the worker (a 501 would be, as a 5xx)."""
    try:
        return await client.post_json(url, body)
    except WorkerHTTPError as exc:
        if exc.status in LACKING:
            raise WorkerHTTPError(404, exc.body) from None
        raise
