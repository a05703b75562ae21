"""The record stage: how one response is kept in the store while it runs and when it ends.

A response is put once when it starts (a background run or a leased stream,
so any replica can retrieve it and the sweep can fail it if this replica
dies), then at most once a second with its output so far (``checkpoint``),
then at its end, with the conversation it belongs to. Puts never overlap: a
checkpoint cannot overwrite the end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.protocol.items import Item
from router.state.store import ResponseDeleted, Store, StoredResponse, StoreUnavailable

log = logging.getLogger("router.turns")


@dataclass(eq=False)
class Record:
    """One response's place in the store; nothing here is shared between responses."""

    store: Store
    owner: str
    stored: bool  # the request's ``store``: False keeps nothing but the conversation's items
    previous_response_id: str | None
    input_items: list[Item]  # the request's items as sent (normalized): what is stored as its input
    background: bool = False
    ttl_s: int | None = None  # stored responses expire this long after creation
    conversation_id: str | None = None  # the turn's input and output are appended to it
    conversation_position: int | None = None  # its end when the turn loaded it: the turn saw what is before
    # Background responses and leased streams: the replica running it, how long its lease lasts per renewal.
    lease_holder: str | None = None
    lease_s: float = 30.0
    # Its end could not be stored (the store stayed unreachable past its retries): ``end`` again later.
    unstored: bool = False
    _persisted: bool = False  # stored once already: later puts only update it
    # Leased runs only (their checkpoints may overlap their end): a plain create's one put takes no lock.
    _put_lock: asyncio.Lock | None = None
    _checkpointed: int = -1  # the event sequence number of the last checkpoint

    def lease(self, holder: str, lease_s: float) -> None:
        """Held by the replica ``holder`` while it runs (router/turns/leases.py renews it)."""
        self.lease_holder = holder
        self.lease_s = lease_s
        if self._put_lock is None:
            self._put_lock = asyncio.Lock()

    async def end(self, response: dict[str, Any], *, write: bool = True) -> bool:
        """Its state now (its end, or ``queued`` for a background run): appended to its conversation
        once it completed, and put unless ``write`` is False (the store is known to be unavailable).
        True: it was put."""
        status = response["status"]
        if self.conversation_id is not None and status in ("completed", "incomplete"):
            await self.store.add_conversation_items(self.conversation_id, self.owner, self.input_items + response["output"])
        if not self.stored or not write:
            return False
        try:
            await self._put(response)
        except ResponseDeleted:
            if self.lease_holder is None or self.background:
                raise
            # A stream its client deleted while it ran: it stays deleted, and the stream ends as it would.
            log.info("streamed response %s was deleted while it ran; not stored again", response["id"])
            return False
        return True

    async def end_or_log(self, response: dict[str, Any], *, write: bool = True) -> bool:
        """``end`` of a response whose end goes to the client whether or not it is stored (failed,
        cancelled): a store that stays unreachable past its retries is logged, not raised."""
        try:
            stored = await self.end(response, write=write)
        except StoreUnavailable:
            write = stored = False
        if not write and self.stored:
            self.unstored = True
            log.warning("response %s ended %s and could not be stored: the store is unavailable",
                        response["id"], response["status"])
        return stored

    async def routing(self, response_id: str, served: dict[str, Any]) -> None:
        """Where the response was served (its arm, its worker), for the next turn of its chain."""
        await self.store.set_routing(response_id, served)

    async def opening(self, response: dict[str, Any]) -> StoreUnavailable | None:
        """A leased stream's first put: ``in_progress``, no output yet, so it can be retrieved (and is
        not chained on) while it runs, and is failed by the sweep if this replica dies. A failure
        here is logged; the put at the end tries again. A store unreachable past its retries is
        returned: the stream ends failed at once (its end could not be stored either)."""
        try:
            await self._put({**response, "output": []})
        except StoreUnavailable as exc:
            return exc
        except Exception:  # the stream goes on; its last put stores it
            log.warning("could not store streamed response %s as it started", response["id"], exc_info=True)
        return None

    async def checkpoint(self, response: dict[str, Any], sequence: int, output: Callable[[], list[Item]]) -> bool:
        """A leased stream's ``output()`` so far, stored with it ``in_progress``: if this replica dies,
        the sweep fails it with what its client had seen up to the last checkpoint, not with nothing.
        Nothing when no event came since the last one (``sequence``), or once the response ended
        (its own put, under the same lock, comes first). True: stored."""
        lock = self._put_lock
        if lock is None or sequence == self._checkpointed or response["status"] != "in_progress" or not self._persisted:
            return False
        async with lock:
            if response["status"] != "in_progress":
                return False
            self._checkpointed = sequence
            put = asyncio.ensure_future(self._store({**response, "output": output()}))
            try:
                await asyncio.shield(put)
            except asyncio.CancelledError:  # the stream ended: the lock is kept until this put is done
                await asyncio.wait({put})
                if not put.cancelled():
                    put.exception()  # retrieved: a failed checkpoint only means an older one stands
                raise
        return True

    async def _put(self, body: dict[str, Any]) -> None:
        if self._put_lock is None:  # not leased: no checkpoints to wait for
            await self._store(body)
            return
        async with self._put_lock:  # never under a checkpoint's put, which would overwrite it
            await self._store(body)

    async def _store(self, body: dict[str, Any]) -> None:
        status = body["status"]
        running = status in ("queued", "in_progress") and self.lease_holder is not None
        await self.store.put_response(
            StoredResponse(
                id=body["id"],
                owner=self.owner,
                previous_response_id=self.previous_response_id,
                created_at=body["created_at"],
                status=status,
                body=body,
                input_items=self.input_items,
                expires_at=body["created_at"] + self.ttl_s if self.ttl_s else None,
                lease_holder=self.lease_holder if running else None,
                lease_until=time.time() + self.lease_s if running else None,
                existing=self._persisted,
                conversation_id=self.conversation_id,
                conversation_position=self.conversation_position,
            )
        )
        self._persisted = True
