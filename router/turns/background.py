"""Background responses: run detached from the request, logged for replay, cancellable from any replica.
Leases on them, and on the foreground streams stored as they run.

Every event goes to the store's event log (in small batches), so a client can
replay and follow the stream from ANY replica, during the run or after it.
The replica running a response holds a lease on it and renews it; a replica
that dies stops renewing, and the sweep (on any replica) marks its responses
failed. Cancel requests go through the store, so any replica can cancel.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import AsyncGenerator
from typing import Any

from router.protocol.errors import APIError, InvalidRequest, NotFound
from router.protocol.replay import output_of
from router.protocol.shapes import response_error
from router.state.store import BackgroundStore, ResponseDeleted, Store, StoreUnavailable
from router.turns.runner import ResponseRun

log = logging.getLogger("router.background")
# How often a leased stream's output so far is stored (``BackgroundRuns._checkpoints``).
CHECKPOINT_S = 1.0

Event = dict[str, Any]
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed", "response.cancelled"})
FINISHED = frozenset({"completed", "incomplete", "failed", "cancelled"})
STOPPED = APIError("The router running this background response stopped before it finished.", code="router_stopped")
ABANDONED = response_error(STOPPED.code, STOPPED.message)  # the stored error of a response nobody runs any more
# How long a cancel request waits for the response to stop before it answers: the run here stops at
# once; one on another replica sees the request at its next poll (``poll_s``).
CANCEL_WAIT_S = 5.0
# Events wait at most this long in the log's buffer before they are written.
FLUSH_S = 0.05


class BackgroundRuns:
    """The background responses this replica runs, and the loops that keep them honest."""

    def __init__(self, store: Store, *, lease_s: float = 30.0, poll_s: float = 0.25, max_events: int = 100_000,
                 sweep_all_at_start: bool = False) -> None:
        self.store = store
        self.holder = f"{os.uname().nodename}:{os.getpid()}:{os.urandom(4).hex()}"
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.max_events = max_events
        self._sweep_all_at_start = sweep_all_at_start  # one replica only (SQLite): nothing else can be running
        self._runs: dict[str, asyncio.Task[None]] = {}
        self._streams: set[str] = set()  # foreground streams stored as they run (``leased``)
        self._cancelling: set[str] = set()
        self._wake: dict[str, asyncio.Event] = {}
        self._loops: list[asyncio.Task[None]] = []
        self._later: set[asyncio.Task[None]] = set()  # storing the ends of streams the store missed

    async def start(self) -> None:
        failed = await self.store.fail_abandoned(math.inf if self._sweep_all_at_start else time.time(), ABANDONED, output_of)
        if failed:
            log.warning("marked %d abandoned background responses failed", len(failed))
        self._loops = [asyncio.create_task(self._lease_loop(), name="leases"),
                       asyncio.create_task(self._cancel_loop(), name="cancels")]

    async def stop(self, drain_s: float = 5.0, margin_s: float = 2.0) -> None:
        """Let running responses finish for ``drain_s``, then fail the rest (given ``margin_s`` to store that)."""
        for loop in [*self._loops, *self._later]:
            loop.cancel()
        if self._runs:
            await asyncio.wait(list(self._runs.values()), timeout=drain_s)
        for task in list(self._runs.values()):
            task.cancel()
        if self._runs:
            await asyncio.wait(list(self._runs.values()), timeout=margin_s)

    # -- running ---------------------------------------------------------------

    async def submit(self, run: ResponseRun) -> dict[str, Any]:
        """Queue ``run``: stored as ``queued`` with its first events before this returns."""
        run.lease_holder = self.holder
        run.lease_s = self.lease_s
        events = run.queue()
        await run.persist()
        await self.store.append_events(run.response["id"], events)
        rid = run.response["id"]
        self._wake[rid] = asyncio.Event()
        self._runs[rid] = asyncio.create_task(self._run(run), name=f"background:{rid}")
        return dict(run.response)

    def stream(self, run: ResponseRun) -> AsyncGenerator[list[Event], None]:
        """A foreground ``run``'s events. A stored one is leased here while it runs: it is stored as
        ``in_progress`` as it starts (router/turns/runner.py), and if this replica dies the sweep marks
        it failed, as it does a background response."""
        return self._leased(run) if run.req.store else run.events()

    async def _leased(self, run: ResponseRun) -> AsyncGenerator[list[Event], None]:
        rid = run.response["id"]
        run.lease_holder = self.holder
        run.lease_s = self.lease_s
        self._streams.add(rid)
        stream = run.events()
        checkpoints = asyncio.create_task(self._checkpoints(run), name=f"checkpoints:{rid}")
        try:
            async for events in stream:
                yield events
        finally:
            checkpoints.cancel()  # the run's own last put has the lock first: nothing is overwritten
            try:
                await stream.aclose()  # now, as the client's leaving closes it: stored cancelled before this ends
            finally:
                if run.unstored:  # the store was unavailable: its end is stored once it is back, leased here meanwhile
                    task = asyncio.create_task(self._store_when_back(run, None), name=f"unstored:{rid}")
                    self._later.add(task)
                    task.add_done_callback(self._later.discard)
                else:
                    self._streams.discard(rid)

    async def _checkpoints(self, run: ResponseRun) -> None:
        """Every CHECKPOINT_S, a leased stream's output so far goes to the store (``run.checkpoint``):
        a replica killed mid-stream leaves its client's answer stored ``failed`` with what the client
        had seen up to then, as a background run leaves its event log."""
        while True:
            await asyncio.sleep(CHECKPOINT_S)
            try:
                await run.checkpoint()
            except ResponseDeleted:
                return
            except Exception:  # a missed checkpoint only means an older one stands
                log.debug("checkpoint of %s failed", run.response["id"], exc_info=True)

    async def _run(self, run: ResponseRun) -> None:
        rid = run.response["id"]
        log_ = _EventLog(self.store, rid, self.max_events, self._wake[rid])
        try:
            try:
                await self._drive(run, log_)
            except StoreUnavailable:  # its end could not be stored or logged: it is, once the store is back
                run.unstored = True
            await self._store_when_back(run, log_)
        except ResponseDeleted:  # deleted while it ran: nothing to record, and it stays deleted
            log.info("background response %s was deleted while it ran; stopped", rid)
        finally:
            try:
                await log_.flush()
            except StoreUnavailable:
                log.warning("background response %s: its last events are not logged (store unavailable)", rid)
            self._runs.pop(rid, None)
            self._cancelling.discard(rid)
            self._wake.pop(rid, None)

    async def _drive(self, run: ResponseRun, log_: _EventLog) -> None:
        """Run it to its end, whichever way it ends recorded (unless it was deleted meanwhile)."""
        try:
            try:
                await run.open_stream()
                async for events in run.events(background=True):
                    await log_.add(events)
            except StoreUnavailable as exc:  # unreachable past its retries: it stops, stored once the store is back
                if run.response["status"] not in FINISHED:
                    log_.keep(await run.failed(exc))
            except APIError:  # the worker could not be reached: stored failed by the runner
                await log_.add(run.failure_events)
            except asyncio.CancelledError:
                if run.response["id"] not in self._cancelling:
                    raise
                await log_.add(await run.cancelled())
        except asyncio.CancelledError:  # shutdown: record the failure while we still can
            await log_.add(await run.failed(STOPPED))
        except (ResponseDeleted, StoreUnavailable):
            raise
        except Exception as exc:  # a background task must always end recorded
            log.exception("background response %s crashed", run.response["id"])
            await log_.add(await run.failed(APIError(f"internal error: {exc}", code="internal_error")))

    async def cancel(self, body: dict[str, Any], owner: str) -> None:
        """Ask whichever replica runs it to stop, and wait (at most ``CANCEL_WAIT_S``) until it has,
        so the answer to a cancel says ``cancelled`` as clients expect; raises 400 for a response
        that cannot be cancelled."""
        rid = body["id"]
        if not body.get("background"):
            raise InvalidRequest("Only responses created with background set to true can be cancelled.", param="response_id")
        if body.get("status") == "cancelled":
            return  # cancelling twice is idempotent: the caller answers with the response as it is
        if body.get("status") in FINISHED:
            raise InvalidRequest(f"Cannot cancel a response with status '{body['status']}'.", param="response_id",
                                 code="response_already_finished")
        if not await self.store.request_cancel(rid, owner):
            raise NotFound(f"Response with id '{rid}' not found.", param="response_id", code="response_not_found")
        task = self._runs.get(rid)
        if task is not None:  # here: no need to wait for the poll
            self._cancel_local(rid)
            await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
            return
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:  # another replica runs it: it stops at its next poll
            await asyncio.sleep(self.poll_s / 5)
            stored = await self.store.get_response(rid, owner)
            if stored is None or stored.get("status") in FINISHED:
                return

    def deleted(self, rid: str) -> None:
        """The response was deleted: a run of it here stops now (one elsewhere at its next poll), and
        its puts find nothing to update, so it is not written back."""
        self._cancel_local(rid)

    def _cancel_local(self, rid: str) -> None:
        task = self._runs.get(rid)
        if task is not None and rid not in self._cancelling:
            self._cancelling.add(rid)
            task.cancel()

    async def _store_when_back(self, run: ResponseRun, log_: _EventLog | None) -> None:
        """Store what a run could not (its end, then its last events: the store stayed unreachable past
        its retries), trying until the store answers. Its id stays leased here meanwhile, renewed as
        soon as the store is back, so no sweep fails it as abandoned, for the wrong reason."""
        rid = run.response["id"]
        try:
            while True:
                try:
                    if run.unstored:
                        await run.persist()
                        run.unstored = False
                    if log_ is not None:
                        await log_.flush()
                    return
                except StoreUnavailable:
                    await asyncio.sleep(self.lease_s / 3)
        except ResponseDeleted:
            log.info("response %s was deleted before its end could be stored", rid)
        finally:
            self._streams.discard(rid)

    # -- replay ----------------------------------------------------------------

    async def replay(self, rid: str, owner: str, after: int) -> AsyncGenerator[list[Event], None]:
        """The event log from ``after`` on, then live events until the terminal one."""
        finished_at: float | None = None
        while True:
            events = await self.store.read_events(rid, owner, after=after, limit=500)
            if events is None:
                return
            if events:
                yield events
                after = events[-1]["sequence_number"]
                if events[-1]["type"] in TERMINAL:
                    return
                continue
            body = await self.store.get_response(rid, owner)
            if body is None:
                return
            if body.get("status") in FINISHED:
                if finished_at is None and after >= 0 and await self._ended_at(rid, owner, after):
                    return  # the client has seen the end already (or asked for more than there is)
                # Stored before its terminal events are logged: give them a moment, then end with
                # one made from the stored response (a replica that died never logs it).
                finished_at = finished_at or time.monotonic()
                if time.monotonic() - finished_at > 2.0:
                    yield [_terminal(body, after + 1)]
                    return
            await self._wait(rid)

    async def _ended_at(self, rid: str, owner: str, after: int) -> bool:
        """Whether a finished response's log has nothing for a client that has seen event ``after``:
        that event is the terminal one, or the log ends before it."""
        at = await self.store.read_events(rid, owner, after=after - 1, limit=1)
        return not at or at[0]["type"] in TERMINAL

    async def _wait(self, rid: str) -> None:
        wake = self._wake.get(rid)
        if wake is None:  # running elsewhere (or finished): poll
            await asyncio.sleep(self.poll_s / 2)
            return
        wake.clear()  # running here: woken as soon as events are logged
        try:
            await asyncio.wait_for(wake.wait(), self.poll_s)
        except TimeoutError:
            pass

    # -- loops -----------------------------------------------------------------

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                if self._runs or self._streams:
                    await self.store.renew_leases([*self._runs, *self._streams], self.holder, time.time() + self.lease_s)
                # No lease could be renewed while the store was unreachable: none is judged until it
                # has answered for a lease since (a ping starts the count), so their holders renew them.
                if self.store.reachable_s() < self.lease_s:
                    await self.store.ping()
                    continue
                failed = await self.store.fail_abandoned(time.time(), ABANDONED, output_of)
                if failed:
                    log.warning("marked abandoned background responses failed: %s", ", ".join(failed))
            except StoreUnavailable:  # the store's own log lines say so
                pass
            except Exception:  # keep renewing whatever one round did
                log.exception("lease round failed")

    async def _cancel_loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            if not self._runs:
                continue
            try:
                for rid in await self.store.cancel_requested(list(self._runs)):
                    self._cancel_local(rid)
            except StoreUnavailable:  # the store's own log lines say so
                pass
            except Exception:
                log.exception("cancel poll failed")


def _terminal(body: dict[str, Any], sequence_number: int) -> Event:
    status = body.get("status")
    kind = f"response.{status}" if status in FINISHED else "response.failed"
    return {"type": kind, "response": body, "sequence_number": sequence_number}


class _EventLog:
    """Buffers a response's events and writes them in small batches: at most ``FLUSH_S`` after the
    first of a batch, even when nothing follows it for a while (a tool running, a slow worker), so
    a replay never lags the run by more than that."""

    def __init__(self, store: BackgroundStore, rid: str, cap: int, wake: asyncio.Event) -> None:
        self._store = store
        self._rid = rid
        self._cap = cap
        self._wake = wake
        self._pending: list[Event] = []
        self._written = 0
        self._last = 0.0
        self._lock = asyncio.Lock()  # one write at a time: batches land in order
        self._timer: asyncio.TimerHandle | None = None
        self._later: asyncio.Task[None] | None = None  # the timer's flush, referenced while it runs
        self._error: Exception | None = None  # the timer's flush failed: raised by the next add

    def keep(self, events: list[Event]) -> None:
        """Queue ``events`` for the next flush, without writing now."""
        self._pending += events

    async def add(self, events: list[Event]) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._pending += events  # kept for a later flush (the failed batch went back before them)
            raise error
        self._pending += events
        terminal = bool(events) and events[-1]["type"] in TERMINAL
        wait = FLUSH_S - (time.monotonic() - self._last)
        if terminal or wait <= 0 or len(self._pending) >= 256:
            await self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(wait, self._flush_later)

    def _flush_later(self) -> None:
        self._timer = None
        self._later = asyncio.get_running_loop().create_task(self._flush_in_time())

    async def _flush_in_time(self) -> None:
        try:
            await self.flush()
        except Exception as exc:  # noqa: BLE001 - the run sees it at its next add, as if that add had written
            self._error = exc

    async def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        async with self._lock:
            if not self._pending:
                return
            batch, self._pending = self._pending, []
            room = self._cap - self._written
            if len(batch) > room:  # bounded: keep the terminal event so replays still end
                batch = batch[: max(room - 1, 0)] + [batch[-1]] if room > 0 else []
            if batch:
                try:
                    await self._store.append_events(self._rid, batch)
                except KeyError:  # the response was deleted while it ran: nothing left to replay
                    self._cap = 0
                except StoreUnavailable:  # kept for the next flush: the log stays whole, in order
                    self._pending = batch + self._pending
                    raise
                self._written += len(batch)
            self._last = time.monotonic()
            self._wake.set()
