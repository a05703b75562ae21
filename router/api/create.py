"""The create sequence that HTTP (JSON, SSE, background) and WebSocket share, up to the answer.

Both read a ``CreateResponse`` and then go through the same stages (docs/ARCHITECTURE.md "A
response's way"): the access line names the model, ``prepare`` refuses what it can and routes,
the access line holds the run (read as the answer ends), and the shadow, if any, is mirrored.
From there each answers in its own frames: a JSON body, SSE, a background log, WebSocket events.
"""

from __future__ import annotations

from dataclasses import dataclass

from router import telemetry
from router.api import access
from router.protocol.requests import CreateResponse
from router.protocol.sealing import Sealer
from router.state.store import Store
from router.tools.registry import RouterTools
from router.turns.meters import Meters
from router.turns.prepare import prepare
from router.turns.routing import ModelTarget
from router.turns.runner import ResponseRun
from router.turns.shadow import maybe_mirror


@dataclass(frozen=True, slots=True)
class Creator:
    """What a create needs, bound once at start-up."""

    store: Store
    models: dict[str, ModelTarget]
    ttl_s: int | None = None
    router_tools: RouterTools | None = None
    metrics: Meters | None = None
    sealer: Sealer | None = None

    async def prepared(self, req: CreateResponse, owner: str, *, store: Store | None = None,
                       mirror: bool = True) -> ResponseRun:
        """The run of ``req``, prepared and routed (``store``: a view of the store instead, as a
        WebSocket connection's cache is); ``mirror``: its shadow sent too (not for a run that
        calls no worker)."""
        record = access.current()
        if record is not None:
            record.model = req.model
        with telemetry.span("prepare", **{"router.model": req.model}):
            run = await prepare(req, owner, store=self.store if store is None else store, models=self.models,
                                ttl_s=self.ttl_s, router_tools=self.router_tools, metrics=self.metrics, sealer=self.sealer)
        if record is not None:
            record.run = run  # read as the answer ends: where it was served, its id, tokens, status
        if mirror:
            maybe_mirror(self.models[req.model], run)  # shadow traffic, on a task of its own
        return run
