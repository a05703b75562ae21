"""Background responses: run detached from the request, logged for replay, cancellable from any replica.

Every event goes to the store's event log (in small batches), so a client can
replay and follow the stream from ANY replica, during the run or after it.
The replica running a response leases it (router/turns/leases.py). Cancel
requests go through the store, so any replica can cancel.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from router.protocol.errors import APIError, InvalidRequest, NotFound
from router.state.store import BackgroundStore, ResponseDeleted, Store, StoreUnavailable
from router.turns.leases import STOPPED, Leases
from router.turns.runner import ResponseRun

log = logging.getLogger("router.background")

Event = dict[str, Any]
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed", "response.cancelled"})
FINISHED = frozenset({"completed", "incomplete", "failed", "cancelled"})
# How long a cancel request waits for the response to stop before it answers: the run here stops at
# once; one on another replica sees the request at its next poll (``poll_s``).
CANCEL_WAIT_S = 5.0
# Events wait at most this long in the log's buffer before they are written.
FLUSH_S = 0.05


class BackgroundRuns:
    """The background responses this replica runs, and the loops that keep them honest."""

    def __init__(self, store: Store, leases: Leases, *, poll_s: float = 0.25, max_events: int = 100_000) -> None:
        self.store = store
        self.leases = leases
        self.poll_s = poll_s
        self.max_events = max_events
        self._runs: dict[str, asyncio.Task[None]] = {}
        self._cancelling: set[str] = set()
        self._wake: dict[str, asyncio.Event] = {}
        self._loops: list[asyncio.Task[None]] = []
        self._running = asyncio.Event()  # set while ``_runs`` has any: the cancel poll sleeps on it otherwise

    async def start(self) -> None:
        await self.leases.start()
        self._loops = [asyncio.create_task(self._cancel_loop(), name="cancels")]

    async def stop(self, drain_s: float = 5.0, margin_s: float = 2.0) -> None:
        """Let running responses finish for ``drain_s``, then fail the rest (given ``margin_s`` to store that)."""
        for loop in self._loops:
            loop.cancel()
        self.leases.stop()
        if self._runs:
            await asyncio.wait(list(self._runs.values()), timeout=drain_s)
        for task in list(self._runs.values()):
            task.cancel()
        if self._runs:
            await asyncio.wait(list(self._runs.values()), timeout=margin_s)

    # -- running ---------------------------------------------------------------

    async def submit(self, run: ResponseRun) -> dict[str, Any]:
        """Queue ``run``: stored as ``queued`` with its first events before this returns."""
        rid = run.response["id"]
        self.leases.hold(run)
        events = run.queue()
        try:
            await run.persist()
            await self.store.append_events(rid, events)
        except BaseException:
            self.leases.release(rid)
            raise
        self._wake[rid] = asyncio.Event()
        self._runs[rid] = asyncio.create_task(self._run(run), name=f"background:{rid}")
        self._running.set()
        return dict(run.response)

    async def _run(self, run: ResponseRun) -> None:
        rid = run.response["id"]
        log_ = _EventLog(self.store, rid, self.max_events, self._wake[rid])
        try:
            try:
                await self._drive(run, log_)
            except StoreUnavailable:  # its end could not be stored or logged: it is, once the store is back
                run.record.unstored = True
            await self.leases.store_when_back(run, log_.flush)
        except ResponseDeleted:  # deleted while it ran: nothing to record, and it stays deleted
            log.info("background response %s was deleted while it ran; stopped", rid)
        finally:
            try:
                await log_.flush()
            except StoreUnavailable:
                log.warning("background response %s: its last events are not logged (store unavailable)", rid)
            self.leases.release(rid)
            self._runs.pop(rid, None)
            if not self._runs:
                self._running.clear()
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
                    log_.keep(await run.fail(exc))
            except APIError:  # the worker could not be reached: stored failed by the runner
                await log_.add(run.refused_events)
            except asyncio.CancelledError:
                if run.response["id"] not in self._cancelling:
                    raise
                await log_.add(await run.cancelled())
        except asyncio.CancelledError:  # shutdown: record the failure while we still can
            await log_.add(await run.fail(STOPPED))
        except (ResponseDeleted, StoreUnavailable):
            raise
        except Exception as exc:  # a background task must always end recorded
            log.exception("background response %s crashed", run.response["id"])
            await log_.add(await run.fail(APIError(f"internal error: {exc}", code="internal_error")))

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

    async def _cancel_loop(self) -> None:
        while True:
            await self._running.wait()  # an idle router wakes for nothing
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
