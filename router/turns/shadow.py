"""Shadow traffic: a sample of requests mirrored to a candidate pool, answers discarded.

The mirror runs after the client's own request was prepared, as a separate
task with its own bounded concurrency: it never adds latency or errors to
what the client sees, and nothing of it is stored.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from router.turns.record import Record
from router.turns.routing import ModelTarget
from router.turns.runner import ResponseRun

log = logging.getLogger("router.shadow")

_running: dict[str, int] = {}
_tasks: set[asyncio.Task[None]] = set()
stats: dict[str, dict[str, int]] = {}  # model -> mirrored / skipped / failed


def maybe_mirror(target: ModelTarget, run: ResponseRun) -> None:
    """Mirror ``run`` to the model's shadow pool if it is sampled and there is room."""
    if target.shadow is None or target.shadow_sampler is None or run.routing is None:
        return
    if not target.shadow_sampler.sample(run.routing.key):
        return
    counts = stats.setdefault(target.name, {"mirrored": 0, "skipped": 0, "failed": 0})
    if _running.get(target.name, 0) >= target.shadow_limit:
        counts["skipped"] += 1
        return
    req = run.req.model_copy(update={"store": False, "stream": False, "background": False, "conversation": None})
    record = Record(store=run.record.store, owner=run.owner, stored=False, previous_response_id=None, input_items=[])
    mirror = ResponseRun(req=req, owner=run.owner, route=target.shadow, tools=run.tools,
                         prompt_items=list(run.prompt_items), response=replace_response(run), record=record)
    _running[target.name] = _running.get(target.name, 0) + 1
    task = asyncio.create_task(_run(target.name, mirror, counts), name=f"shadow:{target.name}")
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


def replace_response(run: ResponseRun) -> dict[str, Any]:
    response = dict(run.response)
    response["output"] = []
    response["id"] = response["id"] + "_shadow"
    return response


async def _run(model: str, mirror: ResponseRun, counts: dict[str, int]) -> None:
    try:
        await mirror.complete()
        counts["mirrored"] += 1
    except Exception as exc:  # noqa: BLE001 - the shadow's failures are counted, never surfaced
        counts["failed"] += 1
        log.info("shadow request for %s failed: %s", model, exc)
    finally:
        _running[model] -= 1

