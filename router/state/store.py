"""The Store contract: what the router keeps, independent of the database.

Responses are kept as Responses items (never as an engine's messages) so a
conversation can move between engines. Every read takes an ``owner``: the
caller's key name, so one key never sees another key's responses.

Rules every implementation follows (the contract tests in
``tests/test_store.py`` run against each one):

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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Item = dict[str, Any]
Order = Literal["asc", "desc"]


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


@dataclass(slots=True)
class ItemPage:
    data: list[Item]
    has_more: bool


class Store(Protocol):
    async def open(self) -> None:
        """Create or migrate the schema if needed; called once at start-up. Idempotent."""

    async def close(self) -> None:
        """Release the connection(s). Idempotent; any later call but ``open`` raises RuntimeError."""

    async def put_response(self, response: StoredResponse) -> None:
        """Insert or replace a response, its input items and output items, atomically.

        Replacing drops all the old items. Raises PermissionError when the id
        exists under another owner (nothing is written then).
        """

    async def get_response(self, response_id: str, owner: str) -> dict[str, Any] | None:
        """The Response object, or None when unknown, deleted, expired or another owner's."""

    async def load_history(self, response_id: str, owner: str) -> list[Item] | None:
        """Items of the chain ending at ``response_id``, oldest first, in ONE query.

        For each response of the chain: its input items, then its output
        items, each by position. The chain stops at the first ancestor that is
        missing, expired or another owner's. None when ``response_id`` itself
        is unknown (or expired) to this owner.
        """

    async def delete_response(self, response_id: str, owner: str) -> bool:
        """Remove a response and its items; False when there was none to remove.

        An expired response is removed too, but reported as False (it was
        already gone as far as the caller can tell).
        """

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

    async def purge_expired(self, now: int) -> int:
        """Delete every response with ``expires_at <= now`` (any owner); returns how many."""
