"""The Store contract: what the router keeps, independent of the database.

Responses are kept as Responses items (never as an engine's messages) so a
conversation can move between engines. Every read takes an ``owner``: the
caller's key name, so one key never sees another key's responses.

Rules every implementation follows (the contract tests in
``tests/test_store*.py`` run against each one):

- Response ids are unique across owners. ``put_response`` for an id that
  exists under another owner raises ``PermissionError`` and changes nothing.
- Owner isolation holds at every hop: a chain never crosses owners, it stops
  at the first ancestor that belongs to someone else.
- Retention: a response whose ``expires_at`` (unix seconds) is at or before
  the store's clock is treated by every read as not found, including as a
  hop of a chain (the chain stops there, like at a deleted response).
  ``purge_expired`` removes such responses for good.
- ``previous_response_id`` is not a foreign key: deleting (or expiring) a
  response leaves its children intact; their history stops at the gap.
- ``list_input_items`` raises ``KeyError(after)`` when ``after`` is not one of
  the response's input items (the API answers 400 naming ``after``), and
  ``ValueError`` for a limit below 1 or an order other than asc/desc.
- Conversations follow the same owner rules: another owner's conversation
  is "not found" everywhere. ``list_conversation_items`` has the same
  ``after``/``limit``/``order`` rules as ``list_input_items``.
- The event log of a response is deleted with the response (and purged
  with it). Background bookkeeping (lease, cancel request) lives on the
  response row and is never visible in the Response body.
- A database that cannot be reached (a restart, an outage) is retried for a
  bounded time where the store can (PostgreSQL: ``[store] retry_s``); past
  it, any call raises ``StoreUnavailable``. A retried write has the effect of
  one write, even when an attempt's outcome was lost with its connection; a
  retried delete whose lost attempt had deleted reports False.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from router.protocol.errors import APIError

Item = dict[str, Any]
Order = Literal["asc", "desc"]


# A response's logged events -> the output items to keep (see BackgroundStore.fail_abandoned).
Settle = Callable[[list[dict[str, Any]]], list[Item]]


@dataclass(slots=True)
class StoredResponse:
    """One response as persisted: the Response object plus its turn's input items."""

    id: str
    owner: str
    previous_response_id: str | None
    created_at: int
    status: str
    # The whole Response object as the API returns it (``output`` included).
    body: dict[str, Any]
    # This turn's own input items, normalized, each with an ``id``.
    input_items: list[Item] = field(default_factory=list)
    # Unix seconds after which the response counts as gone; None keeps it forever.
    expires_at: int | None = None
    # Background responses: the router instance running it and until when it promised to (unix seconds, float).
    # Every response put as queued/in_progress needs a lease: ``fail_abandoned`` fails one without.
    lease_holder: str | None = None
    lease_until: float | None = None
    # Created in a conversation: it, and the conversation's end when the response was made. Its history
    # is the conversation's items before that position (what it saw), then its own (a chain from it
    # continues them).
    conversation_id: str | None = None
    conversation_position: int | None = None
    # Put before by this run (a background response writing its progress): only ever update it, and
    # raise ResponseDeleted if it is gone, so a response deleted while it ran is not written back.
    existing: bool = False


class ResponseDeleted(KeyError):
    """A put with ``existing`` found no response to update: it was deleted meanwhile."""


class StoreUnavailable(APIError):
    """The store could not be reached, retries included: the client may try again later (503)."""

    status = 503
    type = "server_error"

    def __init__(self, message: str = "The response store cannot be reached right now; try again later.") -> None:
        super().__init__(message, code="store_unavailable")


class ResponseInProgress(Exception):
    """``load_history`` from a response that has not finished: a turn on it would miss its output."""


@dataclass(slots=True)
class Conversation:
    id: str
    owner: str
    created_at: int
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class ItemPage:
    data: list[Item]
    has_more: bool


class ResponseStore(Protocol):
    """Responses: each with its input and output items, chained by ``previous_response_id``."""

    async def open(self) -> None:
        """Create or migrate the schema if needed; called once at start-up. Idempotent."""
        ...

    async def close(self) -> None:
        """Release the connection(s). Idempotent; any later call but ``open`` raises RuntimeError."""
        ...

    async def ping(self) -> None:
        """Reach the database once, without retrying (``/health``): StoreUnavailable when it cannot."""
        ...

    async def put_response(self, response: StoredResponse) -> None:
        """Insert or replace a response, its input items and output items, atomically.

        Replacing drops all the old items. Raises PermissionError when the id
        exists under another owner (nothing is written then).

        The lease columns are set from ``lease_holder``/``lease_until``, except
        that a put by the holder of the current lease never shortens it (a
        ``renew_leases`` may have extended it since this object was built). A
        pending cancel request is kept: a running response re-puts itself.
        With ``existing`` set, a response that is no longer stored (deleted)
        raises ``ResponseDeleted`` and nothing is written.
        """
        ...

    async def get_response(self, response_id: str, owner: str) -> dict[str, Any] | None:
        """The Response object, or None when unknown, deleted, expired or another owner's."""
        ...

    async def load_history(self, response_id: str, owner: str) -> list[Item] | None:
        """Items of the chain ending at ``response_id``, oldest first, in ONE query.

        For each response of the chain: its input items, then its output
        items, each by position. The chain stops at the first ancestor that is
        missing, expired or another owner's. None when ``response_id`` itself
        is unknown (or expired) to this owner. Raises ResponseInProgress when
        ``response_id`` is queued or in progress (a background response still
        running): its output is not there yet.
        """
        ...

    async def delete_response(self, response_id: str, owner: str) -> bool:
        """Remove a response and its items; False when there was none to remove.

        An expired response is removed too, but reported as False (it was
        already gone as far as the caller can tell).
        """
        ...

    async def list_input_items(
        self,
        response_id: str,
        owner: str,
        *,
        after: str | None = None,
        limit: int = 20,
        order: Order = "desc",
    ) -> ItemPage | None:
        """A page of the response's own input items in ``order``, strictly after item ``after``.

        None when the response is unknown (or expired). Raises KeyError(after)
        for an unknown ``after``, ValueError for a limit below 1 or a bad order.
        """
        ...

    async def purge_expired(self, now: int) -> int:
        """Delete every response with ``expires_at <= now`` (any owner); returns how many."""
        ...

    async def set_routing(self, response_id: str, routing: dict[str, Any]) -> None:
        """Record where a stored response was served (pool, arm, worker); deleted with it."""
        ...

    async def get_routing(self, response_id: str, owner: str) -> dict[str, Any] | None:
        """What ``set_routing`` recorded, or None."""
        ...

    async def get_items(self, item_ids: list[str], owner: str) -> dict[str, Item]:
        """Stored items by id, for ``item_reference`` input: any input or output item of this
        owner's (unexpired) responses, or of this owner's conversations. Unknown ids are absent.
        An id stored in several places (a conversation keeps copies of its responses' items)
        maps to one of its copies. One query."""
        ...


class ConversationStore(Protocol):
    """Conversations: an ordered list of items, appended to by each response that names it."""

    async def create_conversation(self, conversation: Conversation, items: list[Item]) -> None:
        """Insert a conversation with its initial items (each has a unique ``id``), atomically.

        Raises ValueError when the id is already taken, by any owner (nothing is written then).
        """
        ...

    async def get_conversation(self, conversation_id: str, owner: str) -> Conversation | None: ...

    async def update_conversation(self, conversation_id: str, owner: str, metadata: dict[str, str]) -> Conversation | None:
        """Replace the metadata; None when unknown."""
        ...

    async def delete_conversation(self, conversation_id: str, owner: str) -> bool:
        """Remove the conversation and its items (the responses that used it stay)."""
        ...

    async def add_conversation_items(self, conversation_id: str, owner: str, items: list[Item]) -> int | None:
        """Append items at the end, atomically. Returns the position the first of them took (the
        conversation's end before them, for an empty list), None when the conversation is unknown."""
        ...

    async def load_conversation(self, conversation_id: str, owner: str) -> list[Item] | None:
        """Every item, oldest first, in ONE query; None when unknown."""
        ...

    async def load_conversation_with_end(self, conversation_id: str, owner: str) -> tuple[list[Item], int] | None:
        """``load_conversation`` and, from the same snapshot, the position the next appended item
        will take: a response made now saw the items before it (``StoredResponse.conversation_position``)."""
        ...

    async def list_conversation_items(
        self, conversation_id: str, owner: str, *, after: str | None = None, limit: int = 20, order: Order = "desc"
    ) -> ItemPage | None:
        """Like ``list_input_items``: KeyError for an unknown ``after``, ValueError for a bad limit/order."""
        ...

    async def get_conversation_item(self, conversation_id: str, owner: str, item_id: str) -> Item | None: ...

    async def delete_conversation_item(self, conversation_id: str, owner: str, item_id: str) -> bool:
        """Remove the item (every copy, should the id be there twice); False when none was removed.
        ``get_conversation_item`` returns the last copy of a repeated id."""
        ...


class BackgroundStore(Protocol):
    """What background responses need: an event log to replay, leases, cancel requests.

    Several router replicas share one store: the replica running a response
    holds a lease on it and renews it; any replica can ask it to cancel; a
    response whose lease ran out (its replica died) is marked failed.
    """

    def reachable_s(self) -> float:
        """How long the database has answered this replica since it last failed to (seconds; inf when
        it never failed, 0.0 while it is failing). Leases could not be renewed while it failed: the
        sweep waits until it has answered for a lease (router/turns/background.py)."""
        ...

    async def append_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        """Add events (each has a unique, increasing ``sequence_number``) to the response's log, atomically.

        Raises KeyError(response_id) when the response is not stored (e.g. deleted meanwhile) and
        ValueError for an event without an integer ``sequence_number`` or with one already logged;
        nothing is written then. Any owner: the caller is the replica running the response.
        """
        ...

    async def read_events(self, response_id: str, owner: str, *, after: int = -1, limit: int = 1000) -> list[dict[str, Any]] | None:
        """Events with ``sequence_number > after``, ascending, at most ``limit``; None when the response is
        unknown (or expired) to this owner. ValueError for a limit below 1."""
        ...

    async def renew_leases(self, response_ids: list[str], holder: str, until: float) -> None:
        """Set ``lease_until`` of those of these responses whose lease ``holder`` holds (others' leases,
        and responses with no lease, are left alone)."""
        ...

    async def request_cancel(self, response_id: str, owner: str) -> bool:
        """Flag a response for cancelling; False when it is unknown (or expired) to this owner.
        The flag stays until the response is deleted; ``put_response`` never clears it."""
        ...

    async def cancel_requested(self, response_ids: list[str]) -> set[str]:
        """Which of these responses must stop: they have a cancel request, or they are no longer
        stored (deleted while they ran). Any owner: asked by the running replica."""
        ...

    async def fail_abandoned(self, now: float, error: dict[str, Any], settle: Settle | None = None) -> list[str]:
        """Responses still ``queued``/``in_progress`` whose lease ended before ``now`` (or that have
        no lease) become ``failed``: status and body (``status``, ``error``) updated atomically, and
        their lease cleared. With ``settle``, one that has logged events gets the output
        ``settle(events)`` gives (what its run had produced; router/protocol/replay.py). Returns
        their ids. Safe to run on every replica at once: each response is failed (and returned) by
        one of them only. Never retried: a database it cannot reach raises StoreUnavailable at once
        (the sweep runs again soon, and must first give the holders a lease to renew theirs)."""
        ...


class Store(ResponseStore, ConversationStore, BackgroundStore, Protocol):
    """The whole contract: what SQLiteStore and PostgresStore implement (``make_store`` returns one,
    so the type checker holds both to it) and what the router is handed."""
