"""One model turn's worker call: pick a worker, send, and map its failures.

An unreachable worker is skipped for the next one before anything reaches
the client. With ``truncation: auto`` a prompt the worker says is too long
loses its oldest turn and is sent again. Failures come out as APIError.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

from backends.client import SSEStream, WorkerError, WorkerHTTPError, WorkerStreamBroken, WorkerUnavailable
from backends.engines import is_context_overflow
from backends.errors import WorkerAnswerTooLarge, WorkerRequestFailed
from backends.pools import NoHealthyWorker, Pool, Worker
from router.dialects.turn import DialectTurn
from router.protocol.errors import APIError, InvalidRequest, NoCapacity, UpstreamError
from router.protocol.items import Item

log = logging.getLogger("router.turns")

RETRY_ATTEMPTS = 3  # worker calls that may fail before the client gets the error
RETRY_DEADLINE_S = 30.0


class Upstream:
    """Per-request: the worker in use, and the prompt as truncation left it."""

    def __init__(self, pool: Pool, model: str, *, truncate: bool, preferred: str | None = None,
                 prefix_key: str | None = None) -> None:
        self.pool = pool
        self.model = model  # the public name, for messages
        self.truncate = truncate
        self.preferred = preferred
        self.prefix_key = prefix_key
        self.worker: Worker | None = None
        self._ticket = 0  # the current call's, from Pool.acquire
        self.last_url: str | None = None  # the worker that served the last call

    async def post(self, turn: DialectTurn, items: list[Item]) -> tuple[Any, list[Item]]:
        """A non-streamed answer; returns it with the prompt items actually sent."""
        return await self._call(turn, items, stream=False)

    async def open(self, turn: DialectTurn, items: list[Item]) -> tuple[SSEStream, list[Item]]:
        """An open stream that answered 200; the worker stays counted until ``release``."""
        return await self._call(turn, items, stream=True)

    async def _call(self, turn: DialectTurn, items: list[Item], *, stream: bool) -> tuple[Any, list[Item]]:
        client = self.pool.client
        while True:
            body = turn.request(items, stream=stream)
            try:
                if stream:
                    # The lambdas are awaited within this iteration: the loop's body is theirs (B023).
                    return await self._send(lambda url: client.open_sse(url, body), turn.path, release=False), items  # noqa: B023
                return await self._send(lambda url: client.post_json(url, body), turn.path, release=True), items  # noqa: B023
            except WorkerHTTPError as exc:
                if exc.status == 404 and getattr(turn, "fallback", None) is not None and turn.fallback():  # type: ignore[attr-defined]
                    log.warning("pool %s: no token-level generate endpoint, using %s", self.pool.name, turn.path)
                    self.pool.no_generate = True
                    continue
                if self.truncate and is_context_overflow(exc.status, exc.message):
                    shorter = drop_oldest_turn(items)
                    if shorter is not None:
                        log.info("pool %s: prompt too long, dropped the oldest turn", self.pool.name)
                        items = shorter
                        continue
                raise api_error(exc) from None
            except WorkerError as exc:
                raise api_error(exc) from None

    async def _send(self, send: Any, path: str, *, release: bool) -> Any:
        """Before the client has seen a byte, a failed call is tried again on another worker.

        Whose fault a failure is decides what counts towards a worker's circuit breaker:

        - unreachable (refused, connect timeout): the worker is marked down, the next one tried;
        - 429/503: backpressure, another worker, no fault;
        - closed or reset before the answer was in, no first byte or no data in time: the
          worker's fault (crashing, overloaded, restarting), counted at once, retried;
        - another 5xx, or an answer over the pool's size limit, is ambiguous: the worker answered,
          and a request whose body crashes the engine gets a 5xx from every worker. It is tried
          once more elsewhere and counted only when another worker then serves the request; when a
          second worker fails it so too, it is the request's: no more calls, no fault counted, the
          client gets the engine's error (WorkerRequestFailed). In a pool of one worker a 5xx is
          never counted: nothing can tell, and shutting the only worker off would help no one;
        - 4xx: the request's fault, no retry.

        At most RETRY_ATTEMPTS failed calls, jittered pauses, within RETRY_DEADLINE_S.
        """
        tried: list[Worker] = []
        last: WorkerHTTPError | WorkerStreamBroken | None = None
        suspects: list[tuple[Worker, int, str]] = []  # answered it 5xx: blamed if another worker serves it
        failed = 0
        deadline = time.monotonic() + RETRY_DEADLINE_S
        while True:
            try:
                worker = self.pool.pick(exclude=tried, preferred=self.preferred, prefix_key=self.prefix_key)
            except NoHealthyWorker as exc:
                if last is not None:
                    raise last from None
                raise NoCapacity(f"no worker can serve model '{self.model}' now: {exc}", code=exc.code) from None
            tried.append(worker)
            ticket = self._acquire(worker)
            try:
                result = await send(worker.url + path)
            except WorkerUnavailable as exc:
                self.pool.mark_down(worker, str(exc))
                self.release()
                continue
            except (WorkerHTTPError, WorkerStreamBroken) as exc:
                self.release()
                if isinstance(exc, WorkerHTTPError) and exc.status < 500 and exc.status != 429:
                    raise
                last = exc
                if isinstance(exc, WorkerHTTPError) and exc.status in (429, 503):
                    pass  # backpressure: another worker, no fault
                elif isinstance(exc, WorkerHTTPError | WorkerAnswerTooLarge):  # it answered: whose fault?
                    if suspects:  # the second worker to fail this request so: the request's
                        if isinstance(exc, WorkerHTTPError):
                            raise WorkerRequestFailed(exc.status, exc.body, len(suspects) + 1) from None
                        raise
                    suspects.append((worker, ticket, _what(exc)))
                    failed += 1
                else:
                    self.pool.record_failure(worker, str(exc), ticket)
                    failed += 1
                if failed >= RETRY_ATTEMPTS or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(random.uniform(0.02, 0.1) * failed)
                continue
            except BaseException:
                self.release()
                raise
            self.pool.record_success(worker, ticket)
            for suspect, its_ticket, why in suspects:
                self.pool.record_failure(suspect, f"{why} (another worker served the request)", its_ticket)
            if release:
                self.release()
            return result

    def broke(self) -> None:
        """The worker's stream broke after it started: a failure of the worker, for its circuit
        (the other streams one crash broke with it count with it, once)."""
        if self.worker is not None:
            self.pool.record_failure(self.worker, "stream broke off", self._ticket)

    def _acquire(self, worker: Worker) -> int:
        self._ticket = self.pool.acquire(worker)
        self.worker = worker
        self.last_url = worker.url
        return self._ticket

    def release(self) -> None:
        worker, self.worker = self.worker, None
        if worker is not None:
            self.pool.release(worker, self._ticket)

    @property
    def worker_url(self) -> str:
        return self.worker.url if self.worker else "?"


def _what(exc: WorkerError) -> str:
    return f"answered {exc.status}: {exc.message}" if isinstance(exc, WorkerHTTPError) else str(exc)


def drop_oldest_turn(items: list[Item]) -> list[Item] | None:
    """The prompt without its oldest turn (a user message up to the next one); None when one turn is left."""
    users = [i for i, item in enumerate(items) if item["type"] == "message" and item["role"] == "user"]
    if len(users) < 2:
        return None
    cut = users[1]
    keep_system = [item for item in items[:cut] if item["type"] == "message" and item["role"] in ("system", "developer")]
    return keep_system + items[cut:]


def api_error(exc: WorkerError) -> APIError:
    """How a worker's failure looks to the client."""
    if isinstance(exc, WorkerHTTPError):
        if is_context_overflow(exc.status, exc.message):
            return InvalidRequest(f"The input is too long for the model: {exc.message}", param="input",
                                  code="context_length_exceeded")
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
