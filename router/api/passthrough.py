"""``/v1/chat/completions`` and ``/v1/completions``: relayed to a worker of the model's pool.

The body is parsed only to find and rewrite ``model``; the answer, streamed
or not, goes back byte for byte. A worker that cannot be reached, or that
closes the connection before its answer begins, is skipped for the next one
(a 502 when none is left); an answer that began, an error status included,
goes back as it came.
"""

from __future__ import annotations

import os
from typing import Any

import orjson
from starlette.requests import Request
from starlette.routing import Route

from backends.client import WorkerStreamBroken, WorkerUnavailable
from backends.pools import NoHealthyWorker, Pool, Worker
from router.api.auth import Authenticator
from router.api.fastpath import HotRoute
from router.api.http import Body, Headers, decode_request, read_raw
from router.api.sse import StreamBody
from router.protocol.errors import InvalidRequest, NoCapacity, NotFound, UpstreamError
from router.turns.routing import ModelTarget


class PassthroughAPI:
    def __init__(self, *, models: dict[str, ModelTarget], auth: Authenticator, max_body_bytes: int) -> None:
        self.models = models
        self.auth = auth
        self.max_body_bytes = max_body_bytes

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ]

    def hot_routes(self) -> dict[str, HotRoute]:
        return {"/v1/chat/completions": HotRoute(self.chat_from, self.max_body_bytes),
                "/v1/completions": HotRoute(self.completions_from, self.max_body_bytes)}

    async def chat(self, request: Request) -> Body | StreamBody:
        """The Starlette route; the servers call ``chat_from`` directly (router/api/fastpath.py)."""
        return await self.chat_from(request.scope["headers"], await read_raw(request, self.max_body_bytes))

    async def completions(self, request: Request) -> Body | StreamBody:
        return await self.completions_from(request.scope["headers"], await read_raw(request, self.max_body_bytes))

    async def chat_from(self, headers: Headers, raw: bytes) -> Body | StreamBody:
        return await self._relay(headers, raw, "chat_path")

    async def completions_from(self, headers: Headers, raw: bytes) -> Body | StreamBody:
        return await self._relay(headers, raw, "completions_path")

    async def _relay(self, headers: Headers, raw: bytes, path_attr: str) -> Body | StreamBody:
        self.auth.owner_of(headers)
        body = _json_object(await decode_request(headers, raw, self.max_body_bytes))
        target = self.models.get(body.get("model"))  # type: ignore[arg-type]
        if target is None:
            raise NotFound(f"The model '{body.get('model')}' does not exist.", param="model", code="model_not_found")
        key = str(body.get("user") or body.get("safety_identifier") or os.urandom(8).hex())
        pool = target.route(key, None, prefix_key=None).route.pool
        body["model"] = pool.model
        data = orjson.dumps(body)
        path = getattr(pool.engine, path_attr)
        tried: list[Worker] = []
        broke: WorkerStreamBroken | None = None
        while True:
            try:
                worker = pool.pick(exclude=tried)
            except NoHealthyWorker as exc:
                if broke is not None:
                    raise UpstreamError(f"the worker failed: {broke}", code="upstream_error") from None
                raise NoCapacity(f"no worker can serve model '{target.name}' now: {exc}", code=exc.code) from None
            tried.append(worker)
            ticket = pool.acquire(worker)
            try:
                answer = await pool.client.relay(worker.url + path, data)
            except WorkerUnavailable as exc:
                pool.release(worker, ticket, served=False)
                pool.mark_down(worker, str(exc))
                continue
            except WorkerStreamBroken as exc:  # closed or reset before its answer began: the next worker
                pool.release(worker, ticket, served=False)
                pool.record_failure(worker, str(exc), ticket)
                broke = exc
                continue
            except BaseException:
                pool.release(worker, ticket, served=False)
                raise
            if answer.status < 500:
                pool.record_success(worker, ticket)
            break
        if not body.get("stream"):
            try:
                raw = await answer.read()
            finally:
                pool.release(worker, ticket)
            return Body(raw, answer.status, answer.content_type)
        return StreamBody(_counted(answer.chunks(), pool, worker, ticket), status=answer.status,
                          media_type=answer.content_type)


async def _counted(chunks: Any, pool: Pool, worker: Worker, ticket: int) -> Any:
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        pool.release(worker, ticket)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    if not isinstance(body.get("model"), str):
        raise InvalidRequest("Missing required parameter: 'model'.", param="model", code="missing_required_parameter")
    return body
