"""``ConversationStore`` for PostgresStore: a mixin over the store's pool.

A conversation is a row of ``conversations`` plus its items in
``conversation_items``, ordered by position. Appending takes its positions
from the conversation's ``next_position`` counter, bumped by the same UPDATE
that checks the owner: that UPDATE locks the row, so concurrent appends to
one conversation (from any replica) run one after the other and never
collide. Items go with their conversation by ON DELETE CASCADE. Another
owner's conversation is "not found" everywhere.

Calls are retried like every call (router/state/postgres.py). The two that
are not idempotent by themselves check, after an attempt whose COMMIT may have
been sent, whether it took effect: a create whose id is taken by a row equal
to its own (owner, time, metadata: ids are random, so it is the lost
attempt's), an append whose reserved positions hold its items.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncpg
import orjson

from router.state.common import check_page, decode_bodies, encode_items
from router.state.retry import Retrier
from router.state.store import Conversation, Item, ItemPage, Order

_GET_SQL = "SELECT id, owner, created_at, metadata FROM conversations WHERE id = $1 AND owner = $2"

_CREATE_SQL = """
INSERT INTO conversations (id, owner, created_at, metadata, next_position) VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (id) DO NOTHING
RETURNING 1
"""

# The conversation a create's lost attempt made, when it did.
_CREATED_SQL = "SELECT 1 FROM conversations WHERE id = $1 AND owner = $2 AND created_at = $3 AND metadata = $4"

_UPDATE_SQL = """
UPDATE conversations SET metadata = $3 WHERE id = $1 AND owner = $2
RETURNING id, owner, created_at, metadata
"""

# Reserves $3 positions at the end; no row when the conversation is unknown to the owner.
_RESERVE_SQL = """
UPDATE conversations SET next_position = next_position + $3 WHERE id = $1 AND owner = $2
RETURNING next_position
"""

_INSERT_ITEMS_SQL = """
INSERT INTO conversation_items (conversation_id, position, item_id, body)
SELECT $1, $2 + t.k - 1, t.item_id, t.body
FROM unnest($3::text[], $4::bytea[]) WITH ORDINALITY AS t (item_id, body, k)
"""

# Whether positions $2.. of a conversation hold exactly these bodies ($3): an append's lost attempt's.
_APPENDED_SQL = """
SELECT coalesce(array_agg(body ORDER BY position), '{}') = $3::bytea[] FROM conversation_items
WHERE conversation_id = $1 AND position >= $2 AND position < $2 + cardinality($3::bytea[])
"""

_LOAD_SQL = """
SELECT ci.body, c.next_position FROM conversations c LEFT JOIN conversation_items ci ON ci.conversation_id = c.id
WHERE c.id = $1 AND c.owner = $2
ORDER BY ci.position
"""

# One statement, so one snapshot: no row when the conversation is unknown; a
# NULL bound when ``after`` ($3) is not one of its items; else the page.
_LIST_SQL = """
SELECT b.bound, ARRAY(
    SELECT i.body FROM conversation_items i
    WHERE i.conversation_id = $1 AND i.position {cmp} b.bound
    ORDER BY i.position {direction} LIMIT $5
) AS page
FROM conversations c, LATERAL (
    SELECT CASE WHEN $3::text IS NULL THEN $4::integer ELSE (
        SELECT position FROM conversation_items
        WHERE conversation_id = $1 AND item_id = $3
        ORDER BY position {direction} LIMIT 1
    ) END AS bound
) b
WHERE c.id = $1 AND c.owner = $2
"""
_LIST = {
    "asc": _LIST_SQL.format(cmp=">", direction="ASC"),
    "desc": _LIST_SQL.format(cmp="<", direction="DESC"),
}

_GET_ITEM_SQL = """
SELECT ci.body FROM conversation_items ci JOIN conversations c ON c.id = ci.conversation_id
WHERE c.id = $1 AND c.owner = $2 AND ci.item_id = $3
ORDER BY ci.position DESC LIMIT 1
"""

_DELETE_ITEM_SQL = """
DELETE FROM conversation_items
WHERE conversation_id = $1 AND item_id = $3 AND EXISTS (SELECT 1 FROM conversations WHERE id = $1 AND owner = $2)
"""


def _conversation(row: asyncpg.Record | None) -> Conversation | None:
    if row is None:
        return None
    return Conversation(
        id=row["id"], owner=row["owner"], created_at=row["created_at"], metadata=orjson.loads(row["metadata"])
    )


def _count(status: str) -> int:
    return int(status.split()[-1])  # "DELETE <n>"


class PostgresConversations:
    """Mixin of PostgresStore (which provides ``_pool``, ``_retry``)."""

    if TYPE_CHECKING:
        _retry: Retrier

        @property
        def _pool(self) -> asyncpg.Pool: ...

    async def create_conversation(self, conversation: Conversation, items: list[Item]) -> None:
        """Insert the conversation and its items in one transaction.

        Raises ValueError when the id is already taken (by any owner); nothing is written then.
        """
        c = conversation
        metadata = orjson.dumps(c.metadata)
        encoded = encode_items(items)
        committing = False

        async def attempt() -> None:
            nonlocal committing
            async with self._pool.acquire() as conn, conn.transaction():
                if await conn.fetchval(_CREATE_SQL, c.id, c.owner, c.created_at, metadata, len(encoded)) is None:
                    if committing and await conn.fetchval(_CREATED_SQL, c.id, c.owner, c.created_at, metadata):
                        return  # made by the attempt whose COMMIT's answer was lost
                    raise ValueError(f"conversation {c.id!r} already exists")
                if encoded:
                    await conn.execute(_INSERT_ITEMS_SQL, c.id, 0, *map(list, zip(*encoded)))
                committing = True

        await self._retry.run(attempt)

    async def get_conversation(self, conversation_id: str, owner: str) -> Conversation | None:
        return _conversation(await self._retry.run(self._pool.fetchrow, _GET_SQL, conversation_id, owner))

    async def update_conversation(
        self, conversation_id: str, owner: str, metadata: dict[str, str]
    ) -> Conversation | None:
        """Replace the metadata; None when unknown."""
        row = await self._retry.run(self._pool.fetchrow, _UPDATE_SQL, conversation_id, owner, orjson.dumps(metadata))
        return _conversation(row)

    async def delete_conversation(self, conversation_id: str, owner: str) -> bool:
        """Items go by ON DELETE CASCADE; responses that used the conversation stay."""
        status = await self._retry.run(self._pool.execute, "DELETE FROM conversations WHERE id = $1 AND owner = $2",
                                       conversation_id, owner)
        return _count(status) == 1

    async def add_conversation_items(self, conversation_id: str, owner: str, items: list[Item]) -> int | None:
        """Append after the last item, in one transaction: the first one's position, None when unknown."""
        encoded = encode_items(items)
        bodies = [body for _, body in encoded]
        committing: int | None = None  # the start of the attempt whose COMMIT was sent

        async def attempt() -> int | None:
            nonlocal committing
            async with self._pool.acquire() as conn:
                if committing is not None and await conn.fetchval(_APPENDED_SQL, conversation_id, committing, bodies):
                    return committing  # appended by the attempt whose COMMIT's answer was lost
                async with conn.transaction():
                    end = await conn.fetchval(_RESERVE_SQL, conversation_id, owner, len(encoded))
                    if end is None:
                        return None
                    start: int = end - len(encoded)
                    if encoded:
                        await conn.execute(_INSERT_ITEMS_SQL, conversation_id, start, *map(list, zip(*encoded)))
                    committing = start
            return start

        return await self._retry.run(attempt)

    async def load_conversation(self, conversation_id: str, owner: str) -> list[Item] | None:
        """Every item, oldest first, in one query; None when unknown."""
        loaded = await self.load_conversation_with_end(conversation_id, owner)
        return None if loaded is None else loaded[0]

    async def load_conversation_with_end(self, conversation_id: str, owner: str) -> tuple[list[Item], int] | None:
        rows = await self._retry.run(self._pool.fetch, _LOAD_SQL, conversation_id, owner)
        if not rows:
            return None  # the LEFT JOIN yields >= 1 row when the conversation is there
        return decode_bodies(rows), rows[0][1]

    async def list_conversation_items(
        self, conversation_id: str, owner: str, *, after: str | None = None, limit: int = 20, order: Order = "desc"
    ) -> ItemPage | None:
        """A page in ``order``, strictly after item ``after``, in one query: KeyError(after) for an id
        that is not in the conversation, ValueError for a bad limit/order, None when unknown."""
        check_page(limit, order)
        start = -1 if order == "asc" else 2**31 - 1
        row = await self._retry.run(self._pool.fetchrow, _LIST[order], conversation_id, owner, after, start, limit + 1)
        if row is None:
            return None
        if row["bound"] is None:
            raise KeyError(after)
        page = row["page"]
        return ItemPage(data=[orjson.loads(body) for body in page[:limit]], has_more=len(page) > limit)

    async def get_conversation_item(self, conversation_id: str, owner: str, item_id: str) -> Item | None:
        """The item with this id (the last one, should the id be there twice); None when unknown."""
        body = await self._retry.run(self._pool.fetchval, _GET_ITEM_SQL, conversation_id, owner, item_id)
        return None if body is None else orjson.loads(body)

    async def delete_conversation_item(self, conversation_id: str, owner: str, item_id: str) -> bool:
        """Remove the item (every copy of this id); False when there was none to remove."""
        return _count(await self._retry.run(self._pool.execute, _DELETE_ITEM_SQL, conversation_id, owner, item_id)) > 0
