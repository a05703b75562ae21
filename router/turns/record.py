"""The record stage: how one response is kept in the store while it runs and when it ends.

A response is put once when it starts (a background run or a leased stream,
so any replica can retrieve it and the sweep can fail it if this replica
dies), then at its end, with the conversation it belongs to: one put after
the other (the first is awaited before the stream's first event). Meanwhile,
at most once a second, what its output grew by is appended to its event log
(``checkpoint``): a long answer is written once, not once per second.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.protocol.items import Item
from router.protocol.replay import growth
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
    _checkpointed: int = -1  # the event sequence number of the last checkpoint
    _logged: list[Item] = field(default_factory=list)  # the output the checkpoints' log holds
    _log_seq: int = 0  # the next checkpoint event's number in the log

    def lease(self, holder: str, lease_s: float) -> None:
        """Held by the replica ``holder`` while it runs (router/turns/leases.py renews it)."""
        self.lease_holder = holder
        self.lease_s = lease_s

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
            await self._store(response)
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
            await self._store({**response, "output": []})
        except StoreUnavailable as exc:
            return exc
        except Exception:  # the stream goes on; its last put stores it
            log.warning("could not store streamed response %s as it started", response["id"], exc_info=True)
        return None

    async def checkpoint(self, response: dict[str, Any], sequence: int, output: Callable[[], list[Item]]) -> bool:
        """A leased stream's ``output()`` so far, kept in its event log as what grew since the last
        checkpoint (``router.protocol.replay.growth``: a delta of the new text, not the whole output
        again). If this replica dies, the sweep fails it with what the log says its client had seen
        up to then, and a retrieve while it runs shows the same (router/api/responses.py). Nothing
        when no event came since the last one (``sequence``), or once the response ended. True:
        logged. ResponseDeleted: the response is no longer stored."""
        if self.lease_holder is None or sequence == self._checkpointed or response["status"] != "in_progress" or not self._persisted:
            return False
        self._checkpointed = sequence
        now = output()
        events = growth(self._logged, now)
        if not events:
            return False
        for event in events:
            event["sequence_number"] = self._log_seq
            self._log_seq += 1
        try:
            await self.store.append_events(response["id"], events)
        except KeyError:
            raise ResponseDeleted(response["id"]) from None
        self._logged = now
        return True

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
