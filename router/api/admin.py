"""``/admin``: the pools' workers and the models' experiments; add or remove external workers.

Guarded by ``[auth] admin_key``; without one, every admin route answers 403.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.routing import Route

from backends.pools import Pool
from backends.worker import Worker
from router.api.http import Body, json_response, read_body
from router.protocol.errors import APIError, InvalidRequest, NotFound, Unauthorized
from router.turns.routing import ModelTarget


class AdminAPI:
    def __init__(self, *, pools: dict[str, Pool], models: dict[str, ModelTarget], admin_key: str) -> None:
        self.pools = pools
        self.models = models
        self.admin_key = admin_key

    def routes(self) -> list[Route]:
        return [
            Route("/admin/pools", self.list_pools, methods=["GET"]),
            Route("/admin/pools/{pool}/workers", self.add_worker, methods=["POST"]),
            Route("/admin/pools/{pool}/workers", self.remove_worker, methods=["DELETE"]),
        ]

    def _check(self, request: Request) -> None:
        if not self.admin_key:
            raise APIError("The admin API is disabled: set [auth] admin_key.", status=403, type="permission_error",
                           code="admin_disabled")
        token = request.headers.get("authorization", "").partition(" ")[2].strip()
        if not hmac.compare_digest(token.encode(), self.admin_key.encode()):
            raise Unauthorized("Incorrect admin key.", code="invalid_admin_key")

    async def list_pools(self, request: Request) -> Body:
        self._check(request)
        models = []
        for target in self.models.values():
            models.append(target.describe())
        return json_response({"pools": [p.describe() for p in self.pools.values()], "models": models})

    async def add_worker(self, request: Request) -> Body:
        self._check(request)
        pool = self._pool(request)
        url = await _url(request)
        if any(w.url == url for w in pool.workers):
            raise InvalidRequest(f"{url} is already in pool {pool.name!r}", param="url")
        worker = Worker(url)
        pool.workers.append(worker)
        await pool.check_health()  # routable as soon as it answers
        if pool.kv is not None:  # its KV events, where it says it publishes them
            found = await pool.kv.discover(pool.client, url)
            if found is not None:
                pool.kv.watch(url, *found)
        return json_response(pool.describe())

    async def remove_worker(self, request: Request) -> Body:
        self._check(request)
        pool = self._pool(request)
        url = request.query_params.get("url", "").rstrip("/")
        worker = next((w for w in pool.workers if w.url == url), None)
        if worker is None or worker.process is not None:
            raise NotFound(f"no external worker {url!r} in pool {pool.name!r}", param="url")
        pool.workers.remove(worker)  # requests in flight on it finish; no new ones go there
        pool.client.forget(url)  # its idle connections close now, the busy ones as their requests end
        if pool.kv is not None:
            pool.kv.unwatch(url)  # what it held is no longer a reason to go there
        return json_response(pool.describe())

    def _pool(self, request: Request) -> Pool:
        pool = self.pools.get(request.path_params["pool"])
        if pool is None:
            raise NotFound(f"no pool named {request.path_params['pool']!r}", param="pool")
        return pool


async def _url(request: Request) -> str:
    import orjson

    try:
        body = orjson.loads(await read_body(request, 4096))
    except orjson.JSONDecodeError:
        raise InvalidRequest("send {\"url\": \"http://host:port\"}", param="url") from None
    url = body.get("url") if isinstance(body, dict) else None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise InvalidRequest("url must start with http:// or https://", param="url")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is no number or out of range
    except ValueError:
        parts = None
    if parts is None or not parts.hostname or parts.query or parts.fragment or parts.username is not None:
        raise InvalidRequest("url must be http(s)://host[:port][/path], with a host and nothing more", param="url")
    return url.rstrip("/")
