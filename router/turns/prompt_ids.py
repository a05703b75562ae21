"""A prompt's token ids as its engine will see them, for a kv_aware pool's pick (backends/pools.py).

Harmony pools: the router renders the prompt's tokens itself (the turn's ``prompt_ids``). Chat
pools: the engine's chat template decides, so the engine is asked: vLLM's ``POST /tokenize`` in
its chat form (the messages, tools and template options the request carries, and the generation
prompt), through a worker call of its own (counted, retried, picked by load). A worker without
it is marked (``Worker.lacks``) and not asked again; without ids the pick goes by load alone.
One call more per model turn: llm-d's way (its render endpoints), not the router tokenizing.
"""

from __future__ import annotations

from typing import Any

from backends.errors import NoHealthyWorker, WorkerError, WorkerHTTPError
from backends.pools import Pool
from router.dialects.turn import DialectTurn
from router.protocol.items import Item

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
    request = {"model": body["model"], "messages": body["messages"], "add_generation_prompt": True}
    for key in ("tools", "chat_template_kwargs"):
        if key in body:
            request[key] = body[key]
    call = pool.call(exclude=[w for w in pool.workers if TOKENIZE_PATH in w.lacks])
    try:
        answer = await call.send(pool.client.post_json, TOKENIZE_PATH, request)
    except NoHealthyWorker:
        return None
    except WorkerHTTPError as exc:
        if exc.status in LACKING and call.last is not None:
            call.last.lacks.add(TOKENIZE_PATH)
        return None
    except WorkerError:
        return None
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
        return tokens
    return None
