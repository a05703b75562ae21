"""``ConversationStore`` for SQLiteStore: a mixin over the store's connection and thread.

A conversation is a row of ``conversations`` plus its items in
``conversation_items``, ordered by position. Appending takes its positions
from the conversation's ``next_position`` counter, bumped by the same UPDATE
that checks the owner, so positions only grow (a deleted item leaves a gap)
and appends never collide. Items go with their conversation by ON DELETE
CASCADE. Another owner's conversation is "not found" everywhere.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from router.state.common import check_page, decode_bodies, encode_items, sqlite_page
from router.state.store import Conversation, Item, ItemPage, Order

T = TypeVar("T")

_CONVERSATION = "SELECT id, owner, created_at, metadata FROM conversations WHERE id = ? AND owner = ?"

_LOAD_SQL = """
SELECT ci.body, c.next_position FROM conversations c LEFT JOIN conversation_items ci ON ci.conversation_id = c.id
WHERE c.id = ? AND c.owner = ?
ORDER BY ci.position
"""

_INSERT_ITEMS = "INSERT INTO conversation_items (conversation_id, position, item_id, body) VALUES (?, ?, ?, ?)"


def _conversation(row: tuple[Any, ...] | None) -> Conversation | None:
    if row is None:
        return None
    cid, owner, created_at, metadata = row
    return Conversation(id=cid, owner=owner, created_at=created_at, metadata=orjson.loads(metadata))


class SQLiteConversations:
    """Mixin of SQLiteStore (which provides ``_run``, ``_write``)."""

    if TYPE_CHECKING:

        async def _run(self, fn: Callable[..., T], *args: Any) -> T: ...

        @staticmethod
        def _write(conn: sqlite3.Connection, statements: Callable[[], T]) -> T: ...

    async def create_conversation(self, conversation: Conversation, items: list[Item]) -> None:
        """Insert the conversation and its items in one transaction.

        Raises ValueError when the id is already taken (by any owner); nothing is written then.
        """
        c = conversation
        metadata = orjson.dumps(c.metadata)
        rows = [(c.id, position, iid, body) for position, (iid, body) in enumerate(encode_items(items))]

        def run(conn: sqlite3.Connection) -> None:
            def statements() -> None:
                cur = conn.execute(
                    "INSERT INTO conversations (id, owner, created_at, metadata, next_position) VALUES (?, ?, ?, ?, ?)"
                    " ON CONFLICT(id) DO NOTHING",
                    (c.id, c.owner, c.created_at, metadata, len(rows)),
                )
                if cur.rowcount != 1:
                    raise ValueError(f"conversation {c.id!r} already exists")
                conn.executemany(_INSERT_ITEMS, rows)

            self._write(conn, statements)

        await self._run(run)

    async def get_conversation(self, conversation_id: str, owner: str) -> Conversation | None:
        row = await self._run(lambda conn: conn.execute(_CONVERSATION, (conversation_id, owner)).fetchone())
        return _conversation(row)

    async def update_conversation(
        self, conversation_id: str, owner: str, metadata: dict[str, str]
    ) -> Conversation | None:
        """Replace the metadata; None when unknown."""
        sql = "UPDATE conversations SET metadata = ? WHERE id = ? AND owner = ? RETURNING id, owner, created_at, metadata"
        params = (orjson.dumps(metadata), conversation_id, owner)
        # fetchall: a RETURNING statement must run to its end before the COMMIT.
        rows = await self._run(lambda conn: self._write(conn, lambda: conn.execute(sql, params).fetchall()))
        return _conversation(rows[0] if rows else None)

    async def delete_conversation(self, conversation_id: str, owner: str) -> bool:
        """Items go by ON DELETE CASCADE; responses that used the conversation stay."""
        sql = "DELETE FROM conversations WHERE id = ? AND owner = ?"
        params = (conversation_id, owner)
        n = await self._run(lambda conn: self._write(conn, lambda: conn.execute(sql, params).rowcount))
        return n == 1

    async def add_conversation_items(self, conversation_id: str, owner: str, items: list[Item]) -> int | None:
        """Append after the last item, in one transaction: the first one's position, None when unknown."""
        encoded = encode_items(items)

        def run(conn: sqlite3.Connection) -> int | None:
            def statements() -> int | None:
                row = conn.execute(
                    "UPDATE conversations SET next_position = next_position + ? WHERE id = ? AND owner = ?"
                    " RETURNING next_position",
                    (len(encoded), conversation_id, owner),
                ).fetchall()
                if not row:
                    return None
                start: int = row[0][0] - len(encoded)
                conn.executemany(
                    _INSERT_ITEMS, [(conversation_id, start + k, iid, body) for k, (iid, body) in enumerate(encoded)]
                )
                return start

            return self._write(conn, statements)

        return await self._run(run)

    async def load_conversation(self, conversation_id: str, owner: str) -> list[Item] | None:
        """Every item, oldest first, in one query; None when unknown."""
        loaded = await self.load_conversation_with_end(conversation_id, owner)
        return None if loaded is None else loaded[0]

    async def load_conversation_with_end(self, conversation_id: str, owner: str) -> tuple[list[Item], int] | None:
        rows = await self._run(lambda conn: conn.execute(_LOAD_SQL, (conversation_id, owner)).fetchall())
        if not rows:
            return None  # the LEFT JOIN yields >= 1 row when the conversation is there
        return decode_bodies(rows), rows[0][1]

    async def list_conversation_items(
        self, conversation_id: str, owner: str, *, after: str | None = None, limit: int = 20, order: Order = "desc"
    ) -> ItemPage | None:
        """A page in ``order``, strictly after item ``after``: KeyError(after) for an id that is
        not in the conversation, ValueError for a bad limit/order, None when unknown."""
        check_page(limit, order)
        return await self._run(self._list_conversation_sync, conversation_id, owner, after, limit, order)

    @staticmethod
    def _list_conversation_sync(
        conn: sqlite3.Connection, conversation_id: str, owner: str, after: str | None, limit: int, order: Order
    ) -> ItemPage | None:
        conn.execute("BEGIN")  # one snapshot for the checks and the page
        try:
            if conn.execute("SELECT 1 FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner)).fetchone() is None:
                return None
            return sqlite_page(conn, "conversation_items", "conversation_id = ?", (conversation_id,),
                               after=after, limit=limit, order=order)
        finally:
            conn.execute("COMMIT")

    async def get_conversation_item(self, conversation_id: str, owner: str, item_id: str) -> Item | None:
        """The item with this id (the last one, should the id be there twice); None when unknown."""
        sql = """SELECT ci.body FROM conversation_items ci JOIN conversations c ON c.id = ci.conversation_id
            WHERE c.id = ? AND c.owner = ? AND ci.item_id = ? ORDER BY ci.position DESC LIMIT 1"""
        params = (conversation_id, owner, item_id)
        row = await self._run(lambda conn: conn.execute(sql, params).fetchone())
        return None if row is None else orjson.loads(row[0])

    async def delete_conversation_item(self, conversation_id: str, owner: str, item_id: str) -> bool:
        """Remove the item (every copy of this id); False when there was none to remove."""
        sql = """DELETE FROM conversation_items WHERE conversation_id = ? AND item_id = ?
            AND EXISTS (SELECT 1 FROM conversations WHERE id = ? AND owner = ?)"""
        params = (conversation_id, item_id, conversation_id, owner)
        n = await self._run(lambda conn: self._write(conn, lambda: conn.execute(sql, params).rowcount))
        return n > 0
