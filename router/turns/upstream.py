"""One model turn's worker call, and its failures mapped to what the client sees.

The pool's worker call (backends/calls.py) picks the worker, retries before
the first byte and says whose fault a failure is. Here: a ``max_tokens`` the
worker says is too large for the room the prompt leaves is capped to that room
and sent again (the engines' own Responses servers clamp it so); with
``truncation: auto`` a prompt the worker says is too long by itself (or, on a
harmony pool, that the router's own token count says is) loses its oldest turn
and is sent again (a too large ``max_tokens`` never drops a turn);
a pool whose vLLM has no token-level generate endpoint falls back to chat;
failures come out as APIError.
"""

from __future__ import annotations

import logging
from typing import Any

from backends.client import SSEStream, WorkerError, WorkerHTTPError
from backends.engines import is_context_overflow, output_room
from backends.errors import NoHealthyWorker, QueueRefused, WorkerRequestFailed
from backends.pools import Pool
from backends.worker import Worker
from router.dialects.turn import DialectTurn
from router.protocol.errors import APIError, InvalidRequest, NoCapacity, RateLimited, UpstreamError
from router.protocol.items import Item
from router.turns.prompt_ids import prompt_ids

log = logging.getLogger("router.turns")

# Calls sent again with max_tokens capped, per model turn: an engine names the room at the first
# answer; a second covers a wording that gives only a bound (vLLM's count of characters).
MAX_CAPS = 2


class Upstream:
    """Per-request: the worker call (the worker in use), and the prompt as truncation left it."""

    def __init__(self, pool: Pool, model: str, *, truncate: bool, preferred: str | None = None,
                 prefix_key: str | None = None) -> None:
        self.pool = pool
        self.model = model  # the public name, for messages
        self.truncate = truncate
        self.call = pool.call(preferred=preferred, prefix_key=prefix_key)

    async def post(self, turn: DialectTurn, items: list[Item]) -> tuple[Any, list[Item]]:
        """A non-streamed answer; returns it with the prompt items actually sent."""
        return await self._request(turn, items, stream=False)

    async def open(self, turn: DialectTurn, items: list[Item]) -> tuple[SSEStream, list[Item]]:
        """An open stream that answered 200; the worker stays counted until ``release``."""
        return await self._request(turn, items, stream=True)

    async def _request(self, turn: DialectTurn, items: list[Item], *, stream: bool) -> tuple[Any, list[Item]]:
        client = self.pool.client
        caps = 0
        while True:
            try:
                body = turn.request(items, stream=stream)
            except InvalidRequest as exc:  # a harmony prompt the router counted past the context itself
                shorter = drop_oldest_turn(items) if self.truncate and exc.code == "context_length_exceeded" else None
                if shorter is None:
                    raise
                log.info("pool %s: prompt too long (counted), dropped the oldest turn", self.pool.name)
                items = shorter
                continue
            path = turn.path
            if self.pool.kv_policy is not None:  # where the prompt is cached decides (router/turns/prompt_ids.py)
                self.call.prompt_ids = await prompt_ids(self.pool, turn, items, body)
            try:
                if stream:
                    return await self.call.send(client.open_sse, path, body, hold=True), items
                return await self.call.send(client.post_json, path, body), items
            except NoHealthyWorker as exc:
                raise no_capacity(self.model, exc) from None
            except QueueRefused as exc:
                raise queue_refused(self.pool.name, exc) from None
            except WorkerHTTPError as exc:
                if exc.status == 404 and getattr(turn, "fallback", None) is not None and turn.fallback():  # type: ignore[attr-defined]
                    log.warning("pool %s: no token-level generate endpoint, using %s", self.pool.name, turn.path)
                    self.pool.no_generate = True
                    continue
                room = output_room(exc.status, exc.message)
                cap = getattr(turn, "cap_output", None)
                if room is not None and cap is not None and caps < MAX_CAPS and cap(room):
                    log.info("pool %s: max_tokens capped to the %d tokens the prompt leaves", self.pool.name, room)
                    caps += 1
                    continue
                if self.truncate and is_context_overflow(exc.status, exc.message):
                    shorter = drop_oldest_turn(items)
                    if shorter is not None:
                        log.info("pool %s: prompt too long, dropped the oldest turn", self.pool.name)
                        items = shorter
                        if cap is not None:
                            cap(None)  # a shorter prompt leaves more room
                        continue
                raise api_error(exc) from None
            except WorkerError as exc:
                raise api_error(exc) from None

    def broke(self) -> None:
        """The worker's stream broke after it started: a failure of the worker, for its circuit."""
        self.call.broke("stream broke off")

    def release(self) -> None:
        self.call.release()

    @property
    def worker(self) -> Worker | None:
        return self.call.worker

    @property
    def last_url(self) -> str | None:
        """The worker of the last call (the one that served it, when it succeeded)."""
        last = self.call.last
        return last.url if last is not None else None

    @property
    def worker_url(self) -> str:
        worker = self.call.worker
        return worker.url if worker else "?"


def drop_oldest_turn(items: list[Item]) -> list[Item] | None:
    """The prompt without its oldest turn (a user message up to the next one); None when one turn is left."""
    users = [i for i, item in enumerate(items) if item["type"] == "message" and item["role"] == "user"]
    if len(users) < 2:
        return None
    cut = users[1]
    keep_system = [item for item in items[:cut] if item["type"] == "message" and item["role"] in ("system", "developer")]
    return keep_system + items[cut:]


def no_capacity(model: str, exc: NoHealthyWorker) -> NoCapacity:
    """No worker could be tried: none healthy, or every circuit open (``exc.code`` says which)."""
    return NoCapacity(f"no worker can serve model '{model}' now: {exc}", code=exc.code)


def queue_refused(pool: str, exc: QueueRefused) -> RateLimited:
    """A saturated pool's queue did not take a request: 429 when the key has its share waiting,
    503 when the pool is overloaded for everyone (queue full, or the wait bound passed)."""
    if exc.reason == "key_full":
        return RateLimited(f"Too many requests waiting: pool {pool!r} is saturated and {exc}.",
                           retry_after_s=exc.retry_after_s, code="rate_limit_exceeded")
    return RateLimited(f"The router is overloaded: pool {pool!r}: {exc}.", retry_after_s=exc.retry_after_s,
                       code="server_overloaded" if exc.reason != "client_left" else "client_disconnected",
                       type="server_error", status=503)


def api_error(exc: WorkerError) -> APIError:
    """How a worker's failure looks to the client."""
    if isinstance(exc, WorkerHTTPError):
        if is_context_overflow(exc.status, exc.message):
            return InvalidRequest(f"The input is too long for the model: {exc.message}", param="input",
                                  code="context_length_exceeded")
        if output_room(exc.status, exc.message) is not None:  # left uncapped (no room to cap to, caps used up)
            return InvalidRequest(f"max_output_tokens does not fit the model's context: {exc.message}",
                                  param="max_output_tokens", code="upstream_rejected")
        if isinstance(exc, WorkerRequestFailed):
            what = f"the request failed on {exc.workers} workers, each answering {exc.status}: {exc.message}"
            if exc.says_bad_request:
                return InvalidRequest(f"The engine rejected the request: {what}", code="upstream_rejected")
            return UpstreamError(what, code="upstream_error")
        if exc.status in (429, 503):
            return NoCapacity(f"the worker is overloaded: {exc.message}", code="worker_overloaded")
        if 400 <= exc.status < 500:
            return InvalidRequest(exc.message, code="upstream_rejected")
        return UpstreamError(f"the worker failed with status {exc.status}: {exc.message}", code="upstream_error")
    return UpstreamError(f"the worker failed: {exc}", code="upstream_error")
