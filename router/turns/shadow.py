"""Shadow traffic: a sample of requests mirrored to a candidate pool, answers compared, then discarded.

The mirror runs after the client's own request was prepared, as a separate
task with its own bounded concurrency: it never adds latency or errors to
what the client sees, and nothing of it is stored. Its outcome, time and
tokens go to the metrics (``shadow_*``), and how its answer differs from the
client's: in length (output tokens more than 20% apart) or in how it ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from router.turns.record import Record
from router.turns.routing import ModelTarget, Shadow
from router.turns.runner import ResponseRun

log = logging.getLogger("router.shadow")

LENGTH_APART = 0.2  # output token counts further apart than this (relative to the larger) differ in length
WAIT_FOR_CLIENT_S = 600.0  # how long a finished mirror waits for the client's answer to compare with

def maybe_mirror(target: ModelTarget, run: ResponseRun) -> None:
    """Mirror ``run`` to the model's shadow pool if it is sampled and there is room."""
    shadow = target.shadow
    if shadow is None or run.routing is None or not shadow.sampler.sample(run.routing.key):
        return
    if shadow.running >= shadow.limit:
        shadow.counts["skipped"] += 1
        if run.metrics is not None:
            run.metrics.shadow(target.name, shadow.route.pool.name, "skipped")
        return
    req = run.req.model_copy(update={"store": False, "stream": False, "background": False, "conversation": None})
    record = Record(store=run.record.store, owner=run.owner, stored=False, previous_response_id=None, input_items=[])
    mirror = ResponseRun(req=req, owner=run.owner, route=shadow.route, tools=run.tools,
                         prompt_items=list(run.prompt_items), response=replace_response(run), record=record)
    shadow.running += 1
    task = asyncio.create_task(_run(target.name, shadow, mirror, run), name=f"shadow:{target.name}")
    shadow.tasks.add(task)
    task.add_done_callback(shadow.tasks.discard)


def replace_response(run: ResponseRun) -> dict[str, Any]:
    response = dict(run.response)
    response["output"] = []
    response["id"] = response["id"] + "_shadow"
    return response


async def _run(model: str, shadow: Shadow, mirror: ResponseRun, client: ResponseRun) -> None:
    start = time.perf_counter()
    pool = mirror.route.pool.name
    try:
        await mirror.complete()
        shadow.counts["mirrored"] += 1
    except Exception as exc:  # noqa: BLE001 - the shadow's failures are counted, never surfaced
        shadow.counts["failed"] += 1
        log.info("shadow request for %s failed: %s", model, exc)
    finally:
        shadow.running -= 1
    seconds = time.perf_counter() - start
    metrics = client.metrics
    if metrics is None:
        return
    answer = mirror.response
    usage = answer.get("usage") or {}
    theirs = await _ended(client)
    metrics.shadow(model, pool, answer.get("status") or "failed", seconds, usage.get("output_tokens"),
                   differences(theirs, answer) if theirs is not None else ())


async def _ended(run: ResponseRun) -> dict[str, Any] | None:
    """The client's response once it has ended (None if it runs past WAIT_FOR_CLIENT_S)."""
    deadline = time.monotonic() + WAIT_FOR_CLIENT_S
    while run.response.get("status") in ("queued", "in_progress"):
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.1)
    return run.response


def differences(client: dict[str, Any], shadow: dict[str, Any]) -> list[str]:
    """How the shadow's answer differs from the client's: ``length`` (output tokens more than
    LENGTH_APART apart), ``finish`` (another status or incomplete reason)."""
    out = []
    mine = (client.get("usage") or {}).get("output_tokens") or 0
    theirs = (shadow.get("usage") or {}).get("output_tokens") or 0
    if abs(mine - theirs) > LENGTH_APART * max(mine, theirs):
        out.append("length")
    if _ending(client) != _ending(shadow):
        out.append("finish")
    return out


def _ending(response: dict[str, Any]) -> tuple[Any, Any]:
    return response.get("status"), (response.get("incomplete_details") or {}).get("reason")
