"""A saturated pool's gate: calls wait in the router, in a fair queue, until a worker has room.

A pool with ``max_in_flight_per_worker`` or ``max_engine_waiting`` is saturated when no healthy
worker has room under them. A call that finds it so (or finds others already waiting: nobody
passes the queue) waits in ``policies/fair_queue.py``'s queue: the lowest band first, inside a
band the key served the fewest tokens recently. Each call of a key is charged its expected
tokens as it is dispatched, queued or not, and corrected by what it used at its end
(``Tenant.settle``).

A slot that frees (a call ends, a scrape shows an engine's queue shorter, a worker comes back)
goes to the next waiter, held for it (``_granted``) until it takes a worker, so a call arriving
in between does not take it. A waiter leaves after ``max_wait_s`` (503), when its client has
left, or when it is cancelled; the queue's bounds refuse with 429 (the key's share) or 503.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from backends.errors import QueueRefused
from backends.worker import Worker
from policies.fair_queue import FairQueue, Refused
from policies.tenant import Tenant

# How often a waiter looks whether its client has left.
GONE_POLL_S = 1.0
# The Retry-After of a refusal: calls end all the time in a saturated pool, so a second.
RETRY_S = 1.0


class Gate:
    def __init__(self, *, max_in_flight: int | None, max_waiting: float | None, max_queued: int, max_per_key: int,
                 max_wait_s: float, half_life_s: float, on_wait: Callable[[str, float], None] | None = None,
                 on_refused: Callable[[str, str], None] | None = None) -> None:
        self.max_in_flight = max_in_flight
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self.queue: FairQueue[asyncio.Future[None]] = FairQueue(max_len=max(1, max_queued), max_per_key=max(1, max_per_key),
                                                                 half_life_s=half_life_s)
        self.no_queue = max_queued == 0 or max_per_key == 0  # saturated: refuse at once
        self.on_wait = on_wait  # (key, seconds waited): a call that waited its turn
        self.on_refused = on_refused  # (key, "queue_" + reason): a call the queue refused or gave up on
        self._granted = 0  # slots handed to waiters that have not taken a worker yet
        self.waited = 0  # calls that waited, in all

    def full(self, worker: Worker) -> bool:
        """Whether the worker is at a bound: it takes no more calls while the pool is gated."""
        return ((self.max_in_flight is not None and worker.in_flight >= self.max_in_flight)
                or (self.max_waiting is not None and worker.waiting > self.max_waiting))

    def room(self, workers: Sequence[Worker]) -> int:
        """Calls the healthy workers can take now, less the slots already handed to waiters."""
        free = 0
        for worker in workers:
            if worker.healthy and not self.full(worker):
                free += self.max_in_flight - worker.in_flight if self.max_in_flight is not None else 1
        return free - self._granted

    async def enter(self, tenant: Tenant | None, workers: Sequence[Worker]) -> None:
        """Return once the call may take a worker: at once while there is room and no one waits;
        else after waiting its turn. Raises QueueRefused when refused or given up."""
        now = time.monotonic()
        key = tenant.key if tenant is not None else ""
        if not len(self.queue) and self.room(workers) > 0:
            self._charge(tenant, now)
            return
        if self.no_queue:
            raise self._refused(key, QueueRefused("every worker of the pool is at its bound, and the pool queues nothing",
                                                  reason="queue_full", retry_after_s=RETRY_S))
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        refused = self.queue.push(waiter, key=key, band=tenant.band if tenant is not None else 0, now=now)
        if refused is Refused.KEY_FULL:
            raise self._refused(key, QueueRefused(
                f"the pool is saturated and key {key!r} already has {self.queue.queued(key)} requests waiting for it, "
                "its share of the queue", reason="key_full", retry_after_s=RETRY_S))
        if refused is Refused.QUEUE_FULL:
            raise self._refused(key, QueueRefused(
                f"the pool is saturated and its queue is full ({len(self.queue)} requests waiting)",
                reason="queue_full", retry_after_s=RETRY_S))
        self.waited += 1
        self.wake(workers)  # room may have come while nothing woke the queue (a worker just back)
        try:
            await self._wait(waiter, tenant, now)
        except QueueRefused as exc:
            self._left(waiter, workers)
            raise self._refused(key, exc) from None
        except BaseException:
            self._left(waiter, workers)
            raise
        self._granted -= 1
        if self.on_wait is not None:
            self.on_wait(key, time.monotonic() - now)
        self._charge(tenant, time.monotonic())

    def _left(self, waiter: asyncio.Future[None], workers: Sequence[Worker]) -> None:
        """A waiter gave up: out of the queue, or, handed a slot already, the slot to the next one."""
        if not self.queue.remove(waiter) and waiter.done() and not waiter.cancelled():
            self._granted -= 1
            self.wake(workers)

    def _refused(self, key: str, exc: QueueRefused) -> QueueRefused:
        if self.on_refused is not None:
            self.on_refused(key, "queue_" + exc.reason)
        return exc

    async def _wait(self, waiter: asyncio.Future[None], tenant: Tenant | None, since: float) -> None:
        deadline = since + self.max_wait_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise QueueRefused(f"the pool stayed saturated for {self.max_wait_s:g} s, the longest a request waits",
                                   reason="timeout", retry_after_s=RETRY_S)
            try:
                await asyncio.wait_for(asyncio.shield(waiter), min(left, GONE_POLL_S))
                return
            except TimeoutError:
                if tenant is not None and tenant.gone is not None and tenant.gone():
                    raise QueueRefused("its client left while it waited", reason="client_left", retry_after_s=RETRY_S) from None

    def wake(self, workers: Sequence[Worker]) -> None:
        """Hand the room there is to the waiters next in line (a call ended, a scrape, a worker back)."""
        if not len(self.queue):
            return
        now = time.monotonic()
        room = self.room(workers)
        while room > 0:
            waiter = self.queue.pop(now)
            if waiter is None:
                return
            if waiter.done():  # cancelled while it waited
                continue
            waiter.set_result(None)
            self._granted += 1
            room -= 1

    def _charge(self, tenant: Tenant | None, now: float) -> None:
        if tenant is None or not tenant.tokens:
            return
        self.queue.charge(tenant.key, tenant.tokens, now)
        tenant.charged += tenant.tokens
        key, queue = tenant.key, self.queue
        tenant.correct = lambda amount: queue.charge(key, amount, time.monotonic())

