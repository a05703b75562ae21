"""Leases: the stored responses this replica runs (background runs, and foreground streams stored
as they run) are held by it, so that any replica can tell a running response from an abandoned one.

The replica running a response holds a lease on it and renews it; a replica
that dies stops renewing, and the sweep (on any replica) marks its responses
failed, with the output a stream had checkpointed. A response whose end the
store missed (unreachable past its retries) stays leased here until its end
is stored.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from router.protocol.errors import APIError
from router.protocol.replay import output_of
from router.protocol.shapes import response_error
from router.state.store import ResponseDeleted, Store, StoreUnavailable
from router.turns.runner import ResponseRun

log = logging.getLogger("router.background")
# How often a leased stream's output so far is stored (``Leases._checkpoints``).
CHECKPOINT_S = 1.0

Event = dict[str, Any]
STOPPED = APIError("The router running this response stopped before it finished.", code="router_stopped")
ABANDONED = response_error(STOPPED.code, STOPPED.message)  # the stored error of a response nobody runs any more


class Leases:
    """The responses this replica holds, renewed while they run, and the sweep of abandoned ones."""

    def __init__(self, store: Store, *, lease_s: float = 30.0, sweep_all_at_start: bool = False) -> None:
        self.store = store
        self.holder = f"{os.uname().nodename}:{os.getpid()}:{os.urandom(4).hex()}"
        self.lease_s = lease_s
        self._sweep_all_at_start = sweep_all_at_start  # one replica only (SQLite): nothing else can be running
        self._held: set[str] = set()
        self._streaming: dict[str, ResponseRun] = {}  # leased foreground streams: checkpointed by one loop
        self._loop: asyncio.Task[None] | None = None
        self._checkpointing: asyncio.Task[None] | None = None
        self._later: set[asyncio.Task[None]] = set()  # storing the ends of streams the store missed

    async def start(self) -> None:
        failed = await self.store.fail_abandoned(math.inf if self._sweep_all_at_start else time.time(), ABANDONED, output_of)
        if failed:
            log.warning("marked %d abandoned responses failed", len(failed))
        self._loop = asyncio.create_task(self._renew_loop(), name="leases")
        self._checkpointing = asyncio.create_task(self._checkpoint_loop(), name="checkpoints")

    def stop(self) -> None:
        for task in [self._loop, self._checkpointing, *self._later]:
            if task is not None:
                task.cancel()

    def hold(self, run: ResponseRun) -> None:
        """``run`` is this replica's until ``release``: stored with a lease, renewed meanwhile."""
        run.record.lease(self.holder, self.lease_s)
        self._held.add(run.response["id"])

    def release(self, rid: str) -> None:
        self._held.discard(rid)

    def stream(self, run: ResponseRun) -> RunEvents:
        """A foreground ``run``'s events. A stored one is leased here while it runs: it is stored as
        ``in_progress`` as it starts, what its output grew by is logged every CHECKPOINT_S
        (``_checkpoint_loop``), and if this replica dies the sweep marks it failed with that output,
        as it does a background response."""
        return RunEvents(run, self._leased(run) if run.req.store else run.events())

    async def _leased(self, run: ResponseRun) -> AsyncGenerator[list[Event], None]:
        rid = run.response["id"]
        self.hold(run)
        stream = run.events()
        self._streaming[rid] = run
        try:
            async for events in stream:
                yield events
        finally:
            self._streaming.pop(rid, None)  # a checkpoint only appends to the log: the run's last put is the response
            try:
                await stream.aclose()  # now, as the client's leaving closes it: stored cancelled before this ends
            finally:
                if run.record.unstored:  # the store was unavailable: its end is stored once it is back, leased here meanwhile
                    task = asyncio.create_task(self.store_when_back(run, None), name=f"unstored:{rid}")
                    self._later.add(task)
                    task.add_done_callback(self._later.discard)
                else:
                    self.release(rid)

    async def _checkpoint_loop(self) -> None:
        """Every CHECKPOINT_S, what each leased stream's output grew by goes to its log
        (``run.checkpoint``): a replica killed mid-stream leaves its clients' answers stored
        ``failed`` with what they had seen up to then, as a background run leaves its event log.
        One loop for all of them: a task per stream was ~2 KiB of every open stream and a wake-up
        of each every second."""
        while True:
            await asyncio.sleep(CHECKPOINT_S)
            for rid, run in list(self._streaming.items()):
                if rid not in self._streaming:  # ended while an earlier one was stored
                    continue
                try:
                    await run.checkpoint()
                except ResponseDeleted:
                    self._streaming.pop(rid, None)
                except StoreUnavailable:  # the store's own log lines say so; the next round tries again
                    break
                except Exception:  # a missed checkpoint only means an older one stands
                    log.debug("checkpoint of %s failed", rid, exc_info=True)

    async def store_when_back(self, run: ResponseRun, flush: Callable[[], Awaitable[None]] | None) -> None:
        """Store what a run could not (its end, then ``flush``: its last events), trying until the store
        answers. Its id stays leased here meanwhile, renewed as soon as the store is back, so no sweep
        fails it as abandoned, for the wrong reason. Released once done."""
        rid = run.response["id"]
        try:
            while True:
                try:
                    if run.record.unstored:
                        await run.store_again()
                        run.record.unstored = False
                    if flush is not None:
                        await flush()
                    return
                except StoreUnavailable:
                    await asyncio.sleep(self.lease_s / 3)
        except ResponseDeleted:
            log.info("response %s was deleted before its end could be stored", rid)
        except Exception:  # its lease is released: the sweep stores it failed as abandoned
            log.exception("response %s: its end could not be stored", rid)
        finally:
            self.release(rid)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                if self._held:
                    await self.store.renew_leases(list(self._held), self.holder, time.time() + self.lease_s)
                # No lease could be renewed while the store was unreachable: none is judged until it
                # has answered for a lease since (a ping starts the count), so their holders renew them.
                if self.store.reachable_s() < self.lease_s:
                    await self.store.ping()
                    continue
                failed = await self.store.fail_abandoned(time.time(), ABANDONED, output_of)
                if failed:
                    log.warning("marked abandoned responses failed: %s", ", ".join(failed))
            except StoreUnavailable:  # the store's own log lines say so
                pass
            except Exception:  # keep renewing whatever one round did
                log.exception("lease round failed")


class RunEvents:
    """A foreground run's event batches as its answer reads them. Closed before its first read (the
    client left just as the answer's head went out), it still ends the run, as ``cancelled``: the
    ``aclose`` of an async generator that never started runs none of its code, and the run would
    keep its worker counted in flight and its stream open."""

    __slots__ = ("_run", "_events", "_started")

    def __init__(self, run: ResponseRun, events: AsyncGenerator[list[Event], None]) -> None:
        self._run = run
        self._events = events
        self._started = False

    def __aiter__(self) -> AsyncGenerator[list[Event], None]:
        self._started = True
        return self._events  # each batch straight from the generator: nothing added per batch

    async def __anext__(self) -> list[Event]:
        self._started = True
        return await self._events.__anext__()

    async def aclose(self) -> None:
        if not self._started:
            self._started = True
            await self._run.cancelled()
        await self._events.aclose()
