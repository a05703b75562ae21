"""One worker call: pick a worker, count it in flight, send, classify a failure, retry before the
first byte, release the worker.

Every call the router makes to a worker for a client goes through ``WorkerCall`` (``Pool.call``):
a Responses turn (router/turns/upstream.py), the passthrough (router/api/passthrough.py) and the
token count (router/turns/compaction.py). It is the only place that counts a call to a worker
(``Worker.take`` and ``Worker.end``: in flight, and a breaker ticket). What differs between callers is passed in: how to send
(``send(fn, path, body)`` awaits ``fn(worker.url + path, body)``: a WorkerClient method),
whether an answer's error status is relayed as it came (``relayed``: the passthrough's 5xx
counts neither for nor against the worker), and whether the worker stays counted after the
answer began (``hold``: a stream keeps it until ``release``).

Whose fault a failure is decides what counts towards a worker's circuit breaker (``classify``):

- unreachable (refused, connect timeout): the worker is marked down, the next one tried at once;
- 429/503: backpressure, another worker, no fault;
- closed or reset before the answer was in, no first byte or no data in time: the worker's
  fault (crashing, overloaded, restarting), counted at once, retried;
- a kept-alive connection closed with nothing back (WorkerIdleClosed): the worker may have closed
  it as idle as the request went out, or crashed on it. A failed call, but no one's fault: it may
  go to the same worker again (on a new connection);
- another 5xx, or an answer over the pool's size limit, is ambiguous: the worker answered, and a
  request whose body crashes the engine gets a 5xx from every worker. It is tried once more
  elsewhere and counted only when another worker then serves the request; when a second worker
  fails it so too, it is the request's: no more calls, no fault counted, the caller gets the
  engine's error (WorkerRequestFailed). In a pool of one worker a 5xx is never counted: nothing
  can tell, and shutting the only worker off would help no one;
- any other answer (4xx): the request's fault, no retry.

At most RETRY_ATTEMPTS failed calls (unreachable workers and backpressure are not failed calls:
each is tried once), jittered pauses, within RETRY_DEADLINE_S. When no worker is left, the last
failure is raised, or NoHealthyWorker when there was none. Retries happen only before the answer
began: once ``send`` has returned, a broken stream is the caller's to report (``broke``).

The hot path (a call that succeeds at once) is kept to what it must do: every Python call or
allocation added to it costs ~1k instructions, ~0.3% of a passthrough request (bench/instructions.py).

Not tenacity: measured with callgrind (tenacity 9.2, Python 3.11), one call through its
``AsyncRetrying`` that succeeds at once costs 200-250k instructions (200k reusing one instance,
253k with ``async for``), this loop's shape ~3k; a create is ~0.9M and a passthrough request
~0.33M (bench/instructions.py, sim worker): +25% and +65%, where the budget for this change was
2%. Running only the retries through it, the first attempt outside (as router/state/retry.py
does), would keep that off the hot path, but every decision here is the classification's (which
failures count towards the attempts, which pause, whose fault is settled by the next outcome):
tenacity's stop, wait and retry would be callbacks over this loop's own state, more code than
the loop they would replace.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from backends.errors import (
    NoHealthyWorker,
    WorkerAnswerTooLarge,
    WorkerError,
    WorkerHTTPError,
    WorkerIdleClosed,
    WorkerRequestFailed,
    WorkerStreamBroken,
    WorkerUnavailable,
)
from backends.worker import Worker
from policies.tenant import Tenant

T = TypeVar("T")

RETRY_ATTEMPTS = 3  # failed calls (the worker's fault, or ambiguous) before the caller gets the error
RETRY_DEADLINE_S = 30.0  # no new attempt after this long
PAUSE_S = (0.02, 0.1)  # before the next attempt, jittered, times the failed calls so far

# What a failed call says (``classify``).
UNREACHABLE = "unreachable"  # nothing was sent: the worker is down
BUSY = "busy"  # 429/503: backpressure
WORKERS = "workers"  # the worker's fault: closed, reset or timed out before its answer was in
IDLE = "idle"  # a kept-alive connection closed with nothing back: a failed call, no fault, same worker allowed
AMBIGUOUS = "ambiguous"  # a 5xx or an oversized answer: the worker's or the request's, the next worker says
REQUESTS = "requests"  # the request's fault (4xx): no retry


def classify(exc: WorkerError) -> str:
    """Whose fault a failed call is, and so whether it is tried again and counted against the worker."""
    if isinstance(exc, WorkerUnavailable):
        return UNREACHABLE
    if isinstance(exc, WorkerHTTPError):
        if exc.status in (429, 503):
            return BUSY
        return AMBIGUOUS if exc.status >= 500 else REQUESTS
    if isinstance(exc, WorkerAnswerTooLarge):
        return AMBIGUOUS
    if isinstance(exc, WorkerIdleClosed):
        return IDLE
    if isinstance(exc, WorkerStreamBroken):
        return WORKERS
    return REQUESTS


class Workers(Protocol):
    gated: bool  # the pool bounds its workers' calls: a call enters its gate first (backends/gate.py)

    async def enter(self, tenant: Tenant | None) -> None: ...

    def freed(self) -> None: ...

    """What a call needs of its pool (backends/pools.py ``Pool``): a pick, and where each outcome goes."""

    def pick(self, exclude: Sequence[Worker] = (), *, preferred: str | None = None,
             prefix_key: str | None = None, prompt_ids: Sequence[int] | None = None) -> Worker: ...

    def mark_down(self, worker: Worker, reason: str) -> None: ...

    def record_success(self, worker: Worker, ticket: int) -> None: ...

    def record_failure(self, worker: Worker, reason: str, ticket: int) -> None: ...


class WorkerCall:
    """A caller's calls to one pool's workers (one request's: its retries, a turn's truncations
    and tool-loop turns), and the worker it holds.

    ``preferred`` and ``prefix_key`` go to ``Pool.pick`` (affinity pools); ``exclude`` are workers
    never to pick; ``relayed``: answers (with a ``status``) are relayed as they came, and one of
    5xx counts neither for nor against the worker (the passthrough).
    """

    __slots__ = ("pool", "preferred", "prefix_key", "prompt_ids", "exclude", "relayed", "worker", "ticket", "last", "tenant")

    def __init__(self, pool: Workers, *, preferred: str | None = None, prefix_key: str | None = None,
                 exclude: Sequence[Worker] = (), relayed: bool = False) -> None:
        self.pool = pool
        self.preferred = preferred
        self.prefix_key = prefix_key
        self.prompt_ids: Sequence[int] | None = None  # the prompt's token ids, for a kv_aware pool's pick
        self.exclude = exclude
        self.relayed = relayed
        self.worker: Worker | None = None  # the worker held (counted in flight) now
        self.ticket = 0  # its breaker ticket
        self.last: Worker | None = None  # the worker of the last attempt
        self.tenant: Tenant | None = None  # whom it is for, in a gated pool's fair queue

    async def send(self, fn: Callable[[str, Any], Awaitable[T]], path: str, body: Any, *, hold: bool = False) -> T:
        """``fn(worker.url + path, body)`` on a worker the pool picks; tried again elsewhere as the
        failure says.

        The worker is released when this returns, or with ``hold`` kept counted in flight until
        ``release`` (an open stream). Every path out releases a worker it does not return held:
        a failure, the caller's cancellation, a bug in ``fn``.
        """
        # The hot path (see above): a call that succeeds at once allocates nothing.
        if self.worker is not None:  # a stream the caller did not release: not counted forever
            self.release()
        pool = self.pool
        tried: Sequence[Worker] = self.exclude  # a new list with each failed worker
        suspects: list[tuple[Worker, int, str]] | None = None  # answered 5xx: blamed if another worker serves
        last: WorkerError | None = None
        failed = 0
        deadline = 0.0
        if pool.gated:  # a saturated pool: wait in its fair queue (QueueRefused past its bounds)
            await pool.enter(self.tenant)
        while True:
            try:
                worker = pool.pick(tried, preferred=self.preferred, prefix_key=self.prefix_key, prompt_ids=self.prompt_ids)
            except NoHealthyWorker:
                if last is not None:
                    raise last from None
                raise
            # Counted in flight and admitted by its breaker (a half-open circuit's one trial) until
            # released: below when the attempt fails, else by ``release``.
            now = time.monotonic()
            if not deadline:
                deadline = now + RETRY_DEADLINE_S
            self.ticket = ticket = worker.take(now)
            self.worker = self.last = worker
            try:
                result = await fn(worker.url + path, body)
            except WorkerError as exc:
                self._failed()
                kind = classify(exc)
                if kind == REQUESTS:
                    raise
                if kind != IDLE:
                    tried = [*tried, worker]
                if kind == UNREACHABLE:  # nothing sent; none left after it is "no healthy worker"
                    pool.mark_down(worker, str(exc))
                    continue
                last = exc
                if kind == AMBIGUOUS:
                    if suspects:  # the second worker to fail this request so: the request's
                        if isinstance(exc, WorkerHTTPError):
                            raise WorkerRequestFailed(exc.status, exc.body, len(suspects) + 1) from None
                        raise
                    suspects = [(worker, ticket, _what(exc))]
                    failed += 1
                elif kind == WORKERS:
                    pool.record_failure(worker, str(exc), ticket)
                    failed += 1
                elif kind == IDLE:
                    failed += 1
                if failed >= RETRY_ATTEMPTS or time.monotonic() > deadline:
                    raise
                if failed and kind != IDLE:
                    await asyncio.sleep(random.uniform(*PAUSE_S) * failed)
                continue
            except BaseException:  # cancelled, or a bug in fn: the worker is not left counted
                self._failed()
                raise
            if not self.relayed or result.status < 500:  # type: ignore[attr-defined]
                pool.record_success(worker, ticket)
                if suspects:
                    for suspect, its_ticket, why in suspects:
                        pool.record_failure(suspect, f"{why} (another worker served the request)", its_ticket)
            if not hold:
                self.worker = None
                worker.end(ticket, served=True)
                if pool.gated:
                    pool.freed()
            return result

    def broke(self, reason: str = "stream broke off") -> None:
        """The held worker's answer broke after it began: a failure of the worker, for its circuit
        (the other streams one crash broke with it count with it, once: backends/breaker.py)."""
        if self.worker is not None:
            self.pool.record_failure(self.worker, reason, self.ticket)

    def release(self) -> None:
        """The held worker's answer is over (read to its end, broken, or dropped): no longer counted,
        its breaker ticket returned (a half-open trial that ended without a verdict frees its slot).
        Idempotent."""
        worker = self.worker
        if worker is not None:
            self.worker = None
            worker.end(self.ticket, served=True)
            if self.pool.gated:
                self.pool.freed()

    def _failed(self) -> None:
        """The attempt failed: as ``release``, but the worker served nothing."""
        worker = self.worker
        if worker is not None:
            self.worker = None
            worker.end(self.ticket, served=False)
            if self.pool.gated:
                self.pool.freed()


def _what(exc: WorkerError) -> str:
    return f"answered {exc.status}: {exc.message}" if isinstance(exc, WorkerHTTPError) else str(exc)
