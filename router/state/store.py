"""The Store contract: what the router keeps, independent of the database.

Responses are kept as Responses items (never as an engine's messages) so a
conversation can move between engines. Every read takes an ``owner``: the
caller's key name, so one key never sees another key's responses.
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


@dataclass(slots=True)
class ItemPage:
    data: list[Item]
    has_more: bool


class Store(Protocol):
    async def open(self) -> None:
        """Create the schema if needed; called once at start-up."""

    async def close(self) -> None: ...

    async def put_response(self, response: StoredResponse) -> None:
        """Insert or replace a response, its input items and output items, atomically."""

    async def get_response(self, response_id: str, owner: str) -> dict[str, Any] | None:
        """The Response object, or None when unknown, deleted or another owner's."""

    async def load_history(self, response_id: str, owner: str) -> list[Item] | None:
        """Items of the chain ending at ``response_id``, oldest first, in ONE query.

        For each response of the chain: its input items, then its output
        items. None when ``response_id`` itself is unknown to this owner.
        """

    async def delete_response(self, response_id: str, owner: str) -> bool:
        """Remove a response and its items; False when there was none to remove."""

    async def list_input_items(
        self,
        response_id: str,
        owner: str,
        *,
        after: str | None = None,
        limit: int = 20,
        order: Order = "desc",
    ) -> ItemPage | None:
        """A page of the response's own input items; None when the response is unknown."""
