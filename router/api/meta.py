"""``GET /v1/models`` (and one model), ``GET /health`` and ``GET /metrics``."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from backends.pools import Pool
from router.api.auth import Authenticator
from router.api.http import Body, json_response
from router.metrics import CONTENT_TYPE, RouterMetrics
from router.protocol.errors import NotFound, Unauthorized
from router.state.store import Store, StoreUnavailable


class MetaAPI:
    def __init__(self, *, models: list[str], pools: list[Pool], auth: Authenticator, metrics: RouterMetrics,
                 admin_key: str = "", store: Store | None = None) -> None:
        self.store = store
        self.metrics = metrics
        self.admin_key = admin_key
        self.models = models
        self.pools = pools
        self.auth = auth

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self.list_models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.retrieve_model, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"])]

    def _is_admin(self, request: Request) -> bool:
        """True when no admin key is configured, or the request carries it."""
        if not self.admin_key:
            return True
        token = request.headers.get("authorization", "").partition(" ")[2].strip()
        return hmac.compare_digest(token.encode(), self.admin_key.encode())

    async def prometheus(self, request: Request) -> Response:
        """Prometheus text; guarded by the admin key when one is configured."""
        if not self._is_admin(request):
            raise Unauthorized("Incorrect admin key.", code="invalid_admin_key")
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def list_models(self, request: Request) -> Body:
        self.auth.owner(request)
        return json_response({"object": "list", "data": [_model(name) for name in self.models]})

    async def retrieve_model(self, request: Request) -> Body:
        self.auth.owner(request)
        name = request.path_params["model"]  # a path: model names often hold a slash (org/model)
        if name not in self.models:
            raise NotFound(f"The model '{name}' does not exist.", param="model", code="model_not_found")
        return json_response(_model(name))

    async def health(self, request: Request) -> Body:
        """200 while every pool can serve; 503 when some pool has no available worker (healthy, and
        its circuit not open: five failed calls in a row shut a worker off for a while).

        ``reason`` (when down; per pool, and the down pools' reasons at the top) tells "no healthy
        worker" (fix or wait for the workers) from "circuit open on all workers" (they pass health
        checks, but their calls failed; a trial call follows the cool-down). The pools, with their workers' URLs, processes and last
        errors, only for the admin key when one is configured: a load balancer's probe needs the
        status, not the insides.

        ``store``: whether the store answers one round trip now (no retries; always, with its error,
        for the admin key; for others only when it does not answer). A store that does not answer
        makes the status ``degraded``, not a 503: ``store: false`` requests and the passthrough are
        still served, and every replica shares the store, so a load balancer would take them all
        out at once."""
        pools = [pool.describe() for pool in self.pools]
        serving = all(p["available_workers"] > 0 for p in pools)
        store = await self._store_state()
        degraded = any(p["status"] != "ok" for p in pools) or not store["ok"]
        status = "down" if not serving else ("degraded" if degraded else "ok")
        admin = self._is_admin(request)
        body: dict[str, Any] = {"status": status, "pools": pools} if admin else {"status": status}
        if admin:
            body["store"] = store
        elif not store["ok"]:
            body["store"] = {"ok": False}
        if not serving:
            body["reason"] = "; ".join(sorted({p["reason"] for p in pools if p["reason"] is not None}))
        return json_response(body, 200 if serving else 503)

    async def _store_state(self) -> dict[str, Any]:
        """``{"ok": true}``, or ``{"ok": false, "error": ...}`` when the store's ping fails."""
        if self.store is None:
            return {"ok": True}
        try:
            await self.store.ping()
        except StoreUnavailable as exc:
            cause = exc.__cause__
            return {"ok": False, "error": f"{type(cause).__name__}: {cause}" if cause and str(cause) else exc.message}
        return {"ok": True}


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "responses-router"}
